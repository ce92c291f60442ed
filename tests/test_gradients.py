"""keras_penalties.gradients on every backend: closed forms, seeds, and training through double backprop."""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import ops as P
from keras_penalties.gradients import gradient_penalty, input_gradient, interpolated_gradient_penalty
from tests.testing import central_difference, float64_scope, to_numpy

RNG = np.random.default_rng(0)
X = RNG.normal(size=(6, 3)).astype(np.float32)
W = np.array([0.3, -1.2, 2.0], np.float32)


def linear_critic(x):
    return ops.sum(ops.multiply(x, W), axis=-1) + 0.7


def half_squared_norm(x):
    return 0.5 * ops.sum(ops.square(x), axis=tuple(range(1, len(x.shape))))


def test_input_gradient_closed_forms():
    np.testing.assert_allclose(to_numpy(input_gradient(P.l1, X)), np.sign(X))
    np.testing.assert_allclose(to_numpy(input_gradient(lambda t: ops.sum(ops.square(t)), X)), 2 * X, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(input_gradient(linear_critic, X)), np.tile(W, (6, 1)), rtol=1e-6)
    norm = np.linalg.norm(to_numpy(input_gradient(P.l1, X)))
    np.testing.assert_allclose(norm, np.sqrt(X.size), rtol=1e-6)


def test_linear_critic_penalty_is_norm_of_w_minus_one_squared():
    expected = (np.linalg.norm(W.astype(np.float64)) - 1.0) ** 2
    np.testing.assert_allclose(to_numpy(gradient_penalty(linear_critic, X)), expected, rtol=1e-5)
    np.testing.assert_allclose(
        to_numpy(gradient_penalty(linear_critic, X, target=2.0, reduction="none")),
        np.full(6, (np.linalg.norm(W) - 2.0) ** 2),
        rtol=1e-5,
    )


def test_half_squared_norm_penalty_and_r1():
    x = RNG.normal(size=(5, 2, 3)).astype(np.float32)
    norms = np.linalg.norm(x.reshape(5, -1).astype(np.float64), axis=1)
    np.testing.assert_allclose(to_numpy(gradient_penalty(half_squared_norm, x)), np.mean((norms - 1) ** 2), rtol=1e-5)
    np.testing.assert_allclose(
        to_numpy(gradient_penalty(half_squared_norm, x, target=0.0)), np.mean(norms**2), rtol=1e-5
    )
    np.testing.assert_allclose(
        to_numpy(gradient_penalty(half_squared_norm, x, target=0.0, reduction="sum")), np.sum(norms**2), rtol=1e-5
    )


def test_zero_gradient_is_nan_free():
    # A constant critic has ∇ = 0 everywhere: the penalty is target², and the
    # gradient of the penalty (through the safe norm) is finite.
    x = ops.convert_to_tensor(X)
    constant = lambda t: ops.sum(t * 0.0, axis=-1)  # noqa: E731
    np.testing.assert_allclose(to_numpy(gradient_penalty(constant, x)), 1.0)
    outer = input_gradient(lambda t: gradient_penalty(constant, t), x)
    assert np.all(np.isfinite(to_numpy(outer)))


def test_penalty_of_a_kl_to_a_frozen_teacher_and_its_gradient():
    """Double backprop through KL(p‖softmax(x)) with p held constant, the
    path where torch forms the product in place in log p − log q: the
    gradient is softmax(x) − p a row, the penalty (‖softmax(x) − p‖ − 1)²
    on average, and its own gradient matches central differences of that
    closed form (float64)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 6)) * 2.0
    p = special.softmax(rng.normal(size=(4, 6)), axis=-1)

    def closed_form(x):
        return np.mean((np.linalg.norm(special.softmax(x, axis=-1) - p, axis=-1) - 1.0) ** 2)

    with float64_scope():
        teacher = ops.convert_to_tensor(p)
        kl = lambda t: P.kl_divergence(teacher, t, from_logits=False, reduction="none")  # noqa: E731
        critic = lambda t: kl(ops.softmax(t, axis=-1))  # noqa: E731
        penalty = lambda t: gradient_penalty(critic, t)  # noqa: E731
        np.testing.assert_allclose(to_numpy(penalty(ops.convert_to_tensor(x))), closed_form(x), rtol=1e-9)
        outer = to_numpy(input_gradient(penalty, ops.convert_to_tensor(x)))
    np.testing.assert_allclose(outer, central_difference(closed_form, x), rtol=1e-6, atol=1e-9)


def test_interpolated_penalty_is_reproducible_and_interpolates():
    real = RNG.normal(size=(8, 3)).astype(np.float32)
    fake = RNG.normal(size=(8, 3)).astype(np.float32)
    first = to_numpy(interpolated_gradient_penalty(half_squared_norm, real, fake, seed=42))
    second = to_numpy(interpolated_gradient_penalty(half_squared_norm, real, fake, seed=42))
    assert first == second
    # The same ε that keras.random draws for this seed gives the oracle.
    eps = to_numpy(keras.random.uniform((8, 1), seed=42)).astype(np.float64)
    mixed = eps * real + (1 - eps) * fake
    np.testing.assert_allclose(first, np.mean((np.linalg.norm(mixed, axis=1) - 1) ** 2), rtol=1e-5)
    # A SeedGenerator draws fresh ε each call, reproducibly from its seed.
    draws = [
        interpolated_gradient_penalty(half_squared_norm, real, fake, seed=keras.random.SeedGenerator(7))
        for _ in range(2)
    ]
    generator = keras.random.SeedGenerator(7)
    again = [interpolated_gradient_penalty(half_squared_norm, real, fake, seed=generator) for _ in range(2)]
    np.testing.assert_allclose(to_numpy(draws[0]), to_numpy(again[0]))
    assert to_numpy(again[0]) != to_numpy(again[1])


def test_interpolated_penalty_shape_error():
    with pytest.raises(ValueError, match=r"`real` and `fake` must have the same shape"):
        interpolated_gradient_penalty(half_squared_norm, X, X[:3])
    with pytest.raises(ValueError, match=r"`target` must be >= 0"):
        interpolated_gradient_penalty(half_squared_norm, X, X, target=-1.0)


class PenaltyOnlyCritic(keras.Model):
    """A linear critic trained on its gradient penalty alone: its optimum is ‖w‖ = 1."""

    def __init__(self):
        super().__init__()
        self.score = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(1.5))

    def call(self, x):
        return self.score(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return gradient_penalty(lambda t: self(t)[:, 0], x)


def test_training_on_the_penalty_drives_the_weight_norm_to_one():
    keras.utils.set_random_seed(0)
    critic = PenaltyOnlyCritic()
    critic.compile(optimizer=keras.optimizers.SGD(0.05))
    x = np.random.default_rng(1).normal(size=(64, 4)).astype(np.float32)
    critic.fit(x, epochs=20, batch_size=16, verbose=0)
    np.testing.assert_allclose(np.linalg.norm(to_numpy(critic.score.kernel)), 1.0, atol=1e-3)


class WGANCritic(keras.Model):
    """A WGAN-GP critic loss written once for every backend: E[f(fake)] − E[f(real)] + λ·GP."""

    def __init__(self, gp_weight):
        super().__init__()
        self.gp_weight = gp_weight
        self.score = keras.layers.Dense(1)
        self.seed_generator = keras.random.SeedGenerator(0)

    def call(self, x):
        return self.score(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        real, fake = x, y
        critic = lambda t: self(t)[:, 0]  # noqa: E731
        wasserstein = ops.mean(critic(fake)) - ops.mean(critic(real))
        penalty = interpolated_gradient_penalty(critic, real, fake, seed=self.seed_generator)
        return wasserstein + self.gp_weight * penalty


def test_wgan_gp_critic_converges_to_closed_form():
    # For a linear critic the gradient is w everywhere, so the loss is
    # −w·d + λ(‖w‖ − 1)² with d = mean(real) − mean(fake): minimised by w ∥ d,
    # ‖w‖ = 1 + ‖d‖/(2λ).
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    real = (rng.normal(size=(128, 2)) + [2.0, 1.0]).astype(np.float32)
    fake = rng.normal(size=(128, 2)).astype(np.float32)
    d = real.astype(np.float64).mean(0) - fake.astype(np.float64).mean(0)
    critic = WGANCritic(gp_weight=2.0)
    # Full batches and plain SGD: the loss is convex in w, so the iterates
    # contract geometrically to the optimum.
    critic.compile(optimizer=keras.optimizers.SGD(0.1))
    history = critic.fit(real, fake, epochs=200, batch_size=128, verbose=0).history["loss"]
    assert np.all(np.isfinite(history))
    w = to_numpy(critic.score.kernel)[:, 0].astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(w), 1 + np.linalg.norm(d) / 4.0, rtol=1e-4)
    np.testing.assert_allclose(w / np.linalg.norm(w), d / np.linalg.norm(d), atol=1e-4)
