"""Masks choosing the tokens a policy loss trains on: DPPO's trust region
in probability space (verl's `dppo_tv`, `dppo_kl`) and the high-entropy
tokens (TRL's `top_entropy_quantile`). Each returns `kept`, a bool
constant of its input's shape, to pass as a policy loss's `weights` (or
`mask`).

Notation as `policy`'s: p = exp(logprobs), p_old = exp(old_logprobs), A the
advantages, M the mask. Computed in float32 (float64 stays float64).
"""

from typing import cast, get_args

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Tensor, TensorLike, TrustRegion
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _ratios as ratios
from keras_penalties.ops import _reductions as reductions

TRUST_REGIONS = get_args(TrustRegion)
# verl's Bernoulli KL guards its logs with 1e-8.
_KL_EPSILON = 1e-8


def _threshold(name, value):
    """δ, or (δ_low, δ_high), each ≥ 0, as (δ_low, δ_high)."""
    if isinstance(value, (tuple, list)):
        low, high = ratios.pair(name, value)
    else:
        low = high = check.number(name, value)
    if low < 0 or high < 0:
        raise ValueError(f"`{name}` must be δ or (δ_low, δ_high), each >= 0; got {value!r}.")
    return low, high


@check.options(tensors=("mask",), divergence=check.choice(*TRUST_REGIONS), threshold=_threshold)
def trust_region_mask(
    logprobs: TensorLike,
    old_logprobs: TensorLike,
    advantages: TensorLike,
    *,
    divergence: TrustRegion = "tv",
    threshold: float | tuple[float, float],
    mask: TensorLike | None = None,
) -> Tensor:
    """The tokens inside DPPO's trust region in probability space.

    `kept` is M, except where the update leaves the region on the side its
    advantage pushes: `"tv"` keeps p − p_old ≤ δ_high where A > 0 and
    p − p_old ≥ −δ_low elsewhere; `"kl"` keeps, where A > 0, KL_bin ≤
    δ_high or p ≤ p_old, and elsewhere KL_bin ≤ δ_low or p ≥ p_old, with
    the Bernoulli KL in verl's form, KL_bin = p_old·(old_logprobs −
    logprobs) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8)), 1 − p
    formed as −expm1(logprobs). DPPO's loss is then `policy_loss(...,
    kind="cispo", clip=(0.0, C − 1), weights=kept, mask=M)`, C verl's
    `clip_ratio_c`; the fraction dropped (verl's `pg_clipfrac`) is 1 − the
    mean over M of `kept`.

    Args:
        logprobs: log π of the sampled tokens (read as a constant).
        old_logprobs: log π_old of the same tokens, the same shape.
        advantages: per sequence ([batch]) or per token (logprobs' shape);
            the sign test is each token's.
        divergence: `"tv"` (verl's `dppo_tv`) or `"kl"` (`dppo_kl`).
        threshold: δ, or (δ_low, δ_high), each ≥ 0 (verl's
            `clip_ratio_low/high`; its DPPO example: 0.15 for tv, 0.05 for
            kl). Required.
        mask: None, or the tokens that count.

    Returns:
        `kept`, bool, logprobs' shape, no gradient.

    Raises:
        ValueError: an unknown `divergence`, `threshold` < 0, shapes that
            differ, `advantages` neither [batch] nor logprobs' shape, a mask
            of another shape.

    Example:

    >>> import math
    >>> from keras import ops
    >>> from keras_penalties import ops as P
    >>> # p_old = ½ for both; p = 0.8 (A > 0: up 0.3, out) and 0.6 (up 0.1, in)
    >>> logprobs, old = [[math.log(0.8), math.log(0.6)]], [[math.log(0.5), math.log(0.5)]]
    >>> ops.convert_to_numpy(P.trust_region_mask(logprobs, old, [1.0], threshold=0.15)).tolist()
    [[False, True]]
    """
    logprobs, old = backend.as_tensor(logprobs), backend.as_tensor(old_logprobs)
    check.check_same_shape(("logprobs", "old_logprobs"), logprobs, old)
    advantages = backend.as_tensor(advantages)
    ratios.check_advantages(advantages, logprobs)
    mask = reductions.sample_mask(mask, logprobs, None)
    compute, _ = dtypes.dtype_pair([logprobs])
    fill = lambda t: ops.stop_gradient(reductions.fill_masked(ops.cast(t, compute), mask))  # noqa: E731
    logprobs, old = fill(logprobs), fill(old)
    a = fill(ratios.broadcast_advantages(advantages, logprobs, compute))
    low, high = cast(tuple[float, float], threshold)  # the check made it a pair
    p, p_old = ops.exp(logprobs), ops.exp(old)
    up = a > 0
    if divergence == "tv":
        inside = ops.where(up, p - p_old <= high, p - p_old >= -low)
    else:
        rest, rest_old = -ops.expm1(logprobs), -ops.expm1(old)
        kl = p_old * (old - logprobs) + rest_old * ops.log((rest_old + _KL_EPSILON) / (rest + _KL_EPSILON))
        inside = ops.where(up, ops.logical_or(kl <= high, p <= p_old), ops.logical_or(kl <= low, p >= p_old))
    return inside if mask is None else ops.logical_and(mask, inside)


@check.options(tensors=("mask",), top=check.half_open_unit)
def entropy_mask(entropy: TensorLike, *, top: float = 0.2, mask: TensorLike | None = None) -> Tensor:
    """The tokens among the top ρ of entropy: TRL's `top_entropy_quantile`.

    `kept` is M where H ≥ q, q the (1 − ρ)-quantile of H over the kept
    tokens, interpolated linearly between order statistics (as
    `numpy.quantile` and `torch.quantile` by default); ρ = 1 keeps every
    kept token, and where no token is kept, none is. Under several replicas
    in sync (a `tf.distribute` strategy's, torch processes under DDP in a
    training step) q is the global batch's, from every replica's kept
    tokens, as TRL gathers them across processes; a JAX batch sharded over
    devices is one array, whose q is the whole batch's already. Pass `kept`
    as a policy loss's `weights`: TRL multiplies it into the per-token
    loss, and its denominator keeps M.

    Args:
        entropy: H, each token's entropy (`token_logprobs(...,
            return_entropy=True)`), read as a constant.
        top: ρ in (0, 1].
        mask: None, or the tokens that count (entropy's shape).

    Returns:
        `kept`, bool, entropy's shape, no gradient.

    Raises:
        ValueError: `top` outside (0, 1], a mask of another shape.

    Example:

    >>> from keras import ops
    >>> from keras_penalties import ops as P
    >>> # The 0.5-quantile of (1, 2, 3, 4) is 2.5: the two above it
    >>> ops.convert_to_numpy(P.entropy_mask([[1.0, 4.0, 2.0, 3.0]], top=0.5)).tolist()
    [[False, True, False, True]]
    """
    entropy = backend.as_tensor(entropy)
    mask = reductions.sample_mask(mask, entropy, None)
    compute, _ = dtypes.dtype_pair([entropy])
    h = ops.stop_gradient(reductions.fill_masked(ops.cast(entropy, compute), mask))
    kept = ops.ones(ops.shape(h), "bool") if mask is None else mask
    every_h, every_kept = ops.reshape(h, (-1,)), ops.reshape(ops.cast(kept, compute), (-1,))
    if backend.replicas_in_sync() > 1:
        every_h, every_kept = backend.gather_over_replicas([every_h, every_kept], reductions.forward_pass_layer())
    q = _quantile(every_h, every_kept > 0, 1.0 - top)
    return ops.logical_and(kept, h >= q)


def _quantile(values, kept, level):
    """The `level`-quantile of `values` where `kept` (1-D), interpolated
    linearly between order statistics; +inf where none is kept."""
    ordered = ops.sort(ops.where(kept, values, ops.full_like(values, float("inf"))))
    n = ops.sum(ops.cast(kept, "int32"))
    position = ops.cast(level, values.dtype) * ops.cast(ops.maximum(n - 1, 0), values.dtype)
    below = ops.cast(ops.floor(position), "int32")
    above = ops.minimum(below + 1, ops.maximum(n - 1, 0))
    low, high = ops.take(ordered, below), ops.take(ordered, above)
    q = low + (position - ops.cast(below, values.dtype)) * ops.where(above > below, high - low, ops.zeros_like(low))
    return ops.where(n > 0, q, ops.full_like(q, float("inf")))
