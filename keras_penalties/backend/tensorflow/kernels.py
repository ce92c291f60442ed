"""TensorFlow's row kernels: the softmax pair as an exp of the log-softmax,
and in a chunk loop TF's fused label cross-entropy."""

import tensorflow as tf
from keras import ops

from keras_penalties.backend.tensorflow.tracing import in_chunk


# TF's graph optimizer (common subgraph elimination) can merge an
# objective's repeated log-softmaxes, and a GradientTape inside a term
# would not see one formed before it (num.sharing).
SHARES_SOFTMAX = False


def label_cross_entropy(logits, labels, axis):
    """As `common.label_cross_entropy`: in a chunk of logits formed from
    hidden states (`chunked_sum`, first order only), TF's fused
    `sparse_softmax_cross_entropy_with_logits`, whose one op forms the
    values and the logits' gradient (softmax − one-hot) and whose gradient
    has no second derivative; None elsewhere (on `map_chunks`' formed
    logits it was slower than a log-softmax and a pick)."""
    if not in_chunk.get() or axis not in (-1, len(logits.shape) - 1) or logits.dtype not in (tf.float32, tf.float64):
        return None
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def softmax_pair(logits, axis, log_softmax=None):
    """`(exp(log p), log p)`: TF runs softmax and log_softmax as separate
    kernels, each with its own backward pass; one log_softmax and an exp is
    cheaper."""
    if log_softmax is None:
        log_softmax = ops.log_softmax(logits, axis=axis)
    return ops.exp(log_softmax), log_softmax
