"""keras_penalties.regularizers through real layers, their batch-size semantics, config and errors."""

import math

import keras
import numpy as np
import pytest
from scipy import stats

from keras_penalties import regularizers as R
from tests import oracles as O
from tests.testing import assert_config_round_trip, to_numpy

PACKAGE = "keras_penalties.regularizers"

# name -> (regularizer, NumPy value of reg(x) for a kernel or any tensor x)
KERNEL_REGULARIZERS = {
    "l1": (R.L1(0.3), lambda w: 0.3 * O.np_l1(w)),
    "l2": (R.L2(0.2), lambda w: 0.2 * O.np_l2(w)),
    "l2_center_clip": (R.L2(0.2, center=0.1, clip=0.5), lambda w: 0.2 * O.np_l2(w, center=0.1, clip=0.5)),
    "l2_center_mean": (R.L2(0.2, center="mean"), lambda w: 0.2 * O.np_l2(w, center="mean")),
    "elastic_net": (R.ElasticNet(0.5, l1_ratio=0.3), lambda w: 0.5 * O.np_elastic_net(w, l1_ratio=0.3)),
    "orthogonality_soft": (R.Orthogonality(0.7), lambda w: 0.7 * O.np_orthogonality(w)),
    "orthogonality_spectral_rows": (
        R.Orthogonality(0.7, mode="spectral", axis="rows", normalize=False),
        lambda w: 0.7 * O.np_orthogonality(w, mode="spectral", axis="rows", normalize=False),
    ),
    "orthogonality_hard": (R.Orthogonality(0.7, mode="hard"), lambda w: 0.7 * O.np_orthogonality(w, mode="hard")),
}


@pytest.mark.parametrize("name", list(KERNEL_REGULARIZERS))
def test_kernel_regularizer_through_dense(name):
    reg, expected = KERNEL_REGULARIZERS[name]
    layer = keras.layers.Dense(4, kernel_regularizer=reg)
    layer.build((None, 6))
    (loss,) = layer.losses
    kernel = to_numpy(layer.kernel).astype(np.float64)
    np.testing.assert_allclose(to_numpy(loss), expected(kernel), rtol=1e-5)


def _entropy_mean(out, sign=1.0, normalize=False, temperature=1.0):
    p = O._dist(out, from_logits=True, temperature=temperature)
    h = stats.entropy(p, axis=-1)
    return sign * np.mean(h / np.log(out.shape[-1]) if normalize else h)


# name -> (regularizer, activation, NumPy value of the loss the layer adds,
# given the layer's output [batch, units])
ACTIVITY_REGULARIZERS = {
    "entropy_penalty": (R.Entropy(0.1, from_logits=True), None, lambda o: 0.1 * _entropy_mean(o)),
    "entropy_bonus_normalized_T": (
        R.Entropy(0.2, from_logits=True, mode="bonus", normalize=True, temperature=2.0),
        None,
        lambda o: 0.2 * _entropy_mean(o, -1.0, True, 2.0),
    ),
    "entropy_probabilities": (
        R.Entropy(0.1),
        "softmax",
        lambda o: 0.1 * np.mean(stats.entropy(o, axis=-1)),
    ),
    "output_magnitude": (R.OutputMagnitude(0.3, target=0.5), None, lambda o: 0.3 * O.np_output_magnitude(o, 0.5)),
    "kl_sparsity": (R.KLSparsity(0.4, target=0.1), "sigmoid", lambda o: 0.4 * O.np_kl_sparsity(o, 0.1)),
    # Keras' own convention for weight-type penalties: the value over the batch size.
    "l1": (R.L1(0.05), None, lambda o: 0.05 * O.np_l1(o) / len(o)),
    "l2": (R.L2(0.05), None, lambda o: 0.05 * O.np_l2(o) / len(o)),
}


def _activity_loss(reg, activation, x):
    keras.utils.set_random_seed(1)
    layer = keras.layers.Dense(5, activation=activation, activity_regularizer=reg)
    out = layer(x)
    (loss,) = layer.losses
    return to_numpy(loss), to_numpy(out).astype(np.float64)


@pytest.mark.parametrize("name", list(ACTIVITY_REGULARIZERS))
def test_activity_regularizer_through_dense(name):
    reg, activation, expected = ACTIVITY_REGULARIZERS[name]
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    loss, out = _activity_loss(reg, activation, x)
    np.testing.assert_allclose(loss, expected(out), rtol=1e-5)


@pytest.mark.parametrize("name", list(ACTIVITY_REGULARIZERS))
def test_activity_loss_does_not_depend_on_batch_size(name):
    # 32 samples that are the same 4 samples eight times: the same per-sample
    # data, so the same loss, if the penalty is a per-sample mean.
    reg, activation, _ = ACTIVITY_REGULARIZERS[name]
    x4 = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    small, _ = _activity_loss(reg, activation, x4)
    large, _ = _activity_loss(reg, activation, np.tile(x4, (8, 1)))
    np.testing.assert_allclose(large, small, rtol=1e-5)
    assert small != 0


ALL_REGULARIZERS = [r for r, _ in KERNEL_REGULARIZERS.values()] + [r for r, _, _ in ACTIVITY_REGULARIZERS.values()]


@pytest.mark.parametrize("reg", ALL_REGULARIZERS, ids=repr)
def test_config_round_trip(reg):
    assert_config_round_trip(reg, keras.regularizers.get, PACKAGE)


def test_config_holds_every_option():
    reg = R.Entropy(0.3, from_logits=True, mode="bonus", normalize=True, temperature=0.5)
    hint = {"import_keras_penalties_before_loading": True}  # see test_saving
    assert reg.get_config() == {
        **hint,
        "factor": 0.3,
        "from_logits": True,
        "mode": "bonus",
        "normalize": True,
        "temperature": 0.5,
    }
    assert R.L2(1.0, center="mean", clip=2.0).get_config() == {**hint, "factor": 1.0, "center": "mean", "clip": 2.0}
    assert list(reg.get_config())[0] == "import_keras_penalties_before_loading"


@pytest.mark.parametrize("dtype, expected", [("float16", "float32"), ("bfloat16", "float32"), ("float32", "float32")])
def test_value_dtype_follows_input_and_half_gives_float32(dtype, expected):
    # Mixed precision: a loss contribution is float32.
    x = keras.ops.ones((4, 3), dtype=dtype)
    for reg in ALL_REGULARIZERS:
        if isinstance(reg, R.KLSparsity):
            continue  # needs activations in (0, 1)
        assert keras.backend.standardize_dtype(reg(x).dtype) == expected, reg
    assert keras.backend.standardize_dtype(R.KLSparsity(1.0)(x * 0.5).dtype) == expected


ERRORS = {
    "negative_factor": (lambda: R.L1(-0.1), ValueError, r"`factor` must be >= 0"),
    "nan_factor": (lambda: R.L2(math.nan), ValueError, r"`factor` must be finite"),
    "inf_factor": (lambda: R.ElasticNet(math.inf), ValueError, r"`factor` must be finite"),
    # As Keras' own regularizers: a factor that is not a number is a ValueError.
    "string_factor": (lambda: R.L1("0.1"), ValueError, r"`factor` must be a number"),
    "none_factor": (lambda: R.L1(None), ValueError, r"`factor` must be a number"),
    "list_factor": (lambda: R.L2([0.1]), ValueError, r"`factor` must be a number"),
    "bool_factor": (lambda: R.Entropy(True), ValueError, r"`factor` must be a number"),
    "l1_ratio": (lambda: R.ElasticNet(0.1, l1_ratio=1.2), ValueError, r"`l1_ratio` must be in \[0, 1\]"),
    "orthogonality_mode": (lambda: R.Orthogonality(0.1, mode="frobenius"), ValueError, r"`mode` must be one of"),
    "orthogonality_axis": (lambda: R.Orthogonality(0.1, axis="cols"), ValueError, r"`axis` must be one of"),
    "entropy_mode": (lambda: R.Entropy(0.1, mode="reward"), ValueError, r"`mode` must be one of 'penalty', 'bonus'"),
    "entropy_temperature": (lambda: R.Entropy(0.1, temperature=0.0), ValueError, r"`temperature` must be > 0"),
    "kl_sparsity_target": (lambda: R.KLSparsity(0.1, target=1.0), ValueError, r"`target` must be in the open interval"),
    "output_magnitude_target": (lambda: R.OutputMagnitude(0.1, target=-1.0), ValueError, r"`target` must be >= 0"),
    "l2_center": (lambda: R.L2(0.1, center="median"), ValueError, r"`center`"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_construction_errors_name_the_argument(name):
    make, error, message = ERRORS[name]
    with pytest.raises(error, match=message):
        make()


# (Keras reads None as its default factor, 0.01; ours has no default: see ERRORS.)
@pytest.mark.parametrize("factor", ["0.1", [0.1], -1.0, math.nan, math.inf])
def test_bad_factors_raise_value_error_as_keras_own_regularizers_do(factor):
    # The oracle is Keras itself: its L1/L2 raise ValueError for each of these.
    for keras_own, ours in ((keras.regularizers.L1, R.L1), (keras.regularizers.L2, R.L2)):
        with pytest.raises(ValueError):
            keras_own(factor)
        with pytest.raises(ValueError, match="`factor`"):
            ours(factor)
