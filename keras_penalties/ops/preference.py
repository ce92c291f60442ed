"""Preference optimisation from log-probabilities: DPO and its family (IPO,
cDPO, robust DPO, hinge, NCA, SPPO, APO, SimPO, ORPO, BCO, EXO, DiscoPOP),
with TRL's f-divergence scores, WPO's weights and RPO's NLL, and the rewards
TRL logs beside them.

Each side of a pair (the chosen and the rejected completion) is given per
token ([batch, tokens], its own length and mask) or per sequence
([batch]). A sequence's value is the sum of its kept tokens' log-
probabilities, or their mean for `"ipo"`, `"simpo"`, `"orpo"` and
`"sigmoid_norm"`, as TRL computes them. With c, r the policy's chosen and rejected values, c_ref,
r_ref the reference's (0 when no reference is given: reference free) and
h = (c − c_ref) − (r − r_ref). Computed in float32 (float64 stays float64),
returned in the chosen side's dtype.
"""

from typing import get_args

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import (
    PreferenceDivergence,
    PreferenceKind,
    PreferenceStatistic,
    Reduction,
    Tensor,
    TensorLike,
)
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _preference_kinds as kinds
from keras_penalties.ops import _reductions as reductions

PREFERENCE_KINDS = get_args(PreferenceKind)
PREFERENCE_STATISTICS = get_args(PreferenceStatistic)
DIVERGENCES = get_args(PreferenceDivergence)


def _sides(chosen, rejected, refs, masks):
    """The four log-probability inputs as tensors (references None when not
    given) and the two masks as bools (None: every token), checked."""
    names = ("chosen_logprobs", "rejected_logprobs", "ref_chosen_logprobs", "ref_rejected_logprobs")
    tensors = [None if t is None else backend.as_tensor(t) for t in (chosen, rejected, *refs)]
    for name, t in zip(names, tensors):
        if t is not None and len(t.shape) not in (1, 2):
            raise ValueError(
                f"`{name}` must be per token [batch, tokens] or per sequence [batch]; got shape {tuple(t.shape)}."
            )
    batch = tensors[0].shape[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t is not None and batch is not None and t.shape[0] is not None and t.shape[0] != batch:
            raise ValueError(f"`{name}` must hold {batch} pairs, as `chosen_logprobs`; got shape {tuple(t.shape)}.")
    bools = []
    for side, (name, mask) in enumerate(zip(("chosen_mask", "rejected_mask"), masks)):
        like = tensors[side]
        if mask is not None and len(like.shape) != 2:
            raise ValueError(f"`{name}` masks per-token log-probabilities; `{names[side]}` is per sequence.")
        bools.append(reductions.sample_mask(mask, like, None, name))
        ref = tensors[side + 2]
        if ref is not None and len(ref.shape) == 2:
            if len(like.shape) != 2:
                raise ValueError(
                    f"`{names[side + 2]}` is per token but `{names[side]}` is per sequence: its tokens (padding "
                    f"included) would be summed with no mask; give it per sequence ([batch]), or both per token."
                )
            check.check_same_shape((names[side], names[side + 2]), like, ref)
    return tensors, bools


def _sequence(values, mask, mean, compute):
    """A side's per-sequence values: as given ([batch]), or the sum (or the
    mean) of its kept tokens; and whether each sequence keeps a token."""
    values = ops.cast(values, compute)
    if len(values.shape) == 1:
        return values, None
    kept = ops.ones_like(values) if mask is None else ops.cast(mask, compute)
    # A masked token may hold anything (padding at -inf): 0 there.
    total = ops.sum(ops.where(kept > 0, values, ops.zeros_like(values)), axis=1)
    count = ops.sum(kept, axis=1)
    return (total / ops.maximum(count, 1.0) if mean else total), count > 0


def _pairs(chosen, rejected, refs, masks, kind):
    """(c, r, c_ref, r_ref, valid, compute, dtype, sides) per pair; `sides`
    the two per-token (or per-sequence) inputs and their masks."""
    tensors, bools = _sides(chosen, rejected, refs, masks)
    compute, dtype = dtypes.dtype_pair([tensors[0]])
    mean = kinds.KINDS[kind].mean
    c, c_kept = _sequence(tensors[0], bools[0], mean, compute)
    r, r_kept = _sequence(tensors[1], bools[1], mean, compute)
    refs = [None if t is None else _sequence(t, bools[i], mean, compute)[0] for i, t in enumerate(tensors[2:])]
    c_ref, r_ref = (ops.stop_gradient(t) if t is not None else ops.zeros_like(c) for t in refs)
    kept = [k for k in (c_kept, r_kept) if k is not None]
    valid = ops.logical_and(*kept) if len(kept) == 2 else (kept[0] if kept else None)
    return c, r, c_ref, r_ref, valid, compute, dtype, (tensors[:2], bools)


def _check_references(kind, refs):
    given = [t is not None for t in refs]
    if any(given) and not all(given):
        raise ValueError(
            "`ref_chosen_logprobs` and `ref_rejected_logprobs` come together: give both, or neither (reference free)."
        )
    if all(given) and kinds.KINDS[kind].reference_free:
        raise ValueError(
            f"`kind={kind!r}` is reference free: leave `ref_chosen_logprobs` and `ref_rejected_logprobs` None."
        )


def _check_options(kind, divergence, epsilon, nll, reduction, log_sum_sq):
    """The options a kind refuses, before any tensor work."""
    kinds.check_options(kind, divergence, epsilon)
    if nll > 0.0 and reduction == "none":
        raise ValueError("`nll` adds a token mean to the reduced loss: use reduction='mean' or 'sum', or nll=0.")
    if (log_sum_sq[0] is None) != (log_sum_sq[1] is None):
        raise ValueError("`chosen_log_sum_sq` and `rejected_log_sum_sq` come together (WPO's weights): give both.")


def _chosen_nll(chosen, mask, valid, compute):
    """The mean of −logprobs over the kept chosen tokens of the pairs that
    count (RPO's and ORPO's NLL: TRL's `sft` token mean)."""
    if len(chosen.shape) != 2:
        raise ValueError("`nll` needs per-token `chosen_logprobs` [batch, tokens]; they are per sequence.")
    kept = ops.ones(ops.shape(chosen), "bool") if mask is None else mask
    if valid is not None:
        kept = ops.logical_and(kept, ops.expand_dims(valid, -1))
    values = ops.cast(reductions.fill_masked(chosen, kept), compute)
    count = ops.sum(ops.cast(kept, compute))
    return -ops.sum(values) / ops.cast(reductions.kept_divisor(count), compute)


def _wpo_weights(sides, masks, log_sum_sq, compute):
    """WPO's weight of each pair, w_c·w_r, w = exp(mean over a side's kept
    tokens of (logprobs − log Σp²)), a constant."""
    names = (("chosen_logprobs", "chosen_log_sum_sq"), ("rejected_logprobs", "rejected_log_sum_sq"))
    weight = None
    for (name, sq_name), side, mask, sq in zip(names, sides, masks, log_sum_sq):
        sq = backend.as_tensor(sq)
        if len(side.shape) != 2:
            raise ValueError(f"`{sq_name}` weighs per-token log-probabilities; `{name}` is per sequence.")
        check.check_same_shape((name, sq_name), side, sq)
        gap = reductions.fill_masked(ops.cast(side, compute) - ops.cast(sq, compute), mask)
        w = ops.exp(_sequence(ops.stop_gradient(gap), mask, True, compute)[0])
        weight = w if weight is None else weight * w
    return weight


def _over_pairs(values, valid, reduction):
    """Per-pair values reduced over the pairs that keep a token on both
    sides (0 for the others, which do not count in `"mean"`)."""
    # Every pair kept where nothing is masked: a mean is then still the
    # global batch's within a composite (`reductions.kept_divisor`).
    valid = ops.ones_like(values, dtype="bool") if valid is None else valid
    return reductions.masked_reduce(values, valid, reduction)


@check.options(
    tensors=("chosen_mask", "rejected_mask", "chosen_log_sum_sq", "rejected_log_sum_sq"),
    kind=check.choice(*PREFERENCE_KINDS),
    beta=check.positive,
    label_smoothing=check.below_half,
    gamma=check.non_negative,
    reduction=check.REDUCTION,
    divergence=check.choice(*DIVERGENCES),
    alpha=check.number,
    discopop_tau=check.positive,
    nll=check.non_negative,
)
def preference_loss(
    chosen_logprobs: TensorLike,
    rejected_logprobs: TensorLike,
    ref_chosen_logprobs: TensorLike | None = None,
    ref_rejected_logprobs: TensorLike | None = None,
    *,
    kind: PreferenceKind = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    chosen_mask: TensorLike | None = None,
    rejected_mask: TensorLike | None = None,
    reduction: Reduction = "mean",
    divergence: PreferenceDivergence = "reverse_kl",
    alpha: float = 0.5,
    discopop_tau: float = 0.05,
    nll: float = 0.0,
    chosen_log_sum_sq: TensorLike | None = None,
    rejected_log_sum_sq: TensorLike | None = None,
) -> Tensor:
    """The preference loss of chosen/rejected pairs, to minimise.

    With ε = `label_smoothing` and x = βh, each pair's loss:
    `"sigmoid"` (DPO; cDPO with ε) −(1−ε)·logσ(x) − ε·logσ(−x);
    `"robust"` (−(1−ε)·logσ(x) + ε·logσ(−x)) / (1 − 2ε);
    `"hinge"` max(0, 1 − x); `"ipo"` (h − 1/(2β))²;
    `"nca_pair"` −logσ(β(c − c_ref)) − ½logσ(−β(c − c_ref)) − ½logσ(−β(r − r_ref));
    `"sppo_hard"` (c − c_ref − 1/(2β))² + (r − r_ref + 1/(2β))²;
    `"apo_zero"` 1 − σ(β(c − c_ref)) + σ(β(r − r_ref));
    `"apo_down"` σ(β(c − c_ref)) + 1 − σ(βh);
    `"simpo"` (reference free; γ the target margin)
    −(1−ε)·logσ(β(c − r) − γ) − ε·logσ(γ − β(c − r));
    `"orpo"` (reference free; the odds-ratio term: with `nll=1.0` TRL's
    ORPO loss) −β·logσ((c − r) − (log(1 − e^c) − log(1 − e^r))), log(1 − e^x)
    formed at x ≤ −1e-7, so value and gradient stay finite as c or r → 0;
    `"bco_pair"` −logσ(β(c − c_ref)) − logσ(−β(r − r_ref));
    `"exo_pair"` (ε > 0) σ(x)·(logσ(x) − log(1 − ε)) + σ(−x)·(logσ(−x) − log ε);
    `"discopop"` (1 − σ(x/τ))·(−logσ(x)) + σ(x/τ)·e^{−x}, τ = `discopop_tau`,
    its last term formed as exp(logσ(x/τ) − x) (finite at any margin);
    `"sigmoid_norm"` −logσ(x), each side's value the mean of its tokens.

    The kinds built on h (sigmoid, robust, hinge, ipo, exo_pair, discopop,
    sigmoid_norm) take TRL's `f_divergence_type` as `divergence`: h =
    f(c − c_ref) − f(r − r_ref) with f(Δ) Δ (`"reverse_kl"`), 1 − e^{−Δ}
    (`"forward_kl"`), ln 2 + logσ(Δ) (`"js_divergence"`) or (e^{(α−1)Δ} −
    1)/(α − 1) (`"alpha_divergence"`, α = `alpha`), exponents clamped at 40.

    A pair whose chosen or rejected side keeps no token gives 0 and does not
    count (TRL drops such examples). The references are constants; an option
    a kind does not use (ε, γ, τ) is ignored. `nll=α` adds α times the mean
    of −logprobs over the kept chosen tokens of the pairs that count (RPO's
    `rpo_alpha`, TRL's `sft` term; ORPO's NLL), with its gradient.
    `chosen_log_sum_sq` and `rejected_log_sum_sq` (from `token_logprobs(...,
    return_log_sum_sq=True)`) weigh each pair's loss by WPO's constant
    w_c·w_r, w = exp(mean over a side's kept tokens of (logprobs −
    log_sum_sq)); the NLL is not weighted.

    Args:
        chosen_logprobs, rejected_logprobs: the policy's log-probabilities
            of each pair's chosen and rejected completion: per token
            [batch, tokens] (each side its own length; `token_logprobs`) or
            per sequence [batch].
        ref_chosen_logprobs, ref_rejected_logprobs: the reference model's,
            per token (reduced with the same masks) or per sequence (TRL's
            precomputed reference log-probabilities); both None: reference
            free.
        kind: one of the above (TRL's `loss_type` names).
        beta: β > 0.
        label_smoothing: ε in [0, ½) (`"sigmoid"`, `"robust"`, `"simpo"`;
            > 0 for `"exo_pair"`).
        gamma: SimPO's target margin γ ≥ 0.
        chosen_mask, rejected_mask: None, or each side's kept tokens (its
            per-token log-probabilities' shape).
        reduction: `"mean"` over the pairs that count (0 when none does),
            `"sum"`, or `"none"` ([batch]).
        divergence: `"reverse_kl"`, `"forward_kl"`, `"js_divergence"` or
            `"alpha_divergence"`, on the kinds built on h.
        alpha: α of `"alpha_divergence"` (TRL's `f_alpha_divergence_coef`).
        discopop_tau: DiscoPOP's τ > 0.
        nll: α ≥ 0, the weight of the chosen side's NLL (per-token chosen
            log-probabilities; not with `reduction="none"`).
        chosen_log_sum_sq, rejected_log_sum_sq: None, or both: each side's
            per-token log Σp², its log-probabilities' shape (WPO).

    Returns:
        The reduced loss, in the chosen side's dtype.

    Raises:
        ValueError: an unknown `kind`, `divergence` or `reduction`, β ≤ 0,
            ε outside [0, ½) (or 0 for `"exo_pair"`), γ < 0, τ ≤ 0, `nll`
            < 0 (or > 0 with per-sequence chosen log-probabilities or
            `reduction="none"`), `alpha` not finite, a `divergence` on a
            kind not built on h, references or WPO's log Σp² on one side
            only, references given to a reference-free kind, ranks other
            than 1 or 2, batch sizes or shapes that differ, a mask of
            another shape.

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> # h = (−1 − (−2)) − (−3 − (−2)) = 2, β = 0.5: −log σ(1)
    >>> round(float(P.preference_loss([-1.0], [-3.0], [-2.0], [-2.0], beta=0.5)), 6)
    0.313262
    """
    refs = (ref_chosen_logprobs, ref_rejected_logprobs)
    log_sum_sq = (chosen_log_sum_sq, rejected_log_sum_sq)
    _check_references(kind, refs)
    _check_options(kind, divergence, label_smoothing, nll, reduction, log_sum_sq)
    chosen_logprobs = backend.as_tensor(chosen_logprobs)
    if nll > 0.0 and len(chosen_logprobs.shape) != 2:
        raise ValueError("`nll` needs per-token `chosen_logprobs` [batch, tokens]; they are per sequence.")
    c, r, c_ref, r_ref, valid, compute, dtype, (sides, masks) = _pairs(
        chosen_logprobs, rejected_logprobs, refs, (chosen_mask, rejected_mask), kind
    )
    facts = kinds.KINDS[kind]
    chosen, rejected = c - c_ref, r - r_ref
    if facts.on_h:
        h = kinds.score(chosen, divergence, alpha) - kinds.score(rejected, divergence, alpha)
    else:
        h = chosen - rejected
    pair = kinds.Pair(c, r, chosen, rejected, h)
    losses = facts.loss(pair, kinds.Options(beta, label_smoothing, gamma, discopop_tau))
    if log_sum_sq[0] is not None:
        losses = losses * _wpo_weights(sides, masks, log_sum_sq, compute)
    total = _over_pairs(losses, valid, reduction)
    if nll > 0.0:
        total = total + nll * _chosen_nll(sides[0], masks[0], valid, compute)
    return dtypes.from_compute(total, dtype)


@check.options(
    tensors=("chosen_mask", "rejected_mask"),
    statistic=check.choice(*PREFERENCE_STATISTICS),
    kind=check.choice(*PREFERENCE_KINDS),
    beta=check.positive,
)
def preference_reward(
    chosen_logprobs: TensorLike,
    rejected_logprobs: TensorLike,
    ref_chosen_logprobs: TensorLike | None = None,
    ref_rejected_logprobs: TensorLike | None = None,
    *,
    statistic: PreferenceStatistic = "margin",
    kind: PreferenceKind = "sigmoid",
    beta: float = 0.1,
    chosen_mask: TensorLike | None = None,
    rejected_mask: TensorLike | None = None,
) -> Tensor:
    """TRL's reward logs of preference pairs, a constant for the logs.

    With the implicit rewards β(c − c_ref) and β(r − r_ref) (c, r and the
    references as `preference_loss` forms them for `kind`; reference free:
    β·c and β·r), the mean over the pairs that count of `"chosen"` (TRL's
    `rewards/chosen`), `"rejected"` (`rewards/rejected`), `"margin"`
    (`rewards/margins`, their difference) or `"accuracy"`
    (`rewards/accuracies`, the fraction of pairs with a positive margin).
    No gradient. A term by name in a `CompositeObjective` with weight 0
    logs it beside the loss.

    Args:
        chosen_logprobs, rejected_logprobs, ref_chosen_logprobs,
        ref_rejected_logprobs, kind, beta, chosen_mask, rejected_mask: as
            `preference_loss`'s.
        statistic: `"chosen"`, `"rejected"`, `"margin"` or `"accuracy"`.

    Returns:
        A scalar, float32 (float64 for float64 inputs).

    Example:

    >>> from keras_penalties import ops as P
    >>> # β = 0.5: rewards 0.5·(−1 + 2) = 0.5 and 0.5·(−3 + 2) = −0.5
    >>> float(P.preference_reward([-1.0], [-3.0], [-2.0], [-2.0], beta=0.5))
    1.0
    """
    refs = (ref_chosen_logprobs, ref_rejected_logprobs)
    _check_references(kind, refs)
    c, r, c_ref, r_ref, valid, _, _, _ = _pairs(
        chosen_logprobs, rejected_logprobs, refs, (chosen_mask, rejected_mask), kind
    )
    chosen, rejected = ops.stop_gradient(beta * (c - c_ref)), ops.stop_gradient(beta * (r - r_ref))
    values = {
        "chosen": chosen,
        "rejected": rejected,
        "margin": chosen - rejected,
        "accuracy": ops.cast(chosen > rejected, chosen.dtype),
    }[statistic]
    return _over_pairs(values, valid, "mean")
