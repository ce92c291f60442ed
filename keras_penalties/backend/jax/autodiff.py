"""JAX's gradients: `jax.grad`, the probe as one jitted call, and what a
trace allows (a stateless scope's values, tracers of an ended trace)."""

import functools

import jax
import jax.numpy as jnp
import keras
from keras import ops

from keras_penalties import _keras_internals
from keras_penalties.backend.common import norm


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


def traced_outside_scope(x):
    """As `common.traced_outside_scope`: `x` is a tracer and no stateless
    scope collects assignments (a `jax.jit` of the user's own around a
    composite; `fit` and `stateless_call` trace inside one)."""
    return isinstance(x, jax.core.Tracer) and _keras_internals.stateless_scope() is None


def keep_for_metrics(variables):
    """As `common.keep_for_metrics`: JAX's `fit` reads a step's metrics in
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
    """As `common.kept_for_metrics`: inside a stateless scope that does not
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
