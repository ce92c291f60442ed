"""The policy losses users asked for after PPO and GRPO — SAPO, GMPO, VESPO,
LUSPO (a combination), Dr. GRPO's constant normaliser — and the token masks
beside them (DPPO's trust region, TRL's high-entropy tokens), with
`token_logprobs`' log Σp² (WPO's input).

Oracles: NumPy float64 transcriptions of TRL's and verl's code
(tests/policy_kind_oracles.py, each citing repository, path and commit),
values and their closed-form gradients. Errors before any tensor work;
finite at |log-ratio| ≤ 80 in float32 and bfloat16.
"""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from tests import policy_kind_oracles as PK
from tests.testing import assert_finite, assert_raises_as_listed, compiled, grad, to_numpy

RNG = np.random.default_rng(66)
B, T = 4, 6
LOGP = -RNG.uniform(0.05, 2.5, size=(B, T))
OLD = LOGP + RNG.normal(scale=0.35, size=(B, T))
ADV = np.array([1.2, -0.7, 0.4, -1.5])
TOKEN_ADV = RNG.normal(size=(B, T))
MASK = np.ones((B, T), "float32")
MASK[0, 4:] = 0.0  # right padding
MASK[2, 2] = 0.0  # a hole
# Padding may hold anything; the oracles see the clean values.
PADDED = np.where(MASK > 0, LOGP, np.nan)


def f32(x):
    return np.asarray(x, "float32")


def _loss(kind, reduction="sum", advantages=ADV, **options):
    return lambda x: P.policy_loss(x, f32(OLD), f32(advantages), kind=kind, mask=MASK, reduction=reduction, **options)


# ------------------------------------------------------------------ SAPO


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_equals_trls_loss_and_gradient(level):
    options = {"level": level}
    expected = PK.trl_sapo_per_token_loss(LOGP, OLD, ADV, MASK, level=level)
    got = to_numpy(_loss("sapo", "none", **options)(f32(PADDED)))
    np.testing.assert_allclose(got, np.broadcast_to(expected, MASK.shape) * MASK, rtol=1e-5, atol=1e-7)
    # TRL's aggregation: each sequence's token mean, averaged over the sequences (none is empty here).
    np.testing.assert_allclose(
        float(_loss("sapo", "sequence_mean", **options)(f32(LOGP))),
        PK.trl_sapo_loss(LOGP, OLD, ADV, MASK, level=level),
        rtol=1e-5,
    )
    expected_grad = PK.trl_sapo_per_token_loss_grad(LOGP, OLD, ADV, MASK, level=level)
    np.testing.assert_allclose(grad(_loss("sapo", **options), f32(PADDED)), expected_grad, rtol=1e-5, atol=1e-7)


def test_sapo_equals_verls_with_per_token_advantages_and_its_temperatures():
    tau = (0.8, 1.3)
    expected = PK.verl_sapo_loss(LOGP, OLD, TOKEN_ADV, MASK, tau_pos=tau[0], tau_neg=tau[1])
    loss = _loss("sapo", "sequence_mean", TOKEN_ADV, sapo_tau=tau)
    np.testing.assert_allclose(float(loss(f32(LOGP))), expected, rtol=1e-5)
    expected_grad = PK.verl_sapo_per_token_loss_grad(LOGP, OLD, TOKEN_ADV, MASK, tau_pos=tau[0], tau_neg=tau[1])
    np.testing.assert_allclose(
        grad(_loss("sapo", "sum", TOKEN_ADV, sapo_tau=tau), f32(LOGP)), expected_grad, rtol=1e-5, atol=1e-7
    )


# ------------------------------------------------------------------ GMPO


def test_gmpo_equals_trls_at_its_default_clip():
    # clip=None is GMPO's own (0.4, 0.4), TRL's.
    loss = _loss("gmpo", "sequence_mean")
    np.testing.assert_allclose(float(loss(f32(PADDED))), PK.trl_gmpo_loss(LOGP, OLD, ADV, MASK), rtol=1e-5)
    np.testing.assert_allclose(
        grad(loss, f32(PADDED)), PK.trl_gmpo_loss_grad(LOGP, OLD, ADV, MASK), rtol=1e-5, atol=1e-8
    )
    per_sequence = PK.trl_gmpo_per_sequence_loss(LOGP, OLD, ADV, MASK)
    np.testing.assert_allclose(to_numpy(_loss("gmpo", "none")(f32(LOGP))), per_sequence[:, None] * MASK, rtol=1e-5)


def test_gmpo_equals_verls_with_its_clip_and_clips_on_the_advantages_side_only():
    old = LOGP + RNG.normal(scale=0.6, size=(B, T))  # log-ratios past ±0.2
    expected = PK.verl_gmpo_loss(LOGP, old, np.tile(ADV[:, None], (1, T)), MASK)

    def loss(x):
        return P.policy_loss(x, f32(old), f32(ADV), kind="gmpo", clip=(0.2, 0.2), mask=MASK, reduction="sequence_mean")

    np.testing.assert_allclose(float(loss(f32(LOGP))), expected, rtol=1e-5)
    expected_grad = PK.verl_gmpo_loss_grad(LOGP, old, np.tile(ADV[:, None], (1, T)), MASK)
    g = grad(loss, f32(LOGP))
    np.testing.assert_allclose(g, expected_grad, rtol=1e-4, atol=1e-8)
    assert ((g == 0) & (MASK > 0)).any()  # some token clipped


# ------------------------------------------------------------------ VESPO


@pytest.mark.parametrize("advantages", ["sequence", "token"])
def test_vespo_equals_trls_gamma_weighted_loss(advantages):
    a = ADV if advantages == "sequence" else TOKEN_ADV
    old = LOGP + RNG.normal(scale=0.1, size=(B, T))  # w near 1: φ neither 0 nor huge
    options = {"vespo_k": (2.0, 3.0), "vespo_lambda": (3.0, 2.0)}

    def loss(x, reduction="mean"):
        return P.policy_loss(x, f32(old), f32(a), kind="vespo", mask=MASK, reduction=reduction, **options)

    np.testing.assert_allclose(float(loss(f32(PADDED))), PK.trl_vespo_loss(LOGP, old, a, MASK), rtol=1e-5)
    per_token = PK.trl_vespo_per_token_loss(LOGP, old, a, MASK)
    np.testing.assert_allclose(to_numpy(loss(f32(LOGP), "none")), per_token * MASK, rtol=1e-5, atol=1e-7)
    expected_grad = PK.trl_vespo_per_token_loss_grad(LOGP, old, a, MASK)
    np.testing.assert_allclose(grad(lambda x: loss(x, "sum"), f32(PADDED)), expected_grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ LUSPO, Dr. GRPO


def test_luspo_is_gspo_summed_over_each_sequence():
    per_token = PK.trl_luspo_per_token_loss(LOGP, OLD, ADV, MASK, level="sequence")
    expected = PK.trl_luspo_loss(per_token, MASK, version="1.16.0")
    loss = _loss("ppo", "sequence_sum", level="sequence")
    np.testing.assert_allclose(float(loss(f32(PADDED))), expected, rtol=1e-5)
    expected_grad = PK.trl_luspo_loss_grad(LOGP, OLD, ADV, MASK, level="sequence", version="1.16.0")
    np.testing.assert_allclose(grad(loss, f32(PADDED)), expected_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("max_length", [None, 10])
def test_dr_grpos_constant_normaliser_equals_trls_and_verls(max_length):
    per_token = to_numpy(_loss("ppo", "none")(f32(LOGP)))
    expected = PK.trl_dr_grpo_aggregate(per_token, MASK, T if max_length is None else max_length)
    got = _loss("ppo", "constant", max_length=max_length)(f32(PADDED))
    np.testing.assert_allclose(float(got), expected, rtol=1e-6)
    if max_length is None:  # verl's seq-mean-token-sum-norm, no sequence empty, the padded length
        np.testing.assert_allclose(float(got), PK.verl_agg_seq_mean_token_sum_norm(per_token, MASK), rtol=1e-6)
    # The KL term of TRL's dr_grpo reads the same normaliser.
    kl = P.kl_estimate(f32(PADDED), f32(OLD), mask=MASK, reduction="constant", max_length=max_length)
    values = to_numpy(P.kl_estimate(f32(LOGP), f32(OLD), reduction="none"))
    np.testing.assert_allclose(float(kl), PK.trl_dr_grpo_aggregate(values, MASK, max_length or T), rtol=1e-6)


def test_the_constant_normaliser_counts_every_sequence_and_gives_zero_for_none_kept():
    empty = MASK.copy()
    empty[1] = 0.0
    got = P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), mask=empty, reduction="constant")
    per_token = to_numpy(P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), reduction="none"))
    np.testing.assert_allclose(float(got), (per_token * empty).sum() / (B * T), rtol=1e-6)
    none = np.zeros((B, T), "float32")
    assert float(P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), mask=none, reduction="constant")) == 0.0
    g = grad(lambda x: P.policy_loss(x, f32(OLD), f32(ADV), mask=none, reduction="constant"), f32(LOGP))
    np.testing.assert_array_equal(g, 0.0)


# ------------------------------------------------------------------ the trust region, the entropy mask


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("advantages", ["sequence", "token"])
def test_trust_region_mask_equals_verls_dppo_masks(divergence, advantages):
    a = np.tile(ADV[:, None], (1, T)) if advantages == "sequence" else TOKEN_ADV
    given = ADV if advantages == "sequence" else TOKEN_ADV
    low, high = (0.15, 0.1) if divergence == "tv" else (0.05, 0.03)
    oracle = PK.verl_dppo_tv_mask if divergence == "tv" else PK.verl_dppo_kl_mask
    expected = oracle(LOGP, OLD, a, clip_ratio_low=low, clip_ratio_high=high) * MASK
    kept = P.trust_region_mask(
        f32(PADDED), f32(OLD), f32(given), divergence=divergence, threshold=(low, high), mask=MASK
    )
    kept = to_numpy(kept)
    np.testing.assert_array_equal(kept, expected > 0)
    assert 0 < kept.sum() < MASK.sum(), "the region drops no token, or every one"
    # DPPO's loss: CISPO truncated at C on the kept tokens, over M's tokens (verl's token-mean); its clip fraction.
    mode = "dppo_tv" if divergence == "tv" else "dppo_kl"
    c = 3.0
    options = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c}
    loss = lambda x: P.policy_loss(  # noqa: E731
        x, f32(OLD), f32(given), kind="cispo", clip=(0.0, c - 1.0), weights=kept, mask=MASK
    )
    np.testing.assert_allclose(
        float(loss(f32(LOGP))), PK.verl_dppo_loss(LOGP, OLD, a, MASK, mode, **options), rtol=1e-5
    )
    expected_grad = PK.verl_dppo_per_token_loss_grad(LOGP, OLD, a, MASK, mode, **options) / MASK.sum()
    np.testing.assert_allclose(grad(loss, f32(LOGP)), expected_grad, rtol=1e-5, atol=1e-8)
    fraction = 1.0 - kept.sum() / MASK.sum()
    metrics = PK.verl_dppo_metrics(LOGP, OLD, a, MASK, mode, **options)
    np.testing.assert_allclose(fraction, metrics["actor/pg_clipfrac"], rtol=1e-6)


@pytest.mark.parametrize("top", [0.2, 0.5, 1.0])
def test_entropy_mask_equals_trls_high_entropy_mask(top):
    entropy = RNG.uniform(0.0, 3.0, size=(B, T))
    expected = PK.trl_high_entropy_mask(entropy, MASK, 1.0 - top)
    padded = np.where(MASK > 0, entropy, np.inf)
    got = to_numpy(P.entropy_mask(f32(padded), top=top, mask=MASK))
    # float32 entropies: the same order statistics, none on the quantile.
    np.testing.assert_array_equal(got, expected > 0)
    assert got.sum() == (expected > 0).sum() > 0
    assert not to_numpy(P.entropy_mask(f32(entropy), mask=np.zeros((B, T)))).any()


def test_log_sum_sq_equals_trls_from_the_same_chunks_and_carries_no_gradient():
    rng = np.random.default_rng(5)  # its own draw, whatever ran before
    hidden = rng.normal(size=(B, T, 5)).astype("float32")
    kernel = rng.normal(size=(5, 11)).astype("float32")
    labels = rng.integers(0, 11, size=(B, T))
    logits = hidden @ kernel
    expected = PK.trl_log_sum_sq_probs(logits, temperature=0.7)
    for z in (logits, P.linear(hidden, kernel)):
        for chunk_size in (None, 4):
            if chunk_size is None and not isinstance(z, np.ndarray):
                continue
            logprobs, entropy, log_sum_sq = P.token_logprobs(
                labels, z, temperature=0.7, chunk_size=chunk_size, return_entropy=True, return_log_sum_sq=True
            )
            np.testing.assert_allclose(to_numpy(log_sum_sq), expected, rtol=1e-5, atol=1e-6)
            alone = P.token_logprobs(labels, z, temperature=0.7, chunk_size=chunk_size)
            np.testing.assert_allclose(to_numpy(logprobs), to_numpy(alone), rtol=1e-6)
            p = special.softmax(logits / 0.7, axis=-1)
            np.testing.assert_allclose(to_numpy(entropy), -(p * np.log(p)).sum(-1), rtol=1e-5, atol=1e-6)
    g = grad(
        lambda h: ops.sum(P.token_logprobs(labels, P.linear(h, kernel), chunk_size=4, return_log_sum_sq=True)[1]),
        hidden,
    )
    np.testing.assert_array_equal(g, 0.0)


# ------------------------------------------------------------------ numerics and errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["sapo", "gmpo", "vespo"])
def test_finite_at_log_ratios_of_eighty(kind, dtype):
    logp = np.array([[-0.5, -80.0, -1.0], [-79.0, -0.2, -0.3]], "float32")
    old = np.array([[-80.0, -0.5, -1.0], [-0.1, -80.0, -0.3]], "float32")
    for a in ([1.0, -1.0], [-1.0, 1.0]):
        loss = lambda x, a=a: P.policy_loss(x, ops.cast(old, dtype), f32(a), kind=kind, reduction="sequence_mean")  # noqa: E731
        x = ops.cast(logp, dtype)
        value = to_numpy(loss(x))
        assert_finite(value, kind)
        assert_finite(grad(loss, x), f"{kind}'s gradient")


U = type("Untouchable", (), {"__array__": lambda self, *a, **k: (_ for _ in ()).throw(AssertionError("touched"))})()
ERRORS = {
    "sapo_tau": (
        lambda: P.policy_loss(U, U, U, kind="sapo", sapo_tau=(1.0, 0.0)),
        ValueError,
        r"`sapo_tau` must be two numbers > 0",
    ),
    "vespo_k": (
        lambda: P.policy_loss(U, U, U, kind="vespo", vespo_k=(-1.0, 1.0)),
        ValueError,
        r"`vespo_k` must be two numbers >= 0",
    ),
    "vespo_lambda": (
        lambda: P.policy_loss(U, U, U, kind="vespo", vespo_lambda=(1.0, 0.0)),
        ValueError,
        r"`vespo_lambda` must be two numbers > 0",
    ),
    "gmpo_clip": (
        lambda: P.policy_loss(U, U, U, kind="gmpo", clip=(-0.1, 0.4)),
        ValueError,
        r"`clip` must be log-ratio bounds",
    ),
    "ppo_clip": (lambda: P.policy_loss(U, U, U, clip=(1.0, 0.2)), ValueError, r"`clip` must be \(ε_low, ε_high\)"),
    "gmpo_level": (
        lambda: P.policy_loss(U, U, U, kind="gmpo", level="sequence"),
        ValueError,
        r"forms its own sequence ratio",
    ),
    "vespo_level": (lambda: P.policy_loss(U, U, U, kind="vespo", level="sequence_token"), ValueError, r"forms its own"),
    "gmpo_rank": (
        lambda: P.policy_loss(f32([0.0]), f32([0.0]), f32([1.0]), kind="gmpo"),
        ValueError,
        r"must be \[batch, tokens\]",
    ),
    "gmpo_token_advantages": (
        lambda: P.policy_loss(f32(LOGP), f32(OLD), f32(TOKEN_ADV), kind="gmpo"),
        ValueError,
        r"one advantage a sequence",
    ),
    "max_length_type": (
        lambda: P.policy_loss(U, U, U, reduction="constant", max_length=2.5),
        TypeError,
        r"`max_length`",
    ),
    "max_length_low": (
        lambda: P.policy_loss(f32(LOGP), f32(OLD), f32(ADV), reduction="constant", max_length=3),
        ValueError,
        r"`max_length` \(3\) is below the tokens axis's length \(6\)",
    ),
    "constant_rank": (
        lambda: P.kl_estimate(f32([0.0]), f32([0.0]), reduction="constant"),
        ValueError,
        r"divides by sequences × max_length",
    ),
    "reduction": (lambda: P.topk_kl(U, U, reduction="constant"), ValueError, r"`reduction` must be one of"),
    "threshold": (lambda: P.trust_region_mask(U, U, U, threshold=-0.1), ValueError, r"`threshold` must be δ or"),
    "threshold_missing": (lambda: P.trust_region_mask(U, U, U), TypeError, r"threshold"),
    "divergence": (lambda: P.trust_region_mask(U, U, U, divergence="js", threshold=0.1), ValueError, r"`divergence`"),
    "top": (lambda: P.entropy_mask(U, top=0.0), ValueError, r"`top` must be in \(0, 1\]"),
    "return_log_sum_sq": (lambda: P.token_logprobs(U, U, return_log_sum_sq=1), TypeError, r"`return_log_sum_sq`"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_names_the_argument(name):
    assert_raises_as_listed(ERRORS[name])


class _Policy(keras.Model):
    """A tiny causal LM's policy step: token_logprobs from its own head,
    fused, and `kind`'s loss against a slightly older policy."""

    def __init__(self, kind, vocab=9, hidden=4):
        super().__init__(name="policy")
        self.kind = kind
        self.embed = keras.layers.Embedding(vocab, hidden)
        self.head = keras.layers.Dense(vocab, use_bias=False)
        self.head.build((None, hidden))

    def call(self, x):
        return self.embed(x)

    def logprobs(self, x, hidden):
        return P.token_logprobs(x, P.linear(hidden, self.head.kernel), chunk_size=4)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        logprobs = self.logprobs(x, y_pred)
        old = ops.stop_gradient(logprobs) - 0.05
        return P.policy_loss(logprobs, old, ops.cast(y, "float32"), kind=self.kind, reduction="sequence_mean")


@pytest.mark.parametrize("kind", ["sapo", "gmpo"])
def test_the_new_kinds_train_in_fit_from_hidden_states(kind):
    # Compiled: the sequences with a positive advantage gain log-probability against those with a negative one
    # (Σ_i A_i · mean_t log π rises).
    tokens = RNG.integers(0, 9, size=(8, T))
    advantages = np.linspace(-1, 1, 8).astype("float32")
    keras.utils.set_random_seed(0)
    model = _Policy(kind)

    def objective():
        return float(np.sum(advantages * to_numpy(model.logprobs(tokens, model(tokens))).mean(-1)))

    before = objective()
    model.compile(keras.optimizers.Adam(0.05))
    history = model.fit(tokens, advantages, batch_size=8, epochs=5, verbose=0).history["loss"]
    assert np.isfinite(history).all(), history
    assert objective() > before + 0.1, (before, objective())


def _step(logp):
    """Every new op in one step, as a training step calls them."""
    entropy = ops.square(ops.stop_gradient(logp))
    top = ops.cast(P.entropy_mask(entropy, top=0.5, mask=MASK), "float32")
    region = ops.cast(P.trust_region_mask(logp, f32(OLD), f32(ADV), threshold=0.3, mask=MASK), "float32")
    losses = [
        P.policy_loss(logp, f32(OLD), f32(ADV), kind="sapo", weights=top, mask=MASK, reduction="sequence_mean"),
        P.policy_loss(logp, f32(OLD), f32(ADV), kind="gmpo", mask=MASK, reduction="sequence_mean"),
        P.policy_loss(logp, f32(OLD), f32(ADV), kind="vespo", mask=MASK),
        P.policy_loss(logp, f32(OLD), f32(ADV), kind="cispo", clip=(0.0, 2.0), weights=region, mask=MASK),
        P.kl_estimate(logp, f32(OLD), mask=MASK, reduction="constant", max_length=8),
    ]
    return sum(ops.cast(loss, "float32") for loss in losses)


def test_the_new_ops_under_jit_and_half_precision():
    eager = float(_step(ops.convert_to_tensor(f32(LOGP))))
    np.testing.assert_allclose(float(compiled(_step)(ops.convert_to_tensor(f32(LOGP)))), eager, rtol=1e-5)
    for dtype in ("float16", "bfloat16"):
        value = _step(ops.cast(f32(LOGP), dtype))
        np.testing.assert_allclose(float(to_numpy(value)), eager, rtol=5e-2)
        assert_finite(grad(lambda x, dtype=dtype: _step(ops.cast(x, dtype)), f32(LOGP)), dtype)


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_a_composite_under_mixed_precision_computes_in_float32_on_the_bfloat16_values(policy):
    objective = CompositeObjective(
        {
            "sapo": Term(
                "policy_loss", inputs=("logprobs", "old", "advantages"), options={"kind": "sapo", "mask": "mask"}
            ),
            "dr_kl": Term(
                "kl_estimate", 0.1, inputs=("logprobs", "old"), options={"mask": "mask", "reduction": "constant"}
            ),
        }
    )
    half = ops.cast(f32(LOGP), "bfloat16")
    inputs = {"logprobs": half, "old": f32(OLD), "advantages": f32(ADV), "mask": MASK}
    _, values = objective.compute(inputs)
    widened = ops.cast(half, "float32")
    expected = {
        "sapo": P.policy_loss(widened, f32(OLD), f32(ADV), kind="sapo", mask=MASK),
        "dr_kl": P.kl_estimate(widened, f32(OLD), mask=MASK, reduction="constant"),
    }
    for name, value in expected.items():
        np.testing.assert_allclose(float(to_numpy(values[name])), float(value), rtol=1e-6, err_msg=name)
