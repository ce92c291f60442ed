"""`ops.kl_estimate` and `ops.policy_loss` on log-probabilities
arriving as arrays (the remote case: a trainer elsewhere sends them).

Oracles: NumPy float64 transcriptions of verl's `kl_penalty`, `agg_loss`
and PPO loss and of TRL's GRPO `_compute_loss` (tests/rl_oracles.py); the
closed forms of the estimators' expectations (Σ π·k = KL(π‖π_ref) for the
unbiased ones, and the gradient of KL for the straight-through forms);
central differences of the transcriptions for gradients. Errors before any
tensor work; finite values and gradients at |d| = 80 under float32 and
bfloat16; zeros for empty batches and sequences with no kept token.
"""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import ops as P
from tests import rl_oracles as RL
from tests.testing import assert_finite, assert_raises_as_listed, central_difference, compiled, grad, grads, to_numpy

RNG = np.random.default_rng(12)
B, T = 3, 6
LOGP = -RNG.uniform(0.05, 3.0, size=(B, T))
REF = LOGP + RNG.normal(scale=0.7, size=(B, T))
OLD = LOGP + RNG.normal(scale=0.3, size=(B, T))
ADV = RNG.normal(size=(B,))
MASK = np.ones((B, T), "float32")
MASK[0, 4:] = 0.0
MASK[2, 1] = 0.0
# verl's names for the estimators ("+": the same names with "+").
VERL = {"k1": "k1", "abs": "abs", "k2": "k2", "k3": "k3"}
ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+")
AGGREGATIONS = {"mean": "token-mean", "sequence_mean": "seq-mean-token-mean", "sequence_sum": "seq-mean-token-sum"}


def f32(x):
    return np.asarray(x, "float32")


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_estimates_per_token_equal_verls_kl_penalty(estimator):
    # verl's k3 is always clamped to ±10: no estimate here comes near it.
    assert RL.verl_kl_penalty(LOGP, REF, "k3").max() < 5.0
    expected = RL.verl_kl_penalty(LOGP, REF, estimator)
    got = to_numpy(P.kl_estimate(f32(LOGP), f32(REF), estimator=estimator, reduction="none"))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    g = grad(lambda x: P.kl_estimate(x, f32(REF), estimator=estimator, reduction="none"), f32(LOGP))
    np.testing.assert_allclose(g, RL.verl_kl_penalty_grad(LOGP, REF, estimator), rtol=1e-5, atol=1e-6)


def test_verls_low_var_kl_is_k3_clipped_to_ten():
    d = np.array([-14.0, -3.0, 0.5, 12.0])
    logp, ref = np.zeros(4), -d
    got = to_numpy(P.kl_estimate(f32(logp), f32(ref), estimator="k3", clip=(-10, 10), reduction="none"))
    np.testing.assert_allclose(got, RL.verl_kl_penalty(logp, ref, "low_var_kl"), rtol=1e-6)
    g = grad(lambda x: P.kl_estimate(x, f32(ref), estimator="k3", clip=(-10, 10), reduction="none"), f32(logp))
    np.testing.assert_allclose(g, RL.verl_kl_penalty_grad(logp, ref, "low_var_kl"), rtol=1e-6, atol=1e-7)
    assert g[0] == 0.0  # k3(−14) = e¹⁴ − 15 is past 10: clamped, no gradient


def test_k3_is_trls_per_token_kl():
    got = to_numpy(P.kl_estimate(f32(LOGP), f32(REF), reduction="none"))
    np.testing.assert_allclose(got, RL.trl_per_token_kl(LOGP, REF), rtol=1e-5, atol=1e-6)


def test_unbiased_estimators_and_the_straight_through_gradient_in_expectation():
    # A categorical π over 7 outcomes: Σ π(x)·k(x) over every outcome is
    # the estimator's exact expectation.
    logits, ref_logits = RNG.normal(size=7), RNG.normal(size=7)
    log_pi, log_ref = special.log_softmax(logits), special.log_softmax(ref_logits)
    pi = np.exp(log_pi)
    kl = float(np.sum(pi * (log_pi - log_ref)))
    for estimator in ("k1", "k3", "k1+", "k3+"):
        values = to_numpy(P.kl_estimate(f32(log_pi), f32(log_ref), estimator=estimator, reduction="none"))
        assert abs(float(np.sum(pi * values)) - kl) < 1e-6, estimator
    # ∇_z KL(softmax(z)‖π_ref) = π ⊙ (d − KL): what Σ sg(π)·k+ gives for k3+.
    expected = pi * (log_pi - log_ref - kl)

    def expectation(z):
        logp = ops.log_softmax(z)
        values = P.kl_estimate(logp, f32(log_ref), estimator="k3+", reduction="none")
        return ops.sum(ops.stop_gradient(ops.exp(logp)) * values)

    np.testing.assert_allclose(grad(expectation, f32(logits)), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", sorted(AGGREGATIONS))
def test_reductions_equal_verls_agg_loss(reduction):
    values = RL.verl_kl_penalty(LOGP, REF, "k3")
    got = P.kl_estimate(f32(LOGP), f32(REF), mask=MASK, reduction=reduction)
    np.testing.assert_allclose(to_numpy(got), RL.verl_agg_loss(values, MASK, AGGREGATIONS[reduction]), rtol=1e-5)
    summed = P.kl_estimate(f32(LOGP), f32(REF), mask=MASK, reduction="sum")
    np.testing.assert_allclose(to_numpy(summed), np.sum(values * MASK), rtol=1e-5)


def test_a_sequence_with_no_kept_token_does_not_count():
    mask = MASK.copy()
    mask[1] = 0.0
    values = RL.verl_kl_penalty(LOGP, REF, "k3")
    kept = [0, 2]
    for reduction in ("sequence_mean", "sequence_sum"):
        got = to_numpy(P.kl_estimate(f32(LOGP), f32(REF), mask=mask, reduction=reduction))
        expected = RL.verl_agg_loss(values[kept], mask[kept], AGGREGATIONS[reduction])
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=reduction)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_k3_stays_finite_at_a_log_ratio_of_80(dtype):
    logp = np.array([[-80.0, 0.0, -1.0, 0.0]])
    ref = np.array([[0.0, -80.0, -1.0, 0.0]])  # d = −80, 80, 0, 0
    x = ops.cast(logp, dtype)
    values = P.kl_estimate(x, ops.cast(ref, dtype), reduction="none")
    assert keras.backend.standardize_dtype(values.dtype) == dtype
    got = to_numpy(values)
    if dtype == "float16":
        assert np.isinf(got[0, 0]) and got[0, 1] == 79.0  # e⁸⁰ is past float16's 65504
    else:
        assert_finite(got, "k3")
        np.testing.assert_allclose(got[0, :2], [np.expm1(80.0) - 80.0, 79.0], rtol=1e-2)
    for estimator in ESTIMATORS:
        g = grad(lambda v, e=estimator: P.kl_estimate(v, ops.cast(ref, dtype), estimator=e, mask=[[1, 1, 1, 0]]), x)
        if dtype != "float16":
            assert_finite(g, estimator)


def test_no_tokens_and_no_kept_tokens_give_zero_with_finite_gradients():
    empty = np.zeros((0, T), "float32")
    nothing = np.zeros((B, T), "float32")
    for reduction in ("mean", "sum", "sequence_mean", "sequence_sum"):
        for logp, ref, adv, mask in ((empty, empty, np.zeros(0), None), (f32(LOGP), f32(REF), f32(ADV), nothing)):

            def total(x, ref=ref, adv=adv, mask=mask, reduction=reduction):
                kl = P.kl_estimate(x, ref, mask=mask, reduction=reduction)
                return kl + P.policy_loss(x, ref, adv, mask=mask, reduction=reduction)

            assert float(to_numpy(total(logp))) == 0.0
            g = grad(total, logp)
            assert_finite(g, reduction)
            assert not g.any()


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_per_token_equals_verls(clip, dual_clip):
    # Advantages of both signs, and ratios past both clips and the dual clip.
    logp = np.array([[0.0, -0.5, -2.0, 0.3, -1.0, 0.1]] * 2)
    old = np.array([[0.5, -0.5, -0.5, 0.0, -2.5, 0.0]] * 2)
    adv = np.array([[1.0] * 6, [-1.0] * 6])
    expected = RL.verl_ppo_token_loss(logp, old, adv, clip[0], clip[1], dual_clip)
    ours = P.policy_loss(f32(logp), f32(old), f32(adv), clip=clip, dual_clip=dual_clip, reduction="none")
    np.testing.assert_allclose(to_numpy(ours), expected, rtol=1e-6, atol=1e-7)
    g = grad(
        lambda x: P.policy_loss(x, f32(old), f32(adv), clip=clip, dual_clip=dual_clip, reduction="none"), f32(logp)
    )
    numeric = central_difference(
        lambda x: np.sum(RL.verl_ppo_token_loss(x, old, adv, clip[0], clip[1], dual_clip)), logp
    )
    np.testing.assert_allclose(g, numeric, rtol=1e-5, atol=1e-6)


def test_the_other_kinds_by_their_closed_forms():
    ratio = np.exp(LOGP - OLD)
    a = ADV[:, None]
    cases = {
        "reinforce": (-a * LOGP, -a * np.ones_like(LOGP)),
        "importance_sampling": (-ratio * a, -ratio * a),
        "cispo": (-np.minimum(ratio, 1.28) * a * LOGP, -np.minimum(ratio, 1.28) * a),
    }
    for kind, (value, gradient) in cases.items():
        old = None if kind == "reinforce" else f32(OLD)

        def loss(x, kind=kind, old=old):
            return P.policy_loss(x, old, f32(ADV), kind=kind, clip=(0.2, 0.28), reduction="none")

        np.testing.assert_allclose(to_numpy(loss(f32(LOGP))), value, rtol=1e-5, atol=1e-6, err_msg=kind)
        np.testing.assert_allclose(grad(loss, f32(LOGP)), gradient, rtol=1e-5, atol=1e-6, err_msg=kind)
    # verl's CISPO clips the ratio from below too: at 1 − 0.99 no ratio here reaches it.
    cispo = P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), kind="cispo", clip=(0.2, 0.28), reduction="none")
    expected = RL.verl_cispo_token_loss(LOGP, OLD, np.broadcast_to(a, LOGP.shape), 0.99, 0.28)
    np.testing.assert_allclose(to_numpy(cispo), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_the_grpo_loss_equals_trls(loss_type):
    beta, clip = 0.04, (0.2, 0.28)
    expected = RL.trl_grpo_loss(LOGP, OLD, REF, ADV, MASK, beta, clip[0], clip[1], loss_type, max_completion_length=T)

    def loss(x):
        if loss_type == "dr_grpo":
            pg = P.policy_loss(x, f32(OLD), f32(ADV), clip=clip, mask=MASK, reduction="sum")
            kl = P.kl_estimate(x, f32(REF), mask=MASK, reduction="sum")
            return (pg + beta * kl) / (B * T)
        reduction = "sequence_mean" if loss_type == "grpo" else "mean"
        pg = P.policy_loss(x, f32(OLD), f32(ADV), clip=clip, mask=MASK, reduction=reduction)
        return pg + beta * P.kl_estimate(x, f32(REF), mask=MASK, reduction=reduction)

    np.testing.assert_allclose(to_numpy(loss(f32(LOGP))), expected, rtol=1e-5)

    def trl(x):
        return RL.trl_grpo_loss(x, OLD, REF, ADV, MASK, beta, clip[0], clip[1], loss_type, max_completion_length=T)

    np.testing.assert_allclose(grad(loss, f32(LOGP)), central_difference(trl, LOGP), rtol=1e-4, atol=1e-6)


def test_compiled_with_run_time_shapes():
    def total(x, ref, old, adv, mask):
        return P.policy_loss(x, old, adv, mask=mask) + P.kl_estimate(x, ref, mask=mask, reduction="sequence_mean")

    run = compiled(total)
    for rows in (B, 1):
        args = [f32(a[:rows]) for a in (LOGP, REF, OLD, ADV, MASK)]
        np.testing.assert_allclose(to_numpy(run(*args)), to_numpy(total(*args)), rtol=1e-6)
    expected = grads(total, *[f32(a) for a in (LOGP, REF, OLD, ADV, MASK)])[0]
    np.testing.assert_allclose(grads(run, *[f32(a) for a in (LOGP, REF, OLD, ADV, MASK)])[0], expected, rtol=1e-6)


LP, RF, AD = f32(LOGP), f32(REF), f32(ADV)
ERRORS = {
    "estimator": (lambda: P.kl_estimate(LP, RF, estimator="k4"), ValueError, r"`estimator` must be one of"),
    "kl_reduction": (lambda: P.kl_estimate(LP, RF, reduction="tokens"), ValueError, r"`reduction` must be one of"),
    "kl_clip_order": (lambda: P.kl_estimate(LP, RF, clip=(1, -1)), ValueError, r"`clip` must be \(low, high\)"),
    "kl_clip_pair": (lambda: P.kl_estimate(LP, RF, clip=3.0), ValueError, r"`clip` must be a pair"),
    "kl_shapes": (
        lambda: P.kl_estimate(LP, RF[:, :2]),
        ValueError,
        r"`logprobs` and `ref_logprobs` must have the same shape",
    ),
    "kl_sequence_rank": (
        lambda: P.kl_estimate(LP[0], RF[0], reduction="sequence_mean"),
        ValueError,
        r"`reduction='sequence_mean'` averages over sequences: `logprobs` must be \[batch, tokens\]",
    ),
    "kind": (lambda: P.policy_loss(LP, LP, AD, kind="grpo"), ValueError, r"`kind` must be one of"),
    "ppo_clip": (lambda: P.policy_loss(LP, LP, AD, clip=(1.0, 0.2)), ValueError, r"`clip` must be \(ε_low, ε_high\)"),
    "ppo_clip_high": (lambda: P.policy_loss(LP, LP, AD, clip=(0.2, -0.1)), ValueError, r"`clip` must be"),
    "dual_clip": (lambda: P.policy_loss(LP, LP, AD, dual_clip=1.0), ValueError, r"`dual_clip` must be > 1"),
    "old_none": (lambda: P.policy_loss(LP, None, AD), ValueError, r"`old_logprobs` is needed for kind='ppo'"),
    "old_shape": (
        lambda: P.policy_loss(LP, LP[:2], AD),
        ValueError,
        r"`logprobs` and `old_logprobs` must have the same shape",
    ),
    "advantages_shape": (
        lambda: P.policy_loss(LP, LP, AD[:2]),
        ValueError,
        r"`advantages` must be per sequence \(3,\) or per token \(3, 6\)",
    ),
    "policy_sequence_rank": (
        lambda: P.policy_loss(LP[None], LP[None], AD[:1], reduction="sequence_sum"),
        ValueError,
        r"`reduction='sequence_sum'`",
    ),
    "cross_entropy_sequence_rank": (
        lambda: P.cross_entropy(np.zeros(3, "int32"), np.zeros((3, 4), "float32"), reduction="sequence_mean"),
        ValueError,
        r"`reduction='sequence_mean'` averages over sequences: the values",
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_name_the_argument(case):
    assert_raises_as_listed(ERRORS[case])


def test_as_terms_by_name_in_both_composites():
    from keras_penalties import CompositeObjective, Term
    from keras_penalties.losses import CompositeLoss

    clip = (0.2, 0.28)
    objective = CompositeObjective(
        {
            "pg": Term("policy_loss", inputs=("logprobs", "old", "advantages"), options={"mask": "mask", "clip": clip}),
            "kl": Term(
                "kl_estimate",
                0.04,
                inputs=("logprobs", "ref"),
                options={"mask": "mask", "reduction": "sequence_mean"},
            ),
        }
    )
    data = {"logprobs": LOGP, "old": OLD, "ref": REF, "advantages": ADV, "mask": MASK}
    total, values = objective.compute({k: f32(v) for k, v in data.items()})
    adv = np.broadcast_to(ADV[:, None], LOGP.shape)
    pg = RL.verl_agg_loss(RL.verl_ppo_token_loss(LOGP, OLD, adv, *clip), MASK, "token-mean")
    kl = RL.verl_agg_loss(RL.verl_kl_penalty(LOGP, REF, "k3"), MASK, "seq-mean-token-mean")
    np.testing.assert_allclose([to_numpy(values["pg"]), to_numpy(values["kl"])], [pg, kl], rtol=1e-5)
    np.testing.assert_allclose(to_numpy(total), pg + 0.04 * kl, rtol=1e-5)

    # In a CompositeLoss, y_true is the reference's log-probabilities and
    # y_pred the policy's; Keras reduces the per-token values.
    loss = CompositeLoss({"kl": Term("kl_estimate", options={"estimator": "k2"})})
    np.testing.assert_allclose(to_numpy(loss(f32(REF), f32(LOGP))), np.mean(0.5 * (LOGP - REF) ** 2), rtol=1e-5)
    three = CompositeLoss({"pg": "policy_loss"})
    with pytest.raises(ValueError, match=r"policy_loss takes 3 tensors; a CompositeLoss term gets \(y_true, y_pred\)"):
        three(f32(REF), f32(LOGP))


def test_masked_tokens_may_hold_any_reference():
    # A reference padded with -inf (or -1e30) where the mask drops tokens:
    # those tokens count for nothing, value or gradient.
    ref = f32(REF).copy()
    ref[MASK == 0] = -np.inf
    for estimator in ESTIMATORS:
        for reduction in ("mean", "sequence_mean"):

            def kl(x, estimator=estimator, reduction=reduction):
                return P.kl_estimate(x, ref, estimator=estimator, mask=MASK, reduction=reduction)

            expected = RL.verl_agg_loss(
                RL.verl_kl_penalty(LOGP, np.where(MASK == 0, LOGP, REF), estimator),
                MASK,
                AGGREGATIONS[reduction],
            )
            np.testing.assert_allclose(to_numpy(kl(f32(LOGP))), expected, rtol=1e-5, err_msg=estimator)
            g = grad(kl, f32(LOGP))
            assert_finite(g, estimator)
            assert not g[MASK == 0].any()


def test_a_sequence_reduction_in_a_composite_loss():
    from keras_penalties import Term
    from keras_penalties.losses import CompositeLoss

    loss = CompositeLoss({"kl": Term("kl_estimate", options={"reduction": "sequence_sum"})})
    expected = RL.verl_agg_loss(RL.verl_kl_penalty(LOGP, REF, "k3"), np.ones_like(LOGP), "seq-mean-token-sum")
    np.testing.assert_allclose(to_numpy(loss(f32(REF), f32(LOGP))), expected, rtol=1e-5)
    with pytest.raises(ValueError, match=r"Term 'kl': reduction='sequence_sum' averages over sequences"):
        loss(f32(REF), f32(LOGP), sample_weight=np.ones(B, "float32"))
