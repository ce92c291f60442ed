"""`mask=` on kl_divergence, js_divergence and entropy (SPEC §1), against the
NumPy oracles' per-sample values reduced over the kept positions only."""

import numpy as np
import pytest
from keras import ops

from keras_penalties import ops as P
from tests import oracles as O
from tests.testing import assert_finite, grad, to_numpy

RNG = np.random.default_rng(3)
SHAPE = (3, 4, 7)  # [batch, tokens, vocab]
P_LOGITS = RNG.normal(scale=3.0, size=SHAPE).astype("float32")
Q_LOGITS = RNG.normal(scale=3.0, size=SHAPE).astype("float32")
MASK = (RNG.uniform(size=SHAPE[:2]) < 0.6).astype("float32")
MASK[0, 0], MASK[0, 1] = 1.0, 0.0  # at least one kept and one masked

# name -> (ours(p, q, **kw), oracle per-sample values(p, q))
FUNCTIONS = {
    "kl_forward": (lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, **kw), lambda p, q: O.np_kl_divergence(p, q, True, reduction="none")),
    "kl_reverse": (
        lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, direction="reverse", temperature=0.5, **kw),
        lambda p, q: O.np_kl_divergence(p, q, True, direction="reverse", temperature=0.5, reduction="none"),
    ),
    "js": (lambda p, q, **kw: P.js_divergence(p, q, from_logits=True, **kw), lambda p, q: O.np_js_divergence(p, q, True, reduction="none")),
    "js_beta": (
        lambda p, q, **kw: P.js_divergence(p, q, from_logits=True, beta=0.2, **kw),
        lambda p, q: O.np_js_divergence(p, q, True, reduction="none", beta=0.2),
    ),
    "entropy": (lambda p, q, **kw: P.entropy(q, from_logits=True, **kw), lambda p, q: O.np_entropy(q, True, reduction="none")),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_masked_value_matches_oracle(name, reduction):
    ours, oracle = FUNCTIONS[name]
    values = oracle(P_LOGITS, Q_LOGITS)
    kept = MASK != 0
    expected = {
        "mean": values[kept].sum() / kept.sum(),
        "sum": values[kept].sum(),
        "none": np.where(kept, values, 0.0),
    }[reduction]
    for mask in (MASK, MASK.astype(bool), 2.0 * MASK):  # float, bool, any nonzero keeps
        np.testing.assert_allclose(to_numpy(ours(P_LOGITS, Q_LOGITS, mask=mask, reduction=reduction)), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_masked_positions_add_nothing_to_value_or_gradient(name):
    ours, _ = FUNCTIONS[name]
    kept = (MASK != 0)[..., None]
    # Extreme logits where the mask is 0 must not change anything.
    wild = np.where(kept, Q_LOGITS, 1e4 * np.sign(Q_LOGITS)).astype("float32")
    base = to_numpy(ours(P_LOGITS, Q_LOGITS, mask=MASK))
    np.testing.assert_allclose(to_numpy(ours(P_LOGITS, wild, mask=MASK)), base, rtol=1e-6)
    g = to_numpy(grad(lambda q: ours(ops.convert_to_tensor(P_LOGITS), q, mask=MASK), wild))
    assert_finite(g, name)
    np.testing.assert_array_equal(g[~np.broadcast_to(kept, SHAPE)], 0.0)
    assert np.any(g[np.broadcast_to(kept, SHAPE)] != 0.0)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_all_kept_is_unmasked_and_none_kept_is_zero(name):
    ours, _ = FUNCTIONS[name]
    np.testing.assert_allclose(
        to_numpy(ours(P_LOGITS, Q_LOGITS, mask=np.ones(SHAPE[:2]))), to_numpy(ours(P_LOGITS, Q_LOGITS)), rtol=1e-6
    )
    none = np.zeros(SHAPE[:2], "float32")
    for reduction in ("mean", "sum"):
        assert float(to_numpy(ours(P_LOGITS, Q_LOGITS, mask=none, reduction=reduction))) == 0.0
    g = to_numpy(grad(lambda q: ours(ops.convert_to_tensor(P_LOGITS), q, mask=none), Q_LOGITS))
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_mask_of_the_wrong_shape_is_an_error(name):
    ours, _ = FUNCTIONS[name]
    for bad in (np.ones(SHAPE), np.ones(SHAPE[:1]), np.ones((3, 5))):
        with pytest.raises(ValueError, match=r"`mask` must have the per-sample shape \(3, 4\)"):
            ours(P_LOGITS, Q_LOGITS, mask=bad)


def test_mask_on_another_axis():
    # Distribution along axis 1: the per-sample shape is [batch, vocab-less rest].
    p, q = np.moveaxis(P_LOGITS, -1, 1), np.moveaxis(Q_LOGITS, -1, 1)
    masked = P.kl_divergence(p, q, from_logits=True, axis=1, mask=MASK)
    np.testing.assert_allclose(to_numpy(masked), to_numpy(P.kl_divergence(P_LOGITS, Q_LOGITS, from_logits=True, mask=MASK)), rtol=1e-6)
