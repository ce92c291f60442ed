"""TensorFlow's chunked heads, a block at a time: a chunk's logits in blocks
of rows (`in_blocks`), and the kernel's gradient added in place a block of
its rows at a time (`add_kernel_grad`). Used by `chunks` only."""

import tensorflow as tf


def _divisor_near(count, most):
    """The largest divisor of `count` from `most` down to half that, or None."""
    return next((d for d in range(most, (most - 1) // 2, -1) if count % d == 0), None)


def _block_rows(rows, classes, elements):
    """Rows per block of a chunk of `rows` rows of `classes` logits: the
    largest divisor of `rows` from `elements // classes` down to half
    that, as `chunk_rows` picks chunks; `rows` (the chunk whole) when none
    is, or when the classes are known only at run time: blocks of a row or
    two would make a loop of hundreds of steps per chunk."""
    if classes is None:
        return rows
    most = max(1, elements // classes)
    if rows <= most:
        return rows
    return _divisor_near(rows, most) or rows


def in_blocks(fn, rows, dtype, outputs, elements):
    """`fn(logits, chunk_rows, weight)` -> (value (a scalar, or a vector of
    columns for weights [rows, k]), `outputs` gradients of
    `dtype`, each with the rows on its first axis), for a chunk of `rows`
    rows, taken a block of rows at a time in a while loop, each block about
    `elements` of logits, as `map_chunks`' "auto". Under XLA, where
    its `TensorArray` is one buffer written in place, the temporaries are
    then a block's, not the chunk's (`_block_rows` says how many rows)."""

    def blocked(logits, chunk_rows, weight):
        size = _block_rows(rows, logits[0].shape[-1] if logits else None, elements)
        if size == rows:
            return fn(logits, chunk_rows, weight)
        count = rows // size

        def split(x):
            return tf.reshape(x, tf.concat([[count, size], tf.shape(x)[1:]], 0))

        def joined(x):
            return tf.reshape(x, tf.concat([[rows], tf.shape(x)[2:]], 0))

        logits, chunk_rows, weight = [split(x) for x in logits], [split(x) for x in chunk_rows], split(weight)

        def step(i, total, grads):
            value, block_grads = fn([x[i] for x in logits], [x[i] for x in chunk_rows], weight[i])
            return i + 1, total + value, tuple(g.write(i, b) for g, b in zip(grads, block_grads))

        start = (
            tf.constant(0),
            tf.zeros(tf.shape(weight)[2:], dtype),  # the value's columns, if any
            tuple(tf.TensorArray(dtype, size=count) for _ in range(outputs)),
        )
        _, total, grads = tf.while_loop(
            lambda i, *_: i < count, step, start, parallel_iterations=1, maximum_iterations=count
        )
        return total, [joined(g.stack()) for g in grads]

    return blocked


# Elements of the kernel's gradient formed and added in place at a time: the
# smallest block as fast as larger ones (bench/results/README.md).
_KERNEL_BLOCK_ELEMENTS = 8 * 2**20


def add_kernel_grad(total, dlogits, hidden, transposed, xla):
    """total + the kernel's gradient from one chunk: hiddenᵀ·dlogits [H, V],
    or dlogitsᵀ·hidden [V, H] for a transposed (tied) kernel. Outside XLA,
    in place, a block of the kernel's rows at a time (`InplaceAdd`): no
    product larger than a block (about `_KERNEL_BLOCK_ELEMENTS`, or the
    kernel's when it is smaller), and the sum is not rewritten whole. A
    [H, V] kernel's blocks are rows of H (columns of the chunk's hidden
    rows), a [V, H] one's rows of V (columns of the logits' gradient).

    One block's product at a time (a control dependency on the sum so far):
    unordered, TF would form every block's product at once. Blocks are the
    largest divisor of the kernel's rows from the budget's rows down to
    half that (`_divisor_near`); with one, the sum is seen as one row per
    block (a reshape, the same buffer), so that each block is one
    `InplaceAdd` row (it adds row by row); with none, blocks of the
    budget's rows are added row by row."""
    classes, features = dlogits.shape[1], hidden.shape[1]

    def product(dlogits, hidden):
        if transposed:
            return tf.matmul(dlogits, hidden, transpose_a=True)
        return tf.matmul(hidden, dlogits, transpose_a=True)

    def part(start, stop, after):
        with tf.control_dependencies([after] if start else []):
            return product(dlogits[:, start:stop], hidden) if transposed else product(dlogits, hidden[:, start:stop])

    if xla or classes is None or features is None:
        return total + product(dlogits, hidden)
    length, width = (classes, features) if transposed else (features, classes)
    most = max(1, _KERNEL_BLOCK_ELEMENTS // width)
    block = _divisor_near(length, most) if length > most else length
    if block is not None:
        rows = tf.reshape(total, [length // block, block * width])
        for k in range(length // block):
            summand = tf.reshape(part(k * block, (k + 1) * block, rows), [1, block * width])
            rows = tf.raw_ops.InplaceAdd(x=rows, i=[k], v=summand)
        return tf.reshape(rows, [length, width])
    for start in range(0, length, most):
        stop = min(start + most, length)
        total = tf.raw_ops.InplaceAdd(x=total, i=tf.range(start, stop), v=part(start, stop, total))
    return total
