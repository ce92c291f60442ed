"""Every public signature is annotated (issue 26), so an IDE shows each
option's type and a `Literal`'s values. mypy (`make test`) checks what is
annotated; it requires annotations only in the modules that are public
throughout, so this checks the public names of the others. Signatures only,
so it runs, and means the same, on every backend."""

import inspect

import pytest

from keras_penalties import callbacks, distillation, gradients, losses, ops, optimizers, regularizers
from keras_penalties.losses import CompositeLoss
from keras_penalties.objective import CompositeObjective
from keras_penalties.terms import Term

PUBLIC = (
    [getattr(ops, name) for name in ops.__all__]
    + [getattr(regularizers, name) for name in regularizers.__all__]
    + [getattr(losses, name) for name in losses.__all__]
    + [getattr(optimizers, name) for name in optimizers.__all__]
    + [callbacks.PenaltyMonitor, callbacks.DynamicWeightAverage, callbacks.GradNorm]
    + [gradients.input_gradient, gradients.gradient_penalty, gradients.interpolated_gradient_penalty]
    + [gradients.gradient_norms, gradients.parameter_probe]
    + [distillation.LogitsDivergence, distillation.Distiller, Term, CompositeObjective, CompositeLoss]
)


def _functions(obj):
    """`obj`, or a class's constructor and public methods (its own and those
    it inherits from this package), as (name, function)."""
    if not inspect.isclass(obj):
        return [(obj.__name__, obj)]
    found = {}
    for cls in reversed(obj.__mro__):
        if not cls.__module__.startswith("keras_penalties"):
            continue
        for name, attr in vars(cls).items():
            if name.startswith("_") and name not in ("__init__", "__call__"):
                continue
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if inspect.isfunction(attr):
                found[name] = attr
    return [(f"{obj.__name__}.{name}", fn) for name, fn in sorted(found.items())]


def _missing(fn):
    signature = inspect.signature(fn)
    missing = [
        p.name
        for i, p in enumerate(signature.parameters.values())
        if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))
    ]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_public_signatures_are_annotated(obj):
    functions = _functions(obj)
    assert functions
    missing = {name: m for name, fn in functions if (m := _missing(fn))}
    assert not missing, f"unannotated parameters or returns: {missing}"


def test_the_check_finds_a_missing_annotation():
    def partly(x: int, y):
        return x

    assert _missing(partly) == ["y", "return"]


def test_ops_keep_their_signature_and_check_options():
    # `options` wraps each ops function; IDEs and inspect see the wrapped
    # signature (functools.wraps), and the checks are still reachable.
    parameters = inspect.signature(ops.kl_divergence).parameters
    assert parameters["direction"].annotation.__args__ == ("forward", "reverse", "symmetric")
    assert ops.kl_divergence.check_options(direction="reverse") == {"direction": "reverse"}
