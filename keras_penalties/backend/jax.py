"""JAX: `jax.grad`, a jitted probe; a `DataParallel`/`ModelParallel` batch is
one global (sharded) array, so every step sees the whole batch."""

import functools

import jax
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
