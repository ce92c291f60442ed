"""
# Adaptive weighting: uncertainty, FAMO, DWA and GradNorm

Three tasks share one trunk: a regression in units of 1, a regression in
units ten times larger (its squared error is 100× the first's) and a 4-class
classification. With equal weights the large regression owns the gradient.
This guide trains the same model with fixed weights and with the four
adaptive methods, compares each task's held-out error, and plots how the
weights move.

    KERAS_BACKEND=jax python guides/adaptive_weighting.py
"""

import os
import pathlib
import tempfile

import keras
import numpy as np

from keras_penalties.callbacks import DynamicWeightAverage, GradNorm, PenaltyMonitor
from keras_penalties.losses import CompositeLoss

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 12))
rng = np.random.default_rng(0)
mix, heads = rng.normal(size=(16, 8)) / 4.0, (rng.normal(size=(8, 2)), rng.normal(size=(8, 4)))


def draw(n):
    x = rng.normal(size=(n, 16))
    z = np.tanh(2.0 * x @ mix)
    reg = z @ heads[0] + 0.1 * rng.normal(size=(n, 2))
    label = (3.0 * z @ heads[1] + rng.gumbel(size=(n, 4))).argmax(-1)
    y = np.concatenate([reg[:, :1], 10.0 * reg[:, 1:], np.eye(4)[label]], axis=1)
    return x.astype("float32"), y.astype("float32")


(x, y), (x_test, y_test) = draw(2048), draw(512)

"""
## One CompositeLoss over the three tasks

The model's output stacks the three heads; each task's loss reads its own
columns. Registering the loss class lets a `.keras` file bring it back.
"""


@keras.saving.register_keras_serializable(package="guide")
class Task(keras.losses.Loss):
    def __init__(self, task, **kwargs):
        super().__init__(**{"name": task, **kwargs})
        self.task = task

    def call(self, y_true, y_pred):
        if self.task == "cls":
            return keras.losses.categorical_crossentropy(y_true[:, 2:], y_pred[:, 2:], from_logits=True)
        column = 0 if self.task == "reg" else 1
        return keras.ops.square(y_true[:, column] - y_pred[:, column])

    def get_config(self):
        return {**super().get_config(), "task": self.task}


def model_with(**loss_kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="trunk")(h)
    outputs = keras.layers.Concatenate()([keras.layers.Dense(1)(h), keras.layers.Dense(1)(h), keras.layers.Dense(4)(h)])
    model = keras.Model(inputs, outputs)
    loss = CompositeLoss({t: Task(t) for t in ("reg", "reg_x10", "cls")}, name="tasks", **loss_kwargs)
    model.compile(keras.optimizers.Adam(1e-3), loss=loss)
    return model


def task_errors(model):
    pred = model.predict(x_test, verbose=0)
    return {
        "reg": float(np.mean((pred[:, 0] - y_test[:, 0]) ** 2)),
        "reg_x10": float(np.mean((pred[:, 1] - y_test[:, 1]) ** 2)),
        "cls error": float(np.mean(pred[:, 2:].argmax(-1) != y_test[:, 2:].argmax(-1))),
    }


"""
## Fixed, equal weights: the baseline
"""

fixed = model_with()
fixed.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0)
print("fixed       ", task_errors(fixed))

"""
## Uncertainty weighting

`weighting="uncertainty"` gives each task a trainable log-variance sᵢ; the
loss is Σ ½·exp(−sᵢ)·Lᵢ + ½·sᵢ, whose optimum sᵢ = log Lᵢ divides each task
by its own scale. `PenaltyMonitor` logs the weights ½·exp(−sᵢ) per epoch.
The sᵢ are trained by the model's optimizer like any weight: Adam moves each
by about its learning rate per step, so reaching log Lᵢ ≈ 4 for the large
regression takes thousands of steps at 1e-3 (bench/multitask.py measures
where it gets to).
"""

uncertainty = model_with(weighting="uncertainty")
logs = uncertainty.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()]).history
print("uncertainty ", task_errors(uncertainty))
print("  weights after training:", {t: round(logs[f"tasks/{t}/weight"][-1], 4) for t in ("reg", "reg_x10", "cls")})

# The learned sᵢ are saved and loaded with the model.
path = pathlib.Path(tempfile.mkdtemp()) / "uncertainty.keras"
uncertainty.save(path)
restored = keras.saving.load_model(path)
np.testing.assert_allclose(
    keras.ops.convert_to_numpy(restored.loss.log_variances), keras.ops.convert_to_numpy(uncertainty.loss.log_variances)
)

"""
## FAMO

`weighting="famo"` (Liu et al., 2023) balances how fast each task's loss
falls, on the log scale, so a task 100× smaller is not drowned out. Each
task has a logit ξᵢ with an Adam of its own (learning rate 0.025); the model
trains on Σ cᵢzᵢ·log Lᵢ, z = softmax(ξ), whose gradient is Σ wᵢ·∇Lᵢ with
wᵢ = cᵢzᵢ/Lᵢ: each task is divided by its own scale at every step, at no
extra cost (no per-task gradients). After each step ξ moves towards the
tasks whose log-loss fell least. The effective weights wᵢ sum to 1; the
loss `fit` shows is the log-sum, which can be negative.
"""

famo = model_with(weighting="famo")
logs = famo.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()]).history
print("FAMO        ", task_errors(famo))
weights = {t: logs[f"tasks/{t}/weight"][-1] for t in ("reg", "reg_x10", "cls")}
print("  effective weights after training:", {t: round(w, 4) for t, w in weights.items()})
# Each task divided by its scale: the large regression gets the smallest weight.
assert weights["reg_x10"] < weights["reg"] and abs(sum(weights.values()) - 1.0) < 1e-4

"""
## Dynamic Weight Average

After each epoch from the second on, wᵢ = K·softmax(rᵢ/T), with rᵢ the ratio
of task i's last two epoch means: a task that stopped improving gets more
weight. It balances the rates, not the scales.
"""

dwa = model_with()
logs = dwa.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=[DynamicWeightAverage("tasks")]).history
print("DWA         ", task_errors(dwa))
print("  weights per epoch (reg_x10):", np.round(logs["tasks/reg_x10/weight"], 3))

"""
## GradNorm

GradNorm probes a fixed batch and measures each task's gradient norm with
respect to the last shared layer, then steps the weights towards equal
weighted norms, scaled by how far each task has come. The weights take
steps of their own optimizer, Adam(0.025) as in the paper: Adam divides by
the gradient's running magnitude, so the weight of a task whose norm is 1
moves as fast as one whose norm is 100. The monitor, probing the same
batch, plots the weights.
"""

gradnorm = model_with()
probe = (x[:128], y[:128])
monitor = PenaltyMonitor(probe_data=probe, every_n_batches=8)
callback = GradNorm("tasks", "trunk", probe_data=probe, every_n_batches=8)
gradnorm.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=[callback, monitor])
print("GradNorm    ", task_errors(gradnorm))
last = callback.history[-1]
print("  last probe: norms", {k: round(v, 2) for k, v in last["grad_norms"].items()},
      "weights", {k: round(v, 3) for k, v in last["weights"].items()})
assert last["weights"]["reg_x10"] < 1.0 < last["weights"]["reg"]

figure = monitor.plot()  # contributions, weighted gradient norms, and a panel of the weights
figure.savefig(pathlib.Path(tempfile.mkdtemp()) / "gradnorm.png")

"""
## Which to use

`bench/multitask.py` runs this problem (4096 samples) for 30 and 100
epochs on every backend; [Multi-task weighting](../docs/performance.md#multi-task-weighting)
on the Performance page has the table.
From those numbers:

- A long enough run for learned weights to settle (100 epochs there):
  `weighting="uncertainty"`. It was the one method better than fixed
  weights on every task, on every backend (the small regression at ×0.6–0.7
  of its alone-error, where fixed weights leave it at ×1.6–2.0).
- A short run where the small-scale task matters: `weighting="famo"`. It
  divides each task by its own loss from the first step, and after 30
  epochs the small regression is at ×0.7 of its alone-error (fixed: ×3.3–4.0),
  while the large regression pays (×1.5–1.7 of its alone-error).
- Tasks of one scale whose progress differs: `DynamicWeightAverage`.
- GradNorm gave the classification most of the weight there and left both
  regressions worse than fixed weights; measure it on your problem before
  relying on it.
"""
