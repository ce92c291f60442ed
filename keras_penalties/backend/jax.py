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
from keras_penalties.backend._jax_heads import (  # noqa: F401  (re-exported: backend's contract)
    chunked_sum,
    chunked_values,
    data_parallel,
    project,
    row_shards,
    shard_map,
)

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


def parameter_probe(trainable, others, outputs, num_outputs, grad_norms, batched=False, update=None):
    fn, state = update or (None, [])
    written = [*others, *state]

    def measure(trainable_values, other_values, x, y):
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

    @jax.jit
    def run(trainable_values, other_values, state_values, x, y):
        values, norms = measure(trainable_values, other_values, x, y)
        if fn is None:
            return values, norms, None, []
        # The update reads every variable through a scope, which collects
        # what it assigns: the new values, assigned below.
        mapping = [*zip(trainable, trainable_values), *zip(others, other_values), *zip(state, state_values)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            before = [scope.get_current_value(v) for v in written]
            result = fn(values, norms)
        # None (known when tracing) for what `fn` left: only what it assigned comes back.
        after = [scope.get_current_value(v) for v in written]
        return values, norms, result, [None if new is old else new for old, new in zip(before, after)]

    def probe(x, y):
        values, norms, result, new = run(
            [v.value for v in trainable], [v.value for v in others], [v.value for v in state], x, y
        )
        for variable, value in zip(written, new):
            if value is not None:
                variable.assign(value)
        return values, norms, result

    return probe


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
