"""The logit z-loss and the per-pass extras of SPEC §14b:
`cross_entropy(..., z_loss=λ)` is CE + λ·lse² at every kept position, and
`token_logprobs`' `return_logsumexp` and `return_top1` — fused or formed,
chunked or whole, masked, with a temperature and a soft cap — against
NumPy on the formed logits (SciPy's logsumexp), values and gradients."""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

import keras_penalties as kp
from keras_penalties import ops as P
from tests.testing import grads, to_numpy

RNG = np.random.default_rng(14)
B, T, H, V = 2, 5, 4, 7
HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
KERNEL = RNG.normal(size=(H, V)).astype("float32")
LABELS = RNG.integers(0, V, size=(B, T))
LABELS[0, 0] = -100  # masks its position
MASK = np.ones((B, T), "float32")
MASK[1, -1] = 0
KEPT = (LABELS >= 0) & (MASK > 0)
SAFE = np.where(KEPT, LABELS, 0)
LAMBDA, TEMPERATURE, CAP = 0.1, 1.5, 3.0


def _logits(soft_cap=None):
    z = HIDDEN.astype(np.float64) @ KERNEL
    return z if soft_cap is None else soft_cap * np.tanh(z / soft_cap)


def _pick(x, labels=SAFE):
    return np.take_along_axis(x, labels[..., None], -1)[..., 0]


def _mean_with_z_loss(z):
    """CE + λ·lse² of logits `z`, averaged over the positions whose label is not negative."""
    lse = special.logsumexp(z, -1)
    valid = LABELS >= 0
    return np.mean((lse - _pick(z, np.where(valid, LABELS, 0)) + LAMBDA * lse**2)[valid])


def _head(fused, soft_cap=None):
    if fused:
        return P.linear(HIDDEN, KERNEL, soft_cap=soft_cap)
    return _logits(soft_cap).astype("float32")


CASES = {
    "formed": (False, None, None),
    "formed_chunked": (False, 3, None),
    "fused_whole": (True, None, None),
    "fused_chunked": (True, 3, None),
    "fused_capped": (True, 4, CAP),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cross_entropy_with_z_loss_is_ce_plus_lambda_lse_squared(case, reduction):
    fused, chunk_size, cap = CASES[case]
    z = _logits(cap) / TEMPERATURE
    lse = special.logsumexp(z, -1)
    per = np.where(KEPT, -_pick(z - lse[..., None]) + LAMBDA * lse**2, 0.0)
    expected = {"mean": per.sum() / KEPT.sum(), "sum": per.sum(), "none": per}[reduction]
    got = P.cross_entropy(
        LABELS,
        _head(fused, cap),
        mask=MASK,
        temperature=TEMPERATURE,
        reduction=reduction,
        chunk_size=chunk_size,
        z_loss=LAMBDA,
    )
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_z_loss_gradient_adds_two_lambda_lse_softmax(case):
    fused, chunk_size, cap = CASES[case]
    if cap is not None:
        pytest.skip("the capped head's gradient through tanh is the ops.linear tests'")

    def loss(hidden):
        logits = P.linear(hidden, KERNEL) if fused else ops.matmul(hidden, KERNEL)
        return P.cross_entropy(LABELS, logits, mask=MASK, chunk_size=chunk_size, z_loss=LAMBDA)

    (got,) = grads(loss, HIDDEN)
    z = _logits()
    p, lse = special.softmax(z, -1), special.logsumexp(z, -1, keepdims=True)
    dz = (p - np.eye(V)[SAFE] + 2 * LAMBDA * lse * p) * KEPT[..., None] / KEPT.sum()
    np.testing.assert_allclose(got, dz @ KERNEL.T.astype(np.float64), rtol=1e-4, atol=1e-6)


def test_label_smoothing_is_unaffected_and_lambda_zero_is_the_plain_loss():
    logits = _logits().astype("float32")
    plain = to_numpy(P.cross_entropy(LABELS, logits, label_smoothing=0.2))
    lse = special.logsumexp(_logits(), -1)
    with_z = to_numpy(P.cross_entropy(LABELS, logits, label_smoothing=0.2, z_loss=LAMBDA))
    np.testing.assert_allclose(with_z, plain + LAMBDA * np.mean(lse[LABELS >= 0] ** 2), rtol=1e-5)
    assert to_numpy(P.cross_entropy(LABELS, logits, z_loss=0.0)) == to_numpy(P.cross_entropy(LABELS, logits))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_hidden_states_give_the_float32_numbers(dtype):
    hidden = ops.cast(HIDDEN, dtype)
    got = P.cross_entropy(LABELS, P.linear(hidden, ops.cast(KERNEL, dtype)), chunk_size=3, z_loss=LAMBDA)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    rounded = to_numpy(hidden).astype(np.float64) @ to_numpy(ops.cast(KERNEL, dtype)).astype(np.float64)
    np.testing.assert_allclose(to_numpy(got), _mean_with_z_loss(rounded), rtol=1e-2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_token_logprobs_returns_logsumexp_and_top1_from_the_same_pass(case):
    fused, chunk_size, cap = CASES[case]
    z = _logits(cap) / TEMPERATURE
    lse = special.logsumexp(z, -1)
    logprobs, entropy, logsumexp, top1 = P.token_logprobs(
        LABELS,
        _head(fused, cap),
        temperature=TEMPERATURE,
        mask=MASK,
        chunk_size=chunk_size,
        return_entropy=True,
        return_logsumexp=True,
        return_top1=True,
    )
    logp = z - lse[..., None]
    np.testing.assert_allclose(to_numpy(logprobs), np.where(KEPT, _pick(logp), 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(entropy), np.where(KEPT, -(np.exp(logp) * logp).sum(-1), 0), atol=1e-5)
    np.testing.assert_allclose(to_numpy(logsumexp), np.where(KEPT, lse, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(to_numpy(top1), np.where(KEPT, _pick(z) >= z.max(-1), 0))


def test_top1_is_one_per_id_with_several_ids_and_its_mean_is_token_accuracy():
    z = _logits()
    ids = np.stack([SAFE, np.argmax(z, -1)], -1)  # the second id is always the argmax
    _, top1 = P.token_logprobs(ids, z.astype("float32"), return_top1=True)
    assert tuple(top1.shape) == (B, T, 2)
    np.testing.assert_array_equal(to_numpy(top1)[..., 1], 1.0)
    np.testing.assert_array_equal(to_numpy(top1)[..., 0], _pick(z) >= z.max(-1))
    # Ties count: a row of equal logits has every id on top.
    _, tied = P.token_logprobs([[3]], np.zeros((1, V), "float32"), return_top1=True)
    assert to_numpy(tied).tolist() == [[1.0]]


def test_logsumexp_gradient_is_softmax_and_top1_has_none():
    def lse_sum(hidden):
        _, lse, top1 = P.token_logprobs(
            LABELS, P.linear(hidden, KERNEL), mask=MASK, chunk_size=3, return_logsumexp=True, return_top1=True
        )
        return ops.sum(lse) + ops.sum(top1)

    (got,) = grads(lse_sum, HIDDEN)
    expected = (special.softmax(_logits(), -1) * KEPT[..., None]) @ KERNEL.T.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_extreme_logits_give_finite_values_and_gradients():
    z = np.where(RNG.uniform(size=(B, T, V)) > 0.5, 1e4, -1e4).astype("float32")
    value = P.cross_entropy(LABELS, z, z_loss=1e-4)
    assert np.isfinite(to_numpy(value))
    (g,) = grads(lambda x: P.cross_entropy(LABELS, x, z_loss=1e-4), z)
    assert np.isfinite(g).all()


def test_z_loss_is_a_term_option():
    term = kp.Term("cross_entropy", 1.0, inputs=("labels", "logits"), options={"z_loss": LAMBDA})
    objective = kp.CompositeObjective({"ce": term})
    logits = _logits().astype("float32")
    _, values = objective.compute({"labels": LABELS, "logits": logits})
    np.testing.assert_allclose(to_numpy(values["ce"]), _mean_with_z_loss(_logits()), rtol=1e-5)
    with pytest.raises(ValueError, match="`z_loss` > 0 needs logits"):
        kp.Term("cross_entropy", options={"z_loss": 1e-4, "from_logits": False})


def test_the_lse_gradient_joins_the_entropys_in_one_pass():
    # torch's chunk kernel forms both in its one backward pass; the others autograd.
    logits = _logits().astype("float32")

    def loss(x):
        logprobs, entropy, lse = P.token_logprobs(SAFE, x, chunk_size=3, return_entropy=True, return_logsumexp=True)
        return ops.sum(logprobs) + 0.5 * ops.sum(entropy) + 0.25 * ops.sum(lse)

    z = _logits()
    lse = special.logsumexp(z, -1, keepdims=True)
    p, logp = np.exp(z - lse), z - lse
    entropy = -(p * logp).sum(-1, keepdims=True)
    expected = np.eye(V)[SAFE] - p - 0.5 * p * (logp + entropy) + 0.25 * p
    (got,) = grads(loss, logits)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_lse_reads_the_label_so_a_banned_class_leaves_it_finite():
    # Class 0's logit -inf at every row (a banned token), the labels elsewhere.
    logits = _logits().astype("float32")
    logits[..., 0] = -np.inf
    labels = np.where(SAFE == 0, 1, SAFE)
    z = _logits()[..., 1:]
    _, lse = P.token_logprobs(labels, logits, chunk_size=3, return_logsumexp=True)
    np.testing.assert_allclose(to_numpy(lse), special.logsumexp(z, -1), rtol=1e-5)
    (g,) = grads(lambda x: ops.sum(P.token_logprobs(labels, x, chunk_size=3, return_logsumexp=True)[1]), logits)
    np.testing.assert_allclose(g[..., 1:], special.softmax(z, -1), rtol=1e-4, atol=1e-6)
    assert np.all(g[..., 0] == 0.0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"z_loss": -1e-4}, "`z_loss` must be >= 0"),
        ({"z_loss": float("nan")}, "`z_loss` must be finite"),
        ({"z_loss": 1e-4, "from_logits": False}, "`z_loss` > 0 needs logits"),
    ],
)
def test_z_loss_errors_name_it(options, message):
    with pytest.raises(ValueError, match=message):
        P.cross_entropy(LABELS, _logits().astype("float32"), **options)
