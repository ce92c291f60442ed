"""Properties every penalty must have, on hypothesis-generated inputs."""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import special, stats

from keras_penalties import ops as P
from tests.testing import to_numpy

finite = st.floats(-20.0, 20.0, allow_nan=False, width=32)
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=2, max_side=6)
logits = hnp.arrays(np.float32, shapes, elements=finite)


@st.composite
def logit_pairs(draw):
    shape = draw(shapes)
    return (
        draw(hnp.arrays(np.float32, shape, elements=finite)),
        draw(hnp.arrays(np.float32, shape, elements=finite)),
    )


def probs(x):
    return special.softmax(x.astype(np.float64), axis=-1).astype(np.float32)


@given(logit_pairs(), st.sampled_from(["forward", "reverse", "symmetric"]), st.sampled_from([0.5, 1.0, 2.0]))
def test_kl_is_non_negative_and_zero_on_itself(pair, direction, temperature):
    p, q = pair
    for from_logits, (a, b) in ((True, (p, q)), (False, (probs(p), probs(q)))):
        value = to_numpy(
            P.kl_divergence(
                a, b, from_logits=from_logits, direction=direction, temperature=temperature, reduction="none"
            )
        )
        assert np.all(value >= -1e-6), value
        same = to_numpy(P.kl_divergence(a, a, from_logits=from_logits, direction=direction, temperature=temperature))
        np.testing.assert_allclose(same, 0.0, atol=1e-6)


@given(logit_pairs(), st.booleans())
def test_js_is_symmetric_and_bounded_by_ln2(pair, from_logits):
    p, q = pair if from_logits else (probs(pair[0]), probs(pair[1]))
    pq = to_numpy(P.js_divergence(p, q, from_logits=from_logits, reduction="none"))
    qp = to_numpy(P.js_divergence(q, p, from_logits=from_logits, reduction="none"))
    np.testing.assert_allclose(pq, qp, rtol=1e-5, atol=1e-7)
    assert np.all(pq >= -1e-7) and np.all(pq <= math.log(2) + 1e-6), pq


@given(logits, st.sampled_from([0.5, 1.0, 3.0]))
def test_normalized_entropy_is_between_0_and_1(x, temperature):
    h = to_numpy(P.entropy(x, from_logits=True, normalize=True, temperature=temperature, reduction="none"))
    assert np.all(h >= -1e-6) and np.all(h <= 1 + 1e-6), h
    raw = to_numpy(P.entropy(x, from_logits=True, temperature=temperature, reduction="none"))
    np.testing.assert_allclose(
        raw, stats.entropy(special.softmax(x / temperature, axis=-1), axis=-1), rtol=1e-4, atol=1e-5
    )


@given(hnp.arrays(np.float32, shapes, elements=finite), st.floats(-5.0, 5.0, allow_nan=False))
def test_l2_is_quadratic_and_l1_absolutely_homogeneous(x, k):
    np.testing.assert_allclose(to_numpy(P.l2(k * x)), k**2 * to_numpy(P.l2(x)), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(to_numpy(P.l1(k * x)), abs(k) * to_numpy(P.l1(x)), rtol=1e-4, atol=1e-3)


@given(logit_pairs(), st.sampled_from(["mse", "l1", "cosine", "kl", "js"]))
def test_consistency_is_non_negative_and_zero_on_itself(pair, metric):
    a, b = pair
    if metric == "cosine" and a.ndim < 2:
        a, b = a[None], b[None]
    assert np.all(to_numpy(P.consistency(a, b, metric=metric, from_logits=True, reduction="none")) >= -1e-6)
    np.testing.assert_allclose(to_numpy(P.consistency(a, a, metric=metric, from_logits=True)), 0.0, atol=1e-5)


@given(st.integers(2, 6), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_orthogonal_matrix_has_zero_penalty(k, extra_rows, seed):
    # Q from a QR decomposition has orthonormal columns.
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(k + extra_rows, k)))
    q = q.astype(np.float32)
    for mode in ("soft", "hard", "spectral"):
        for normalize in (True, False):
            value = to_numpy(P.orthogonality(q, mode=mode, normalize=normalize))
            np.testing.assert_allclose(value, 0.0, atol=1e-5, err_msg=mode)
    # Its rows are orthonormal only when it is square.
    if extra_rows == 0:
        np.testing.assert_allclose(to_numpy(P.orthogonality(q, axis="rows", mode="hard")), 0.0, atol=1e-5)


@given(hnp.arrays(np.float32, shapes, elements=finite), st.floats(0.0, 3.0))
def test_magnitude_penalties_are_non_negative(x, target):
    assert to_numpy(P.l1(x)) >= 0 and to_numpy(P.l2(x, center="mean")) >= 0
    assert to_numpy(P.elastic_net(x, l1_ratio=0.3)) >= 0
    assert to_numpy(P.output_magnitude(x, target=target)) >= 0
    for mode in ("soft", "hard", "spectral"):
        if x.ndim >= 2:
            assert to_numpy(P.orthogonality(x, mode=mode)) >= -1e-6


@given(hnp.arrays(np.float32, (8, 3), elements=st.floats(0.015625, 0.984375, width=32)), st.floats(0.01, 0.99))
def test_kl_sparsity_is_non_negative_and_zero_on_target(x, target):
    assert to_numpy(P.kl_sparsity(x, target=target)) >= -1e-6
    on_target = np.full((8, 3), target, np.float32)
    np.testing.assert_allclose(to_numpy(P.kl_sparsity(on_target, target=target)), 0.0, atol=1e-5)
