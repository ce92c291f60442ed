"""PenaltyMonitor probes: gradient norms against closed forms, compiled once, and side-effect free."""

import keras
import numpy as np
import pytest

from keras_penalties import CompositeObjective, Term, gradients
from keras_penalties import losses as L
from keras_penalties import ops as P
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor
from tests.testing import BACKEND, to_numpy

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4)).astype(np.float32)
Y = RNG.normal(size=(16, 3)).astype(np.float32)


def _linear_model(l1_weight=0.1, factor=0.05, loss="mse"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, kernel_regularizer=R.L2(factor), name="lin")(inputs)
    out = CompositeObjective({"l1": Term("l1", l1_weight)}, name="obj")(h)
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    return model


def test_probe_values_and_gradient_norms_match_closed_forms():
    model = _linear_model()
    monitor = PenaltyMonitor(probe_data=(X, Y), every_n_batches=1)
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor]).history
    w, b = (to_numpy(v).astype(np.float64) for v in model.get_layer("lin").weights)
    x, y = X.astype(np.float64), Y.astype(np.float64)
    h = x @ w + b
    # l1 = Σ|h| / N (per-sample mean): ∂/∂W = xᵀ sign(h) / N, ∂/∂b = Σₙ sign(h) / N.
    n = len(x)
    g_l1 = (x.T @ np.sign(h) / n, np.sign(h).sum(0) / n)
    # kernel regularizer 0.05·Σ W²: ∂/∂W = 0.1·W.
    g_reg = (0.1 * w, np.zeros_like(b))
    # mse = mean((h − y)²): ∂/∂h = 2(h − y)/(N·3).
    dh = 2 * (h - y) / h.size
    g_loss = (x.T @ dh, dh.sum(0))

    def norm(g):
        return np.sqrt(sum(np.sum(p**2) for p in g))

    def combine(*parts):
        return tuple(sum(weight * g[i] for weight, g in parts) for i in range(2))

    entry = monitor.history[-1]
    np.testing.assert_allclose(entry["obj/l1"], np.abs(h).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(entry["lin/kernel_regularizer"], 0.05 * np.sum(w**2), rtol=1e-5)
    np.testing.assert_allclose(entry["obj/l1/grad_norm"], norm(g_l1), rtol=1e-5)
    np.testing.assert_allclose(entry["obj/l1/grad_norm_weighted"], 0.1 * norm(g_l1), rtol=1e-5)
    np.testing.assert_allclose(entry["lin/kernel_regularizer/grad_norm"], norm(g_reg), rtol=1e-5)
    np.testing.assert_allclose(entry["base_loss/grad_norm"], norm(g_loss), rtol=1e-5)
    np.testing.assert_allclose(
        entry["total/grad_norm"], norm(combine((1.0, g_loss), (0.1, g_l1), (1.0, g_reg))), rtol=1e-5
    )
    np.testing.assert_allclose(entry["base_loss"], np.mean((h - y) ** 2), rtol=1e-5)
    # Epoch logs average the epoch's probes (two here, with frozen weights: equal).
    np.testing.assert_allclose(history["obj/l1/grad_norm"][0], norm(g_l1), rtol=1e-5)
    np.testing.assert_allclose(history["lin/kernel_regularizer"][0], 0.05 * np.sum(w**2), rtol=1e-5)
    assert [e["step"] for e in monitor.history] == [0, 1]


def test_probe_function_is_compiled_once():
    model = _linear_model()
    model(X)
    calls = []

    def outputs(x, y):
        calls.append(1)
        return [keras.ops.sum(model(x))]

    probe = gradients.parameter_probe(model, outputs, 1)
    values = [probe(X, Y)[1] for _ in range(3)]
    np.testing.assert_allclose(values[0], values[2])
    # JAX and TF trace the probe once; torch runs eagerly, once per probe.
    assert len(calls) == (3 if BACKEND == "torch" else 1)


@pytest.mark.parametrize("chunked", [False, True], ids=["plain ops", "with a chunked entropy"])
@pytest.mark.parametrize("batched", [False, True], ids=["a pass each", "batched"])
def test_probe_norms_over_some_variables_match_closed_forms(batched, chunked):
    # Outputs through the kernel and bias, through the bias alone, through
    # another layer's weight only (norm 0 over these) and through nothing;
    # and a chunked entropy, whose backward torch's vmap cannot batch (the
    # batched probe then takes a pass an output).
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, name="lin")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    lin, head = model.get_layer("lin"), model.get_layer("head")

    def outputs(x, y):
        hidden = lin(x)
        values = [
            keras.ops.sum(keras.ops.square(hidden)),
            keras.ops.sum(lin.bias * 3.0),
            keras.ops.sum(head.kernel),
            keras.ops.sum(keras.ops.square(y)),
        ]
        return values + ([P.entropy(hidden, from_logits=True, chunk_size=5)] if chunked else [])

    probe = gradients.parameter_probe(model, outputs, 4 + chunked, variables=lin.trainable_weights, batched=batched)
    for _ in range(2):  # the second call after any fallback
        values, norms = probe(X, Y)
    w, b = (to_numpy(v).astype(np.float64) for v in lin.weights)
    x = X.astype(np.float64)
    hidden = x @ w + b

    def norm(g):  # ‖∂/∂W‖ and ‖∂/∂b‖ together, from ∂/∂hidden
        return np.sqrt(np.sum((x.T @ g) ** 2) + np.sum(g.sum(0) ** 2))

    # Σh²: ∂/∂h = 2h; Σ3b: ∂/∂b = 3.
    expected_values = [np.sum(hidden**2), 3 * b.sum(), to_numpy(head.kernel).sum(), np.sum(Y.astype(np.float64) ** 2)]
    expected_norms = [norm(2 * hidden), 3 * np.sqrt(3), 0.0, 0.0]
    if chunked:
        # The mean over rows of H = −Σ p log p: ∂H/∂h = −p (log p + H).
        log_p = hidden - np.log(np.sum(np.exp(hidden), 1, keepdims=True))
        entropy = -np.sum(np.exp(log_p) * log_p, 1, keepdims=True)
        expected_values.append(entropy.mean())
        expected_norms.append(norm(-np.exp(log_p) * (log_p + entropy) / len(x)))
    np.testing.assert_allclose(values, expected_values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)


def test_monitor_builds_one_probe_per_model():
    model = _linear_model()
    monitor = PenaltyMonitor(probe_data=(X, Y), every_n_batches=1)
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[monitor])
    assert len(monitor.history) == 8 and len(monitor._probes) == 1


@pytest.mark.skipif(BACKEND != "torch", reason="`.grad` is a torch tensor attribute")
def test_probe_leaves_no_torch_grad():
    model = _linear_model()
    model(X)
    monitor = PenaltyMonitor(probe_data=(X, Y))
    monitor.set_model(model)
    monitor.probe()
    assert all(v.value.grad is None for v in model.trainable_variables)


def _stateful_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(
        8, activation="relu", kernel_regularizer=R.L2(0.01), activity_regularizer=R.Entropy(0.01, from_logits=True)
    )(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3)(h)
    h = CompositeObjective(
        {"ent": Term("entropy", 0.1, options={"from_logits": True}), "l2": Term("l2", 1e-3)}, name="obj"
    )(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=L.CompositeLoss(
            {"mse": keras.losses.MeanSquaredError(), "cos": L.Consistency(metric="cosine")}, weights={"cos": 0.1}
        ),
    )
    return model


def test_monitor_does_not_change_the_training_trajectory():
    def train(callbacks):
        model = _stateful_model()
        keras.utils.set_random_seed(4)
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        # Everything but the objective's running sums, which the monitor resets
        # each epoch by design: weights, BatchNormalization statistics, the
        # objective's step and weights, and the optimizer's state.
        state = [v for v in model.variables if v.name not in ("value_sums", "value_counts")]
        state += model.optimizer.variables
        return [to_numpy(v) for v in state], int(to_numpy(model.optimizer.iterations))

    plain, plain_steps = train([])
    monitored, monitored_steps = train([PenaltyMonitor(probe_data=(X, Y), every_n_batches=1)])
    assert plain_steps == monitored_steps == 8
    assert len(plain) == len(monitored)
    for a, b in zip(plain, monitored):
        np.testing.assert_array_equal(a, b)


def test_monitor_keeps_async_batch_dispatch_and_probes_every_n_batches():
    # Keras turns off asynchronous batch-end dispatch for every batch once a
    # callback overrides on_train_batch_end (CallbackList._async_train, the
    # flag Keras itself reads; TF is never async). The monitor must not.
    model = _linear_model()
    bare = keras.callbacks.CallbackList([], model=model)
    monitor = PenaltyMonitor(probe_data=(X, Y), every_n_batches=3)
    with_monitor = keras.callbacks.CallbackList([monitor], model=model)
    assert with_monitor._async_train == bare._async_train == (BACKEND != "tensorflow")
    # Its work is still done after the right batches: probes after steps 0, 3
    # (of 4 per epoch) and the epoch's last batch mirrored into its logs.
    history = model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert [entry["step"] for entry in monitor.history] == [0, 3, 6]
    assert [entry["epoch"] for entry in monitor.history] == [0, 0, 1]
    assert len(history.history["obj/l1"]) == 2


def test_history_plot_and_composite_loss_keys():
    model = _stateful_model()
    monitor = PenaltyMonitor(probe_data=(X, Y), every_n_batches=2)
    history = model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[monitor]).history
    for key in ("composite_loss/cos/grad_norm", "obj/ent/grad_norm_weighted", "total/grad_norm", "base_loss/grad_norm"):
        assert key in history and np.isfinite(history[key][0]), key
    entry = monitor.history[0]
    assert entry["obj/ent/contribution"] == pytest.approx(entry["obj/ent/weight"] * entry["obj/ent"])
    assert entry["composite_loss/cos/weight"] == pytest.approx(0.1)  # a float32 variable
    import matplotlib.figure

    assert isinstance(monitor.plot(), matplotlib.figure.Figure)


def test_values_only_without_grad_norms():
    model = _linear_model()
    monitor = PenaltyMonitor(probe_data=(X, Y), every_n_batches=1, grad_norms=False)
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor]).history
    assert "lin/kernel_regularizer" in history
    assert not any("grad_norm" in key for key in history)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"every_n_batches": 0}, ValueError, r"`every_n_batches` must be an int >= 1"),
        ({"every_n_batches": 2.5}, TypeError, r"`every_n_batches` must be an int"),
        ({"grad_norms": "yes"}, TypeError, r"`grad_norms` must be a bool"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        PenaltyMonitor(**kwargs)


def test_probe_data_without_y_needs_a_model_without_a_compiled_loss():
    # Without y the compiled loss cannot run: its value would read 0.
    with pytest.raises(ValueError, match=r"`probe_data` holds x alone.*probe_data=\(x, y\)"):
        _linear_model().fit(X, Y, epochs=1, verbose=0, callbacks=[PenaltyMonitor(probe_data=X)])
    # (A model compiled again with loss=None keeps its first compiled loss in Keras 3.15: a fresh one here.)
    model = _linear_model(loss=None)
    monitor = PenaltyMonitor(probe_data=X)
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[monitor])
    (entry,) = monitor.history
    kernel, bias = (w.astype(np.float64) for w in model.get_layer("lin").get_weights())
    np.testing.assert_allclose(
        entry["total"], 0.1 * np.abs(X @ kernel + bias).sum(1).mean() + 0.05 * (kernel**2).sum(), rtol=1e-5
    )


def test_plot_without_probes_is_an_error():
    with pytest.raises(ValueError, match=r"No probes yet"):
        PenaltyMonitor().plot()


def test_repeated_fits_with_the_monitor_do_not_retrace():
    traces = []

    def counted(x):
        traces.append(1)  # Python runs once per trace (per call on torch)
        from keras_penalties import ops as P

        return P.l1(x)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    out = CompositeObjective({"l1": Term(counted, 0.1)}, name="obj")(keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, out)
    model.compile(optimizer="sgd", loss="mse")
    monitor = PenaltyMonitor()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    after_first = len(traces)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    # Eagerly (torch) each step calls the term; traced backends do not trace again.
    assert len(traces) - after_first == (4 if BACKEND == "torch" else 0)
