"""What the backend modules share: the gradient norm, the softmax pair, and the one-device
answers of the replica functions (JAX's distribution works on global arrays;
Keras has no torch distribution)."""

import keras
from keras import ops


def norm(grads):
    """‖(g₁, g₂, …)‖₂ over all the tensors, in float32."""
    return ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads))


def softmax_pair(logits, axis):
    """`(softmax, log_softmax)` of logits along `axis`. Under XLA the two share
    their exp and sum (exp(log p) would take one more exp per element:
    entropy's value on [8192, 32000] on JAX, 97 ms against 72 ms)."""
    return ops.softmax(logits, axis=axis), ops.log_softmax(logits, axis=axis)


def sum_of_squares(x):
    """Σx² over all of x. XLA and TF fuse square-then-sum into one pass
    (x·x on TF is a matrix-vector product: a 20 % slower fit step)."""
    return ops.sum(ops.square(x))


def map_chunks(fn, chunks, dtype):
    """`fn` over the leading axis of the tuple `chunks`, stacked (values of
    `dtype`), each chunk recomputed in the backward pass: a scan
    (`keras.ops.map`) of `keras.remat(fn)`, so XLA keeps one chunk's
    temporaries at a time."""
    return ops.map(keras.remat(fn), chunks)


def replicas_in_sync():
    return 1


def sum_over_replicas(tensors):
    return list(tensors)


def loss_replicas():
    return 1


def outside_distribution(fn):
    return fn()
