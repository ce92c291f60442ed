"""Argument checks for the whole package. Each check is `(name, value) -> value`:
it validates (and normalises) a Python option before any tensor work, so a
wrong option fails with a message naming it, not deep inside a trace. Ops
functions declare theirs with `@options(...)`; the Keras classes reuse them
through `fn.check_options(...)`."""

import functools
import inspect
import math
from typing import Any, Callable, ParamSpec, Protocol, TypeVar, cast, get_args

import keras
import numpy as np

from keras_penalties._types import MagnitudeReduction, PolicyReduction, Reduction, TokenReduction

_P = ParamSpec("_P")
_R = TypeVar("_R")
_R_co = TypeVar("_R_co", covariant=True)


class OptionsChecked(Protocol[_P, _R_co]):
    """What `options` makes of a function: the function, with its own
    signature for type checkers and IDEs, plus `check_options`."""

    tensor_options: tuple[str, ...]
    per_element: bool
    prediction_first: bool

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...

    def check_options(self, **options: Any) -> dict[str, Any]: ...


def options(
    *,
    tensors: tuple[str, ...] = (),
    per_element: bool = False,
    prediction_first: bool = False,
    together: Callable[[dict[str, Any]], None] | None = None,
    **checks: Callable[[str, Any], Any],
) -> Callable[[Callable[_P, _R]], OptionsChecked[_P, _R]]:
    """Decorator: validates (and normalises) keyword options before the call.

    `checks` maps an option name to a function `(name, value) -> value` that
    raises `ValueError`/`TypeError` naming the option. The decorated function
    gets `check_options(**options) -> dict`, which validates options without
    calling it and rejects names the function does not take, and
    `tensor_options`: `tensors`, the options that take tensors (a mask,
    weights, another log-probability), which a `Term` feeds from its inputs.
    What a composite needs to know of the op rides on it too:
    `per_element` (a penalty on magnitudes: `reduction="none"` gives a value
    per element, and a term defaults to the mean over the batch, Keras'
    activity-regularizer scale) and `prediction_first` (its first tensor is
    the model's prediction: a `CompositeLoss` feeds it `(y_pred, y_true)`).
    `together(options)` checks options against each other (a ValueError
    naming them), after each alone. `check_options(complete=True, ...)`
    (what a `Term` calls) also rejects a missing required option, as the
    call would, but as a ValueError naming it, before any tensor work.
    """

    def decorate(fn: Callable[_P, _R]) -> OptionsChecked[_P, _R]:
        keyword_only = [
            p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        accepted = [p.name for p in keyword_only]
        required = [p.name for p in keyword_only if p.default is inspect.Parameter.empty]

        def check_options(complete: bool = False, **opts: Any) -> dict[str, Any]:
            unknown = sorted(set(opts) - set(accepted))
            if unknown:
                raise TypeError(f"{fn.__name__}() got unknown option(s) {unknown}; it takes {accepted}.")
            missing = [name for name in required if name not in opts] if complete else []
            if missing:
                raise ValueError(f"{fn.__name__}() needs the option(s) {missing}; got {sorted(opts)}.")
            checked = {k: checks[k](k, v) if k in checks else v for k, v in opts.items()}
            if together is not None:
                together(checked)
            return checked

        call: Callable[..., _R] = fn  # called with the checked options

        @functools.wraps(fn)
        def wrapper(*args: Any, **opts: Any) -> _R:
            return call(*args, **check_options(**opts))

        wrapper.check_options = check_options  # type: ignore[attr-defined]
        wrapper.tensor_options = tuple(tensors)  # type: ignore[attr-defined]
        wrapper.per_element = per_element  # type: ignore[attr-defined]
        wrapper.prediction_first = prediction_first  # type: ignore[attr-defined]
        return cast("OptionsChecked[_P, _R]", wrapper)

    return decorate


def choice(*allowed):
    def check(name, value):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.")
        return value

    return check


def number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"`{name}` must be a number; got {value!r}.")
    try:
        value = float(value)
    except OverflowError:
        # An int beyond float range (10**400): too large to be a float.
        raise ValueError(f"`{name}` must be finite; got an int too large for a float.") from None
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite; got {value!r}.")
    return value


def _number_where(holds, what):
    """A check of a real number for which `holds(value)`, said as `what`."""

    def check(name, value):
        value = number(name, value)
        if not holds(value):
            raise ValueError(f"`{name}` must be {what}; got {value!r}.")
        return value

    return check


positive = _number_where(lambda v: v > 0, "> 0")
non_negative = _number_where(lambda v: v >= 0, ">= 0")
closed_unit = _number_where(lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
open_unit = _number_where(lambda v: 0.0 < v < 1.0, "in the open interval (0, 1)")
half_open_unit = _number_where(lambda v: 0.0 < v <= 1.0, "in (0, 1]")
above_one = _number_where(lambda v: v > 1.0, "> 1")
below_half = _number_where(lambda v: 0.0 <= v < 0.5, "in [0, 0.5)")


def boolean(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool; got {value!r}.")
    return bool(value)


def integer(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int; got {value!r}.")
    return int(value)


def positive_integer(name, value):
    value = integer(name, value)
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1; got {value!r}.")
    return value


def chunk_size(name, value):
    """None, "auto", or an int >= 1 (rows per chunk)."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        raise ValueError(f"`{name}` must be None, 'auto' or an int >= 1; got {value!r}.")
    return positive_integer(name, value)


def optional(check):
    def check_optional(name, value):
        return None if value is None else check(name, value)

    return check_optional


REDUCTIONS = get_args(Reduction)
# The magnitude penalties (l1, l2, elastic_net) also take Keras' activity-
# regularizer scale: the sum over all elements divided by the batch size.
MAGNITUDE_REDUCTIONS = get_args(MagnitudeReduction)
REDUCTION = choice(*REDUCTIONS)
TOKEN_REDUCTION = choice(*get_args(TokenReduction))
POLICY_REDUCTION = choice(*get_args(PolicyReduction))
SEQUENCE_REDUCTIONS = ("sequence_mean", "sequence_sum")


def check_sequence_rank(reduction, rank, what="the per-token values"):
    """A sequence reduction (and the constant normaliser) needs [batch, tokens] values."""
    if reduction in (*SEQUENCE_REDUCTIONS, "constant") and rank != 2:
        how = "divides by sequences × max_length" if reduction == "constant" else "averages over sequences"
        raise ValueError(f"`reduction={reduction!r}` {how}: {what} must be [batch, tokens] (rank 2); got rank {rank}.")


MAGNITUDE_REDUCTION = choice(*MAGNITUDE_REDUCTIONS)


def check_axis(name, axis, ndim):
    """Returns `axis` as a non-negative int for a tensor of rank `ndim`."""
    axis = integer(name, axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"`{name}`={axis} is out of range for an input of rank {ndim}.")
    return int(axis) % ndim


def check_same_shape(names, a, b):
    """Raises if two tensors' static shapes differ where both are known."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    compatible = len(sa) == len(sb) and all(x is None or y is None or x == y for x, y in zip(sa, sb))
    if not compatible:
        raise ValueError(f"`{names[0]}` and `{names[1]}` must have the same shape; got {sa} and {sb}.")


def check_rank(name, x, minimum, what):
    """Raises unless `x` has rank >= `minimum`; `what` says why it is needed."""
    if len(x.shape) < minimum:
        raise ValueError(f"`{name}` must have rank >= {minimum} ({what}); got shape {tuple(x.shape)}.")


def optimizer(name, value):
    """An optimizer instance, or a Keras identifier of one (`"adam"`, a
    config dict) resolved as `compile` resolves it; a class, or anything
    else, is refused naming `name`."""
    if isinstance(value, type):
        raise TypeError(f"`{name}` must be an optimizer instance; got the class {value.__name__}.")
    if isinstance(value, (str, dict)):
        try:
            return keras.optimizers.get(value)
        except ValueError as error:
            raise ValueError(f"`{name}`: {error}") from None
    if not isinstance(value, keras.optimizers.Optimizer):
        raise TypeError(
            f"`{name}` must be a keras.optimizers.Optimizer instance (or a name such as 'adam'); got {value!r}."
        )
    return value
