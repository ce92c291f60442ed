"""CompositeLoss: a weighted sum of named losses in compile, with per-term logs."""

import keras
import numpy as np
import pytest
from scipy import special

from keras_penalties import Term
from keras_penalties import losses as L
from keras_penalties.callbacks import PenaltyMonitor
from tests import oracles as O
from tests.testing import save_and_load, to_numpy


def _ce(y, logits):
    return np.mean(-np.sum(y * special.log_softmax(logits, axis=-1), axis=-1))


def _loss():
    return L.CompositeLoss(
        {
            "ce": keras.losses.CategoricalCrossentropy(from_logits=True),
            "ent": L.Entropy(from_logits=True, mode="bonus"),
            "kl": Term("kl_divergence", options={"from_logits": True, "direction": "reverse"}),
            "conf": Term("entropy", options={"from_logits": True, "normalize": True}),
        },
        weights={"ce": 1.0, "ent": 0.01, "kl": 0.5, "conf": 0.2},
    )


def test_value_is_the_weighted_sum_of_terms():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 4)).astype(np.float32)
    y = keras.utils.to_categorical(rng.integers(0, 4, 6), 4).astype(np.float32)
    lg = logits.astype(np.float64)
    entropy = O.np_entropy(lg, from_logits=True)
    # The kl term compares y_true (as logits here) with y_pred.
    kl = O.np_kl_divergence(y.astype(np.float64), lg, True, "reverse")
    expected = _ce(y, lg) - 0.01 * entropy + 0.5 * kl + 0.2 * entropy / np.log(4)
    np.testing.assert_allclose(to_numpy(_loss()(y, logits)), expected, rtol=1e-5)


def test_sample_weights_reach_each_term():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 3)).astype(np.float32)
    y = special.softmax(rng.normal(size=(5, 3)), axis=-1).astype(np.float32)
    w = np.array([0.0, 1.0, 2.0, 1.0, 0.5], np.float32)
    loss = L.CompositeLoss({"kl": L.KLDivergence(from_logits=False), "js": L.JSDivergence()}, weights={"js": 2.0})
    probs = special.softmax(logits, axis=-1)
    expected = np.mean(w * O.np_kl_divergence(y, probs, reduction="none")) + 2.0 * np.mean(
        w * O.np_js_divergence(y, probs, reduction="none")
    )
    np.testing.assert_allclose(to_numpy(loss(y, probs, sample_weight=w)), expected, rtol=1e-5)


def test_fit_logs_each_term_with_the_monitor():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    xb = rng.normal(size=(8, 3)).astype(np.float32)
    yb = keras.utils.to_categorical(rng.integers(0, 4, 8), 4).astype(np.float32)
    x, y = np.tile(xb, (3, 1)), np.tile(yb, (3, 1))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=_loss())
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[PenaltyMonitor()]).history
    logits = model.predict(xb, verbose=0).astype(np.float64)
    entropy = O.np_entropy(logits, from_logits=True)
    expected = {
        "composite_loss/ce": _ce(yb, logits),
        "composite_loss/ent": -entropy,
        "composite_loss/kl": O.np_kl_divergence(yb.astype(np.float64), logits, True, "reverse"),
        "composite_loss/conf": entropy / np.log(4),
    }
    for key, value in expected.items():
        np.testing.assert_allclose(history[key], [value, value], rtol=1e-5, err_msg=key)
    weights = {"ce": 1.0, "ent": 0.01, "kl": 0.5, "conf": 0.2}
    total = sum(weights[k.split("/")[1]] * v for k, v in expected.items())
    np.testing.assert_allclose(history["loss"], [total, total], rtol=1e-5)
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True, callbacks=[PenaltyMonitor()])
    np.testing.assert_allclose(logs["composite_loss/ce"], expected["composite_loss/ce"], rtol=1e-5)
    # Once registered, the tracker goes on reporting true values without the monitor.
    later = model.fit(x, y, batch_size=8, verbose=0).history
    np.testing.assert_allclose(later["composite_loss/ce"], [expected["composite_loss/ce"]], rtol=1e-5)


def test_compiled_model_saves_and_loads(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss=_loss())
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = keras.utils.to_categorical(rng.integers(0, 4, 16), 4).astype(np.float32)
    model.fit(x, y, epochs=1, verbose=0)
    loaded = save_and_load(model, tmp_path)
    assert type(loaded.loss) is L.CompositeLoss
    assert loaded.loss.get_config() == model.loss.get_config()
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6)


def test_config_round_trip():
    loss = _loss()
    revived = keras.losses.get(keras.saving.serialize_keras_object(loss))
    assert type(revived) is L.CompositeLoss
    assert revived.get_config() == loss.get_config()


ERRORS = {
    "schedule": (
        lambda: L.CompositeLoss(
            {"ce": keras.losses.MeanSquaredError()},
            weights={"ce": keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5)},
        ),
        r"Term 'ce': CompositeLoss weights are numbers",
    ),
    "inputs": (
        lambda: L.CompositeLoss({"kl": Term("kl_divergence", inputs=("a", "b"))}),
        r"Term 'kl': a CompositeLoss term takes \(y_true, y_pred\)",
    ),
    "negative": (
        lambda: L.CompositeLoss({"ce": keras.losses.MeanSquaredError()}, weights={"ce": -1.0}),
        r"Term 'ce': `weight` must be >= 0",
    ),
    "unknown": (lambda: L.CompositeLoss({"ce": keras.losses.MeanSquaredError()}, weights={"x": 1.0}), r"unknown term"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_term(name):
    make, message = ERRORS[name]
    with pytest.raises(ValueError, match=message):
        make()


def test_non_scalar_term_is_an_error():
    loss = L.CompositeLoss({"l1": Term("l1", options={"reduction": "none"})})
    with pytest.raises(ValueError, match=r"Term 'l1' must return a scalar"):
        loss(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))


# -------------------------------------------------------- ops-function terms meet sample weights and masks as Losses do

_AS_LOSS = {
    # name -> (the ops-function term, the same number as one of our Losses)
    "kl": (
        lambda: Term("kl_divergence", options={"from_logits": True, "direction": "reverse"}),
        lambda: L.KLDivergence(from_logits=True, direction="reverse"),
    ),
    "js": (
        lambda: Term("js_divergence", options={"from_logits": True, "beta": 0.3}),
        lambda: L.JSDivergence(from_logits=True, beta=0.3),
    ),
    "entropy": (lambda: Term("entropy", options={"from_logits": True}), lambda: L.Entropy(from_logits=True)),
}


@pytest.mark.parametrize("policy", [None, "mixed_float16"])
@pytest.mark.parametrize("name", list(_AS_LOSS))
def test_ops_function_terms_meet_sample_weights_and_keras_masks_as_the_loss_compiled_alone(name, policy):
    # The oracle is Keras' own reduction: the same number from our Loss class
    # compiled alone, on a model whose Embedding(mask_zero=True) mask reaches
    # the loss, with per-sample weights.
    term, loss = _AS_LOSS[name]
    rng = np.random.default_rng(7)
    tokens = rng.integers(1, 9, size=(8, 6))
    tokens[:, 4:] = 0  # padding
    tokens[0, 1:] = 0
    teacher = rng.normal(size=(8, 6, 5)).astype(np.float32)
    weights = rng.uniform(0.0, 2.0, size=(8, 6)).astype(np.float32)  # per token, as Keras takes them for sequences

    def evaluate(compiled):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,), dtype="int32")
        logits = keras.layers.Dense(5)(keras.layers.Embedding(9, 4, mask_zero=True)(inputs))
        model = keras.Model(inputs, logits)
        model.compile(loss=compiled)
        return model.evaluate(tokens, teacher, sample_weight=weights, batch_size=8, verbose=0)

    if policy:
        keras.config.set_dtype_policy(policy)
    try:
        alone = evaluate(loss())
        composite = evaluate(L.CompositeLoss({"term": term()}))
    finally:
        keras.config.set_dtype_policy("float32")
    np.testing.assert_allclose(composite, alone, rtol=1e-5)


def test_ops_function_terms_weigh_per_sample_sums_and_take_both_tensors_where_the_op_does():
    rng = np.random.default_rng(8)
    y_true, y_pred = rng.normal(size=(2, 6, 3)).astype(np.float32)
    w = np.array([0.0, 1.0, 2.0, 1.0, 0.5, 3.0], np.float32)
    loss = L.CompositeLoss(
        {
            "l2": Term("l2"),  # per-sample Σx², over the batch size
            "l1_sum": Term("l1", options={"reduction": "sum"}),  # Σ over samples of Σ|x|
            "gauss": Term("gaussian_kl"),  # gaussian_kl(mean=y_true, log_var=y_pred)
        },
        weights={"l1_sum": 0.1, "gauss": 0.5},
    )
    y64, p64 = y_true.astype(np.float64), y_pred.astype(np.float64)
    gauss = 0.5 * np.sum(np.exp(p64) + y64**2 - 1.0 - p64, axis=-1)
    expected = (
        np.sum(w * np.sum(p64**2, axis=-1)) / 6
        + 0.1 * np.sum(w * np.sum(np.abs(p64), axis=-1))
        + 0.5 * np.sum(w * gauss) / 6
    )
    np.testing.assert_allclose(to_numpy(loss(y_true, y_pred, sample_weight=w)), expected, rtol=1e-5)
    # Unweighted, each term is the ops function's own value.
    unweighted = np.mean(np.sum(p64**2, axis=-1)) + 0.1 * np.sum(np.abs(p64)) + 0.5 * np.mean(gauss)
    np.testing.assert_allclose(to_numpy(loss(y_true, y_pred)), unweighted, rtol=1e-5)


def test_each_batch_logs_the_running_mean_of_the_terms():
    # Per-batch logs (the progress bar's, a callback's on_train_batch_end and
    # on_test_batch_end) hold each term's mean over the batches so far, as the
    # epoch's logs do: against NumPy, batch by batch, with a frozen model.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, kernel_initializer="ones")])
    model.compile(
        keras.optimizers.SGD(0.0),
        loss=L.CompositeLoss(
            {"mse": keras.losses.MeanSquaredError(), "ent": L.Entropy(from_logits=True)}, name="closs"
        ),
    )
    rng = np.random.default_rng(5)
    x = rng.normal(size=(12, 3)).astype(np.float32)
    y = rng.normal(size=(12, 4)).astype(np.float32)
    logits = (x @ np.ones((3, 4))).astype(np.float64)
    batches = [slice(i, i + 4) for i in (0, 4, 8)]
    mse = [np.mean((logits[b] - y[b]) ** 2) for b in batches]
    ent = [O.np_entropy(logits[b], from_logits=True) for b in batches]

    class BatchLogs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.train, self.test = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.train.append((float(logs["closs/mse"]), float(logs["closs/ent"])))

        def on_test_batch_end(self, batch, logs=None):
            self.test.append((float(logs["closs/mse"]), float(logs["closs/ent"])))

    seen = BatchLogs()
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[PenaltyMonitor(), seen])
    model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[seen])
    expected = np.stack([np.cumsum(mse) / np.arange(1, 4), np.cumsum(ent) / np.arange(1, 4)], axis=1)
    np.testing.assert_allclose(seen.train, expected, rtol=1e-5)
    np.testing.assert_allclose(seen.test, expected, rtol=1e-5)
