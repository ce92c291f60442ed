"""Router penalties (SPEC §14b): `ops.router_load_balancing` and
`ops.router_z_loss` against Hugging Face's pooled `load_balancing_loss_func`
(× k), keras-hub's per-layer `compute_load_balancing_loss`, ST-MoE's and
Megatron's z-loss (tests/router_oracles.py, with their sources) and the
closed-form gradients; the regularizers in `activity_regularizer=`; the
terms by name; `RouterLogits` on plain Keras models. The keras-hub models
are in tests/test_routers_hub.py."""

import os
import tempfile

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

import keras_penalties as kp
from keras_penalties import ops as P
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor
from tests import router_oracles as O
from tests.testing import grads, to_numpy

RNG = np.random.default_rng(68)
L, B, S, E, K = 3, 3, 5, 6, 2
LOGITS = [RNG.normal(scale=1.5, size=(B, S, E)).astype("float32") for _ in range(L)]
# One full sequence, one right-padded, one with a hole.
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], "float32")
KEPT = MASK.reshape(-1) > 0


def _rows(layers):
    return [np.asarray(z, np.float64).reshape(-1, E) for z in layers]


def _padded(layers, value):
    """The layers with `value` at every dropped token."""
    return [np.where(MASK[..., None] > 0, z, np.float32(value)) for z in layers]


def _load_balancing_gradient(layers, mask, pool):
    """∂/∂z_{l,t} = (E·M_t/|S|)·p⊙(f − ⟨f, p⟩), f the routed fractions (SPEC)."""
    rows = _rows(layers)
    keep = np.ones(len(rows[0])) if mask is None else np.asarray(mask, np.float64).reshape(-1)
    probs = [special.softmax(z, -1) for z in rows]
    chosen = [np.eye(E)[np.argsort(-z, -1)[:, :K]].sum(1) for z in rows]  # [N, E]
    if pool == "all":
        size = keep.sum() * len(rows)
        f = sum((c * keep[:, None]).sum(0) for c in chosen) / (K * size)
        fs, sizes = [f] * len(rows), [size] * len(rows)
    else:
        sizes = [keep.sum()] * len(rows)
        fs = [(c * keep[:, None]).sum(0) / (K * keep.sum()) for c in chosen]
    return [
        (E * keep[:, None] / size) * p * (f - (p * f).sum(-1, keepdims=True)) for p, f, size in zip(probs, fs, sizes)
    ]


# ------------------------------------------------------------------ values against the peers


@pytest.mark.parametrize("masked", [False, True])
def test_pooled_value_is_hf_load_balancing_over_k(masked):
    mask = MASK if masked else None
    # What padding holds changes nothing: NaN there.
    layers = _padded(LOGITS, np.nan) if masked else LOGITS
    got = to_numpy(P.router_load_balancing(layers, top_k=K, mask=mask))
    expected = O.hf_load_balancing_loss(_rows(LOGITS), E, K, mask) / K
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_per_layer_value_is_keras_hubs_sum_over_its_layers(masked):
    # keras-hub reads a [B, S, S] attention mask, a token kept where its row has any 1.
    attention = None if not masked else np.broadcast_to(MASK[:, :, None], (B, S, S))
    layers = _padded(LOGITS, np.inf) if masked else LOGITS
    got = to_numpy(P.router_load_balancing(layers, top_k=K, mask=MASK if masked else None, pool="layer"))
    expected = sum(O.keras_hub_load_balancing_loss(z, E, K, attention) for z in _rows(LOGITS))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_one_layer_is_a_list_of_one_and_numpy_lists_are_one_tensor():
    one = to_numpy(P.router_load_balancing(LOGITS[0], top_k=np.int64(K)))
    np.testing.assert_allclose(one, to_numpy(P.router_load_balancing([LOGITS[0]], top_k=K)), rtol=1e-6)
    np.testing.assert_allclose(one, to_numpy(P.router_load_balancing(LOGITS[0].tolist(), top_k=K)), rtol=1e-6)
    np.testing.assert_allclose(one, O.keras_hub_load_balancing_loss(_rows(LOGITS[:1])[0], E, K), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, E])
def test_uniform_probabilities_give_one_for_every_k(k):
    # P_i = 1/E for every i, and Σ f = 1, whatever the ties route.
    np.testing.assert_allclose(to_numpy(P.router_load_balancing(np.zeros((7, E), "float32"), top_k=k)), 1.0)


@pytest.mark.parametrize("pool", ["all", "layer"])
def test_z_loss_is_st_moe_and_megatron(pool):
    layers = _padded(LOGITS, -np.inf)
    got = to_numpy(P.router_z_loss(layers, mask=MASK, pool=pool))
    expected = O.st_moe_z_loss(_rows(LOGITS), KEPT)
    if pool == "layer":  # Megatron adds each layer's z_loss_func
        expected = sum(O.megatron_z_loss(z, 1.0, ~KEPT) for z in _rows(LOGITS))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# ------------------------------------------------------------------ gradients


@pytest.mark.parametrize("pool", ["all", "layer"])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_gradient_is_the_closed_form(pool, masked):
    mask = MASK if masked else None
    got = grads(lambda *zs: P.router_load_balancing(list(zs), top_k=K, mask=mask, pool=pool), *LOGITS)
    for g, expected in zip(got, _load_balancing_gradient(LOGITS, mask, pool)):
        np.testing.assert_allclose(g.reshape(-1, E), expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("pool", ["all", "layer"])
def test_z_loss_gradient_is_two_lse_softmax_over_the_kept(pool):
    got = grads(lambda *zs: P.router_z_loss(list(zs), mask=MASK, pool=pool), *_padded(LOGITS, np.nan))
    size = KEPT.sum() * (L if pool == "all" else 1)
    for g, z in zip(got, _rows(LOGITS)):
        lse = special.logsumexp(z, -1, keepdims=True)
        np.testing.assert_allclose(g.reshape(-1, E), 2 * lse * special.softmax(z, -1) * KEPT[:, None] / size, atol=1e-6)


@pytest.mark.parametrize("op", ["router_load_balancing", "router_z_loss"])
def test_no_kept_token_gives_zero_and_a_zero_gradient(op):
    options = {"top_k": K} if op == "router_load_balancing" else {}
    fn = getattr(P, op)
    zero = np.zeros_like(MASK)
    assert float(to_numpy(fn(LOGITS, mask=zero, **options))) == 0.0
    for g in grads(lambda *zs: fn(list(zs), mask=zero, **options), *LOGITS):
        assert np.all(g == 0.0)
    empty = np.zeros((0, E), "float32")
    assert float(to_numpy(fn(empty, **options))) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_of_plus_minus_1e4_are_finite(dtype):
    z = np.where(RNG.uniform(size=(8, E)) > 0.5, 1e4, -1e4).astype("float32")
    z = ops.cast(z, dtype)
    for fn, options in ((P.router_load_balancing, {"top_k": K}), (P.router_z_loss, {})):
        assert np.isfinite(to_numpy(fn(z, **options)))
        (g,) = grads(lambda x, fn=fn, options=options: ops.cast(fn(x, **options), "float32"), z)
        assert np.isfinite(g).all()


def test_a_float16_z_loss_past_its_range_is_inf_and_the_value_is_in_the_logits_dtype():
    assert np.isinf(to_numpy(P.router_z_loss(ops.cast(np.full((2, E), 1e3), "float16"))))
    for dtype in ("float16", "bfloat16", "float32"):
        z = ops.cast(LOGITS[0], dtype)
        value = P.router_load_balancing(z, top_k=K)
        assert keras.backend.standardize_dtype(value.dtype) == dtype
        np.testing.assert_allclose(to_numpy(value), to_numpy(P.router_load_balancing(LOGITS[0], top_k=K)), rtol=2e-2)


def test_symbolic_inputs_give_a_scalar():
    inputs = [keras.Input((S, E)) for _ in range(2)]
    assert tuple(P.router_load_balancing(inputs, top_k=K).shape) == ()
    assert tuple(P.router_z_loss(inputs[0], mask=keras.Input((S,))).shape) == ()


ERRORS = {
    "top_k zero": (lambda: P.router_load_balancing(LOGITS, top_k=0), r"`top_k` must be an int in \[1, E\]"),
    "top_k float": (lambda: P.router_load_balancing(LOGITS, top_k=2.0), r"`top_k`"),
    "term without top_k": (
        lambda: kp.Term("router_load_balancing", inputs=("z",)),
        r"needs the option\(s\) \['top_k'\]",
    ),
    "top_k > E": (lambda: P.router_load_balancing(LOGITS, top_k=E + 1), r"`top_k` must be an int in \[1, E\] = "),
    "pool": (lambda: P.router_z_loss(LOGITS, pool="mean"), r"`pool` must be one of"),
    "rank": (lambda: P.router_z_loss(np.zeros((E,), "float32")), r"`router_logits` must be \[\.\.\., E\]"),
    "empty list": (lambda: P.router_z_loss([]), r"`router_logits` must hold at least one"),
    "shapes": (lambda: P.router_z_loss([LOGITS[0], LOGITS[1][:, :2]]), r"`router_logits`: every layer"),
    "mask": (lambda: P.router_z_loss(LOGITS, mask=np.ones((B, S + 1))), r"`mask` must have one element per"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_arguments_are_value_errors_naming_them(name):
    call, message = ERRORS[name]
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------ regularizers and terms


def _router_model(regularizer, rows):
    """Two routers on [B, S, H] inputs (or [B·S, H] rows), each with `regularizer`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,) if rows else (S, 4))
    first = keras.layers.Dense(E, activity_regularizer=regularizer, name="router_0")(inputs)
    second = keras.layers.Dense(E, activity_regularizer=regularizer, name="router_1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(first + second))


@pytest.mark.parametrize("rows", [False, True])
def test_regularizers_add_the_per_layer_sum_of_every_token(rows):
    x = RNG.normal(size=(B * S, 4) if rows else (B, S, 4)).astype("float32")
    model = _router_model(R.RouterLoadBalancing(0.01, top_k=K, z_loss=1e-3), rows)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    y = np.zeros(x.shape[:-1] + (1,), "float32")
    loss = model.evaluate(x, y, batch_size=len(x), verbose=0)
    routers = [x.reshape(-1, 4).astype(np.float64) @ w[0] + w[1] for w in _weights(model)]
    mse = np.mean(to_numpy(model(x)) ** 2)
    penalty = sum(0.01 * O.keras_hub_load_balancing_loss(z, E, K) + 1e-3 * O.st_moe_z_loss(z) for z in routers)
    np.testing.assert_allclose(loss, mse + penalty, rtol=1e-5)
    model = _router_model(R.RouterZLoss(1e-2), rows)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    loss = model.evaluate(x, y, batch_size=len(x), verbose=0)
    routers = [x.reshape(-1, 4).astype(np.float64) @ w[0] + w[1] for w in _weights(model)]
    mse = np.mean(to_numpy(model(x)) ** 2)
    np.testing.assert_allclose(loss, mse + sum(1e-2 * O.st_moe_z_loss(z) for z in routers), rtol=1e-5)


def _weights(model):
    return [[w.astype(np.float64) for w in model.get_layer(f"router_{i}").get_weights()] for i in range(2)]


def test_regularizers_round_trip_their_config_and_give_float32_from_half():
    for reg in (R.RouterLoadBalancing(0.01, top_k=3, z_loss=1e-3), R.RouterZLoss(0.5)):
        back = type(reg).from_config(reg.get_config())
        assert back.get_config() == reg.get_config()
        assert keras.backend.standardize_dtype(reg(ops.cast(LOGITS[0], "float16")).dtype) == "float32"
    reg = R.RouterLoadBalancing(0.01, top_k=3, z_loss=1e-3)
    assert (reg.factor, reg.top_k, reg.z_loss) == (0.01, 3, 1e-3)
    restored = keras.regularizers.deserialize(keras.regularizers.serialize(reg))
    assert isinstance(restored, R.RouterLoadBalancing) and restored.z_loss == 1e-3


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: R.RouterLoadBalancing(-1.0, top_k=1), "`factor`"),
        (lambda: R.RouterLoadBalancing(0.1, top_k=0), "`top_k`"),
        (lambda: R.RouterLoadBalancing(0.1, top_k=1, z_loss=-1e-3), "`z_loss`"),
        (lambda: R.RouterLoadBalancing(0.1, top_k=1, z_loss=float("inf")), "`z_loss`"),
        (lambda: R.RouterZLoss(float("nan")), "`factor`"),
    ],
)
def test_regularizer_errors_name_the_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_terms_by_name_read_a_list_of_layers_and_a_mask():
    inputs, mask = keras.Input((S, 4)), keras.Input((S,))
    routers = [keras.layers.Dense(E, name=f"router_{i}") for i in range(2)]
    logits = [router(inputs) for router in routers]
    objective = kp.CompositeObjective(
        {
            "load_balancing": kp.Term(
                "router_load_balancing", 0.5, inputs=("router_logits",), options={"top_k": K, "mask": "mask"}
            ),
            "router_z": kp.Term("router_z_loss", 0.1, inputs=("router_logits",), options={"mask": "mask"}),
        },
        name="moe",
    )
    hidden = objective({"hidden": logits[0] + logits[1], "router_logits": logits, "mask": mask})["hidden"]
    model = keras.Model([inputs, mask], keras.layers.Dense(1)(hidden))
    model.compile(keras.optimizers.SGD(0.0), "mse")
    x = RNG.normal(size=(B, S, 4)).astype("float32")
    history = model.fit([x, MASK], np.zeros((B, S, 1)), batch_size=B, verbose=0, callbacks=[PenaltyMonitor()])
    rows = [x.reshape(-1, 4).astype(np.float64) @ r.kernel.numpy() + r.bias.numpy() for r in routers]
    lb = O.hf_load_balancing_loss(rows, E, K, MASK) / K
    np.testing.assert_allclose(history.history["moe/load_balancing"][0], lb, rtol=1e-5)
    np.testing.assert_allclose(history.history["moe/router_z"][0], O.st_moe_z_loss(rows, KEPT), rtol=1e-5)


# ------------------------------------------------------------------ RouterLogits on a Keras model


def _moe_like():
    """A functional model with two routers inside, one with a regularizer of its own."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    first = keras.layers.Dense(E, name="gate_0", activity_regularizer=R.L2(0.1))
    second = keras.layers.Dense(E, name="gate_1")
    hidden = keras.layers.Dense(4, activation="tanh")(first(inputs))
    return keras.Model(inputs, keras.layers.Dense(2)(hidden + second(hidden)[..., :4])), [first, second]


def test_router_logits_hands_out_the_latest_logits_and_changes_nothing():
    model, routers = _moe_like()
    x = RNG.normal(size=(5, 4)).astype("float32")
    before = to_numpy(model(x))
    before_losses = [to_numpy(v) for v in model.losses]
    hooked = kp.RouterLogits(model, layers=routers)
    with pytest.raises(ValueError, match="'gate_0' has not run"):
        hooked(ops.zeros((1,)))
    outputs = model(x)
    np.testing.assert_allclose(to_numpy(outputs), before, rtol=1e-6)
    # The router with no regularizer of its own adds 0.
    np.testing.assert_allclose(sum(to_numpy(v) for v in model.losses), sum(before_losses), rtol=1e-6)
    logits = hooked(outputs)
    kernel, bias = (w.astype(np.float64) for w in routers[0].get_weights())
    np.testing.assert_allclose(to_numpy(logits[0]), x @ kernel + bias, rtol=1e-5, atol=1e-6)
    assert [tuple(t.shape) for t in logits] == [(5, E), (5, E)]
    symbolic = hooked(keras.Input((2,)))
    assert [tuple(t.shape) for t in symbolic] == [(None, E), (None, E)]


def test_router_logits_are_differentiable_down_to_the_model_inputs():
    model, routers = _moe_like()
    hooked = kp.RouterLogits(model, layers=routers)
    x = RNG.normal(size=(5, 4)).astype("float32")

    def z_loss(inputs):
        model(inputs)
        return P.router_z_loss(hooked(inputs)[0])

    (g,) = grads(z_loss, x)
    kernel, bias = (w.astype(np.float64) for w in routers[0].get_weights())
    z = x.astype(np.float64) @ kernel + bias
    dz = 2 * special.logsumexp(z, -1, keepdims=True) * special.softmax(z, -1) / len(z)
    np.testing.assert_allclose(g, dz @ kernel.T, rtol=1e-4, atol=1e-6)


class RouterTrained(keras.Model):
    """A model whose loss adds a router z-loss read through RouterLogits."""

    def __init__(self, model, routers, **kwargs):
        super().__init__(**kwargs)
        self.inner = model
        self.routers = kp.RouterLogits(model, layers=routers)

    def call(self, x):
        return self.inner(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + P.router_z_loss(self.routers(y_pred))


def test_fit_trains_the_routers_on_the_loss_read_through_router_logits():
    model, routers = _moe_like()
    trained = RouterTrained(model, routers)
    trained.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = RNG.normal(size=(6, 4)).astype("float32"), np.zeros((6, 2), "float32")
    z0 = x.astype(np.float64) @ routers[0].get_weights()[0] + routers[0].get_weights()[1]
    hidden = np.tanh(z0 @ model.layers[2].get_weights()[0] + model.layers[2].get_weights()[1])
    z = hidden @ routers[1].get_weights()[0] + routers[1].get_weights()[1]
    expected = (
        # MSE, gate_0's own L2 activity loss, then both routers' z-loss
        np.mean(to_numpy(model(x)) ** 2) + 0.1 * np.sum(z0**2) / len(x) + O.st_moe_z_loss([z0, z])
    )
    history = trained.fit(x, y, batch_size=6, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(history[0], expected, rtol=1e-5)
    assert history[1] < history[0]


def test_a_hooked_model_saves_and_loads_as_before_and_records_nothing_until_hooked():
    model, routers = _moe_like()
    kp.RouterLogits(model, layers=routers)
    x = RNG.normal(size=(5, 4)).astype("float32")
    expected, losses = to_numpy(model(x)), [to_numpy(v) for v in model.losses]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_allclose(to_numpy(loaded(x)), expected, rtol=1e-6)
    np.testing.assert_allclose(sum(to_numpy(v) for v in loaded.losses), sum(losses), rtol=1e-6)
    gates = [loaded.get_layer("gate_0"), loaded.get_layer("gate_1")]
    assert all(gate.activity_regularizer.latest() is None for gate in gates)  # records nothing
    rehooked = kp.RouterLogits(loaded, layers=gates)
    np.testing.assert_allclose(
        to_numpy(rehooked(loaded(x))[1]), to_numpy(kp.RouterLogits(model, layers=routers)(model(x))[1]), rtol=1e-6
    )


def test_router_logits_errors_name_the_argument():
    model, _ = _moe_like()
    with pytest.raises(ValueError, match="`model`: no router found"):
        kp.RouterLogits(model)
    with pytest.raises(ValueError, match="`layers` must be a non-empty list"):
        kp.RouterLogits(model, layers=[])
    with pytest.raises(ValueError, match="`layers` must hold Keras layers"):
        kp.RouterLogits(model, layers=[np.zeros(3)])
