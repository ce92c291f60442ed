"""The preference losses TRL 1.16 added after DPO's ten kinds: bco_pair,
exo_pair, discopop and sigmoid_norm; the f-divergence scores; WPO's weights;
RPO's and ORPO's NLL; and KTO on unpaired examples (with TRL's unpaired
APO-zero).

Oracles: NumPy float64 transcriptions of TRL's and Liger's code
(tests/preference_kind_oracles.py, each citing repository, path and commit),
values and closed-form gradients. Errors before any tensor work; finite at
margins of ±1e4 in float32 and bfloat16.
"""

import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from tests import preference_kind_oracles as PK
from tests.testing import assert_finite, assert_raises_as_listed, compiled, grad, grads, to_numpy

RNG = np.random.default_rng(661)
B, TC, TR = 5, 6, 4
CHOSEN = -RNG.uniform(0.05, 1.5, size=(B, TC))
REJECTED = -RNG.uniform(0.05, 1.5, size=(B, TR))
REF_CHOSEN = CHOSEN + RNG.normal(scale=0.3, size=(B, TC))
REF_REJECTED = REJECTED + RNG.normal(scale=0.3, size=(B, TR))
CHOSEN_MASK = (RNG.uniform(size=(B, TC)) < 0.8).astype("float32")
REJECTED_MASK = (RNG.uniform(size=(B, TR)) < 0.8).astype("float32")
CHOSEN_MASK[:, 0] = REJECTED_MASK[:, 0] = 1.0  # every pair counts
BETA = 0.7


def f32(x):
    return np.asarray(x, "float32")


def _padded(values, mask):
    """A side with NaN where it is padding (it may hold anything)."""
    return f32(np.where(mask > 0, values, np.nan))


def _sums():
    """Each side's per-sequence sums over its kept tokens, as TRL forms them."""
    return [PK.trl_sequence_values(v, m)[0] for v, m in ((CHOSEN, CHOSEN_MASK), (REJECTED, REJECTED_MASK))] + [
        PK.trl_sequence_values(v, m)[0] for v, m in ((REF_CHOSEN, CHOSEN_MASK), (REF_REJECTED, REJECTED_MASK))
    ]


def _ours(kind, reduction="none", **options):
    """Our loss as a function of the policy's per-token chosen and rejected log-probabilities."""
    refs = (_padded(REF_CHOSEN, CHOSEN_MASK), _padded(REF_REJECTED, REJECTED_MASK))

    def loss(chosen, rejected):
        return P.preference_loss(
            chosen,
            rejected,
            *refs,
            kind=kind,
            beta=BETA,
            chosen_mask=CHOSEN_MASK,
            rejected_mask=REJECTED_MASK,
            reduction=reduction,
            **options,
        )

    return loss


SIDES = (_padded(CHOSEN, CHOSEN_MASK), _padded(REJECTED, REJECTED_MASK))
# Each new kind with the options it takes.
NEW_KINDS = {
    "bco_pair": {},
    "exo_pair": {"label_smoothing": 1e-3},
    "discopop": {"discopop_tau": 0.3},
    "sigmoid_norm": {},
}


def _trl_options(options):
    return {"label_smoothing": options.get("label_smoothing", 0.0), "discopop_tau": options.get("discopop_tau", 0.05)}


@pytest.mark.parametrize("kind", sorted(NEW_KINDS))
def test_new_kinds_equal_trls_values_and_gradients(kind):
    options = NEW_KINDS[kind]
    c, r, c_ref, r_ref = _sums()
    lengths = {"chosen_lengths": CHOSEN_MASK.sum(1), "rejected_lengths": REJECTED_MASK.sum(1)}
    extra = {**_trl_options(options), **(lengths if kind == "sigmoid_norm" else {})}
    expected = PK.trl_dpo_kind_loss(c, r, c_ref, r_ref, kind, BETA, **extra)
    np.testing.assert_allclose(to_numpy(_ours(kind, **options)(*SIDES)), expected, rtol=1e-5, atol=1e-7)
    d_chosen, d_rejected = PK.trl_dpo_kind_loss_grad(c, r, c_ref, r_ref, kind, BETA, **extra)
    g_chosen, g_rejected = grads(_ours(kind, "sum", **options), *SIDES)
    # A token's gradient is its sequence's (the sum's derivative is 1 a kept token).
    np.testing.assert_allclose(g_chosen, d_chosen[:, None] * CHOSEN_MASK, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_rejected, d_rejected[:, None] * REJECTED_MASK, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["bco_pair", "exo_pair", "discopop"])
def test_new_kinds_equal_ligers(kind):
    options = NEW_KINDS[kind]
    c, r, c_ref, r_ref = _sums()
    expected, _, _ = PK.liger_dpo_kind_loss(c, r, c_ref, r_ref, kind, BETA, **_trl_options(options))
    np.testing.assert_allclose(to_numpy(_ours(kind, **options)(*SIDES)), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("kind", ["sigmoid", "robust", "hinge", "exo_pair", "discopop"])
def test_f_divergence_scores_equal_trl_1_16s(kind, divergence):
    options = {**NEW_KINDS.get(kind, {}), "divergence": divergence, "alpha": 0.3}
    if kind == "robust":
        options["label_smoothing"] = 0.1
    c, r, c_ref, r_ref = _sums()
    trl = {**_trl_options(options), "f_divergence_type": divergence, "f_alpha_divergence_coef": 0.3}
    expected = PK.trl_dpo_kind_loss(c, r, c_ref, r_ref, kind, BETA, **trl)
    np.testing.assert_allclose(to_numpy(_ours(kind, **options)(*SIDES)), expected, rtol=1e-5, atol=1e-7)
    d_chosen, d_rejected = PK.trl_dpo_kind_loss_grad(c, r, c_ref, r_ref, kind, BETA, **trl)
    g_chosen, g_rejected = grads(_ours(kind, "sum", **options), *SIDES)
    np.testing.assert_allclose(g_chosen, d_chosen[:, None] * CHOSEN_MASK, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_rejected, d_rejected[:, None] * REJECTED_MASK, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["ipo", "sigmoid_norm"])
def test_the_mean_kinds_score_the_mean_log_ratio(kind):
    # TRL divides f(Σ log-ratio) by the length, which equals f(mean) for reverse_kl only; here f takes the mean
    # (a per-sequence input carries no length). Against TRL at reverse_kl, and f(mean) by hand at forward_kl.
    c, r, c_ref, r_ref = _sums()
    lengths = {"chosen_lengths": CHOSEN_MASK.sum(1), "rejected_lengths": REJECTED_MASK.sum(1)}
    expected = PK.trl_dpo_kind_loss(c, r, c_ref, r_ref, kind, BETA, **lengths)
    np.testing.assert_allclose(to_numpy(_ours(kind)(*SIDES)), expected, rtol=1e-5, atol=1e-7)
    u, v = (c - c_ref) / CHOSEN_MASK.sum(1), (r - r_ref) / REJECTED_MASK.sum(1)
    h = (1 - np.exp(-u)) - (1 - np.exp(-v))
    by_hand = (h - 1 / (2 * BETA)) ** 2 if kind == "ipo" else np.logaddexp(0.0, -BETA * h)
    np.testing.assert_allclose(to_numpy(_ours(kind, divergence="forward_kl")(*SIDES)), by_hand, rtol=1e-5)


# ------------------------------------------------------------------ NLL, WPO


def test_nll_is_rpos_sft_term_beside_dpo():
    c, r, c_ref, r_ref = _sums()
    expected = PK.trl_dpo_combined_loss(
        c,
        r,
        c_ref,
        r_ref,
        ["sigmoid", "sft"],
        BETA,
        loss_weights=[1.0, 0.4],
        chosen_per_token_logps=CHOSEN,
        chosen_mask=CHOSEN_MASK,
    )
    np.testing.assert_allclose(float(_ours("sigmoid", "mean", nll=0.4)(*SIDES)), expected, rtol=1e-5)
    # The NLL's gradient is TRL's token mean's, beside DPO's.
    with_nll, without = (grads(_ours("sigmoid", "mean", nll=a), *SIDES)[0] for a in (0.4, 0.0))
    np.testing.assert_allclose(with_nll - without, 0.4 * PK.trl_sft_nll_grad(CHOSEN, CHOSEN_MASK), rtol=1e-5, atol=1e-7)


def test_orpo_with_its_nll_is_trls_and_ligers_orpo_loss():
    def ours(chosen, rejected):
        return P.preference_loss(
            chosen, rejected, kind="orpo", beta=BETA, nll=1.0, chosen_mask=CHOSEN_MASK, rejected_mask=REJECTED_MASK
        )

    # Our NLL reads the chosen mask (TRL's ORPO reads prompt and response: the same mask given to both here).
    trl = PK.trl_orpo_total_loss(CHOSEN, CHOSEN_MASK, REJECTED, REJECTED_MASK, beta=BETA)
    liger = PK.liger_orpo_total_loss(CHOSEN, CHOSEN_MASK, REJECTED, REJECTED_MASK, beta=BETA)
    np.testing.assert_allclose(float(ours(*SIDES)), trl, rtol=1e-5)
    np.testing.assert_allclose(float(ours(*SIDES)), liger, rtol=1e-5)


def test_wpo_weights_equal_trls_and_leave_the_nll_unweighted():
    logits_c, logits_r = RNG.normal(size=(B, TC, 7)), RNG.normal(size=(B, TR, 7))
    sq_c, sq_r = PK.trl_log_sum_sq_probs(logits_c), PK.trl_log_sum_sq_probs(logits_r)
    weights = PK.trl_wpo_weights(CHOSEN, sq_c, CHOSEN_MASK, REJECTED, sq_r, REJECTED_MASK)
    c, r, c_ref, r_ref = _sums()
    expected = PK.trl_dpo_combined_loss(c, r, c_ref, r_ref, ["sigmoid"], BETA, wpo_weights=weights)
    options = {"chosen_log_sum_sq": f32(sq_c), "rejected_log_sum_sq": f32(sq_r)}
    np.testing.assert_allclose(float(_ours("sigmoid", "mean", **options)(*SIDES)), expected, rtol=1e-5)
    nll = PK.trl_sft_nll(CHOSEN, CHOSEN_MASK)
    np.testing.assert_allclose(
        float(_ours("sigmoid", "mean", nll=0.5, **options)(*SIDES)), expected + 0.5 * nll, rtol=1e-5
    )
    # The weights are constants: the gradient is the weighted DPO gradient.
    d_chosen, _ = PK.trl_dpo_kind_loss_grad(c, r, c_ref, r_ref, "sigmoid", BETA)
    g = grads(_ours("sigmoid", "sum", **options), *SIDES)[0]
    np.testing.assert_allclose(g, (weights * d_chosen)[:, None] * CHOSEN_MASK, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ KTO

N, T = 6, 5
LOGP = -RNG.uniform(0.05, 1.5, size=(N, T))
REF = LOGP + RNG.normal(scale=0.4, size=(N, T))
MASK = (RNG.uniform(size=(N, T)) < 0.8).astype("float32")
MASK[:, 0] = 1.0
DESIRABLE = np.array([1, 0, 1, 1, 0, 0])
# Mismatched pairs: each prompt with the previous example's completion, as TRL builds them.
KL_LOGP = LOGP[np.roll(np.arange(N), 1)] + 0.3
KL_REF = REF[np.roll(np.arange(N), 1)]
KL_MASK = MASK[np.roll(np.arange(N), 1)]


def _kto(kind="kto", reduction="mean", **options):
    def loss(logprobs):
        return P.unpaired_preference_loss(
            logprobs, _padded(REF, MASK), DESIRABLE, kind=kind, beta=BETA, mask=MASK, reduction=reduction, **options
        )

    return loss


def _sum(values, mask):
    return PK.trl_sequence_values(values, mask)[0]


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.5, 0.5)])
def test_kto_equals_trls_with_its_kl_baseline_from_mismatched_pairs(weights):
    options = {
        "kl_logprobs": _padded(KL_LOGP, KL_MASK),
        "ref_kl_logprobs": _padded(KL_REF, KL_MASK),
        "kl_mask": KL_MASK,
        "desirable_weight": weights[0],
        "undesirable_weight": weights[1],
    }
    args = (_sum(LOGP, MASK), _sum(REF, MASK), DESIRABLE.astype(bool), _sum(KL_LOGP, KL_MASK), _sum(KL_REF, KL_MASK))
    trl = {"beta": BETA, "desirable_weight": weights[0], "undesirable_weight": weights[1]}
    loss, losses, kl = PK.trl_kto_loss(*args, **trl)
    assert kl > 0  # the baseline is not clamped here
    np.testing.assert_allclose(float(_kto(**options)(_padded(LOGP, MASK))), loss, rtol=1e-5)
    order = np.concatenate([np.flatnonzero(DESIRABLE), np.flatnonzero(DESIRABLE == 0)])
    np.testing.assert_allclose(
        to_numpy(_kto(reduction="none", **options)(_padded(LOGP, MASK)))[order], losses, rtol=1e-5
    )
    expected_grad = PK.trl_kto_loss_grad(*args, **trl)
    np.testing.assert_allclose(
        grad(_kto(**options), _padded(LOGP, MASK)), expected_grad[:, None] * MASK, rtol=1e-5, atol=1e-8
    )


def test_kto_clamps_its_baseline_at_zero_and_takes_one_given_as_is():
    below = {"kl_logprobs": f32(_sum(KL_REF, KL_MASK) - 1.0), "ref_kl_logprobs": f32(_sum(KL_REF, KL_MASK))}
    np.testing.assert_allclose(float(_kto(**below)(f32(LOGP))), float(_kto(kl_baseline=0.0)(f32(LOGP))), rtol=1e-6)
    # Liger's KTO takes its kl as given (no clamp, no weights): a negative one too.
    expected, _, _, _ = PK.liger_kto_loss(_sum(LOGP, MASK), _sum(REF, MASK), DESIRABLE, beta=BETA, kl=-0.3)
    np.testing.assert_allclose(float(_kto(kl_baseline=-0.3)(f32(LOGP))), expected, rtol=1e-5)


def test_unpaired_apo_zero_equals_trls():
    args = (_sum(LOGP, MASK), _sum(REF, MASK), DESIRABLE.astype(bool))
    loss, _, _ = PK.trl_kto_loss(*args, beta=BETA, loss_type="apo_zero_unpaired")
    np.testing.assert_allclose(float(_kto("apo_zero_unpaired")(_padded(LOGP, MASK))), loss, rtol=1e-5)
    expected_grad = PK.trl_kto_loss_grad(*args, beta=BETA, loss_type="apo_zero_unpaired")
    g = grad(_kto("apo_zero_unpaired"), _padded(LOGP, MASK))
    np.testing.assert_allclose(g, expected_grad[:, None] * MASK, rtol=1e-5, atol=1e-8)


def test_kto_is_a_term_by_name_with_its_tensor_options_inputs():
    objective = CompositeObjective(
        {
            "kto": Term(
                "unpaired_preference_loss",
                inputs=("logprobs", "ref", "desirable"),
                options={"mask": "mask", "kl_baseline": "z0", "beta": BETA},
            )
        }
    )
    inputs = {"logprobs": f32(LOGP), "ref": f32(REF), "desirable": f32(DESIRABLE), "mask": MASK, "z0": f32(0.2)}
    _, values = objective.compute(inputs)
    np.testing.assert_allclose(float(to_numpy(values["kto"])), float(_kto(kl_baseline=0.2)(f32(LOGP))), rtol=1e-6)


def test_an_example_with_no_kept_token_does_not_count():
    mask = MASK.copy()
    mask[1] = 0.0
    got = P.unpaired_preference_loss(
        f32(LOGP), f32(REF), DESIRABLE, beta=BETA, kl_baseline=0.1, mask=mask, reduction="none"
    )
    assert float(to_numpy(got)[1]) == 0.0
    mean = P.unpaired_preference_loss(f32(LOGP), f32(REF), DESIRABLE, beta=BETA, kl_baseline=0.1, mask=mask)
    np.testing.assert_allclose(float(mean), to_numpy(got).sum() / (N - 1), rtol=1e-6)


# ------------------------------------------------------------------ rewards, numerics, errors


def test_rewards_of_the_new_kinds_read_their_sequence_values():
    # sigmoid_norm's values are means: the margin is β·(mean log-ratio of the chosen − of the rejected).
    c, r, c_ref, r_ref = _sums()
    u, v = (c - c_ref) / CHOSEN_MASK.sum(1), (r - r_ref) / REJECTED_MASK.sum(1)
    got = P.preference_reward(
        *SIDES,
        _padded(REF_CHOSEN, CHOSEN_MASK),
        _padded(REF_REJECTED, REJECTED_MASK),
        kind="sigmoid_norm",
        beta=BETA,
        chosen_mask=CHOSEN_MASK,
        rejected_mask=REJECTED_MASK,
    )
    np.testing.assert_allclose(float(got), np.mean(BETA * (u - v)), rtol=1e-5)


MARGINS = [(1e4, -1e4), (-1e4, 1e4)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "kind, options",
    [(k, o) for k, o in NEW_KINDS.items()]
    + [("sigmoid", {"divergence": d}) for d in ("forward_kl", "js_divergence", "alpha_divergence")]
    + [("ipo", {"divergence": "forward_kl"}), ("orpo", {"nll": 1.0})],
)
def test_finite_at_margins_of_ten_thousand(kind, options, dtype):
    for chosen, rejected in MARGINS:
        c, r = ops.cast(f32([[chosen, 0.0]]), dtype), ops.cast(f32([[rejected, 0.0]]), dtype)
        refs = () if kind == "orpo" else (ops.zeros_like(c), ops.zeros_like(r))
        if kind == "orpo":  # log-probabilities are ≤ 0
            c, r = -ops.abs(c), -ops.abs(r)

        def loss(a, b, refs=refs):
            return P.preference_loss(a, b, *refs, kind=kind, beta=BETA, **options)

        assert_finite(to_numpy(loss(c, r)), kind)
        for g in grads(loss, c, r):
            assert_finite(g, f"{kind}'s gradient")
    for delta in (1e4, -1e4):
        lp = ops.cast(f32([delta, -delta]), dtype)
        kto = lambda x: P.unpaired_preference_loss(x, ops.zeros_like(x), [1, 0], kl_baseline=0.5)  # noqa: E731
        assert_finite(to_numpy(kto(lp)), "kto")
        assert_finite(grad(kto, lp), "kto's gradient")


U = type("Untouchable", (), {"__array__": lambda self, *a, **k: (_ for _ in ()).throw(AssertionError("touched"))})()
S = f32(CHOSEN[:2, :3])
ERRORS = {
    "divergence": (lambda: P.preference_loss(U, U, divergence="kl"), ValueError, r"`divergence` must be one of"),
    "divergence_kind": (
        lambda: P.preference_loss(U, U, kind="nca_pair", divergence="forward_kl"),
        ValueError,
        r"`divergence='forward_kl'` scores h: kind='nca_pair' is not built on it",
    ),
    "alpha": (lambda: P.preference_loss(U, U, alpha=float("nan")), ValueError, r"`alpha` must be finite"),
    "exo_epsilon": (lambda: P.preference_loss(U, U, kind="exo_pair"), ValueError, r"needs `label_smoothing` > 0"),
    "discopop_tau": (lambda: P.preference_loss(U, U, kind="discopop", discopop_tau=0.0), ValueError, r"`discopop_tau`"),
    "nll": (lambda: P.preference_loss(U, U, nll=-1.0), ValueError, r"`nll` must be >= 0"),
    "nll_none": (lambda: P.preference_loss(U, U, nll=0.5, reduction="none"), ValueError, r"`nll` adds a token mean"),
    "nll_per_sequence": (lambda: P.preference_loss(S[:, 0], S[:, 0], nll=0.5), ValueError, r"`nll` needs per-token"),
    "wpo_one_side": (lambda: P.preference_loss(U, U, chosen_log_sum_sq=U), ValueError, r"come together \(WPO"),
    "wpo_shape": (
        lambda: P.preference_loss(S, S, chosen_log_sum_sq=S[:, :2], rejected_log_sum_sq=S),
        ValueError,
        r"`chosen_logprobs` and `chosen_log_sum_sq` must have the same shape",
    ),
    "wpo_per_sequence": (
        lambda: P.preference_loss(S[:, 0], S, chosen_log_sum_sq=S[:, 0], rejected_log_sum_sq=S),
        ValueError,
        r"`chosen_log_sum_sq` weighs per-token",
    ),
    "kto_no_source": (
        lambda: P.unpaired_preference_loss(U, U, U),
        ValueError,
        r"needs its KL baseline z₀ from one source",
    ),
    "kto_both_sources": (
        lambda: P.unpaired_preference_loss(U, U, U, kl_logprobs=U, ref_kl_logprobs=U, kl_baseline=0.0),
        ValueError,
        r"not both",
    ),
    "kl_pair": (lambda: P.unpaired_preference_loss(U, U, U, kl_logprobs=U), ValueError, r"come together"),
    "apo_zero_kl": (
        lambda: P.unpaired_preference_loss(U, U, U, kind="apo_zero_unpaired", kl_baseline=0.0),
        ValueError,
        r"has no KL baseline",
    ),
    "weight": (lambda: P.unpaired_preference_loss(U, U, U, desirable_weight=-1.0), ValueError, r"`desirable_weight`"),
    "kind": (lambda: P.unpaired_preference_loss(U, U, U, kind="kto_pair"), ValueError, r"`kind` must be one of"),
    "desirable": (
        lambda: P.unpaired_preference_loss(S, S, [[1, 0]], kl_baseline=0.0),
        ValueError,
        r"`desirable` must be \[batch\]",
    ),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_names_the_argument(name):
    assert_raises_as_listed(ERRORS[name])


def test_log_sum_sq_from_token_logprobs_feeds_wpo():
    # The end to end: token_logprobs' log Σp² of the same logits.
    logits = RNG.normal(size=(B, TC, 7)).astype("float32")
    labels = RNG.integers(0, 7, size=(B, TC))
    logprobs, sq = P.token_logprobs(labels, logits, return_log_sum_sq=True)
    expected = special.logsumexp(2 * logits, -1) - 2 * special.logsumexp(logits, -1)
    np.testing.assert_allclose(to_numpy(sq), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(sq), PK.trl_log_sum_sq_probs(logits), rtol=1e-5, atol=1e-6)
    assert to_numpy(logprobs).shape == (B, TC)


def _preference_step(chosen, rejected):
    """The new preference losses in one step."""
    refs = (f32(REF_CHOSEN), f32(REF_REJECTED))
    masks = {"chosen_mask": CHOSEN_MASK, "rejected_mask": REJECTED_MASK, "beta": BETA}
    sq = {"chosen_log_sum_sq": f32(CHOSEN - 0.5), "rejected_log_sum_sq": f32(REJECTED - 0.5)}
    losses = [
        P.preference_loss(chosen, rejected, *refs, kind="discopop", divergence="js_divergence", **masks),
        P.preference_loss(chosen, rejected, *refs, kind="sigmoid_norm", nll=0.3, **masks, **sq),
        P.preference_loss(chosen, rejected, *refs, kind="exo_pair", label_smoothing=0.01, **masks),
        P.unpaired_preference_loss(
            chosen,
            refs[0],
            [1, 0, 1, 0, 1],
            kl_logprobs=rejected,
            ref_kl_logprobs=refs[1],
            mask=CHOSEN_MASK,
            kl_mask=REJECTED_MASK,
            beta=BETA,
        ),
    ]
    return sum(ops.cast(loss, "float32") for loss in losses)


def test_the_new_losses_under_jit_and_half_precision():
    eager = float(_preference_step(*(ops.convert_to_tensor(f32(x)) for x in (CHOSEN, REJECTED))))
    jitted = compiled(_preference_step)(*(ops.convert_to_tensor(f32(x)) for x in (CHOSEN, REJECTED)))
    np.testing.assert_allclose(float(jitted), eager, rtol=1e-5)
    for dtype in ("float16", "bfloat16"):
        value = _preference_step(ops.cast(f32(CHOSEN), dtype), ops.cast(f32(REJECTED), dtype))
        np.testing.assert_allclose(float(to_numpy(value)), eager, rtol=5e-2)
        for g in grads(
            lambda c, r, dtype=dtype: _preference_step(ops.cast(c, dtype), ops.cast(r, dtype)),
            f32(CHOSEN),
            f32(REJECTED),
        ):
            assert_finite(g, dtype)
