"""Every ops function against its NumPy/SciPy oracle, on random inputs of several shapes."""

import zlib

import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import ops as P
from tests.oracles import CASES, np_js_divergence
from tests.testing import BACKEND, grad, to_numpy

VALUE_CASES = [
    pytest.param(case, shape, id=f"{case.id}-{'x'.join(map(str, shape))}") for case in CASES for shape in case.shapes()
]


@pytest.mark.parametrize("case, shape", VALUE_CASES)
def test_matches_oracle(case, shape):
    rng = np.random.default_rng(zlib.crc32(f"{case.id}{shape}".encode()))
    inputs = case.inputs(shape, rng)
    expected = case.oracle(*[x.astype(np.float64) for x in inputs], **case.options)
    actual = case.fn(*inputs, **case.options)
    assert to_numpy(actual).dtype == np.float32
    np.testing.assert_allclose(to_numpy(actual), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.5, 0.2])
@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_js_leaves_its_inputs_as_they_were(from_logits, beta, chunk_size):
    """Torch forms the value in place where nothing is differentiated
    (`backend.js_rows`): in its own temporaries, never in the caller's
    tensors (given probabilities are used as they are)."""
    rng = np.random.default_rng(7)
    p, q = (3.0 * rng.normal(size=(2, 4, 9))).astype("float32")
    if not from_logits:
        p, q = special.softmax(p, axis=-1).astype("float32"), special.softmax(q, axis=-1).astype("float32")
    tp, tq = ops.convert_to_tensor(p), ops.convert_to_tensor(q)
    value = P.js_divergence(tp, tq, from_logits=from_logits, beta=beta, reduction="none", chunk_size=chunk_size)
    expected = np_js_divergence(p.astype(np.float64), q.astype(np.float64), from_logits, reduction="none", beta=beta)
    np.testing.assert_allclose(to_numpy(value), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(to_numpy(tp), p)
    np.testing.assert_array_equal(to_numpy(tq), q)


@pytest.mark.skipif(
    BACKEND != "torch", reason="only torch forms the JS value two ways (in place where nothing is differentiated)"
)
@pytest.mark.parametrize("from_logits", [True, False])
def test_js_in_place_value_has_the_differentiable_bits(from_logits):
    import torch

    generator = torch.Generator().manual_seed(0)
    p, q = 4.0 * torch.randn(2, 64, 1000, generator=generator)
    if not from_logits:
        p, q = torch.softmax(p, -1), torch.softmax(q, -1)
        # Classes both sides give no mass: there m = 0 and log m is log(tiny).
        p[:, :10], q[:, :10] = 0.0, 0.0
    for beta in (0.5, 0.1):
        plain = P.js_divergence(p, q, from_logits=from_logits, beta=beta, reduction="none")
        tracked = P.js_divergence(
            p.clone().requires_grad_(True), q, from_logits=from_logits, beta=beta, reduction="none"
        )
        assert tracked.requires_grad
        assert torch.equal(plain, tracked.detach())


@pytest.mark.skipif(BACKEND != "torch", reason="only torch shares an objective's log-softmaxes and forms JS in place")
def test_js_in_place_beside_a_shared_log_softmax():
    """Where an objective shares one side's log-softmax with its other
    terms, the in-place JS value leaves that one as it was and keeps the
    differentiable form's bits."""
    import torch

    from keras_penalties.ops import _numerics as num

    generator = torch.Generator().manual_seed(1)
    p, q = 4.0 * torch.randn(2, 64, 1000, generator=generator)
    tracked = P.js_divergence(p.clone().requires_grad_(True), q, from_logits=True, beta=0.3, reduction="none")
    with num.sharing([q]):
        logq = num.log_probs(q, from_logits=True, temperature=1.0, axis=-1)
        before = logq.clone()
        plain = P.js_divergence(p, q, from_logits=True, beta=0.3, reduction="none")
        assert torch.equal(logq, before)
        assert num.log_probs(q, from_logits=True, temperature=1.0, axis=-1) is logq
    assert torch.equal(plain, tracked.detach())


def test_js_under_vectorized_map():
    """`ops.vectorized_map` (torch.vmap on torch, where in-place ops cannot
    write a batched result into an unbatched tensor): one side batched, the
    other not."""
    rng = np.random.default_rng(11)
    p = special.softmax(rng.normal(size=5), axis=-1).astype("float32")
    q = special.softmax(rng.normal(size=(4, 5)), axis=-1).astype("float32")
    tp = ops.convert_to_tensor(p)
    value = ops.vectorized_map(lambda row: P.js_divergence(tp, row, beta=0.3), ops.convert_to_tensor(q))
    expected = [np_js_divergence(p.astype(np.float64), row.astype(np.float64), beta=0.3) for row in q]
    np.testing.assert_allclose(to_numpy(value), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("size", [2**18, 2**18 + 1, 2**20 + 1, 4 * 2**20 + 3])
def test_l1_and_l2_of_large_tensors_are_exact_to_float32_rounding(size):
    """Σ|x| and Σx², and their gradients, within 1e-6 of float64 at sizes
    where torch's own 1-norm and dot were off by up to 3e-4 and 2e-5 (the
    sizes where torch's `sum_abs`/`sum_of_squares` change method; the
    others reduce with XLA or TF, the same formula at every size)."""
    x = np.random.default_rng(size).normal(size=size).astype("float32")
    x64, tx = x.astype(np.float64), ops.convert_to_tensor(x)
    np.testing.assert_allclose(to_numpy(P.l1(tx)), np.abs(x64).sum(), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(P.l2(tx)), np.square(x64).sum(), rtol=1e-6)
    np.testing.assert_array_equal(grad(P.l1, tx), np.sign(x))
    np.testing.assert_allclose(grad(P.l2, tx), 2.0 * x, rtol=1e-6)


def test_l1_and_l2_of_large_rows_under_vectorized_map():
    """Per-row Σ|x| and Σx² through `ops.vectorized_map` (torch.vmap on
    torch, where the blocked sums of large tensors sum plainly)."""
    x = np.random.default_rng(3).normal(size=(2, 2**20 + 3)).astype("float32")
    tx = ops.convert_to_tensor(x)
    np.testing.assert_allclose(to_numpy(ops.vectorized_map(P.l1, tx)), np.abs(x.astype(np.float64)).sum(1), rtol=1e-6)
    np.testing.assert_allclose(
        to_numpy(ops.vectorized_map(P.l2, tx)), np.square(x.astype(np.float64)).sum(1), rtol=1e-6
    )


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="torch.autocast is torch's (it runs bmm, which torch's large Σx² uses, in half precision)",
)
def test_l2_of_a_large_tensor_stays_float32_under_torch_autocast():
    import torch

    x = np.random.default_rng(4).normal(size=2**20 + 3).astype("float32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = P.l2(ops.convert_to_tensor(x))
    assert value.dtype == torch.float32
    np.testing.assert_allclose(to_numpy(value), np.square(x.astype(np.float64)).sum(), rtol=1e-6)
