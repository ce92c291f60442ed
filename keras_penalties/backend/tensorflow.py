"""TensorFlow: `tf.GradientTape`, a `tf.function` probe, and `tf.distribute`.

Under `MirroredStrategy` each replica runs the step on its shard of the batch, and
Keras divides every loss, `add_loss` terms included, by the number of replicas before
it sums their gradients; its `Loss` objects divide their means by it in a strategy.
"""

import contextlib
import functools
import threading

import tensorflow as tf
from keras import ops

from keras_penalties import _keras_internals
from keras_penalties.backend._tensorflow_chunks import (  # noqa: F401  (re-exported: backend's contract)
    CHUNK_ELEMENTS,
    HEAD_CHUNK_ELEMENTS,
    chunked_sum,
    chunked_values,
    in_chunk,
    map_chunks,
    project,
)
from keras_penalties.backend import _common
from keras_penalties.backend._common import norm

# TF's graph optimizer (common subgraph elimination) can merge an
# objective's repeated log-softmaxes, and a GradientTape inside a term
# would not see one formed before it (num.sharing).
SHARES_SOFTMAX = False


def label_cross_entropy(logits, labels, axis):
    """As `_common.label_cross_entropy`: in a chunk of logits formed from
    hidden states (`chunked_sum`, first order only), TF's fused
    `sparse_softmax_cross_entropy_with_logits`, whose one op forms the
    values and the logits' gradient (softmax − one-hot) and whose gradient
    has no second derivative; None elsewhere (on `map_chunks`' formed
    logits it was slower than a log-softmax and a pick)."""
    if not in_chunk.get() or axis not in (-1, len(logits.shape) - 1) or logits.dtype not in (tf.float32, tf.float64):
        return None
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def gradients(fn, tensors):
    with tf.GradientTape() as tape:
        for t in tensors:
            tape.watch(t)
        y = fn(*tensors)
    return tape.gradient(y, list(tensors), unconnected_gradients=tf.UnconnectedGradients.ZERO)


def parameter_probe(trainable, others, outputs, num_outputs, grad_norms, batched=False, update=None):
    fn, _ = update or (None, [])

    @tf.function(reduce_retracing=True)
    def run(x, y):
        values_in = [tf.identity(v.value) for v in trainable]
        other_values = [tf.identity(v.value) for v in others]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(values_in)
            entries = outputs(values_in, other_values, x, y)
        values, norms = tf.stack(entries), None
        if grad_norms:
            # Each entry's gradient traverses only the ops it depends on.
            zero = tf.UnconnectedGradients.ZERO
            norms = tf.stack([norm(tape.gradient(e, values_in, unconnected_gradients=zero)) for e in entries])
        # The update assigns its variables in the same call (eager TF makes each op a call).
        return values, norms, None if fn is None else fn(values, norms)

    def probe(x, y):
        # Under a strategy on the host thread (whole values, as one device); else here, as the caller runs.
        if not tf.distribute.has_strategy():
            return run(x, y)
        return _common.outside_distribution(lambda: run(x, y), in_strategy=True)

    return probe


def outside_distribution(fn):
    """As `_common.outside_distribution`, leaving a strategy's scope too."""
    return _common.outside_distribution(fn, in_strategy=tf.distribute.has_strategy() or not tf.executing_eagerly())


def softmax_pair(logits, axis, log_softmax=None):
    """`(exp(log p), log p)`: TF runs softmax and log_softmax as separate
    kernels, each with its own backward pass; one log_softmax and an exp is
    cheaper."""
    if log_softmax is None:
        log_softmax = ops.log_softmax(logits, axis=axis)
    return ops.exp(log_softmax), log_softmax


def replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def gradients_in_sync():
    return replicas_in_sync()


def variable_home(model=None):
    strategy = tf.distribute.get_strategy() if model is None else model.distribute_strategy
    return None if strategy is _default_strategy() else strategy


@functools.cache
def _default_strategy():
    # What `get_strategy()` gives outside any scope: a scope is per thread,
    # and a new thread is in none.
    found = []
    thread = threading.Thread(target=lambda: found.append(tf.distribute.get_strategy()))
    thread.start()
    thread.join()
    return found[0]


def made_at(home):
    return contextlib.nullcontext() if home is None else home.scope()


def sum_over_replicas(tensors, keep_losses_of=None):
    tensors = list(tensors)
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return tensors
    with _keras_internals.added_losses_kept(keep_losses_of):
        summed = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, [tensors[i] for i in present]
        )
    for i, t in zip(present, summed):
        tensors[i] = t
    return tensors


def gather_over_replicas(tensors, keep_losses_of=None):
    tensors = [tf.stop_gradient(t) for t in tensors]
    with _keras_internals.added_losses_kept(keep_losses_of):
        return list(tf.distribute.get_replica_context().all_gather(tensors, axis=0))


def loss_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync
