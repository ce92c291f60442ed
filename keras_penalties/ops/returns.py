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
    exponent. Differentiable, and traceable with a token axis known only
    at run time (`keras.Input((None,))`, a `tf.function` over padded
    batches of any length, a `tf.data` map).

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
    if isinstance(x.shape[-1], int):
        y = _parallel_returns(x, gamma)
    else:
        y = _sequential_returns(x, gamma)
    if mask is not None:
        y = ops.where(mask, y, ops.zeros_like(y))
    return dtypes.from_compute(y, dtype)


def _parallel_returns(x, gamma):
    """The returns by doubling (Hillis–Steele): after the steps of offset
    1, 2, 4, …, y_t = Σ_{t ≤ s < t + 2^m} γ^(s−t)·x_s: ⌈log₂ T⌉ steps of a
    shift and an add, no T × T matrix; the steps need the token axis's
    length while tracing. (Keras' `associative_scan` loses the shape of a
    [None, T] input on TensorFlow.)"""
    length, offset, y = x.shape[-1], 1, x
    while offset < length:
        later = ops.concatenate([y[..., offset:], ops.zeros_like(y[..., :offset])], axis=-1)
        y = y + (gamma**offset) * later
        offset *= 2
    return y


def _sequential_returns(x, gamma):
    """The returns by a reverse scan over the token axis, one step a token:
    for a length known only at run time (a `tf.function` traced with
    [batch, None] inputs, a layer's symbolic call on JAX), where the
    associative scan cannot unroll its steps."""
    steps = ops.moveaxis(x, -1, 0)

    def step(later, value):
        y = value + gamma * later
        return y, y

    _, y = ops.scan(step, ops.zeros_like(steps[0]), steps, reverse=True)
    return ops.moveaxis(y, 0, -1)
