"""Trains a small classifier with composed penalties and watches each term with PenaltyMonitor.

The hidden layer carries an L1 sparsity penalty on its activations and an L2
kernel regularizer; the output logits an entropy bonus (a confidence penalty)
whose weight warms up from 0 along a schedule. PenaltyMonitor logs every term
and probes gradient norms; at the end the script prints the per-term table
and writes penalty_monitor.png (or $PENALTY_MONITOR_PNG). This is `make demo`.

    KERAS_BACKEND=torch python examples/penalty_monitor.py
"""

import os

# TensorFlow, when installed, logs its start-up (oneDNN, CPU features) from C++ on import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_penalties import CompositeObjective, Term  # noqa: E402
from keras_penalties import losses as L  # noqa: E402
from keras_penalties import regularizers as R  # noqa: E402
from keras_penalties.callbacks import PenaltyMonitor  # noqa: E402

EPOCHS = int(os.environ.get("EXAMPLE_EPOCHS", 8))
OUTPUT = os.environ.get("PENALTY_MONITOR_PNG", "penalty_monitor.png")


def data(n=2048, classes=4, dim=20, seed=0):
    """Gaussian blobs: no download needed."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=2.0, size=(classes, dim))
    y = rng.integers(0, classes, n)
    x = centers[y] + rng.normal(size=(n, dim))
    return x.astype("float32"), y


def main():
    keras.utils.set_random_seed(0)
    x, y = data()
    warm_up = keras.optimizers.schedules.PolynomialDecay(0.0, 100, 0.1)
    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(64, activation="relu", kernel_regularizer=R.L2(1e-3), name="hidden")(inputs)
    # Per-sample Σ|h| (averaged over the batch), so 3e-3 means the same at any batch size.
    hidden = CompositeObjective({"sparsity": Term("l1", 3e-3)}, name="activity")(hidden)
    logits = keras.layers.Dense(4, name="logits")(hidden)
    logits = CompositeObjective(
        {"entropy_bonus": Term(L.Entropy(from_logits=True, mode="bonus"), warm_up)}, name="output"
    )(logits)
    model = keras.Model(inputs, logits)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    monitor = PenaltyMonitor(probe_data=(x[:256], y[:256]), every_n_batches=10)
    history = model.fit(x, y, batch_size=64, epochs=EPOCHS, validation_split=0.25, verbose=0, callbacks=[monitor])

    last = monitor.history[-1]
    print(f"{'term':<28}{'value':>12}{'weight':>10}{'contribution':>14}{'grad norm (w)':>15}")
    for key in ("activity/sparsity", "output/entropy_bonus", "hidden/kernel_regularizer"):
        print(
            f"{key:<28}{last[key]:>12.4f}{last[key + '/weight']:>10.4f}"
            f"{last[key + '/contribution']:>14.4f}{last[key + '/grad_norm_weighted']:>15.4f}"
        )
    # The monitor's own keys: "base_loss" is the compiled loss, "total" the whole training loss.
    for key in ("base_loss", "total"):
        print(f"{key:<28}{last[key]:>12.4f}{'':>10}{last[key]:>14.4f}{last[key + '/grad_norm']:>15.4f}")
    print(f"validation accuracy {history.history['val_accuracy'][-1]:.3f}")
    monitor.plot().savefig(OUTPUT, dpi=100)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
