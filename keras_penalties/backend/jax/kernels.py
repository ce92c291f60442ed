"""JAX's row kernels: a label pick whose gradient XLA fuses. The others are
`common`'s (Keras' ops, which XLA fuses)."""

import functools

import jax
import jax.numpy as jnp


# XLA merges an objective's repeated log-softmaxes itself (num.sharing).
SHARES_SOFTMAX = False


def pick_labels(values, labels, axis):
    """As `common.pick_labels` (a gather), with a forward-mode rule, a
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
