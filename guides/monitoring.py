"""
# Monitoring penalty terms and their gradients

A regularized objective is a sum, and the sum hides which term is doing the
work. `PenaltyMonitor` shows each term's value and, on a fixed probe batch,
how hard each term pulls on the weights: ‖∂termᵢ/∂θ‖, raw and weighted. This
guide trains a model with several terms and reads those numbers from the
progress bar's logs, `History`, `monitor.history`, a CSV log and TensorBoard.

    KERAS_BACKEND=jax python guides/monitoring.py
"""

import csv
import os
import pathlib
import tempfile

import keras
import numpy as np

from keras_penalties import CompositeObjective, Term
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 6))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 12)).astype("float32")
y = (x[:, :3].sum(1) > 0).astype("int32")

"""
## A model with terms of every kind

A CompositeObjective on the hidden layer, a kernel regularizer and an
activity regularizer: the monitor finds all of them by itself.
"""

inputs = keras.Input((12,))
hidden = keras.layers.Dense(
    32, activation="relu", kernel_regularizer=R.L2(1e-3), activity_regularizer=R.OutputMagnitude(1e-3, target=3.0), name="hidden"
)(inputs)
hidden = CompositeObjective(
    {"sparsity": Term("l1", 1e-3), "decorrelate": Term(R.Orthogonality(1.0), 1e-2)}, name="objective"
)(hidden)
model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(hidden))
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

"""
## Training with the monitor, a CSV log and TensorBoard

`probe_data` is a fixed batch; every `every_n_batches` the monitor measures
each term's gradient norm on it, with the backend's native autodiff, compiled
once, without changing the training. List it before CSVLogger and
TensorBoard so they receive the values it adds.
"""

logdir = pathlib.Path(tempfile.mkdtemp())
monitor = PenaltyMonitor(probe_data=(x[:128], y[:128]), every_n_batches=8)
history = model.fit(
    x,
    y,
    epochs=EPOCHS,
    batch_size=32,
    validation_split=0.25,
    verbose=0,
    callbacks=[monitor, keras.callbacks.CSVLogger(str(logdir / "log.csv")), keras.callbacks.TensorBoard(str(logdir / "tb"))],
)

"""
## Reading the numbers

`History` holds each term's epoch-averaged value (`val_`-prefixed for the
validation split) and, averaged over the epoch's probes, its gradient norms.
"""

logs = history.history
for key in ("objective/sparsity", "objective/decorrelate", "hidden/kernel_regularizer", "hidden/activity_regularizer"):
    print(f"{key:<30} value {logs[key][-1]:10.4f}   weighted grad norm {logs[key + '/grad_norm_weighted'][-1]:.5f}")
print(f"{'compiled loss':<30} grad norm {logs['base_loss/grad_norm'][-1]:.5f}; whole objective {logs['total/grad_norm'][-1]:.5f}")
print("validation sparsity:", round(logs["val_objective/sparsity"][-1], 4))

"""
`monitor.history` keeps every probe (step, value, weight, contribution and
gradient norms of each term), ready for a DataFrame or a plot, and
`monitor.plot()` draws contributions and weighted gradient norms over steps.
"""

print(f"{len(monitor.history)} probes; the last at step {monitor.history[-1]['step']}")
monitor.plot().savefig(logdir / "penalties.png")

"""
The CSV log has a column per term, and TensorBoard's event files receive the
same scalars.
"""

with open(logdir / "log.csv") as f:
    columns = next(csv.reader(f))
print("CSV columns:", [c for c in columns if "/" in c][:6], "...")
print("TensorBoard event files:", sum(1 for _ in (logdir / "tb").rglob("events.*")))
