"""keras-hub's MoE models (Qwen3-MoE, Mixtral; built from config) trained
with the package's router penalties instead of their built-in loss, as
SPEC §14b's recipe writes them: keras-hub's coefficient 0, ours in
`compute_loss` through `RouterLogits`. keras-hub's own per-layer loss is
the oracle where it is right (no padding: its Qwen mask counts
right-padded tokens); with padding, `fit`'s loss is the cross-entropy plus
Hugging Face's pooled loss over k and ST-MoE's z-loss on the kept tokens
(tests/router_oracles.py). Also the functional form with per-term logs, the
warning for a non-zero built-in coefficient, and saving."""

import os
import tempfile
import warnings

import keras
import numpy as np
import pytest

import keras_penalties as kp
from keras_penalties import ops as P
from keras_penalties.callbacks import PenaltyMonitor
from tests import router_oracles as O
from tests.testing import to_numpy

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub needs Python 3.11+; make test installs it there (--no-deps, see the Makefile)"
)

VOCAB, B, S, E, K = 32, 4, 6, 4, 2
RNG = np.random.default_rng(68)
IDS = RNG.integers(1, VOCAB, size=(B, S)).astype("int32")
# Right padding: the sequences keep 6, 4, 3 and 5 tokens.
PADDING = (np.arange(S)[None, :] < np.array([6, 4, 3, 5])[:, None]).astype("int32")


def _qwen3_moe(coefficient):
    return keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        moe_intermediate_dim=8,
        num_experts=E,
        head_dim=4,
        top_k=K,
        router_aux_loss_coefficient=coefficient,
    )


def _mixtral(coefficient):
    return keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        num_experts=E,
        top_k=K,
        router_aux_loss_coef=coefficient,
    )


MODELS = {
    "qwen3_moe": (_qwen3_moe, keras_hub.models.Qwen3MoeCausalLM),
    "mixtral": (_mixtral, keras_hub.models.MixtralCausalLM),
}


def _recipe(causal_lm_class):
    """SPEC §14b's recipe on `causal_lm_class`, with the pool and the weights
    as arguments."""

    @keras.saving.register_keras_serializable(package="tests_routers")
    class MoECausalLM(causal_lm_class):
        def __init__(self, backbone, preprocessor=None, pool="all", z_loss=1e-3, **kwargs):
            super().__init__(backbone=backbone, preprocessor=preprocessor, **kwargs)
            self.routers = kp.RouterLogits(backbone)
            self.pool, self.z_loss = pool, z_loss

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            logits, mask = self.routers(y_pred), x["padding_mask"]
            return (
                loss
                + 0.01 * P.router_load_balancing(logits, top_k=self.backbone.top_k, mask=mask, pool=self.pool)
                + self.z_loss * P.router_z_loss(logits, mask=mask)
            )

        def get_config(self):
            return {**super().get_config(), "pool": self.pool, "z_loss": self.z_loss}

    MoECausalLM.__name__ = MoECausalLM.__qualname__ = f"MoE{causal_lm_class.__name__}"
    return MoECausalLM


RECIPES = {name: _recipe(causal_lm) for name, (_, causal_lm) in MODELS.items()}


def _compiled(model, learning_rate=0.1):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=loss)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_recipe_per_layer_trains_as_keras_hubs_own_loss_on_unpadded_batches(name):
    make, causal_lm = MODELS[name]
    keras.utils.set_random_seed(1)
    ours = _compiled(RECIPES[name](make(0.0), pool="layer", z_loss=0.0))
    theirs = _compiled(causal_lm(backbone=make(0.01), preprocessor=None))
    theirs.set_weights(ours.get_weights())
    # The routers in the backbone's order: layer 0's first.
    assert [r.path.split("/")[0] for r in ours.routers.routers] == ["transformer_layer_0", "transformer_layer_1"]
    x = {"token_ids": IDS, "padding_mask": np.ones_like(PADDING)}
    got = ours.fit(x, IDS, batch_size=B, epochs=2, shuffle=False, verbose=0).history["loss"]
    expected = theirs.fit(x, IDS, batch_size=B, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_on_padded_batches_fits_loss_is_cross_entropy_plus_ours_on_the_kept_tokens(name):
    make, causal_lm = MODELS[name]
    keras.utils.set_random_seed(2)
    model = _compiled(RECIPES[name](make(0.0)), learning_rate=0.0)
    x = {"token_ids": IDS, "padding_mask": PADDING}
    loss = model.fit(x, IDS, batch_size=B, epochs=1, verbose=0).history["loss"][0]
    logits = to_numpy(model(x))
    rows = [to_numpy(z).astype(np.float64) for z in model.routers(model.backbone(x, training=True))]
    log_p = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    cross_entropy = -np.mean(np.take_along_axis(log_p, IDS[..., None], -1))
    kept = PADDING.reshape(-1) > 0
    ours = 0.01 * O.hf_load_balancing_loss(rows, E, K, PADDING) / K + 1e-3 * O.st_moe_z_loss(rows, kept)
    np.testing.assert_allclose(loss, cross_entropy + ours, rtol=1e-5)
    if name == "qwen3_moe":  # keras-hub's own mask keeps the right padding
        counted = O.qwen_padding_token_mask(PADDING)
        assert counted.all() and not kept.all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_router_logits_warns_once_naming_the_built_in_coefficient(name):
    make, _ = MODELS[name]
    argument = "router_aux_loss_coefficient" if name == "qwen3_moe" else "router_aux_loss_coef"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kp.RouterLogits(make(0.02))
        kp.RouterLogits(make(0.0))
    messages = [str(w.message) for w in caught if "RouterLogits" in str(w.message)]
    assert len(messages) == 1 and f"`{argument}=0.02`" in messages[0]


def test_the_recipe_saves_and_loads_and_trains_again():
    keras.utils.set_random_seed(3)
    model = _compiled(RECIPES["qwen3_moe"](_qwen3_moe(0.0)))
    x = {"token_ids": IDS, "padding_mask": PADDING}
    expected = to_numpy(model(x))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "moe.keras")
        model.save(path)
        loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_allclose(to_numpy(loaded(x)), expected, rtol=1e-5, atol=1e-6)
    assert len(loaded.routers.routers) == len(model.routers.routers) == 2  # hooked again by __init__
    first = model.evaluate(x, IDS, verbose=0, return_dict=True)
    again = loaded.evaluate(x, IDS, verbose=0, return_dict=True)
    np.testing.assert_allclose(again["loss"], first["loss"], rtol=1e-5)


def test_the_functional_form_logs_each_router_term():
    keras.utils.set_random_seed(4)
    backbone = _qwen3_moe(0.0)
    routers = kp.RouterLogits(backbone)
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
    }
    hidden = backbone(inputs)
    hidden = kp.CompositeObjective(
        {
            "load_balancing": kp.Term(
                "router_load_balancing",
                0.01,
                inputs=("router_logits",),
                options={"top_k": backbone.top_k, "mask": "padding_mask"},
            ),
            "router_z": kp.Term("router_z_loss", 1e-3, inputs=("router_logits",), options={"mask": "padding_mask"}),
        },
        name="moe",
    )({"hidden": hidden, "router_logits": routers(hidden), "padding_mask": inputs["padding_mask"]})["hidden"]
    logits = backbone.token_embedding(hidden, reverse=True)
    model = _compiled(keras.Model(inputs, logits), learning_rate=0.0)
    x = {"token_ids": IDS, "padding_mask": PADDING}
    history = model.fit(x, IDS, batch_size=B, verbose=0, callbacks=[PenaltyMonitor()]).history
    rows = [to_numpy(z).astype(np.float64) for z in routers(backbone(x, training=True))]
    kept = PADDING.reshape(-1) > 0
    np.testing.assert_allclose(
        history["moe/load_balancing"][0], O.hf_load_balancing_loss(rows, E, K, PADDING) / K, rtol=1e-5
    )
    np.testing.assert_allclose(history["moe/router_z"][0], O.st_moe_z_loss(rows, kept), rtol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_under_mixed_precision_the_router_logits_are_half_and_the_penalties_float32(policy):
    if keras.backend.backend() == "tensorflow":
        # keras-hub 0.32's MoE blocks multiply their half-precision softmax by
        # a float32 mask in training, which TF refuses, whatever the coefficient
        # (docs/routers.md); the ops' half-precision numbers are tests/test_routers.py's.
        pytest.skip("keras-hub's MoE blocks do not train under mixed precision on TensorFlow")
    keras.utils.set_random_seed(5)
    model = _compiled(RECIPES["mixtral"](_mixtral(0.0)), learning_rate=0.0)
    x = {"token_ids": IDS, "padding_mask": PADDING}
    loss = model.fit(x, IDS, batch_size=B, epochs=1, verbose=0).history["loss"][0]
    logits = model.routers(model.backbone(x, training=True))
    assert {keras.backend.standardize_dtype(z.dtype) for z in logits} == {policy.split("_")[1]}
    rows = [to_numpy(z).astype(np.float64) for z in logits]
    kept = PADDING.reshape(-1) > 0
    ours = 0.01 * O.hf_load_balancing_loss(rows, E, K, PADDING) / K + 1e-3 * O.st_moe_z_loss(rows, kept)
    value = P.router_load_balancing(logits, top_k=K, mask=PADDING)
    assert keras.backend.standardize_dtype(value.dtype) == policy.split("_")[1]
    np.testing.assert_allclose(
        0.01 * to_numpy(value) + 1e-3 * to_numpy(P.router_z_loss(logits, mask=PADDING)), ours, rtol=1e-2
    )
    assert np.isfinite(loss)
