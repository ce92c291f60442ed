"""Per-token returns: discounted sums of per-token rewards along a sequence,
as on-policy distillation turns a per-token KL into advantages."""

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Tensor, TensorLike
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _reductions as reductions


@check.options(tensors=("mask",))
def discounted_cumsum(values: TensorLike, gamma: float, *, mask: TensorLike | None = None) -> Tensor:
    """y_t = M_t · Σ_{s ≥ t} γ^(s−t) · x_s · M_s along the last axis.

    The discounted return of each position from per-token rewards x (a
    per-token KL, a reward at the last token, …), as Tinker's on-policy
    distillation forms its advantages; masked positions are 0 and add
    nothing (Tinker leaves them unmasked), but still count in the discount's
    exponent. Differentiable (a reverse associative scan: O(log T) steps,
    no T × T matrix).

    Args:
        values: x, [..., tokens].
        gamma: γ in [0, 1].
        mask: None, or the positions that count (values' shape).

    Returns:
        y, values' shape and dtype (computed in float32 from half inputs).

    Raises:
        ValueError: `gamma` outside [0, 1], a scalar `values`, a mask of
            another shape.

    Example:

    >>> from keras import ops
    >>> from keras_penalties import ops as P
    >>> ops.convert_to_numpy(P.discounted_cumsum([1.0, 2.0, 4.0], 0.5)).tolist()  # 1 + 1 + 1, 2 + 2, 4
    [3.0, 4.0, 4.0]
    """
    gamma = check.closed_unit("gamma", gamma)
    values = backend.as_tensor(values)
    check.check_rank("values", values, 1, "positions along the last axis")
    mask = reductions.sample_mask(mask, values, None)
    compute, dtype = dtypes.dtype_pair([values])
    x = dtypes.cast_to(values, compute)
    if mask is not None:
        x = ops.where(mask, x, ops.zeros_like(x))

    def combine(later, earlier):
        # Each element is h ↦ a·h + b (the return carried from the right):
        # applying `later` then `earlier` gives (a₁a₂, b₁a₂ + b₂).
        (a1, b1), (a2, b2) = later, earlier
        return a1 * a2, b1 * a2 + b2

    discounts = ops.full(ops.shape(x), gamma, compute)
    _, y = ops.associative_scan(combine, (discounts, x), reverse=True, axis=len(x.shape) - 1)
    if mask is not None:
        y = ops.where(mask, y, ops.zeros_like(y))
    return dtypes.from_compute(y, dtype)
