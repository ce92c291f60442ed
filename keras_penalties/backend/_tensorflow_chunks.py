"""TensorFlow's chunk loops: `map_chunks` over formed logits, `chunked_sum`
and `chunked_values` over logits formed from hidden states, and what they
ask of a trace (whether XLA compiles it, whether a tape records an input).
Used by `backend/tensorflow.py` only."""

import contextvars
import functools

import tensorflow as tf

from keras_penalties._types import Head
from keras_penalties.backend import _common

from keras_penalties import _keras_internals
from keras_penalties.backend._tensorflow_blocks import add_kernel_grad, in_blocks

# chunk_size="auto": about 1 M elements of formed logits a chunk (32 rows of
# 32000, 8 of 128256), chunks that stay in cache, and 16 M from hidden states
# were the fastest on the benchmark machine (bench/results/README.md).
CHUNK_ELEMENTS = 2**20
HEAD_CHUNK_ELEMENTS = 16 * 2**20


def _in_xla():
    """Whether the graph being built will be compiled by XLA (`jit_compile`).
    TF has no public way to ask; without its private helper, assume so (the
    XLA-safe path works everywhere, at one more copy of the gradient)."""
    return _keras_internals.tf_graph_in_xla(tf.compat.v1.get_default_graph())


def _traced_untaped():
    """Whether a gradient is being built for a graph traced with no tape
    recording its inputs: a `tf.function` differentiated by a tape outside
    it. The loops then kept no gradient, and form them when asked (a second
    loop). In eager mode an input no tape recorded needs none; `fit` traces
    its tape inside the step, so its inputs are recorded, and `evaluate`
    never asks."""
    return not tf.executing_eagerly()


def _recorded(tensor):
    """Whether a gradient tape records `tensor` (someone may ask for its
    gradient). TF's own `custom_gradient` asks this; the helper is private,
    and without it every input counts as recorded."""
    return _keras_internals.tf_records_backprop([tensor])


# Whether the code running is the forward pass of a chunk of logits formed
# from hidden states (`chunked_sum`), whose gradient is taken once: where
# `label_cross_entropy` fuses.
in_chunk = contextvars.ContextVar("keras_penalties_tfin_chunk", default=False)


def chunk_body():
    return _common.flag_set(in_chunk)


def _compiled(fn, xla):
    """`fn` compiled by XLA (`tf.function(jit_compile=True)`) when it will
    be traced into a graph that XLA does not already compile and TF sees
    only CPUs (`_compiles`); as it is eagerly, where each call would trace
    and compile it anew. A chunk's passes over its logits (softmax, logs,
    products, sums, and their gradients) then run fused, as on JAX, instead
    of one TF kernel and one chunk-sized buffer each."""
    return tf.function(fn, jit_compile=True, autograph=False) if _compiles(xla) else fn


def _compiles(xla):
    """Whether `_compiled` compiles here."""
    return not xla and not tf.executing_eagerly() and _cpu_only()


@functools.cache
def _cpu_only():
    """Whether TF sees no device but CPUs, where compiling the chunks was
    shown to pay. With a GPU Keras' `fit` compiles the whole step with XLA
    anyway; a pluggable device may have no XLA compiler at all."""
    return all(d.device_type == "CPU" for d in tf.config.list_physical_devices())


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
    wanted = [j for j, chunk in enumerate(chunks) if chunk.dtype.is_floating and _recorded(chunk)]
    xla = _in_xla()

    def buffer(x):
        if xla:
            return tf.TensorArray(dtype, size=count)
        # Every chunk is written, so the buffer needs no zeros first.
        return tf.raw_ops.Empty(shape=tf.shape(x), dtype=dtype)

    def put(rows, i, chunk_rows):
        if xla:
            return rows.write(i, chunk_rows)
        return tf.raw_ops.InplaceUpdate(x=rows, i=tf.reshape(i, [1]), v=chunk_rows[None])

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

            body = _compiled(body, xla)

            def step(i, values, slopes):
                chunk_values, grads = body(*[tf.cast(x[i], dtype) if x.dtype.is_floating else x[i] for x in xs])
                return i + 1, values.write(i, chunk_values), tuple(put(s, i, g) for s, g in zip(slopes, grads))

            # One iteration at a time: parallel ones would each hold a chunk.
            start = (tf.constant(0), tf.TensorArray(dtype, size=count), tuple(buffer(xs[j]) for j in wanted))
            _, values, slopes = tf.while_loop(
                lambda i, *_: i < count, step, start, parallel_iterations=1, maximum_iterations=count
            )
            return values.stack(), dict(zip(wanted, (s.stack() if xla else s for s in slopes)))

        values, slopes = loop(wanted)

        def gradient(upstream):
            if not slopes and _traced_untaped():
                slopes.update(loop([j for j, x in enumerate(xs) if x.dtype.is_floating])[1])
            grads = [None] * len(xs)
            for j, s in slopes.items():
                grads[j] = tf.cast(upstream[..., None] * s, xs[j].dtype)
            return grads

        return values, gradient

    return run(*chunks)


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
    # Keras variables (a head's kernel) are read here, on the tape: Keras'
    # convert_to_tensor hands a variable back as it is.
    rows = [tf.convert_to_tensor(r) for r in rows]
    transposed = [head.transpose for head in heads]
    heads = [
        [None if p is None else tf.convert_to_tensor(p) for p in (head.rows, head.kernel, head.bias)] for head in heads
    ]
    flat = rows + [p for head in heads for p in head if p is not None]
    recorded = [t.dtype.is_floating and _recorded(t) for t in flat]
    row_wanted = [i for i in range(len(rows)) if recorded[i]]
    position, wanted = len(rows), []
    for head in heads:
        wanted.append([False if p is None else recorded[position + k] for k, p in enumerate(head)])
        position += sum(p is not None for p in head)
    xla = _in_xla()

    def cast(x):
        return x if x is None or not x.dtype.is_floating else tf.cast(x, dtype)

    def unflatten(tensors):
        rest = list(tensors[len(rows) :])
        unpacked = []
        for head in heads:
            unpacked.append([None if p is None else rest.pop(0) for p in head])
        return list(tensors[: len(rows)]), unpacked

    @tf.custom_gradient
    def run(weights, *tensors):
        # The gradient is `gradient` below: an outer persistent tape must not
        # differentiate the loop itself (InplaceUpdate has no gradient).
        tensors = [tf.stop_gradient(t) for t in tensors]
        row_values, head_values = unflatten(tensors)

        def chunked(x):
            return tf.reshape(x, tf.concat([[-1, chunk_size], tf.shape(x)[1:]], 0))

        row_chunks = [chunked(r) for r in row_values]
        hidden_chunks = [chunked(head[0]) for head in head_values]
        params = [(cast(k), cast(b)) for _, k, b in head_values]
        weights = chunked(weights)
        count = tf.shape(weights)[0]

        def buffer(x):
            if xla:
                return tf.TensorArray(x.dtype, size=count)
            return tf.raw_ops.Empty(shape=tf.shape(x), dtype=x.dtype)

        def put(so_far, i, chunk_rows):
            if xla:
                return so_far.write(i, chunk_rows)
            return tf.raw_ops.InplaceUpdate(x=so_far, i=tf.reshape(i, [1]), v=chunk_rows[None])

        def loop(row_wanted, wanted):
            def loss(logits, chunk_rows, weight):
                # The chunk's value and its logits' (and float rows')
                # gradient, compiled by XLA (`_compiled`); the products
                # stay TF's (oneDNN), faster on CPU than XLA's.
                watched = [logits[j] for j in range(len(heads)) if any(wanted[j])] + [chunk_rows[i] for i in row_wanted]
                with tf.GradientTape() as tape, chunk_body():
                    tape.watch(watched)
                    columns = tf.reduce_sum(weight * fn(logits, chunk_rows), axis=0)
                    value = tf.reduce_sum(columns)
                grads = (
                    tape.gradient(value, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO) if watched else []
                )
                return columns, grads

            if xla or _compiles(xla):
                # In blocks only where XLA compiles them: in a plain graph
                # a block's ops would each be a small TF kernel.
                outputs = sum(any(w) for w in wanted) + len(row_wanted)
                loss = _compiled(in_blocks(loss, chunk_size, dtype, outputs, CHUNK_ELEMENTS), xla)

            def step(i, total, kernel_grads, bias_grads, row_grads, hidden_grads):
                chunk_rows = [cast(r[i]) for r in row_chunks]
                hidden = [cast(h[i]) for h in hidden_chunks]
                logits = [
                    project(h, k, t) if b is None else project(h, k, t) + b
                    for h, (k, b), t in zip(hidden, params, transposed)
                ]
                value, grads = loss(logits, chunk_rows, weights[i])
                grads = iter(grads)
                dlogits = [next(grads) if any(wanted[j]) else None for j in range(len(heads))]
                row_grads = tuple(put(b, i, tf.cast(next(grads), rows[k].dtype)) for b, k in zip(row_grads, row_wanted))
                kernel_grads = tuple(
                    add_kernel_grad(a, dlogits[j], hidden[j], transposed[j], xla)
                    for a, j in zip(kernel_grads, _which(wanted, 1))
                )
                bias_grads = tuple(a + tf.reduce_sum(dlogits[j], 0) for a, j in zip(bias_grads, _which(wanted, 2)))
                hidden_grads = tuple(
                    put(b, i, tf.cast(project(dlogits[j], params[j][0], not transposed[j]), heads[j][0].dtype))
                    for b, j in zip(hidden_grads, _which(wanted, 0))
                )
                return i + 1, total + value, kernel_grads, bias_grads, row_grads, hidden_grads

            # One iteration at a time: parallel ones would each hold a chunk.
            start = (
                tf.constant(0),
                tf.zeros(tf.shape(weights)[2:], dtype),
                # A fresh zeroed buffer per call: a tf.zeros constant would be
                # folded into the graph, and the in-place sums would mutate it.
                tuple(
                    tf.raw_ops.Empty(shape=tf.shape(params[j][0]), dtype=dtype, init=True) for j in _which(wanted, 1)
                ),
                tuple(tf.zeros_like(params[j][1]) for j in _which(wanted, 2)),
                tuple(buffer(row_chunks[k]) for k in row_wanted),
                tuple(buffer(hidden_chunks[j]) for j in _which(wanted, 0)),
            )
            _, total, kernel_grads, bias_grads, row_grads, hidden_grads = tf.while_loop(
                lambda i, *_: i < count, step, start, parallel_iterations=1, maximum_iterations=count
            )

            def stacked(g, like):
                return tf.reshape(g.stack() if xla else g, tf.shape(like))

            kept_rows = dict(zip(row_wanted, (stacked(g, row_values[k]) for g, k in zip(row_grads, row_wanted))))
            kept = [dict() for _ in heads]
            for g, j in zip(hidden_grads, _which(wanted, 0)):
                kept[j][0] = stacked(g, head_values[j][0])
            for g, j in zip(kernel_grads, _which(wanted, 1)):
                kept[j][1] = g
            for g, j in zip(bias_grads, _which(wanted, 2)):
                kept[j][2] = g

            return total, kept_rows, kept

        columns, kept_rows, kept = loop(row_wanted, wanted)

        def gradient(upstream, _):
            # The columns are not differentiated: only the total's gradient counts.
            if not kept_rows and not any(kept) and _traced_untaped():
                everything = [[p is not None and p.dtype.is_floating for p in head] for head in head_values]
                _, more_rows, more = loop([i for i, r in enumerate(row_values) if r.dtype.is_floating], everything)
                kept_rows.update(more_rows)
                for mine, theirs in zip(kept, more):
                    mine.update(theirs)

            def scale(g, like):
                return None if g is None else tf.cast(tf.cast(g, dtype) * upstream, like.dtype)

            grads = [scale(kept_rows.get(k), r) for k, r in enumerate(row_values)]
            for j, head in enumerate(head_values):
                grads += [scale(kept[j].get(k), p) for k, p in enumerate(head) if p is not None]
            return [None] + grads

        return (tf.reduce_sum(columns), columns), gradient

    return run(weights, *flat)


def chunked_values(fn, rows, heads, chunk_size, dtype):
    """fn(logits, rows) for every row ([rows] or [rows, k]), `chunk_size`
    rows at a time, with no gradient formed in the forward pass (a
    `map_fn`, one chunk at a time): the upstream gradient, of the values'
    shape, is known only in the backward pass, which forms each chunk's
    logits again as `chunked_sum` with it as the weights, under a tape of
    its own."""
    rows = [tf.convert_to_tensor(r) for r in rows]
    transposed = [head.transpose for head in heads]
    parts = [
        [None if p is None else tf.convert_to_tensor(p) for p in (head.rows, head.kernel, head.bias)] for head in heads
    ]
    flat = rows + [p for head in parts for p in head if p is not None]
    # The inputs a tape records (a frozen teacher's head is not): all float
    # inputs where the graph is differentiated from outside (see `_traced_untaped`).
    recorded = [t.dtype.is_floating and _recorded(t) for t in flat]
    # Frozen heads (a tape records their hidden rows, not their kernels or
    # biases, nor any float row: a LoRA fine-tune): each row's gradient of
    # its own value, formed with it, costs one product a chunk, where
    # forming the chunk again in the backward pass costs two.
    hidden_at = []
    for head in parts:
        hidden_at.append(len(rows) + sum(p is not None for h in parts[: len(hidden_at)] for p in h))
    others = [r for i, r in enumerate(recorded) if i not in hidden_at]
    jacobians = None
    if any(recorded[i] for i in hidden_at) and not any(others):
        jacobians = [recorded[i] for i in hidden_at]

    def unflatten(tensors):
        rest = iter(tensors[len(rows) :])
        return list(tensors[: len(rows)]), [
            Head(*[None if p is None else next(rest) for p in head], t) for head, t in zip(parts, transposed)
        ]

    def cast(x):
        return x if x is None or not x.dtype.is_floating else tf.cast(x, dtype)

    @tf.custom_gradient
    def run(*tensors):
        row_values, head_values = unflatten([tf.stop_gradient(t) for t in tensors])

        def chunked(x):
            return tf.reshape(x, tf.concat([[-1, chunk_size], tf.shape(x)[1:]], 0))

        def chunk(xs):
            chunk_rows, hidden = xs
            logits = [
                project(cast(h), cast(k), t) if b is None else project(cast(h), cast(k), t) + cast(b)
                for h, (_, k, b, t) in zip(hidden, head_values)
            ]
            with chunk_body():
                return fn(logits, [cast(r) for r in chunk_rows])

        elements = ([chunked(r) for r in row_values], [chunked(h[0]) for h in head_values])
        if jacobians is not None and _one_value_a_row(chunk, row_values, head_values):
            return _values_and_jacobians(chunk, elements, jacobians, head_values, dtype, [t.dtype for t in tensors])
        values = tf.map_fn(chunk, elements, fn_output_signature=dtype, parallel_iterations=1)

        def gradient(upstream):
            wanted = recorded if any(recorded) or not _traced_untaped() else [t.dtype.is_floating for t in tensors]
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


def _values_and_jacobians(chunk, elements, jacobians, heads, dtype, dtypes):
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
    n_rows = len(dtypes) - sum(1 + (h[2] is not None) + 1 for h in heads)

    def gradient(upstream):
        result = [None] * len(dtypes)
        for j, g in zip(wanted, grads):
            at = n_rows + sum(2 + (h[2] is not None) for h in heads[:j])
            result[at] = tf.cast(tf.cast(upstream, dtype)[:, None] * g, dtypes[at])
        return result

    return tf.reshape(values, [-1]), gradient


def _which(wanted, part):
    """The heads whose `part` (0 hidden, 1 kernel, 2 bias) needs a gradient."""
    return [j for j, parts in enumerate(wanted) if parts[part]]
