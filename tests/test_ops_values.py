"""Every ops function against its NumPy/SciPy oracle, on random inputs of several shapes."""

import zlib

import numpy as np
import pytest

from tests.oracles import CASES
from tests.testing import to_numpy

VALUE_CASES = [
    pytest.param(case, shape, id=f"{case.id}-{'x'.join(map(str, shape))}")
    for case in CASES
    for shape in case.shapes()
]


@pytest.mark.parametrize("case, shape", VALUE_CASES)
def test_matches_oracle(case, shape):
    rng = np.random.default_rng(zlib.crc32(f"{case.id}{shape}".encode()))
    inputs = case.inputs(shape, rng)
    expected = case.oracle(*[x.astype(np.float64) for x in inputs], **case.options)
    actual = case.fn(*inputs, **case.options)
    assert to_numpy(actual).dtype == np.float32
    np.testing.assert_allclose(to_numpy(actual), expected, rtol=1e-5, atol=1e-6)
