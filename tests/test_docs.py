"""The documentation site's pages (docs/): every Python example on them runs
as written on the current backend, and every public name has its place in
the API reference. (`mkdocs build --strict` in `make test` checks the links,
anchors and docstrings; the README's examples are tests/test_readme.py's.)"""

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCKS = [
    (page.relative_to(DOCS).as_posix(), index, block)
    for page in sorted(DOCS.rglob("*.md"))
    for index, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M))
]

# The modules whose public names the API reference documents.
MODULES = (
    "keras_penalties",
    "keras_penalties.ops",
    "keras_penalties.regularizers",
    "keras_penalties.losses",
    "keras_penalties.callbacks",
    "keras_penalties.gradients",
    "keras_penalties.optimizers",
    "keras_penalties.distillation",
    "keras_penalties.post_training",
)


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{page}-{index}" for page, index, _ in BLOCKS])
def test_docs_block_runs(page, index, block):
    if "import keras_hub" in block:
        pytest.importorskip("keras_hub", reason="keras-hub is an optional extra (Python 3.11+)")
    exec(compile(block, f"docs/{page} block {index}", "exec"), {})


def test_docs_have_examples():
    assert len({page for page, _, _ in BLOCKS}) >= 8


def _public(module):
    """A module's public objects: its `__all__`, else what it defines without a leading underscore."""
    if hasattr(module, "__all__"):
        names = module.__all__
    else:
        names = [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_") and getattr(obj, "__module__", None) == module.__name__
        ]
    return {name: getattr(module, name) for name in names if not isinstance(getattr(module, name), str)}


def _resolve(path):
    """The object a `::: path` directive names (a module, or attributes of the longest importable prefix)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise AssertionError(f"`::: {path}` names nothing importable")


def _documented():
    """Every object the API pages render: what each `::: path` names and, unless
    its options say `members: false`, the public members of a module it names."""
    found = []
    for page in sorted((DOCS / "api").glob("*.md")):
        for path, options in re.findall(r"^::: ([\w.]+)\n((?:[ \t]+.*\n)*)", page.read_text(), flags=re.M):
            obj = _resolve(path)
            found.append(obj)
            if inspect.ismodule(obj) and not re.search(r"^\s*members:\s*false", options, flags=re.M):
                found.extend(_public(obj).values())
    return found


def test_every_public_name_is_in_the_api_reference():
    documented = _documented()
    missing = [
        f"{name}.{member}"
        for name in MODULES
        for member, obj in _public(importlib.import_module(name)).items()
        if not any(obj is d for d in documented)
    ]
    assert not missing, f"public names with no `::: ...` in docs/api/*.md: {missing}"


def test_the_readme_stays_a_landing_page():
    # What it is, the two commands, the quick start, the comparison, install,
    # and links into the site; the manual itself is docs/.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme
    linked = set(re.findall(r"\]\((docs/[\w/]+\.md)", readme))
    assert {"docs/getting_started.md", "docs/api/index.md", "docs/development.md"} <= linked
    assert all((ROOT / page).is_file() for page in linked), linked
