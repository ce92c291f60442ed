"""PenaltyMonitor(external=...): scores outside the compiled step, run
concurrently with a timeout; failures log NaN and warn once."""

import math
import time
import warnings

import keras
import numpy as np
import pytest

from keras_penalties import CompositeObjective
from keras_penalties.callbacks import PenaltyMonitor

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 4)).astype("float32")
Y = RNG.normal(size=(32, 2)).astype("float32")


def _model():
    inputs = keras.Input((4,))
    hidden = CompositeObjective({"l2": "l2"}, name="obj")(keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile("sgd", "mse")
    return model


def _sleeper(seconds, value):
    def score(x, y, y_pred):
        time.sleep(seconds)
        return value

    return score


def test_scores_see_the_probe_batch_and_the_output_and_are_logged():
    model = _model()
    seen = {}

    def mse(x, y, y_pred):
        seen.update(x=x, y=y, y_pred=y_pred)
        return float(np.mean((y_pred - y) ** 2))

    def both(x, y, y_pred):
        return {"max": float(np.max(y_pred)), "rows": len(x)}

    monitor = PenaltyMonitor(probe_data=(X[:8], Y[:8]), every_n_batches=2, external={"mse": mse, "stats": both})
    history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor]).history
    assert isinstance(seen["x"], np.ndarray) and isinstance(seen["y_pred"], np.ndarray)
    np.testing.assert_array_equal(seen["x"], X[:8])
    np.testing.assert_array_equal(seen["y"], Y[:8])
    # The output it got is the model's at that probe: its MSE is the probe's compiled loss.
    last = monitor.history[-1]
    np.testing.assert_allclose(last["external/mse"], np.mean((seen["y_pred"] - Y[:8]) ** 2), rtol=1e-6)
    for entry in monitor.history:
        np.testing.assert_allclose(entry["external/mse"], entry["base_loss"], rtol=1e-5)
    assert last["external/stats/rows"] == 8.0 and last["external/stats/seconds"] >= 0.0
    for key in ("external/mse", "external/mse/seconds", "external/stats/max", "external/stats/rows"):
        assert len(history[key]) == 2 and all(np.isfinite(history[key])), key
    # The epoch value is the mean over that epoch's probes (two per epoch here).
    epoch_two = [e["external/mse"] for e in monitor.history if e["epoch"] == 1]
    np.testing.assert_allclose(history["external/mse"][1], np.mean(epoch_two), rtol=1e-6)


def test_four_slow_scores_run_concurrently():
    model = _model()
    scores = {f"slow{i}": _sleeper(0.5, float(i)) for i in range(4)}
    monitor = PenaltyMonitor(probe_data=(X[:8], Y[:8]), external=scores)
    model.fit(X[:8], Y[:8], epochs=1, verbose=0)  # compile the step outside the timing
    monitor.set_model(model)
    monitor.probe()  # compiles the probe
    start = time.perf_counter()
    entry = monitor.probe()
    elapsed = time.perf_counter() - start
    assert [entry[f"external/slow{i}"] for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert all(0.45 <= entry[f"external/slow{i}/seconds"] < 1.0 for i in range(4))
    assert elapsed < 1.2, f"four 0.5 s scores took {elapsed:.2f} s per probe: not concurrent"


def test_failures_log_nan_warn_once_and_training_goes_on():
    model = _model()

    def broken(x, y, y_pred):
        raise RuntimeError("service unavailable")

    scores = {
        "broken": broken,
        "hangs": _sleeper(3.0, 1.0),  # bounded: it ends after the test
        "wrong": lambda x, y, y_pred: "high",
        "fine": lambda x, y, y_pred: 1.5,
    }
    monitor = PenaltyMonitor(probe_data=(X[:8], Y[:8]), every_n_batches=1, external=scores, external_timeout=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor]).history
        elapsed = time.perf_counter() - start
    messages = [str(w.message) for w in caught if "external score" in str(w.message)]
    for name in ("broken", "hangs", "wrong"):
        assert sum(f"'{name}'" in m for m in messages) == 1, (name, messages)
    assert not any("'fine'" in m for m in messages)
    assert len(monitor.history) == 4
    for entry in monitor.history:
        assert entry["external/fine"] == 1.5
        assert math.isnan(entry["external/broken"]) and math.isnan(entry["external/wrong"])
        assert math.isnan(entry["external/hangs"])
    # The hanging call is waited for once (the timeout), then not started again while it runs.
    assert monitor.history[0]["external/hangs/seconds"] == pytest.approx(0.3)
    assert all(e["external/hangs/seconds"] == 0.0 for e in monitor.history[1:])
    assert elapsed < 3.0, f"a hanging score held training up: {elapsed:.2f} s"
    assert math.isnan(history["external/broken"][0]) and history["external/fine"][0] == 1.5
    assert np.isfinite(history["loss"][0])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"external": [len]}, TypeError, "`external` must be a dict"),
        ({"external": {"bad name": len}}, ValueError, "`external` names"),
        ({"external": {"score": 3}}, TypeError, r"`external\['score'\]` must be a function"),
        ({"external": {"score": len}, "external_timeout": 0.0}, ValueError, "`external_timeout` must be > 0"),
        ({"external": {"score": len}, "probe_data": None}, ValueError, "give `probe_data`"),
    ],
)
def test_argument_errors(kwargs, error, match):
    kwargs = {"probe_data": (X[:4], Y[:4]), **kwargs}
    with pytest.raises(error, match=match):
        PenaltyMonitor(**kwargs)
