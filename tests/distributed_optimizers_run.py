"""Trains one model per optimizer wrapper on one device and on two, in one
process, and prints the largest relative difference of the weights. Run by
tests/test_optimizers.py in a subprocess (device counts are fixed when the
framework starts):

    KERAS_BACKEND=jax python -m tests.distributed_optimizers_run         # DataParallel
    KERAS_BACKEND=tensorflow python -m tests.distributed_optimizers_run  # MirroredStrategy
"""

import contextlib
import json

from tests.two_devices import BACKEND, BATCH, before_keras, regression_data, split_tensorflow_cpu

if __name__ == "__main__":
    before_keras()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_penalties import regularizers as R  # noqa: E402
from keras_penalties import optimizers as opt  # noqa: E402

RNG = np.random.default_rng(0)
X, Y = regression_data(RNG, 3)

# AGC and noise are nonlinear in the gradient: they must see the whole
# gradient, not each replica's part (TF sums the parts inside the inner optimizer).
OPTIMIZERS = {
    "proximal_l1_adam": lambda: opt.ProximalDecay(keras.optimizers.Adam(0.05), R.L1(0.05)),
    "proximal_l2_mean_sgd": lambda: opt.ProximalDecay(keras.optimizers.SGD(0.05), R.L2(0.5, center="mean")),
    "noise_sgd": lambda: opt.GradientNoise(keras.optimizers.SGD(0.05), stddev=0.1, seed=3),
    "agc_sgd": lambda: opt.AdaptiveGradientClipping(keras.optimizers.SGD(0.5), clip_factor=0.01),
    "gc_adam": lambda: opt.GradientCentralization(keras.optimizers.Adam(0.05)),
}


def train(make, scope):
    with scope:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
        model.compile(make(), "mse")
    model.fit(X, Y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    return [np.asarray(w.numpy()) for w in model.weights]


def two_devices():
    if BACKEND == "jax":
        devices = keras.distribution.list_devices("cpu")
        return len(devices), keras.distribution.DataParallel(devices=devices).scope()
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return strategy.num_replicas_in_sync, strategy.scope()


def main():
    if BACKEND == "tensorflow":
        split_tensorflow_cpu()
    differences = {}
    for name, make in OPTIMIZERS.items():
        one = train(make, contextlib.nullcontext())
        devices, scope = two_devices()
        two = train(make, scope)
        differences[name] = max(float(np.max(np.abs(a - b) / (np.abs(a) + 1e-3))) for a, b in zip(one, two))
    print(json.dumps({"devices": devices, "differences": differences}))


if __name__ == "__main__":
    main()
