"""
# Moving a penalty into the optimizer: ProximalDecay and gradient transforms

A `kernel_regularizer=L1(f)` adds f·Σ|w| to the loss, and the optimizer sees
its gradient f·sign(w) mixed with the data's. Under SGD that is fine; under
Adam it is not what you asked for: Adam divides every gradient by its own
running RMS, so the penalty moves each weight by about η a step whatever f
is, and no weight ever lands on 0.

`keras_penalties.optimizers.ProximalDecay(optimizer, L1(f))` takes the same
regularizer object and applies it *after* the optimizer's update, as its exact
proximal step: w ← sign(w)·max(|w| − η·f, 0). Weights become exactly 0. This
guide

1. trains a linear model with a known sparse truth both ways, and reads the
   sparsity each gives;
2. compares L2 as a coupled regularizer, as Adam's `weight_decay` and as a
   proximal step;
3. nests the gradient transforms (centralization, adaptive clipping, noise)
   around an optimizer, and saves and loads the model with its optimizer state.

    KERAS_BACKEND=jax python guides/optimizers.py
"""

import os
import tempfile

import keras
import numpy as np

from keras_penalties import optimizers
from keras_penalties import regularizers as R

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 20))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

"""
## Data: 200 features, 10 of which matter
"""

features, relevant = 200, 10
x = rng.normal(size=(1024, features)).astype("float32")
truth = np.zeros(features, "float32")
truth[:relevant] = rng.choice([-1.0, 1.0], relevant) * rng.uniform(0.5, 2.0, relevant)
y = (x @ truth + 0.1 * rng.normal(size=1024)).astype("float32")[:, None]


def linear(regularizer=None):
    return keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(1, use_bias=False, kernel_regularizer=regularizer, kernel_initializer="zeros")]
    )


def sparsity(model):
    w = keras.ops.convert_to_numpy(model.layers[0].kernel)[:, 0]
    return {
        "exact zeros": int(np.sum(w == 0.0)),
        "irrelevant, |w| > 0.01": int(np.sum(np.abs(w[relevant:]) > 0.01)),
        "relevant kept": int(np.sum(w[:relevant] != 0.0)),
    }


"""
## 1. The same L1, coupled and proximal

Moving the penalty is moving one object: from `kernel_regularizer=` to the
optimizer. The factor means something different, though. Coupled, f is in
loss units. Proximal under Adam, the threshold η·f is compared with Adam's
step η·m̂/√v̂: a weight ends at exactly 0 when |m̂|/√v̂ < f, that is when its
minibatch gradients mostly cancel. For a weight whose gradient is pure noise
m̂/√v̂ has a spread of about √((1 − β₁)/(1 + β₁)) ≈ 0.23 (β₁ = 0.9), so
factors of 0.3–0.7 zero such weights while f ≥ 1 zeroes everything.
"""

coupled = linear(R.L1(1e-2))
coupled.compile(keras.optimizers.Adam(0.01), "mse")
coupled.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0)

proximal = linear()
proximal.compile(optimizers.ProximalDecay(keras.optimizers.Adam(0.01), R.L1(0.5)), "mse")
proximal.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0)

print("Adam + kernel_regularizer=L1(0.01):", sparsity(coupled))
print("Adam in ProximalDecay(L1(0.5)):    ", sparsity(proximal))

"""
The coupled model has no exact zero: its irrelevant weights hover around 0
at about η. In the proximal one every irrelevant weight is exactly 0 and
every relevant one is kept (bench/sparse_recovery.py measures it at 1000
features). For SGD, `ProximalDecay` is the proximal-gradient method
(ISTA), and to first order in η the same as the coupled penalty.

## 2. L2 three ways

With no data gradient, k Adam steps at rate η give, for L2(f):

- `ProximalDecay(Adam, L2(f))`: w / (1 + 2ηf)^k — the exact prox;
- `Adam(weight_decay=2f)` (Keras' decoupled decay, linearised): w·(1 − 2ηf)^k,
  the same to first order in ηf;
- `kernel_regularizer=L2(f)` with Adam: about w − kη·sign(w), whatever f.
"""

eta, f, k = 0.01, 2.0, 10
w0 = np.float32([[1.0], [-2.0], [0.5]])
zeros_x, zeros_y = np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32")


def decay_run(optimizer, regularizer=None):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, use_bias=False, kernel_regularizer=regularizer, kernel_initializer=keras.initializers.Constant(w0))]
    )
    model.compile(optimizer, "mse")
    model.fit(zeros_x, zeros_y, batch_size=4, epochs=k, verbose=0)
    return [round(float(v), 4) for v in keras.ops.convert_to_numpy(model.layers[0].kernel)[:, 0]]


print("ProximalDecay(Adam, L2(2)):", decay_run(optimizers.ProximalDecay(keras.optimizers.Adam(eta), R.L2(f))))
print("Adam(weight_decay=4):      ", decay_run(keras.optimizers.Adam(eta, weight_decay=2 * f)))
print("Adam + coupled L2(2):      ", decay_run(keras.optimizers.Adam(eta), R.L2(f)))

"""
## 3. Gradient transforms, nested, saved and loaded

Each wrapper is a Keras optimizer around another, so they nest: here the
gradient is centralized (Yong et al., 2020), then clipped unit-wise against
the weight norms (AGC, Brock et al., 2021), then perturbed with annealed
noise (Neelakantan et al., 2015) before Adam steps. `learning_rate` and
`iterations` are Adam's. Under `mixed_float16` Keras wraps the whole stack in
a `LossScaleOptimizer`, as it would a bare Adam.
"""

stack = optimizers.GradientCentralization(
    optimizers.AdaptiveGradientClipping(
        optimizers.GradientNoise(keras.optimizers.Adam(3e-3), stddev=0.01, seed=0),
        clip_factor=0.05,
        exclude=["logits"],  # the paper leaves the classifier layer unclipped
    )
)
labels = (x[:, :2].sum(axis=1) > 0).astype("int32")
classifier = keras.Sequential(
    [keras.Input((features,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2, name="logits")]
)
classifier.compile(stack, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = classifier.fit(x, labels, batch_size=64, epochs=max(EPOCHS // 4, 1), verbose=0)
print("accuracy:", round(history.history["accuracy"][-1], 3), "after", int(classifier.optimizer.iterations), "steps")

with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "classifier.keras")
    classifier.save(path)
    loaded = keras.saving.load_model(path)  # safe_mode=True; the optimizer state comes back too
print("loaded optimizer:", type(loaded.optimizer).__name__, "at step", int(loaded.optimizer.iterations))
