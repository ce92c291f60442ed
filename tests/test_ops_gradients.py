"""Gradients of every ops function: central finite differences, and no NaN/Inf at the edges."""

import zlib

import numpy as np
import pytest
from keras import ops

from keras_penalties import ops as P
from tests.oracles import CASES
from tests.testing import assert_finite, central_difference, float64_scope, grad, to_numpy

# One shape per case and only the default reduction: the other reductions are
# linear maps of the same per-sample values, covered by the value tests.
GRAD_CASES = [
    pytest.param(case, id=case.id)
    for case in CASES
    if case.options.get("reduction") in (None, "sum", "mean") and "reduction" not in case.options
]


@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradient_matches_finite_differences(case):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    shape = case.shapes()[-1] if case.kind != "matrix" else (5, 3)
    inputs = [x.astype(np.float64) for x in case.inputs(shape, rng)]
    with float64_scope():
        for i in range(len(inputs)):

            def f(x, i=i):
                args = list(inputs)
                args[i] = x
                return case.fn(*args, **case.options)

            actual = grad(f, inputs[i])
            expected = central_difference(lambda x: to_numpy(f(x)), inputs[i])
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7, err_msg=f"input {i}")


# Inputs where naive formulas produce NaN or Inf: exact zeros in probabilities,
# logits of ±1e4, and all-zero tensors.
ZERO_PROBS = np.array([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]], np.float32)
OTHER_PROBS = np.array([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.0, 0.0, 1.0]], np.float32)
BIG_LOGITS = np.array([[1e4, -1e4, 0.0], [-1e4, 1e4, 3.0], [0.0, 0.0, -1e4]], np.float32)
OTHER_LOGITS = BIG_LOGITS[::-1].copy()
ZEROS = np.zeros((3, 3), np.float32)

EDGE_CASES = {
    "kl_probs": (lambda p, q: P.kl_divergence(p, q), ZERO_PROBS, OTHER_PROBS),
    "kl_probs_reverse": (lambda p, q: P.kl_divergence(p, q, direction="reverse"), ZERO_PROBS, OTHER_PROBS),
    "kl_probs_symmetric_T": (
        lambda p, q: P.kl_divergence(p, q, direction="symmetric", temperature=0.5),
        ZERO_PROBS,
        OTHER_PROBS,
    ),
    "kl_logits": (lambda p, q: P.kl_divergence(p, q, from_logits=True), BIG_LOGITS, OTHER_LOGITS),
    "kl_logits_symmetric_T": (
        lambda p, q: P.kl_divergence(p, q, from_logits=True, direction="symmetric", temperature=0.1),
        BIG_LOGITS,
        OTHER_LOGITS,
    ),
    "js_probs": (lambda p, q: P.js_divergence(p, q), ZERO_PROBS, OTHER_PROBS),
    "js_probs_T": (lambda p, q: P.js_divergence(p, q, temperature=2.0), ZERO_PROBS, OTHER_PROBS),
    "js_logits": (lambda p, q: P.js_divergence(p, q, from_logits=True), BIG_LOGITS, OTHER_LOGITS),
    "js_beta_probs": (lambda p, q: P.js_divergence(p, q, beta=0.1), ZERO_PROBS, OTHER_PROBS),
    "js_beta_logits": (lambda p, q: P.js_divergence(p, q, from_logits=True, beta=0.9), BIG_LOGITS, OTHER_LOGITS),
    "entropy_probs": (lambda x: P.entropy(x), ZERO_PROBS),
    "entropy_probs_normalized_T": (lambda x: P.entropy(x, normalize=True, temperature=0.5), ZERO_PROBS),
    "entropy_logits": (lambda x: P.entropy(x, from_logits=True), BIG_LOGITS),
    "entropy_one_class": (lambda x: P.entropy(x, normalize=True), np.ones((3, 1), np.float32)),
    "consistency_kl": (lambda a, b: P.consistency(a, b, metric="kl"), ZERO_PROBS, OTHER_PROBS),
    "consistency_js_logits": (
        lambda a, b: P.consistency(a, b, metric="js", from_logits=True),
        BIG_LOGITS,
        OTHER_LOGITS,
    ),
    "consistency_cosine_zeros": (lambda a, b: P.consistency(a, b, metric="cosine"), ZEROS, ZEROS),
    "consistency_mse_logits": (
        lambda a, b: P.consistency(a, b, metric="mse", from_logits=True),
        BIG_LOGITS,
        OTHER_LOGITS,
    ),
    "l1_zeros": (lambda x: P.l1(x), ZEROS),
    "l2_zeros_mean_clip": (lambda x: P.l2(x, center="mean", clip=1.0), ZEROS),
    "elastic_net_zeros": (lambda x: P.elastic_net(x), ZEROS),
    "output_magnitude_zeros": (lambda x: P.output_magnitude(x), ZEROS),
    "kl_sparsity_zeros": (lambda x: P.kl_sparsity(x), ZEROS),
    "kl_sparsity_ones": (lambda x: P.kl_sparsity(x), np.ones((3, 3), np.float32)),
    "orthogonality_zeros_soft": (lambda w: P.orthogonality(w), ZEROS),
    "orthogonality_zeros_hard": (lambda w: P.orthogonality(w, mode="hard"), ZEROS),
    "orthogonality_zeros_spectral": (lambda w: P.orthogonality(w, mode="spectral"), ZEROS),
    "orthogonality_identity_spectral": (
        lambda w: P.orthogonality(w, mode="spectral"),
        np.eye(3, dtype=np.float32),
    ),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_value_and_gradients_finite_at_edges(name):
    fn, *inputs = EDGE_CASES[name]
    inputs = [ops.convert_to_tensor(x) for x in inputs]
    assert_finite(to_numpy(fn(*inputs)), f"{name} value")
    for i in range(len(inputs)):

        def f(x, i=i):
            args = list(inputs)
            args[i] = x
            return fn(*args)

        assert_finite(grad(f, inputs[i]), f"{name} gradient w.r.t. input {i}")


def test_zero_probabilities_contribute_zero():
    # 0·log 0 = 0: a zero in p adds nothing to KL(p‖q) or H(p).
    p = np.array([0.0, 0.25, 0.75], np.float32)
    q = np.array([0.2, 0.3, 0.5], np.float32)
    expected_kl = 0.25 * np.log(0.25 / 0.3) + 0.75 * np.log(0.75 / 0.5)
    np.testing.assert_allclose(to_numpy(P.kl_divergence(p, q)), expected_kl, rtol=1e-6)
    expected_h = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    np.testing.assert_allclose(to_numpy(P.entropy(p)), expected_h, rtol=1e-6)


def test_extreme_logits_values_are_exact():
    # One-hot logits of ±1e4: entropy 0; KL = the logit gap the student is off by.
    logits = np.array([[1e4, -1e4]], np.float32)
    np.testing.assert_allclose(to_numpy(P.entropy(logits, from_logits=True)), 0.0, atol=1e-6)
    np.testing.assert_allclose(
        to_numpy(P.kl_divergence(logits, logits[:, ::-1].copy(), from_logits=True)), 2e4, rtol=1e-6
    )
    np.testing.assert_allclose(
        to_numpy(P.js_divergence(logits, logits[:, ::-1].copy(), from_logits=True)), np.log(2), rtol=1e-6
    )
