"""TensorFlow's chunk loops: `map_chunks` over formed logits, and
`chunked_sum` and `chunked_values` over logits formed from hidden states:
while loops, one chunk at a time, under a custom gradient."""

import tensorflow as tf

from keras_penalties._types import Head
from keras_penalties.backend.tensorflow import tracing
from keras_penalties.backend.tensorflow.blocks import add_kernel_grad, in_blocks


# chunk_size="auto": about 1 M elements of formed logits a chunk (32 rows of
# 32000, 8 of 128256), chunks that stay in cache, and 16 M from hidden states
# were the fastest on the benchmark machine (bench/results/README.md).
CHUNK_ELEMENTS = 2**20


HEAD_CHUNK_ELEMENTS = 16 * 2**20


def map_chunks(fn, chunks, dtype):
    """`fn` over the leading axis of the tuple `chunks`, stacked (values of
    `dtype`), without keeping any chunk's temporaries for the backward pass.

    Not `keras.ops.map` of `keras.remat(fn)` (`tf.map_fn` of
    `tf.recompute_grad`): map_fn copies every input into a TensorArray, its
    while loop's gradient keeps each chunk it read, and a graph while loop
    runs ten iterations at once, each holding its chunk's temporaries: more
    memory than no chunking at all, and each chunk computed twice.

    Here one loop slices one chunk at a time and computes, with the values,
    each row's gradient of its own value (a row's value depends on that row
    alone, so the gradient of the chunk's sum is exactly that), for the
    inputs a tape records. The backward pass only scales those rows by the
    upstream gradient: nothing is recomputed. The rows' gradients go into
    one buffer in place (`InplaceUpdate` on a fresh `Empty`, as
    `tf.parallel_stack` does); XLA, which has no `InplaceUpdate`, keeps a
    TensorArray as one buffer. The gradient is not itself differentiable
    (no second order).
    """
    chunks = tuple(chunks)
    count = tf.shape(chunks[0])[0]
    wanted = [j for j, chunk in enumerate(chunks) if chunk.dtype.is_floating and tracing.recorded(chunk)]
    xla = tracing.in_xla()

    @tf.custom_gradient
    def run(*xs):
        # The gradient is `gradient` below: an outer persistent tape must not
        # differentiate the loop itself (InplaceUpdate has no gradient).
        xs = [tf.stop_gradient(x) for x in xs]

        def loop(wanted):
            def body(*chunk):
                watched = [chunk[j] for j in wanted]
                with tf.GradientTape() as tape:
                    tape.watch(watched)
                    chunk_values = fn(chunk)
                grads = (
                    tape.gradient(chunk_values, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    if watched
                    else []
                )
                return chunk_values, grads

            body = tracing.compiled(body, xla)

            def step(i, values, slopes):
                chunk_values, grads = body(*[tf.cast(x[i], dtype) if x.dtype.is_floating else x[i] for x in xs])
                return i + 1, values.write(i, chunk_values), tuple(_put(s, i, g, xla) for s, g in zip(slopes, grads))

            # One iteration at a time: parallel ones would each hold a chunk.
            start = (
                tf.constant(0),
                tf.TensorArray(dtype, size=count),
                tuple(_buffer(xs[j], dtype, count, xla) for j in wanted),
            )
            _, values, slopes = tf.while_loop(
                lambda i, *_: i < count, step, start, parallel_iterations=1, maximum_iterations=count
            )
            return values.stack(), {j: s.stack() if xla else s for j, s in zip(wanted, slopes)}

        values, slopes = loop(wanted)

        def gradient(upstream):
            if not slopes and tracing.traced_untaped():
                slopes.update(loop([j for j, x in enumerate(xs) if x.dtype.is_floating])[1])
            grads = [None] * len(xs)
            for j, s in slopes.items():
                grads[j] = tf.cast(upstream[..., None] * s, xs[j].dtype)
            return grads

        return values, gradient

    return run(*chunks)


def _buffer(like, dtype, count, xla):
    """A buffer of `like`'s shape in `dtype`, for a loop to write `count`
    chunks of rows into, in place: a fresh `Empty` (every chunk is written,
    so it needs no zeros first), or under XLA, which has no
    `InplaceUpdate`, a TensorArray (one buffer there)."""
    if xla:
        return tf.TensorArray(dtype, size=count)
    return tf.raw_ops.Empty(shape=tf.shape(like), dtype=dtype)


def _put(buffer, i, chunk_rows, xla):
    """`buffer` with chunk `i`'s rows written in (`_buffer`'s)."""
    if xla:
        return buffer.write(i, chunk_rows)
    return tf.raw_ops.InplaceUpdate(x=buffer, i=tf.reshape(i, [1]), v=chunk_rows[None])


def _stacked(buffer, like, xla):
    """A filled `_buffer` in `like`'s shape."""
    return tf.reshape(buffer.stack() if xla else buffer, tf.shape(like))


def _chunked(x, chunk_size):
    """[n, ...] as [n / chunk_size, chunk_size, ...]: the loop's chunks."""
    return tf.reshape(x, tf.concat([[-1, chunk_size], tf.shape(x)[1:]], 0))


def _cast(x, dtype):
    """A float tensor in the compute dtype; None and integer tensors as they are."""
    return x if x is None or not x.dtype.is_floating else tf.cast(x, dtype)


def _flatten(rows, heads):
    """`(flat, positions, unflatten)`: the rows' and heads' tensors in one
    list (rows, then each head's hidden rows, kernel and bias if any),
    Keras variables read here, on the tape (Keras' convert_to_tensor hands
    a variable back as it is); where each head's parts lie in it (None for
    no bias); and `unflatten(tensors)`, a list like `flat` as
    `(rows, [Head])`."""
    rows = [tf.convert_to_tensor(r) for r in rows]
    parts = [[None if p is None else tf.convert_to_tensor(p) for p in (h.rows, h.kernel, h.bias)] for h in heads]
    positions, at = [], len(rows)
    for head in parts:
        positions.append([None if p is None else at + k for k, p in enumerate(head)])
        at += sum(p is not None for p in head)
    transposed = [h.transpose for h in heads]

    def unflatten(tensors):
        return list(tensors[: len(rows)]), [
            Head(*[None if k is None else tensors[k] for k in where], t) for where, t in zip(positions, transposed)
        ]

    return rows + [p for head in parts for p in head if p is not None], positions, unflatten


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` (MatMul's `transpose_b`: no
    transposed copy; `tf.transpose` would write one eagerly)."""
    return tf.matmul(rows, tf.convert_to_tensor(kernel), transpose_b=transpose_kernel)


def chunked_sum(fn, rows, heads, weights, chunk_size, dtype):
    """(Σᵣ weights[r]·fn(logits, rows)[r], its columns: see backend/__init__),
    `chunk_size` rows at a time, with
    the gradient formed in the forward pass.

    As `map_chunks`: one while loop, one chunk at a time. Each chunk forms
    its heads' logits, takes the gradient of its weighted sum w.r.t. them
    and the float rows, and turns the logits' gradient into the hidden
    rows' (into one buffer in place) and the kernel's and bias's (summed in
    the loop), for the inputs a tape records; the backward pass only scales
    them by the upstream scalar. A frozen teacher is not recorded: one
    forward product per chunk. The kernel's gradient is summed in the
    kernel's own layout, a block of its rows at a time (`add_kernel_grad`).
    First order only.
    """
    flat, positions, unflatten = _flatten(rows, heads)
    recorded = [t.dtype.is_floating and tracing.recorded(t) for t in flat]
    xla = tracing.in_xla()

    @tf.custom_gradient
    def run(weights, *tensors):
        # The gradient is `gradient` below: an outer persistent tape must not
        # differentiate the loop itself (InplaceUpdate has no gradient).
        tensors = [tf.stop_gradient(t) for t in tensors]

        def loop(wanted):
            return _sum_loop(fn, *unflatten(tensors), positions, weights, wanted, chunk_size, dtype, xla)

        columns, kept = loop(recorded)

        def gradient(upstream, _):
            # The columns are not differentiated: only the total's gradient counts.
            if all(g is None for g in kept) and tracing.traced_untaped():
                kept[:] = loop([t.dtype.is_floating for t in tensors])[1]
            scaled = [
                None if g is None else tf.cast(tf.cast(g, dtype) * upstream, t.dtype) for g, t in zip(kept, tensors)
            ]
            return [None] + scaled

        return (tf.reduce_sum(columns), columns), gradient

    return run(weights, *flat)


def _sum_loop(fn, rows, heads, positions, weights, wanted, chunk_size, dtype, xla):
    """`chunked_sum`'s loop: `(columns, grads)`, `grads` a list like
    `_flatten`'s with each input's gradient of the total where `wanted`
    marks it (unscaled), else None."""
    row_wanted = [i for i in range(len(rows)) if wanted[i]]
    parts = [[k is not None and wanted[k] for k in where] for where in positions]  # hidden, kernel, bias
    row_chunks = [_chunked(r, chunk_size) for r in rows]
    hidden_chunks = [_chunked(h.rows, chunk_size) for h in heads]
    params = [(_cast(h.kernel, dtype), _cast(h.bias, dtype), h.transpose) for h in heads]
    weights = _chunked(weights, chunk_size)
    count = tf.shape(weights)[0]
    loss = _chunk_loss(fn, parts, row_wanted, chunk_size, dtype, xla)

    def step(i, total, kernel_grads, bias_grads, row_grads, hidden_grads):
        chunk_rows = [_cast(r[i], dtype) for r in row_chunks]
        hidden = [_cast(h[i], dtype) for h in hidden_chunks]
        logits = [project(h, k, t) if b is None else project(h, k, t) + b for h, (k, b, t) in zip(hidden, params)]
        value, grads = loss(logits, chunk_rows, weights[i])
        grads = iter(grads)
        dlogits = [next(grads) if any(parts[j]) else None for j in range(len(heads))]
        row_grads = tuple(_put(g, i, tf.cast(next(grads), rows[k].dtype), xla) for g, k in zip(row_grads, row_wanted))
        kernel_grads = tuple(
            add_kernel_grad(a, dlogits[j], hidden[j], params[j][2], xla) for a, j in zip(kernel_grads, _which(parts, 1))
        )
        bias_grads = tuple(a + tf.reduce_sum(dlogits[j], 0) for a, j in zip(bias_grads, _which(parts, 2)))
        hidden_grads = tuple(
            _put(g, i, tf.cast(project(dlogits[j], params[j][0], not params[j][2]), heads[j].rows.dtype), xla)
            for g, j in zip(hidden_grads, _which(parts, 0))
        )
        return i + 1, total + value, kernel_grads, bias_grads, row_grads, hidden_grads

    # One iteration at a time: parallel ones would each hold a chunk.
    start = (
        tf.constant(0),
        tf.zeros(tf.shape(weights)[2:], dtype),
        # A fresh zeroed buffer per call: a tf.zeros constant would be
        # folded into the graph, and the in-place sums would mutate it.
        tuple(tf.raw_ops.Empty(shape=tf.shape(params[j][0]), dtype=dtype, init=True) for j in _which(parts, 1)),
        tuple(tf.zeros_like(params[j][1]) for j in _which(parts, 2)),
        tuple(_buffer(row_chunks[k], rows[k].dtype, count, xla) for k in row_wanted),
        tuple(_buffer(hidden_chunks[j], heads[j].rows.dtype, count, xla) for j in _which(parts, 0)),
    )
    _, total, kernel_grads, bias_grads, row_grads, hidden_grads = tf.while_loop(
        lambda i, *_: i < count, step, start, parallel_iterations=1, maximum_iterations=count
    )
    grads = [None] * len(wanted)
    for g, k in zip(row_grads, row_wanted):
        grads[k] = _stacked(g, rows[k], xla)
    for g, j in zip(hidden_grads, _which(parts, 0)):
        grads[positions[j][0]] = _stacked(g, heads[j].rows, xla)
    for part, found in ((1, kernel_grads), (2, bias_grads)):
        for g, j in zip(found, _which(parts, part)):
            grads[positions[j][part]] = g
    return total, grads


def _chunk_loss(fn, parts, row_wanted, chunk_size, dtype, xla):
    """`loss(logits, chunk_rows, weight)`: a chunk's columns and the
    gradients of their sum w.r.t. the logits of the heads with a part in
    `parts` to differentiate, then the float rows `row_wanted` lists;
    compiled by XLA (`tracing.compiled`) and in blocks of rows where XLA
    compiles it: the products stay TF's (oneDNN), faster on CPU than XLA's."""

    def loss(logits, chunk_rows, weight):
        watched = [logits[j] for j in range(len(parts)) if any(parts[j])] + [chunk_rows[i] for i in row_wanted]
        with tf.GradientTape() as tape, tracing.chunk_body():
            tape.watch(watched)
            columns = tf.reduce_sum(weight * fn(logits, chunk_rows), axis=0)
            value = tf.reduce_sum(columns)
        grads = tape.gradient(value, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO) if watched else []
        return columns, grads

    if xla or tracing.compiles(xla):
        # In blocks only where XLA compiles them: in a plain graph
        # a block's ops would each be a small TF kernel.
        outputs = sum(any(w) for w in parts) + len(row_wanted)
        loss = tracing.compiled(in_blocks(loss, chunk_size, dtype, outputs, CHUNK_ELEMENTS), xla)
    return loss


def chunked_values(fn, rows, heads, chunk_size, dtype):
    """fn(logits, rows) for every row ([rows] or [rows, k]), `chunk_size`
    rows at a time, with no gradient formed in the forward pass (a
    `map_fn`, one chunk at a time): the upstream gradient, of the values'
    shape, is known only in the backward pass, which forms each chunk's
    logits again as `chunked_sum` with it as the weights, under a tape of
    its own."""
    flat, positions, unflatten = _flatten(rows, heads)
    # The inputs a tape records (a frozen teacher's head is not): all float
    # inputs where the graph is differentiated from outside (see `tracing.traced_untaped`).
    recorded = [t.dtype.is_floating and tracing.recorded(t) for t in flat]
    # Frozen heads (a tape records their hidden rows, not their kernels or
    # biases, nor any float row: a LoRA fine-tune): each row's gradient of
    # its own value, formed with it, costs one product a chunk, where
    # forming the chunk again in the backward pass costs two.
    hidden_at = [where[0] for where in positions]
    others = [r for i, r in enumerate(recorded) if i not in hidden_at]
    jacobians = None
    if any(recorded[i] for i in hidden_at) and not any(others):
        jacobians = [recorded[i] for i in hidden_at]

    @tf.custom_gradient
    def run(*tensors):
        row_values, head_values = unflatten([tf.stop_gradient(t) for t in tensors])

        def chunk(xs):
            chunk_rows, hidden = xs
            logits = [
                project(_cast(h, dtype), _cast(k, dtype), t)
                if b is None
                else project(_cast(h, dtype), _cast(k, dtype), t) + _cast(b, dtype)
                for h, (_, k, b, t) in zip(hidden, head_values)
            ]
            with tracing.chunk_body():
                return fn(logits, [_cast(r, dtype) for r in chunk_rows])

        elements = ([_chunked(r, chunk_size) for r in row_values], [_chunked(h.rows, chunk_size) for h in head_values])
        if jacobians is not None and _one_value_a_row(chunk, row_values, head_values):
            return _values_and_jacobians(chunk, elements, jacobians, hidden_at, dtype, [t.dtype for t in tensors])
        values = tf.map_fn(chunk, elements, fn_output_signature=dtype, parallel_iterations=1)

        def gradient(upstream):
            wanted = (
                recorded if any(recorded) or not tracing.traced_untaped() else [t.dtype.is_floating for t in tensors]
            )
            watched = [t for t, w in zip(tensors, wanted) if w]
            with tf.GradientTape() as tape:
                tape.watch(watched)
                total = chunked_sum(fn, *unflatten(tensors), tf.cast(upstream, dtype), chunk_size, dtype)[0]
            found = iter(tape.gradient(total, watched) if watched else [])
            return [next(found) if w else None for w in wanted]

        return tf.reshape(values, tf.concat([[-1], tf.shape(values)[2:]], 0)), gradient

    return run(*flat)


def _one_value_a_row(chunk, rows, heads):
    """Whether `chunk` gives one value a row, from a one-row call (pruned
    from a graph that does not use it)."""
    sample = ([r[:1] for r in rows], [h[0][:1] for h in heads])
    return len(chunk(sample).shape) == 1


def _values_and_jacobians(chunk, elements, jacobians, hidden_at, dtype, dtypes):
    """`chunked_values` for frozen heads: with each chunk's values, each
    row's gradient of its own value w.r.t. the hidden rows of the heads
    `jacobians` marks, in one loop; the backward pass only scales them."""
    wanted = [j for j, want in enumerate(jacobians) if want]

    def body(xs):
        chunk_rows, hidden = xs
        hidden = [tf.cast(h, dtype) for h in hidden]
        with tf.GradientTape() as tape:
            tape.watch([hidden[j] for j in wanted])
            values = chunk((chunk_rows, hidden))
            total = tf.reduce_sum(values)
        # A row's value depends on its own row alone: the gradient of the
        # chunk's sum is each row's gradient of its own value.
        return values, tape.gradient(total, [hidden[j] for j in wanted])

    signature = (tf.TensorSpec(None, dtype), [tf.TensorSpec(None, dtype)] * len(wanted))
    values, grads = tf.map_fn(body, elements, fn_output_signature=signature, parallel_iterations=1)
    grads = [tf.reshape(g, tf.concat([[-1], tf.shape(g)[2:]], 0)) for g in grads]

    def gradient(upstream):
        result = [None] * len(dtypes)
        for j, g in zip(wanted, grads):
            at = hidden_at[j]
            result[at] = tf.cast(tf.cast(upstream, dtype)[:, None] * g, dtypes[at])
        return result

    return tf.reshape(values, [-1]), gradient


def _which(wanted, part):
    """The heads whose `part` (0 hidden, 1 kernel, 2 bias) needs a gradient."""
    return [j for j, parts in enumerate(wanted) if parts[part]]
