"""ops.gaussian_kl: the closed form, a Monte Carlo estimate from NumPy samples,
gradients, dtypes, edges, errors, and a Term that saves without registration."""

import keras
import numpy as np
import pytest
from scipy import stats

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from tests.testing import assert_finite, float64_scope, save_and_load, to_numpy

RNG = np.random.default_rng(0)
MU = RNG.normal(size=(5, 3))
LV = RNG.normal(size=(5, 3))
MU0 = RNG.normal(size=(5, 3))
LV0 = RNG.normal(size=(3,))  # broadcasts over samples


def np_gaussian_kl(mu, lv, mu0=0.0, lv0=0.0, axis=-1, reduction="mean"):
    """KL(N(μ, σ²) ‖ N(μ₀, σ₀²)) per coordinate from the variances, summed over `axis`."""
    var, var0 = np.exp(lv), np.exp(lv0)
    per = 0.5 * (np.log(var0 / var) + (var + (mu - mu0) ** 2) / var0 - 1.0)
    values = per.sum(axis=axis)
    return {"mean": values.mean() if values.size else 0.0, "sum": values.sum(), "none": values}[reduction]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("refs", ["none", "mean_only", "log_var_only", "both"])
def test_against_the_closed_form(refs, reduction):
    mu0 = MU0 if refs in ("mean_only", "both") else None
    lv0 = LV0 if refs in ("log_var_only", "both") else None
    with float64_scope():
        got = P.gaussian_kl(MU, LV, mu0, lv0, reduction=reduction)
    expected = np_gaussian_kl(MU, LV, 0.0 if mu0 is None else mu0, 0.0 if lv0 is None else lv0, reduction=reduction)
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-10)


def test_the_vae_form_and_another_axis():
    # −½Σ(1 + log σ² − μ² − σ²), the form Keras' VAE example writes.
    vae = np.mean(-0.5 * np.sum(1 + LV - MU**2 - np.exp(LV), axis=1))
    np.testing.assert_allclose(to_numpy(P.gaussian_kl(MU.astype("float32"), LV.astype("float32"))), vae, rtol=1e-6)
    x, y = RNG.normal(size=(2, 4, 3)), RNG.normal(size=(2, 4, 3))
    with float64_scope():
        got = P.gaussian_kl(x, y, axis=1, reduction="none")
    np.testing.assert_allclose(to_numpy(got), np_gaussian_kl(x, y, axis=1, reduction="none"), rtol=1e-10)


def test_against_a_monte_carlo_estimate_from_samples():
    """E_{z~N(μ,σ²)}[log N(z; μ, σ²) − log N(z; μ₀, σ₀²)], with SciPy's densities."""
    mu, lv, mu0, lv0 = np.array([[0.7, -1.2]]), np.array([[0.3, -0.8]]), np.array([[0.1, 0.4]]), np.array([[-0.2, 0.5]])
    z = np.random.default_rng(1).normal(mu, np.exp(0.5 * lv), size=(400_000, 2))
    log_ratio = stats.norm.logpdf(z, mu, np.exp(0.5 * lv)) - stats.norm.logpdf(z, mu0, np.exp(0.5 * lv0))
    estimate = log_ratio.sum(axis=1).mean()
    got = float(to_numpy(P.gaussian_kl(*(t.astype("float32") for t in (mu, lv, mu0, lv0)))))
    assert abs(got - estimate) < 5e-3, (got, estimate)


def test_gradients_are_the_closed_form():
    from keras_penalties.gradients import _gradients

    mu, lv, mu0, lv0 = (t.astype("float32") for t in (MU, LV, MU0, np.broadcast_to(LV0, MU.shape).copy()))
    grads = _gradients(
        lambda a, b, c, d: P.gaussian_kl(a, b, c, d, reduction="sum"),
        [keras.ops.convert_to_tensor(t) for t in (mu, lv, mu0, lv0)],
    )
    var, var0 = np.exp(LV), np.exp(np.broadcast_to(LV0, MU.shape))
    expected = [
        (MU - MU0) / var0,
        0.5 * (var / var0 - 1.0),
        -(MU - MU0) / var0,
        0.5 * (1.0 - (var + (MU - MU0) ** 2) / var0),
    ]
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs_keep_their_dtype(dtype):
    mu, lv = keras.ops.cast(MU[:, :2], dtype), keras.ops.cast(LV[:, :2] * 0.5, dtype)
    got = P.gaussian_kl(mu, lv)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    expected = np_gaussian_kl(to_numpy(mu).astype(np.float64), to_numpy(lv).astype(np.float64))
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-2)


def test_edges_empty_batch_and_extreme_log_variances():
    empty = np.zeros((0, 3), "float32")
    assert float(to_numpy(P.gaussian_kl(empty, empty))) == 0.0
    from keras_penalties.gradients import _gradients

    extreme = np.array([[30.0, -30.0, 0.0]], "float32")
    value = P.gaussian_kl(np.zeros((1, 3), "float32"), extreme)
    assert_finite(to_numpy(value), "value")
    (g_mu, g_lv) = _gradients(
        lambda a, b: P.gaussian_kl(a, b), [keras.ops.zeros((1, 3)), keras.ops.convert_to_tensor(extreme)]
    )
    assert_finite(to_numpy(g_mu), "d/dmean")
    assert_finite(to_numpy(g_lv), "d/dlog_var")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: P.gaussian_kl(np.float32(1.0), np.float32(0.0)), ValueError, r"`mean` must have rank >= 1"),
        (lambda: P.gaussian_kl(MU, LV[:, :2]), ValueError, r"`mean` and `log_var` must have the same shape"),
        (lambda: P.gaussian_kl(MU, LV, MU0[:, :2]), ValueError, r"`mean_ref` must broadcast against `mean`"),
        (lambda: P.gaussian_kl(MU, LV, reduction="batch"), ValueError, r"`reduction` must be one of"),
        (lambda: P.gaussian_kl(MU, LV, axis=3), ValueError, r"`axis`=3 is out of range"),
    ],
)
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_term_by_name_saves_and_loads_without_registration(tmp_path):
    inputs = keras.Input((4,))
    out = CompositeObjective({"kl": Term("gaussian_kl", 0.5, inputs=("mean", "log_var"))}, name="vae")(
        {"mean": keras.layers.Dense(2)(inputs), "log_var": keras.layers.Dense(2)(inputs)}
    )
    model = keras.Model(inputs, out["mean"])
    x = RNG.normal(size=(6, 4)).astype("float32")
    loaded = save_and_load(model, tmp_path)
    for m in (model, loaded):
        layers = [layer for layer in m.layers if isinstance(layer, keras.layers.Dense)]
        mean, log_var = (to_numpy(layer(x)).astype(np.float64) for layer in layers)
        total, _ = m.get_layer("vae").compute({"mean": mean.astype("float32"), "log_var": log_var.astype("float32")})
        np.testing.assert_allclose(to_numpy(total), 0.5 * np_gaussian_kl(mean, log_var), rtol=1e-5)
