"""keras_penalties.losses: values, sample weights, masks, training in fit, config and errors."""

import math

import keras
import numpy as np
import pytest
from scipy import special

from keras_penalties import losses as L
from tests import oracles as O
from tests.testing import assert_config_round_trip, to_numpy

PACKAGE = "keras_penalties.losses"


def _entropy_per_sample(y_pred, sign=1.0, **options):
    return sign * O.np_entropy(y_pred, reduction="none", **options)


# name -> (loss, input kind, NumPy per-sample values of (y_true, y_pred))
LOSSES = {
    "kl": (L.KLDivergence(), "probs2", lambda t, p: O.np_kl_divergence(t, p, reduction="none")),
    "kl_logits_reverse_T": (
        L.KLDivergence(from_logits=True, direction="reverse", temperature=2.0),
        "logits2",
        lambda t, p: O.np_kl_divergence(t, p, True, "reverse", 2.0, reduction="none"),
    ),
    "kl_symmetric": (
        L.KLDivergence(direction="symmetric"),
        "probs2",
        lambda t, p: O.np_kl_divergence(t, p, direction="symmetric", reduction="none"),
    ),
    "js_logits": (
        L.JSDivergence(from_logits=True),
        "logits2",
        lambda t, p: O.np_js_divergence(t, p, True, reduction="none"),
    ),
    "js_beta_logits": (
        L.JSDivergence(from_logits=True, beta=0.2),
        "logits2",
        lambda t, p: O.np_js_divergence(t, p, True, reduction="none", beta=0.2),
    ),
    "entropy": (L.Entropy(), "probs2", lambda t, p: _entropy_per_sample(p)),
    "entropy_bonus": (
        L.Entropy(from_logits=True, mode="bonus", normalize=True, temperature=0.5),
        "logits2",
        lambda t, p: _entropy_per_sample(p, -1.0, from_logits=True, normalize=True, temperature=0.5),
    ),
    # Chunked rows (3 per chunk; the batches have 6 rows): the same numbers.
    "kl_chunked": (
        L.KLDivergence(from_logits=True, direction="symmetric", chunk_size=4),
        "logits2",
        lambda t, p: O.np_kl_divergence(t, p, True, "symmetric", reduction="none"),
    ),
    "js_chunked": (
        L.JSDivergence(from_logits=True, beta=0.7, chunk_size=4),
        "logits2",
        lambda t, p: O.np_js_divergence(t, p, True, reduction="none", beta=0.7),
    ),
    "entropy_chunked": (
        L.Entropy(from_logits=True, temperature=0.5, chunk_size=1),
        "logits2",
        lambda t, p: _entropy_per_sample(p, from_logits=True, temperature=0.5),
    ),
    "consistency_mse": (L.Consistency(), "real2", lambda t, p: O.np_consistency(t, p, reduction="none")),
    "consistency_cosine": (
        L.Consistency(metric="cosine"),
        "real2",
        lambda t, p: O.np_consistency(t, p, "cosine", reduction="none"),
    ),
    "consistency_js_logits": (
        L.Consistency(metric="js", from_logits=True),
        "logits2",
        lambda t, p: O.np_consistency(t, p, "js", True, reduction="none"),
    ),
}


def _batch(kind, seed=0, shape=(6, 5)):
    return O.make_inputs(kind, shape, np.random.default_rng(seed))


@pytest.mark.parametrize("name", list(LOSSES))
def test_value_with_sample_weight_matches_oracle(name):
    loss, kind, per_sample = LOSSES[name]
    y_true, y_pred = _batch(kind)
    weights = np.linspace(0.0, 2.0, len(y_true)).astype(np.float32)
    values = per_sample(y_true.astype(np.float64), y_pred.astype(np.float64))
    np.testing.assert_allclose(to_numpy(loss(y_true, y_pred)), values.mean(), rtol=1e-5, atol=1e-6)
    # sum_over_batch_size: Σ wᵢ·vᵢ / batch size.
    np.testing.assert_allclose(
        to_numpy(loss(y_true, y_pred, sample_weight=weights)), (weights * values).mean(), rtol=1e-5, atol=1e-6
    )


def test_kl_agrees_with_keras_kl_divergence():
    rng = np.random.default_rng(3)
    y_true, y_pred = O.make_inputs("probs2", (16, 7), rng)
    ours = to_numpy(L.KLDivergence()(y_true, y_pred))
    theirs = to_numpy(keras.losses.KLDivergence()(y_true, y_pred))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "none", "mean_with_sample_weight"])
def test_keras_reductions(reduction):
    y_true, y_pred = _batch("probs2")
    weights = np.arange(1, 7, dtype=np.float32)
    values = O.np_kl_divergence(y_true.astype(np.float64), y_pred.astype(np.float64), reduction="none") * weights
    expected = {
        "sum": values.sum(),
        "sum_over_batch_size": values.mean(),
        "none": values,
        "mean_with_sample_weight": values.sum() / weights.sum(),
    }[reduction]
    actual = L.KLDivergence(reduction=reduction)(y_true, y_pred, sample_weight=weights)
    np.testing.assert_allclose(to_numpy(actual), expected, rtol=1e-5)


def test_mask_excludes_padded_timesteps():
    # A sequence model whose mask (from Masking) reaches the loss: padded
    # steps count neither in the sum nor in the average.
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 4, 2)).astype(np.float32)
    x[0, 2:] = 0.0
    x[2, 1:] = 0.0
    y = O.make_inputs("probs", (3, 4, 5), rng)[0]
    inputs = keras.Input((4, 2))
    outputs = keras.layers.Dense(5, activation="softmax")(keras.layers.Masking(0.0)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(loss=L.KLDivergence())
    valid = np.any(x != 0.0, axis=-1)
    per_step = O.np_kl_divergence(
        y.astype(np.float64), model.predict(x, verbose=0).astype(np.float64), reduction="none"
    )
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), per_step[valid].mean(), rtol=1e-5)


# name -> (loss, output activation); targets are a random teacher's outputs
FIT_CASES = {
    "kl": (L.KLDivergence(), "softmax"),
    "kl_logits_T": (L.KLDivergence(from_logits=True, temperature=2.0), None),
    "kl_reverse_logits": (L.KLDivergence(from_logits=True, direction="reverse"), None),
    "js": (L.JSDivergence(from_logits=True), None),
    "entropy": (L.Entropy(from_logits=True), None),
    "consistency": (L.Consistency(metric="kl", from_logits=True), None),
}


@pytest.mark.parametrize("name", list(FIT_CASES))
def test_loss_trains_in_fit_and_evaluates_to_oracle(name):
    loss, activation = FIT_CASES[name]
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    teacher = x @ rng.normal(size=(4, 3)).astype(np.float32)
    y = special.softmax(teacher, axis=-1).astype(np.float32) if activation == "softmax" else teacher
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation=activation)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0).history["loss"]
    assert history[-1] < history[0], history
    # One fixed batch: evaluate must equal the NumPy value on the predictions.
    pred = model.predict(x, verbose=0).astype(np.float64)
    expected = {
        "kl": lambda: O.np_kl_divergence(y, pred),
        "kl_logits_T": lambda: O.np_kl_divergence(y, pred, True, temperature=2.0),
        "kl_reverse_logits": lambda: O.np_kl_divergence(y, pred, True, "reverse"),
        "js": lambda: O.np_js_divergence(y, pred, True),
        "entropy": lambda: O.np_entropy(pred, True),
        "consistency": lambda: O.np_consistency(y, pred, "kl", True),
    }[name]()
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=64, verbose=0), expected, rtol=1e-5)


@pytest.mark.parametrize("loss", [case[0] for case in LOSSES.values()], ids=list(LOSSES))
def test_config_round_trip(loss):
    assert_config_round_trip(loss, keras.losses.get, PACKAGE)


def test_config_holds_every_option():
    loss = L.KLDivergence(from_logits=True, direction="symmetric", temperature=3.0, axis=1, reduction="sum", name="kd")
    assert loss.get_config() == {
        # First, so loading without the package names it (see test_saving).
        "import_keras_penalties_before_loading": True,
        "name": "kd",
        "reduction": "sum",
        "dtype": "float32",
        "from_logits": True,
        "direction": "symmetric",
        "temperature": 3.0,
        "axis": 1,
        "chunk_size": None,
    }
    assert L.Entropy(mode="bonus").get_config()["mode"] == "bonus"


def test_entropy_ignores_y_true():
    y_pred = _batch("probs2")[1]
    np.testing.assert_allclose(to_numpy(L.Entropy()(None, y_pred)), to_numpy(L.Entropy()(y_pred * 0, y_pred)))


def _counting_keras_calls(monkeypatch):
    calls = []
    keras_call = keras.losses.Loss.__call__
    monkeypatch.setattr(keras.losses.Loss, "__call__", lambda *a, **k: calls.append(1) or keras_call(*a, **k))
    return calls


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5), (5,)])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_tensors_reduce_as_keras_loss_call_does(name, reduction, shape, monkeypatch):
    # On tensors of the loss's dtype with nothing to weigh or mask, a loss
    # reduces with the ops' own reduction, without Keras' Loss.__call__
    # (its per-call work is half an Entropy term's time on eager torch);
    # Keras' own __call__ on the same tensors is the oracle: a mean over
    # positions, not samples, for [batch, time, classes], and a lone
    # distribution's value as it is.
    loss, kind, _ = LOSSES[name]
    if shape == (5,) and name == "consistency_cosine":
        pytest.skip("cosine compares samples: it needs a batch axis")
    loss = loss.__class__.from_config({**loss.get_config(), "reduction": reduction})
    y_true, y_pred = (keras.ops.convert_to_tensor(t) for t in O.make_inputs(kind, shape, np.random.default_rng(5)))
    expected = to_numpy(keras.losses.Loss.__call__(loss, y_true, y_pred))
    calls = _counting_keras_calls(monkeypatch)
    np.testing.assert_allclose(to_numpy(loss(y_true, y_pred)), expected, rtol=1e-6, atol=1e-7)
    assert not calls
    empty = keras.ops.zeros((0,) + shape[1:])
    if len(shape) > 1:
        assert float(to_numpy(loss(empty, empty))) == 0.0 and not calls
    # Anything Keras' __call__ would do more than reduce goes through it:
    # half-precision inputs, sample weights (a Keras mask: the next test).
    loss(keras.ops.cast(y_true, "float16"), keras.ops.cast(y_pred, "float16"))
    if len(shape) == 2:
        loss(y_true, y_pred, sample_weight=keras.ops.ones(shape[:1]))
    assert len(calls) == 1 + (len(shape) == 2)


def test_masked_predictions_and_overridden_call_go_through_keras(monkeypatch):
    y_true, y_pred = (keras.ops.convert_to_tensor(t) for t in _batch("probs2"))
    masked = keras.layers.Masking(mask_value=0.0)(keras.ops.where(keras.ops.arange(6)[:, None] < 2, 0.0, y_pred))

    class Doubled(L.KLDivergence):
        def call(self, y_true, y_pred):
            return 2.0 * super().call(y_true, y_pred)

    calls = _counting_keras_calls(monkeypatch)
    L.KLDivergence()(y_true, masked)
    assert len(calls) == 1
    plain = to_numpy(L.KLDivergence()(y_true, y_pred))
    np.testing.assert_allclose(to_numpy(Doubled()(y_true, y_pred)), 2.0 * plain, rtol=1e-6)
    assert len(calls) == 2
    # Entropy reads no y_true: integer labels in y_true keep it on the direct path.
    L.Entropy()(keras.ops.zeros((6,), "int32"), y_pred)
    assert len(calls) == 2


ERRORS = {
    "direction": (lambda: L.KLDivergence(direction="up"), ValueError, r"`direction` must be one of"),
    "temperature": (lambda: L.KLDivergence(temperature=-2.0), ValueError, r"`temperature` must be > 0"),
    "temperature_nan": (lambda: L.JSDivergence(temperature=math.nan), ValueError, r"`temperature` must be finite"),
    "entropy_mode": (lambda: L.Entropy(mode="maximize"), ValueError, r"`mode` must be one of 'penalty', 'bonus'"),
    "metric": (lambda: L.Consistency(metric="dot"), ValueError, r"`metric` must be one of"),
    "axis": (lambda: L.Entropy(axis="last"), TypeError, r"`axis` must be an int"),
    "from_logits": (lambda: L.JSDivergence(from_logits="true"), TypeError, r"`from_logits` must be a bool"),
    "reduction": (lambda: L.KLDivergence(reduction="average"), ValueError, r"reduction"),
    "chunk_size": (lambda: L.JSDivergence(chunk_size=0), ValueError, r"`chunk_size` must be an int >= 1"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_construction_errors_name_the_argument(name):
    make, error, message = ERRORS[name]
    with pytest.raises(error, match=message):
        make()
