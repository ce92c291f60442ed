"""keras-hub causal LMs other than GPT-2, built from config (no download),
as first-class policies of `PreferenceModel` and `PolicyModel`: Gemma with
its final logit soft cap (the head reads the cap from the layer), Llama
with an untied head (the reverse embeddings, not the token embeddings),
and Qwen3-MoE, whose router load-balancing loss (keras-hub adds it with
`add_loss`) is part of the policy's losses. Each loss equals the ops applied
by hand to the model's own logits (a log-softmax, a gather) plus the
model's own losses from the same forward pass; `fit` trains each.
"""

import keras
import numpy as np
import pytest

from keras_penalties import ops as P
from keras_penalties.post_training import PolicyModel, PreferenceModel
from tests.test_post_training import BATCH, PAIRS, ROLLOUT, VOCAB, _by_hand, _formed_logprobs
from tests.testing import to_numpy

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub needs Python 3.11+; make test installs it there (--no-deps, see the Makefile)"
)


def _gemma():
    # A cap of 2 with logits of a few units: the cap changes every log-probability.
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        head_dim=4,
        final_logit_soft_cap=2.0,
        dropout=0.0,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _llama():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        tie_word_embeddings=False,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _qwen3_moe():
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        moe_intermediate_dim=8,
        num_experts=4,
        head_dim=4,
        top_k=2,
        router_aux_loss_coefficient=0.5,
    )
    return keras_hub.models.Qwen3MoeCausalLM(backbone=backbone, preprocessor=None)


MODELS = {"gemma": _gemma, "llama": _llama, "qwen3_moe": _qwen3_moe}


def _policy(name, seed=0):
    keras.utils.set_random_seed(seed)
    model = MODELS[name]()
    embeddings = model.backbone.token_embedding.embeddings
    # Logits of a few units (Gemma's input embeddings are scaled by √H already).
    embeddings.assign(embeddings * (3.0 if name == "gemma" else 30.0))
    return model


def _own_losses(lm, ids, padding):
    """Σ of the model's own losses (a router's load balancing, added in training) from a forward pass on
    these rows."""
    lm({"token_ids": ids, "padding_mask": padding}, training=True)
    return float(sum(float(to_numpy(loss)) for loss in lm.losses))


def test_each_model_is_what_it_tests():
    gemma, llama, moe = _policy("gemma"), _policy("llama"), _policy("qwen3_moe")
    ids, padding = ROLLOUT["token_ids"], ROLLOUT["padding_mask"]
    # Gemma: the cap bounds its logits, so the uncapped projection is not its head.
    logits = to_numpy(gemma({"token_ids": ids, "padding_mask": padding}))
    hidden = gemma.backbone({"token_ids": ids, "padding_mask": padding})
    uncapped = to_numpy(hidden) @ to_numpy(gemma.backbone.token_embedding.embeddings).T
    assert np.abs(logits).max() <= 2.0 < 1.5 * 2.0 < np.abs(uncapped).max()
    # Llama: an untied head.
    assert not llama.backbone.token_embedding.tie_weights
    # Qwen3-MoE: its router adds a loss on every forward pass.
    assert _own_losses(moe, ids, padding) > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_dpo_loss_equals_the_ops_on_the_models_own_logits_plus_its_own_losses(name):
    policy = _policy(name)
    model = PreferenceModel(policy, chunk_size=5)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    expected = _by_hand(policy, model.reference, PAIRS)["loss"]
    # Both sides go through the policy in one call, each padded on the right to the longest.
    longest = max(PAIRS["chosen_ids"].shape[1], PAIRS["rejected_ids"].shape[1])

    def padded(x):
        return np.pad(x, [(0, 0), (0, longest - x.shape[1])])

    ids = np.concatenate([padded(PAIRS["chosen_ids"]), padded(PAIRS["rejected_ids"])])
    padding = np.concatenate([padded(PAIRS["chosen_padding_mask"]), padded(PAIRS["rejected_padding_mask"])])
    expected += _own_losses(policy, ids, padding)
    np.testing.assert_allclose(float(to_numpy(model.compute_loss(PAIRS))), expected, rtol=1e-5, atol=1e-6)
    before = [w.copy() for w in policy.get_weights()]
    history = model.fit(PAIRS, batch_size=BATCH, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    assert any(not np.allclose(a, b) for a, b in zip(before, policy.get_weights()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_grpo_loss_equals_the_ops_on_the_models_own_logits_plus_its_own_losses(name):
    policy = _policy(name, seed=1)
    model = PolicyModel(policy, reduction="sequence_mean", chunk_size=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    ids, padding = ROLLOUT["token_ids"], ROLLOUT["padding_mask"]
    logprobs = _formed_logprobs(policy, ids, padding)
    mask = ROLLOUT["completion_mask"][:, 1:]
    expected = float(
        P.policy_loss(logprobs, logprobs, ROLLOUT["advantages"], mask=mask, reduction="sequence_mean")
    ) + _own_losses(policy, ids, padding)
    np.testing.assert_allclose(float(to_numpy(model.compute_loss(ROLLOUT))), expected, rtol=1e-5, atol=1e-6)
    history = model.fit(ROLLOUT, batch_size=BATCH, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all()
