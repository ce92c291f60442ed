"""Where real training runs: mixed precision, shared layers, empty batches.

Each check trains a frozen model (learning rate 0) whose activations are known
exactly, so every logged value has a NumPy oracle. Several devices are in
tests/test_distributed.py.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties import ops as P
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor
from keras_penalties.gradients import gradient_penalty, input_gradient
from tests import oracles as O
from tests.testing import assert_finite, to_numpy

RNG = np.random.default_rng(0)
# Multiples of 1/8 below 4: exact in float16 and bfloat16, so a half-precision
# identity layer passes them on unchanged and the oracle knows its output.
X = (np.round(RNG.normal(size=(32, 6)) * 8) / 8).clip(-3.875, 3.875).astype("float32")
Y = RNG.normal(size=(32, 2)).astype("float32")


def _entropy_from_logits(h):
    return O.np_entropy(h.astype(np.float64), from_logits=True)


def _per_batch(fn, x, batch):
    return [fn(x[i : i + batch]) for i in range(0, len(x), batch)]


# ---------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("auto_scale_loss", [True, False], ids=["loss_scale", "no_loss_scale"])
def test_objective_under_mixed_precision(policy, auto_scale_loss):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    # Frozen: without loss scaling the penalty's float16 gradient w.r.t. its
    # kernel would overflow (a property of float16, not of the objective).
    hidden = keras.layers.Dense(6, kernel_initializer="identity", trainable=False, name="hidden")(inputs)
    ramp = keras.optimizers.schedules.PolynomialDecay(0.0, 10000, 1.0)  # w(t) = t / 10000
    objective = CompositeObjective(
        {
            "l1": Term("l1", 1e5),  # inf if read in float16
            "ent": Term("entropy", ramp, options={"from_logits": True}),
            "tiny": Term("l2", 1e-8),  # 0 if read in float16
        },
        name="obj",
    )
    outputs = keras.layers.Dense(2)(objective(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mse"], auto_scale_loss=auto_scale_loss)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (
        auto_scale_loss and policy == "mixed_float16"
    )
    # A float16 count would stall at 2049 and a bfloat16 one at 257.
    objective.step.assign(5000)
    monitor = PenaltyMonitor(probe_data=(X[:8], Y[:8]), every_n_batches=2)
    history = model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[monitor]).history

    for variable in objective.non_trainable_weights:
        assert variable.dtype in ("float32", "int32") and not variable._autocast, (
            variable.path
        )  # private: no public reader
    assert int(to_numpy(objective.step)) == 5004
    np.testing.assert_allclose(to_numpy(objective.effective_weights()), [1e5, 0.5004, 1e-8], rtol=1e-6)

    h = X.astype(np.float64)  # what the half-precision identity layer passes on
    l1 = _per_batch(lambda b: np.abs(b).sum() / len(b), h, 8)
    ent = _per_batch(_entropy_from_logits, h, 8)
    l2 = _per_batch(lambda b: np.square(b).sum() / len(b), h, 8)
    np.testing.assert_allclose(history["obj/l1"][0], np.mean(l1), rtol=1e-6)
    np.testing.assert_allclose(history["obj/ent"][0], np.mean(ent), rtol=1e-6)
    np.testing.assert_allclose(history["obj/tiny"][0], np.mean(l2), rtol=1e-6)
    penalty = np.mean([1e5 * a + (5000 + t) / 1e4 * b + 1e-8 * c for t, (a, b, c) in enumerate(zip(l1, ent, l2))])
    np.testing.assert_allclose(history["loss"][0] - history["mse"][0], penalty, rtol=1e-5)
    # The probe sees the first batch, and the monitor's own state is float32.
    probe = monitor.history[-1]
    np.testing.assert_allclose([probe["obj/l1"], probe["obj/ent"]], [l1[0], ent[0]], rtol=1e-6)
    # After batch t the next step's weight is in force: (5000 + t + 1) / 1e4.
    np.testing.assert_allclose(probe["obj/ent/weight"], (5001 + probe["step"]) / 1e4, rtol=1e-6)
    np.testing.assert_allclose(probe["obj/l1/contribution"], 1e5 * l1[0], rtol=1e-6)
    np.testing.assert_allclose(
        probe["total"] - probe["base_loss"], 1e5 * l1[0] + probe["obj/ent/weight"] * ent[0] + 1e-8 * l2[0], rtol=1e-6
    )
    assert all(v.dtype == "float32" for m in model.metrics for v in m.variables)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_objective_adds_a_float32_loss(policy):
    objective = CompositeObjective({"l1": Term("l1", 1e-4)})
    objective(ops.ones((131072, 1), "float16"), training=True)
    (loss,) = objective.losses
    assert keras.backend.standardize_dtype(loss.dtype) == "float32"
    # 1e-4 x 131072 ones, over a batch of 131072: 1e-4, where float16 sums overflow.
    np.testing.assert_allclose(to_numpy(loss), 1e-4, rtol=1e-6)


REGULARIZERS = {
    "l1": (R.L1(1e-4), lambda x: 1e-4 * np.abs(x).sum()),
    "l2": (R.L2(1e-4, center=0.5), lambda x: 1e-4 * np.square(x - 0.5).sum()),
    "elastic_net": (
        R.ElasticNet(1e-4, l1_ratio=0.25),
        lambda x: 1e-4 * (0.25 * np.abs(x).sum() + 0.75 * np.square(x).sum()),
    ),
    "output_magnitude": (R.OutputMagnitude(1e-4), lambda x: 1e-4 * O.np_output_magnitude(x, 1.0, reduction="sum")),
    "entropy": (R.Entropy(1e-4, from_logits=True), lambda x: 1e-4 * O.np_entropy(x, from_logits=True, reduction="sum")),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(REGULARIZERS))
def test_regularizers_return_float32_for_half_inputs(name, dtype):
    regularizer, oracle = REGULARIZERS[name]
    # 131072 x 4 elements: every half-precision sum of these would overflow or round.
    x = np.tile(X[:, :4], (4096, 1)) if name != "entropy" else X
    half = ops.cast(x, dtype)
    value = regularizer(half)
    assert keras.backend.standardize_dtype(value.dtype) == "float32"
    np.testing.assert_allclose(to_numpy(value), oracle(to_numpy(half).astype(np.float64)), rtol=1e-5)


def test_l1_of_many_float16_ones_is_not_inf():
    np.testing.assert_allclose(to_numpy(R.L1(1e-4)(ops.ones((131072,), "float16"))), 13.1072, rtol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_activity_regularizers_fit_under_mixed_float16(policy):
    # Keras' own float16 activity-regularizer losses fail `fit` on TensorFlow.
    inputs = keras.Input((6,))
    hidden = inputs
    for regularizer in (R.L1(1e-2), R.OutputMagnitude(1e-2), R.Entropy(1e-2, from_logits=True)):
        hidden = keras.layers.Dense(
            6, kernel_initializer="identity", trainable=False, activity_regularizer=regularizer
        )(hidden)
    # Zero outputs and targets: the loss is the penalty alone.
    outputs = keras.layers.Dense(2, kernel_initializer="zeros")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    history = model.fit(X, np.zeros_like(Y), batch_size=8, epochs=1, shuffle=False, verbose=0).history
    penalty = np.mean(
        _per_batch(
            lambda h: (
                1e-2
                * (
                    np.abs(h).sum()
                    + O.np_output_magnitude(h, 1.0, reduction="sum")
                    + O.np_entropy(h, True, reduction="sum")
                )
                / len(h)
            ),
            X.astype(np.float64),
            8,
        )
    )
    np.testing.assert_allclose(history["loss"][0], penalty, rtol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_composite_loss_under_mixed_precision(policy):
    inputs = keras.Input((6,))
    logits = keras.layers.Dense(6, kernel_initializer="identity")(inputs)
    model = keras.Model(inputs, logits)
    loss = L.CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "ent": L.Entropy(from_logits=True)}, weights={"ent": 1e5}
    )
    model.compile(keras.optimizers.SGD(0.0), loss=loss)
    history = model.fit(X, X, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]).history
    ent = np.mean(_per_batch(_entropy_from_logits, X.astype(np.float64), 8))
    np.testing.assert_allclose(history["composite_loss/ent"][0], ent, rtol=1e-6)
    np.testing.assert_allclose(history["composite_loss/mse"][0], 0.0, atol=1e-7)
    np.testing.assert_allclose(history["loss"][0], 1e5 * ent, rtol=1e-6)
    assert all(v.dtype == "float32" for v in loss.state.running_sums.variables)


# ---------------------------------------------------------------- shared layers


def _two_view_model(objective):
    """A linear encoder holding `objective`, applied to x and to 2x."""
    enc_in = keras.Input((6,))
    hidden = keras.layers.Dense(6, kernel_initializer="identity", use_bias=False)(enc_in)
    encoder = keras.Model(enc_in, objective(hidden), name="encoder")
    x = keras.Input((6,))
    views = keras.layers.Add()([encoder(x), encoder(keras.layers.Rescaling(2.0)(x))])
    model = keras.Model(x, keras.layers.Dense(2)(views))
    model.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mse"])
    return model


def test_shared_encoder_steps_once_and_counts_every_call():
    ramp = keras.optimizers.schedules.PolynomialDecay(1.0, 10, 11.0)  # w(t) = 1 + t
    objective = CompositeObjective({"l1": Term("l1", ramp)}, name="obj")
    model = _two_view_model(objective)
    history = model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]).history
    assert int(to_numpy(objective.step)) == 4  # steps, not calls (8)
    l1 = _per_batch(lambda b: np.abs(b).sum() / len(b), X.astype(np.float64), 8)
    # Each step: w(t) on both views, |x| and |2x|: 3 w(t) l1.
    expected = np.mean([(1 + t) * 3 * v for t, v in enumerate(l1)])
    np.testing.assert_allclose(history["loss"][0] - history["mse"][0], expected, rtol=1e-5)
    # The logged value is the mean over calls: (l1 + 2 l1) / 2.
    np.testing.assert_allclose(history["obj/l1"][0], 1.5 * np.mean(l1), rtol=1e-5)


def test_shared_encoder_in_one_eager_call():
    objective = CompositeObjective({"l1": Term("l1", keras.optimizers.schedules.PolynomialDecay(1.0, 10, 11.0))})
    model = _two_view_model(objective)
    model(X[:8], training=True)
    assert int(to_numpy(objective.step)) == 1
    l1 = np.abs(X[:8].astype(np.float64)).sum() / 8
    np.testing.assert_allclose(sorted(float(to_numpy(v)) for v in model.losses), [l1, 2 * l1], rtol=1e-6)


def test_shared_encoder_probed_by_the_monitor_gives_the_mean_of_its_calls():
    # The probe reads a shared objective as its logs do: the mean over the
    # views (|x| and |2x|), with the weight in use; the total counts both.
    objective = CompositeObjective({"l1": Term("l1", 0.5)}, name="obj")
    model = _two_view_model(objective)
    monitor = PenaltyMonitor(probe_data=(X[:8], Y[:8]), every_n_batches=1)
    model.fit(X[:8], Y[:8], batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    (entry,) = monitor.history
    l1 = np.abs(X[:8].astype(np.float64)).sum() / 8
    np.testing.assert_allclose(entry["obj/l1"], 1.5 * l1, rtol=1e-6)
    np.testing.assert_allclose(entry["obj/l1/contribution"], 0.5 * 1.5 * l1, rtol=1e-6)
    np.testing.assert_allclose(entry["total"] - entry["base_loss"], 0.5 * 3 * l1, rtol=1e-5)


# ---------------------------------------------------------------- batch-size independence


def test_magnitude_terms_do_not_depend_on_the_batch_size():
    objective = CompositeObjective({"l1": "l1", "l2": Term("l2"), "en": Term("elastic_net", options={"l1_ratio": 0.3})})
    small = objective.compute(np.ones((32, 5), "float32"))[1]
    large = objective.compute(np.ones((256, 5), "float32"))[1]
    for name in small:
        np.testing.assert_allclose(to_numpy(small[name]), to_numpy(large[name]), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(small["l1"]), 5.0, rtol=1e-6)
    # An explicit reduction is kept.
    assert Term("l1", options={"reduction": "sum"}).options["reduction"] == "sum"
    assert Term("l1").options["reduction"] == "sum_over_batch_size"


# ---------------------------------------------------------------- empty batches

EMPTY = np.zeros((0, 5), "float32")

EMPTY_OPS = {
    "l1_sum": lambda x: P.l1(x),
    "l1_mean": lambda x: P.l1(x, reduction="mean"),
    "l1_batch": lambda x: P.l1(x, reduction="sum_over_batch_size"),
    "l2_mean": lambda x: P.l2(x, reduction="mean", center="mean"),
    "elastic_net_mean": lambda x: P.elastic_net(x, reduction="mean"),
    "elastic_net_batch": lambda x: P.elastic_net(x, reduction="sum_over_batch_size"),
    "kl": lambda x: P.kl_divergence(x, x + 1.0, from_logits=True),
    "kl_symmetric_sum": lambda x: P.kl_divergence(x, x, from_logits=True, direction="symmetric", reduction="sum"),
    "js": lambda x: P.js_divergence(x, x * 2.0, from_logits=True),
    "entropy": lambda x: P.entropy(x, from_logits=True, normalize=True),
    "consistency_cosine": lambda x: P.consistency(x, x + 1.0, metric="cosine"),
    "consistency_mse": lambda x: P.consistency(x, x + 1.0),
    "output_magnitude": lambda x: P.output_magnitude(x),
    "kl_sparsity": lambda x: P.kl_sparsity(ops.sigmoid(x)),
    "gradient_penalty": lambda x: gradient_penalty(lambda t: ops.sum(t * t, axis=-1), x),
    "regularizer_entropy": lambda x: R.Entropy(1.0, from_logits=True)(x),
    "regularizer_kl_sparsity": lambda x: R.KLSparsity(1.0)(ops.sigmoid(x)),
    "loss_kl": lambda x: L.KLDivergence(from_logits=True)(x, x + 1.0),
    "loss_consistency": lambda x: L.Consistency()(x, x + 1.0),
    "loss_entropy": lambda x: L.Entropy(from_logits=True)(None, x),
    "composite_loss": lambda x: L.CompositeLoss({"kl": L.KLDivergence(from_logits=True), "l1": "l1"})(x, x + 1.0),
    "objective": lambda x: CompositeObjective(
        {"l1": "l1", "ent": Term("entropy", options={"from_logits": True})}
    ).compute(x)[0],
    "objective_regularizer_term": lambda x: CompositeObjective({"mag": R.OutputMagnitude(1.0)}).compute(x)[0],
}


@pytest.mark.parametrize("name", list(EMPTY_OPS))
def test_empty_batch_gives_zero_and_a_finite_gradient(name):
    fn = EMPTY_OPS[name]
    value = to_numpy(fn(EMPTY))
    assert value.shape == () and value == 0.0, value
    gradient = to_numpy(input_gradient(fn, EMPTY))
    assert gradient.shape == (0, 5)
    assert_finite(gradient, name)


def test_fit_on_a_last_batch_of_one_sample():
    inputs = keras.Input((6,))
    hidden = CompositeObjective({"l1": "l1", "ent": Term("entropy", options={"from_logits": True})}, name="obj")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile("sgd", "mse")
    history = model.fit(X[:9], Y[:9], batch_size=8, epochs=1, verbose=0, callbacks=[PenaltyMonitor()]).history
    assert all(np.isfinite(v[0]) for v in history.values()), history
