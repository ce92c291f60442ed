"""Magnitude penalties: L1, L2, elastic net and output magnitude."""

from typing import Any

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Center, MagnitudeReduction, Reduction, Tensor, TensorLike
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions


@check.options(per_element=True, reduction=check.MAGNITUDE_REDUCTION)
def l1(x: TensorLike, *, reduction: MagnitudeReduction = "sum") -> Tensor:
    """L1 penalty: Σ|x|.

    Args:
        x: tensor of any shape.
        reduction: `"sum"` (default) or `"mean"` over all elements,
            `"sum_over_batch_size"` (the sum divided by the size of axis 0:
            each sample's sum, averaged over the batch, as Keras scales an
            activity regularizer), or `"none"` for the elementwise |x|.

    Returns:
        A scalar (or, with `reduction="none"`, a tensor shaped like `x`) in
        x's float dtype.

    Example:

    >>> from keras_penalties import ops as P
    >>> float(P.l1([[1.0, -2.0], [3.0, -4.0]]))
    10.0
    >>> float(P.l1([[1.0, -2.0], [3.0, -4.0]], reduction="sum_over_batch_size"))  # 10 / 2 samples
    5.0
    """
    (x,), dtype = dtypes.to_compute(x)
    if reduction == "none":
        return dtypes.from_compute(ops.abs(x), dtype)
    return dtypes.from_compute(reductions.scale_sum(backend.sum_abs(x), x, reduction), dtype)


# Σ|x| is `backend.sum_abs` and Σx² `backend.sum_of_squares`: each a single
# reduction over x (on eager torch abs-then-sum or square-then-sum of a
# large x writes and reads a second copy of it, and torch's own norms lose
# precision with the size), and on TF x·x would be a matrix-vector product,
# slower in the bench's fit step (bench/results/README.md).


def _center(name: str, value: Any) -> Center:
    if value is None or value == "mean":
        return value
    if isinstance(value, str):
        raise ValueError(f"`{name}` must be None, a number or 'mean'; got {value!r}.")
    return check.number(name, value)


@check.options(
    per_element=True, reduction=check.MAGNITUDE_REDUCTION, center=_center, clip=check.optional(check.positive)
)
def l2(
    x: TensorLike, *, reduction: MagnitudeReduction = "sum", center: Center = None, clip: float | None = None
) -> Tensor:
    """L2 penalty: Σ(x − c)², without the ½ (the Keras convention).

    Args:
        x: tensor of any shape.
        reduction: `"sum"` (default), `"mean"`, `"sum_over_batch_size"`
            (as for `l1`) or `"none"` (elementwise).
        center: `None` (c = 0), a number, or `"mean"` (c = mean of x, so the
            penalty is the spread of x around its own mean).
        clip: `None`, or a positive number: (x − c) is clipped to
            [−clip, clip] before squaring, bounding each element's pull.

    Example:

    >>> from keras_penalties import ops as P
    >>> float(P.l2([[1.0, -2.0], [3.0, -4.0]]))
    30.0
    >>> float(P.l2([1.0, 3.0], center="mean"))  # (1-2)² + (3-2)²
    2.0
    >>> float(P.l2([0.5, 3.0], clip=1.0))  # 0.5² + 1²
    1.25
    """
    (x,), dtype = dtypes.to_compute(x)
    if center == "mean":
        x = x - reductions.mean(x)
    elif center is not None and center != 0.0:
        x = x - center
    if clip is not None:
        x = num.clamp(x, -clip, clip)
    if reduction == "none":
        return dtypes.from_compute(ops.square(x), dtype)
    return dtypes.from_compute(reductions.scale_sum(backend.sum_of_squares(x), x, reduction), dtype)


@check.options(per_element=True, l1_ratio=check.closed_unit, reduction=check.MAGNITUDE_REDUCTION)
def elastic_net(x: TensorLike, *, l1_ratio: float = 0.5, reduction: MagnitudeReduction = "sum") -> Tensor:
    """Elastic net penalty: α·Σ|x| + (1 − α)·Σx², α = `l1_ratio`.

    Args:
        x: tensor of any shape.
        l1_ratio: α in [0, 1]; 1 is pure L1, 0 pure L2.
        reduction: `"sum"` (default), `"mean"`, `"sum_over_batch_size"`
            (as for `l1`) or `"none"` (elementwise).

    Example:

    >>> from keras_penalties import ops as P
    >>> float(P.elastic_net([1.0, -2.0], l1_ratio=0.25))  # .25·3 + .75·5
    4.5
    """
    (x,), dtype = dtypes.to_compute(x)
    if reduction == "none":
        return dtypes.from_compute(l1_ratio * ops.abs(x) + (1.0 - l1_ratio) * ops.square(x), dtype)
    total = l1_ratio * backend.sum_abs(x) + (1.0 - l1_ratio) * backend.sum_of_squares(x)
    return dtypes.from_compute(reductions.scale_sum(total, x, reduction), dtype)


@check.options(target=check.non_negative, reduction=check.REDUCTION)
def output_magnitude(x: TensorLike, *, target: float = 1.0, reduction: Reduction = "mean") -> Tensor:
    """Output magnitude penalty: (‖x_i‖₂ − target)² per sample.

    Axis 0 is the batch; each sample's norm is taken over all its other axes
    (a rank-1 `x` is a batch of scalars). The norm has a finite gradient at
    zero.

    Args:
        x: tensor of shape [batch, ...].
        target: the norm each sample is pulled towards (≥ 0).
        reduction: `"mean"` (default) or `"sum"` over samples, or `"none"`
            for the per-sample values, shape [batch].

    Example:

    >>> from keras_penalties import ops as P
    >>> float(P.output_magnitude([[3.0, 4.0], [0.0, 0.0]]))  # ((5-1)² + 1) / 2
    8.5
    """
    (x,), dtype = dtypes.to_compute(x)
    if len(x.shape) == 0:
        raise ValueError("`x` must have a batch axis (rank >= 1); got a scalar.")
    if len(x.shape) == 1:
        norms = ops.abs(x)
    else:
        norms = num.safe_norm(x, axis=tuple(range(1, len(x.shape))))
    values = ops.square(norms - target)
    return dtypes.from_compute(reductions.reduce(values, reduction), dtype)
