"""Every guide runs top to bottom on the current backend, at a small size."""

import pathlib
import runpy

import pytest

GUIDES = sorted((pathlib.Path(__file__).parent.parent / "guides").glob("*.py"))


@pytest.mark.parametrize("path", GUIDES, ids=[p.name for p in GUIDES])
def test_guide_runs(path, monkeypatch, capsys):
    monkeypatch.setenv("GUIDE_ROUNDS", "2")
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()
