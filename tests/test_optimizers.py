"""keras_penalties.optimizers against closed forms, step by step and in `fit`.

Oracles: tests/optimizer_oracles.py (NumPy, float64) — Keras' SGD and Adam
update rules, soft thresholding and the L2 prox, AGC, centralization and the
noise schedule from their papers.
"""

import json

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import regularizers as R
from keras_penalties.optimizers import (
    AdaptiveGradientClipping,
    GradientCentralization,
    GradientNoise,
    ProximalDecay,
)
from tests import optimizer_oracles as O
from tests.testing import BACKEND, save_and_load, to_numpy
from tests.two_devices import report_of

RNG = np.random.default_rng(0)
SHAPES = {"kernel": (4, 3), "conv": (3, 3, 2, 4), "bias": (3,)}
INNER = {
    "sgd": (lambda: keras.optimizers.SGD(0.1), lambda: O.SGD(0.1)),
    "adam": (lambda: keras.optimizers.Adam(0.05), lambda: O.Adam(0.05)),
    # η_t = 0.1·0.5^t: the decay reads the inner schedule at the step's t.
    "sgd_schedule": (
        lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)),
        lambda: O.SGD(lambda t: 0.1 * 0.5**t),
    ),
}


def _identity_grad(g, w):
    return g


def _no_prox(w, eta):
    return w


# name -> (wrapper around an inner optimizer, gradient transform, post-update step)
WRAPPERS = {
    "prox_l1": (
        lambda inner: ProximalDecay(inner, R.L1(0.3)),
        _identity_grad,
        lambda w, eta: O.prox("l1", w, eta, 0.3),
    ),
    "prox_l2": (
        lambda inner: ProximalDecay(inner, R.L2(0.4)),
        _identity_grad,
        lambda w, eta: O.prox("l2", w, eta, 0.4),
    ),
    "prox_l2_center": (
        lambda inner: ProximalDecay(inner, R.L2(0.4, center=0.25)),
        _identity_grad,
        lambda w, eta: O.prox("l2", w, eta, 0.4, center=0.25),
    ),
    "prox_l2_mean": (
        lambda inner: ProximalDecay(inner, R.L2(0.4, center="mean")),
        _identity_grad,
        lambda w, eta: O.prox("l2", w, eta, 0.4, center="mean"),
    ),
    "prox_elastic_net": (
        lambda inner: ProximalDecay(inner, R.ElasticNet(0.5, l1_ratio=0.3)),
        _identity_grad,
        lambda w, eta: O.prox("elastic_net", w, eta, 0.5, l1_ratio=0.3),
    ),
    "agc": (
        lambda inner: AdaptiveGradientClipping(inner, clip_factor=0.05, eps=1e-3),
        lambda g, w: O.agc(g, w, 0.05, 1e-3),
        _no_prox,
    ),
    "gc": (lambda inner: GradientCentralization(inner), lambda g, w: O.centralize(g), _no_prox),
}


def _start_values():
    values = {name: RNG.normal(scale=0.2, size=shape) for name, shape in SHAPES.items()}
    values["kernel"][:, 1] = 0.0  # a unit whose weight norm is below AGC's eps
    return values


def _step_grads(t):
    grads = {name: RNG.normal(scale=[0.05, 1.0, 3.0][t % 3], size=shape) for name, shape in SHAPES.items()}
    grads["conv"][..., 2] = 0.0  # a unit whose gradient is 0: AGC leaves it alone
    return grads


def _run_both(make, transform, post, inner_name, steps=4):
    keras_inner, numpy_inner = INNER[inner_name]
    opt = make(keras_inner())
    oracle_inner = numpy_inner()
    # Adam divides each gradient by its own RMS, so a float32 rounding of a
    # transformed gradient near 0 (centralization cancels) moves the step by
    # up to ~1e-6 of η; SGD passes rounding through unamplified.
    atol = 1e-5 if isinstance(oracle_inner, O.Adam) else 1e-6
    start = _start_values()
    variables = [keras.Variable(v.astype("float32"), name=n) for n, v in start.items()]
    expected = {n: v.copy() for n, v in start.items()}
    for t in range(steps):
        grads = _step_grads(t)
        opt.apply([ops.convert_to_tensor(g.astype("float32")) for g in grads.values()], variables)
        eta = oracle_inner.rate(t)
        for i, name in enumerate(SHAPES):
            g = transform(grads[name], expected[name])
            if isinstance(oracle_inner, O.Adam):
                stepped = oracle_inner.step(expected[name], g, t, key=i)
            else:
                stepped = oracle_inner.step(expected[name], g, t)
            expected[name] = post(stepped, eta)
        for v, name in zip(variables, SHAPES):
            np.testing.assert_allclose(to_numpy(v), expected[name], rtol=1e-5, atol=atol, err_msg=f"{name} at step {t}")
    return opt, variables


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_each_step_matches_closed_form(wrapper, inner):
    make, transform, post = WRAPPERS[wrapper]
    opt, _ = _run_both(make, transform, post, inner)
    assert int(to_numpy(opt.iterations)) == 4


def test_wrappers_nest_as_their_composition():
    # GC sees the gradient first, then Adam steps, then the L1 prox.
    def make(inner):
        return GradientCentralization(ProximalDecay(inner, R.L1(0.3)))

    _run_both(make, lambda g, w: O.centralize(g), lambda w, eta: O.prox("l1", w, eta, 0.3), "adam")


def test_l1_soft_thresholding_makes_exact_zeros():
    opt, variables = _run_both(*WRAPPERS["prox_l1"], "adam", steps=6)
    zeros = sum(int(np.sum(to_numpy(v) == 0.0)) for v in variables)
    assert zeros > 0


# ---- in fit: the compiled step (jit on JAX, tf.function, torch) ------------

X = RNG.normal(size=(32, 5)).astype("float32")
Y = (X @ RNG.normal(size=(5, 2))).astype("float32")
W0 = RNG.normal(scale=0.3, size=(5, 2)).astype("float32")
BATCH = 8


def _linear_model():
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(2, use_bias=False, kernel_initializer=keras.initializers.Constant(W0))]
    )
    return model


def _fit_oracle(numpy_inner, transform, post, epochs=2, targets=Y, skip=0):
    """MSE of a linear model, batch by batch: ∂L/∂W = 2·xᵀ(xW − y)/(n·k).

    The first `skip` batches are steps a LossScaleOptimizer skipped."""
    w = W0.astype("float64")
    t = 0
    for _ in range(epochs):
        for start in range(0, len(X), BATCH):
            if skip:
                skip -= 1
                continue
            x, y = X[start : start + BATCH], targets[start : start + BATCH]
            g = 2.0 * x.T @ (x @ w - y) / y.size
            g = transform(g, w)
            w = post(numpy_inner.step(w, g, t), numpy_inner.rate(t))
            t += 1
    return w


FIT_CASES = {
    "prox_elastic_net_adam": ("prox_elastic_net", "adam"),
    "prox_l2_mean_sgd_schedule": ("prox_l2_mean", "sgd_schedule"),
    "agc_sgd": ("agc", "sgd"),
    "gc_adam": ("gc", "adam"),
}


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_fit_matches_closed_form(case):
    wrapper, inner = FIT_CASES[case]
    make, transform, post = WRAPPERS[wrapper]
    keras_inner, numpy_inner = INNER[inner]
    model = _linear_model()
    model.compile(make(keras_inner()), "mse")
    model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expected = _fit_oracle(numpy_inner(), transform, post)
    np.testing.assert_allclose(to_numpy(model.layers[0].kernel), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "wrapper, policy, placement",
    [
        ("prox_l1", "mixed_float16", "outside"),
        ("prox_l1", "mixed_float16", "inside"),
        ("prox_l1", "mixed_bfloat16", "outside"),
        ("agc", "mixed_float16", "outside"),
        ("gc", "mixed_bfloat16", "outside"),
    ],
)
def test_fit_under_mixed_precision(wrapper, policy, placement):
    """Loss scaling outside (Keras wraps the compiled optimizer) or inside
    (compile with auto_scale_loss=False): the gradient reaches the wrapper
    unscaled once, and the result is the float32 closed form up to half
    precision rounding of the forward pass."""
    make, transform, post = WRAPPERS[wrapper]
    keras.mixed_precision.set_global_policy(policy)
    # A small initial loss scale, so that no step overflows in float16 and is
    # skipped: the oracle takes every step.
    scaled = lambda optimizer: keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=16.0)  # noqa: E731
    try:
        model = _linear_model()
        if placement == "inside":
            model.compile(make(scaled(keras.optimizers.SGD(0.1))), "mse", auto_scale_loss=False)
        elif policy == "mixed_float16":
            model.compile(scaled(make(keras.optimizers.SGD(0.1))), "mse")
        else:
            model.compile(make(keras.optimizers.SGD(0.1)), "mse")
        model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    expected = _fit_oracle(O.SGD(0.1), transform, post)
    tolerance = 2e-2 if policy == "mixed_float16" else 6e-2
    np.testing.assert_allclose(to_numpy(model.layers[0].kernel), expected, rtol=tolerance, atol=tolerance / 10)


def test_compile_wraps_a_wrapper_in_loss_scaling_under_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _linear_model()
        model.compile(ProximalDecay("sgd", R.L1(0.1)), "mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, ProximalDecay)


def test_steps_skipped_by_inner_loss_scaling_apply_no_decay():
    """Large targets overflow float16 gradients at the initial loss scale
    2^15: the nested LossScaleOptimizer skips those steps (halving its scale)
    and the prox must not shrink the weights on them."""
    make, transform, post = WRAPPERS["prox_l1"]
    targets = 100.0 * Y
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _linear_model()
        scaling = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(make(scaling), "mse", auto_scale_loss=False)
        model.fit(X, targets, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    taken = int(to_numpy(model.optimizer.iterations))
    skipped = 4 * len(X) // BATCH - taken
    assert skipped >= 1 and float(to_numpy(scaling.dynamic_scale)) == 2.0**15 / 2**skipped
    expected = _fit_oracle(O.SGD(0.1), transform, post, epochs=4, targets=targets, skip=skipped)
    np.testing.assert_allclose(to_numpy(model.layers[0].kernel), expected, rtol=2e-2, atol=2e-2)


def test_gradient_accumulation_decays_once_per_real_step():
    opt = ProximalDecay(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), R.L1(1.0))
    w = keras.Variable([0.5, -0.05, 2.0])
    opt.apply([ops.zeros(3)], [w])  # accumulated only
    np.testing.assert_array_equal(to_numpy(w), np.float32([0.5, -0.05, 2.0]))
    opt.apply([ops.zeros(3)], [w])  # the update: threshold 0.1
    np.testing.assert_allclose(to_numpy(w), [0.4, 0.0, 1.9], rtol=1e-6)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow optimizers have no stateless_apply (tf.distribute)")
@pytest.mark.parametrize("wrapper", ["prox_l2_mean", "agc", "gc"])
def test_stateless_apply_equals_apply(wrapper):
    make, _, _ = WRAPPERS[wrapper]
    start = _start_values()
    grads = [ops.convert_to_tensor(g.astype("float32")) for g in _step_grads(1).values()]
    stateful = [keras.Variable(v.astype("float32")) for v in start.values()]
    opt = make(keras.optimizers.Adam(0.05))
    opt.apply(grads, stateful)
    stateless = [keras.Variable(v.astype("float32")) for v in start.values()]
    twin = make(keras.optimizers.Adam(0.05))
    twin.build(stateless)
    new_values, new_state = twin.stateless_apply([v.value for v in twin.variables], grads, [v.value for v in stateless])
    for a, b in zip(stateful, new_values):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6, atol=1e-7)
    assert len(new_state) == len(twin.variables)
    assert int(to_numpy(new_state[len(twin._variables)])) == 1  # the inner Adam's iterations


# ---- what the decay does under Adam ----------------------------------------


def _sparse_problem():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 40)).astype("float32")
    truth = np.zeros((40, 1), "float32")
    truth[:4, 0] = [1.5, -2.0, 1.0, 0.8]
    return x, x @ truth


def _fit_sparse(optimizer, regularizer=None):
    x, y = _sparse_problem()
    model = keras.Sequential(
        [
            keras.Input((40,)),
            keras.layers.Dense(
                1,
                use_bias=False,
                kernel_regularizer=regularizer,
                kernel_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=2),
            ),
        ]
    )
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=64, epochs=30, shuffle=False, verbose=0)
    return to_numpy(model.layers[0].kernel)[:, 0]


def test_adam_with_proximal_l1_reaches_exact_zeros_coupled_l1_never_does():
    # Under Adam the threshold η·f competes with steps of η·m/√v: a weight
    # whose minibatch gradients mostly cancel (|m|/√v < f) is zeroed.
    proximal = _fit_sparse(ProximalDecay(keras.optimizers.Adam(0.05), R.L1(0.3)))
    coupled = _fit_sparse(keras.optimizers.Adam(0.05), R.L1(0.3 / 40))
    assert np.all(proximal[:4] != 0.0)
    assert np.sum(proximal[4:] == 0.0) >= 30  # of 36 irrelevant features
    # Coupled: Adam normalises sign(w)·f to a step of about η, so the
    # irrelevant weights hover around 0 without landing on it.
    assert np.sum(coupled == 0.0) == 0
    assert np.max(np.abs(coupled[4:])) > 1e-4


def test_adam_proximal_l2_against_coupled_l2_and_weight_decay():
    """With no data gradient (x = 0) only the penalty moves the weights.

    After k Adam steps at rate η, for L2(f):
    - ProximalDecay: w / (1 + 2ηf)^k;
    - Adam(weight_decay=2f) (Keras' decoupled, linearised): w·(1 − 2ηf)^k,
      which differs from the prox by O(k(2ηf)²)·w;
    - coupled kernel_regularizer=L2(f): Adam normalises the penalty's
      gradient 2fw, so each weight moves by about η a step whatever f is.
    """
    eta, f, k = 0.01, 2.0, 10
    w0 = np.float32([[1.0], [-2.0], [0.5]])
    x, y = np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32")

    def run(optimizer, regularizer=None):
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(
                    1,
                    use_bias=False,
                    kernel_regularizer=regularizer,
                    kernel_initializer=keras.initializers.Constant(w0),
                ),
            ]
        )
        model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=4, epochs=k, verbose=0)
        return to_numpy(model.layers[0].kernel)

    proximal = run(ProximalDecay(keras.optimizers.Adam(eta), R.L2(f)))
    decoupled = run(keras.optimizers.Adam(eta, weight_decay=2 * f))
    coupled = run(keras.optimizers.Adam(eta), R.L2(f))
    np.testing.assert_allclose(proximal, w0 / (1 + 2 * eta * f) ** k, rtol=1e-5)
    np.testing.assert_allclose(decoupled, w0 * (1 - 2 * eta * f) ** k, rtol=1e-5)
    # Not exactly η a step: 2fw shrinks as w does, and Adam's averages lag.
    np.testing.assert_allclose(coupled, w0 - k * eta * np.sign(w0), atol=0.01 * k * eta)
    gap = np.abs(proximal - decoupled) / np.abs(w0)
    assert np.all(gap > 0.5 * k * (2 * eta * f) ** 2) and np.all(gap < 2 * k * (2 * eta * f) ** 2)


# ---- gradient noise ----------------------------------------------------------


def _noise_steps(seed, steps=3, stddev=0.5, decay=0.55, shape=(200, 100)):
    opt = GradientNoise(keras.optimizers.SGD(1.0), stddev=stddev, decay=decay, seed=seed)
    variables = [keras.Variable(np.zeros(shape, "float32")) for _ in range(2)]
    draws = []
    for _ in range(steps):
        before = [to_numpy(v).copy() for v in variables]
        opt.apply([ops.zeros(shape), ops.zeros(shape)], variables)
        draws.append([b - to_numpy(v) for b, v in zip(before, variables)])  # SGD(1) on g = 0: w −= noise
    return draws


def test_noise_has_the_annealed_variance_and_is_independent():
    draws = _noise_steps(seed=7)
    n = draws[0][0].size
    for t, (a, b) in enumerate(draws):
        sigma = O.noise_stddev(0.5, 0.55, t)
        for noise in (a, b):
            assert abs(noise.mean()) < 4 * sigma / np.sqrt(n)
            assert abs(noise.var() / sigma**2 - 1) < 5 * np.sqrt(2 / n)  # 5 standard errors
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 4 / np.sqrt(n)  # per variable
    assert abs(np.corrcoef(draws[0][0].ravel(), draws[1][0].ravel())[0, 1]) < 4 / np.sqrt(n)  # per step


def test_noise_is_reproducible_with_an_int_seed():
    same = [_noise_steps(seed=7, steps=2, shape=(50,)) for _ in range(2)]
    other = _noise_steps(seed=8, steps=2, shape=(50,))
    np.testing.assert_array_equal(same[0][1][0], same[1][1][0])
    assert not np.allclose(same[0][1][0], other[1][0])
    zero = _noise_steps(seed=7, steps=1, stddev=0.0, shape=(50,))
    np.testing.assert_array_equal(zero[0][0], 0.0)


def test_noise_in_fit_is_reproducible_and_its_seed_state_advances():
    def run(seed):
        model = _linear_model()
        model.compile(GradientNoise(keras.optimizers.SGD(0.01), stddev=0.1, seed=seed), "mse")
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return to_numpy(model.layers[0].kernel), to_numpy(model.optimizer._seed_generator.state)

    (a, state_a), (b, _), (c, _) = run(3), run(3), run(4)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert int(state_a[1]) == 4  # one draw per step: 4 batches, one variable


# ---- exclude, None gradients, forwarding --------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda inner, exclude: ProximalDecay(inner, R.L1(5.0), exclude=exclude),
        lambda inner, exclude: AdaptiveGradientClipping(inner, clip_factor=1e-3, exclude=exclude),
        lambda inner, exclude: GradientCentralization(inner, exclude=exclude),
    ],
    ids=["proximal", "agc", "gc"],
)
def test_exclude_matches_variable_paths(make):
    layer = keras.layers.Dense(3, name="head")
    layer.build((None, 4))
    assert [v.path for v in layer.weights] == ["head/kernel", "head/bias"]
    layer.kernel.assign(RNG.normal(scale=0.1, size=(4, 3)).astype("float32"))
    layer.bias.assign(np.float32([0.5, -0.5, 1.0]))
    grads = [ops.convert_to_tensor(RNG.normal(size=s).astype("float32")) for s in [(4, 3), (3,)]]
    plain_sgd = [to_numpy(v) - 0.1 * to_numpy(g) for v, g in zip(layer.weights, grads)]
    make(keras.optimizers.SGD(0.1), ["bias"]).apply(grads, layer.weights)
    np.testing.assert_allclose(to_numpy(layer.bias), plain_sgd[1], rtol=1e-6)
    assert np.max(np.abs(to_numpy(layer.kernel) - plain_sgd[0])) > 1e-3  # the kernel was transformed


def test_a_variable_without_gradient_is_left_alone():
    for make in (
        lambda inner: ProximalDecay(inner, R.L2(1.0, center=3.0)),
        lambda inner: GradientNoise(inner, stddev=1.0, seed=1),
        lambda inner: AdaptiveGradientClipping(inner),
        lambda inner: GradientCentralization(inner),
    ):
        start = np.float32([[1.0, 2.0], [3.0, 4.0]])
        frozen, moving = keras.Variable(start), keras.Variable(start)
        make(keras.optimizers.SGD(0.1)).apply([None, ops.convert_to_tensor([[1.0, 0.0], [0.0, 0.0]])], [frozen, moving])
        np.testing.assert_array_equal(to_numpy(frozen), start)
        assert not np.array_equal(to_numpy(moving), start)


def test_learning_rate_and_iterations_are_the_inner_optimizers():
    inner = keras.optimizers.Adam(0.01)
    opt = GradientCentralization(ProximalDecay(inner, R.L1(0.1)))
    assert opt.optimizer.optimizer is inner and opt.inner_optimizer.inner_optimizer is inner
    opt.learning_rate = 0.5
    assert float(to_numpy(inner.learning_rate)) == 0.5
    opt.apply([ops.ones((2,))], [keras.Variable([1.0, 2.0])])
    assert int(to_numpy(opt.iterations)) == int(to_numpy(inner.iterations)) == 1
    assert len(opt.variables) == len(opt._variables) + len(opt.inner_optimizer._variables) + len(inner.variables)


# ---- serialization -----------------------------------------------------------

SERIALIZABLE = {
    "proximal": lambda: ProximalDecay(keras.optimizers.Adam(0.01), R.ElasticNet(0.1, l1_ratio=0.2), exclude=["bias"]),
    "noise": lambda: GradientNoise(keras.optimizers.SGD(0.05, momentum=0.9), stddev=0.2, decay=0.3, seed=5),
    "agc": lambda: AdaptiveGradientClipping("adam", clip_factor=0.02, eps=1e-2, exclude=["dense_1"]),
    "nested": lambda: GradientCentralization(
        ProximalDecay(
            keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 5, 0.5)), R.L2(0.1, center="mean")
        )
    ),
}


@pytest.mark.parametrize("name", sorted(SERIALIZABLE))
def test_config_round_trip(name):
    opt = SERIALIZABLE[name]()
    config = opt.get_config()
    assert next(iter(config)) == "import_keras_penalties_before_loading"
    assert config["optimizer"]["class_name"] in ("Adam", "SGD", "ProximalDecay")
    for option in ("stddev", "decay", "seed", "clip_factor", "eps", "exclude"):
        if option in config:
            assert config[option] == getattr(opt, option)
    again = type(opt).from_config(json.loads(json.dumps(config)))
    assert again.get_config() == config
    assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).get_config() == config


@pytest.mark.parametrize("name", sorted(SERIALIZABLE))
def test_keras_file_round_trip_keeps_optimizer_state(name, tmp_path):
    def model():
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
        m.compile(SERIALIZABLE[name](), "mse")
        return m

    keras.utils.set_random_seed(0)
    original = model()
    original.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loaded = save_and_load(original, tmp_path)
    assert type(loaded.optimizer) is type(original.optimizer)
    assert len(loaded.optimizer.variables) == len(original.optimizer.variables)
    for a, b in zip(original.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    # Training goes on from the same state, noise included.
    for m in (original, loaded):
        m.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(original.weights, loaded.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6, atol=1e-7)


def test_loss_scale_optimizer_outside_saves_and_loads(tmp_path):
    model = _linear_model()
    model.compile(keras.optimizers.LossScaleOptimizer(ProximalDecay("sgd", R.L1(0.01))), "mse")
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    loaded = save_and_load(model, tmp_path)
    assert isinstance(loaded.optimizer.inner_optimizer, ProximalDecay)
    np.testing.assert_array_equal(to_numpy(loaded.optimizer.iterations), to_numpy(model.optimizer.iterations))


# ---- argument errors ---------------------------------------------------------

ERRORS = [
    (lambda: ProximalDecay("adam", keras.regularizers.L1(0.1)), ValueError, "`regularizer`"),
    (lambda: ProximalDecay("adam", R.Orthogonality(0.1)), ValueError, "`regularizer`"),
    (lambda: ProximalDecay("adam", 0.1), ValueError, "`regularizer`"),
    (lambda: ProximalDecay("adam", R.L2(0.1, clip=1.0)), ValueError, "`regularizer`.*clip"),
    (lambda: ProximalDecay(object(), R.L1(0.1)), TypeError, "`optimizer`"),
    (lambda: ProximalDecay(keras.layers.Dense(2), R.L1(0.1)), TypeError, "`optimizer`"),
    (lambda: ProximalDecay("no_such_optimizer", R.L1(0.1)), ValueError, "`optimizer`"),
    (lambda: ProximalDecay("adam", R.L1(0.1), exclude=[1]), TypeError, "`exclude`"),
    (lambda: GradientNoise("adam", stddev=-0.1), ValueError, "`stddev`"),
    (lambda: GradientNoise("adam", stddev=float("nan")), ValueError, "`stddev`"),
    (lambda: GradientNoise("adam", decay=-1.0), ValueError, "`decay`"),
    (lambda: GradientNoise("adam", seed=1.5), TypeError, "`seed`"),
    (lambda: AdaptiveGradientClipping("adam", clip_factor=-0.01), ValueError, "`clip_factor`"),
    (lambda: AdaptiveGradientClipping("adam", eps=-1e-3), ValueError, "`eps`"),
    (lambda: AdaptiveGradientClipping("adam", eps=float("inf")), ValueError, "`eps`"),
    (lambda: GradientCentralization(None), TypeError, "`optimizer`"),
]


@pytest.mark.parametrize("index", range(len(ERRORS)))
def test_bad_arguments_fail_at_construction(index):
    make, error, match = ERRORS[index]
    with pytest.raises(error, match=match):
        make()


# ---- two devices -------------------------------------------------------------


@pytest.mark.skipif(BACKEND == "torch", reason="Keras has no distribution for the torch backend")
def test_two_devices_match_one():
    """JAX DataParallel on 2 virtual devices, TF MirroredStrategy on 2 logical CPUs."""
    report = report_of("tests.distributed_optimizers_run")
    assert report["devices"] == 2
    assert sorted(report["differences"]) == sorted(
        ["proximal_l1_adam", "proximal_l2_mean_sgd", "noise_sgd", "agc_sgd", "gc_adam"]
    )
    for name, difference in report["differences"].items():
        assert difference < 1e-5, (name, difference)
