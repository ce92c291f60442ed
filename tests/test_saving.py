"""Models using the regularizers and losses save to .keras and load back under safe_mode=True."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest

from keras_penalties import losses as L
from keras_penalties import regularizers as R
from tests.testing import save_and_load, to_numpy

DATA = pathlib.Path(__file__).resolve().parent / "data"


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
            "logits": L.JSDivergence(from_logits=True, temperature=2.0, beta=0.3),
            "magnitude": L.Entropy(from_logits=True, mode="penalty"),
        },
    )
    return model


def test_save_load_round_trip(tmp_path):
    model = _model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 6)).astype(np.float32)
    y = {
        "logits": rng.normal(size=(10, 4)).astype(np.float32),
        "magnitude": rng.normal(size=(10, 3)).astype(np.float32),
    }
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
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6)


# ---------------------------------------------------------------- what a .keras file may bring in


@keras.saving.register_keras_serializable(package="keras_penalties_tests")
def zero_fraction(x):
    return keras.ops.mean(keras.ops.cast(keras.ops.equal(x, 0.0), "float32"))


def _objective_model(term):
    from keras_penalties import CompositeObjective

    inputs = keras.Input((3,))
    outputs = CompositeObjective({"t": term}, name="obj")(keras.layers.Dense(2)(inputs))
    return keras.Model(inputs, outputs)


def test_registered_function_term_loads(tmp_path):
    from keras_penalties import Term

    model = _objective_model(Term(zero_fraction, 0.5))
    loaded = save_and_load(model, tmp_path)
    assert loaded.get_layer("obj").terms["t"].penalty is zero_fraction


@pytest.mark.parametrize(
    "function, message",
    [(keras.activations.relu, "refusing to load it"), (keras.config.set_floatx, "Could not locate function")],
    ids=["keras_builtin", "keras_config"],
)
def test_unregistered_importable_function_is_refused(tmp_path, function, message):
    from keras_penalties import Term

    # Keras rebuilds the functions of its own built-in modules by name: a
    # term is refused unless it is an ops function, a Loss, a Regularizer or
    # registered.
    model = _objective_model(Term(function))
    with pytest.raises((ValueError, TypeError), match=message):
        save_and_load(model, tmp_path)


def test_loading_without_importing_the_package_says_to_import_it(tmp_path):
    from keras_penalties import CompositeObjective

    inputs = keras.Input((3,))
    # L2 and KLDivergence share their names with Keras' own classes, which
    # Keras would otherwise build from our configs.
    hidden = keras.layers.Dense(2, kernel_regularizer=R.L2(0.1))(inputs)
    models = {
        "regularizer": keras.Model(inputs, hidden),
        "objective": keras.Model(inputs, CompositeObjective({"l1": "l1"})(hidden)),
    }
    models["loss"] = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    models["loss"].compile("sgd", loss=L.KLDivergence(from_logits=True))
    paths = {}
    for name, model in models.items():
        paths[name] = str(tmp_path / f"{name}.keras")
        model.save(paths[name])
    # One fresh process loads all three (each start imports the framework anew).
    script = (
        "import json, sys, keras\n"
        f"errors = {{}}\nfor name, path in {paths!r}.items():\n"
        "    try:\n        keras.saving.load_model(path)\n"
        "    except Exception as error:\n        errors[name] = str(error)\n"
        "    else:\n        errors[name] = 'loaded without keras_penalties'\n"
        "    assert 'keras_penalties' not in sys.modules\n"
        "print(json.dumps(errors))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(errors) == set(models)
    for name, error in errors.items():
        assert "import_keras_penalties_before_loading" in error, (name, error[-2000:])


def test_composite_loss_terms_are_reported_after_a_reload(tmp_path):
    from keras_penalties.callbacks import PenaltyMonitor

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones")])
    model.compile(
        keras.optimizers.SGD(0.0),
        loss=L.CompositeLoss(
            {"mse": keras.losses.MeanSquaredError(), "ent": L.Entropy(from_logits=True)}, name="closs"
        ),
    )
    x = np.ones((4, 3), "float32")
    loaded = save_and_load(model, tmp_path)
    history = loaded.fit(x, np.zeros((4, 2), "float32"), verbose=0, callbacks=[PenaltyMonitor()]).history
    # Outputs are 3 everywhere: mse 9, entropy of two equal logits ln 2.
    np.testing.assert_allclose(history["closs/mse"], [9.0], rtol=1e-6)
    np.testing.assert_allclose(history["closs/ent"], [np.log(2)], rtol=1e-6)


# ---------------------------------------------------------------- files saved by a release


def _version(text):
    return tuple(int(part) for part in text.split(".")[:3])


def _release_model_module():
    spec = importlib.util.spec_from_file_location("save_release_model", DATA / "save_release_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("saved_on", ["jax", "tensorflow", "torch"])
def test_files_saved_by_0_1_0_load(saved_on):
    # Saved by release 0.1.0's code (tests/data/save_release_model.py says how),
    # on each backend: the composites, the regularizers, ProximalDecay and
    # FAMO's state come back, and the model computes what the same model
    # built by today's code computes with the file's weights.
    import keras_penalties as kp

    path = DATA / f"release_0.1.0_{saved_on}.keras"
    with zipfile.ZipFile(path) as archive:
        saved_by = json.loads(archive.read("metadata.json"))["keras_version"]
    if _version(keras.__version__) < _version(saved_by):
        pytest.skip(f"saved by Keras {saved_by}, whose configs Keras {keras.__version__} cannot read (Keras' own)")
    release = _release_model_module()
    loaded = keras.saving.load_model(path)
    fresh = release.build_model()
    for layer in fresh.layers:
        layer.set_weights(loaded.get_layer(layer.name).get_weights())
    x, y = release.data()

    assert type(loaded.get_layer("act")) is kp.CompositeObjective
    assert type(loaded.loss) is L.CompositeLoss
    assert loaded.get_layer("act").get_config() == fresh.get_layer("act").get_config()
    assert loaded.loss.get_config() == fresh.loss.get_config()
    assert loaded.optimizer.get_config()["regularizer"] == fresh.optimizer.get_config()["regularizer"]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), fresh.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    loaded(x), fresh(x)
    np.testing.assert_allclose(
        [to_numpy(v) for v in loaded.losses], [to_numpy(v) for v in fresh.losses], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), fresh.evaluate(x, y, verbose=0), rtol=1e-5, atol=1e-6)
    # What training learned was saved and comes back: the uncertainty
    # weighting's log-variances, FAMO's weights (equal at the start).
    assert np.abs(to_numpy(loaded.get_layer("act").log_variances)).max() > 0
    famo = to_numpy(loaded.loss.effective_weights())
    assert np.abs(famo - famo.mean()).max() > 1e-3, famo
