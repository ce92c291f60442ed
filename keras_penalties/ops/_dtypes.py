"""The dtypes every penalty in `keras_penalties.ops` computes in: inputs are
converted with `to_compute` to one stable dtype (float16/bfloat16 are computed
in float32, integers in floatx) and the result cast back with `from_compute`."""

import keras
import numpy as np
from keras import ops

from keras_penalties import backend


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
# `cast_to` below): on eager torch each Keras call costs Python time whatever
# it does (bench/results/README.md).


def cast_to(x, dtype):
    """`ops.cast(x, dtype)`, or `x` itself where it has that dtype already;
    for tensors already converted (Keras' cast would also move a torch
    tensor to Keras' device)."""
    return x if keras.backend.standardize_dtype(x.dtype) == dtype else ops.cast(x, dtype)


def dtype_pair(tensors):
    """`(compute_dtype, output_dtype)` of tensors: half precision computes in
    float32; the output is their common float dtype (floatx for integers)."""
    dtype = _common_float_dtype([keras.backend.standardize_dtype(t.dtype) for t in tensors])
    return "float32" if backend.is_half(dtype) else dtype, dtype


def _common_float_dtype(dtypes):
    # Not keras.backend.result_type: on some backends it resolves float64 to
    # floatx, and a float64 input must keep float64.
    floats = sorted(set(d for d in dtypes if "float" in d))
    if not floats:
        return keras.config.floatx()
    if len(floats) == 1:
        return floats[0]
    widest = max(floats, key=lambda d: np.dtype(d if d != "bfloat16" else "float16").itemsize)
    return "float32" if backend.is_half(widest) else widest


def from_compute(x, dtype):
    return cast_to(x, dtype)


def as_float32(tensors):
    """The one "make it float32" of the package: half-precision tensors of a
    structure as float32 copies, the others as they are (a composite's
    inputs under a mixed policy)."""
    if not isinstance(tensors, (list, tuple, dict)):
        # A lone tensor, what most objectives get: no structure to walk
        # (keras.tree's walk is most of this function's time on eager torch).
        return _as_float32(tensors)
    return keras.tree.map_structure(_as_float32, tensors)


def _as_float32(t):
    return cast_to(t, "float32") if hasattr(t, "dtype") and backend.is_half(t.dtype) else t
