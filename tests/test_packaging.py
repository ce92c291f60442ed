"""What PyPI shows: a description without repository-relative links, and the
licence metadata. (The build and `twine check --strict` run in `make test`
after the suite, once: they do not depend on the backend.) Pure file checks,
so they run, and mean the same, on every backend."""

import pathlib
import re

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
