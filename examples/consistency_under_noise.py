"""Consistency regularization under input noise (semi-supervised learning).

Only 32 of 2048 points are labeled. A classifier is trained on those labels
and, on every point, to give the same prediction for an input and a noisy
copy of it (the Π-model / UDA idea): a CompositeObjective compares the two
views' logits with the Jensen-Shannon divergence. The unlabeled points
propagate the labels along the data; the script compares test accuracy with
and without the consistency term.

    KERAS_BACKEND=jax python examples/consistency_under_noise.py
"""

import os

import keras
import numpy as np
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties.callbacks import PenaltyMonitor

EPOCHS = int(os.environ.get("EXAMPLE_EPOCHS", 40))


def two_moons(n, rng, noise=0.1):
    t = rng.uniform(0, np.pi, n)
    upper = rng.random(n) < 0.5
    x = np.where(upper[:, None], np.stack([np.cos(t), np.sin(t)], 1), np.stack([1 - np.cos(t), 0.5 - np.sin(t)], 1))
    return (x + noise * rng.normal(size=(n, 2))).astype("float32"), (~upper).astype("int32")


class NoisyView(keras.layers.Layer):
    """Gaussian input noise during training, from a seed the layer owns."""

    def __init__(self, stddev, **kwargs):
        super().__init__(**kwargs)
        self.stddev = stddev
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, x, training=None):
        if not training:
            return x
        return x + self.stddev * keras.random.normal(ops.shape(x), seed=self.seed_generator)


def train(consistency_weight, x, y, labeled):
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)]
    )
    inputs = keras.Input((2,))
    clean, noisy = net(inputs), net(NoisyView(0.15)(inputs))
    views = CompositeObjective(
        {
            "consistency": Term(
                "js_divergence", consistency_weight, inputs=("clean", "noisy"), options={"from_logits": True}
            )
        },
        name="views",
    )({"clean": clean, "noisy": noisy})
    model = keras.Model(inputs, views["clean"])
    # Unlabeled points get sample weight 0: they count only through the consistency term.
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    weights = labeled.astype("float32") * len(y) / labeled.sum()
    model.fit(x, y, sample_weight=weights, batch_size=256, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
    return model


def main():
    rng = np.random.default_rng(0)
    x, y = two_moons(2048, rng)
    x_test, y_test = two_moons(1024, rng)
    labeled = np.zeros(len(y), bool)
    labeled[rng.choice(len(y), 32, replace=False)] = True
    for weight in (0.0, 5.0):
        model = train(weight, x, y, labeled)
        accuracy = (ops.convert_to_numpy(model.predict(x_test, verbose=0)).argmax(1) == y_test).mean()
        print(f"consistency weight {weight}: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
