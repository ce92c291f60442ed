"""Off-policy RL ops (importance weights, the off-policy sequence mask, the
clip fractions) and the off-policy options of `policy_loss` (GSPO's
sequence levels, `weights`) and `kl_estimate` (`old_logprobs`).

Oracles: NumPy float64 transcriptions of TRL's and verl's own code
(tests/off_policy_oracles.py, each citing repository, path and commit),
values and gradients; closed forms (the unbiasedness of the
importance-corrected KL over a categorical π_old). Errors before any tensor
work; finite at extreme log-ratios; under `jit` and half precision; as
terms of a `CompositeObjective` whose tensor options name inputs.
"""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from keras_penalties.callbacks import PenaltyMonitor
from tests import off_policy_oracles as OP
from tests.testing import assert_finite, compiled, grad, grads, to_numpy

RNG = np.random.default_rng(57)
B, T = 4, 6
LOGP = -RNG.uniform(0.05, 3.0, size=(B, T))
SAMPLER = LOGP + RNG.normal(scale=0.4, size=(B, T))
OLD = LOGP + RNG.normal(scale=0.15, size=(B, T))
REF = LOGP + RNG.normal(scale=0.5, size=(B, T))
ADV = np.array([1.0, -0.5, 2.0, -1.5])
MASK = np.ones((B, T), "float32")
MASK[0, 4:] = 0.0  # padding at the end
MASK[2, 1] = 0.0  # a token masked inside
PADDED = np.where(MASK > 0, SAMPLER, -np.inf)  # a sampler's padding may be anything


def f32(x):
    return np.asarray(x, "float32")


# ------------------------------------------------------------------ importance weights


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("bounds", [(None, 2.0), (0.5, 1.5)])
def test_importance_weights_equal_trls_vllm_correction(level, mode, bounds):
    expected = OP.trl_vllm_is_weights(LOGP, SAMPLER, MASK, f"{level}_{mode}", clip_max=bounds[1], clip_min=bounds[0])
    weights, kept = P.importance_weights(f32(LOGP), f32(PADDED), level=level, mode=mode, bounds=bounds, mask=MASK)
    weights, kept = to_numpy(weights), to_numpy(kept)
    # On the kept tokens TRL's weight; 0 on padding (TRL's is 1 there, which its mask drops).
    np.testing.assert_allclose(weights, expected * MASK, rtol=1e-5, atol=1e-7)
    # "mask": a rejected token leaves `kept`, so a loss masked by it drops it from the token-mean denominator.
    rejected = (MASK > 0) & (expected == 0)
    assert mode == "truncate" or rejected.any()
    np.testing.assert_array_equal(kept, (MASK > 0) & ~rejected)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_equal_verls_rollout_correction(level):
    # verl's ratio is π_old / π_rollout: its old_log_prob is the trainer's log-probabilities.
    tis = OP.verl_rollout_is_weights(LOGP, SAMPLER, MASK, level, threshold=2.0)
    got, _ = P.importance_weights(f32(LOGP), f32(SAMPLER), level=level, mask=MASK)
    np.testing.assert_allclose(to_numpy(got), tis, rtol=1e-5, atol=1e-7)
    icepop = OP.verl_rollout_is_weights(LOGP, SAMPLER, MASK, level, threshold="0.5_1.5")
    got, _ = P.importance_weights(f32(LOGP), f32(SAMPLER), level=level, mode="mask", bounds=(0.5, 1.5), mask=MASK)
    np.testing.assert_allclose(to_numpy(got), icepop, rtol=1e-5, atol=1e-7)


# verl's rollout_rs option, its threshold, and the level and bounds of ours: verl bounds π_rollout/π_train, so
# its (l, u) is (1/u, 1/l) of π/q; "u" alone is (1/u, u).
REJECTIONS = {
    "token_k1": ("token_k1", "2.0", "token", (0.5, 2.0)),
    "token_k1_l_u": ("token_k1", "0.8_1.5", "token", (1 / 1.5, 1 / 0.8)),
    "seq_sum_k1": ("seq_sum_k1", "3.0", "sequence", (1 / 3.0, 3.0)),
    "seq_mean_k1": ("seq_mean_k1", "1.25", "geometric", (1 / 1.25, 1.25)),
}


@pytest.mark.parametrize("name", sorted(REJECTIONS))
def test_kept_tokens_equal_verls_rejection_sampling_mask(name):
    option, threshold, level, bounds = REJECTIONS[name]
    expected = OP.verl_rollout_rejection_mask(LOGP, SAMPLER, MASK, option, threshold)
    _, kept = P.importance_weights(f32(LOGP), f32(PADDED), level=level, mode="mask", bounds=bounds, mask=MASK)
    kept = to_numpy(kept)
    np.testing.assert_array_equal(kept, expected > 0)
    assert kept.sum() < MASK.sum(), "no token rejected: the bounds test nothing"


def test_geometric_weights_and_unbounded_ratios():
    delta = (LOGP - SAMPLER) * MASK
    geometric = np.exp(delta.sum(1, keepdims=True) / MASK.sum(1, keepdims=True)) * MASK
    got, kept = P.importance_weights(f32(LOGP), f32(SAMPLER), level="geometric", bounds=(None, None), mask=MASK)
    np.testing.assert_allclose(to_numpy(got), geometric, rtol=1e-5)
    np.testing.assert_array_equal(to_numpy(kept), MASK > 0)
    # Without a mask every token counts; ρ as it is at the token level.
    got, _ = P.importance_weights(f32(LOGP), f32(SAMPLER), bounds=(None, None))
    np.testing.assert_allclose(to_numpy(got), np.exp(LOGP - SAMPLER), rtol=1e-5)


def test_importance_weights_are_finite_constants_at_extreme_ratios():
    # A sequence sum of 40 nats: e^40 overflows float32; clamped at ±20 first.
    logp, sampler = f32(np.zeros((2, 4))), f32(np.array([[-10.0] * 4, [10.0] * 4]))
    weights, kept = P.importance_weights(logp, sampler, level="sequence", bounds=(None, None))
    np.testing.assert_allclose(to_numpy(weights), np.exp([[20.0] * 4, [-20.0] * 4]), rtol=1e-5)
    weights, kept = P.importance_weights(logp, sampler, level="sequence", mode="mask", bounds=(0.1, 10.0))
    assert not to_numpy(kept).any() and not to_numpy(weights).any()
    # No gradient reaches the log-probabilities.
    g = grad(lambda x: P.importance_weights(x, f32(SAMPLER), bounds=(None, None))[0], f32(LOGP))
    np.testing.assert_array_equal(g, 0.0)
    # Half precision in, float32 weights out: a ratio of 1.004 is not rounded to bfloat16's 1.0.
    half = P.importance_weights(ops.cast(f32([[0.004]]), "bfloat16"), f32([[0.0]]), bounds=(None, None))[0]
    assert keras.backend.standardize_dtype(half.dtype) == "float32"
    assert float(to_numpy(half)[0, 0]) > 1.0


# ------------------------------------------------------------------ the off-policy mask


@pytest.mark.parametrize("per_token", [False, True])
def test_off_policy_mask_equals_trls(per_token):
    advantages = np.tile(ADV[:, None], (1, T)) * np.where(RNG.uniform(size=(B, T)) < 0.3, -1, 1) if per_token else ADV
    old = LOGP + RNG.uniform(0.0, 1.0, size=(B, T))  # π_old more sure of its samples than π: a drift > 0
    drift = ((old - LOGP) * MASK).sum(1) / MASK.sum(1)
    # Under the drift of the negative sequences but the least: one or more dropped, not all.
    threshold = 0.999 * float(np.min(drift[[1, 3]]))
    expected = OP.trl_off_policy_mask(advantages, LOGP, old, MASK, threshold)
    kept = P.off_policy_mask(f32(LOGP), f32(old), f32(advantages), threshold=threshold, mask=MASK)
    expected = np.broadcast_to(expected, (B, T)) * MASK > 0
    assert 0 < expected.sum() < MASK.sum()
    np.testing.assert_array_equal(to_numpy(kept), expected)


# ------------------------------------------------------------------ GSPO


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_gspo_levels_equal_trls_loss_and_gradient(level):
    def loss(x, reduction="sum"):
        return P.policy_loss(x, f32(OLD), f32(ADV), clip=(0.2, 0.28), level=level, mask=MASK, reduction=reduction)

    expected = OP.trl_gspo_token_loss(LOGP, OLD, ADV, MASK, 0.2, 0.28, level)
    np.testing.assert_allclose(to_numpy(loss(f32(LOGP), "none")), expected * MASK, rtol=1e-5, atol=1e-7)
    expected_grad = OP.trl_gspo_token_loss_grad(LOGP, OLD, ADV, MASK, 0.2, 0.28, level)
    np.testing.assert_allclose(grad(loss, f32(LOGP)), expected_grad, rtol=1e-5, atol=1e-7)


def test_gspo_token_equals_verls_gspo_with_its_aggregation():
    advantages = np.tile(ADV[:, None], (1, T))
    losses = OP.verl_gspo_token_loss(LOGP, OLD, advantages, MASK, 0.2, 0.28)
    seq_mean = ((losses * MASK).sum(1) / MASK.sum(1)).mean()  # verl's seq-mean-token-mean

    def loss(x):
        return P.policy_loss(
            x, f32(OLD), f32(advantages), clip=(0.2, 0.28), level="sequence_token", mask=MASK, reduction="sequence_mean"
        )

    np.testing.assert_allclose(float(loss(f32(LOGP))), seq_mean, rtol=1e-5)
    grad_sum = OP.verl_gspo_token_loss_grad(LOGP, OLD, advantages, MASK, 0.2, 0.28)
    expected = grad_sum / MASK.sum(1, keepdims=True) / B
    np.testing.assert_allclose(grad(loss, f32(LOGP)), expected, rtol=1e-5, atol=1e-8)


def test_sequence_levels_need_a_ratio_and_clip_with_the_dual_clip():
    with pytest.raises(ValueError, match="level"):
        P.policy_loss(f32(LOGP), None, f32(ADV), kind="reinforce", level="sequence")
    # The dual clip bounds the sequence ratio's loss too: A < 0 and a large ratio.
    logp, old = f32(np.full((1, 3), 0.0)), f32(np.full((1, 3), -2.0))  # r = e² ≈ 7.4 for the sequence
    values = P.policy_loss(logp, old, f32([-1.0]), level="sequence", dual_clip=3.0, reduction="none")
    np.testing.assert_allclose(to_numpy(values), 3.0, rtol=1e-6)


def test_weights_multiply_the_per_token_loss_before_the_reduction():
    weights, kept = P.importance_weights(f32(LOGP), f32(SAMPLER), mask=MASK)
    plain = to_numpy(P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), reduction="none"))
    got = P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), weights=weights, mask=kept)
    np.testing.assert_allclose(float(got), (plain * to_numpy(weights)).sum() / MASK.sum(), rtol=1e-5)
    # Per-sequence weights broadcast over the tokens.
    got = P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), weights=f32([1.0, 0.0, 2.0, 1.0]), reduction="sum")
    np.testing.assert_allclose(float(got), (plain * np.array([1.0, 0.0, 2.0, 1.0])[:, None]).sum(), rtol=1e-5)


# ------------------------------------------------------------------ the importance-corrected KL


@pytest.mark.parametrize("level", ["token"])
def test_bias_corrected_kl_equals_trls(level):
    def kl(x):
        return P.kl_estimate(x, f32(REF), old_logprobs=f32(OLD), mask=MASK, reduction="sum")

    expected = OP.trl_bias_corrected_kl(LOGP, OLD, REF, MASK, level)
    got = P.kl_estimate(f32(LOGP), f32(REF), old_logprobs=f32(OLD), mask=MASK, reduction="none")
    np.testing.assert_allclose(to_numpy(got), expected * MASK, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad(kl, f32(LOGP)), OP.trl_bias_corrected_kl_grad(LOGP, OLD, REF, MASK), rtol=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k3", "k3+"])
def test_the_corrected_estimate_is_unbiased_over_a_categorical_old_policy(estimator):
    # Tokens sampled from π_old: Σ_x π_old(x)·r(x)·k(x) = Σ_x π(x)·k(x) = KL(π‖π_ref), as functions of π's
    # logits, so the gradient is KL's too: π ⊙ (log π − log π_ref − KL). (Not for a "+" form's gradient: r's
    # gradient times its value adds E_π[k·∇log π].)
    logits, ref, old = (RNG.normal(size=9) for _ in range(3))
    log_ref, log_old = special.log_softmax(ref), special.log_softmax(old)
    pi_old = np.exp(log_old)

    def expectation(z):
        logp = z - ops.logsumexp(z)
        values = P.kl_estimate(logp, f32(log_ref), estimator=estimator, old_logprobs=f32(log_old), reduction="none")
        return ops.sum(ops.convert_to_tensor(f32(pi_old)) * values)

    log_pi = special.log_softmax(logits)
    kl = float(np.sum(np.exp(log_pi) * (log_pi - log_ref)))
    np.testing.assert_allclose(float(expectation(ops.convert_to_tensor(f32(logits)))), kl, rtol=1e-5)
    if not estimator.endswith("+"):
        expected = np.exp(log_pi) * (log_pi - log_ref - kl)
        np.testing.assert_allclose(grad(expectation, f32(logits)), expected, atol=1e-6)


# ------------------------------------------------------------------ clip fractions


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_fractions_equal_trls_logged_ratios(level):
    # Ratios far enough from 1 to clip, the sequences' means too.
    old = LOGP + RNG.normal(scale=0.4 if level == "token" else 1.0, size=(B, T))
    # TRL averages a sequence's flag over sequences, here over kept tokens: the same where every sequence
    # keeps as many tokens.
    mask = MASK if level == "token" else np.ones((B, T), "float32")
    expected = OP.trl_clip_ratio_metrics(LOGP, old, ADV, mask, 0.2, 0.28, level)
    got = P.clip_fraction(f32(LOGP), f32(old), f32(ADV), clip=(0.2, 0.28), level=level, mask=mask)
    for ours, theirs in (("low", "low_mean"), ("high", "high_mean"), ("region", "region_mean")):
        np.testing.assert_allclose(float(got[ours]), expected[f"clip_ratio/{theirs}"], rtol=1e-6, err_msg=ours)
    assert 0 < float(got["region"]) < 1


# ------------------------------------------------------------------ everywhere


def test_the_sequence_clip_fraction_equals_verls_gspo_clipfrac():
    # verl's pg_clipfrac of GSPO: the kept tokens whose clipped loss exceeds the unclipped one, per-token advantages.
    old = LOGP + RNG.normal(scale=1.0, size=(B, T))
    advantages = np.tile(ADV[:, None], (1, T))
    expected = OP.verl_gspo_clipfrac(LOGP, old, advantages, MASK, 0.2, 0.28)
    got = P.clip_fraction(f32(LOGP), f32(old), f32(advantages), clip=(0.2, 0.28), level="sequence", mask=MASK)
    np.testing.assert_allclose(float(got["region"]), expected, rtol=1e-6)
    assert 0 < expected < 1


def test_the_ops_under_jit_and_half_precision():
    def step(logp):
        weights, kept = P.importance_weights(logp, f32(SAMPLER), mask=MASK)
        kept = ops.logical_and(kept, P.off_policy_mask(logp, f32(OLD), f32(ADV), threshold=0.5, mask=MASK))
        loss = P.policy_loss(logp, f32(OLD), f32(ADV), level="sequence", weights=weights, mask=kept)
        kl = P.kl_estimate(logp, f32(REF), old_logprobs=f32(OLD), mask=kept)
        region = P.clip_fraction(logp, f32(OLD), f32(ADV), mask=kept)["region"]
        return loss + 0.1 * kl, region

    eager = [float(v) for v in step(ops.convert_to_tensor(f32(LOGP)))]
    jitted = [float(v) for v in compiled(step)(ops.convert_to_tensor(f32(LOGP)))]
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    for dtype in ("float16", "bfloat16"):
        loss, region = step(ops.cast(f32(LOGP), dtype))
        assert keras.backend.standardize_dtype(loss.dtype) == dtype
        np.testing.assert_allclose(float(to_numpy(loss)), eager[0], rtol=3e-2)
        # A ratio at the clip's edge may round across it: a token of the 21 kept.
        np.testing.assert_allclose(float(region), eager[1], atol=1 / 21 + 1e-6)
        assert_finite(grad(lambda x: step(ops.cast(x, dtype))[0], f32(LOGP)), dtype)


def test_terms_by_name_read_their_tensor_options_from_the_inputs():
    weights, kept = (to_numpy(t) for t in P.importance_weights(f32(LOGP), f32(SAMPLER), mask=MASK))
    inputs = {
        "logp": f32(LOGP),
        "old": f32(OLD),
        "adv": f32(ADV),
        "ref": f32(REF),
        "weights": weights,
        "kept": kept,
    }
    objective = CompositeObjective(
        {
            "gspo": Term(
                "policy_loss",
                inputs=("logp", "old", "adv"),
                options={"level": "sequence", "mask": "kept", "weights": "weights"},
            ),
            "kl": Term("kl_estimate", 0.1, inputs=("logp", "ref"), options={"mask": "kept", "old_logprobs": "old"}),
        }
    )
    total, values = objective.compute(inputs)
    gspo = P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), level="sequence", mask=kept, weights=weights)
    kl = P.kl_estimate(f32(LOGP), f32(REF), mask=kept, old_logprobs=f32(OLD))
    np.testing.assert_allclose(to_numpy(values["gspo"]), to_numpy(gspo), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(values["kl"]), to_numpy(kl), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(total), float(gspo) + 0.1 * float(kl), rtol=1e-6)
    restored = CompositeObjective.from_config(objective.get_config())
    np.testing.assert_allclose(to_numpy(restored.compute(inputs)[0]), to_numpy(total), rtol=1e-6)
    with pytest.raises(TypeError, match=r"options\['weights'\]"):
        Term("policy_loss", inputs=("logp", "old", "adv"), options={"weights": weights})
    with pytest.raises(ValueError, match=r"options\['old_logprobs'\]"):
        Term("kl_estimate", options={"old_logprobs": "old"})


def test_empty_masks_give_zero_with_finite_gradients():
    empty = np.zeros((B, T), "float32")
    weights, kept = P.importance_weights(f32(LOGP), f32(PADDED), level="geometric", mask=empty)
    assert not to_numpy(weights).any() and not to_numpy(kept).any()
    for level in ("token", "sequence", "sequence_token"):
        value = P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), level=level, mask=empty)
        assert float(value) == 0.0
        g = grad(lambda x: P.policy_loss(x, f32(OLD), f32(ADV), level=level, mask=empty), f32(LOGP))
        np.testing.assert_array_equal(g, 0.0)
    fractions = P.clip_fraction(f32(LOGP), f32(OLD), f32(ADV), mask=empty)
    assert all(float(v) == 0.0 for v in fractions.values())
    both = grads(lambda x: P.kl_estimate(x, f32(REF), old_logprobs=f32(OLD), mask=empty), f32(LOGP))
    np.testing.assert_array_equal(both[0], 0.0)


class _SampledTokens(keras.layers.Layer):
    """The sampled tokens' log-probabilities and the entropy at each position,
    from hidden states through the model's head, in chunks (`chunk_size`)
    or from the formed logits (None)."""

    def __init__(self, head, chunk_size, **kwargs):
        super().__init__(**kwargs)
        self.head, self.chunk_size = head, chunk_size

    def call(self, hidden, labels, mask):
        logits = P.linear(hidden, self.head.kernel)
        return P.token_logprobs(labels, logits, mask=mask, chunk_size=self.chunk_size, return_entropy=True)


def _off_policy_model(chunk_size, vocab=13, hidden=6):
    """An off-policy GSPO step in fit: the sampler's truncated importance
    weights and kept tokens (inputs, computed in the data pipeline), a
    GSPO loss weighted by them, the importance-corrected k3 KL to a
    reference, and an entropy bonus from the same chunks."""
    keras.utils.set_random_seed(21)
    tokens, labels = keras.Input((T,), dtype="int32"), keras.Input((T,), dtype="int32")
    kept, weights, advantages = keras.Input((T,)), keras.Input((T,)), keras.Input(())
    old, reference = keras.Input((T,)), keras.Input((T,))
    states = keras.layers.Dense(hidden, activation="tanh")(keras.layers.Embedding(vocab, hidden)(tokens))
    head = keras.layers.Dense(vocab, use_bias=False)
    head.build((None, hidden))
    logprobs, entropy = _SampledTokens(head, chunk_size)(states, labels, kept)
    objective = CompositeObjective(
        {
            "gspo": Term(
                "policy_loss",
                inputs=("logprobs", "old", "advantages"),
                options={"level": "sequence", "mask": "kept", "weights": "weights", "reduction": "sequence_mean"},
            ),
            "kl": Term(
                "kl_estimate", 0.1, inputs=("logprobs", "reference"), options={"mask": "kept", "old_logprobs": "old"}
            ),
            "bonus": Term(
                lambda e, m: -ops.sum(e * m) / ops.maximum(ops.sum(m), 1.0), 0.01, inputs=("entropy", "kept")
            ),
        },
        name="off_policy",
    )
    inputs = {"logprobs": logprobs, "entropy": entropy, "old": old, "reference": reference}
    out = objective({**inputs, "advantages": advantages, "kept": kept, "weights": weights})["logprobs"]
    model = keras.Model([tokens, labels, kept, weights, advantages, old, reference], out)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=None)
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"], indirect=True)
def test_an_off_policy_gspo_step_in_fit_from_hidden_states(policy):
    rng = np.random.default_rng(9)
    n = 10
    logp = -rng.uniform(0.5, 3.0, size=(n, T)).astype("float32")
    sampler = logp + rng.normal(scale=0.3, size=(n, T)).astype("float32")
    mask = (rng.uniform(size=(n, T)) < 0.8).astype("float32")
    weights, kept = (to_numpy(t) for t in P.importance_weights(logp, sampler, mask=mask))
    data = [
        rng.integers(0, 13, size=(n, T)),
        rng.integers(0, 13, size=(n, T)),
        kept.astype("float32"),
        weights,
        rng.normal(size=(n,)).astype("float32"),
        sampler,
        logp - 0.2,
    ]
    histories = {}
    for chunk_size in (None, 3):
        model = _off_policy_model(chunk_size)
        histories[chunk_size] = model.fit(
            data, epochs=2, batch_size=4, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]
        ).history
    tolerance = 1e-4 if policy == "float32" else 2e-2
    for key in ("loss", "off_policy/gspo", "off_policy/kl", "off_policy/bonus"):
        assert np.isfinite(histories[3][key]).all(), key
        np.testing.assert_allclose(histories[3][key], histories[None][key], rtol=tolerance, err_msg=key)
