"""JAX's heads: logits formed from hidden states a chunk at a time
(`chunked_sum`, `chunked_values`), the products they cannot avoid, and the
split of a chunked op's rows over the devices of Keras' distribution
(`data_parallel`, `shard_map`). Used by `backend/jax.py` only."""

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec

from keras_penalties._types import Head


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` without a transposed copy (a
    `dot_general` contracting the kernel's last axis)."""
    contract = 1 if transpose_kernel else 0
    return jax.lax.dot_general(rows, kernel, (((1,), (contract,)), ((), ())))


def kernel_grad(hidden, dlogits, transpose_kernel):
    """∂/∂kernel of Σ dlogits·(hidden @ kernel): hiddenᵀ·dlogits [H, V], or
    dlogitsᵀ·hidden [V, H] for a transposed (tied) kernel."""
    first, second = (dlogits, hidden) if transpose_kernel else (hidden, dlogits)
    return jax.lax.dot_general(first, second, (((0,), (0,)), ((), ())))


def _add_kernel_grad(total, hidden, dlogits, transpose_kernel):
    """total + kernel_grad(hidden, dlogits); on CPU a block at a time (see
    `_add_kernel_grad_in_blocks`). The blocks were measured on CPU only,
    and XLA:GPU's GEMM rewriter can fold the add into the product (cuBLAS's
    beta) where a loop of small products would cost a launch each: on other
    platforms, and where variables may be sharded, it stays the plain sum."""
    if jax.default_backend() != "cpu" or _model_parallel():
        return total + kernel_grad(hidden, dlogits, transpose_kernel)
    return _add_kernel_grad_in_blocks(total, hidden, dlogits, transpose_kernel)


def _model_parallel():
    """Whether Keras' distribution splits variables (a `ModelParallel` mesh
    with a non-batch axis over several devices). A kernel may then be
    sharded on its vocabulary axis, which the blocks of a tied kernel's
    gradient slice: XLA gathered each chunk's [chunk, V] logits gradient
    for them, and left the kernel's gradient replicated."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.ModelParallel):
        return False
    mesh = distribution.device_mesh
    return any(size > 1 for name, size in zip(mesh.axis_names, mesh.shape) if name != distribution.batch_dim_name)


def _add_kernel_grad_in_blocks(total, hidden, dlogits, transpose_kernel):
    """total + kernel_grad(hidden, dlogits), a block of the kernel's rows at
    a time (a loop: each block's product is added, in place, before the
    next is formed), each block about the size of the chunk's logits.

    XLA:CPU fuses no dot with an add: the whole [H, V] product would be a
    temporary beside the sum. A [H, V] kernel's blocks are rows of H (slices of
    the chunk's hidden columns), a [V, H] one's rows of V (slices of the
    logits' gradient columns)."""
    rows, features = hidden.shape
    classes = dlogits.shape[1]
    length = classes if transpose_kernel else features
    block = max(1, rows * classes // features) if transpose_kernel else rows
    if length <= block:
        return total + kernel_grad(hidden, dlogits, transpose_kernel)

    def product(start, size):
        if transpose_kernel:
            return kernel_grad(hidden, jax.lax.dynamic_slice_in_dim(dlogits, start, size, 1), True)
        return kernel_grad(jax.lax.dynamic_slice_in_dim(hidden, start, size, 1), dlogits, False)

    def add(total, start, size):
        so_far = jax.lax.dynamic_slice_in_dim(total, start, size, 0)
        return jax.lax.dynamic_update_slice_in_dim(total, so_far + product(start, size), start, 0)

    total = jax.lax.fori_loop(0, length // block, lambda b, t: add(t, b * block, block), total)
    if length % block:
        total = add(total, length - length % block, length % block)
    return total


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


def data_parallel(chunks):
    """`(mesh, batch axis name)` where Keras' distribution (`DataParallel`,
    or `ModelParallel`) splits the batch over n > 1 devices and the
    `chunks` split evenly among them, else None."""
    devices = row_shards()
    if devices == 1 or not isinstance(chunks, int) or chunks % devices:
        return None
    distribution = keras.distribution.distribution()
    return distribution.device_mesh.backend_mesh, distribution.batch_dim_name


def row_shards():
    """As `_common.row_shards`: the devices on the batch axis of Keras'
    distribution (`DataParallel`, `ModelParallel`)."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, (keras.distribution.DataParallel, keras.distribution.ModelParallel)):
        return 1
    mesh = distribution.device_mesh
    return dict(zip(mesh.axis_names, mesh.shape))[distribution.batch_dim_name]


def shard_map(fn, mesh, in_specs, out_specs, axis):
    """`jax.shard_map` (`jax.experimental.shard_map` before 0.7) over the
    mesh axis `axis` alone, without replication checks: `fn` runs no
    collective over it, the cotangents of inputs not split on it (a kernel)
    are summed over its devices by shard_map's transpose, and the other
    axes stay XLA's (a kernel split on its vocabulary axis by
    `ModelParallel` stays split inside)."""
    manual = frozenset({axis})
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual, check_vma=False)
    from jax.experimental.shard_map import shard_map

    auto = frozenset(mesh.axis_names) - manual
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False, auto=auto)


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

    def is_float(x):
        return jnp.issubdtype(x.dtype, jnp.floating)

    def cast(x):
        return x if x is None or not is_float(x) else x.astype(dtype)

    def split(x):
        return x.reshape((-1, chunk_size) + x.shape[1:])

    def logits_of(j, hidden, kernel, bias):
        logits = project(hidden, kernel, transposed[j])
        return logits if bias is None else logits + bias

    def inputs(rows, heads, weights):
        return [split(r) for r in rows], [split(head[0]) for head in heads], split(weights)

    @jax.custom_vjp
    def total(rows, heads, weights):
        params = [(cast(k), cast(b)) for _, k, b in heads]

        def step(acc, xs):
            chunk_rows, hidden, w = xs
            logits = [logits_of(j, cast(h), *params[j]) for j, h in enumerate(hidden)]
            return acc + jnp.sum(w * fn(logits, [cast(r) for r in chunk_rows]), axis=0), None

        columns = jax.lax.scan(step, jnp.zeros(weights.shape[1:], dtype), inputs(rows, heads, weights))[0]
        return jnp.sum(columns), columns

    def forward(rows, heads, weights):
        row_wanted = [i for i, r in enumerate(rows) if r.perturbed and is_float(r.value)]
        wanted = [[p is not None and p.perturbed for p in head] for head in heads]
        rows = [r.value for r in rows]
        heads = [[None if p is None else p.value for p in head] for head in heads]
        params = [(cast(k), cast(b)) for _, k, b in heads]

        def step(carry, xs):
            acc, kernel_grads, bias_grads = carry
            chunk_rows, hidden, w = xs
            chunk_rows = [cast(r) for r in chunk_rows]
            hidden = [cast(h) for h in hidden]
            logits = [logits_of(j, h, *params[j]) for j, h in enumerate(hidden)]

            def chunk_value(logits, wanted_rows):
                all_rows = list(chunk_rows)
                for i, t in zip(row_wanted, wanted_rows):
                    all_rows[i] = t
                columns = jnp.sum(w * fn(logits, all_rows), axis=0)
                return jnp.sum(columns), columns

            # Gradients nothing reads (a frozen teacher's logits) are dropped by XLA.
            (_, value), (dlogits, row_grads) = jax.value_and_grad(chunk_value, argnums=(0, 1), has_aux=True)(
                logits, [chunk_rows[i] for i in row_wanted]
            )
            kernel_grads = [
                g if g is None else _add_kernel_grad(g, hidden[j], dlogits[j], transposed[j])
                for j, g in enumerate(kernel_grads)
            ]
            bias_grads = [g if g is None else g + jnp.sum(dlogits[j], axis=0) for j, g in enumerate(bias_grads)]
            hidden_grads = [
                project(dlogits[j], params[j][0], not transposed[j]).astype(head_dtypes[j][0]) if wanted[j][0] else None
                for j in range(len(heads))
            ]
            row_grads = [g.astype(row_dtypes[i]) for i, g in zip(row_wanted, row_grads)]
            return (acc + value, kernel_grads, bias_grads), (row_grads, hidden_grads)

        start = (
            jnp.zeros(weights.value.shape[1:], dtype),
            [jnp.zeros_like(params[j][0]) if wanted[j][1] else None for j in range(len(heads))],
            [jnp.zeros_like(params[j][1]) if wanted[j][2] else None for j in range(len(heads))],
        )
        (value, kernel_grads, bias_grads), (row_grads, hidden_grads) = jax.lax.scan(
            step, start, inputs(rows, heads, weights.value)
        )
        kept_rows = [None] * len(rows)
        for i, g in zip(row_wanted, row_grads):
            kept_rows[i] = g.reshape(rows[i].shape)
        kept_heads = [
            [None if h is None else h.reshape(head[0].shape), k, b]
            for head, h, k, b in zip(heads, hidden_grads, kernel_grads, bias_grads)
        ]
        return (jnp.sum(value), value), (kept_rows, kept_heads)

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
        frozen = not any(r.perturbed and jnp.issubdtype(r.value.dtype, jnp.floating) for r in rows) and not any(
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
        return fn(logits, [r.astype(dtype) if jnp.issubdtype(r.dtype, jnp.floating) else r for r in chunk_rows])

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
    def cast(x):
        return x if x is None or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    def split(x):
        return x.reshape((-1, chunk_size) + x.shape[1:])

    params = [(cast(k), cast(b), t) for _, k, b, t in heads]

    def logits_of(hidden):
        logits = []
        for h, (k, b, t) in zip(hidden, params):
            x = project(cast(h), k, t)
            logits.append(x if b is None else x + b)
        return logits

    def chunk(xs):
        chunk_rows, hidden = xs
        return fn(logits_of(hidden), [cast(r) for r in chunk_rows])

    def chunk_and_jacobians(xs):
        chunk_rows, hidden = xs
        chunk_rows = [cast(r) for r in chunk_rows]

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

    inputs = ([split(r) for r in rows], [split(h[0]) for h in heads])
    if jacobians is None:
        values = jax.lax.map(chunk, inputs)
        return values.reshape((-1,) + values.shape[2:])
    values, grads = jax.lax.map(chunk_and_jacobians, inputs)
    return values.reshape(-1), [None if g is None else g.reshape((-1,) + g.shape[2:]) for g in grads]
