"""Term and CompositeObjective: computation, weights and schedules, control during fit, errors."""

import json
import math

import keras
import numpy as np
import pytest
from scipy import special

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties import ops as P
from keras_penalties import backend
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor
from tests import oracles as O
from tests.testing import BACKEND, central_difference, grad, save_and_load, to_numpy

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 5)).astype(np.float32)
TEACHER = RNG.normal(size=(4, 5)).astype(np.float32)


def _np_entropy_logits(x):
    return O.np_entropy(x.astype(np.float64), from_logits=True)


def test_compute_matches_oracles_and_weights():
    objective = CompositeObjective(
        {
            "l1": "l1",
            "l2": Term("l2", 0.5, options={"center": "mean"}),
            "ent": Term(P.entropy, 0.25, options={"from_logits": True}),
            "mag": Term(R.OutputMagnitude(2.0, target=1.0), 0.1),
        }
    )
    total, values = objective.compute(X)
    x = X.astype(np.float64)
    expected = {
        "l1": O.np_l1(x, "sum_over_batch_size"),
        "l2": O.np_l2(x, "sum_over_batch_size", center="mean"),
        "ent": _np_entropy_logits(x),
        # A regularizer term adds what it would as an activity regularizer.
        "mag": 2.0 * O.np_output_magnitude(x, 1.0, reduction="sum") / len(x),
    }
    weights = {"l1": 1.0, "l2": 0.5, "ent": 0.25, "mag": 0.1}
    assert list(values) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(to_numpy(values[name]), value, rtol=1e-5)
    np.testing.assert_allclose(to_numpy(total), sum(weights[k] * v for k, v in expected.items()), rtol=1e-5)


def _terms_on_one_logits(teacher):
    """Terms that all take (log-)softmaxes of the objective's input x (JS
    first: where nothing is differentiated torch forms it in place in its
    temporaries, which must not be the log-softmax the others share)."""
    return {
        "js": Term(lambda x: P.js_divergence(teacher, x, from_logits=True, beta=0.3), 1.1),
        "bonus": Term(L.Entropy(from_logits=True, mode="bonus"), 0.3),
        "kl": Term(lambda x: P.kl_divergence(teacher, x, from_logits=True), 0.5),
        "reverse": Term(lambda x: P.kl_divergence(teacher, x, from_logits=True, direction="reverse"), 0.2),
        "hot": Term(lambda x: P.entropy(x, from_logits=True, temperature=2.0), 0.7),
    }


def _np_terms_on_one_logits(x, teacher):
    return {
        "bonus": -O.np_entropy(x, from_logits=True),
        "kl": O.np_kl_divergence(teacher, x, from_logits=True),
        "reverse": O.np_kl_divergence(teacher, x, from_logits=True, direction="reverse"),
        "hot": O.np_entropy(x, from_logits=True, temperature=2.0),
        "js": O.np_js_divergence(teacher, x, from_logits=True, beta=0.3),
    }


@pytest.mark.parametrize("classes", [5, 17])
def test_terms_on_the_same_logits_match_oracles_in_value_and_gradient(classes):
    """An objective forms each (log-)softmax of its input once for all its
    terms (below); values and the total's gradient are still each term's
    own, against NumPy and central differences of NumPy in float64."""
    rng = np.random.default_rng(classes)
    x, teacher = rng.normal(size=(2, 3, classes)).astype("float32")
    weights = {"bonus": 0.3, "kl": 0.5, "reverse": 0.2, "hot": 0.7, "js": 1.1}
    objective = CompositeObjective(_terms_on_one_logits(keras.ops.convert_to_tensor(teacher)))
    total, values = objective.compute(keras.ops.convert_to_tensor(x))
    expected = _np_terms_on_one_logits(x.astype(np.float64), teacher.astype(np.float64))
    for name, value in expected.items():
        np.testing.assert_allclose(to_numpy(values[name]), value, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(to_numpy(total), sum(weights[k] * v for k, v in expected.items()), rtol=1e-5)
    gradient = grad(lambda t: objective.compute(t)[0], x)

    def np_total(v):
        return sum(weights[k] * e for k, e in _np_terms_on_one_logits(v, teacher.astype(np.float64)).items())

    np.testing.assert_allclose(gradient, central_difference(np_total, x), rtol=1e-4, atol=1e-6)


def test_terms_on_the_same_logits_share_each_log_softmax(monkeypatch):
    """Five terms on the input x ask for x's softmax and log-softmax six
    times; the objective forms them once (and once more at T = 2), where
    the terms one by one form each again."""
    formed, inside = [], []
    softmax_pair, log_softmax = backend.softmax_pair, keras.ops.log_softmax

    def counting(fn, kind):
        def wrapped(logits, *args, **kwargs):
            if not inside:  # not the log-softmax a softmax_pair forms
                formed.append((kind, id(logits)))
            inside.append(kind)
            try:
                return fn(logits, *args, **kwargs)
            finally:
                inside.pop()

        return wrapped

    monkeypatch.setattr(backend, "softmax_pair", counting(softmax_pair, "pair"))
    monkeypatch.setattr(keras.ops, "log_softmax", counting(log_softmax, "log"))
    x = keras.ops.convert_to_tensor(X)
    objective = CompositeObjective(_terms_on_one_logits(keras.ops.convert_to_tensor(TEACHER)))
    objective.compute(x)
    alone = ["log", "pair", "pair", "pair"]
    # Only torch shares them (XLA and TF's graph optimizer merge them).
    shared = ["pair"] if backend.SHARES_SOFTMAX else alone
    assert sorted(kind for kind, i in formed if i == id(x)) == shared
    formed.clear()
    objective(x)
    assert sorted(kind for kind, i in formed if i == id(x)) == shared
    formed.clear()
    for name in objective.terms:
        objective.term_value(name, x)
    assert sorted(kind for kind, i in formed if i == id(x)) == alone
    # A CompositeLoss shares them between its terms on y_pred alike.
    loss = L.CompositeLoss(
        {"bonus": L.Entropy(from_logits=True, mode="bonus"), "kl": Term(P.kl_divergence, options={"from_logits": True})}
    )
    formed.clear()
    np.testing.assert_allclose(
        to_numpy(loss(keras.ops.convert_to_tensor(TEACHER), x)),
        O.np_kl_divergence(TEACHER.astype(np.float64), X.astype(np.float64), from_logits=True)
        - O.np_entropy(X.astype(np.float64), from_logits=True),
        rtol=1e-5,
    )
    assert sorted(kind for kind, i in formed if i == id(x)) == (["pair"] if backend.SHARES_SOFTMAX else ["log", "pair"])


def test_a_term_differentiating_the_input_after_another_term_read_it():
    """An entropy term, then a term that differentiates the entropy w.r.t.
    the same input: the gradient is the closed form, not one cut off at a
    (log-)softmax formed before the gradient was taken."""
    from keras_penalties.gradients import input_gradient

    objective = CompositeObjective(
        {
            "entropy": Term(P.entropy, options={"from_logits": True}),
            "sharpness": lambda x: keras.ops.sum(
                keras.ops.square(input_gradient(lambda t: P.entropy(t, from_logits=True), x))
            ),
        }
    )
    _, values = objective.compute(keras.ops.convert_to_tensor(X))
    x = X.astype(np.float64)
    p = special.softmax(x, axis=-1)
    rows = -(p * np.log(p)).sum(-1, keepdims=True)
    # d mean_rows H / dx = −p (log p + H) / rows.
    gradient = -p * (np.log(p) + rows) / len(x)
    np.testing.assert_allclose(to_numpy(values["entropy"]), rows.mean(), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(values["sharpness"]), np.square(gradient).sum(), rtol=1e-4)


def test_weights_argument_overrides_term_weights():
    objective = CompositeObjective({"l1": Term("l1", 3.0), "l2": "l2"}, weights={"l1": 0.5})
    total, _ = objective.compute(X)
    np.testing.assert_allclose(
        to_numpy(total), 0.5 * O.np_l1(X, "sum_over_batch_size") + O.np_l2(X, "sum_over_batch_size"), rtol=1e-5
    )


def test_dict_inputs_feed_named_entries_in_order():
    objective = CompositeObjective(
        {
            "kd_loss": Term(L.KLDivergence(from_logits=True, temperature=2.0), inputs=("teacher", "student")),
            "kd_op": Term("kl_divergence", inputs=("teacher", "student"), options={"from_logits": True}),
            "js": Term("js_divergence", inputs=["student", "teacher"], options={"from_logits": True}),
            "ent": Term(L.Entropy(from_logits=True, mode="bonus"), inputs="student"),
        }
    )
    inputs = {"student": X, "teacher": TEACHER}
    _, values = objective.compute(inputs)
    t, s = TEACHER.astype(np.float64), X.astype(np.float64)
    np.testing.assert_allclose(to_numpy(values["kd_loss"]), O.np_kl_divergence(t, s, True, temperature=2.0), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(values["kd_op"]), O.np_kl_divergence(t, s, True), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(values["js"]), O.np_js_divergence(s, t, True), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(values["ent"]), -_np_entropy_logits(s), rtol=1e-5)
    outputs = objective(inputs)
    assert set(outputs) == {"student", "teacher"}
    np.testing.assert_array_equal(to_numpy(outputs["student"]), X)


def test_list_inputs_are_positional():
    objective = CompositeObjective(
        {
            "kl": Term("kl_divergence", options={"from_logits": True}),
            "ent": Term("entropy", inputs=1, options={"from_logits": True}),
        }
    )
    _, values = objective.compute([TEACHER, X])
    np.testing.assert_allclose(to_numpy(values["kl"]), O.np_kl_divergence(TEACHER, X, True), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(values["ent"]), _np_entropy_logits(X), rtol=1e-5)


def test_call_is_identity_and_adds_the_total():
    objective = CompositeObjective({"l1": Term("l1", 0.1), "l2": Term("l2", 0.2)})
    out = objective(X)
    np.testing.assert_array_equal(to_numpy(out), X)
    (loss,) = objective.losses
    np.testing.assert_allclose(
        to_numpy(loss), 0.1 * O.np_l1(X, "sum_over_batch_size") + 0.2 * O.np_l2(X, "sum_over_batch_size"), rtol=1e-5
    )


def test_set_weight_enable_disable():
    objective = CompositeObjective({"l1": "l1", "l2": Term("l2", 2.0)})
    objective.set_weight("l2", 0.5)
    objective.disable("l1")
    total, values = objective.compute(X)
    assert list(values) == ["l2"]
    np.testing.assert_allclose(to_numpy(total), 0.5 * O.np_l2(X, "sum_over_batch_size"), rtol=1e-5)
    objective.enable("l1")
    total, values = objective.compute(X)
    np.testing.assert_allclose(
        to_numpy(total), O.np_l1(X, "sum_over_batch_size") + 0.5 * O.np_l2(X, "sum_over_batch_size"), rtol=1e-5
    )
    with pytest.raises(ValueError, match=r"Unknown term 'l3'; terms are \['l1', 'l2'\]"):
        objective.set_weight("l3", 1.0)
    with pytest.raises(TypeError, match=r"set_weight takes a number"):
        objective.set_weight("l1", keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5))
    with pytest.raises(ValueError, match=r"`weight` must be >= 0"):
        objective.set_weight("l1", -1.0)


def test_set_weight_replaces_a_schedule():
    schedule = keras.optimizers.schedules.PolynomialDecay(0.0, 10, 1.0)
    objective = CompositeObjective({"l1": Term("l1", schedule)})
    np.testing.assert_allclose(to_numpy(objective.compute(X)[0]), 0.0)
    objective.set_weight("l1", 0.25)
    np.testing.assert_allclose(to_numpy(objective.compute(X)[0]), 0.25 * O.np_l1(X, "sum_over_batch_size"), rtol=1e-5)


# ---------------------------------------------------------------- inside fit

STEPS_PER_EPOCH = 4
BATCH = 8


def _frozen_model(objective):
    """Dense → objective → Dense, trained at learning rate 0: the weights never
    move, so with identical batches every step's values are the same."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(5, name="hidden")(inputs)
    hidden = objective(hidden)
    outputs = keras.layers.Dense(2, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    return model


def _identical_batches(epochs=1):
    rng = np.random.default_rng(1)
    xb = rng.normal(size=(BATCH, 3)).astype(np.float32)
    yb = rng.normal(size=(BATCH, 2)).astype(np.float32)
    n = STEPS_PER_EPOCH
    return np.tile(xb, (n, 1)), np.tile(yb, (n, 1)), xb, yb


def _hidden_and_base(model, xb, yb):
    kernel, bias = (to_numpy(w).astype(np.float64) for w in model.get_layer("hidden").weights)
    hidden = xb.astype(np.float64) @ kernel + bias
    head_k, head_b = (to_numpy(w).astype(np.float64) for w in model.get_layer("head").weights)
    base = np.mean((hidden @ head_k + head_b - yb) ** 2)
    return hidden, base


def test_fit_minimizes_base_plus_weighted_terms_with_schedule_and_logs_each_term():
    # KL-annealing style: the weight of "mag" rises linearly from 0 to 1 over
    # 6 steps; step t uses schedule(t).
    schedule = keras.optimizers.schedules.PolynomialDecay(0.0, 6, 1.0)
    objective = CompositeObjective(
        {"l1": Term("l1", 0.01), "mag": Term("output_magnitude", schedule, options={"target": 0.5})}, name="obj"
    )
    model = _frozen_model(objective)
    x, y, xb, yb = _identical_batches()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]
    ).history
    hidden, base = _hidden_and_base(model, xb, yb)
    l1, mag = O.np_l1(hidden, "sum_over_batch_size"), O.np_output_magnitude(hidden, 0.5)
    for epoch in range(3):
        steps = np.arange(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        mean_weight = np.mean(np.minimum(steps / 6.0, 1.0))
        np.testing.assert_allclose(history["loss"][epoch], base + 0.01 * l1 + mean_weight * mag, rtol=1e-5)
        np.testing.assert_allclose(history["obj/l1"][epoch], l1, rtol=1e-5)
        np.testing.assert_allclose(history["obj/mag"][epoch], mag, rtol=1e-5)
    assert int(to_numpy(objective.step)) == 3 * STEPS_PER_EPOCH


class _Control(keras.callbacks.Callback):
    """Disables "l1" for epoch 1 and sets "l2"'s weight to 3 from epoch 2 on,
    reaching the objective through self.model (which syncs JAX state)."""

    def on_epoch_begin(self, epoch, logs=None):
        objective = self.model.get_layer("obj")
        if epoch == 1:
            objective.disable("l1")
        if epoch == 2:
            objective.enable("l1")
            objective.set_weight("l2", 3.0)


def test_changes_during_fit_take_effect_next_step_without_retracing():
    traces = []

    def counted_l2(x):
        traces.append(1)  # Python runs once per trace (per call on torch)
        return P.l2(x)

    def run(callbacks):
        traces.clear()
        objective = CompositeObjective({"l1": Term("l1", 0.1), "l2": Term(counted_l2, 0.5)}, name="obj")
        model = _frozen_model(objective)
        x, y, xb, yb = _identical_batches()
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
        return history.history["loss"], _hidden_and_base(model, xb, yb), len(traces)

    losses, (hidden, base), changed_traces = run([_Control()])
    # counted_l2 calls the op with its own default reduction, the sum.
    l1, l2 = O.np_l1(hidden, "sum_over_batch_size"), O.np_l2(hidden)
    np.testing.assert_allclose(losses[0], base + 0.1 * l1 + 0.5 * l2, rtol=1e-5)
    np.testing.assert_allclose(losses[1], base + 0.5 * l2, rtol=1e-5)
    np.testing.assert_allclose(losses[2], base + 0.1 * l1 + 3.0 * l2, rtol=1e-5)
    _, _, plain_traces = run([])
    assert changed_traces == plain_traces


def test_evaluate_logs_terms_and_validation_is_prefixed():
    objective = CompositeObjective({"ent": Term("entropy", options={"from_logits": True})}, name="obj")
    model = _frozen_model(objective)
    x, y, xb, yb = _identical_batches()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, validation_data=(x, y), verbose=0, callbacks=[PenaltyMonitor()]
    ).history
    hidden, _ = _hidden_and_base(model, xb, yb)
    expected = _np_entropy_logits(hidden)
    np.testing.assert_allclose(history["val_obj/ent"][0], expected, rtol=1e-5)
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True, callbacks=[PenaltyMonitor()])
    np.testing.assert_allclose(logs["obj/ent"], expected, rtol=1e-5)
    # A later evaluate without the monitor reports the values too.
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["obj/ent"], expected, rtol=1e-5)


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(dict(logs))


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_terms_are_logged_without_the_monitor_after_a_monitored_fit(run_eagerly):
    # Issue 41: after fit with a probing monitor, evaluate and fit without it
    # logged NaN for the objective's terms on every backend. Batches differ,
    # so each batch's log is the running mean of the batches so far.
    objective = CompositeObjective({"l1": Term("l1", 1e-2), "mag": Term("output_magnitude", 1e-2)}, name="act")
    model = _frozen_model(objective)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse", run_eagerly=run_eagerly)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(STEPS_PER_EPOCH * BATCH, 3)).astype(np.float32)
    y = rng.normal(size=(STEPS_PER_EPOCH * BATCH, 2)).astype(np.float32)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        verbose=0,
        callbacks=[PenaltyMonitor(probe_data=(x[:BATCH], y[:BATCH]), every_n_batches=1)],
    )
    hidden, _ = _hidden_and_base(model, x, y)
    batches = hidden.reshape(STEPS_PER_EPOCH, BATCH, -1)
    per_batch = {
        "act/l1": [O.np_l1(h, "sum_over_batch_size") for h in batches],
        "act/mag": [O.np_output_magnitude(h) for h in batches],
    }
    seen = _BatchLogs()
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True, callbacks=[seen])
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[seen]).history
    assert len(seen.test) == len(seen.train) == STEPS_PER_EPOCH
    for key, values in per_batch.items():
        running = np.cumsum(values) / np.arange(1, STEPS_PER_EPOCH + 1)
        np.testing.assert_allclose(logs[key], running[-1], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(history[key], [running[-1]], rtol=1e-5, err_msg=key)
        # Each batch's log: the running mean, read inside the step.
        np.testing.assert_allclose([b[key] for b in seen.test], running, rtol=1e-5, err_msg=key)
        np.testing.assert_allclose([b[key] for b in seen.train], running, rtol=1e-5, err_msg=key)


# ---------------------------------------------------------------- serialization


def test_objective_in_functional_model_saves_and_loads(tmp_path):
    schedule = keras.optimizers.schedules.PolynomialDecay(0.0, 100, 1.0)
    keras.utils.set_random_seed(0)
    student_in = keras.Input((3,), name="x")
    student = keras.layers.Dense(4, name="student")(student_in)
    teacher = keras.layers.Dense(4, name="teacher", trainable=False)(student_in)
    objective = CompositeObjective(
        {
            "kd": Term(L.KLDivergence(from_logits=True, temperature=2.0), schedule, inputs=("teacher", "student")),
            "ent": Term("entropy", 0.1, inputs="student", options={"from_logits": True, "normalize": True}),
            "mag": Term(R.OutputMagnitude(1.0, target=2.0), 0.3, inputs="student"),
        },
        name="objective",
    )
    outputs = objective({"student": student, "teacher": teacher})["student"]
    model = keras.Model(student_in, outputs)
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(2).normal(size=(16, 3)).astype(np.float32)
    y = np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    objective.disable("mag")
    loaded = save_and_load(model, tmp_path)

    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    revived = loaded.get_layer("objective")
    assert int(to_numpy(revived.step)) == int(to_numpy(objective.step)) == 8
    assert revived.get_config()["terms"] == objective.get_config()["terms"]
    model(x)
    loaded(x)
    np.testing.assert_allclose(to_numpy(loaded.losses[0]), to_numpy(model.losses[0]), rtol=1e-6)
    # The disabled term stays disabled after loading.
    inputs = {"student": model.get_layer("student")(x), "teacher": model.get_layer("teacher")(x)}
    assert list(revived.compute(inputs)[1]) == ["kd", "ent"]
    np.testing.assert_allclose(to_numpy(revived.compute(inputs)[0]), to_numpy(objective.compute(inputs)[0]), rtol=1e-6)


def test_term_config_round_trip():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5)
    for term in (
        Term("entropy", 0.1, options={"from_logits": True}),
        Term(P.kl_divergence, schedule, inputs=("p", "q"), options={"direction": "reverse"}),
        Term(R.L2(0.3, center="mean"), enabled=False),
        Term(L.JSDivergence(from_logits=True), 2.0, inputs=(0, 1)),
    ):
        config = keras.saving.serialize_keras_object(term)
        assert config["registered_name"] == "keras_penalties>Term"
        revived = keras.saving.deserialize_keras_object(config)
        assert revived.get_config() == term.get_config()


# ---------------------------------------------------------------- errors


def _bad_scalar(x):
    return P.l1(x, reduction="none")


CONSTRUCTION_ERRORS = {
    "empty_name": (lambda: CompositeObjective({"": "l1"}), ValueError, r"Term names must be non-empty strings"),
    "duplicate": (lambda: CompositeObjective([("a", "l1"), ("a", "l2")]), ValueError, r"Duplicate term name 'a'"),
    "metric_name": (
        lambda: CompositeObjective({"kl/student": "l1"}),
        ValueError,
        r"Term name 'kl/student' cannot be a metric name",
    ),
    "no_terms": (lambda: CompositeObjective({}), ValueError, r"at least one term"),
    "negative_weight": (
        lambda: CompositeObjective({"l1": Term("l1", 1.0)}, weights={"l1": -0.5}),
        ValueError,
        r"Term 'l1': `weight` must be >= 0",
    ),
    "nan_weight": (
        lambda: CompositeObjective({"l1": "l1"}, weights={"l1": math.nan}),
        ValueError,
        r"Term 'l1': `weight` must be finite",
    ),
    "term_weight": (lambda: Term("l1", -1.0), ValueError, r"`weight` must be >= 0"),
    "unknown_weight": (
        lambda: CompositeObjective({"l1": "l1"}, weights={"l2": 1.0}),
        ValueError,
        r"`weights` names unknown term\(s\) \['l2'\]",
    ),
    "unknown_penalty": (
        lambda: CompositeObjective({"x": "l3"}),
        ValueError,
        r"Term 'x': `penalty` must name a keras_penalties.ops function",
    ),
    "bad_option": (
        lambda: CompositeObjective({"ent": Term("entropy", options={"temperature": 0})}),
        ValueError,
        r"`temperature` must be > 0",
    ),
    "unknown_option": (lambda: Term("l1", options={"center": 1}), TypeError, r"l1\(\) got unknown option"),
    "options_on_loss": (
        lambda: Term(L.KLDivergence(), options={"axis": 0}),
        ValueError,
        r"configure a KLDivergence through its constructor",
    ),
    "bad_penalty": (lambda: Term(3.0), TypeError, r"`penalty` must be"),
    "bad_inputs": (lambda: Term("l1", inputs=[]), ValueError, r"`inputs` must be None or a non-empty sequence"),
}


@pytest.mark.parametrize("name", list(CONSTRUCTION_ERRORS))
def test_construction_errors_name_the_term(name):
    make, error, message = CONSTRUCTION_ERRORS[name]
    with pytest.raises(error, match=message):
        make()


CALL_ERRORS = {
    "missing_input": (
        {"kd": Term("kl_divergence", inputs=("teacher", "student"))},
        {"student": X},
        r"Term 'kd' takes inputs \['teacher', 'student'\], but \['teacher'\] is not among the fed inputs \['student'\]",
    ),
    "dict_without_inputs": ({"l1": "l1"}, {"a": X}, r"Term 'l1' has no `inputs`, but the objective was fed a dict"),
    "names_on_tensor": (
        {"kd": Term("kl_divergence", inputs=("a", "b"))},
        X,
        r"Term 'kd' takes inputs \['a', 'b'\], but the objective was fed a single tensor",
    ),
    "not_scalar": ({"bad": Term(_bad_scalar)}, X, r"Term 'bad' must return a scalar; it returned shape \(4, 5\)"),
    "loss_one_input": ({"kl": Term(L.KLDivergence())}, X, r"a Loss takes two tensors"),
}


@pytest.mark.parametrize("name", list(CALL_ERRORS))
def test_call_errors_name_the_term(name):
    terms, inputs, message = CALL_ERRORS[name]
    with pytest.raises(ValueError, match=message):
        CompositeObjective(terms).compute(inputs)


# ---------------------------------------------------------------- report


def test_report_schema_and_values():
    objective = CompositeObjective({"l1": Term("l1", 0.5), "l2": Term("l2", 2.0), "off": Term("l1", enabled=False)})
    report = objective.report(X, base_loss=2.5)
    assert json.loads(json.dumps(report)) == report
    assert set(report) == {"loss_total", "regularizer_total", "base_loss", "regularizers", "total_grad_norm"}
    assert list(report["regularizers"]) == ["l1", "l2"]
    l1, l2 = O.np_l1(X, "sum_over_batch_size"), O.np_l2(X, "sum_over_batch_size")
    entry = report["regularizers"]["l2"]
    np.testing.assert_allclose(entry["value"], l2, rtol=1e-5)
    assert entry["weight"] == 2.0
    np.testing.assert_allclose(entry["contribution"], 2.0 * l2, rtol=1e-5)
    assert entry["grad_norm"] is None and entry["grad_norm_weighted"] is None
    np.testing.assert_allclose(report["regularizer_total"], 0.5 * l1 + 2.0 * l2, rtol=1e-5)
    np.testing.assert_allclose(report["loss_total"], 2.5 + 0.5 * l1 + 2.0 * l2, rtol=1e-5)
    assert report["base_loss"] == {"value": 2.5, "grad_norm": None}
    assert report["total_grad_norm"] is None


def test_report_gradient_norms_match_closed_forms():
    from keras import ops

    objective = CompositeObjective({"l1": Term("l1", 0.5), "l2": Term("l2", 2.0)})
    report = objective.report(X, base_loss=lambda x: ops.sum(x), grad_norms=True)
    x = X.astype(np.float64)
    regs = report["regularizers"]
    n = len(x)  # l1 and l2 are per-sample means in an objective
    np.testing.assert_allclose(regs["l1"]["grad_norm"], np.sqrt(x.size) / n, rtol=1e-5)  # ∇Σ|x|/n = sign x / n
    np.testing.assert_allclose(regs["l2"]["grad_norm"], 2 * np.linalg.norm(x) / n, rtol=1e-5)  # ∇Σx²/n = 2x/n
    np.testing.assert_allclose(regs["l2"]["grad_norm_weighted"], 4 * np.linalg.norm(x) / n, rtol=1e-5)
    np.testing.assert_allclose(report["base_loss"]["grad_norm"], np.sqrt(x.size), rtol=1e-5)
    np.testing.assert_allclose(
        report["total_grad_norm"], np.linalg.norm((0.5 * np.sign(x) + 4 * x) / n + 1.0), rtol=1e-5
    )


def test_gradient_norms_over_dict_inputs():
    from keras_penalties.gradients import gradient_norms

    objective = CompositeObjective(
        {"kd": Term("kl_divergence", 0.5, inputs=("teacher", "student"), options={"from_logits": True})}
    )
    norms = gradient_norms(objective, {"student": X, "teacher": TEACHER})
    t, s = TEACHER.astype(np.float64), X.astype(np.float64)
    p, q = special.softmax(t, -1), special.softmax(s, -1)
    batch = len(t)
    # KL(p‖q) from logits: ∂/∂s = (q − p)/B, ∂/∂t = p ⊙ (log p − log q − KLᵢ)/B.
    kl_rows = np.sum(p * (np.log(p) - np.log(q)), axis=-1, keepdims=True)
    d_student = (q - p) / batch
    d_teacher = p * (np.log(p) - np.log(q) - kl_rows) / batch
    expected = np.sqrt(np.sum(d_student**2) + np.sum(d_teacher**2))
    np.testing.assert_allclose(norms["kd"], expected, rtol=1e-4)
    np.testing.assert_allclose(norms["total"], 0.5 * expected, rtol=1e-4)


@pytest.mark.skipif(BACKEND != "jax", reason="only JAX traces a user's own jit without Keras' stateless scope")
def test_a_composite_in_a_users_jit_leaves_its_running_sums():
    # A trace of the user's own: the running sums cannot hold its values, so
    # they are left alone (and stay usable eagerly after it).
    import jax

    objective = CompositeObjective({"l1": "l1"}, name="jitted")
    x = np.array([[1.0, -2.0]], "float32")
    objective(x, training=True)
    jax.jit(lambda t: objective(t, training=True))(x)
    objective(2 * x, training=True)
    np.testing.assert_allclose(objective.running_values()["l1"], (3.0 + 6.0) / 2, rtol=1e-6)
