"""Chunking over rows for the token-level penalties: how many rows a chunk
holds (`chunk_rows`), the per-sample values computed a chunk at a time
(`per_sample`), and the padding of rows to whole chunks, per device where
the rows are split over devices (`padded_rows`, `unpadded_rows`)."""

from keras import ops

from keras_penalties import backend
from keras_penalties.ops._dtypes import cast_to
from keras_penalties.ops._reductions import at_least_one


def chunk_rows(chunk_size, classes, n, heads=False):
    """Rows per chunk: `chunk_size`, or for "auto" the backend's measured
    elements per chunk (`backend.CHUNK_ELEMENTS`, or `HEAD_CHUNK_ELEMENTS`
    for logits formed from hidden states) over the number of `classes`, at
    least 1. When the `n` rows are known: at most n, and the largest
    divisor of n down to half that many rows if there is one, so that no
    padded copy of the inputs is made (8192 rows of 32000 classes on a
    4 M budget: 128 rows, not 131); where the rows are split over devices
    (`backend.row_shards`), of each device's rows, so that every device
    runs whole chunks of its own. Classes known only at run time count as
    32768."""
    if chunk_size != "auto":
        return chunk_size
    budget = backend.HEAD_CHUNK_ELEMENTS if heads else backend.CHUNK_ELEMENTS
    rows = max(1, budget // (classes if isinstance(classes, int) else 32768))
    if not isinstance(n, int):
        return rows
    shards = backend.row_shards()
    if shards > 1 and n % shards == 0:
        n //= shards
    if n <= rows:
        return max(n, 1)
    return next((d for d in range(rows, (rows - 1) // 2, -1) if n % d == 0), rows)


def per_sample(values_fn, tensors, axis, compute, chunk_size=None, labels=None):
    """`values_fn(*tensors, axis=axis)`, the per-sample values, with the
    tensors cast to `compute` first; `labels` (integers of the per-sample
    shape), if given, are passed on as `labels=`.

    With `chunk_size`, the rows of the tensors (every axis but `axis`,
    flattened) are taken `chunk_size` at a time under `backend.map_chunks`
    (a scan on JAX, a while loop on TF, a loop over `unbind` on torch),
    each chunk cast and computed there with each row's gradient, so that
    value + gradient hold O(chunk_size × classes) temporaries rather than
    O(rows × classes), and the backward pass recomputes nothing. A scan,
    not a Python loop: XLA keeps every slice of an unrolled loop alive.
    The row count may be known only at run time; rows short of a whole
    chunk are padded with ones (finite as logits and as probabilities;
    label 0) and dropped (`padded_rows`).
    """
    extra = {} if labels is None else {"labels": labels}
    if chunk_size is None:
        return values_fn(*[cast_to(t, compute) for t in tensors], axis=axis, **extra)
    last = len(tensors[0].shape) - 1
    if axis != last:
        tensors = [ops.moveaxis(t, axis, -1) for t in tensors]
    shape = ops.shape(tensors[0])
    classes = shape[-1]
    rows = [ops.reshape(t, (-1, classes)) for t in tensors]
    n = ops.shape(rows[0])[0]
    chunk_size = chunk_rows(chunk_size, classes, n)
    rows = [ops.reshape(padded_rows(r, n, chunk_size, 1), (-1, chunk_size, classes)) for r in rows]
    if labels is not None:
        flat = padded_rows(ops.reshape(labels, (-1,)), n, chunk_size, 0)
        rows.append(ops.reshape(flat, (-1, chunk_size)))

    def chunk_values(chunk):
        if labels is None:
            return values_fn(*[ops.cast(t, compute) for t in chunk], axis=-1)
        *chunk, chunk_labels = chunk
        return values_fn(*[ops.cast(t, compute) for t in chunk], axis=-1, labels=chunk_labels)

    values = ops.reshape(backend.map_chunks(chunk_values, tuple(rows), compute), (-1,))
    return ops.reshape(unpadded_rows(values, n, chunk_size), shape[:-1])


def _row_blocks(n):
    """How many blocks `n` rows are padded in: the devices they are split
    over (`backend.row_shards`) where each holds n / devices of them, else
    1."""
    shards = backend.row_shards()
    return shards if shards > 1 and isinstance(n, int) and n % shards == 0 else 1


def padded_rows(x, n, chunk_size, value):
    """`x` ([n, ...]) padded with `value` to whole chunks of `chunk_size`
    rows: at its end, or where the rows are split over devices, at the end
    of each device's rows, so that every device's chunks are its own rows
    (`backend.map_chunks`, `backend.chunked_sum`). `n` may be known only at
    run time."""
    blocks = _row_blocks(n)
    local = n // blocks
    pad = at_least_one((local + chunk_size - 1) // chunk_size) * chunk_size - local
    if isinstance(pad, int) and not pad:
        return x
    rest = tuple(ops.shape(x)[1:])
    if blocks == 1:
        return ops.concatenate([x, ops.full((pad,) + rest, value, x.dtype)], axis=0)
    x = ops.reshape(x, (blocks, local) + rest)
    x = ops.concatenate([x, ops.full((blocks, pad) + rest, value, x.dtype)], axis=1)
    return ops.reshape(x, (blocks * (local + pad),) + rest)


def unpadded_rows(values, n, chunk_size):
    """The `n` values ([rows] or [rows, k]) of the rows `padded_rows`
    padded, in their order."""
    blocks = _row_blocks(n)
    if blocks == 1:
        return values[:n]
    rest = tuple(values.shape[1:])
    return ops.reshape(ops.reshape(values, (blocks, -1) + rest)[:, : n // blocks], (n,) + rest)
