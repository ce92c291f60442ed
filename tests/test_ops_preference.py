"""`ops.preference_loss` and `ops.preference_reward`: DPO and its family.

Oracles: NumPy float64 transcriptions of TRL's `DPOTrainer._compute_loss`,
CPO trainer (SimPO) and ORPO trainer and of Liger-Kernel's torch
references (tests/preference_oracles.py, each citing repository, path and
commit), values and the gradients w.r.t. each side's log-probabilities;
closed forms where those libraries dropped a form the package keeps (cDPO's
label smoothing on `"sigmoid"`). Pairs with an empty side; finite at
extreme margins, as ORPO's log(1 − e^c) meets c → 0, under bfloat16; `jit`;
a term by name with its masks as inputs; errors before any tensor work.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from tests import preference_oracles as PO
from tests.testing import assert_finite, assert_raises_as_listed, compiled, grads, to_numpy

RNG = np.random.default_rng(58)
B, TC, TR = 5, 6, 4  # pairs; the chosen and the rejected side's lengths differ
CHOSEN = -RNG.uniform(0.05, 2.0, size=(B, TC))
REJECTED = -RNG.uniform(0.05, 2.0, size=(B, TR))
REF_CHOSEN = CHOSEN + RNG.normal(scale=0.3, size=(B, TC))
REF_REJECTED = REJECTED + RNG.normal(scale=0.3, size=(B, TR))
CHOSEN_MASK = (RNG.uniform(size=(B, TC)) < 0.75).astype("float32")
REJECTED_MASK = (RNG.uniform(size=(B, TR)) < 0.75).astype("float32")
CHOSEN_MASK[:, 0] = REJECTED_MASK[:, 0] = 1.0
BETA = 0.7
REFERENCE_KINDS = ("sigmoid", "robust", "hinge", "ipo", "nca_pair", "sppo_hard", "apo_zero", "apo_down")


def f32(x):
    return np.asarray(x, "float32")


def _inputs():
    return [f32(x) for x in (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)]


def _masks():
    return {"chosen_mask": CHOSEN_MASK, "rejected_mask": REJECTED_MASK}


def _sequence(x, mask):
    return PO.trl_sequence_logps(x, mask)


def _trl(kind, smoothing):
    sides = (_sequence(CHOSEN, CHOSEN_MASK), _sequence(REJECTED, REJECTED_MASK))
    refs = (_sequence(REF_CHOSEN, CHOSEN_MASK), _sequence(REF_REJECTED, REJECTED_MASK))
    lengths = {"chosen_lengths": CHOSEN_MASK.sum(1), "rejected_lengths": REJECTED_MASK.sum(1)}
    losses = PO.trl_dpo_loss(*sides, *refs, kind, BETA, smoothing, **lengths)[0]
    grad_c, grad_r = PO.trl_dpo_loss_grad(*sides, *refs, kind, BETA, smoothing, **lengths)
    return losses, grad_c, grad_r


@pytest.mark.parametrize("kind", REFERENCE_KINDS)
def test_each_kind_equals_trls_dpo_loss_and_gradient(kind):
    smoothing = 0.1 if kind == "robust" else 0.0
    losses, grad_c, grad_r = _trl(kind, smoothing)
    options = dict(kind=kind, beta=BETA, label_smoothing=smoothing, **_masks())
    got = P.preference_loss(*_inputs(), reduction="none", **options)
    np.testing.assert_allclose(to_numpy(got), losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(P.preference_loss(*_inputs(), **options)), losses.mean(), rtol=1e-5)
    # Per token: TRL's per-sequence gradient on every kept token (the sum), over the pairs (the mean).
    c, r = grads(lambda a, b: P.preference_loss(a, b, *_inputs()[2:], **options), *_inputs()[:2])
    np.testing.assert_allclose(c, grad_c[:, None] * CHOSEN_MASK / B, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(r, grad_r[:, None] * REJECTED_MASK / B, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["sigmoid", "robust", "hinge", "nca_pair", "sppo_hard", "apo_zero", "apo_down"])
def test_per_sequence_inputs_equal_ligers_references(kind):
    sides = [f32(_sequence(x, m)) for x, m in ((CHOSEN, CHOSEN_MASK), (REJECTED, REJECTED_MASK))]
    refs = [f32(_sequence(x, m)) for x, m in ((REF_CHOSEN, CHOSEN_MASK), (REF_REJECTED, REJECTED_MASK))]
    smoothing = 0.1 if kind == "robust" else 0.0
    expected = PO.liger_dpo_loss(*sides, *refs, kind, BETA, smoothing)[0]
    got = P.preference_loss(*sides, *refs, kind=kind, beta=BETA, label_smoothing=smoothing, reduction="none")
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-6)


def test_cdpo_label_smoothing_on_sigmoid():
    # TRL's and Liger's "sigmoid" dropped cDPO's ε: its form, −(1−ε)·logσ(βh) − ε·logσ(−βh), by hand.
    sides = [_sequence(x, m) for x, m in ((CHOSEN, CHOSEN_MASK), (REJECTED, REJECTED_MASK))]
    refs = [_sequence(x, m) for x, m in ((REF_CHOSEN, CHOSEN_MASK), (REF_REJECTED, REJECTED_MASK))]
    h = BETA * ((sides[0] - refs[0]) - (sides[1] - refs[1]))
    expected = 0.8 * np.logaddexp(0.0, -h) + 0.2 * np.logaddexp(0.0, h)
    got = P.preference_loss(*_inputs(), beta=BETA, label_smoothing=0.2, reduction="none", **_masks())
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trls_and_ligers(smoothing):
    c, r = (PO.trl_get_batch_logps(x, m, True) for x, m in ((CHOSEN, CHOSEN_MASK), (REJECTED, REJECTED_MASK)))
    options = dict(kind="simpo", beta=2.0, gamma=0.6, label_smoothing=smoothing, **_masks())
    expected = PO.trl_simpo_loss(c, r, 2.0, 0.6, smoothing)[0]
    got = P.preference_loss(f32(CHOSEN), f32(REJECTED), reduction="none", **options)
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(got), PO.liger_simpo_loss(c, r, 2.0, 0.6, smoothing)[0], rtol=1e-5)
    grad_c, grad_r = PO.trl_simpo_loss_grad(c, r, 2.0, 0.6, smoothing)
    gc, gr = grads(lambda a, b: P.preference_loss(a, b, **options), f32(CHOSEN), f32(REJECTED))
    np.testing.assert_allclose(gc, grad_c[:, None] * CHOSEN_MASK / CHOSEN_MASK.sum(1, keepdims=True) / B, rtol=1e-4)
    np.testing.assert_allclose(gr, grad_r[:, None] * REJECTED_MASK / REJECTED_MASK.sum(1, keepdims=True) / B, rtol=1e-4)


def test_orpo_equals_trls_odds_ratio_and_is_finite_as_a_side_nears_zero():
    c, r = (PO.trl_get_batch_logps(x, m, True) for x, m in ((CHOSEN, CHOSEN_MASK), (REJECTED, REJECTED_MASK)))
    # TRL's term is +β·logσ(log odds), subtracted from the NLL: the loss here is its negative.
    expected = -PO.trl_orpo_odds_ratio_loss(c, r, BETA)[0]
    np.testing.assert_allclose(expected, PO.liger_orpo_loss(c, r, BETA)[0], rtol=1e-9)
    options = dict(kind="orpo", beta=BETA, **_masks())
    got = P.preference_loss(f32(CHOSEN), f32(REJECTED), reduction="none", **options)
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-7)
    grad_c, grad_r = PO.trl_orpo_odds_ratio_loss_grad(c, r, BETA)
    gc, gr = grads(lambda a, b: P.preference_loss(a, b, **options), f32(CHOSEN), f32(REJECTED))
    np.testing.assert_allclose(gc, -grad_c[:, None] * CHOSEN_MASK / CHOSEN_MASK.sum(1, keepdims=True) / B, rtol=1e-4)
    np.testing.assert_allclose(
        gr, -grad_r[:, None] * REJECTED_MASK / REJECTED_MASK.sum(1, keepdims=True) / B, rtol=1e-4
    )
    # A side whose tokens are all but certain: log(1 − e^c) at c = −1e-9 would be −inf without the clamp.
    near_zero = f32([[-1e-9, -1e-9], [-0.5, -1e-9]])
    value, (gc, gr) = (
        P.preference_loss(near_zero, f32([[-2.0, -3.0]] * 2), kind="orpo"),
        grads(lambda a, b: P.preference_loss(a, b, kind="orpo"), near_zero, f32([[-2.0, -3.0]] * 2)),
    )
    assert np.isfinite(float(value))
    assert_finite(gc, "chosen gradient")
    assert_finite(gr, "rejected gradient")


def test_rewards_equal_trls_logged_metrics():
    sides = [_sequence(x, m) for x, m in ((CHOSEN, CHOSEN_MASK), (REJECTED, REJECTED_MASK))]
    refs = [_sequence(x, m) for x, m in ((REF_CHOSEN, CHOSEN_MASK), (REF_REJECTED, REJECTED_MASK))]
    expected = PO.trl_dpo_metrics(*sides, *refs, BETA)
    for statistic, key in (
        ("chosen", "chosen"),
        ("rejected", "rejected"),
        ("margin", "margins"),
        ("accuracy", "accuracies"),
    ):
        got = P.preference_reward(*_inputs(), statistic=statistic, beta=BETA, **_masks())
        np.testing.assert_allclose(float(got), expected[f"rewards/{key}"], rtol=1e-5, atol=1e-7, err_msg=statistic)
    g = grads(lambda a, b: P.preference_reward(a, b, *_inputs()[2:], beta=BETA, **_masks()), *_inputs()[:2])
    assert all(not np.any(x) for x in g)  # a constant, for the logs


def test_a_pair_with_an_empty_side_gives_zero_and_does_not_count():
    chosen_mask = CHOSEN_MASK.copy()
    chosen_mask[2] = 0.0
    options = dict(beta=BETA, chosen_mask=chosen_mask, rejected_mask=REJECTED_MASK)
    values = to_numpy(P.preference_loss(*_inputs(), reduction="none", **options))
    assert values[2] == 0.0
    kept = np.arange(B) != 2
    np.testing.assert_allclose(float(P.preference_loss(*_inputs(), **options)), values[kept].mean(), rtol=1e-6)
    np.testing.assert_allclose(
        float(P.preference_loss(*_inputs(), reduction="sum", **options)), values.sum(), rtol=1e-6
    )
    empty = dict(beta=BETA, chosen_mask=np.zeros((B, TC)), rejected_mask=REJECTED_MASK)
    assert float(P.preference_loss(*_inputs(), **empty)) == 0.0
    for kind in ("sigmoid", "ipo", "orpo"):
        refs = _inputs()[2:] if kind != "orpo" else []
        g = grads(lambda a, b: P.preference_loss(a, b, *refs, kind=kind, **empty), *_inputs()[:2])
        assert all(np.isfinite(x).all() and not np.any(x) for x in g), kind


def test_finite_at_extreme_margins_in_bfloat16_and_under_jit():
    far = [f32(np.full((2, 3), v)) for v in (-0.01, -300.0, -300.0, -0.01)]  # h = ±600 nats
    for kind in REFERENCE_KINDS:
        for dtype in ("float32", "bfloat16"):
            value = P.preference_loss(*[ops.cast(x, dtype) for x in far], kind=kind, beta=0.5)
            assert keras.backend.standardize_dtype(value.dtype) == dtype
            assert np.isfinite(float(to_numpy(value))), (kind, dtype)
        g = grads(lambda a, b: P.preference_loss(a, b, *far[2:], kind=kind, beta=0.5), *far[:2])
        assert all(np.isfinite(x).all() for x in g), kind
    eager = float(P.preference_loss(*_inputs(), beta=BETA, **_masks()))
    jitted = compiled(lambda *x: P.preference_loss(*x, beta=BETA, **_masks()))(*_inputs())
    np.testing.assert_allclose(float(jitted), eager, rtol=1e-6)


def test_a_term_by_name_with_its_masks_and_rewards_as_inputs():
    names = ("chosen", "rejected", "ref_chosen", "ref_rejected")
    masks = {"chosen_mask": "chosen_mask", "rejected_mask": "rejected_mask", "beta": BETA}
    objective = CompositeObjective(
        {
            "dpo": Term("preference_loss", inputs=names, options=masks),
            "margin": Term("preference_reward", 0.0, inputs=names, options={"statistic": "margin", **masks}),
        }
    )
    inputs = dict(zip(names, _inputs()), **_masks())
    total, values = objective.compute(inputs)
    loss = P.preference_loss(*_inputs(), beta=BETA, **_masks())
    margin = P.preference_reward(*_inputs(), beta=BETA, **_masks())
    np.testing.assert_allclose(float(to_numpy(values["dpo"])), float(loss), rtol=1e-6)
    np.testing.assert_allclose(float(to_numpy(values["margin"])), float(margin), rtol=1e-6)
    np.testing.assert_allclose(float(to_numpy(total)), float(loss), rtol=1e-6)  # the reward term weighs 0


class Untouchable:
    """Fails if converted: option errors come before any tensor work."""

    def __array__(self, *args, **kwargs):
        raise AssertionError("the input was touched before the options were checked")


U = Untouchable()
S = np.zeros((2, 3), "float32")

ERRORS = {
    "kind": (lambda: P.preference_loss(U, U, kind="dpo"), ValueError, r"`kind` must be one of 'sigmoid'"),
    "beta": (lambda: P.preference_loss(U, U, beta=0.0), ValueError, r"`beta` must be > 0"),
    "label_smoothing": (
        lambda: P.preference_loss(U, U, label_smoothing=0.5),
        ValueError,
        r"`label_smoothing` must be in \[0, 0.5\)",
    ),
    "gamma": (lambda: P.preference_loss(U, U, kind="simpo", gamma=-1.0), ValueError, r"`gamma` must be >= 0"),
    "reduction": (lambda: P.preference_loss(U, U, reduction="batch"), ValueError, r"`reduction`"),
    "statistic": (lambda: P.preference_reward(U, U, statistic="mean"), ValueError, r"`statistic` must be one of"),
    "one_reference": (
        lambda: P.preference_loss(U, U, U),
        ValueError,
        r"`ref_chosen_logprobs` and `ref_rejected_logprobs` come together",
    ),
    "reference_free": (
        lambda: P.preference_loss(U, U, U, U, kind="simpo"),
        ValueError,
        r"`kind='simpo'` is reference free",
    ),
    "rank": (lambda: P.preference_loss(np.zeros((2, 3, 4)), S), ValueError, r"`chosen_logprobs` must be per token"),
    "pairs": (lambda: P.preference_loss(S, np.zeros((3, 3))), ValueError, r"`rejected_logprobs` must hold 2 pairs"),
    "mask_shape": (lambda: P.preference_loss(S, S, chosen_mask=np.ones((2, 4))), ValueError, r"`chosen_mask`"),
    "mask_per_sequence": (
        lambda: P.preference_loss(S[:, 0], S, chosen_mask=np.ones(2)),
        ValueError,
        r"`chosen_mask` masks per-token",
    ),
    "reference_per_token_beside_a_sequence": (
        lambda: P.preference_loss(S[:, 0], S, S, S),
        ValueError,
        r"`ref_chosen_logprobs` is per token but `chosen_logprobs` is per sequence",
    ),
    "reference_shape": (
        lambda: P.preference_loss(S, S, np.zeros((2, 4)), S),
        ValueError,
        r"`chosen_logprobs` and `ref_chosen_logprobs`",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_names_the_argument(name):
    assert_raises_as_listed(ERRORS[name])


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_fused_from_hidden_states_equals_trls_from_formed_logits(kind):
    # Both sides' per-token log-probabilities from hidden states through one head, 3 rows a chunk, against TRL's
    # selective log-softmax of the formed logits and its loss; the gradients against the same written with the
    # logits formed.
    from tests import rl_oracles as RL

    vocab, hidden = 13, 4
    rng = np.random.default_rng(7)
    states = [f32(rng.normal(size=(B, t, hidden))) for t in (TC, TR)]
    kernel = f32(rng.normal(size=(hidden, vocab)))
    labels = [rng.integers(0, vocab, size=(B, t)) for t in (TC, TR)]
    refs = [f32(rng.normal(size=B) - 8.0) for _ in range(2)]
    options = dict(kind=kind, beta=BETA, **_masks())

    def loss(hc, hr, k, fused):
        sides = []
        for h, y, m in zip((hc, hr), labels, (CHOSEN_MASK, REJECTED_MASK)):
            logits = P.linear(h, k) if fused else ops.matmul(h, k)
            sides.append(P.token_logprobs(y, logits, mask=m, chunk_size=3 if fused else None))
        return P.preference_loss(*sides, *refs, **options)

    logps = [RL.trl_selective_log_softmax(s.astype(np.float64) @ kernel, y) for s, y in zip(states, labels)]
    sides = [PO.trl_sequence_logps(lp, m) for lp, m in zip(logps, (CHOSEN_MASK, REJECTED_MASK))]
    lengths = {"chosen_lengths": CHOSEN_MASK.sum(1), "rejected_lengths": REJECTED_MASK.sum(1)}
    if kind == "ipo":  # per-sequence references are taken as means for "ipo": TRL's sums over the lengths
        trl_refs = [r * n for r, n in zip(refs, (CHOSEN_MASK.sum(1), REJECTED_MASK.sum(1)))]
    else:
        trl_refs = refs
    expected = PO.trl_dpo_loss(*sides, *trl_refs, kind, BETA, **lengths)[0].mean()
    np.testing.assert_allclose(float(loss(*states, kernel, True)), expected, rtol=1e-5)
    fused = grads(lambda hc, hr, k: loss(hc, hr, k, True), *states, kernel)
    formed = grads(lambda hc, hr, k: loss(hc, hr, k, False), *states, kernel)
    for a, b in zip(fused, formed):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
