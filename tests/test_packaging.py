"""What PyPI shows: a description without repository-relative links, and the
licence metadata; what the wheel and sdist hold (the `py.typed` marker).
(`twine check --strict` runs in `make test` after the suite, once: it does
not depend on the backend.) File checks, so they run, and mean the same, on
every backend."""

import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _field(name):
    match = re.search(rf'^{name} = "([^"]+)"', PYPROJECT, re.M)
    assert match, f"pyproject.toml has no {name} string"
    return match.group(1)


def test_the_pypi_description_has_only_absolute_links():
    text = (ROOT / _field("readme")).read_text()
    targets = re.findall(r"\]\(([^)]*)\)", text) + re.findall(r'(?:src|href)="([^"]*)"', text)
    relative = [t for t in targets if not re.match(r"^(https?://|mailto:|#)", t)]
    assert not relative, f"links that break off the repository: {relative}"
    assert "keras-penalties" in text and len(text) > 500


def test_licence_metadata():
    assert _field("license") == "Apache-2.0"  # an SPDX expression
    assert 'license-files = ["LICENSE"]' in PYPROJECT
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence
    assert "License ::" not in PYPROJECT  # a licence classifier beside an SPDX expression is an error
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_the_wheel_and_sdist_ship_the_py_typed_marker(tmp_path):
    # PEP 561: without the marker, type checkers and IDEs ignore the
    # package's annotations. Built as `make test` builds it (1.5 s).
    assert (ROOT / "keras_penalties" / "py.typed").is_file()
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    (sdist,) = tmp_path.glob("*.tar.gz")
    assert "keras_penalties/py.typed" in zipfile.ZipFile(wheel).namelist()
    with tarfile.open(sdist) as archive:
        assert any(name.endswith("/keras_penalties/py.typed") for name in archive.getnames())
