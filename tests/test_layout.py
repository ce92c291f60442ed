"""The package's rooms (README, Development): private Keras and TF APIs only
in `_keras_internals.py`; backend-specific code only in `backend/`, whose
backend packages hold a module for each concern of its contract, define
each contract name in its concern's module, do not import each other, and
keep their functions short. Pure source checks (the files' syntax trees),
so they run, and mean the same, on every backend."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_penalties"
SOURCES = sorted(PACKAGE.rglob("*.py"))
INTERNALS = PACKAGE / "_keras_internals.py"

PRIVATE_MODULES = ("keras.src", "tensorflow.python")
# Private attributes of Keras objects the package has needed (each now a
# function in _keras_internals.py), and CPython's frame access.
PRIVATE_ATTRIBUTES = {
    "_metrics",
    "_compile_loss",
    "_layers",
    "_get_own_losses",
    "_variables",
    "_trainable_variables",
    "_track_variable",
    "_keras_history",
    "_inbound_nodes",
    "_getframe",
    "_var_key",
    "_exclude_from_weight_decay",
    "_exclude_from_weight_decay_cache",
    "_flatten_layers",
}


def _private_uses(path):
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(PRIVATE_MODULES)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_checker_finds_private_uses():
    # The internals module itself is full of them: the check can fail.
    uses = _private_uses(INTERNALS)
    assert any(u.startswith("keras.src") for u in uses) and any("._getframe" in u for u in uses), uses


@pytest.mark.parametrize("path", [p for p in SOURCES if p != INTERNALS], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_private_keras_apis_only_in_keras_internals(path):
    assert _private_uses(path) == [], f"{path.name}: move these behind a function in _keras_internals.py"


BACKENDS = ("jax", "tensorflow", "torch")
BACKEND_DIR = PACKAGE / "backend"


def _contract():
    """backend/__init__.py's `CONTRACT`: {concern: names}, read from its source."""
    for node in ast.parse((BACKEND_DIR / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CONTRACT" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("backend/__init__.py defines no CONTRACT")


def _bound_names(source):
    """The names a module's top level binds: defined, assigned or imported."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_the_name_finder_sees_definitions_assignments_and_imports():
    source = "import a.b\nfrom c import d as e\nF = 1\nG: int = 2\ndef h(): i = 3\nclass J: pass\n"
    assert _bound_names(source) == {"a", "e", "F", "G", "h", "J"}


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_has_every_concerns_module(name):
    modules = {p.stem for p in (BACKEND_DIR / name).glob("*.py")}
    assert set(_contract()) - modules == set(), f"backend/{name}/ lacks these concerns' modules"


@pytest.mark.parametrize("name", BACKENDS)
def test_contract_names_are_defined_in_their_concerns_module(name):
    # A backend-only module (blocks.py, tracing.py) defines none.
    contract = _contract()
    everyone = {n for names in contract.values() for n in names}
    for path in sorted((BACKEND_DIR / name).glob("*.py")):
        stray = _bound_names(path.read_text()) & (everyone - set(contract.get(path.stem, ())))
        assert not stray, f"backend/{name}/{path.name} defines {sorted(stray)}, which belong to other concerns"


def test_common_defaults_only_contract_names_and_shared_helpers():
    # What a backend module imports from common: the defaults and three helpers.
    everyone = {n for names in _contract().values() for n in names}
    public = {n for n in _bound_names((BACKEND_DIR / "common.py").read_text()) if not n.startswith("_")}
    assert public - everyone == {
        "flag_set",
        "norm",
        "TINY",
        "concurrent",
        "contextlib",
        "threading",
        "keras",
        "np",
        "ops",
    }


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_packages_do_not_import_each_other(name):
    others = set(BACKENDS) - {name}
    for path in sorted((BACKEND_DIR / name).glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {
            node.module.split(".")[2]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras_penalties.backend.")
        }
        imported |= {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "keras_penalties.backend"
            for alias in node.names
        }
        assert not imported & others, f"backend/{name}/{path.name} imports {imported & others}"


def test_no_backend_function_passes_80_lines():
    long = [
        f"{path.relative_to(BACKEND_DIR)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(BACKEND_DIR.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, long


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports(path):
    """The package modules `path` imports (at any depth, outside `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    modules = {_module_name(p) for p in SOURCES}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_penalties"):
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
            if node.module in modules:
                found.add(node.module)
    return found - {_module_name(path)}


def _circle(graph):
    """An import circle of `graph` (module -> modules it imports), or None."""
    done, active = set(), []

    def visit(module):
        if module in active:
            return active[active.index(module) :] + [module]
        if module in done:
            return None
        active.append(module)
        for dependency in sorted(graph.get(module, ())):
            found = visit(dependency)
            if found:
                return found
        active.pop()
        done.add(module)
        return None

    return next((c for c in (visit(m) for m in sorted(graph)) if c), None)


def test_the_circle_finder_finds_circles():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_imports_form_no_circle():
    # A package's __init__ importing its own modules is how it exposes them;
    # the circles that matter are between modules.
    graph = {_module_name(p): _package_imports(p) for p in SOURCES}
    graph = {
        module: {d for d in deps if not module.startswith(d + ".") and not d.startswith(module + ".")}
        for module, deps in graph.items()
    }
    assert "keras_penalties.gradients" in graph["keras_penalties.composite.layer"]  # the reader sees imports
    assert _circle(graph) is None, " -> ".join(_circle(graph))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= 500, f"{path.name}: split it (one job per module)"


def test_ops_exports_only_what_it_defines():
    # Not typing's `get_args` or a type alias: its own functions, classes and submodules.
    import types

    from keras_penalties import ops

    public = {name for name in vars(ops) if not name.startswith("_")}
    own = {
        name
        for name in public
        if isinstance(getattr(ops, name), types.ModuleType) and getattr(ops, name).__name__.startswith(ops.__name__)
    }
    assert public - own - {"PENALTIES", "TENSOR_OPS"} == set(ops.__all__)


def test_what_a_weighting_rule_knows_stays_in_its_module():
    # The rules' options and variables (FAMO's `famo_*`, 0.1.0's flat
    # `weighting_*` options) are named in composite/weighting.py alone: the
    # composites only ask the rule.
    rules = PACKAGE / "composite" / "weighting.py"
    assert re.search(r"\bfamo_\w+", rules.read_text())  # the check can fail
    leaks = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in SOURCES
        if path != rules
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b(famo|weighting)_\w+", line)
    ]
    assert not leaks, leaks
