"""JAX: `jax.grad`, a jitted probe; a `DataParallel`/`ModelParallel` batch is
one global (sharded) array, so every step sees the whole batch."""

import functools

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec
from keras import ops

from keras_penalties import _keras_internals
from keras_penalties.backend._common import norm

# XLA merges an objective's repeated log-softmaxes itself (num.sharing).
SHARES_SOFTMAX = False

# chunk_size="auto": the budgets that were fastest on the benchmark machine,
# of formed logits and from hidden states (bench/results/README.md).
CHUNK_ELEMENTS = 16 * 2**20
HEAD_CHUNK_ELEMENTS = 8 * 2**20


def keep_for_metrics(variables):
    """As `_common.keep_for_metrics`: JAX's `fit` reads a step's metrics in
    a `StatelessScope` of the metric variables alone, after the forward
    pass's scope has closed, so a variable the forward pass assigned reads
    there its value from before the step (or none: the trainer frees it).
    In the forward pass of a training or test step (a scope that collects
    losses), or in its loss's computation (a scope that holds the
    variables), the variables' values with their gradient stopped: inside
    `value_and_grad` they are then tracers of the step's own trace. Else
    None."""
    scope = _keras_internals.stateless_scope()
    if scope is None or not (scope.collect_losses or all(scope.get_current_value(v) is not None for v in variables)):
        return None
    return tuple(jax.lax.stop_gradient(v.value) for v in variables)


def kept_for_metrics(kept, variables):
    """As `_common.kept_for_metrics`: inside a stateless scope that does not
    hold `variables` (JAX's metric scope), `kept` if it belongs to the
    computation running now (concrete arrays, or tracers of the current
    trace), else zeros of the variables' shapes (this step ran no forward
    pass that kept them); None elsewhere, where the variables read right."""
    scope = _keras_internals.stateless_scope()
    if scope is None or any(scope.get_current_value(v) is not None for v in variables):
        return None
    if kept is not None and all(_of_this_trace(v) for v in kept):
        return kept
    return tuple(jnp.zeros(v.shape, v.dtype) for v in variables)


def traced_outside_scope(x):
    """As `_common.traced_outside_scope`: `x` is a tracer and no stateless
    scope collects assignments (a `jax.jit` of the user's own around a
    composite; `fit` and `stateless_call` trace inside one)."""
    return isinstance(x, jax.core.Tracer) and _keras_internals.stateless_scope() is None


def _of_this_trace(x):
    """Whether `x` can be used in the computation running now: a concrete
    array, or a tracer of the current trace (a tracer of a trace that has
    ended would raise). Reads JAX's private `jax._src.core.trace_ctx.trace`
    and a tracer's `_trace` (jax 0.4.36 on; read in 0.10.2); on a JAX
    without them, every tracer counts as current."""
    if not isinstance(x, jax.core.Tracer):
        return True
    from jax._src import core

    context = getattr(core, "trace_ctx", None)
    return context is None or getattr(x, "_trace", None) is context.trace


def gradients(fn, tensors):
    return list(jax.grad(lambda ts: fn(*ts))(list(tensors)))


def parameter_probe(trainable, others, outputs, num_outputs, grad_norms):
    @jax.jit
    def run(trainable_values, other_values, x, y):
        if not grad_norms:
            return ops.stack(outputs(trainable_values, other_values, x, y)), None

        def entry(i, tv):
            values = outputs(tv, other_values, x, y)
            return values[i], ops.stack(values)

        # One gradient per output: JAX keeps the other outputs' zero
        # cotangents symbolic, so each backward pass covers only what its
        # output depends on (a kernel regularizer: its kernel), and XLA
        # merges the repeated forward passes.
        norms = []
        for i in range(num_outputs):
            (_, values), grads = jax.value_and_grad(functools.partial(entry, i), has_aux=True)(trainable_values)
            norms.append(norm(grads))
        return values, ops.stack(norms)

    def probe(x, y):
        return run([v.value for v in trainable], [v.value for v in others], x, y)

    return probe


def map_chunks(fn, chunks, dtype):
    """`fn` over the leading axis of the tuple `chunks`, stacked (values of
    `dtype`), without recomputing any chunk in the backward pass (see
    `_map_chunks`). Under Keras' `DataParallel` over n > 1 devices, each
    device runs the chunks of its own rows (`shard_map`): nothing is
    gathered, and the gradients stay sharded like the inputs."""
    chunks = tuple(chunks)
    split = _data_parallel(chunks[0].shape[0])
    if split is None:
        return _map_chunks(fn, chunks, dtype)
    mesh, axis = split
    spec = PartitionSpec(axis)
    return _shard_map(lambda *c: _map_chunks(fn, c, dtype), mesh, (spec,) * len(chunks), spec, axis)(*chunks)


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

    def is_float(x):
        return jnp.issubdtype(x.dtype, jnp.floating)

    @jax.custom_vjp
    def mapped(*chunks):
        return jax.lax.map(fn, chunks)

    def forward(*primals):
        values = tuple(p.value for p in primals)
        wanted = [j for j, p in enumerate(primals) if p.perturbed and is_float(p.value)]

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


def pick_labels(values, labels, axis):
    """As `_common.pick_labels` (a gather), with a forward-mode rule, a
    masked sum, whose transpose is a select that XLA fuses into whatever
    consumes the gradient: reverse mode through the gather is a scatter
    into a zeroed buffer the size of `values` (in a chunk of logits from
    hidden states, one more [rows, V] temporary)."""
    axis = axis % values.ndim
    # A negative label counts from the end, as the gather reads it, for the
    # tangent rule's mask too.
    labels = jnp.where(labels < 0, labels + values.shape[axis], labels)
    return _pick(values, labels, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _pick(values, labels, axis):
    return jnp.take_along_axis(values, jnp.expand_dims(labels, axis), axis=axis).squeeze(axis)


@_pick.defjvp
def _pick_jvp(axis, primals, tangents):
    values, labels = primals
    tangent = tangents[0]
    hit = jax.lax.broadcasted_iota(labels.dtype, values.shape, axis) == jnp.expand_dims(labels, axis)
    return _pick(values, labels, axis), jnp.sum(jnp.where(hit, tangent, jnp.zeros((), tangent.dtype)), axis=axis)


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
    """Σᵣ weights[r]·fn(logits, rows)[r], `chunk_size` rows at a time, with
    the gradient formed in the forward pass (see `_chunked_sum`). Under
    Keras' `DataParallel` over n > 1 devices, each device sums the chunks
    of its own rows (`shard_map`) against its replica of the kernel and
    bias: nothing row-sized is gathered, the rows' and hidden states'
    gradients stay sharded, and the kernel's and bias's are summed over the
    devices once (an all-reduce of their size), not per chunk."""
    split = _data_parallel(weights.shape[0] // chunk_size)
    if split is None:
        return _chunked_sum(fn, rows, heads, weights, chunk_size, dtype)
    mesh, axis = split
    rows, transposed = list(rows), [head[3] for head in heads]
    has_bias = [head[2] is not None for head in heads]
    # The kernels and biases in the compute dtype before the devices split
    # (each chunk reads them so anyway): their gradients are then summed
    # over the devices in it too, and rounded to a half dtype once.
    params = [p.astype(dtype) for head in heads for p in head[1:3] if p is not None]
    rowwise = rows + [head[0] for head in heads]
    sharded, whole = PartitionSpec(axis), PartitionSpec()
    specs = (sharded,) * len(rowwise) + (whole,) * len(params) + (sharded,)

    def local(*args):
        local_rows, hidden = args[: len(rows)], args[len(rows) : len(rowwise)]
        params, local_weights = iter(args[len(rowwise) : -1]), args[-1]
        local_heads = [
            [h, next(params), next(params) if b else None, t] for h, b, t in zip(hidden, has_bias, transposed)
        ]
        # Each device's partial sum, one entry of a sharded vector: summed
        # outside, so that no collective runs inside the loop.
        return _chunked_sum(fn, local_rows, local_heads, local_weights, chunk_size, dtype)[None]

    partial = _shard_map(local, mesh, specs, sharded, axis)(*rowwise, *params, weights)
    return jnp.sum(partial)


def _data_parallel(chunks):
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


def _shard_map(fn, mesh, in_specs, out_specs, axis):
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
    transposed = [head[3] for head in heads]
    heads = [list(head[:3]) for head in heads]
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
            return acc + jnp.sum(w * fn(logits, [cast(r) for r in chunk_rows])), None

        return jax.lax.scan(step, jnp.zeros((), dtype), inputs(rows, heads, weights))[0]

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
                return jnp.sum(w * fn(logits, all_rows))

            # Gradients nothing reads (a frozen teacher's logits) are dropped by XLA.
            value, (dlogits, row_grads) = jax.value_and_grad(chunk_value, argnums=(0, 1))(
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
            jnp.zeros((), dtype),
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
        return value, (kept_rows, kept_heads)

    def backward(kept, upstream):
        kept_rows, kept_heads = kept

        def scale(g, to):
            return None if g is None else (g.astype(dtype) * upstream).astype(to)

        return (
            [scale(g, d) for g, d in zip(kept_rows, row_dtypes)],
            [[scale(g, d) for g, d in zip(grads, dtypes)] for grads, dtypes in zip(kept_heads, head_dtypes)],
            None,
        )

    total.defvjp(forward, backward, symbolic_zeros=True)
    return total(rows, heads, weights)
