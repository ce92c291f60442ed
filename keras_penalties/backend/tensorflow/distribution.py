"""TensorFlow's distribution: `tf.distribute`.

Under `MirroredStrategy` each replica runs the step on its shard of the batch, and
Keras divides every loss, `add_loss` terms included, by the number of replicas before
it sums their gradients; its `Loss` objects divide their means by it in a strategy.
"""

import functools
import threading

import tensorflow as tf

from keras_penalties import _keras_internals
from keras_penalties.backend import common


def outside_distribution(fn):
    """As `common.outside_distribution`, leaving a strategy's scope too."""
    return common.outside_distribution(fn, in_strategy=tf.distribute.has_strategy() or not tf.executing_eagerly())


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
