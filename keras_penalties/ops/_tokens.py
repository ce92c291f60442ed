"""Token-level evaluation shared by `kl_divergence`, `js_divergence`,
`entropy` and `cross_entropy`: one value per position (every axis but the
class axis) from one or two class tensors, and integer labels for
`cross_entropy`, reduced over the positions a mask keeps, whole or in chunks.

A class tensor may be lazy logits, `LinearLogits` (what `ops.linear`
returns): hidden @ kernel (+ bias). Without `chunk_size` they are formed
whole. With it they are formed one chunk at a time inside
`backend.chunked_sum`, which turns each chunk's logits gradient into the
hidden rows', the kernel's and the bias's while the chunk's logits exist:
no [positions, classes] array is ever formed, forward or backward.
"""

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Head, Tensor
from keras_penalties.ops import _chunks as chunks
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions


class LinearLogits:
    """The logits `hidden @ kernel (+ bias)`, described but not formed: what
    `keras_penalties.ops.linear` returns, accepted as logits by
    `kl_divergence`, `js_divergence`, `entropy` and `cross_entropy`.

    Attributes: `hidden` [..., H]; `kernel` [H, V], or [V, H] with
    `transpose_kernel`; `bias` [V] or None; `soft_cap` None or c > 0 (the
    logits are then c·tanh(z / c)); `shape`, the logits' shape (`hidden`'s
    leading axes, then V).
    """

    def __init__(
        self,
        hidden: Tensor,
        kernel: Tensor,
        bias: Tensor | None,
        transpose_kernel: bool,
        soft_cap: float | None = None,
    ) -> None:
        self.hidden = hidden
        self.kernel = kernel
        self.bias = bias
        self.transpose_kernel = transpose_kernel
        self.soft_cap = soft_cap

    @property
    def classes(self) -> int | None:
        return self.kernel.shape[0 if self.transpose_kernel else 1]

    @property
    def shape(self) -> tuple[int | None, ...]:
        return tuple(self.hidden.shape[:-1]) + (self.classes,)

    def parts(self) -> list[Tensor]:
        """Every tensor the logits are made of (for their dtype)."""
        return [self.hidden] + self.params()

    def params(self) -> list[Tensor]:
        """What every row shares: the kernel, then the bias if any."""
        return [self.kernel] if self.bias is None else [self.kernel, self.bias]

    def rows(self) -> Tensor:
        """The hidden states as rows: [positions, H]."""
        return ops.reshape(self.hidden, (-1, ops.shape(self.hidden)[-1]))

    def logits_of(self, rows: Tensor, params: list[Tensor]) -> Tensor:
        """The logits of hidden `rows` [n, H] with `params` (as `params()`)."""
        logits = backend.project(rows, params[0], self.transpose_kernel)
        return self.capped(logits if len(params) == 1 else logits + params[1])

    def capped(self, logits: Tensor) -> Tensor:
        """`logits` (z = hidden @ kernel + bias) soft-capped: c·tanh(z / c)."""
        if self.soft_cap is None:
            return logits
        return backend.soft_cap(logits, self.soft_cap)

    def materialise(self, compute: str) -> Tensor:
        """The whole logits, computed in `compute` (float32 from half inputs)."""
        logits = self.logits_of(ops.cast(self.rows(), compute), [ops.cast(p, compute) for p in self.params()])
        return ops.reshape(logits, tuple(ops.shape(self.hidden)[:-1]) + (self.classes,))

    def __repr__(self) -> str:
        kernel = "kernelᵀ" if self.transpose_kernel else "kernel"
        bias = "" if self.bias is None else " + bias"
        cap = "" if self.soft_cap is None else f", soft-capped at {self.soft_cap}"
        return f"<LinearLogits hidden{tuple(self.hidden.shape)} @ {kernel}{tuple(self.kernel.shape)}{bias}{cap}>"


def token_level(values_fn, tensors, names, axis, reduction, mask, chunk_size, *, from_logits, labels=None):
    """`values_fn(*tensors, axis=axis[, labels=labels])`, the per-position
    values, reduced over the positions `mask` keeps (see `kl_divergence`).

    `tensors` are one or two class tensors (named `names` in errors), any of
    them `LinearLogits`; `labels`, if given, has the per-position shape, and
    a negative label masks its position (see `label_mask`). A masked
    position's inputs may hold anything: they are filled before any math
    (logits and probabilities with 1, hidden states with 0).
    """
    lazy = [isinstance(t, LinearLogits) for t in tensors]
    if any(lazy):
        _check_lazy(names, lazy, from_logits)
    tensors = [t if is_lazy else backend.as_tensor(t) for t, is_lazy in zip(tensors, lazy)]
    parts = [p for t in tensors for p in (t.parts() if isinstance(t, LinearLogits) else [t])]
    compute, dtype = dtypes.dtype_pair(parts)
    if len(tensors) == 2:
        check.check_same_shape(names, *tensors)
    check.check_rank(names[0], tensors[0], 1, num.DISTRIBUTION_AXIS)
    rank = len(tensors[0].shape)
    axis = check.check_axis("axis", axis, rank)
    check.check_sequence_rank(reduction, rank - 1, "the values (every axis but `axis`)")
    if any(lazy) and axis != rank - 1:
        raise ValueError(
            f"`axis` must be the last axis (-1) when an input is ops.linear(...): its classes are "
            f"the kernel's outputs, last; got axis={axis} for logits of rank {rank}."
        )
    mask = reductions.sample_mask(mask, tensors[0], axis)
    beyond = None
    if labels is not None:
        labels, mask, beyond = label_mask(labels, tensors[0], axis, mask)
    tensors = [_filled(t, mask, axis) for t in tensors]
    if any(lazy) and chunk_size is not None:
        if reduction in ("mean", "sum"):
            total = _fused_total(values_fn, tensors, labels, mask, reduction, chunk_size, compute)
            return dtypes.from_compute(_poisoned_total(total, beyond), dtype)
        values = _fused_values(values_fn, tensors, labels, chunk_size, compute)
    else:
        tensors = [t.materialise(compute) if is_lazy else t for t, is_lazy in zip(tensors, lazy)]
        values = chunks.per_sample(values_fn, tensors, axis, compute, chunk_size, labels=labels)
    return dtypes.from_compute(reductions.masked_reduce(_poisoned(values, beyond), mask, reduction), dtype)


def _check_lazy(names, lazy, from_logits):
    name = names[lazy.index(True)]
    if not from_logits:
        raise ValueError(f"`{name}` is ops.linear(...) logits: pass `from_logits=True`.")


def _filled(t, mask, axis):
    """A class tensor with its masked positions filled before any math:
    logits or probabilities with 1 (finite either way), the hidden states of
    lazy logits with 0 (a NaN there would reach the kernel's gradient)."""
    if isinstance(t, LinearLogits):
        hidden = reductions.fill_masked(t.hidden, mask)
        return t if hidden is t.hidden else LinearLogits(hidden, t.kernel, t.bias, t.transpose_kernel, t.soft_cap)
    return reductions.fill_masked(t, mask, 1, axis=axis)


def _classes(like, axis):
    """The number of classes of logits `like` (or `LinearLogits`) along
    `axis`: an int, or a tensor where known only at run time."""
    classes = like.classes if isinstance(like, LinearLogits) else like.shape[axis]
    if isinstance(classes, int):
        return classes
    return (
        ops.shape(like.kernel)[0 if like.transpose_kernel else 1]
        if isinstance(like, LinearLogits)
        else ops.shape(like)[axis]
    )


def label_mask(labels, like, axis, mask, several=False):
    """Integer labels for logits `like` as the ops read them, with the mask
    they imply: `(labels, mask, beyond)`.

    A negative label (Hugging Face's -100) marks its position as masked: M
    is 0 there for the values, the gradients and the counts of the means.
    `beyond` flags the kept positions whose label is ≥ V: their values are
    NaN (`_poisoned`), on every backend. The labels returned are int32, 0
    where masked or beyond (never an index outside [0, V), which TF's fused
    cross-entropy rejects and torch wraps). `labels` has `like`'s shape
    without `axis`, or with `several`, K ids a position after that (any
    negative one masks the position)."""
    labels = ops.convert_to_tensor(labels)
    expected, got = reductions.without_axis(like.shape, axis), tuple(labels.shape)
    if reductions.shapes_differ(got[: len(expected)], expected) or len(got) != len(expected) + several:
        ids = " plus K ids a position" if several else " (one class index per position)"
        raise ValueError(f"`labels` must have the logits' shape without the class axis, {expected}{ids}; got {got}.")
    labels = ops.cast(labels, "int32")
    negative = labels < 0
    kept = ops.logical_not(ops.any(negative, axis=-1) if several else negative)
    mask = kept if mask is None else ops.logical_and(mask, kept)
    read = ops.expand_dims(mask, -1) if several else mask
    beyond = ops.logical_and(read, labels >= _classes(like, axis))
    valid = ops.logical_and(read, ops.logical_not(beyond))
    return ops.where(valid, labels, ops.zeros_like(labels)), mask, beyond


def _poisoned(values, beyond):
    """`values` with NaN where `beyond` flags a label ≥ V."""
    if beyond is None:
        return values
    return ops.where(beyond, ops.full_like(values, float("nan")), values)


def _poisoned_total(total, beyond):
    """A reduced total, NaN where any kept label is ≥ V."""
    if beyond is None:
        return total
    return ops.where(ops.any(beyond), ops.full_like(total, float("nan")), total)


def weighted_labels(labels, like, weights):
    """Labels for logits `like` (classes last) and their per-position
    `weights` (Keras' sample weights), as the Distiller's fused student loss
    reads them: `(labels, weights)`, the weight 0 where a label is negative
    or the weight is 0 (such a label is read as 0: padding labels such as
    -100 never index a class), NaN where a kept label is ≥ V."""
    labels, mask, beyond = label_mask(labels, like, len(like.shape) - 1, ops.not_equal(weights, 0))
    return labels, _poisoned(reductions.fill_masked(weights, mask), beyond)


def _row_weights(mask, reduction, n, compute):
    """Each row's weight in the reduced total: kept (1) or masked (0), over
    the number kept for `"mean"` (0 when none is)."""
    if mask is None:
        weights, kept = ops.ones((n,), compute), n
    else:
        weights = ops.cast(ops.reshape(mask, (-1,)), compute)
        kept = ops.sum(weights)
    if reduction == "mean":
        weights = weights / ops.cast(reductions.kept_divisor(kept), compute)
    return weights


def _fused_parts(values_fn, tensors, labels, chunk_size):
    """What a chunk loop over lazy logits takes: each `LinearLogits` as a
    head (its hidden states as rows [positions, H], its kernel and bias),
    formed logits and labels as plain rows, padded to whole chunks (zero
    hidden states give the bias as logits, zero logits and label 0 are as
    finite); the function of a chunk's logits and rows; the number of
    positions; the rows per chunk."""
    rows, heads, sources, lazy = [], [], [], []
    for t in tensors:
        if isinstance(t, LinearLogits):
            sources.append((True, len(heads)))
            heads.append(Head(t.rows(), t.kernel, t.bias, t.transpose_kernel))
            lazy.append(t)
        else:
            sources.append((False, len(rows)))
            rows.append(ops.reshape(t, (-1, ops.shape(t)[-1])))
    if labels is not None:
        # One label a position, or several ([..., K]: `token_columns`).
        extra = len(labels.shape) - len(reductions.without_axis(tensors[0].shape, len(tensors[0].shape) - 1))
        rows.append(ops.reshape(labels, (-1,) + tuple(labels.shape[len(labels.shape) - extra :])))

    def values(logits, chunk_rows):
        # A soft cap inside the chunk's function: its gradient is in the
        # logits' gradient the chunk loop forms.
        inputs = [lazy[i].capped(logits[i]) if is_head else chunk_rows[i] for is_head, i in sources]
        extra = {} if labels is None else {"labels": chunk_rows[-1]}
        return values_fn(*inputs, axis=-1, **extra)

    n = ops.shape((heads[0].rows if heads else rows[0]))[0]
    classes = next(t.classes if isinstance(t, LinearLogits) else ops.shape(t)[-1] for t in tensors)
    chunk_size = chunks.chunk_rows(chunk_size, classes, n, heads=True)
    rows = [chunks.padded_rows(r, n, chunk_size, 0) for r in rows]
    heads = [head._replace(rows=chunks.padded_rows(head.rows, n, chunk_size, 0)) for head in heads]
    return values, rows, heads, n, chunk_size


def _fused_total(values_fn, tensors, labels, mask, reduction, chunk_size, compute):
    """The reduced total (`"mean"`, `"sum"`) with lazy logits formed one
    chunk at a time, each chunk's gradient formed with its value."""
    values, rows, heads, n, chunk_size = _fused_parts(values_fn, tensors, labels, chunk_size)
    # Padding rows weigh 0: none adds to the total.
    weights = chunks.padded_rows(_row_weights(mask, reduction, n, compute), n, chunk_size, 0)
    return backend.chunked_sum(values, rows, heads, weights, chunk_size, compute)[0]


def fused_columns(values_fn, tensors, labels, weights, chunk_size):
    """Several weighted sums over the same logits, some lazy, in one chunk
    loop (each chunk's logits formed once for all of them): `values_fn(
    *tensors, labels=...)` gives [positions, k] values (labels, if any, one
    class index per position), `weights` is [positions, k]. Returns the
    total of the k sums (differentiated) and the k sums (not), in float32.
    Labels are used as given (0 where a weight is 0: see `_labels`).
    Without `chunk_size` the logits are formed whole, as every op's None."""
    parts = [p for t in tensors for p in (t.parts() if isinstance(t, LinearLogits) else [t])]
    compute, _ = dtypes.dtype_pair(parts)
    if chunk_size is None:
        return _formed_columns(values_fn, tensors, labels, weights, compute)

    def values(*chunk, axis, labels=None):
        return values_fn(*chunk, labels=labels)

    values, rows, heads, n, chunk_size = _fused_parts(values, tensors, labels, chunk_size)
    weights = ops.cast(ops.reshape(weights, (-1, weights.shape[-1])), compute)
    weights = chunks.padded_rows(weights, n, chunk_size, 0)
    total, columns = backend.chunked_sum(values, rows, heads, weights, chunk_size, compute)
    return ops.cast(total, "float32"), ops.cast(columns, "float32")


def _formed_columns(values_fn, tensors, labels, weights, compute):
    """`fused_columns` with the logits formed whole: one [positions, k]
    product with the weights, differentiated through the formed logits."""
    rows = []
    for t in tensors:
        logits = t.materialise(compute) if isinstance(t, LinearLogits) else ops.cast(t, compute)
        rows.append(ops.reshape(logits, (-1, ops.shape(logits)[-1])))
    flat_labels = None if labels is None else ops.reshape(labels, (-1,))
    weighted = values_fn(*rows, labels=flat_labels) * ops.cast(ops.reshape(weights, (-1, weights.shape[-1])), compute)
    columns = ops.cast(ops.sum(weighted, axis=0), "float32")
    return ops.sum(columns), ops.stop_gradient(columns)


def _fused_values(values_fn, tensors, labels, chunk_size, compute):
    """The per-position values with lazy logits formed one chunk at a time,
    forward and again in the backward pass (`backend.chunked_values`), in
    the positions' shape."""
    values, rows, heads, n, chunk_size = _fused_parts(values_fn, tensors, labels, chunk_size)
    flat = backend.chunked_values(values, rows, heads, chunk_size, compute)
    like = tensors[0].hidden if isinstance(tensors[0], LinearLogits) else tensors[0]
    return ops.reshape(chunks.unpadded_rows(flat, n, chunk_size), tuple(ops.shape(like)[:-1]))


def token_columns(values_fn, logits, labels, mask, chunk_size, several, extra, groups=1):
    """Several values a position from one class tensor (logits, or lazy
    `LinearLogits`): `values_fn(logits, labels=...)` gives [rows, k] from
    [rows, classes] logits and the rows' labels ([rows], or [rows, K] with
    `several`): `groups` values for each label (a log-probability, whether
    it is the largest), then `extra` more (an entropy).
    Returned as the positions' shape + (k,), in the logits' dtype, 0 where
    `mask` or a negative label drops a position (no gradient there, whatever
    its inputs hold), NaN at a label ≥ V (`label_mask`). With `chunk_size`
    the rows are taken a chunk at a time (`backend.chunked_values`): lazy
    logits are formed a chunk at a time, forward and again in the backward
    pass, formed ones only read."""
    lazy = isinstance(logits, LinearLogits)
    logits = logits if lazy else backend.as_tensor(logits)
    parts = logits.parts() if lazy else [logits]
    compute, dtype = dtypes.dtype_pair(parts)
    check.check_rank("logits", logits, 1, num.DISTRIBUTION_AXIS)
    mask = reductions.sample_mask(mask, logits, len(logits.shape) - 1)
    labels, mask, beyond = label_mask(labels, logits, len(logits.shape) - 1, mask, several)
    logits = _filled(logits, mask, -1)
    if chunk_size is None:
        formed = logits.materialise(compute) if lazy else ops.cast(logits, compute)
        flat = ops.reshape(formed, (-1, ops.shape(formed)[-1]))
        flat_labels = ops.reshape(labels, (-1,) + tuple(labels.shape[len(labels.shape) - several :]))
        values = values_fn(flat, labels=flat_labels)
    else:
        fn, rows, heads, n, chunk_size = _fused_parts(values_fn, [logits], labels, chunk_size)
        values = chunks.unpadded_rows(backend.chunked_values(fn, rows, heads, chunk_size, compute), n, chunk_size)
    # The number of columns stays static where the labels' is (a [..., K]
    # reshape to -1 loses it under tf.function).
    per_label = labels.shape[-1] if several else 1
    width = groups * per_label + extra if isinstance(per_label, int) else -1
    values = ops.reshape(values, tuple(ops.shape(parts[0])[:-1]) + (width,))
    values = reductions.fill_masked(values, mask)
    if not several:
        beyond = ops.expand_dims(beyond, -1)
    if groups > 1 or extra:  # an entropy reads no label
        beyond = ops.concatenate([beyond] * groups + [ops.zeros_like(beyond[..., :1])] * extra, axis=-1)
    return dtypes.from_compute(_poisoned(values, beyond), dtype)
