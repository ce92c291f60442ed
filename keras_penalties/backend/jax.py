"""JAX: `jax.grad`, a jitted probe; a `DataParallel`/`ModelParallel` batch is
one global (sharded) array, so every step sees the whole batch."""

import functools

import jax
import jax.numpy as jnp
from keras import ops

from keras_penalties.backend._common import (  # noqa: F401
    loss_replicas,
    map_chunks,
    norm,
    outside_distribution,
    replicas_in_sync,
    softmax_pair,
    sum_of_squares,
    sum_over_replicas,
)


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


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` without a transposed copy (a
    `dot_general` contracting the kernel's last axis)."""
    contract = 1 if transpose_kernel else 0
    return jax.lax.dot_general(rows, kernel, (((1,), (contract,)), ((), ())))


def chunked_sum(fn, rows, shared, weights, chunk_size, dtype):
    """Σᵣ weights[r]·fn(rows chunk, shared)[r], `chunk_size` rows at a time
    (a `lax.scan`), with the gradient formed in the forward pass.

    A `custom_vjp` whose forward pass takes, chunk by chunk, the gradient of
    the chunk's weighted sum w.r.t. the chunk's rows (written into one
    buffer) and w.r.t. `shared` (accumulated in the scan's carry): nothing
    is recomputed, and the backward pass only scales the kept gradients by
    the upstream scalar. Only the inputs JAX differentiates are taken
    (`symbolic_zeros`: a frozen teacher's hidden states and kernel cost one
    forward product per chunk, no gradient).
    """
    rows, shared = list(rows), list(shared)
    row_dtypes = [r.dtype for r in rows]
    shared_dtypes = [s.dtype for s in shared]

    def is_float(x):
        return jnp.issubdtype(x.dtype, jnp.floating)

    def cast(x):
        return x.astype(dtype) if is_float(x) else x

    def split(x):
        return x.reshape((-1, chunk_size) + x.shape[1:])

    def chunk_total(chunk_rows, chunk_weights, shared_values):
        return jnp.sum(chunk_weights * fn([cast(r) for r in chunk_rows], shared_values))

    @jax.custom_vjp
    def total(rows, shared, weights):
        shared_values = [cast(s) for s in shared]

        def step(acc, xs):
            return acc + chunk_total(*xs, shared_values), None

        return jax.lax.scan(step, jnp.zeros((), dtype), ([split(r) for r in rows], split(weights)))[0]

    def forward(rows, shared, weights):
        row_wanted = [i for i, r in enumerate(rows) if r.perturbed and is_float(r.value)]
        shared_wanted = [j for j, s in enumerate(shared) if s.perturbed and is_float(s.value)]
        rows = [r.value for r in rows]
        shared_values = [cast(s.value) for s in shared]

        def step(carry, xs):
            acc, shared_grads = carry
            chunk_rows, chunk_weights = xs
            chunk_rows = [cast(r) for r in chunk_rows]

            def chunk_value(wanted_rows, wanted_shared):
                all_rows, all_shared = list(chunk_rows), list(shared_values)
                for i, t in zip(row_wanted, wanted_rows):
                    all_rows[i] = t
                for j, t in zip(shared_wanted, wanted_shared):
                    all_shared[j] = t
                return chunk_total(all_rows, chunk_weights, all_shared)

            value, (row_grads, grads) = jax.value_and_grad(chunk_value, argnums=(0, 1))(
                [chunk_rows[i] for i in row_wanted], [shared_values[j] for j in shared_wanted]
            )
            shared_grads = [a + g for a, g in zip(shared_grads, grads)]
            return (acc + value, shared_grads), [g.astype(row_dtypes[i]) for i, g in zip(row_wanted, row_grads)]

        start = (jnp.zeros((), dtype), [jnp.zeros_like(shared_values[j]) for j in shared_wanted])
        (value, shared_grads), row_grads = jax.lax.scan(step, start, ([split(r) for r in rows], split(weights.value)))
        kept_rows, kept_shared = [None] * len(rows), [None] * len(shared)
        for i, g in zip(row_wanted, row_grads):
            kept_rows[i] = g.reshape(rows[i].shape)
        for j, g in zip(shared_wanted, shared_grads):
            kept_shared[j] = g
        return value, (kept_rows, kept_shared)

    def backward(kept, upstream):
        kept_rows, kept_shared = kept

        def scale(g, to):
            return None if g is None else (g.astype(dtype) * upstream).astype(to)

        return (
            [scale(g, d) for g, d in zip(kept_rows, row_dtypes)],
            [scale(g, d) for g, d in zip(kept_shared, shared_dtypes)],
            None,
        )

    total.defvjp(forward, backward, symbolic_zeros=True)
    return total(rows, shared, weights)
