"""Preference optimisation from unpaired examples: one completion a prompt,
labelled desirable or not (KTO, TRL's unpaired APO).

Each example's value is the sum of its kept tokens' log-probabilities
(per token, [batch, tokens]) or is given per sequence ([batch]); the
reference's likewise; Δ = value − reference value. Computed in float32
(float64 stays float64), returned in logprobs' dtype.
"""

from typing import get_args

from keras import ops

from keras_penalties import backend
from keras_penalties import _validation as check
from keras_penalties._types import Reduction, Tensor, TensorLike, UnpairedKind
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions

UNPAIRED_KINDS = get_args(UnpairedKind)


def _values(name, values, mask, mask_name, compute, batch=None):
    """Per-sequence values of one input: as given ([batch]), or the sum of
    its kept tokens ([batch, tokens], its mask of that shape); and which
    sequences keep a token (None: all)."""
    values = backend.as_tensor(values)
    if len(values.shape) not in (1, 2):
        raise ValueError(
            f"`{name}` must be per token [batch, tokens] or per sequence [batch]; got shape {tuple(values.shape)}."
        )
    if batch is not None and reductions.shapes_differ((values.shape[0],), (batch,)):
        raise ValueError(f"`{name}` must hold {batch} examples; got shape {tuple(values.shape)}.")
    if len(values.shape) == 1:
        if mask is not None:
            raise ValueError(f"`{mask_name}` masks per-token log-probabilities; `{name}` is per sequence.")
        return ops.cast(values, compute), None
    mask = reductions.sample_mask(mask, values, None, mask_name)
    kept = ops.ones(ops.shape(values), compute) if mask is None else ops.cast(mask, compute)
    total = ops.sum(reductions.fill_masked(ops.cast(values, compute), mask), axis=1)
    return total, ops.sum(kept, axis=1) > 0


def _check_sources(kind, kl_logprobs, ref_kl_logprobs, kl_baseline):
    """Where z₀ comes from, before any tensor work."""
    if (kl_logprobs is None) != (ref_kl_logprobs is None):
        raise ValueError("`kl_logprobs` and `ref_kl_logprobs` come together: give both, or neither.")
    mismatched, given = kl_logprobs is not None, kl_baseline is not None
    if kind == "apo_zero_unpaired" and (mismatched or given):
        raise ValueError(
            "kind='apo_zero_unpaired' has no KL baseline (z₀ = 0): leave `kl_logprobs`, `ref_kl_logprobs` "
            "and `kl_baseline` None."
        )
    if kind == "kto" and mismatched == given:
        raise ValueError(
            "kind='kto' needs its KL baseline z₀ from one source: `kl_logprobs` with `ref_kl_logprobs` "
            "(mismatched pairs), or `kl_baseline` (given)" + (", not both." if given else "; got neither.")
        )


def baseline(
    kl_logprobs: TensorLike, ref_kl_logprobs: TensorLike, kl_mask: TensorLike | None = None, compute: str = "float32"
) -> Tensor:
    """KTO's z₀ = max(0, mean over the mismatched examples that keep a
    token of kl − ref_kl), a constant (what `unpaired_preference_loss`
    reads, and TRL logs as `kl`); over the whole batch's examples within a
    composite under several replicas (as TRL gathers it)."""
    kl, kept = _values("kl_logprobs", kl_logprobs, kl_mask, "kl_mask", compute)
    ref, _ = _values("ref_kl_logprobs", ref_kl_logprobs, kl_mask, "kl_mask", compute, batch=kl.shape[0])
    kept = ops.ones(ops.shape(kl), "bool") if kept is None else kept
    gap = ops.stop_gradient(ops.where(kept, kl - ref, ops.zeros_like(kl)))
    mean = reductions.whole_batch_mean(ops.sum(gap), ops.sum(ops.cast(kept, compute)))
    return num.clamp(mean, low=0.0)


@check.options(
    tensors=("mask", "kl_mask", "kl_logprobs", "ref_kl_logprobs", "kl_baseline"),
    kind=check.choice(*UNPAIRED_KINDS),
    beta=check.positive,
    desirable_weight=check.non_negative,
    undesirable_weight=check.non_negative,
    reduction=check.REDUCTION,
)
def unpaired_preference_loss(
    logprobs: TensorLike,
    ref_logprobs: TensorLike,
    desirable: TensorLike,
    *,
    kind: UnpairedKind = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl_logprobs: TensorLike | None = None,
    ref_kl_logprobs: TensorLike | None = None,
    kl_baseline: TensorLike | None = None,
    mask: TensorLike | None = None,
    kl_mask: TensorLike | None = None,
    reduction: Reduction = "mean",
) -> Tensor:
    """The loss of unpaired examples labelled desirable or not, to minimise.

    `"kto"` (KTO, TRL's `KTOTrainer`): a desirable example's loss is
    λ_D·(1 − σ(β(Δ − z₀))), an undesirable one's λ_U·(1 − σ(β(z₀ − Δ))),
    z₀ the KL baseline, a constant: `kl_baseline` as given, or max(0, the
    mean over the mismatched examples that keep a token of kl − ref_kl),
    from `kl_logprobs` and `ref_kl_logprobs`, the policy's and the
    reference's log-probabilities of mismatched (prompt, completion) pairs
    (TRL pairs each prompt with the previous example's completion), per
    token (summed over `kl_mask`) or per sequence, a batch of their own.
    `"apo_zero_unpaired"` (TRL's unpaired APO-zero) is the same with
    z₀ = 0. An example that keeps no token gives 0 and does not count.

    Args:
        logprobs: the policy's log-probabilities of each example's
            completion, per token [batch, tokens] or per sequence [batch].
        ref_logprobs: the reference's, likewise (a constant).
        desirable: [batch], nonzero where the example is desirable.
        kind: `"kto"` or `"apo_zero_unpaired"`.
        beta: β > 0.
        desirable_weight, undesirable_weight: λ_D, λ_U ≥ 0.
        kl_logprobs, ref_kl_logprobs: `"kto"`'s mismatched pairs, or None.
        kl_baseline: `"kto"`'s z₀ given (a number or a scalar tensor), or
            None.
        mask: None, or the kept tokens of `logprobs` (its shape).
        kl_mask: None, or the kept tokens of `kl_logprobs`.
        reduction: `"mean"` over the examples that keep a token (0 when
            none does), `"sum"`, or `"none"` ([batch], 0 where an example
            keeps no token).

    Returns:
        The reduced loss, in logprobs' dtype.

    Raises:
        ValueError: an unknown `kind` or `reduction`, β ≤ 0, a weight < 0,
            `"kto"` with neither KL source or with both, `kl_logprobs`
            without `ref_kl_logprobs`, a KL input to `"apo_zero_unpaired"`,
            `desirable` not [batch], ranks other than 1 or 2, shapes that
            differ, a mask of another shape.

    Example:

    >>> from keras_penalties import ops as P
    >>> # Δ = 1 and −1, z₀ = 0, β = 1: (1 − σ(1)) for the desirable, 1 − σ(1) for the other
    >>> round(float(P.unpaired_preference_loss([1.0, -1.0], [0.0, 0.0], [1, 0], beta=1.0, kl_baseline=0.0)), 6)
    0.268941
    """
    _check_sources(kind, kl_logprobs, ref_kl_logprobs, kl_baseline)
    logprobs = backend.as_tensor(logprobs)
    compute, dtype = dtypes.dtype_pair([logprobs])
    value, kept = _values("logprobs", logprobs, mask, "mask", compute)
    batch = value.shape[0]
    ref_logprobs = backend.as_tensor(ref_logprobs)
    per_token = len(ref_logprobs.shape) == 2
    if per_token:
        check.check_same_shape(("logprobs", "ref_logprobs"), logprobs, ref_logprobs)
    # A per-sequence reference is taken as given (TRL's precomputed one).
    ref, _ = _values("ref_logprobs", ref_logprobs, mask if per_token else None, "mask", compute, batch=batch)
    desirable = backend.as_tensor(desirable)
    if len(desirable.shape) != 1 or reductions.shapes_differ((desirable.shape[0],), (batch,)):
        raise ValueError(f"`desirable` must be [batch] ({batch},), one label an example; got {tuple(desirable.shape)}.")
    if kind == "apo_zero_unpaired":
        z0 = ops.zeros((), compute)
    elif kl_baseline is not None:
        z0 = ops.stop_gradient(ops.cast(backend.as_tensor(kl_baseline), compute))
    else:
        z0 = baseline(kl_logprobs, ref_kl_logprobs, kl_mask, compute)
    delta = value - ops.stop_gradient(ref)
    wanted = ops.not_equal(desirable, 0)
    losses = ops.where(
        wanted,
        desirable_weight * (1.0 - ops.sigmoid(beta * (delta - z0))),
        undesirable_weight * (1.0 - ops.sigmoid(beta * (z0 - delta))),
    )
    return dtypes.from_compute(_over_examples(losses, kept, reduction), dtype)


def _over_examples(losses, kept, reduction):
    """Per-example losses reduced over the examples that keep a token."""
    if kept is not None:
        losses = ops.where(kept, losses, ops.zeros_like(losses))
    if reduction == "none":
        return losses
    total = ops.sum(losses)
    if reduction == "sum":
        return total
    count = ops.cast(ops.shape(losses)[0], total.dtype) if kept is None else ops.sum(ops.cast(kept, total.dtype))
    return total / ops.cast(reductions.kept_divisor(count), total.dtype)
