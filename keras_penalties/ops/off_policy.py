"""Off-policy correction for RL fine-tuning: when the sampler (vLLM,
`generate` at another precision, a remote trainer) is not the policy being
trained, its log-probabilities differ and each token is reweighted or
dropped. `importance_weights` and `off_policy_mask` give the weights and
the kept tokens (constants, for `policy_loss(..., weights=, mask=)`).

Notation per sampled token as `policy`: r = π/π_old; δ = logprobs −
sampler_logprobs on kept tokens (0 where the mask M drops one). Inputs are
[batch, tokens] (the token level takes any shape), computed in float32
(float64 stays float64); weights are returned in that compute dtype, so a
bfloat16 ratio neither rounds nor overflows.
"""

from typing import get_args

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Bounds, ImportanceLevel, ImportanceMode, Tensor, TensorLike
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _ratios as ratios

IMPORTANCE_LEVELS = get_args(ImportanceLevel)
IMPORTANCE_MODES = get_args(ImportanceMode)


@check.options(
    tensors=("mask",),
    level=check.choice(*IMPORTANCE_LEVELS),
    mode=check.choice(*IMPORTANCE_MODES),
    bounds=ratios.bounds,
)
def importance_weights(
    logprobs: TensorLike,
    sampler_logprobs: TensorLike,
    *,
    level: ImportanceLevel = "token",
    mode: ImportanceMode = "truncate",
    bounds: Bounds = (None, 2.0),
    mask: TensorLike | None = None,
) -> tuple[Tensor, Tensor]:
    """Importance weights π/q of sampled tokens, and the tokens they keep.

    ρ is exp(δ) per token (`"token"`), exp(Σ_t δ) for every token of a
    sequence (`"sequence"`) or exp of its mean over kept tokens
    (`"geometric"`), the log clamped to ±20 first (ρ finite; the decisions
    below read that ρ). `"truncate"`: weights = ρ clipped into `bounds`,
    kept = M. `"mask"`: weights = ρ where it lies inside `bounds` (ends
    included), kept = M there and False outside (verl's rejection
    sampling). Weights are 0 where a token is not kept. TRL's
    `vllm_importance_sampling_mode` is (`"token"`|`"sequence"`,
    `"truncate"`|`"mask"`, `(None, cap)`) with the original mask; passing
    `kept` as the loss's mask takes rejected tokens out of the token-mean
    denominator.

    Args:
        logprobs: log π of the sampled tokens under the policy trained
            (read as a constant).
        sampler_logprobs: log q of the same tokens under the sampler, the
            same shape.
        level: `"token"`, `"sequence"` or `"geometric"` (the last two on
            [batch, tokens]). `"sequence"` here is the exp of the *sum* over
            the sequence's kept tokens of log π − log q (the sequence's
            probability ratio, TRL's `sequence_*` modes), `"geometric"` the
            exp of their *mean*; `policy_loss(level="sequence")` is that
            mean (GSPO's length-normalised ratio), not this sum.
        mode: `"truncate"` or `"mask"`.
        bounds: (low, high), 0 ≤ low < high, either None for no bound on
            that side; `(None, None)` leaves ρ as it is.
        mask: None, or the tokens that count (logprobs' shape).

    Returns:
        `(weights, kept)`: float32 (float64 for float64 inputs) and bool,
        logprobs' shape, no gradient.

    Raises:
        ValueError: an unknown `level` or `mode`, `bounds` not (low, high)
            with 0 ≤ low < high, shapes that differ, a sequence level on a
            rank other than 2.

    Example:

    >>> import math
    >>> from keras import ops
    >>> from keras_penalties import ops as P
    >>> weights, kept = P.importance_weights([[math.log(3.0), 0.0]], [[0.0, 0.0]])
    >>> ops.convert_to_numpy(weights).round(4).tolist()  # ρ = (3, 1), truncated at 2
    [[2.0, 1.0]]
    """
    logprobs, sampler, mask, _ = ratios.log_prob_pair(
        ("logprobs", "sampler_logprobs"), logprobs, sampler_logprobs, mask
    )
    ratios.check_level_rank(level, len(logprobs.shape))
    delta = ops.stop_gradient(ratios.log_ratio(logprobs, sampler, mask))
    if level == "sequence":
        delta = ops.broadcast_to(ratios.sequence_sum(delta), ops.shape(delta))
    elif level == "geometric":
        delta = ops.broadcast_to(ratios.sequence_mean(delta, mask), ops.shape(delta))
    rho = ratios.exp_clamped(delta)
    low, high = bounds
    kept = ratios.kept_or_all(mask, rho)
    if mode == "truncate":
        weights = num.clamp(rho, low, high)
    else:
        weights = rho
        if low is not None:
            kept = ops.logical_and(kept, rho >= low)
        if high is not None:
            kept = ops.logical_and(kept, rho <= high)
    return ops.where(kept, weights, ops.zeros_like(weights)), kept


@check.options(tensors=("mask",), threshold=check.non_negative)
def off_policy_mask(
    logprobs: TensorLike,
    old_logprobs: TensorLike,
    advantages: TensorLike,
    *,
    threshold: float,
    mask: TensorLike | None = None,
) -> Tensor:
    """The tokens kept by off-policy sequence masking (DeepSeek-V3.2).

    Every token of a sequence whose advantage is negative and whose mean
    over kept tokens of old_logprobs − logprobs (an estimate of KL(π_old‖π))
    exceeds `threshold` is dropped; the others keep M. With per-token
    advantages the sign test is each token's own, as TRL's
    `off_policy_mask_threshold`.

    Args:
        logprobs: log π of the sampled tokens, [batch, tokens] (a constant).
        old_logprobs: log π_old (the sampler's) of the same tokens.
        advantages: per sequence ([batch]) or per token.
        threshold: ≥ 0, in nats.
        mask: None, or the tokens that count.

    Returns:
        `kept`, bool [batch, tokens].

    Raises:
        ValueError: `threshold` < 0, shapes that differ, `advantages` neither
            [batch] nor logprobs' shape, inputs not of rank 2.

    Example:

    >>> from keras import ops
    >>> from keras_penalties import ops as P
    >>> logprobs, old = [[-3.0, -3.0], [-3.0, -1.0]], [[-1.0, -1.0], [-1.0, -1.0]]
    >>> kept = P.off_policy_mask(logprobs, old, [-1.0, -1.0], threshold=1.5)
    >>> ops.convert_to_numpy(kept).tolist()  # mean drifts 2 and 1: the first sequence goes
    [[False, False], [True, True]]
    """
    logprobs, old, mask, compute = ratios.log_prob_pair(("logprobs", "old_logprobs"), logprobs, old_logprobs, mask)
    ratios.check_level_rank("sequence", len(logprobs.shape))
    advantages = backend.as_tensor(advantages)
    ratios.check_advantages(advantages, logprobs)
    drift = ratios.sequence_mean(-ratios.log_ratio(logprobs, old, mask), mask)
    a = ratios.broadcast_advantages(advantages, logprobs, compute)
    dropped = ops.logical_and(a < 0, drift > threshold)
    return ops.logical_and(ratios.kept_or_all(mask, logprobs), ops.logical_not(dropped))
