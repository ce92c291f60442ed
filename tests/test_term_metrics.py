"""Term(metrics=...): per-term custom numbers, reported beside the term and
never added to the loss."""

import keras
import numpy as np
import pytest

from keras_penalties import CompositeObjective, Term
from keras_penalties.callbacks import PenaltyMonitor
from keras_penalties.losses import CompositeLoss
from tests.testing import save_and_load

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4)).astype("float32")
Y = RNG.normal(size=(16, 3)).astype("float32")
KERNEL = RNG.normal(size=(4, 3)).astype("float32")


@keras.saving.register_keras_serializable(package="tests")
def zero_fraction(h):
    return keras.ops.mean(keras.ops.cast(keras.ops.equal(h, 0.0), "float32"))


@keras.saving.register_keras_serializable(package="tests")
def max_error(y_true, y_pred):
    return keras.ops.max(keras.ops.abs(y_true - y_pred))


def _model(metrics=None):
    """relu(x·K) with K frozen, so the activations are known; the objective
    and the loss each carry custom metrics."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(3, use_bias=False, activation="relu", trainable=False, name="frozen")
    term = Term("l1", 1e-3, metrics=metrics if metrics is not None else {"zeros": zero_fraction, "l2": "l2"})
    hidden = CompositeObjective({"sparsity": term}, name="obj")(dense(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden))
    dense.kernel.assign(KERNEL)
    loss = CompositeLoss({"mse": Term(keras.losses.MeanSquaredError(), metrics={"max_error": max_error})}, name="closs")
    model.compile(keras.optimizers.SGD(0.0), loss=loss)  # nothing moves: batch values are known
    return model


def _batches(fn, x, size):
    return np.mean([fn(x[i : i + size]) for i in range(0, len(x), size)])


def _hidden(x):
    return np.maximum(x.astype(np.float64) @ KERNEL, 0.0)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"], indirect=True)
def test_metrics_are_logged_beside_their_term(policy):
    model = _model()
    history = model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]).history
    rtol = 1e-5 if policy == "float32" else 2e-2
    np.testing.assert_allclose(
        history["obj/sparsity/zeros"][0], _batches(lambda x: np.mean(_hidden(x) == 0), X, 4), rtol=rtol
    )
    # An ops function named as a metric gets a term's default reduction: Σh² / batch.
    np.testing.assert_allclose(
        history["obj/sparsity/l2"][0], _batches(lambda x: np.sum(_hidden(x) ** 2) / len(x), X, 4), rtol=rtol
    )
    pred = keras.ops.convert_to_numpy(model.predict(X, verbose=0)).astype(np.float64)
    expected = np.mean([np.max(np.abs(Y[i : i + 4] - pred[i : i + 4])) for i in range(0, 16, 4)])
    np.testing.assert_allclose(history["closs/mse/max_error"][0], expected, rtol=rtol)
    result = model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True, callbacks=[PenaltyMonitor()])
    np.testing.assert_allclose(
        result["obj/sparsity/zeros"], _batches(lambda x: np.mean(_hidden(x) == 0), X, 8), rtol=rtol
    )


def test_metrics_never_count_in_the_loss():
    with_metrics = _model().fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0).history["loss"]
    without = _model(metrics={}).fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(with_metrics, without, rtol=1e-7)


def test_report_has_them_under_custom():
    objective = CompositeObjective({"sparsity": Term("l1", metrics={"zeros": zero_fraction}), "plain": Term("l2")})
    h = np.maximum(X, 0.0)
    report = objective.report(h)
    np.testing.assert_allclose(report["regularizers"]["sparsity"]["custom"]["zeros"], np.mean(h == 0), rtol=1e-6)
    assert report["regularizers"]["plain"]["custom"] == {}
    np.testing.assert_allclose(
        report["regularizer_total"], np.sum(np.abs(h)) / len(h) + np.sum(h**2) / len(h), rtol=1e-5
    )


def test_metrics_save_and_load(tmp_path):
    model = _model()
    loaded = save_and_load(model, tmp_path)
    term = loaded.get_layer("obj").terms["sparsity"]
    assert list(term.metrics) == ["zeros", "l2"] and term.metrics["zeros"] is zero_fraction
    assert term.get_config()["metrics"]["l2"] == "l2"
    history = loaded.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()]).history
    np.testing.assert_allclose(
        history["obj/sparsity/zeros"][0], _batches(lambda x: np.mean(_hidden(x) == 0), X, 4), rtol=1e-5
    )


def test_an_unregistered_function_saves_but_does_not_load(tmp_path):
    def local_metric(h):
        return keras.ops.mean(h)

    inputs = keras.Input((3,))
    model = keras.Model(inputs, CompositeObjective({"t": Term("l1", metrics={"m": local_metric})})(inputs))
    with pytest.raises(Exception, match="Could not locate function 'local_metric'"):
        save_and_load(model, tmp_path)


@pytest.mark.parametrize(
    "metrics, error, match",
    [
        ([zero_fraction], TypeError, "`metrics` must be a dict"),
        ({"bad name": zero_fraction}, ValueError, "`metrics` names"),
        ({"m": "median"}, ValueError, r"`metrics\['m'\]` must name a keras_penalties.ops function"),
        ({"m": 3}, TypeError, r"`metrics\['m'\]` must be a callable"),
    ],
)
def test_metric_errors_name_the_argument(metrics, error, match):
    with pytest.raises(error, match=match):
        Term("l1", metrics=metrics)
