"""TensorFlow's gradients: `tf.GradientTape`, and the probe as one
`tf.function` (under a strategy, on the host thread, as one device)."""

import tensorflow as tf

from keras_penalties.backend import common
from keras_penalties.backend.common import norm


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
        return common.outside_distribution(lambda: run(x, y), in_strategy=True)

    return probe
