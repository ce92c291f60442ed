"""Dtype behaviour: half precision in and out with float32 accuracy; float64 kept exact."""

import zlib

import keras
import numpy as np
import pytest
from keras import ops

from tests.oracles import CASES
from tests.testing import float64_scope, to_numpy

# One case per function and option set that changes the code path; the
# reductions only rescale.
DTYPE_CASES = [pytest.param(c, id=c.id) for c in CASES if "reduction" not in c.options]

# Round-to-nearest into the output dtype costs at most half an ulp; the bound is
# one ulp, which a computation carried out in the half type itself would
# exceed on these sums.
HALF_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def _inputs(case, rng):
    shape = case.shapes()[-1]
    return case.inputs(shape, rng)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", DTYPE_CASES)
def test_half_precision_returns_input_dtype_with_float32_accuracy(case, dtype):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    tensors = [ops.cast(x, dtype) for x in _inputs(case, rng)]
    # The oracle sees exactly the rounded inputs the function sees.
    rounded = [to_numpy(t).astype(np.float64) for t in tensors]
    expected = case.oracle(*rounded, **case.options)
    actual = case.fn(*tensors, **case.options)
    assert keras.backend.standardize_dtype(actual.dtype) == dtype
    np.testing.assert_allclose(to_numpy(actual), expected, rtol=HALF_RTOL[dtype], atol=1e-6)


@pytest.mark.parametrize("case", DTYPE_CASES)
def test_float64_is_kept_and_exact(case):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    inputs = [x.astype(np.float64) for x in _inputs(case, rng)]
    expected = case.oracle(*inputs, **case.options)
    with float64_scope():
        actual = case.fn(*inputs, **case.options)
        assert keras.backend.standardize_dtype(actual.dtype) == "float64"
        np.testing.assert_allclose(to_numpy(actual), expected, rtol=1e-12, atol=1e-14)


def test_integer_input_computes_in_floatx():
    from keras_penalties import ops as P

    x = np.array([[1, -2], [3, -4]], np.int32)
    for value, expected in ((P.l1(x), 10.0), (P.l2(x), 30.0), (P.output_magnitude(x, target=0.0), 15.0)):
        assert keras.backend.standardize_dtype(value.dtype) == keras.config.floatx()
        np.testing.assert_allclose(to_numpy(value), expected, rtol=1e-6)
