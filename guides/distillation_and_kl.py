"""
# Distillation and KL penalties

KL divergence between a model's distribution and a reference is the core of
knowledge distillation (Hinton et al., 2015), of KL-regularized fine-tuning
(stay close to a reference model) and of VAE-style KL annealing. This guide:

1. trains a teacher, then distils it into a smaller student from logits, with
   a temperature, in a `CompositeObjective` fed a dict of named tensors;
2. swaps in the symmetric KL and the Jensen-Shannon divergence;
3. anneals the KL weight from 0 to 1 with a schedule of the training step;
4. distils a token model with the T² weight, a token mask and chunks;
5. trains a small VAE whose KL term, `ops.gaussian_kl`, is annealed in, and
   saves and loads it without registering anything.

    KERAS_BACKEND=tensorflow python guides/distillation_and_kl.py
"""

import os

import keras
import numpy as np

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties.callbacks import PenaltyMonitor

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 10))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

"""
## Data and a teacher
"""

centers = rng.normal(scale=2.0, size=(5, 16))
labels = rng.integers(0, 5, 2048)
x = (centers[labels] + rng.normal(size=(2048, 16))).astype("float32")
y = keras.utils.to_categorical(labels, 5)

teacher = keras.Sequential(
    [keras.Input((16,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(5)], name="teacher"
)
teacher.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
teacher.fit(x, y, epochs=EPOCHS, verbose=0)
teacher.trainable = False

"""
## 1. Distilling from logits with a temperature

The student model runs the frozen teacher beside itself and feeds both logits
to a `CompositeObjective`. Terms pick their inputs by name: `KLDivergence`
gets them as (y_true, y_pred) = (teacher, student). The temperature T softens
both distributions; as in Hinton et al., the KL is scaled by T² so its
gradient keeps its size as T changes.
"""

T = 3.0


def student_model(terms):
    inputs = keras.Input((16,))
    student = keras.layers.Dense(16, activation="relu")(inputs)
    student = keras.layers.Dense(5, name="student_logits")(student)
    outputs = CompositeObjective(terms, name="distill")({"student": student, "teacher": teacher(inputs)})
    model = keras.Model(inputs, outputs["student"])
    model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


kd = Term(L.KLDivergence(from_logits=True, temperature=T), T**2, inputs=("teacher", "student"))
student = student_model({"kd": kd})
history = student.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
print(f"KL(teacher‖student) at T={T}: {history.history['distill/kd'][0]:.4f} -> {history.history['distill/kd'][-1]:.4f}")
print(f"student accuracy {history.history['accuracy'][-1]:.3f}")

"""
## 2. Symmetric KL and Jensen-Shannon

Forward KL(teacher‖student) is mass-covering; reverse KL is mode-seeking; the
symmetric KL averages both. JS is symmetric and bounded by ln 2, a gentler
penalty when the two disagree strongly. Each is one option away.
"""

student = student_model(
    {
        "sym": Term("kl_divergence", 1.0, inputs=("teacher", "student"), options={"from_logits": True, "direction": "symmetric"}),
        "js": Term("js_divergence", 1.0, inputs=("teacher", "student"), options={"from_logits": True}),
    }
)
history = student.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
print(f"symmetric KL {history.history['distill/sym'][-1]:.4f}, JS {history.history['distill/js'][-1]:.4f} (≤ ln 2)")

"""
## 3. KL annealing

A weight can be any `keras.optimizers.schedules.LearningRateSchedule`: its
value at training step t weights step t. Here the KL term fades in linearly
over the first epochs, letting the student fit the labels first.
"""

steps = EPOCHS * (len(x) // 32)
anneal = keras.optimizers.schedules.PolynomialDecay(0.0, max(steps // 2, 1), 1.0)
student = student_model({"kd": Term(L.KLDivergence(from_logits=True), anneal, inputs=("teacher", "student"))})
history = student.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
objective = student.get_layer("distill")
print(f"after {int(keras.ops.convert_to_numpy(objective.step))} steps the KL weight is "
      f"{float(keras.ops.convert_to_numpy(objective.current_weights())[0]):.2f}")

"""
## 4. Token-level distillation: T², a token mask, chunks

Language models are distilled position by position. The objective reads a
mask input (1 where a token counts: the answer, not the prompt or padding)
through the term's `mask` option, and `chunk_size` computes the KL a block of
rows at a time, recomputed in the backward pass, so a large vocabulary never
needs the whole `[tokens, vocab]` array of temporaries. The weight is T², as
in section 1.

With a teacher model rather than its logits, use
`keras_penalties.distillation.Distiller` with `LogitsDivergence(temperature=T)`
(T²·KL from logits, right alone or in a list, with `sample_weight` as the
token mask; Keras' own `Distiller` drops a single loss's
`distillation_loss_weights` and its default `LogitsDistillation` loss has no
softmax: see [the Distiller](../docs/distillation.md#a-distiller-that-keeps-what-keras-drops)).
To leave the logits unformed altogether, see
[distilling a language model](distilling_a_language_model.py).
"""

vocab, length, prompt = 32, 10, 4
sequences = rng.integers(1, vocab, (512, length))
# The teacher's next-token logits favour (token + 1) mod vocab.
teacher_logits = 4.0 * keras.ops.convert_to_numpy(keras.ops.one_hot((sequences + 1) % vocab, vocab)).astype("float32")
answer = np.broadcast_to((np.arange(length) >= prompt).astype("float32"), (512, length)).copy()

tokens = keras.Input((length,), dtype="int32")
teacher_in = keras.Input((length, vocab))
answer_in = keras.Input((length,))
student_logits = keras.layers.Dense(vocab)(keras.layers.Embedding(vocab, 16)(tokens))
outputs = CompositeObjective(
    {
        "kd": Term(
            "kl_divergence",
            T**2,
            inputs=("teacher", "student"),
            options={"from_logits": True, "temperature": T, "mask": "answer", "chunk_size": 256},
        )
    },
    name="tokens",
)({"teacher": teacher_in, "student": student_logits, "answer": answer_in})
lm = keras.Model([tokens, teacher_in, answer_in], outputs["student"])
lm.compile(optimizer=keras.optimizers.Adam(0.01))
history = lm.fit([sequences, teacher_logits, answer], epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
print(f"masked token KL at T={T}: {history.history['tokens/kd'][0]:.4f} -> {history.history['tokens/kd'][-1]:.4f}")

"""
## 5. A VAE: the Gaussian KL, annealed

The VAE's KL term is `gaussian_kl(mean, log_var)`, the KL of the encoder's
N(μ, σ²) to N(0, 1) summed over the latent axis, averaged over samples. As a
Term named by string it saves and loads with the model, with no function to
register. The sampling layer owns its seed generator, so each step draws
fresh noise on every backend (JAX included).
"""


class Sample(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(0)

    def call(self, inputs):
        mean, log_var = inputs
        return mean + keras.ops.exp(0.5 * log_var) * keras.random.normal(keras.ops.shape(mean), seed=self.seed)


images = (rng.uniform(size=(1024, 16)) < 0.5 * (1 + np.sin(np.arange(16)))[None] / 2).astype("float32")
pixels = keras.Input((16,))
h = keras.layers.Dense(32, activation="relu")(pixels)
latent = CompositeObjective(
    {"kl": Term("gaussian_kl", keras.optimizers.schedules.PolynomialDecay(0.0, 100, 1.0), inputs=("mean", "log_var"))},
    name="vae",
)({"mean": keras.layers.Dense(2)(h), "log_var": keras.layers.Dense(2)(h)})
z = Sample()([latent["mean"], latent["log_var"]])
decoded = keras.layers.Dense(16)(keras.layers.Dense(32, activation="relu")(z))
vae = keras.Model(pixels, decoded)
vae.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.BinaryCrossentropy(from_logits=True))
history = vae.fit(images, images, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=[PenaltyMonitor()])
print(f"VAE KL (nats per sample): {history.history['vae/kl'][0]:.3f} -> {history.history['vae/kl'][-1]:.3f}")

import pathlib  # noqa: E402
import tempfile  # noqa: E402

path = pathlib.Path(tempfile.mkdtemp()) / "vae.keras"
vae.save(path)
restored = keras.saving.load_model(path, custom_objects={"Sample": Sample})
assert restored.get_layer("vae").terms["kl"].penalty.__name__ == "gaussian_kl"
