"""
# Getting started with keras-penalties

keras-penalties gives Keras 3 composable regularization penalties and loss
terms, written once in `keras.ops`, running unchanged on JAX, TensorFlow and
PyTorch. This guide tours every penalty, then the three places one plugs into
a model:

1. a layer's `kernel_regularizer=` / `activity_regularizer=`;
2. `model.compile(loss=...)`;
3. a `CompositeObjective` layer, several weighted terms in one place, watched
   with `PenaltyMonitor`.

Run it on any backend:

    KERAS_BACKEND=torch python guides/getting_started.py
"""

import os

import keras
import numpy as np

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties import ops as P
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 5))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

"""
## Every penalty is a function of tensors

`keras_penalties.ops` holds each formula once. Options are keyword-only,
logs are natural, and from logits everything goes through log-softmax.
"""

x = rng.normal(size=(4, 6)).astype("float32")
teacher = rng.normal(size=(4, 6)).astype("float32")
weights = rng.normal(size=(8, 3)).astype("float32")

print("l1                ", float(P.l1(x)))
print("l2 (centred)      ", float(P.l2(x, center="mean")))
print("elastic net       ", float(P.elastic_net(x, l1_ratio=0.3)))
print("KL(teacher‖x)     ", float(P.kl_divergence(teacher, x, from_logits=True)))
print("reverse KL, T = 2 ", float(P.kl_divergence(teacher, x, from_logits=True, direction="reverse", temperature=2.0)))
print("symmetric KL      ", float(P.kl_divergence(teacher, x, from_logits=True, direction="symmetric")))
print("JS (≤ ln 2)       ", float(P.js_divergence(teacher, x, from_logits=True)))
print("entropy / ln K    ", float(P.entropy(x, from_logits=True, normalize=True)))
print("consistency (cos) ", float(P.consistency(teacher, x, metric="cosine")))
print("orthogonality     ", float(P.orthogonality(weights, mode="spectral")))
print("output magnitude  ", float(P.output_magnitude(x, target=1.0)))
print("KL sparsity       ", float(P.kl_sparsity(keras.ops.sigmoid(x), target=0.1)))

"""
## 1. Regularizers on layers

Each regularizer takes its strength `factor` first. Activity regularizers are
written for Keras' division by the batch size, so what a layer adds does not
depend on the batch size.
"""

inputs = keras.Input((6,))
hidden = keras.layers.Dense(
    16,
    activation="sigmoid",
    kernel_regularizer=R.Orthogonality(1e-2),
    activity_regularizer=R.KLSparsity(1e-2, target=0.1),
)(inputs)
logits = keras.layers.Dense(3, kernel_regularizer=R.L2(1e-4), activity_regularizer=R.Entropy(1e-2, from_logits=True, mode="bonus"))(hidden)
model = keras.Model(inputs, logits)

"""
## 2. Losses in compile

`KLDivergence` (forward, reverse or symmetric, with temperature),
`JSDivergence`, `Entropy` and `Consistency` are Keras losses; `CompositeLoss`
weights several named ones.
"""

model.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    loss=L.CompositeLoss(
        {"ce": keras.losses.CategoricalCrossentropy(from_logits=True), "kl": L.KLDivergence(from_logits=True, temperature=2.0)},
        weights={"ce": 1.0, "kl": 0.5},
    ),
)
data = rng.normal(size=(256, 6)).astype("float32")
targets = keras.utils.to_categorical((data[:, 0] > 0).astype(int) + (data[:, 1] > 1).astype(int), 3)
history = model.fit(data, targets, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
print("composite loss terms after training:", {k: round(v[-1], 4) for k, v in history.history.items() if "/" in k})

"""
## 3. A CompositeObjective

A pass-through layer with named, weighted terms; weights can follow a
schedule of the training step. `PenaltyMonitor` shows each term in the logs.
"""

inputs = keras.Input((6,))
hidden = keras.layers.Dense(16, activation="relu")(inputs)
hidden = CompositeObjective(
    {
        "sparsity": Term("l1", 1e-3),  # per-sample Σ|h|, averaged over the batch
        "magnitude": Term("output_magnitude", keras.optimizers.schedules.PolynomialDecay(0.0, 20, 0.1), options={"target": 1.0}),
    },
    name="objective",
)(hidden)
model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
history = model.fit(data, targets, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
print("objective terms per epoch:", {k: [round(v, 3) for v in vs] for k, vs in history.history.items() if k.startswith("objective/")})
