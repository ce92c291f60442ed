"""What the backend modules share: the gradient norm, and the one-device
answers of the replica functions (JAX's distribution works on global arrays;
Keras has no torch distribution)."""

from keras import ops


def norm(grads):
    """‖(g₁, g₂, …)‖₂ over all the tensors, in float32."""
    return ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads))


def replicas_in_sync():
    return 1


def sum_over_replicas(tensors):
    return list(tensors)


def loss_replicas():
    return 1


def outside_distribution(fn):
    return fn()
