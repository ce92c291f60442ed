"""Fine-tuning against a reference from sampled tokens' log-probabilities:
KL estimators and policy-gradient losses (PPO, GRPO, DAPO, CISPO, GSPO),
and `clip_fraction`, the fractions of tokens a PPO clip acts on, for the
logs (as `preference_reward` sits beside `preference_loss`).

Notation per sampled token: d = logprobs − ref_logprobs,
r = exp(logprobs − old_logprobs), sg = stop-gradient. Inputs are per-token
log-probabilities (`token_logprobs`, or arrays from a trainer elsewhere) of
any shape; computed in float32 (float64 stays float64) and returned in the
input's dtype. `mask` selects the tokens that count, and `reduction` is
`"mean"` (over the kept tokens), `"sum"`, `"none"`, or over the sequences of
[batch, tokens] values `"sequence_mean"` / `"sequence_sum"`.
"""

import functools
from typing import get_args

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Estimator, PolicyLevel, PolicyLoss, PolicyReduction, Tensor, TensorLike
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _policy_kinds as kinds
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _ratios as ratios
from keras_penalties.ops import _reductions as reductions

ESTIMATORS = get_args(Estimator)
POLICY_LOSSES = get_args(PolicyLoss)
POLICY_LEVELS = get_args(PolicyLevel)


def _estimate_clip(name, value):
    """None, or (low, high) with low < high."""
    if value is None:
        return None
    low, high = ratios.pair(name, value)
    if not low < high:
        raise ValueError(f"`{name}` must be (low, high) with low < high; got {value!r}.")
    return low, high


_dual_clip = check.optional(check.above_one)


def _token_values(mask, like, reduction):
    """`mask` as a bool tensor of `like`'s shape (None stays None), after the
    sequence reductions' rank check."""
    check.check_sequence_rank(reduction, len(like.shape), "`logprobs`")
    return reductions.sample_mask(mask, like, None)


def _token_weights(weights, like, dtype):
    """`weights` ([batch] or `like`'s shape) as a constant that broadcasts
    against `like`; None stays None."""
    if weights is None:
        return None
    weights = backend.as_tensor(weights)
    per_sequence = len(weights.shape) == 1 and len(like.shape) > 1
    expected = (like.shape[0],) if per_sequence else tuple(like.shape)
    if reductions.shapes_differ(tuple(weights.shape), expected):
        raise ValueError(
            f"`weights` must be per sequence ({like.shape[0]},) or per token {tuple(like.shape)}; "
            f"got {tuple(weights.shape)}."
        )
    return ratios.broadcast_advantages(weights, like, dtype)


@check.options(
    tensors=("mask", "old_logprobs"),
    prediction_first=True,
    estimator=check.choice(*ESTIMATORS),
    reduction=check.POLICY_REDUCTION,
    clip=_estimate_clip,
    max_length=kinds.checks["max_length"],
)
def kl_estimate(
    logprobs: TensorLike,
    ref_logprobs: TensorLike,
    *,
    estimator: Estimator = "k3",
    mask: TensorLike | None = None,
    reduction: PolicyReduction = "mean",
    clip: tuple[float, float] | None = None,
    old_logprobs: TensorLike | None = None,
    max_length: int | None = None,
) -> Tensor:
    """A per-token estimate of KL(π‖π_ref) from the sampled tokens' log-probabilities.

    With d = logprobs − ref_logprobs: `"k1"` d; `"abs"` |d|; `"k2"` ½d²;
    `"k3"` exp(−d) − 1 + d, computed as expm1(−d) + d (≥ 0: the
    low-variance estimator of GRPO). `"k1+"`, `"abs+"`, `"k2+"`, `"k3+"`
    are straight-through: the named estimator's value with k2's gradient
    (k2 − sg(k2) + sg(named)), whose expectation is the gradient of
    KL(π‖π_ref). k1 and k3 are unbiased: Σ_x π(x)·k(x) = KL(π‖π_ref).
    Finite, value and gradient, for |d| ≤ 80 under float32 and bfloat16.

    Args:
        logprobs: log π of each sampled token (differentiated).
        ref_logprobs: log π_ref of the same tokens, the same shape (a
            constant: no gradient reaches it).
        estimator: one of the above.
        mask: None, or the tokens that count (logprobs' shape).
        reduction: `"mean"` (over the kept tokens), `"sum"`, `"none"`,
            `"sequence_mean"` (the mean over the sequences that keep a token
            of each one's kept-token mean), `"sequence_sum"` (of each
            one's kept-token sum) or `"constant"` (Dr. GRPO's: the kept
            tokens' sum over B·L_max, B every sequence of the batch, L_max
            `max_length`); the last three on [batch, tokens].
        clip: None, or (low, high): the estimate clamped to it, with a zero
            gradient outside, "+" forms included (verl's `low_var_kl` is
            `"k3"` with `clip=(-10, 10)`; its `low_var_kl+` clamps the value
            and keeps k2's gradient).
        old_logprobs: None, or log π_old of the tokens, when π_old sampled
            them (a constant): the estimate (after `clip`) is multiplied by
            r = exp(clamp(logprobs − old_logprobs, ±20)), with r's gradient,
            and stays unbiased for KL(π‖π_ref) (DeepSeek-V3.2; TRL's
            `use_bias_correction_kl`).
        max_length: with `reduction="constant"`, L_max (an int at least the
            tokens axis's length; None: that length).

    Returns:
        The reduced estimate, in logprobs' dtype.

    Raises:
        ValueError: an unknown `estimator` or `reduction`, `clip` not
            (low, high) with low < high, shapes that differ (`old_logprobs`
            too), or a sequence reduction on a rank other than 2.

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> round(float(P.kl_estimate([0.0], [math.log(0.5)], estimator="k3")), 6)  # ½ − 1 + ln 2
    0.193147
    """
    logprobs, ref_logprobs = backend.as_tensor(logprobs), backend.as_tensor(ref_logprobs)
    check.check_same_shape(("logprobs", "ref_logprobs"), logprobs, ref_logprobs)
    if old_logprobs is not None:
        old_logprobs = backend.as_tensor(old_logprobs)
        check.check_same_shape(("logprobs", "old_logprobs"), logprobs, old_logprobs)
    _check_max_length(max_length, logprobs, reduction)
    mask = _token_values(mask, logprobs, reduction)
    compute, dtype = dtypes.dtype_pair([logprobs])
    # A masked token may hold anything (a reference padded with -inf).
    logprobs, ref_logprobs = (reductions.fill_masked(t, mask) for t in (logprobs, ref_logprobs))
    logprobs = dtypes.cast_to(logprobs, compute)
    if old_logprobs is not None:
        old_logprobs = reductions.fill_masked(old_logprobs, mask)
    d = ratios.log_ratio(logprobs, ref_logprobs, mask)
    kind = estimator.rstrip("+")
    if kind == "k1":
        value = d
    elif kind == "abs":
        value = ops.abs(d)
    elif kind == "k2":
        value = 0.5 * ops.square(d)
    else:
        value = ops.expm1(-d) + d
    if estimator.endswith("+"):
        k2 = 0.5 * ops.square(d)
        value = k2 - ops.stop_gradient(k2) + ops.stop_gradient(value)
    if clip is not None:
        value = num.clamp(value, clip[0], clip[1])
    if old_logprobs is not None:
        value = value * ratios.exp_clamped(ratios.log_ratio(logprobs, old_logprobs, mask))
    return dtypes.from_compute(reductions.masked_reduce(value, mask, reduction, max_length), dtype)


@check.options(
    tensors=("mask", "weights"),
    kind=check.choice(*POLICY_LOSSES),
    clip=kinds.any_clip,
    dual_clip=_dual_clip,
    reduction=check.POLICY_REDUCTION,
    level=check.choice(*POLICY_LEVELS),
    **kinds.checks,
)
def policy_loss(
    logprobs: TensorLike,
    old_logprobs: TensorLike | None,
    advantages: TensorLike,
    *,
    kind: PolicyLoss = "ppo",
    clip: tuple[float, float] | None = None,
    dual_clip: float | None = None,
    mask: TensorLike | None = None,
    reduction: PolicyReduction = "mean",
    level: PolicyLevel = "token",
    weights: TensorLike | None = None,
    sapo_tau: tuple[float, float] = (1.0, 1.05),
    vespo_k: tuple[float, float] = (2.0, 3.0),
    vespo_lambda: tuple[float, float] = (3.0, 2.0),
    max_length: int | None = None,
) -> Tensor:
    """The per-token policy-gradient surrogate loss, to minimise.

    With r = exp(clamp(logprobs − old_logprobs, ±20)) and A the advantages:
    `"reinforce"` −A·logprobs; `"importance_sampling"` −r·A; `"ppo"`
    max(−r·A, −clip(r, 1 − ε_low, 1 + ε_high)·A), and with `dual_clip` c
    where A < 0 at most −c·A; `"cispo"` −sg(min(r, 1 + ε_high))·A·logprobs;
    `"sapo"` (SAPO) −σ(τ(r − 1))·(4/τ)·A, a soft gate in place of the clip,
    τ = τ₊ where A > 0, τ₋ elsewhere.

    `level="sequence"` (GSPO) gives every token of a sequence the sequence's
    ratio, log r = Σ_t (logprobs − old_logprobs)·M / max(Σ_t M, 1), with its
    gradient through every kept token; `"sequence_token"` (GSPO-token) its
    value with each token's own gradient, exp(sg(log r) + logprobs −
    sg(logprobs)). Either clamps log r to ±20 and is clipped (or gated) as
    above.

    Two kinds form their own sequence ratio (on [batch, tokens], `level`
    "token"): `"gmpo"` (GMPO) −A_i·exp(clamp(Σ_t M·c_t / max(n_i, 1), ±20))
    on every token of sequence i, c_t the log-ratio clipped on A's side
    only (≤ ε_high where A > 0, ≥ −ε_low elsewhere: `clip` holds log-ratio
    bounds here), per-sequence advantages; `"vespo"` (VESPO)
    −sg(φ)·A·logprobs, φ = exp(λ + k·log w − λ·w), log w = clamp(Σ_t
    clamp(δ_t, ±20)·M_t, [ln 1e-8, 20]) the sequence's (a sum), (k, λ) the
    first of `vespo_k`, `vespo_lambda` where A ≥ 0. LUSPO is not a kind:
    `kind="ppo", level="sequence", reduction="sequence_sum"`.

    Args:
        logprobs: log π of each sampled token under the policy being
            trained (differentiated).
        old_logprobs: log π_old of the same tokens, the policy that sampled
            them, the same shape (a constant); None for `"reinforce"`.
        advantages: per sequence ([batch], broadcast over its tokens) or per
            token (logprobs' shape); a constant.
        kind: one of the above.
        clip: None (the kind's default: (0.4, 0.4) for `"gmpo"`, (0.2, 0.2)
            otherwise), or (ε_low, ε_high), 0 ≤ ε_low < 1, ε_high ≥ 0: PPO's
            ratio clip (asymmetric as DAPO's clip-higher), CISPO's ε_high;
            for `"gmpo"` log-ratio bounds, each ≥ 0.
        dual_clip: None, or c > 1 (PPO's dual clip, as verl's).
        mask: None, or the tokens that count (logprobs' shape).
        reduction: as `kl_estimate`'s: `"mean"` over the kept tokens
            (DAPO's token mean), `"sequence_mean"` (GRPO's; SAPO's and
            GMPO's in TRL and verl), `"constant"` (Dr. GRPO's), …
        level: `"token"`, `"sequence"` or `"sequence_token"` (a ratio's
            kind only: not `"reinforce"`, `"gmpo"` or `"vespo"`), the last
            two on [batch, tokens]. `"sequence"` here is GSPO's ratio, the
            exp of the *mean* over the sequence's kept tokens of log π −
            log π_old (a length-normalised geometric mean); in
            `importance_weights`, `level="sequence"` is the exp of their
            *sum* (the sequence's probability ratio), and `"geometric"` the
            mean.
        weights: None, or per-token ([batch, tokens]) or per-sequence
            ([batch]) constants multiplied into the loss before the
            reduction: importance weights (`importance_weights`), entropy or
            off-policy masks, as TRL and verl apply them.
        sapo_tau: (τ₊, τ₋), each > 0 (TRL's `sapo_temperature_pos/neg`).
        vespo_k, vespo_lambda: (k₊, k₋) ≥ 0 and (λ₊, λ₋) > 0, VESPO's.
        max_length: with `reduction="constant"`, L_max (an int at least the
            tokens axis's length; None: that length).

    Returns:
        The reduced loss, in logprobs' dtype.

    Raises:
        ValueError: an unknown `kind`, `level` or `reduction`, `clip` or
            `dual_clip` out of range, `sapo_tau`, `vespo_k`, `vespo_lambda`
            or `max_length` out of range, `old_logprobs` None for a ratio,
            a `level` other than `"token"` for `"reinforce"`, `"gmpo"` or
            `"vespo"`, per-token advantages for `"gmpo"`, shapes that
            differ, `advantages` or `weights` neither [batch] nor
            logprobs' shape, or a sequence reduction, level or kind on a
            rank other than 2.

    Example:

    >>> from keras_penalties import ops as P
    >>> # r = 1.5 > 1.2 with A = 1: PPO's clipped term, −1.2·A
    >>> round(float(P.policy_loss([0.405465], [0.0], [1.0])), 4)
    -1.2
    >>> # SAPO at r = 1: σ(0)·4/τ₊ = 2, times −A
    >>> round(float(P.policy_loss([0.0], [0.0], [1.0], kind="sapo")), 4)
    -2.0
    """
    clip = kinds.kind_clip(kind, clip)
    if old_logprobs is None and kind != "reinforce":
        raise ValueError(f"`old_logprobs` is needed for kind={kind!r} (its ratio r); only 'reinforce' takes None.")
    kinds.check_level(kind, level)
    logprobs = backend.as_tensor(logprobs)
    advantages = backend.as_tensor(advantages)
    per_token = len(advantages.shape) == len(logprobs.shape) and len(logprobs.shape) > 1
    kinds.check_shapes(kind, len(logprobs.shape), per_token)
    if old_logprobs is not None:
        old_logprobs = backend.as_tensor(old_logprobs)
        check.check_same_shape(("logprobs", "old_logprobs"), logprobs, old_logprobs)
    ratios.check_level_rank(level, len(logprobs.shape))
    ratios.check_advantages(advantages, logprobs)
    _check_max_length(max_length, logprobs, reduction)
    mask = _token_values(mask, logprobs, reduction)
    compute, dtype = dtypes.dtype_pair([logprobs])
    # A masked token may hold anything, in every input (importance weights
    # from a sampler's -inf padding): a sequence ratio's gradient reaches
    # every token of its sequence.
    fill = functools.partial(reductions.fill_masked, mask=mask)
    weights = None if weights is None else fill(_token_weights(weights, logprobs, compute))
    logprobs = fill(dtypes.cast_to(logprobs, compute))
    old_logprobs = None if old_logprobs is None else fill(old_logprobs)
    a = fill(ratios.broadcast_advantages(advantages, logprobs, compute))
    if kind == "reinforce":
        loss = -a * logprobs
    else:
        delta = ratios.log_ratio(logprobs, old_logprobs, mask)
        if kind == "gmpo":
            loss = kinds.gmpo_loss(delta, a, mask, clip)
        elif kind == "vespo":
            loss = kinds.vespo_loss(delta, a, logprobs, vespo_k, vespo_lambda)
        else:
            ratio = ratios.exp_clamped(ratios.policy_log_ratio(delta, mask, level))
            loss = kinds.ratio_loss(kind, ratio, a, logprobs, clip, dual_clip, sapo_tau)
    if weights is not None:
        loss = loss * weights
    return dtypes.from_compute(reductions.masked_reduce(loss, mask, reduction, max_length), dtype)


def _check_max_length(max_length, logprobs, reduction):
    """`max_length` at least the tokens axis's length, where both are known."""
    if reduction != "constant" or max_length is None:
        return
    tokens = logprobs.shape[-1]
    if isinstance(tokens, int) and max_length < tokens:
        raise ValueError(
            f"`max_length` ({max_length}) is below the tokens axis's length ({tokens}): it must be at least "
            "the longest completion (Dr. GRPO's L_max)."
        )


@check.options(tensors=("mask",), clip=ratios.ratio_clip, level=check.choice(*POLICY_LEVELS))
def clip_fraction(
    logprobs: TensorLike,
    old_logprobs: TensorLike,
    advantages: TensorLike,
    *,
    clip: tuple[float, float] = (0.2, 0.2),
    level: PolicyLevel = "token",
    mask: TensorLike | None = None,
) -> dict[str, Tensor]:
    """The fractions of kept tokens a PPO clip acts on, for the logs (TRL's
    `clip_ratio/low_mean`, `…/high_mean`, `…/region_mean`).

    With r the ratio `policy_loss` reads at `level`: `"low"` the tokens with
    r < 1 − ε_low where A < 0, `"high"` those with r > 1 + ε_high where
    A > 0, `"region"` either; each over the kept tokens (0 when none is).

    Args:
        logprobs, old_logprobs: log π and log π_old of the sampled tokens.
        advantages: per sequence ([batch]) or per token.
        clip: (ε_low, ε_high), as `policy_loss`'s.
        level: `"token"`, `"sequence"` or `"sequence_token"`.
        mask: None, or the tokens that count.

    Returns:
        A dict `{"low", "high", "region"}` of float32 scalars, no gradient.

    Raises:
        ValueError: `clip` out of range, an unknown `level`, shapes that
            differ, `advantages` neither [batch] nor logprobs' shape.

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> fractions = P.clip_fraction([[math.log(1.5), 0.0]], [[0.0, 0.0]], [1.0])  # r = (1.5, 1)
    >>> {k: round(float(v), 2) for k, v in fractions.items()}
    {'low': 0.0, 'high': 0.5, 'region': 0.5}
    """
    logprobs, old, mask, compute = ratios.log_prob_pair(("logprobs", "old_logprobs"), logprobs, old_logprobs, mask)
    ratios.check_level_rank(level, len(logprobs.shape))
    advantages = backend.as_tensor(advantages)
    ratios.check_advantages(advantages, logprobs)
    log_ratio = ratios.policy_log_ratio(ratios.log_ratio(logprobs, old, mask), mask, level)
    ratio = ops.stop_gradient(ratios.exp_clamped(log_ratio))
    a = ratios.broadcast_advantages(advantages, logprobs, compute)
    low = ops.logical_and(ratio < 1.0 - clip[0], a < 0)
    high = ops.logical_and(ratio > 1.0 + clip[1], a > 0)
    kept = ops.cast(ratios.kept_or_all(mask, logprobs), "float32")
    count = ops.maximum(ops.sum(kept), 1.0)

    def fraction(hit):
        return ops.sum(ops.cast(hit, "float32") * kept) / count

    return {"low": fraction(low), "high": fraction(high), "region": fraction(ops.logical_or(low, high))}
