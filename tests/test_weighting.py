"""Adaptive weighting: uncertainty weighting, DynamicWeightAverage,
GradNorm and live CompositeLoss weights, each against its formula on a
problem small enough to follow by hand (NumPy reimplements the training)."""

import warnings

import keras
import numpy as np
import pytest

from keras_penalties import CompositeObjective, Term
from keras_penalties.callbacks import DynamicWeightAverage, GradNorm, PenaltyMonitor
from keras_penalties.composite import weighting as rules
from keras_penalties.composite.weighting import FAMO, Uncertainty, Weighting
from keras_penalties.losses import CompositeLoss
from tests.testing import assert_finite, grad, save_and_load, to_numpy

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 3)).astype("float32")
Y = (RNG.normal(size=(8, 2)) * np.array([10.0, 0.1])).astype("float32")  # two scales
KERNEL = RNG.normal(size=(3, 2)).astype("float32")


def _terms_of(h):
    """The oracle's l2 and l1 values with the objective's default batch mean."""
    h = h.astype(np.float64)
    return np.array([np.sum(h**2) / len(h), np.sum(np.abs(h)) / len(h)])


def _uncertainty_steps(values_fn, steps, lr, momentum=0.0):
    """SGD (Keras' momentum form) on s from 0 for Σ ½·exp(−sᵢ)·Lᵢ + ½·sᵢ:
    ∂/∂sᵢ = ½ − ½·exp(−sᵢ)·Lᵢ."""
    s, velocity = np.zeros(2), np.zeros(2)
    for _ in range(steps):
        velocity = momentum * velocity - lr * (0.5 - 0.5 * np.exp(-s) * values_fn())
        s = s + velocity
    return s


# ---------------------------------------------------------------- uncertainty weighting


def test_uncertainty_total_and_report_follow_the_formula():
    objective = CompositeObjective({"a": "l2", "b": "l1"}, weighting="uncertainty")
    s = np.array([0.3, -0.5], "float32")
    objective.log_variances.assign(s)
    values = _terms_of(X)
    expected = np.sum(0.5 * np.exp(-s) * values + 0.5 * s)
    total, got = objective.compute(X)
    np.testing.assert_allclose(to_numpy(total), expected, rtol=1e-5)
    report = objective.report(X)
    np.testing.assert_allclose(report["regularizer_total"], expected, rtol=1e-5)
    for i, name in enumerate("ab"):
        np.testing.assert_allclose(report["regularizers"][name]["weight"], 0.5 * np.exp(-s[i]), rtol=1e-6)
        np.testing.assert_allclose(to_numpy(got[name]), values[i], rtol=1e-5)
    # A disabled term leaves both its parts out.
    objective.disable("b")
    np.testing.assert_allclose(
        to_numpy(objective.compute(X)[0]), 0.5 * np.exp(-s[0]) * values[0] + 0.5 * s[0], rtol=1e-5
    )


def _objective_model(weighting="uncertainty"):
    inputs = keras.Input((3,))
    h = CompositeObjective({"a": "l2", "b": "l1"}, weighting=weighting, name="obj")(inputs)
    out = keras.layers.Dense(1, kernel_initializer="zeros", trainable=False)(h)
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"], indirect=True)
def test_objective_log_variances_are_trained_by_the_optimizer(policy, tmp_path):
    model = _objective_model()
    monitor = PenaltyMonitor()
    history = model.fit(X, np.zeros((8, 1), "float32"), batch_size=8, epochs=3, verbose=0, callbacks=[monitor])
    objective = model.get_layer("obj")
    assert keras.backend.standardize_dtype(objective.log_variances.dtype) == "float32"
    expected = _uncertainty_steps(lambda: _terms_of(X), 3, 0.1)
    np.testing.assert_allclose(to_numpy(objective.log_variances), expected, rtol=1e-5, atol=1e-7)
    # The logged weight is ½·exp(−s), the one the next step uses.
    np.testing.assert_allclose(history.history["obj/a/weight"][-1], 0.5 * np.exp(-expected[0]), rtol=1e-5)
    loaded = save_and_load(model, tmp_path)
    np.testing.assert_allclose(to_numpy(loaded.get_layer("obj").log_variances), expected, rtol=1e-6)
    assert repr(loaded.get_layer("obj").weighting) == "Uncertainty(learning_rate_multiplier=1.0)"


def _frozen_head(kind="functional"):
    """A model whose output is X @ KERNEL (not trained), so the losses are known."""
    dense = keras.layers.Dense(2, use_bias=False, trainable=False)
    if kind == "sequential":
        model = keras.Sequential([keras.Input((3,)), dense])
    else:
        inputs = keras.Input((3,))
        model = keras.Model(inputs, dense(inputs))
    dense.kernel.assign(KERNEL)
    return model


def _losses(pred):
    pred, y = pred.astype(np.float64), Y.astype(np.float64)
    return np.array([np.mean((pred - y) ** 2), np.mean(np.abs(pred - y))])


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_composite_loss_log_variances_are_trained_without_passing_the_model(kind, tmp_path):
    model = _frozen_head(kind)
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()}, weighting="uncertainty"
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.5), loss=loss)
    history = model.fit(X, Y, batch_size=8, epochs=3, verbose=0)
    expected = _uncertainty_steps(lambda: _losses(X @ KERNEL), 3, 0.1, momentum=0.5)
    np.testing.assert_allclose(to_numpy(loss.log_variances), expected, rtol=1e-5)
    # The model's loss is the weighted total, offset included (first epoch: s = 0).
    np.testing.assert_allclose(history.history["loss"][0], 0.5 * _losses(X @ KERNEL).sum(), rtol=1e-5)
    assert len(model.layers) == 1 + (kind == "functional")  # the state is not a layer of the forward pass
    with warnings.catch_warnings():
        # Keras warns (and loads nothing) when the optimizer has fewer variables than saved.
        warnings.filterwarnings("error", message="Skipping variable loading")
        loaded = save_and_load(model, tmp_path)
    np.testing.assert_allclose(to_numpy(loaded.loss.log_variances), expected, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(loaded.predict(X, verbose=0)), X @ KERNEL, rtol=1e-5, atol=1e-6)
    # Training goes on from the saved s and momentum: two more steps.
    loaded.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    expected = _uncertainty_steps(lambda: _losses(X @ KERNEL), 5, 0.1, momentum=0.5)
    np.testing.assert_allclose(to_numpy(loaded.loss.log_variances), expected, rtol=1e-5)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"], indirect=True)
def test_the_multiplier_scales_the_log_variances_gradient_under_sgd(policy, tmp_path):
    """`weighting_learning_rate_multiplier` m scales ∂/∂sᵢ, so SGD
    (with momentum) moves s as at learning rate m·lr; the loss value is
    unchanged (first epoch: s = 0), and m saves with the model."""
    inputs = keras.Input((3,))
    h = CompositeObjective(
        {"a": "l2", "b": "l1"}, weighting="uncertainty", weighting_learning_rate_multiplier=4.0, name="obj"
    )(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros", trainable=False)(h))
    model.compile(keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    history = model.fit(X, np.zeros((8, 1), "float32"), batch_size=8, epochs=3, verbose=0)
    expected = _uncertainty_steps(lambda: _terms_of(X), 3, 0.05 * 4.0, momentum=0.5)
    np.testing.assert_allclose(to_numpy(model.get_layer("obj").log_variances), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(history.history["loss"][0], 0.5 * _terms_of(X).sum(), rtol=1e-5)
    loaded = save_and_load(model, tmp_path)
    assert loaded.get_layer("obj").weighting.learning_rate_multiplier == 4.0

    model = _frozen_head()
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
        weighting="uncertainty",
        weighting_learning_rate_multiplier=0.5,
    )
    model.compile(keras.optimizers.SGD(0.1), loss=loss)
    pred = to_numpy(model.predict(X, verbose=0))
    model.fit(X, Y, batch_size=8, epochs=3, verbose=0)
    expected = _uncertainty_steps(lambda: _losses(pred), 3, 0.1 * 0.5)
    np.testing.assert_allclose(
        to_numpy(loss.log_variances), expected, rtol=1e-3 if policy.startswith("mixed") else 1e-5
    )


@pytest.mark.parametrize("target", ["objective", "loss"])
def test_weight_decay_never_reaches_the_log_variances(target):
    """Under AdamW the sᵢ follow exactly what Adam gives them (Keras' own
    Adam, same learning rate). The objective reads the inputs, so its terms
    do not depend on the head, whose kernel AdamW does decay; the loss's
    head is frozen (its terms would follow a decayed head)."""

    def run(optimizer):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((3,))
        if target == "objective":
            h = CompositeObjective({"a": "l2", "b": "l1"}, weighting="uncertainty", name="obj")(inputs)
            model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
            model.compile(optimizer, loss="mse")
            composite = model.get_layer("obj")
        else:
            # A trainable layer beside the frozen head, adding 0: on torch
            # Keras' AdamW fails when it has no variable left to decay.
            side = keras.layers.Dense(2, name="side")(inputs)
            out = keras.layers.Dense(2, name="head", trainable=False)(inputs) + 0.0 * side
            model = keras.Model(inputs, out)
            composite = CompositeLoss(
                {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
                weighting="uncertainty",
            )
            model.compile(optimizer, loss=composite)
        model.fit(X, Y, batch_size=4, epochs=3, verbose=0)
        return to_numpy(composite.log_variances), to_numpy(model.get_layer("head").kernel)

    decayed_s, decayed_kernel = run(keras.optimizers.AdamW(0.05, weight_decay=0.5))
    plain_s, plain_kernel = run(keras.optimizers.Adam(0.05))
    assert np.abs(plain_s).min() > 0.05  # the sᵢ moved
    np.testing.assert_allclose(decayed_s, plain_s, rtol=1e-5, atol=1e-7)
    if target == "objective":
        assert np.abs(decayed_kernel - plain_kernel).max() > 1e-3  # the model's weights were decayed


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_composite_loss_log_variances_under_mixed_precision(policy):
    """The head computes in half precision; s and the weights stay float32,
    and s follows the formula on the half-precision predictions."""
    model = _frozen_head()
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()}, weighting="uncertainty"
    )
    model.compile(keras.optimizers.SGD(0.1), loss=loss)
    pred = to_numpy(model.predict(X, verbose=0))
    assert keras.backend.standardize_dtype(model.outputs[0].dtype) != "float32"
    model.fit(X, Y, batch_size=8, epochs=3, verbose=0)
    assert keras.backend.standardize_dtype(loss.log_variances.dtype) == "float32"
    expected = _uncertainty_steps(lambda: _losses(pred), 3, 0.1)
    # predict's and the training step's half-precision matmuls may round
    # differently (XLA fuses the two programs differently): 1e-4 seen in bf16.
    np.testing.assert_allclose(to_numpy(loss.log_variances), expected, rtol=1e-3)


# ---------------------------------------------------------------- FAMO


def _famo_oracle(losses_per_step, lr=0.025, gamma=0.01):
    """FAMO (Liu et al., 2023, Algorithm 1; the official code's torch Adam
    with L2 weight decay), transcribed: before each step after the first,
    ξ takes an Adam step on J_softmax(ξ)ᵀ(log Dₜ₋₁ − log Dₜ) + γξ; the
    step's weights are cᵢzᵢ/Dᵢ, c = 1/Σⱼ zⱼ/Dⱼ. Returns (weights per step, ξ)."""
    xi, m, v, t, previous, weights = np.zeros(2), np.zeros(2), np.zeros(2), 0, None, []
    for losses in losses_per_step:
        log_d = np.log(losses + 1e-8)
        if previous is not None:
            t += 1
            z = np.exp(xi) / np.exp(xi).sum()
            delta = previous - log_d
            g = z * delta - z * (z @ delta) + gamma * xi
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g**2
            xi = xi - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        previous = log_d
        z = np.exp(xi) / np.exp(xi).sum()
        weights.append((z / np.exp(log_d)) / (z / np.exp(log_d)).sum())
    return np.array(weights), xi


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"], indirect=True)
def test_famo_on_an_objective_follows_the_algorithm(policy, tmp_path):
    """The objective reads the inputs, whose batches (of 2) give known term
    values 100× apart in scale; the head outputs 0 for targets 0, so the
    loss is Σ wᵢ·Lᵢ alone."""
    inputs = keras.Input((3,))
    h = CompositeObjective({"a": "l2", "b": Term("l1", 0.01)}, weighting="famo", famo_learning_rate=0.2, name="obj")(
        inputs
    )
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False)(h))
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    xs = X * np.array([10.0, 10.0, 10.0], "float32")
    history = model.fit(
        xs, np.zeros((8, 1), "float32"), batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]
    )
    values = [_terms_of(xs[i : i + 2]) for i in range(0, 8, 2)] * 2
    weights, xi = _famo_oracle(values, lr=0.2)
    objective = model.get_layer("obj")
    np.testing.assert_allclose(to_numpy(objective.famo_logits), xi, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(list(objective.weights_in_use().values()), weights[-1], rtol=1e-4)
    # The model trains on Σ cᵢzᵢ·log Dᵢ, cᵢzᵢ = wᵢ·Dᵢ, with this step's
    # weights (the Term weights are FAMO's to set).
    log_d = np.log(np.array(values) + 1e-8)
    step_losses = np.sum(weights * np.exp(log_d) * log_d, axis=1)
    np.testing.assert_allclose(history.history["loss"], [step_losses[:4].mean(), step_losses[4:].mean()], rtol=1e-4)
    np.testing.assert_allclose(history.history["obj/a/weight"][-1], weights[-1][0], rtol=1e-4)
    assert abs(xi[0] - xi[1]) > 0.05  # the logits moved
    loaded = save_and_load(model, tmp_path)
    again = loaded.get_layer("obj")
    assert isinstance(again.weighting, FAMO) and again.weighting.get_config() == {"learning_rate": 0.2, "gamma": 0.01}
    np.testing.assert_allclose(to_numpy(again.famo_logits), xi, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(to_numpy(again.famo_steps), 8)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"], indirect=True)
def test_famo_on_a_composite_loss_follows_the_algorithm_and_evaluate_leaves_it(policy, tmp_path):
    model = _frozen_head()
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()}, weighting="famo"
    )
    model.compile(keras.optimizers.SGD(0.1), loss=loss)
    pred = to_numpy(model.predict(X, verbose=0))
    model.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    model.evaluate(X, Y, batch_size=4, verbose=0)  # no training step: FAMO's state stays
    values = []
    for _ in range(3):
        for i in (0, 4):
            p, y = pred[i : i + 4].astype(np.float64), Y[i : i + 4].astype(np.float64)
            values.append(np.array([np.mean((p - y) ** 2), np.mean(np.abs(p - y))]))
    weights, xi = _famo_oracle(values)
    rtol = 1e-2 if policy.startswith("mixed") else 1e-4
    np.testing.assert_allclose(to_numpy(loss.state.famo_logits), xi, rtol=rtol, atol=1e-5)
    np.testing.assert_allclose(to_numpy(loss.state.famo_steps), 6)
    np.testing.assert_allclose(list(loss.weights_in_use().values()), weights[-1], rtol=rtol)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        loaded = save_and_load(model, tmp_path)
    np.testing.assert_allclose(to_numpy(loaded.loss.state.famo_logits), to_numpy(loss.state.famo_logits))


def test_famo_on_a_composite_loss_steps_in_a_custom_loop_as_in_fit():
    """`compute(..., training=True)` once per step of a custom loop moves
    FAMO's state as `fit`'s training steps do (the oracle of the test above,
    on the same batches); `training=False` and calling the loss leave it."""
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()}, weighting="famo"
    )
    pred = to_numpy(_frozen_head()(X))
    values, totals = [], []
    for _ in range(3):
        for i in (0, 4):
            p, y = pred[i : i + 4], Y[i : i + 4]
            total, terms = loss.compute(y, p, training=True)
            loss.compute(y, p)  # an evaluation's call: nothing moves
            loss(y, p)
            totals.append(float(to_numpy(total)))
            assert sorted(terms) == ["mae", "mse"]
            p, y = p.astype(np.float64), y.astype(np.float64)
            values.append(np.array([np.mean((p - y) ** 2), np.mean(np.abs(p - y))]))
    weights, xi = _famo_oracle(values)
    np.testing.assert_allclose(to_numpy(loss.state.famo_logits), xi, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(to_numpy(loss.state.famo_steps), 6)
    np.testing.assert_allclose(list(loss.weights_in_use().values()), weights[-1], rtol=1e-4)
    # Each step's total is Σ cᵢzᵢ·log Dᵢ with that step's weights, cᵢzᵢ = wᵢ·Dᵢ.
    log_d = np.log(np.array(values) + 1e-8)
    np.testing.assert_allclose(totals, np.sum(weights * np.exp(log_d) * log_d, axis=1), rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="`training`"):
        loss.compute(Y, pred, training="yes")


def test_famo_gradient_is_the_effective_weights_times_each_loss_gradient():
    """∇ Σ cᵢzᵢ·log Dᵢ = Σ wᵢ·∇Lᵢ: against NumPy's gradients of mse and mae
    at the first step (z uniform, wᵢ = (1/Dᵢ)/Σⱼ 1/Dⱼ)."""
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()}, weighting="famo"
    )
    y = Y[:4].astype(np.float64)
    pred = (X[:4] @ KERNEL).astype(np.float64) + 0.3
    gradient = to_numpy(grad(lambda p: loss(Y[:4], p), pred.astype("float32")))
    d = np.array([np.mean((pred - y) ** 2), np.mean(np.abs(pred - y))])
    w = (1 / d) / np.sum(1 / d)
    expected = w[0] * 2 * (pred - y) / pred.size + w[1] * np.sign(pred - y) / pred.size
    np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-7)
    value = to_numpy(loss(Y[:4], pred.astype("float32")))
    np.testing.assert_allclose(value, np.sum(w * d * np.log(d + 1e-8)), rtol=1e-5)


def test_famo_on_an_empty_batch_is_finite_and_near_zero():
    """Every Dᵢ = 0: the weights are equal, c = 1/Σⱼ zⱼ/(Dⱼ + ε) = ε, and
    the value Σ c·zᵢ·log(Dᵢ + ε) = ε·ln ε ≈ −1.8e-7 (the formula at
    L = 0, not exactly 0), with a finite gradient."""
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()}, weighting="famo"
    )
    empty = np.zeros((0, 2), "float32")
    value = to_numpy(loss(empty, empty))
    np.testing.assert_allclose(value, 1e-8 * np.log(1e-8), rtol=1e-3)
    gradient = grad(lambda p: loss(empty, p), empty)
    assert gradient.shape == (0, 2)
    assert_finite(gradient, "famo on an empty batch")


def test_famo_errors_name_the_argument():
    with pytest.raises(ValueError, match="`famo_learning_rate`"):
        CompositeObjective({"a": "l2"}, weighting="famo", famo_learning_rate=0.0)
    with pytest.raises(ValueError, match="`famo_gamma`"):
        CompositeLoss({"a": keras.losses.MeanSquaredError()}, weighting="famo", famo_gamma=-1.0)
    with pytest.raises(ValueError, match="`famo_gamma` applies with weighting='famo'"):
        CompositeObjective({"a": "l2"}, weighting="uncertainty", famo_gamma=0.1)
    objective = CompositeObjective({"a": "l2"}, weighting="famo")
    with pytest.raises(ValueError, match="learns its weights"):
        objective.set_weight("a", 2.0)


# ---------------------------------------------------------------- live CompositeLoss weights


class _SetAt(keras.callbacks.Callback):
    """At the start of batch `at`: sets the loss's weights, and records which
    traced step ran before and after."""

    def __init__(self, at, change):
        super().__init__()
        self.at, self.change, self.functions = at, change, []

    def on_train_batch_begin(self, batch, logs=None):
        self.model  # noqa: B018 -- syncs JAX state before the variables change
        if batch == self.at:
            self.change(self.model.loss)
        self.functions.append(self.model.train_function)


def test_composite_loss_weights_change_during_fit_without_retracing():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, use_bias=False, kernel_initializer="ones")(inputs))
    loss = CompositeLoss({"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()})
    model.compile(keras.optimizers.SGD(0.05), loss=loss)

    def change(loss):
        loss.set_weight("mse", 0.25)
        loss.disable("mae")

    setter = _SetAt(2, change)
    model.fit(X, Y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[setter])
    assert all(f is setter.functions[0] for f in setter.functions)
    # SGD on the linear model by hand: ∂mse/∂W = 2·xᵀ(p − y)/(B·2), ∂mae/∂W = xᵀsign(p − y)/(B·2).
    w = np.ones((3, 2))
    for batch in range(4):
        x, y = X[2 * batch : 2 * batch + 2].astype(np.float64), Y[2 * batch : 2 * batch + 2].astype(np.float64)
        p = x @ w
        grad_mse, grad_mae = 2 * x.T @ (p - y) / p.size, x.T @ np.sign(p - y) / p.size
        w = w - 0.05 * ((grad_mse + grad_mae) if batch < 2 else 0.25 * grad_mse)
    np.testing.assert_allclose(to_numpy(model.layers[-1].kernel), w, rtol=1e-5)
    assert loss.get_config()["terms"]["mae"]["config"]["enabled"] is False


# ---------------------------------------------------------------- Dynamic Weight Average


def _trainable_model(loss):
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="shared")(inputs)
    h = CompositeObjective({"a": "l2", "b": "l1"}, name="obj")(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    model.compile(keras.optimizers.SGD(0.02), loss=loss)
    return model


def _scheduled_model():
    """`_trainable_model("mse")` whose term a is weighted by a schedule, 3·0.5^step:
    the model, its objective and the schedule."""
    schedule = keras.optimizers.schedules.ExponentialDecay(3.0, decay_steps=1, decay_rate=0.5)
    inputs = keras.Input((3,))
    objective = CompositeObjective({"a": Term("l2", weight=schedule), "b": "l1"}, name="obj")
    model = keras.Model(inputs, keras.layers.Dense(2)(objective(keras.layers.Dense(4, name="shared")(inputs))))
    model.compile(keras.optimizers.SGD(0.02), loss="mse")
    return model, objective, schedule


def _dwa_oracle(means, temperature):
    """Weights per epoch: 1 for epochs 0 and 1, then K·softmax(r/T), r = L(e−1)/L(e−2)."""
    means = np.asarray(means, np.float64)
    weights = [np.ones(means.shape[1]), np.ones(means.shape[1])]
    for e in range(2, len(means)):
        r = means[e - 1] / means[e - 2] / temperature
        weights.append(len(r) * np.exp(r) / np.exp(r).sum())
    return np.array(weights)


def test_dynamic_weight_average_on_a_composite_loss():
    keras.utils.set_random_seed(0)
    loss = CompositeLoss({"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()})
    model = _trainable_model(loss)
    dwa = DynamicWeightAverage("composite_loss", temperature=0.5)
    # Validation resets the loss's metric before the epoch ends: the weights
    # follow the training means all the same.
    logs = model.fit(X, Y, batch_size=4, epochs=5, verbose=0, validation_data=(2 * X, -Y), callbacks=[dwa]).history
    assert not np.allclose(logs["val_composite_loss/mse"], logs["composite_loss/mse"], rtol=0.1)
    means = np.stack([logs["composite_loss/mse"], logs["composite_loss/mae"]], axis=1)
    weights = np.stack([logs["composite_loss/mse/weight"], logs["composite_loss/mae/weight"]], axis=1)
    np.testing.assert_allclose(weights, _dwa_oracle(means, 0.5), rtol=1e-5)
    assert not np.allclose(weights[-1], 1.0)
    # The weights were the ones trained with: the model's loss, less the
    # objective's terms, is Σ wᵢ·L̄ᵢ in each epoch.
    keras.utils.set_random_seed(0)
    model = _trainable_model(
        CompositeLoss({"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()})
    )
    logs = model.fit(
        X, Y, batch_size=4, epochs=4, verbose=0, callbacks=[DynamicWeightAverage("composite_loss"), PenaltyMonitor()]
    ).history
    means = np.stack([logs["composite_loss/mse"], logs["composite_loss/mae"]], axis=1)
    weights = np.stack([logs["composite_loss/mse/weight"], logs["composite_loss/mae/weight"]], axis=1)
    np.testing.assert_allclose(
        np.asarray(logs["loss"]) - np.asarray(logs["obj/a"]) - np.asarray(logs["obj/b"]),
        np.sum(weights * means, axis=1),
        rtol=1e-4,
    )


def test_dynamic_weight_average_on_an_objective():
    keras.utils.set_random_seed(1)
    model = _trainable_model("mse")
    logs = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=4,
        verbose=0,
        validation_data=(2 * X, -Y),
        callbacks=[PenaltyMonitor(), DynamicWeightAverage("obj")],
    ).history
    means = np.stack([logs["obj/a"], logs["obj/b"]], axis=1)
    weights = np.stack([logs["obj/a/weight"], logs["obj/b/weight"]], axis=1)
    np.testing.assert_allclose(weights, _dwa_oracle(means, 2.0), rtol=1e-5)
    # After the last epoch it set the weights of the next one.
    r = means[-1] / means[-2] / 2.0
    np.testing.assert_allclose(
        list(model.get_layer("obj").weights_in_use().values()), 2 * np.exp(r) / np.exp(r).sum(), rtol=1e-5
    )


def test_dynamic_weight_average_replaces_a_scheduled_weight():
    # The adaptive callbacks set every weight at once: a schedule is replaced
    # as set_weight replaces it, and the step uses the set numbers.
    keras.utils.set_random_seed(1)
    model, objective, _ = _scheduled_model()
    logs = model.fit(X, Y, batch_size=4, epochs=4, verbose=0, callbacks=[PenaltyMonitor(), DynamicWeightAverage("obj")])
    means = np.stack([logs.history["obj/a"], logs.history["obj/b"]], axis=1)
    weights = np.stack([logs.history["obj/a/weight"], logs.history["obj/b/weight"]], axis=1)
    np.testing.assert_allclose(weights, _dwa_oracle(means, 2.0), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(objective.effective_weights()), list(objective.weights_in_use().values()))
    with pytest.raises(ValueError, match="`weights`: expected 2 finite numbers >= 0"):
        objective.set_term_weights([1.0, -1.0])
    with pytest.raises(ValueError, match="`weights` must name every term"):
        objective.set_term_weights({"a": 1.0})


# ---------------------------------------------------------------- GradNorm


class _SharedAtBatchEnd(keras.callbacks.Callback):
    """The shared layer's kernel and bias after each batch (listed before GradNorm)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        layer = self.model.get_layer("shared")
        self.weights.append([to_numpy(v).astype(np.float64) for v in (layer.kernel, layer.bias)])


class _NumpyAdam:
    """Adam (Kingma & Ba, 2015) with Keras' defaults: β₁ 0.9, β₂ 0.999, ε 1e-7
    added to √v̂ in Keras' form (the bias corrections folded into the step)."""

    def __init__(self, lr):
        self.lr, self.m, self.v, self.t = lr, 0.0, 0.0, 0

    def step(self, w, g):
        self.t += 1
        self.m = 0.9 * self.m + 0.1 * g
        self.v = 0.999 * self.v + 0.001 * g**2
        alpha = self.lr * np.sqrt(1 - 0.999**self.t) / (1 - 0.9**self.t)
        return w - alpha * self.m / (np.sqrt(self.v) + 1e-7)


class _NumpySGD:
    def __init__(self, lr):
        self.lr = lr

    def step(self, w, g):
        return w - self.lr * g


def _gradnorm_oracle(history, alpha, optimizer, start=(1.0, 1.0)):
    """The weights after each probe, from the probes' values and norms (as
    GradNorm documents): one optimizer step on sign(Gᵢ − Ḡ·rᵢ^α)·gᵢ, clip at 0, sum to K;
    `start`: the weights in use at the first probe."""
    w, initial, out = np.array(start, np.float64), None, []
    for entry in history:
        values = np.array(list(entry["values"].values()))
        norms = np.array(list(entry["grad_norms"].values()))
        initial = values if initial is None else initial
        ratio = values / initial
        r = ratio / ratio.mean()
        big_g = w * norms
        w = np.clip(optimizer.step(w, np.sign(big_g - big_g.mean() * r**alpha) * norms), 0.0, None)
        w = 2 * w / w.sum()
        out.append(w)
    return np.array(out)


@pytest.mark.parametrize(
    "make, oracle",
    [
        (lambda: None, lambda: _NumpyAdam(0.025)),  # the default: Adam(0.025)
        (lambda: keras.optimizers.Adam(0.1), lambda: _NumpyAdam(0.1)),
        (lambda: keras.optimizers.SGD(0.1), lambda: _NumpySGD(0.1)),
    ],
    ids=["default", "adam", "sgd"],
)
def test_gradnorm_norms_and_updates_follow_the_formula(make, oracle):
    keras.utils.set_random_seed(2)
    model = _trainable_model("mse")
    xp, yp = X[:4].astype(np.float64), Y[:4]
    recorder = _SharedAtBatchEnd()
    gradnorm = GradNorm("obj", "shared", alpha=1.5, optimizer=make(), probe_data=(X[:4], yp))
    logs = model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[recorder, gradnorm]).history
    assert len(gradnorm.history) == 4
    for (kernel, bias), entry in zip(recorder.weights, gradnorm.history):
        # h = x·W + b; l2 = Σh²/B and l1 = Σ|h|/B, differentiated by hand
        # with respect to both of the shared layer's weights.
        h = xp @ kernel + bias
        n = len(h)
        values = [np.sum(h**2) / n, np.sum(np.abs(h)) / n]
        norms = [
            np.sqrt(np.sum((2 * xp.T @ h / n) ** 2) + np.sum((2 * h.sum(0) / n) ** 2)),
            np.sqrt(np.sum((xp.T @ np.sign(h) / n) ** 2) + np.sum((np.sign(h).sum(0) / n) ** 2)),
        ]
        np.testing.assert_allclose(list(entry["values"].values()), values, rtol=1e-5)
        np.testing.assert_allclose(list(entry["grad_norms"].values()), norms, rtol=1e-5)
    expected = _gradnorm_oracle(gradnorm.history, 1.5, oracle())
    np.testing.assert_allclose([list(e["weights"].values()) for e in gradnorm.history], expected, rtol=1e-5)
    assert not np.allclose(expected[-1], 1.0)
    # Logged per epoch: the weight in use after the epoch's last probe.
    np.testing.assert_allclose([logs["obj/a/weight"], logs["obj/b/weight"]], expected[[1, 3]].T, rtol=1e-5)
    np.testing.assert_allclose(list(model.get_layer("obj").weights_in_use().values()), expected[-1], rtol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_gradnorm_steps_float32_weights_under_a_mixed_policy(policy):
    # GradNorm's variables are made on the host thread, which has no dtype
    # policy (under float32 they are made in the caller's, tested above): they
    # are float32, and the weights and the batch logs still follow the formula.
    keras.utils.set_random_seed(2)
    model = _trainable_model("mse")
    gradnorm = GradNorm("obj", "shared", probe_data=(X[:4], Y[:4]))
    batch_logs = []
    logger = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[gradnorm, logger])
    expected = _gradnorm_oracle(gradnorm.history, 1.5, _NumpyAdam(0.025))
    np.testing.assert_allclose([list(e["weights"].values()) for e in gradnorm.history], expected, rtol=1e-5)
    assert not np.allclose(expected[-1], 1.0)
    logged = [[logs["obj/a/weight"], logs["obj/b/weight"]] for logs in batch_logs]
    np.testing.assert_allclose(logged, expected, rtol=1e-6)
    np.testing.assert_allclose(list(model.get_layer("obj").weights_in_use().values()), expected[-1], rtol=1e-6)
    assert {keras.backend.standardize_dtype(v.dtype) for v in gradnorm._state} == {"float32"}


def test_gradnorm_starts_from_a_scheduled_weight_and_replaces_it():
    # The first probe (after one training step) steps from the schedule's
    # value at step 1, 3·0.5¹; from then on the weights are GradNorm's, in
    # the variables the step reads as in the Terms.
    keras.utils.set_random_seed(2)
    model, objective, schedule = _scheduled_model()
    gradnorm = GradNorm("obj", "shared", probe_data=(X[:4], Y[:4]))
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[gradnorm])
    expected = _gradnorm_oracle(gradnorm.history, 1.5, _NumpyAdam(0.025), start=(1.5, 1.0))
    np.testing.assert_allclose([list(e["weights"].values()) for e in gradnorm.history], expected, rtol=1e-5)
    np.testing.assert_allclose(list(objective.weights_in_use().values()), expected[-1], rtol=1e-6)
    np.testing.assert_allclose(to_numpy(objective.effective_weights()), expected[-1], rtol=1e-6)
    np.testing.assert_allclose([t.weight for t in objective.terms.values()], expected[-1], rtol=1e-6)


@pytest.mark.parametrize("case", ["overflow", "nan"])
def test_gradnorm_raises_on_weights_that_are_not_finite_and_leaves_them_as_they_were(case):
    # "overflow": a step so large that both weights overflow to ±inf;
    # "nan": an infinite probe batch, whose term values and gradient norms
    # are not finite (before, such a step silently reset the weights to 1).
    # Term a's schedule stays a schedule: after one training step, 3·0.5¹.
    keras.utils.set_random_seed(2)
    model, objective, schedule = _scheduled_model()
    if case == "overflow":
        gradnorm = GradNorm("obj", "shared", optimizer=keras.optimizers.SGD(3e38), probe_data=X[:4])
    else:
        gradnorm = GradNorm("obj", "shared", probe_data=np.full((4, 3), np.inf, "float32"))
    with pytest.raises(ValueError, match="GradNorm's new weights for 'obj' are not finite"):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[gradnorm])
    assert objective.weights_in_use() == {"a": 1.5, "b": 1.0}
    assert objective.terms["a"].weight is schedule and objective.terms["b"].weight == 1.0
    assert gradnorm.history == []


def test_gradnorm_steps_afresh_after_a_failed_step_once_the_model_is_restored():
    # The model diverges (a kernel of inf), so the probe's values and norms
    # are not finite and the step fails; Adam's moments took the NaN step.
    # After a checkpoint is restored, the same callback trains on: its
    # optimizer starts afresh (kept, the NaN moments failed every step).
    keras.utils.set_random_seed(2)
    model = _trainable_model("mse")
    checkpoint = model.get_weights()
    gradnorm = GradNorm("obj", "shared", probe_data=(X[:4], Y[:4]))
    kernel = model.get_layer("shared").kernel
    kernel.assign(np.full(kernel.shape, np.inf, "float32"))
    with pytest.raises(ValueError, match="GradNorm's new weights for 'obj' are not finite"):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[gradnorm])
    model.set_weights(checkpoint)
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[gradnorm])
    expected = _gradnorm_oracle(gradnorm.history, 1.5, _NumpyAdam(0.025))
    np.testing.assert_allclose([list(e["weights"].values()) for e in gradnorm.history], expected, rtol=1e-5)
    assert len(gradnorm.history) == 4 and not np.allclose(expected[-1], 1.0)


def test_gradnorm_alpha_set_after_a_probe_takes_effect_at_the_next():
    keras.utils.set_random_seed(2)
    model = _trainable_model("mse")
    gradnorm = GradNorm("obj", "shared", alpha=1.5, optimizer=keras.optimizers.SGD(0.1), probe_data=X[:4])
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[gradnorm])  # two probes at α = 1.5
    gradnorm.alpha = 12.0
    model.fit(X, Y, batch_size=4, epochs=3, verbose=0, callbacks=[gradnorm])  # a new fit: a new Lᵢ(0)
    with pytest.raises(ValueError, match="`alpha`"):
        gradnorm.alpha = -1.0
    first = _gradnorm_oracle(gradnorm.history[:2], 1.5, _NumpySGD(0.1))
    second = _gradnorm_oracle(gradnorm.history[2:], 12.0, _NumpySGD(0.1), start=first[-1])
    got = [list(e["weights"].values()) for e in gradnorm.history]
    np.testing.assert_allclose(got, np.concatenate([first, second]), rtol=1e-5)
    # α = 12 pulls the slower term up far harder: the oracle at α = 1.5 differs.
    assert not np.allclose(second, _gradnorm_oracle(gradnorm.history[2:], 1.5, _NumpySGD(0.1), start=first[-1]))


def test_gradnorm_moves_a_term_with_small_gradients_as_fast_as_one_with_large_ones():
    """Adam's normalisation removes the scale of gᵢ: with norms
    about 10⁶ apart, the first probe moves both weights by the learning rate
    (the larger norm down, the smaller up: rᵢ = 1, so the goal is Ḡ), where
    a signed step of lr·gᵢ would leave the small one where it was."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(2, name="shared")(inputs)
    big, _ = CompositeObjective({"big": Term("l2", inputs=0), "small": Term("l2", inputs=1)}, name="obj")(
        [h * 30.0, h * 0.03]
    )
    model = keras.Model(inputs, big)
    model.compile(keras.optimizers.SGD(1e-6), "mse")
    gradnorm = GradNorm("obj", "shared", probe_data=X[:4])
    model.fit(X[:4], Y[:4], batch_size=4, epochs=1, verbose=0, callbacks=[gradnorm])
    norms = list(gradnorm.history[0]["grad_norms"].values())
    assert norms[0] > 1e5 * norms[1]
    got = np.array(list(gradnorm.history[0]["weights"].values()))
    g = np.array(norms)
    raw = _NumpyAdam(0.025).step(np.ones(2), np.sign(g - g.mean()) * g)
    np.testing.assert_allclose(got, 2 * raw / raw.sum(), rtol=1e-6)
    np.testing.assert_allclose(got, [0.975, 1.025], rtol=1e-4)  # both moved by about the learning rate


def test_gradnorm_on_a_composite_loss_leaves_training_as_it_would_be_with_those_weights():
    """The probe changes nothing but the weights: training with GradNorm at
    a learning rate → 0 is training without it."""

    def run(callbacks):
        keras.utils.set_random_seed(3)
        model = _trainable_model(
            CompositeLoss({"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()})
        )
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return [to_numpy(v) for v in model.trainable_variables]

    gradnorm = GradNorm("composite_loss", "shared", optimizer=keras.optimizers.SGD(1e-12), probe_data=(X[:4], Y[:4]))
    for a, b in zip(run([gradnorm]), run([])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len(gradnorm.history) == 4 and all(
        np.isfinite(list(e["grad_norms"].values())).all() for e in gradnorm.history
    )


# ---------------------------------------------------------------- errors and serialization


def test_weighting_errors_name_the_argument():
    with pytest.raises(ValueError, match="`weighting`"):
        CompositeObjective({"a": "l2"}, weighting="softmax")
    with pytest.raises(TypeError, match="`weighting`"):
        CompositeLoss({"a": keras.losses.MeanSquaredError()}, weighting=1)
    with pytest.raises(ValueError, match="`weighting_learning_rate_multiplier`"):
        CompositeObjective({"a": "l2"}, weighting="uncertainty", weighting_learning_rate_multiplier=0.0)
    with pytest.raises(TypeError, match="`weighting_learning_rate_multiplier`"):
        CompositeLoss(
            {"a": keras.losses.MeanSquaredError()}, weighting="uncertainty", weighting_learning_rate_multiplier="fast"
        )
    with pytest.raises(ValueError, match="applies with weighting='uncertainty'"):
        CompositeObjective({"a": "l2"}, weighting_learning_rate_multiplier=2.0)
    objective = CompositeObjective({"a": "l2"}, weighting="uncertainty")
    with pytest.raises(ValueError, match="learns its weights"):
        objective.set_weight("a", 2.0)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: DynamicWeightAverage(3), TypeError, "`target`"),
        (lambda: DynamicWeightAverage("obj", temperature=0.0), ValueError, "`temperature`"),
        (lambda: GradNorm("obj", "shared", alpha=-1.0, probe_data=X), ValueError, "`alpha`"),
        (lambda: GradNorm("obj", "shared", optimizer=0.1, probe_data=X), TypeError, "`optimizer`"),
        (lambda: GradNorm("obj", "shared", optimizer=keras.optimizers.Adam, probe_data=X), TypeError, "`optimizer`"),
        (lambda: GradNorm("obj", "shared", optimizer="no_such_optimizer", probe_data=X), ValueError, "`optimizer`"),
        (lambda: GradNorm("obj", "shared", learning_rate=0.1, probe_data=X), TypeError, "learning_rate"),
        (lambda: GradNorm("obj", "shared", probe_data=None), TypeError, "`probe_data`"),
        (lambda: GradNorm("obj", 3, probe_data=X), TypeError, "`layer`"),
        (lambda: GradNorm("obj", "shared", probe_data=X, every_n_batches=0), ValueError, "`every_n_batches`"),
    ],
)
def test_callback_argument_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DynamicWeightAverage("missing"), "`target` 'missing'"),
        (lambda: GradNorm("missing", "shared", probe_data=X), "`target` 'missing'"),
        (lambda: GradNorm("obj", "nowhere", probe_data=X), "`layer` 'nowhere'"),
        (lambda: GradNorm("obj", "obj", probe_data=X), "no trainable weights"),
        (lambda: GradNorm("composite_loss", "shared", probe_data=X), "`probe_data` must be"),
    ],
)
def test_callbacks_check_the_model(make, match):
    model = _trainable_model(CompositeLoss({"mse": keras.losses.MeanSquaredError()}))
    with pytest.raises(ValueError, match=match):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[make()])


def test_adaptive_methods_refuse_learned_weights():
    inputs = keras.Input((3,))
    h = CompositeObjective({"a": "l2", "b": "l1"}, weighting="uncertainty", name="obj")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="shared")(h))
    model.compile("sgd", "mse")
    for callback in (DynamicWeightAverage("obj"), GradNorm("obj", "shared", probe_data=X)):
        with pytest.raises(ValueError, match=r"weighting=Uncertainty\(learning_rate_multiplier=1.0\), which learns"):
            model.fit(X, Y, epochs=1, verbose=0, callbacks=[callback])


def test_weighting_as_a_rule_object_is_the_named_rule():
    by_object = CompositeObjective({"a": "l2", "b": "l1"}, weighting=FAMO(learning_rate=0.2, gamma=0.0))
    by_name = CompositeObjective({"a": "l2", "b": "l1"}, weighting="famo", famo_learning_rate=0.2, famo_gamma=0.0)
    assert by_object.get_config() == {**by_name.get_config(), "name": by_object.name}
    assert by_name.weighting.get_config() == {"learning_rate": 0.2, "gamma": 0.0}
    assert by_object.built and by_name.built  # built with its state, as Keras builds a layer without weights to shape
    with pytest.raises(ValueError, match="`learning_rate`"):
        FAMO(learning_rate=-1.0)
    with pytest.raises(ValueError, match="`learning_rate_multiplier`"):
        Uncertainty(0.0)
    with pytest.raises(ValueError, match="takes its options itself, not `weighting_learning_rate_multiplier`"):
        CompositeLoss({"l2": "l2"}, weighting=Uncertainty(2.0), weighting_learning_rate_multiplier=3.0)


def test_weighting_survives_config_round_trips():
    objective = CompositeObjective({"a": "l2", "b": Term("l1", 0.5)}, weighting="uncertainty")
    again = CompositeObjective.from_config(objective.get_config())
    assert isinstance(again.weighting, Uncertainty) and again.log_variances.shape == (2,)
    loss = CompositeLoss(
        {"mse": keras.losses.MeanSquaredError()}, weighting="uncertainty", weighting_learning_rate_multiplier=3.0
    )
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert isinstance(again.weighting, Uncertainty) and again.log_variances.shape == (1,)
    assert again.weighting.learning_rate_multiplier == 3.0
    fixed = CompositeLoss({"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()})
    fixed.set_weight("mae", 0.3)
    again = CompositeLoss.from_config(fixed.get_config())
    np.testing.assert_allclose(list(again.weights_in_use().values()), [1.0, 0.3], rtol=1e-6)


# ---------------------------------------------------------------- the rules as Keras objects


@pytest.mark.parametrize(
    "identifier, expected",
    [
        (None, "Fixed()"),
        ("fixed", "Fixed()"),
        ("FAMO", "FAMO(learning_rate=0.025, gamma=0.01)"),
        (Weighting(), "Weighting()"),
        ("uncertainty", "Uncertainty(learning_rate_multiplier=1.0)"),
        ("famo", "FAMO(learning_rate=0.025, gamma=0.01)"),
        ({"class_name": "famo", "config": {"learning_rate": 0.5}}, "FAMO(learning_rate=0.5, gamma=0.01)"),
        (
            {"class_name": "Uncertainty", "config": {"learning_rate_multiplier": 2.0}},
            "Uncertainty(learning_rate_multiplier=2.0)",
        ),
        (keras.saving.serialize_keras_object(FAMO(0.1, 0.0)), "FAMO(learning_rate=0.1, gamma=0.0)"),
    ],
)
def test_get_takes_a_name_a_config_or_a_rule(identifier, expected):
    rule = rules.get(identifier)
    assert repr(rule) == expected
    assert rules.get(rule) is rule
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(rule))
    assert type(again) is type(rule) and again.get_config() == rule.get_config()


def test_get_names_what_it_refuses():
    with pytest.raises(ValueError, match="`weighting` must be one of 'fixed', 'uncertainty', 'famo'; got 'famo2'"):
        rules.get("famo2")
    with pytest.raises(TypeError, match="`weighting` must be a Weighting rule"):
        rules.get(0.5)
    with pytest.raises(TypeError, match="`weighting` config could not be read as a Weighting rule"):
        rules.get({"class_name": "Softmaxed", "config": {}})
    with pytest.raises(TypeError, match="`weighting` config could not be read as a Weighting rule"):
        rules.get({"class_name": "famo", "config": {"rate": 0.1}})
    with pytest.raises(TypeError, match="`weighting` config describes MeanSquaredError"):
        rules.get(keras.saving.serialize_keras_object(keras.losses.MeanSquaredError()))
    with pytest.raises(ValueError, match="`gamma`"):
        FAMO(gamma=-0.1)
    with pytest.raises(TypeError, match="unexpected keyword arguments: famo_rate"):
        CompositeLoss({"a": keras.losses.MeanSquaredError()}, famo_rate=0.1)


def test_the_base_rule_saves_and_reloads_as_the_fixed_rule(tmp_path):
    inputs = keras.Input((3,))
    h = CompositeObjective({"a": "l2", "b": Term("l1", 0.5)}, weighting=Weighting(), name="obj")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
    model.compile("sgd", "mse")
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    again = save_and_load(model, tmp_path).get_layer("obj")
    assert type(again.weighting) is Weighting and again.weights_in_use() == {"a": 1.0, "b": 0.5}


def test_flat_options_of_a_release_config_are_read_by_their_rule():
    # 0.1.0 saved the rule's name and all three flat options, at their
    # defaults beside the other rules.
    flat = {"weighting_learning_rate_multiplier": 1.0, "famo_learning_rate": 0.025, "famo_gamma": 0.01}
    config = CompositeObjective({"a": "l2"}, name="obj").get_config()
    for name, options, expected in [
        (None, {}, "Fixed()"),
        ("uncertainty", {"weighting_learning_rate_multiplier": 3.0}, "Uncertainty(learning_rate_multiplier=3.0)"),
        ("famo", {"famo_gamma": 0.0}, "FAMO(learning_rate=0.025, gamma=0.0)"),
    ]:
        again = CompositeObjective.from_config({**config, "weighting": name, **flat, **options})
        assert repr(again.weighting) == expected
    assert "famo_gamma" not in config and config["weighting"]["class_name"] == "Fixed"


@keras.saving.register_keras_serializable(package="tests")
class Annealed(Weighting):
    """The terms' own weights times decay^t, t the training steps taken: a
    rule with a variable that advances at each training step."""

    steps_in_training = True

    def __init__(self, decay=0.5):
        self.decay = float(decay)

    def get_config(self):
        return {"decay": self.decay}

    def make_variables(self, owner, count):
        self.add_variable(owner, "annealed_steps", 0.0)

    def weights(self, owner, set_weights):
        return set_weights() * keras.ops.power(self.decay, owner.annealed_steps.value)

    def total(self, owner, values, weights, enabled, update, model):
        if update:
            owner.annealed_steps.assign(owner.annealed_steps.value + 1.0)
        return super().total(owner, values, weights, enabled, update, model)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("target", ["objective", "loss"])
def test_a_rule_of_ones_own_trains_saves_and_reloads(target, policy, tmp_path):
    # Four training steps of a frozen head: the terms' values are known, and
    # step t's total weighs them by w·0.5^t (the weights before its update).
    if target == "objective":
        inputs = keras.Input((3,))
        h = CompositeObjective({"a": "l2", "b": Term("l1", 2.0)}, weighting=Annealed(0.5), name="obj")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, trainable=False, name="head")(h))
        model.compile("sgd", loss="mse")
        composite = model.get_layer("obj")
    else:
        model = _frozen_head()
        composite = CompositeLoss(
            {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
            weights={"mse": 1.0, "mae": 2.0},
            weighting={"class_name": "Annealed", "config": {"decay": 0.5}, "registered_name": "tests>Annealed"},
        )
        model.compile("sgd", loss=composite)
    y = np.zeros((8, 1), "float32")
    history = model.fit(X, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert float(to_numpy(composite._state_layer().annealed_steps)) == 4.0
    assert keras.backend.standardize_dtype(composite._state_layer().annealed_steps.dtype) == "float32"
    expected = {"obj": [1.0, 2.0], "composite_loss": [1.0, 2.0]}[composite.name]
    np.testing.assert_allclose(list(composite.weights_in_use().values()), np.array(expected) * 0.5**4, rtol=1e-6)
    if target == "objective":
        outputs = to_numpy(model.predict(X, verbose=0)).astype(np.float64)
        # The first epoch's two batches, at steps 0 and 1: the l2 and l1 (×2) terms of each batch's inputs.
        batches = [
            (_terms_of(X[4 * t : 4 * t + 4]) * [1.0, 2.0]).sum() * 0.5**t + np.mean(outputs[4 * t : 4 * t + 4] ** 2)
            for t in range(2)
        ]
        rtol = 1e-2 if policy.startswith("mixed") else 1e-4
        np.testing.assert_allclose(history.history["loss"][0], np.mean(batches), rtol=rtol)
    loaded = save_and_load(model, tmp_path)
    again = loaded.get_layer("obj") if target == "objective" else loaded.loss
    assert type(again.weighting) is Annealed and again.weighting.decay == 0.5
    assert float(to_numpy(again._state_layer().annealed_steps)) == 4.0
    np.testing.assert_allclose(list(again.weights_in_use().values()), np.array(expected) * 0.5**4, rtol=1e-6)
    loaded.fit(X, y, batch_size=8, epochs=1, verbose=0)
    assert float(to_numpy(again._state_layer().annealed_steps)) == 5.0
