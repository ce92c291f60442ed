"""Every script in examples/ runs top to bottom on the current backend."""

import math
import pathlib
import runpy

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path, capsys, monkeypatch, tmp_path):
    # Small sizes, and any file an example writes lands in a temporary folder.
    monkeypatch.setenv("EXAMPLE_EPOCHS", "1")
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()


def test_print_penalties_prints_every_penalty_finite(capsys):
    runpy.run_path(str(EXAMPLES[0].parent / "print_penalties.py"), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    names = {line.split("(")[0].strip() for line in lines}
    from keras_penalties import ops

    assert names == set(ops.PENALTIES)
    assert any("linear(" in line for line in lines)
    assert all(math.isfinite(float(line.split()[-1])) for line in lines)
