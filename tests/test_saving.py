"""Models using the regularizers and losses save to .keras and load back under safe_mode=True."""

import keras
import numpy as np

from keras_penalties import losses as L
from keras_penalties import regularizers as R
from tests.testing import save_and_load, to_numpy


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        8,
        activation="sigmoid",
        kernel_regularizer=R.Orthogonality(0.1, mode="spectral"),
        bias_regularizer=R.L1(0.01),
        activity_regularizer=R.KLSparsity(0.2, target=0.1),
        name="hidden",
    )(inputs)
    logits = keras.layers.Dense(
        4,
        kernel_regularizer=R.L2(0.01, center=0.1, clip=1.0),
        activity_regularizer=R.Entropy(0.1, from_logits=True, mode="bonus", normalize=True),
        name="logits",
    )(hidden)
    magnitude = keras.layers.Dense(
        3,
        kernel_regularizer=R.ElasticNet(0.05, l1_ratio=0.2),
        activity_regularizer=R.OutputMagnitude(0.3, target=2.0),
        name="magnitude",
    )(hidden)
    model = keras.Model(inputs, {"logits": logits, "magnitude": magnitude})
    # regularizers.Entropy and losses.Entropy in one model: they must come back
    # as their own classes.
    model.compile(
        optimizer="adam",
        loss={
            "logits": L.JSDivergence(from_logits=True, temperature=2.0),
            "magnitude": L.Entropy(from_logits=True, mode="penalty"),
        },
    )
    return model


def test_save_load_round_trip(tmp_path):
    model = _model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 6)).astype(np.float32)
    y = {"logits": rng.normal(size=(10, 4)).astype(np.float32), "magnitude": rng.normal(size=(10, 3)).astype(np.float32)}
    model.fit(x, y, epochs=1, verbose=0)
    loaded = save_and_load(model, tmp_path)

    for key, value in model.predict(x, verbose=0).items():
        np.testing.assert_array_equal(loaded.predict(x, verbose=0)[key], value)

    model(x)
    loaded(x)
    assert len(model.losses) == len(loaded.losses) == 7
    np.testing.assert_allclose([to_numpy(v) for v in loaded.losses], [to_numpy(v) for v in model.losses], rtol=1e-6)

    for layer in ("hidden", "logits", "magnitude"):
        for attr in ("kernel_regularizer", "bias_regularizer", "activity_regularizer"):
            original = getattr(model.get_layer(layer), attr)
            revived = getattr(loaded.get_layer(layer), attr)
            assert type(revived) is type(original)
            if original is not None:
                assert revived.get_config() == original.get_config()

    assert type(loaded.loss["logits"]) is L.JSDivergence
    assert type(loaded.loss["magnitude"]) is L.Entropy
    assert loaded.loss["logits"].get_config() == model.loss["logits"].get_config()
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6
    )
