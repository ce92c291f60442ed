"""
# Gradient penalties on every backend: a WGAN-GP in plain Keras

Keras 3 has no backend-agnostic gradient op, so Keras' own WGAN-GP example
is TensorFlow-only. `keras_penalties.gradients` is the one place that takes
input gradients with each backend's native autodiff (`jax.grad`,
`tf.GradientTape`, `torch.autograd.grad`) and keeps them differentiable, so a
penalty on an input gradient trains the critic. This guide trains a small
WGAN-GP (Gulrajani et al., 2017) on a ring of eight Gaussians, with the same
code on JAX, TensorFlow and PyTorch:

    KERAS_BACKEND=jax python guides/gradient_penalty.py
    KERAS_BACKEND=torch python guides/gradient_penalty.py

Everything below is ordinary Keras: models whose `compute_loss` holds the
objective, trained with `fit`. No `train_step` is needed, because nothing
here is backend-specific.
"""

import os

import keras
import numpy as np
from keras import ops

from keras_penalties.gradients import gradient_penalty, interpolated_gradient_penalty

# Small sizes when the test suite runs this guide.
ROUNDS = int(os.environ.get("GUIDE_ROUNDS", 400))
BATCH = 256
NOISE = 8
keras.utils.set_random_seed(0)

"""
## The data: eight Gaussians on a ring
"""


def real_samples(n, rng):
    angles = rng.integers(0, 8, n) * (2 * np.pi / 8)
    centers = np.stack([np.cos(angles), np.sin(angles)], axis=1) * 2.0
    return (centers + 0.05 * rng.normal(size=(n, 2))).astype("float32")


"""
## The critic: Wasserstein loss plus the gradient penalty

The critic scores samples; it is trained to score real samples high and fake
ones low, E[f(fake)] − E[f(real)], while `interpolated_gradient_penalty` pulls
the norm of its input gradient towards 1 at random points between real and
fake samples. The penalty is differentiable again, so `fit` trains the
critic's weights through it on every backend.

The ε of each interpolation comes from a `keras.random.SeedGenerator` owned
by the model, so it is fresh at every step, also inside JAX's `jit`.

The interpolation follows the paper (Gulrajani et al., 2017, Algorithm 1):
x̂ = ε·real + (1 − ε)·fake with ε ~ U(0, 1), so ε weights the real sample.
keras-io's WGAN-GP example differs on both counts: it draws its α from
N(0, 1) and forms real + α·(fake − real), so α weights the fake sample and
about a third of its points lie outside the segment between the two. Code
ported from that example gives different penalties; this one matches the
paper's.
"""


def mlp(units, out, name):
    return keras.Sequential(
        [keras.layers.Dense(u, activation="relu") for u in units] + [keras.layers.Dense(out)], name=name
    )


class Critic(keras.Model):
    def __init__(self, penalty_weight=1.0):
        super().__init__()
        self.net = mlp([64, 64], 1, "critic_net")
        self.penalty_weight = penalty_weight
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, x):
        return self.net(x)[:, 0]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        real, fake = x, y
        wasserstein = ops.mean(self(fake)) - ops.mean(self(real))
        penalty = interpolated_gradient_penalty(self, real, fake, seed=self.seed_generator)
        return wasserstein + self.penalty_weight * penalty


"""
## The generator, trained through the frozen critic

`GeneratorTrainer` chains generator and critic and minimises −E[f(G(z))]. The
critic is a sublayer of it, frozen while the generator trains, so its current
weights flow into each step as non-trainable state.
"""


class GeneratorTrainer(keras.Model):
    def __init__(self, generator, critic):
        super().__init__()
        self.generator = generator
        self.critic = critic

    def call(self, z):
        return self.critic(self.generator(z))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return -ops.mean(y_pred)


generator = mlp([64, 64], 2, "generator")
critic = Critic()
trainer = GeneratorTrainer(generator, critic)
critic.compile(optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9))
trainer.compile(optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9))

"""
## Training: five critic steps per generator step
"""

rng = np.random.default_rng(0)
CRITIC_STEPS = 5
for round_ in range(ROUNDS):
    critic.trainable = True
    real = real_samples(BATCH * CRITIC_STEPS, rng)
    noise = rng.normal(size=(BATCH * CRITIC_STEPS, NOISE)).astype("float32")
    fake = ops.convert_to_numpy(generator.predict(noise, batch_size=BATCH, verbose=0))
    critic_logs = critic.fit(real, fake, batch_size=BATCH, epochs=1, verbose=0).history
    critic.trainable = False
    noise = rng.normal(size=(BATCH, NOISE)).astype("float32")
    trainer.fit(noise, batch_size=BATCH, epochs=1, verbose=0)
    if round_ % 100 == 0 or round_ == ROUNDS - 1:
        print(f"round {round_:4d}  critic loss {critic_logs['loss'][0]:8.4f}")

"""
## What the penalty did

After training, the critic's input gradient has norm close to 1 around the
data: `gradient_penalty(critic, x)` is the mean (‖∇f(x)‖ − 1)², computed with
the same code on every backend.
"""

probe = real_samples(512, rng)
print(f"mean (‖∇f‖ − 1)² on real samples: {float(ops.convert_to_numpy(gradient_penalty(critic, probe))):.4f}")
samples = ops.convert_to_numpy(generator.predict(rng.normal(size=(512, NOISE)).astype("float32"), verbose=0))
radius = np.linalg.norm(samples, axis=1)
print(f"generated samples: mean radius {radius.mean():.3f} (the ring has radius 2)")
