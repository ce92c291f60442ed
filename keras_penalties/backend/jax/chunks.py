"""JAX's chunk loops: `map_chunks` over formed logits and `chunked_sum`,
`chunked_values` over logits formed from hidden states, each a `custom_vjp`
over a `lax.scan` or `lax.map`; under Keras' `DataParallel` each device
runs the chunks of its own rows (`distribution.data_parallel`)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from keras_penalties._types import Head
from keras_penalties.backend.jax.blocks import add_kernel_grad
from keras_penalties.backend.jax.distribution import data_parallel, shard_map


# chunk_size="auto": the budgets that were fastest on the benchmark machine,
# of formed logits and from hidden states (bench/results/README.md).
CHUNK_ELEMENTS = 16 * 2**20


HEAD_CHUNK_ELEMENTS = 8 * 2**20


def map_chunks(fn, chunks, dtype):
    """`fn` over the leading axis of the tuple `chunks`, stacked (values of
    `dtype`), without recomputing any chunk in the backward pass (see
    `_map_chunks`). Under Keras' `DataParallel` over n > 1 devices, each
    device runs the chunks of its own rows (`shard_map`): nothing is
    gathered, and the gradients stay sharded like the inputs."""
    chunks = tuple(chunks)
    split = data_parallel(chunks[0].shape[0])
    if split is None:
        return _map_chunks(fn, chunks, dtype)
    mesh, axis = split
    spec = PartitionSpec(axis)
    return shard_map(lambda *c: _map_chunks(fn, c, dtype), mesh, (spec,) * len(chunks), spec, axis)(*chunks)


def _map_chunks(fn, chunks, dtype):
    """`map_chunks` on one device, or on each device's own chunks.

    A `custom_vjp` whose forward rule is one `lax.scan` that forms, with
    each chunk's values, each row's gradient of its own value (a row's value
    depends on that row alone, so the gradient of the chunk's sum is
    exactly that) for the inputs JAX differentiates (`symbolic_zeros`: a
    frozen teacher's rows cost nothing); the backward pass only scales
    those rows by the upstream gradient, as on TF and torch. Without
    differentiation it is a plain `lax.map`. Not `ops.map(keras.remat(fn))`,
    which runs every chunk's forward pass again in the backward pass. First
    order only.
    """
    dtypes = [c.dtype for c in chunks]

    @jax.custom_vjp
    def mapped(*chunks):
        return jax.lax.map(fn, chunks)

    def forward(*primals):
        values = tuple(p.value for p in primals)
        wanted = [j for j, p in enumerate(primals) if p.perturbed and _is_float(p.value)]

        def step(_, chunk):
            def chunk_values(*watched):
                full = list(chunk)
                for j, x in zip(wanted, watched):
                    full[j] = x
                return fn(tuple(full))

            rows, pullback = jax.vjp(chunk_values, *[chunk[j] for j in wanted])
            grads = dict(zip(wanted, pullback(jnp.ones_like(rows))))
            return None, (rows, [grads[j].astype(dtype) if j in grads else None for j in range(len(chunk))])

        _, (rows, grads) = jax.lax.scan(step, None, values)
        return rows, grads

    def backward(grads, upstream):
        return tuple(None if g is None else _scale_rows(g, upstream).astype(d) for g, d in zip(grads, dtypes))

    mapped.defvjp(forward, backward, symbolic_zeros=True)
    return mapped(*chunks)


def _scale_rows(grads, upstream):
    """grads[i] *= upstream[i] chunk by chunk, in the kept buffer: a loop
    that updates its carry in place. A plain `grads * upstream[..., None]`
    makes XLA write a second buffer the size of the gradient."""

    def step(i, g):
        return jax.lax.dynamic_update_index_in_dim(g, g[i] * upstream[i][..., None].astype(g.dtype), i, 0)

    return jax.lax.fori_loop(0, grads.shape[0], step, grads)


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` without a transposed copy (a
    `dot_general` contracting the kernel's last axis)."""
    contract = 1 if transpose_kernel else 0
    return jax.lax.dot_general(rows, kernel, (((1,), (contract,)), ((), ())))


def chunked_sum(fn, rows, heads, weights, chunk_size, dtype):
    """(Σᵣ weights[r]·fn(logits, rows)[r], its columns: see backend/__init__),
    `chunk_size` rows at a time, with
    the gradient formed in the forward pass (see `_chunked_sum`). Under
    Keras' `DataParallel` over n > 1 devices, each device sums the chunks
    of its own rows (`shard_map`) against its replica of the kernel and
    bias: nothing row-sized is gathered, the rows' and hidden states'
    gradients stay sharded, and the kernel's and bias's are summed over the
    devices once (an all-reduce of their size), not per chunk."""
    split = data_parallel(weights.shape[0] // chunk_size)
    if split is None:
        return _chunked_sum(fn, rows, heads, weights, chunk_size, dtype)
    mesh, axis = split
    rows, transposed = list(rows), [head.transpose for head in heads]
    has_bias = [head.bias is not None for head in heads]
    # The kernels and biases in the compute dtype before the devices split
    # (each chunk reads them so anyway): their gradients are then summed
    # over the devices in it too, and rounded to a half dtype once.
    params = [p.astype(dtype) for head in heads for p in (head.kernel, head.bias) if p is not None]
    rowwise = rows + [head.rows for head in heads]
    sharded, whole = PartitionSpec(axis), PartitionSpec()
    specs = (sharded,) * len(rowwise) + (whole,) * len(params) + (sharded,)

    def local(*args):
        local_rows, hidden = args[: len(rows)], args[len(rows) : len(rowwise)]
        params, local_weights = iter(args[len(rowwise) : -1]), args[-1]
        local_heads = [
            Head(h, next(params), next(params) if b else None, t) for h, b, t in zip(hidden, has_bias, transposed)
        ]
        # Each device's partial sums, one entry of sharded vectors: summed
        # outside, so that no collective runs inside the loop.
        total, columns = _chunked_sum(fn, local_rows, local_heads, local_weights, chunk_size, dtype)
        return total[None], columns[None]

    partial, columns = shard_map(local, mesh, specs, (sharded, sharded), axis)(*rowwise, *params, weights)
    return jnp.sum(partial), jnp.sum(columns, axis=0)


def _chunked_sum(fn, rows, heads, weights, chunk_size, dtype):
    """`chunked_sum` on one device, or on each device's own rows (a
    `lax.scan`).

    A `custom_vjp`. Each chunk forms its heads' logits, takes the gradient of
    its weighted sum w.r.t. those logits and the float rows, then turns the
    logits' gradient into the hidden rows' (into one buffer) and the
    kernel's and bias's (summed in the scan's carry) with one product each:
    nothing is recomputed, and the backward pass only scales the kept
    gradients by the upstream scalar. Only the inputs JAX differentiates
    are taken (`symbolic_zeros`: a frozen teacher costs one forward product
    per chunk).
    """
    rows = list(rows)
    transposed = [head.transpose for head in heads]
    heads = [[head.rows, head.kernel, head.bias] for head in heads]
    row_dtypes = [r.dtype for r in rows]
    head_dtypes = [[None if p is None else p.dtype for p in head] for head in heads]

    @jax.custom_vjp
    def total(rows, heads, weights):
        columns = _summed_columns(fn, transposed, rows, heads, weights, chunk_size, dtype)
        return jnp.sum(columns), columns

    def forward(rows, heads, weights):
        row_wanted = [i for i, r in enumerate(rows) if r.perturbed and _is_float(r.value)]
        wanted = [[p is not None and p.perturbed for p in head] for head in heads]
        values = ([r.value for r in rows], [[None if p is None else p.value for p in head] for head in heads])
        value, kept = _summed_with_grads(fn, transposed, *values, weights.value, chunk_size, dtype, row_wanted, wanted)
        return (jnp.sum(value), value), kept

    def backward(kept, upstream):
        kept_rows, kept_heads = kept
        # The columns are not differentiated: only the total's cotangent counts.
        upstream = upstream[0]
        if isinstance(upstream, jax.custom_derivatives.SymbolicZero):
            upstream = jnp.zeros((), dtype)

        def scale(g, to):
            return None if g is None else (g.astype(dtype) * upstream).astype(to)

        return (
            [scale(g, d) for g, d in zip(kept_rows, row_dtypes)],
            [[scale(g, d) for g, d in zip(grads, dtypes)] for grads, dtypes in zip(kept_heads, head_dtypes)],
            None,
        )

    total.defvjp(forward, backward, symbolic_zeros=True)
    return total(rows, heads, weights)


def _is_float(x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def _cast(x, dtype):
    """A float tensor in the compute dtype; None and integer tensors as they are."""
    return x if x is None or not _is_float(x) else x.astype(dtype)


def _split(x, chunk_size):
    """[n, ...] as [n / chunk_size, chunk_size, ...]: the scan's chunks."""
    return x.reshape((-1, chunk_size) + x.shape[1:])


def _logits(hidden, kernel, bias, transpose):
    logits = project(hidden, kernel, transpose)
    return logits if bias is None else logits + bias


def _summed_columns(fn, transposed, rows, heads, weights, chunk_size, dtype):
    """Σᵣ weights[r]·fn(chunk logits, chunk rows)[r] (the columns), one
    chunk at a time: `_chunked_sum`'s value where nothing is differentiated."""
    params = [(_cast(k, dtype), _cast(b, dtype)) for _, k, b in heads]

    def step(acc, xs):
        chunk_rows, hidden, w = xs
        logits = [_logits(_cast(h, dtype), *params[j], transposed[j]) for j, h in enumerate(hidden)]
        return acc + jnp.sum(w * fn(logits, [_cast(r, dtype) for r in chunk_rows]), axis=0), None

    chunks = (
        [_split(r, chunk_size) for r in rows],
        [_split(h[0], chunk_size) for h in heads],
        _split(weights, chunk_size),
    )
    return jax.lax.scan(step, jnp.zeros(weights.shape[1:], dtype), chunks)[0]


def _summed_with_grads(fn, transposed, rows, heads, weights, chunk_size, dtype, row_wanted, wanted):
    """`_chunked_sum`'s forward rule: `(columns, (row grads, head grads))`,
    the gradients of the total w.r.t. the rows `row_wanted` lists and the
    heads' parts (hidden, kernel, bias) `wanted` marks, unscaled, None for
    the others."""
    params = [(_cast(k, dtype), _cast(b, dtype)) for _, k, b in heads]

    def step(carry, xs):
        acc, kernel_grads, bias_grads = carry
        chunk_rows = [_cast(r, dtype) for r in xs[0]]
        hidden = [_cast(h, dtype) for h in xs[1]]
        logits = [_logits(h, *params[j], transposed[j]) for j, h in enumerate(hidden)]

        def chunk_value(logits, wanted_rows):
            all_rows = list(chunk_rows)
            for i, t in zip(row_wanted, wanted_rows):
                all_rows[i] = t
            columns = jnp.sum(xs[2] * fn(logits, all_rows), axis=0)
            return jnp.sum(columns), columns

        # Gradients nothing reads (a frozen teacher's logits) are dropped by XLA.
        (_, value), (dlogits, row_grads) = jax.value_and_grad(chunk_value, argnums=(0, 1), has_aux=True)(
            logits, [chunk_rows[i] for i in row_wanted]
        )
        kernel_grads = [
            g if g is None else add_kernel_grad(g, hidden[j], dlogits[j], transposed[j])
            for j, g in enumerate(kernel_grads)
        ]
        bias_grads = [g if g is None else g + jnp.sum(dlogits[j], axis=0) for j, g in enumerate(bias_grads)]
        hidden_grads = [
            project(dlogits[j], params[j][0], not transposed[j]).astype(heads[j][0].dtype) if wanted[j][0] else None
            for j in range(len(heads))
        ]
        row_grads = [g.astype(rows[i].dtype) for i, g in zip(row_wanted, row_grads)]
        return (acc + value, kernel_grads, bias_grads), (row_grads, hidden_grads)

    start = (
        jnp.zeros(weights.shape[1:], dtype),
        [jnp.zeros_like(params[j][0]) if wanted[j][1] else None for j in range(len(heads))],
        [jnp.zeros_like(params[j][1]) if wanted[j][2] else None for j in range(len(heads))],
    )
    chunks = (
        [_split(r, chunk_size) for r in rows],
        [_split(h[0], chunk_size) for h in heads],
        _split(weights, chunk_size),
    )
    (value, kernel_grads, bias_grads), (row_grads, hidden_grads) = jax.lax.scan(step, start, chunks)
    kept_rows = [None] * len(rows)
    for i, g in zip(row_wanted, row_grads):
        kept_rows[i] = g.reshape(rows[i].shape)
    kept_heads = [
        [None if h is None else h.reshape(head[0].shape), k, b]
        for head, h, k, b in zip(heads, hidden_grads, kernel_grads, bias_grads)
    ]
    return value, (kept_rows, kept_heads)


def chunked_values(fn, rows, heads, chunk_size, dtype):
    """fn(logits, rows) for every row ([rows] or [rows, k]), `chunk_size`
    rows at a time: no [rows, classes] array forward or backward. The
    upstream gradient, of the values' shape, is known only in the backward
    pass: that pass forms each
    chunk's logits again, as `chunked_sum` with it as the weights (a
    `custom_vjp` over the inputs JAX differentiates; under Keras'
    `DataParallel`, each device maps its own rows)."""
    rows = list(rows)
    transposed = [head.transpose for head in heads]

    def full(heads):
        return [Head(*head, t) for head, t in zip(heads, transposed)]

    @jax.custom_vjp
    def values(rows, heads):
        return _mapped_values(fn, rows, full(heads), chunk_size, dtype)

    def split(x, wanted):
        """The residuals: the differentiated inputs, and the others, each in
        its own tree with None for the other's (a static pattern the
        backward rule reads, per call)."""
        return (x.value if wanted else None), (None if wanted else x.value)

    def forward(rows, heads):
        row_pairs = [split(r, r.perturbed) for r in rows]
        head_pairs = [[(None, None) if p is None else split(p, p.perturbed) for p in h] for h in heads]
        wanted = ([w for w, _ in row_pairs], [[w for w, _ in h] for h in head_pairs])
        fixed = ([c for _, c in row_pairs], [[c for _, c in h] for h in head_pairs])
        hidden = [h[0].perturbed for h in heads]
        frozen = not any(r.perturbed and _is_float(r.value) for r in rows) and not any(
            p is not None and p.perturbed for h in heads for p in h[1:]
        )
        rows = [r.value for r in rows]
        heads = [[None if p is None else p.value for p in h] for h in heads]
        if frozen and any(hidden) and _one_value_a_row(fn, rows, full(heads), chunk_size, dtype):
            # Frozen heads (no kernel or bias gradient: a LoRA fine-tune):
            # each row's gradient of its own value, formed with it, costs
            # one product a chunk, where forming the chunk again in the
            # backward pass costs two.
            result, jacobians = _mapped_values(fn, rows, full(heads), chunk_size, dtype, hidden)
            return result, (None, jacobians)
        return values(rows, heads), (wanted, fixed)

    def backward(saved, upstream):
        wanted, rest = saved
        if wanted is None:
            return [None] * len(rows), [
                [None if j is None else (upstream[:, None].astype(dtype) * j).astype(j.dtype), None, None] for j in rest
            ]
        fixed_rows, fixed_heads = rest

        def total(wanted_rows, wanted_heads):
            all_rows = [c if w is None else w for w, c in zip(wanted_rows, fixed_rows)]
            all_heads = [[c if w is None else w for w, c in zip(ws, cs)] for ws, cs in zip(wanted_heads, fixed_heads)]
            return chunked_sum(fn, all_rows, full(all_heads), upstream.astype(dtype), chunk_size, dtype)[0]

        _, pullback = jax.vjp(total, *wanted)
        return pullback(jnp.ones((), dtype))

    values.defvjp(forward, backward, symbolic_zeros=True)
    return values(rows, [[head.rows, head.kernel, head.bias] for head in heads])


def _one_value_a_row(fn, rows, heads, chunk_size, dtype):
    """Whether `fn` gives one value a row (not [rows, k]), from its shapes."""
    params = [(k, b, t) for _, k, b, t in heads]

    def chunk(chunk_rows, hidden):
        logits = [project(h.astype(dtype), k.astype(dtype), t) for h, (k, _, t) in zip(hidden, params)]
        return fn(logits, [_cast(r, dtype) for r in chunk_rows])

    shape = jax.eval_shape(chunk, [r[:chunk_size] for r in rows], [h[0][:chunk_size] for h in heads]).shape
    return len(shape) == 1


def _mapped_values(fn, rows, heads, chunk_size, dtype, jacobians=None):
    """The per-row values of `chunked_values`, without their gradient: a
    `lax.map` over chunks, on each device's own rows under `DataParallel`.
    With `jacobians` (a bool a head), also each row's gradient of its own
    value w.r.t. the hidden rows of those heads (None for the others)."""
    n = (heads[0][0] if heads else rows[0]).shape[0]
    split = data_parallel(n // chunk_size)
    if split is None:
        return _local_values(fn, rows, heads, chunk_size, dtype, jacobians)
    mesh, axis = split
    transposed, has_bias = [h[3] for h in heads], [h[2] is not None for h in heads]
    params = [p.astype(dtype) for head in heads for p in (head.kernel, head.bias) if p is not None]
    rowwise = rows + [head.rows for head in heads]
    sharded, whole = PartitionSpec(axis), PartitionSpec()

    def local(*args):
        local_rows, hidden, params = args[: len(rows)], args[len(rows) : len(rowwise)], iter(args[len(rowwise) :])
        local_heads = [
            Head(h, next(params), next(params) if b else None, t) for h, b, t in zip(hidden, has_bias, transposed)
        ]
        return _local_values(fn, list(local_rows), local_heads, chunk_size, dtype, jacobians)

    specs = (sharded,) * len(rowwise) + (whole,) * len(params)
    out = sharded if jacobians is None else (sharded, [sharded if j else None for j in jacobians])
    return shard_map(local, mesh, specs, out, axis)(*rowwise, *params)


def _local_values(fn, rows, heads, chunk_size, dtype, jacobians=None):
    params = [(_cast(k, dtype), _cast(b, dtype), t) for _, k, b, t in heads]

    def logits_of(hidden):
        return [_logits(_cast(h, dtype), k, b, t) for h, (k, b, t) in zip(hidden, params)]

    def chunk(xs):
        chunk_rows, hidden = xs
        return fn(logits_of(hidden), [_cast(r, dtype) for r in chunk_rows])

    def chunk_and_jacobians(xs):
        chunk_rows, hidden = xs
        chunk_rows = [_cast(r, dtype) for r in chunk_rows]

        def summed(logits):
            values = fn(logits, chunk_rows)
            return jnp.sum(values), values

        # A row's value depends on its own row alone: the gradient of the
        # chunk's sum is each row's gradient of its own value.
        (_, values), dlogits = jax.value_and_grad(summed, has_aux=True)(logits_of(hidden))
        grads = [
            project(g, k, not t).astype(h.dtype) if wanted else None
            for g, (k, _, t), h, wanted in zip(dlogits, params, hidden, jacobians)
        ]
        return values, grads

    inputs = ([_split(r, chunk_size) for r in rows], [_split(h[0], chunk_size) for h in heads])
    if jacobians is None:
        values = jax.lax.map(chunk, inputs)
        return values.reshape((-1,) + values.shape[2:])
    values, grads = jax.lax.map(chunk_and_jacobians, inputs)
    return values.reshape(-1), [None if g is None else g.reshape((-1,) + g.shape[2:]) for g in grads]
