"""How `keras_penalties.ops` reduce per-sample values: sizes that stay
symbolic where shapes are, reductions, masks over samples, and the divisor
of a masked mean, which composites make the global batch's under a
`tf.distribute` strategy (`global_token_means`)."""

import contextlib
import contextvars

import keras
from keras import ops

from keras_penalties import _replicas, backend

# Set by the composites around their terms (`global_token_means`): the
# layer whose forward pass the terms run in, or None outside one.
_GLOBAL = contextvars.ContextVar("keras_penalties_global_token_means", default=())


@contextlib.contextmanager
def global_token_means(layer=None):
    """Within the block, a masked `"mean"` (see `kept_divisor`) is the mean
    over the positions kept in the whole global batch where each replica of
    a `tf.distribute` strategy holds a part of it, not the mean of the
    replicas' means: the composites' rule. `layer`: the model
    whose forward pass the block runs in, whose add_loss lists the
    cross-replica sum must leave as they were (`backend.sum_over_replicas`).
    A raw op outside the block keeps Keras' rule."""
    token = _GLOBAL.set((layer,))
    try:
        yield
    finally:
        _GLOBAL.reset(token)


def forward_pass_layer():
    """The layer whose forward pass `global_token_means` runs in (None
    outside one): a cross-replica step there must leave its add_loss lists
    as they were."""
    scope = _GLOBAL.get()
    return scope[0] if scope else None


def global_means_active():
    """Whether a masked mean is the global batch's here: within
    `global_token_means` under several replicas."""
    return bool(_GLOBAL.get()) and _replicas.in_sync() > 1


def kept_divisor(count, floor=1.0):
    """What a masked mean's sum is divided by: `count`, the positions kept,
    at least 1. Within `global_token_means` under several replicas, the
    count summed over the replicas (at least `floor`) over their number, so
    that Keras' division of each replica's loss by the replicas, and the sum
    of their gradients, give the global mean (and so do their values'
    mean)."""
    scope = _GLOBAL.get()
    if not scope or _replicas.in_sync() == 1:
        return at_least_one(count)
    return _replicas.global_divisor(count, floor, keep_losses_of=scope[0])


def whole_batch_divisor(total, floor=1.0):
    """`kept_divisor` of a count that `whole_batch_sums` has already summed
    over the replicas (`total`), without summing it again: max(total,
    floor) over the replicas where masked means are the global batch's,
    max(total, floor) elsewhere."""
    replicas = _replicas.in_sync() if global_means_active() else 1
    total = ops.maximum(ops.cast(total, "float32"), floor)
    return total if replicas == 1 else total / float(replicas)


def whole_batch_sums(tensors):
    """Each tensor summed over the replicas where masked means are the
    global batch's (`global_means_active`; no gradient), so that every
    replica holds the whole batch's; as they are elsewhere."""
    scope = _GLOBAL.get()
    n = _replicas.in_sync()
    if not scope or n == 1:
        return list(tensors)
    return [t * float(n) for t in _replicas.mean_in_sync(tensors, keep_losses_of=scope[0])]


def whole_batch_mean(total, count):
    """total / count, 0 where count is 0, over the whole global batch where
    masked means are the global batch's (`whole_batch_sums`): every
    replica holds the same value (a statistic the loss reads, such as KTO's
    z₀, or a log; not a loss that Keras divides)."""
    total, count = whole_batch_sums([total, count])
    safe = ops.where(count > 0, count, ops.ones_like(count))
    return ops.where(count > 0, total / safe, ops.zeros_like(total))


def count(x, axis=None):
    """How many elements of `x` lie along `axis` (an int, a tuple, or None
    for all axes); symbolic where the shape is."""
    axes = range(len(x.shape)) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    shape = ops.shape(x)
    n = 1
    for a in axes:
        n = n * shape[a]
    return n


def at_least_one(n):
    """max(n, 1) for a size: a sum over nothing is 0, and 0 divided by it
    stays 0 (an empty batch gives 0, not NaN). A size known only at run time
    is a tensor on TensorFlow; on JAX, in a layer's symbolic call, it is a
    symbolic dimension, which must stay one (a shape cannot hold an array);
    a count summed from symbolic inputs is a KerasTensor."""
    return ops.maximum(n, 1) if ops.is_tensor(n) or isinstance(n, keras.KerasTensor) else max(n, 1)


def mean(x, axis=None):
    """Mean over `axis` (an int, a tuple, or None for all axes); 0 where
    there is nothing to average. Float64 stays float64 (`ops.mean` goes
    through `keras.backend.result_type`, which maps it to float32)."""
    total = ops.sum(x, axis=axis)
    return total / ops.cast(at_least_one(count(x, axis)), total.dtype)


def batch_size(x):
    """The size of axis 0 (1 for a scalar), at least 1."""
    return at_least_one(ops.shape(x)[0]) if len(x.shape) else 1


def scale_sum(total, x, reduction):
    """`total`, the sum of all of `x`, as `reduction` asks: as is (`"sum"`),
    per element (`"mean"`) or per sample (`"sum_over_batch_size"`); 0 for
    an empty `x`."""
    if reduction == "sum":
        return total
    n = at_least_one(count(x)) if reduction == "mean" else batch_size(x)
    return backend.divide_by_count(total, n)


def reduce(values, reduction):
    """Reduces per-element (or per-sample) `values` as `reduction` asks."""
    if reduction == "none":
        return values
    return scale_sum(backend.reduce_sum(values), values, reduction)


def without_axis(shape, axis):
    """`shape` as a tuple without its `axis` entry: the per-sample shape."""
    return tuple(d for i, d in enumerate(shape) if i != axis)


def shapes_differ(got, expected):
    """Whether two shapes disagree: in rank, or in a size both know (None,
    a size known only at run time, agrees with any)."""
    return len(got) != len(expected) or any(a is not None and b is not None and a != b for a, b in zip(got, expected))


def sample_mask(mask, x, axis, name="mask", boolean=True):
    """`mask` as a bool tensor of x's per-sample shape (x's shape without
    `axis`), nonzero meaning kept; None stays None. With `boolean=False`
    the values are kept as they are (per-position weights)."""
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    expected, got = without_axis(x.shape, axis), tuple(mask.shape)
    if shapes_differ(got, expected):
        raise ValueError(
            f"`{name}` must have the per-sample shape {expected} (the input's shape without `axis`); got {got}."
        )
    return ops.cast(mask, "bool") if boolean else mask


def fill_masked(x, mask, value=0, axis=None):
    """`x` with `value` wherever `mask` (bool; None keeps all) drops a
    position, before any math reads it: a masked position may hold anything
    (inf, NaN, a sampler's -inf padding, a label of -100) and then changes
    neither the value nor any gradient. (A `where` after the math keeps the
    value, but its zero gradient times a NaN or an inf partial there is
    NaN.) `mask` has x's leading shape, or x's shape without `axis`; the
    axes it lacks are broadcast over."""
    if mask is None:
        return x
    if axis is not None and len(mask.shape) < len(x.shape):
        mask = ops.expand_dims(mask, axis)
    while len(mask.shape) < len(x.shape):
        mask = ops.expand_dims(mask, -1)
    fill = ops.zeros_like(x) if value == 0 else ops.full_like(x, value)
    return ops.where(mask, x, fill)


def masked_reduce(values, mask, reduction, max_length=None):
    """`reduce` over the kept samples only: masked ones are 0 in the value and
    the gradient, and `"mean"` divides by the number kept (0 when none is).
    The sequence reductions of [batch, tokens] values: see
    `sequence_reduce`; `"constant"`: see `constant_reduce`."""
    if reduction in ("sequence_mean", "sequence_sum"):
        return sequence_reduce(values, mask, reduction)
    if reduction == "constant":
        return constant_reduce(values, mask, max_length)
    if mask is None:
        return reduce(values, reduction)
    values = ops.where(mask, values, ops.zeros_like(values))
    if reduction != "mean":
        return reduce(values, reduction)
    total = ops.sum(values)
    return total / kept_divisor(ops.sum(ops.cast(mask, total.dtype)))


def constant_reduce(values, mask, max_length=None):
    """Dr. GRPO's constant normaliser of [batch, tokens] values: Σ L·M over
    B·L_max, B every sequence of the batch, kept or not (the whole batch's
    within `global_token_means`), L_max `max_length` (None: the tokens
    axis's length). 0 where nothing is kept or the batch is empty."""
    if mask is not None:
        values = ops.where(mask, values, ops.zeros_like(values))
    total = ops.sum(values)
    shape = ops.shape(values)
    length = shape[1] if max_length is None else max_length
    divisor = ops.cast(kept_divisor(shape[0]), total.dtype) * ops.cast(at_least_one(length), total.dtype)
    return total / divisor


def sequence_reduce(values, mask, reduction):
    """[batch, tokens] values reduced over sequences: each sequence's sum over
    its kept tokens (`"sequence_sum"`), or that over their number
    (`"sequence_mean"`), averaged over the sequences that keep at least one
    token (0 when none does; masked tokens are 0 in the value and the
    gradient). Within `global_token_means`, over the whole batch's such
    sequences."""
    if mask is None:
        mask = ops.ones(ops.shape(values), "bool")
    kept = ops.cast(mask, values.dtype)
    values = ops.where(mask, values, ops.zeros_like(values))
    tokens = ops.sum(kept, axis=1)
    per_sequence = ops.sum(values, axis=1)
    if reduction == "sequence_mean":
        per_sequence = per_sequence / ops.maximum(tokens, 1.0)
    sequences = ops.sum(ops.cast(tokens > 0, values.dtype))
    return ops.sum(per_sequence) / ops.cast(kept_divisor(sequences), values.dtype)
