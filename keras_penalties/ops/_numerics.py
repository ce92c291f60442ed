"""Shared numerics and argument checks for every penalty in `keras_penalties.ops`.

Each penalty converts its inputs with `to_compute`, does its math in a dtype
that is stable (float16/bfloat16 are computed in float32), and casts the result
back with `from_compute`. Logs go through `safe_log` or `log_softmax` (the
Jensen-Shannon mixture's through `backend.js_rows`, as log(m + tiny)), norms
through `safe_norm`, so values and gradients stay finite at exact zeros and at
extreme logits.
"""

import contextlib
import contextvars
import functools
import inspect
import math
from typing import Any, Callable, ParamSpec, Protocol, TypeVar, cast

import keras
import numpy as np
from keras import ops

from keras_penalties import backend
from keras_penalties.ops._reductions import at_least_one

REDUCTIONS = ("sum", "mean", "none")
# The magnitude penalties (l1, l2, elastic_net) also take Keras' activity-
# regularizer scale: the sum over all elements divided by the batch size.
MAGNITUDE_REDUCTIONS = REDUCTIONS + ("sum_over_batch_size",)
_HALF_DTYPES = ("float16", "bfloat16")


# ---------------------------------------------------------------- argument checks
# Options are checked on Python values before any tensor work, so a wrong
# option fails with a message naming it, not deep inside a trace. Each ops
# function declares its checks once with `@options(...)`; the Keras classes
# reuse them through `fn.check_options(...)` at construction.

_P = ParamSpec("_P")
_R = TypeVar("_R")
_R_co = TypeVar("_R_co", covariant=True)


class OptionsChecked(Protocol[_P, _R_co]):
    """What `options` makes of a function: the function, with its own
    signature for type checkers and IDEs, plus `check_options`."""

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...

    def check_options(self, **options: Any) -> dict[str, Any]: ...


def options(**checks: Callable[[str, Any], Any]) -> Callable[[Callable[_P, _R]], OptionsChecked[_P, _R]]:
    """Decorator: validates (and normalises) keyword options before the call.

    `checks` maps an option name to a function `(name, value) -> value` that
    raises `ValueError`/`TypeError` naming the option. The decorated function
    gets `check_options(**options) -> dict`, which validates options without
    calling it and rejects names the function does not take.
    """

    def decorate(fn: Callable[_P, _R]) -> OptionsChecked[_P, _R]:
        accepted = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]

        def check_options(**opts: Any) -> dict[str, Any]:
            unknown = sorted(set(opts) - set(accepted))
            if unknown:
                raise TypeError(
                    f"{fn.__name__}() got unknown option(s) {unknown}; it takes "
                    f"{accepted}."
                )
            return {k: checks[k](k, v) if k in checks else v for k, v in opts.items()}

        call: Callable[..., _R] = fn  # called with the checked options

        @functools.wraps(fn)
        def wrapper(*args: Any, **opts: Any) -> _R:
            return call(*args, **check_options(**opts))

        wrapper.check_options = check_options  # type: ignore[attr-defined]
        return cast("OptionsChecked[_P, _R]", wrapper)

    return decorate


def choice(*allowed):
    def check(name, value):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(
                f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; "
                f"got {value!r}."
            )
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


def positive(name, value):
    value = number(name, value)
    if value <= 0:
        raise ValueError(f"`{name}` must be > 0; got {value!r}.")
    return value


def non_negative(name, value):
    value = number(name, value)
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0; got {value!r}.")
    return value


def closed_unit(name, value):
    value = number(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be in [0, 1]; got {value!r}.")
    return value


def open_unit(name, value):
    value = number(name, value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"`{name}` must be in the open interval (0, 1); got {value!r}.")
    return value


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


def chunk_rows(chunk_size, classes, n, heads=False):
    """Rows per chunk: `chunk_size`, or for "auto" the backend's measured
    elements per chunk (`backend.CHUNK_ELEMENTS`, or `HEAD_CHUNK_ELEMENTS`
    for logits formed from hidden states) over the number of `classes`, at
    least 1. When the `n` rows are known: at most n, and the largest
    divisor of n down to half that many rows if there is one, so that no
    padded copy of the inputs is made (8192 rows of 32000 classes on a
    4 M budget: 128 rows, not 131); where the rows are split over devices
    (`backend.row_shards`), of each device's rows, so that every device
    runs whole chunks of its own. Classes known only at run time count as
    32768."""
    if chunk_size != "auto":
        return chunk_size
    budget = backend.HEAD_CHUNK_ELEMENTS if heads else backend.CHUNK_ELEMENTS
    rows = max(1, budget // (classes if isinstance(classes, int) else 32768))
    if not isinstance(n, int):
        return rows
    shards = backend.row_shards()
    if shards > 1 and n % shards == 0:
        n //= shards
    if n <= rows:
        return max(n, 1)
    return next((d for d in range(rows, (rows - 1) // 2, -1) if n % d == 0), rows)


def optional(check):
    def check_optional(name, value):
        return None if value is None else check(name, value)

    return check_optional


REDUCTION = choice(*REDUCTIONS)
MAGNITUDE_REDUCTION = choice(*MAGNITUDE_REDUCTIONS)


def check_axis(name, axis, ndim):
    """Returns `axis` as a non-negative int for a tensor of rank `ndim`."""
    axis = integer(name, axis)
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"`{name}`={axis} is out of range for an input of rank {ndim}."
        )
    return int(axis) % ndim


def check_same_shape(names, a, b):
    """Raises if two tensors' static shapes differ where both are known."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    compatible = len(sa) == len(sb) and all(
        x is None or y is None or x == y for x, y in zip(sa, sb)
    )
    if not compatible:
        raise ValueError(
            f"`{names[0]}` and `{names[1]}` must have the same shape; "
            f"got {sa} and {sb}."
        )


# ---------------------------------------------------------------- dtypes


def to_compute(*tensors):
    """Converts inputs to tensors in one stable compute dtype.

    Returns `(tensors_in_compute_dtype, output_dtype)`. Half-precision inputs
    are computed in float32 and the result is cast back to their dtype;
    integer inputs are computed and returned in `keras.config.floatx()`.
    """
    tensors, compute, dtype = dtypes(*tensors)
    return [cast_to(t, compute) for t in tensors], dtype


def dtypes(*tensors):
    """`(tensors, compute_dtype, output_dtype)` without casting yet, for
    callers that cast piece by piece (`per_sample` with chunks)."""
    tensors = [backend.as_tensor(t) for t in tensors]
    return (tensors, *dtype_pair(tensors))


# Skipping the conversions that change nothing (`backend.as_tensor`, and
# `cast_to` below): on eager torch each Keras `convert_to_tensor` or `cast`
# call costs microseconds of Python whatever it does, and a fit step of the
# bench's MLP made 15 such casts and 10 such conversions of the package's
# own (bench/results/README.md, issue 25).


def cast_to(x, dtype):
    """`ops.cast(x, dtype)`, or `x` itself where it has that dtype already;
    for tensors already converted (Keras' cast would also move a torch
    tensor to Keras' device)."""
    return x if keras.backend.standardize_dtype(x.dtype) == dtype else ops.cast(x, dtype)


def dtype_pair(tensors):
    """`(compute_dtype, output_dtype)` of tensors: half precision computes in
    float32; the output is their common float dtype (floatx for integers)."""
    dtype = _common_float_dtype([keras.backend.standardize_dtype(t.dtype) for t in tensors])
    return "float32" if dtype in _HALF_DTYPES else dtype, dtype


def _common_float_dtype(dtypes):
    # Not keras.backend.result_type: on some backends it resolves float64 to
    # floatx, and a float64 input must keep float64.
    floats = sorted(set(d for d in dtypes if "float" in d))
    if not floats:
        return keras.config.floatx()
    if len(floats) == 1:
        return floats[0]
    widest = max(floats, key=lambda d: np.dtype(d if d != "bfloat16" else "float16").itemsize)
    return "float32" if widest in _HALF_DTYPES else widest


def from_compute(x, dtype):
    return cast_to(x, dtype)


def is_half(dtype):
    """Whether `dtype` is float16 or bfloat16 (computed in float32 here)."""
    return keras.backend.standardize_dtype(dtype) in _HALF_DTYPES


# ---------------------------------------------------------------- safe math


# Why a divergence, an entropy or a cross-entropy needs rank >= 1.
DISTRIBUTION_AXIS = "a distribution axis"


def check_rank(name, x, minimum, what):
    """Raises unless `x` has rank >= `minimum`; `what` says why it is needed."""
    if len(x.shape) < minimum:
        raise ValueError(f"`{name}` must have rank >= {minimum} ({what}); got shape {tuple(x.shape)}.")


def safe_log(x):
    """log(x) floored at the dtype's smallest normal number.

    The floor makes log(0) finite (about -87 in float32) and its gradient zero,
    so 0 * log(0) is 0 in the value and NaN-free in the gradient.
    """
    tiny = backend.smallest_normal(x.dtype)
    return ops.log(ops.where(x > tiny, x, tiny))


def safe_norm(x, axis=None, keepdims=False):
    """Euclidean norm with a zero (not NaN) gradient where the norm is zero."""
    sq = ops.sum(ops.square(x), axis=axis, keepdims=keepdims)
    positive = sq > 0
    root = ops.sqrt(ops.where(positive, sq, ops.ones_like(sq)))
    return ops.where(positive, root, ops.zeros_like(sq))


def log_probs(x, *, from_logits, temperature, axis):
    """Log-probabilities along `axis` of logits or probabilities.

    Logits are divided by `temperature` and log-softmaxed. Probabilities are
    used as given at temperature 1; otherwise p^(1/T) is renormalised, which
    is log_softmax(log(p) / T).
    """
    if from_logits:
        return _shared(x, ("log", temperature, axis), lambda: ops.log_softmax(_scaled(x, temperature), axis=axis))
    logp = safe_log(x)
    if temperature != 1.0:
        logp = ops.log_softmax(logp / temperature, axis=axis)
    return logp


def probs_and_log_probs(x, *, from_logits, temperature, axis):
    """`(p, log p)` along `axis`; given probabilities at T=1 are kept exactly."""
    if from_logits:
        def pair():
            logp = _shared_value(x, ("log", temperature, axis))
            p, logp = backend.softmax_pair(_scaled(x, temperature), axis, logp)
            _share(x, ("log", temperature, axis), logp)
            return p, logp

        return _shared(x, ("pair", temperature, axis), pair)
    logp = log_probs(x, from_logits=False, temperature=temperature, axis=axis)
    if temperature == 1.0:
        return x, logp
    return ops.exp(logp), logp


def _scaled(logits, temperature):
    return logits / temperature if temperature != 1.0 else logits


# Inside `sharing(tensors)`, the (log-)softmax of each of those tensors is
# formed once per temperature and axis, however many terms ask for it: an
# objective's entropy bonus and KL on the same logits share one
# log-softmax, as hand-written code would. Where the backend says so
# (`backend.SHARES_SOFTMAX`: on eager torch each is a pass over the logits
# and a node of the backward pass; XLA and TF's graph optimizer merge
# them anyway, and a TF GradientTape inside a term would not see a softmax
# formed before it). Only the tensors named are shared, never a chunk of
# them: a chunk loop keeps one chunk's temporaries alive at a time. A
# context variable, so that each thread has its own.
_SHARING = contextvars.ContextVar("keras_penalties_sharing", default=None)


@contextlib.contextmanager
def sharing(tensors):
    """Within: the log-probabilities of any of `tensors` are computed once
    (where `backend.SHARES_SOFTMAX`)."""
    if not backend.SHARES_SOFTMAX:
        yield
        return
    # The dict holds the tensors, so their ids stay theirs while it lives.
    token = _SHARING.set(({id(t): t for t in tensors}, {}))
    try:
        yield
    finally:
        _SHARING.reset(token)


def shared(*tensors):
    """Whether any of `tensors` is a (log-)softmax `sharing` holds for
    other terms (so not to be overwritten)."""
    held = _SHARING.get()
    if held is None:
        return False
    values = [v for value in held[1].values() for v in (value if isinstance(value, tuple) else (value,))]
    return any(t is v for t in tensors for v in values)


def _shared(x, key, make):
    held = _SHARING.get()
    if held is None or id(x) not in held[0]:
        return make()
    cache = held[1]
    if (id(x), key) not in cache:
        cache[id(x), key] = make()
    return cache[id(x), key]


def _shared_value(x, key):
    held = _SHARING.get()
    return None if held is None else held[1].get((id(x), key))


def _share(x, key, value):
    held = _SHARING.get()
    if held is not None and id(x) in held[0]:
        held[1].setdefault((id(x), key), value)


def per_sample(values_fn, tensors, axis, compute, chunk_size=None, labels=None):
    """`values_fn(*tensors, axis=axis)`, the per-sample values, with the
    tensors cast to `compute` first; `labels` (integers of the per-sample
    shape), if given, are passed on as `labels=`.

    With `chunk_size`, the rows of the tensors (every axis but `axis`,
    flattened) are taken `chunk_size` at a time under `backend.map_chunks`
    (a scan on JAX, a while loop on TF, a loop over `unbind` on torch),
    each chunk cast and computed there with each row's gradient, so that
    value + gradient hold O(chunk_size × classes) temporaries rather than
    O(rows × classes), and the backward pass recomputes nothing. A scan,
    not a Python loop: XLA keeps every slice of an unrolled loop alive. The row count may be known only at run time;
    rows short of a whole chunk are padded with ones (finite as logits and
    as probabilities; label 0) and dropped (`padded_rows`).
    """
    extra = {} if labels is None else {"labels": labels}
    if chunk_size is None:
        return values_fn(*[cast_to(t, compute) for t in tensors], axis=axis, **extra)
    last = len(tensors[0].shape) - 1
    if axis != last:
        tensors = [ops.moveaxis(t, axis, -1) for t in tensors]
    shape = ops.shape(tensors[0])
    classes = shape[-1]
    rows = [ops.reshape(t, (-1, classes)) for t in tensors]
    n = ops.shape(rows[0])[0]
    chunk_size = chunk_rows(chunk_size, classes, n)
    rows = [ops.reshape(padded_rows(r, n, chunk_size, 1), (-1, chunk_size, classes)) for r in rows]
    if labels is not None:
        flat = padded_rows(ops.reshape(labels, (-1,)), n, chunk_size, 0)
        rows.append(ops.reshape(flat, (-1, chunk_size)))

    def chunk_values(chunk):
        if labels is None:
            return values_fn(*[ops.cast(t, compute) for t in chunk], axis=-1)
        *chunk, chunk_labels = chunk
        return values_fn(*[ops.cast(t, compute) for t in chunk], axis=-1, labels=chunk_labels)

    values = ops.reshape(backend.map_chunks(chunk_values, tuple(rows), compute), (-1,))
    return ops.reshape(unpadded_rows(values, n, chunk_size), shape[:-1])


def _row_blocks(n):
    """How many blocks `n` rows are padded in: the devices they are split
    over (`backend.row_shards`) where each holds n / devices of them, else
    1."""
    shards = backend.row_shards()
    return shards if shards > 1 and isinstance(n, int) and n % shards == 0 else 1


def padded_rows(x, n, chunk_size, value):
    """`x` ([n, ...]) padded with `value` to whole chunks of `chunk_size`
    rows: at its end, or where the rows are split over devices, at the end
    of each device's rows, so that every device's chunks are its own rows
    (`backend.map_chunks`, `backend.chunked_sum`). `n` may be known only at
    run time."""
    blocks = _row_blocks(n)
    local = n // blocks
    pad = at_least_one((local + chunk_size - 1) // chunk_size) * chunk_size - local
    if isinstance(pad, int) and not pad:
        return x
    rest = tuple(ops.shape(x)[1:])
    if blocks == 1:
        return ops.concatenate([x, ops.full((pad,) + rest, value, x.dtype)], axis=0)
    x = ops.reshape(x, (blocks, local) + rest)
    x = ops.concatenate([x, ops.full((blocks, pad) + rest, value, x.dtype)], axis=1)
    return ops.reshape(x, (blocks * (local + pad),) + rest)


def unpadded_rows(values, n, chunk_size):
    """The `n` values of the rows `padded_rows` padded, in their order."""
    blocks = _row_blocks(n)
    if blocks == 1:
        return values[:n]
    return ops.reshape(ops.reshape(values, (blocks, -1))[:, : n // blocks], (n,))
