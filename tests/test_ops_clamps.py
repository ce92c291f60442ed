"""Every clamp the ops apply, at its exact boundary: the value is the
clamped one, and the gradient is the unclamped formula's (a `clip`,
`minimum` or `maximum` there halves it on JAX and torch, so ORPO's gradient
at its −1e-7 clamp was half the right one there, and right on TensorFlow).
Each expected gradient is the closed form's derivative, in float64."""

import numpy as np
import pytest
from keras import ops

from keras_penalties import ops as P
from tests.testing import grad, to_numpy


def f32(*values):
    return np.asarray(values, "float32")


def _orpo_gradient(c, r, beta=1.0):
    """d/dc of −β·logσ((c − r) − (log(1 − e^c) − log(1 − e^r))), in float64."""
    c, r = np.float64(c), np.float64(r)
    z = (c - r) - (np.log(-np.expm1(c)) - np.log(-np.expm1(r)))
    dz = 1.0 + np.exp(c) / -np.expm1(c)
    return -beta * dz / (1.0 + np.exp(z))


LIMIT = np.float32(-1e-7)  # ORPO's clamp of log(1 − e^x), as float32 holds it
# name -> (the op as a function of x (float32 [n]), x at the boundary,
# the value there, the gradient there).
CLAMPS = {
    "log_ratio_high": (
        lambda x: P.policy_loss(x, f32(0.0), f32(1.0), kind="importance_sampling", reduction="sum"),
        f32(20.0),
        -np.exp(20.0),
        [-np.exp(20.0)],
    ),
    "log_ratio_low": (
        lambda x: P.policy_loss(x, f32(0.0), f32(1.0), kind="importance_sampling", reduction="sum"),
        f32(-20.0),
        -np.exp(-20.0),
        [-np.exp(-20.0)],
    ),
    "log_ratio_sequence": (
        lambda x: P.policy_loss(x[None], f32(0.0, 0.0)[None], f32(1.0), kind="importance_sampling", level="sequence"),
        f32(20.0, 20.0),
        -np.exp(20.0),
        [-np.exp(20.0) / 2, -np.exp(20.0) / 2],
    ),
    "log_ratio_kl_correction": (
        lambda x: P.kl_estimate(x, f32(19.0), estimator="k1", old_logprobs=f32(0.0), reduction="sum"),
        f32(20.0),
        np.exp(20.0),
        [np.exp(20.0) * 2.0],  # d/dx (x − 19)·eˣ = eˣ + (x − 19)·eˣ
    ),
    "kl_clip_high": (
        lambda x: P.kl_estimate(x, f32(0.0), estimator="k1", clip=(-1.0, 2.0), reduction="sum"),
        f32(2.0),
        2.0,
        [1.0],
    ),
    "kl_clip_low": (
        lambda x: P.kl_estimate(x, f32(0.0), estimator="k1", clip=(-1.0, 2.0), reduction="sum"),
        f32(-1.0),
        -1.0,
        [1.0],
    ),
    "orpo_chosen": (
        lambda x: P.preference_loss(x, f32(-1.0), kind="orpo", beta=1.0),
        np.array([LIMIT]),
        None,
        [_orpo_gradient(LIMIT, -1.0)],
    ),
    "orpo_both": (
        lambda x: P.preference_loss(x[:1], x[1:], kind="orpo", beta=1.0),
        np.array([LIMIT, LIMIT]),
        None,
        None,  # c = r: the two sides' derivatives, equal and opposite, sum to 0
    ),
    "l2_clip": (lambda x: P.l2(x, clip=1.0), f32(1.0, -1.0), 2.0, [2.0, -2.0]),
}


@pytest.mark.parametrize("name", sorted(CLAMPS))
def test_at_a_clamps_boundary_the_gradient_is_the_unclamped_one(name):
    call, x, value, gradient = CLAMPS[name]
    got = to_numpy(call(x))
    if value is not None:
        np.testing.assert_allclose(got, value, rtol=1e-5)
    g = grad(call, x)
    if name == "orpo_both":
        single = _orpo_gradient(LIMIT, LIMIT)
        # Each side alone, at the clamp, by its own derivative: c gets `single`, r its negation.
        g_chosen = grad(lambda c: call(ops.concatenate([c, ops.convert_to_tensor(x[1:])])), x[:1])
        np.testing.assert_allclose(g_chosen, [single], rtol=1e-3)
        np.testing.assert_allclose(g, [single, -single], rtol=1e-3)
        return
    np.testing.assert_allclose(g, gradient, rtol=1e-3)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_bounds_include_their_ends(mode):
    # δ = 0 and ln 2 give ρ = 1 and 2 exactly, each on a bound.
    weights, kept = P.importance_weights(f32(0.0, np.log(2.0), 0.0), f32(0.0, 0.0, 0.0), mode=mode, bounds=(1.0, 2.0))
    np.testing.assert_allclose(to_numpy(weights), [1.0, 2.0, 1.0], rtol=1e-6)
    assert to_numpy(kept).all()
