"""The model of tests/test_saving.py::test_files_saved_by_0_1_0_load.

Run as a script with a release's checkout first on PYTHONPATH, it trains the
model briefly and saves it: `KERAS_BACKEND=jax PYTHONPATH=<checkout> python
tests/data/save_release_model.py tests/data/release_0.1.0_jax.keras`."""

import sys

import keras
import numpy as np

import keras_penalties as kp
from keras_penalties import losses as L
from keras_penalties import optimizers as O
from keras_penalties import regularizers as R


def build_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=R.ElasticNet(0.01, l1_ratio=0.3),
        activity_regularizer=R.OutputMagnitude(0.1, target=1.0),
        name="hidden",
    )(inputs)
    terms = {"l1": kp.Term("l1", 0.01), "mag": kp.Term("output_magnitude", 0.02, options={"target": 0.5})}
    hidden = kp.CompositeObjective(terms, weighting="uncertainty", name="act")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, name="logits")(hidden))
    loss = L.CompositeLoss(
        {
            "ce": keras.losses.CategoricalCrossentropy(from_logits=True),
            "ent": L.Entropy(from_logits=True, mode="bonus"),
        },
        weights={"ce": 1.0, "ent": 0.1},
        weighting="famo",
        name="closs",
    )
    model.compile(optimizer=O.ProximalDecay(keras.optimizers.Adam(1e-2), R.L1(1e-3)), loss=loss)
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    return x, np.eye(4, dtype="float32")[rng.integers(0, 4, 32)]


if __name__ == "__main__":
    model = build_model()
    model.fit(*data(), epochs=2, batch_size=8, verbose=0)
    model.save(sys.argv[1])
