"""
# Regularizing activations: CompositeObjective and a sparse autoencoder

Penalties on what a layer *outputs* shape representations: sparse codes,
bounded norms, confident or spread-out predictions. This guide

1. puts a `CompositeObjective` on hidden activations (L1 sparsity and an
   output-magnitude penalty), and
2. trains a sparse autoencoder whose code units are pushed, with the
   `KLSparsity` penalty of Ng's sparse-autoencoder notes, to fire on average
   with probability ρ = 0.05.

    KERAS_BACKEND=jax python guides/activity_regularization.py
"""

import os

import keras
import numpy as np
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 40))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

"""
## Data: points near a low-dimensional subspace, no download needed
"""

basis = rng.normal(size=(4, 32))
x = (rng.normal(size=(2048, 4)) @ basis + 0.1 * rng.normal(size=(2048, 32))).astype("float32")

"""
## 1. A CompositeObjective on hidden activations

The objective passes its input through and adds Σ wᵢ·termᵢ to the loss.
`PenaltyMonitor` reports each term as `"<objective>/<term>"`.
"""

inputs = keras.Input((32,))
hidden = keras.layers.Dense(64, activation="relu")(inputs)
hidden = CompositeObjective(
    {"sparsity": Term("l1", 1e-3), "magnitude": Term("output_magnitude", 1e-2, options={"target": 2.0})},
    name="hidden_penalties",
)(hidden)
outputs = keras.layers.Dense(32)(hidden)
model = keras.Model(inputs, outputs)
model.compile(optimizer="adam", loss="mse")
history = model.fit(x, x, epochs=max(EPOCHS // 3, 1), batch_size=64, verbose=0, callbacks=[PenaltyMonitor()])
for key in ("hidden_penalties/sparsity", "hidden_penalties/magnitude"):
    print(f"{key}: {history.history[key][0]:.3f} -> {history.history[key][-1]:.3f}")

"""
## 2. A sparse autoencoder

A sigmoid code layer with `activity_regularizer=KLSparsity(factor, target)`:
the penalty is Σⱼ KL(ρ‖ρ̂ⱼ) with ρ̂ⱼ unit j's mean activation over the
batch. It is a statistic of the whole batch, so the regularizer multiplies by
the batch size to cancel Keras' division: the layer adds exactly factor × the
penalty, whatever the batch size.
"""

RHO = 0.05
inputs = keras.Input((32,))
code = keras.layers.Dense(
    64, activation="sigmoid", activity_regularizer=R.KLSparsity(3.0, target=RHO), name="code"
)(inputs)
reconstruction = keras.layers.Dense(32)(code)
autoencoder = keras.Model(inputs, reconstruction)
autoencoder.compile(optimizer=keras.optimizers.Adam(2e-2), loss="mse")
encoder = keras.Model(inputs, code)

before = float(ops.mean(encoder(x[:512])))
autoencoder.fit(x, x, epochs=EPOCHS, batch_size=128, verbose=0)
activations = ops.convert_to_numpy(encoder(x[:512]))
print(f"mean code activation: {before:.3f} before, {activations.mean():.3f} after training (target ρ = {RHO})")
