"""The replica rule, in one place.

Under a `tf.distribute` strategy each replica computes the loss on its part
of the batch; Keras divides each replica's loss by the number of replicas
(its own `Loss` objects do, in a replica context or out of one) and sums the
replicas' gradients. A one-device value handed to Keras as a loss is this
replica's share (`share`); a Keras loss's mean read back has the division
undone (`unshare`); a mean over the whole batch is taken across the replicas
running in sync (`mean_in_sync`, `global_divisor`, `whole_batch_values`).

torch processes under `DistributedDataParallel` are replicas in sync too,
while a training step records gradients (`backend.replicas_in_sync`):
Keras divides nothing there, DDP averages the processes' gradients, which
is the same as Keras' division followed by the sum. Elsewhere (JAX, one
device) both numbers are 1 and every function returns its input.
"""

import numpy as np
from keras import ops

from keras_penalties import backend


def keras_divisor() -> int:
    """What Keras divides each replica's loss by: the strategy's replicas."""
    return backend.loss_replicas()


def in_sync() -> int:
    """How many replicas run this step in sync (a replica context), whose
    values a cross-replica sum combines; 1 elsewhere."""
    return backend.replicas_in_sync()


def share(value):
    """This replica's loss for a one-device `value`: Keras' division and the
    sum of the replicas' gradients give back `value`'s."""
    n = keras_divisor()
    return value if n == 1 else value / float(n)


def unshare(value):
    """A Keras loss's mean with Keras' division by the replicas undone."""
    n = keras_divisor()
    return value if n == 1 else value * float(n)


def mean_in_sync(tensors, keep_losses_of=None):
    """Each tensor's mean over the replicas in sync (None stays None).
    `keep_losses_of`: see `backend.sum_over_replicas`."""
    n = in_sync()
    if n == 1:
        return list(tensors)
    return [None if t is None else t / float(n) for t in backend.sum_over_replicas(tensors, keep_losses_of)]


def split_in_sync(tensors):
    """For an optimizer handed each replica's part of the gradients (TF's
    replicas, which Keras sums after it; DDP averages before): the
    replicas' sum of each tensor (None stays None) and a function that
    hands each replica its equal share of a result computed from it: a
    nonlinear map of a gradient must see the whole gradient."""
    n = backend.gradients_in_sync()
    if n == 1:
        return list(tensors), lambda results: results
    return backend.sum_over_replicas(tensors), lambda results: [None if r is None else r / n for r in results]


def global_divisor(count, floor=1.0, keep_losses_of=None):
    """What a replica divides its sum by for the replicas' shares to give the
    whole batch's mean after Keras' division: Σ_replicas count / replicas
    (the sum at least `floor`), `count` being this replica's divisor (the
    positions it keeps, its weights). Without replicas in sync, `count` at
    least `floor`."""
    count = ops.cast(count, "float32")  # a count of rows is an int (a shape), which TF divides by no float
    n = in_sync()
    if n == 1:
        return ops.maximum(count, floor)
    (total,) = backend.sum_over_replicas([count], keep_losses_of=keep_losses_of)
    return ops.maximum(total, floor) / float(n)


def whole_batch_values(values, sums):
    """Each replica's term values scaled so that their mean over the replicas
    in sync is the whole batch's value: a sum over samples (where `sums`)
    times the replicas, a per-sample mean as is."""
    n = in_sync()
    if n == 1 or not any(sums):
        return values
    return values * ops.convert_to_tensor(np.where(sums, float(n), 1.0).astype("float32"))
