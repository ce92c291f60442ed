"""keras-hub causal LMs built from config (no download), trained and distilled
through their tied embeddings without forming the logits: GPT-2, and a
Gemma 2-style model whose final logits are soft-capped.

Oracles: the same keras-hub models trained the way keras-hub trains them,
from their logits (the causal LM compiled with Keras' sparse cross-entropy;
the unfused Distiller).
"""

import keras
import numpy as np
import pytest

from keras_penalties import ops as P
from keras_penalties.distillation import Distiller, LogitsDivergence
from tests.testing import to_numpy

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub needs Python 3.11+; make test installs it there (--no-deps, see the Makefile)"
)

VOCAB, LENGTH = 61, 8
RNG = np.random.default_rng(17)
TOKEN_IDS = RNG.integers(1, VOCAB, size=(6, LENGTH + 1))
LENGTHS = np.array([9, 4, 7, 9, 2, 6])  # right padding, as keras-hub's preprocessors make it
PADDING = (np.arange(LENGTH + 1)[None, :] < LENGTHS[:, None]).astype("int32")
TOKEN_IDS = TOKEN_IDS * PADDING
# Next-token prediction: inputs are tokens 0..L-1, labels 1..L, a label
# counts where it is not padding.
X = {"token_ids": TOKEN_IDS[:, :-1], "padding_mask": PADDING[:, :-1]}
Y = TOKEN_IDS[:, 1:]
SAMPLE_WEIGHT = PADDING[:, 1:].astype("float32")


def _gpt2(num_layers, seed):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=num_layers,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    # GPT-2's initial embeddings (σ = 0.02) give logits near 0, where two
    # models' distributions nearly coincide (KL ~ 1e-3, within float32
    # cancellation of any implementation): logits of a few units instead.
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(embeddings * 40.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


class HeadOwningLM(keras.Model):
    """A causal LM that owns its head: it outputs the backbone's hidden
    states and computes its loss from them, through the tied embedding,
    `chunk_size` tokens at a time (a compute_loss override)."""

    def __init__(self, backbone, chunk_size, **kwargs):
        inputs = backbone.input
        super().__init__(inputs, backbone(inputs), **kwargs)
        self.backbone = backbone
        self.chunk_size = chunk_size

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        logits = P.linear(y_pred, self.backbone.token_embedding.embeddings, transpose_kernel=True)
        loss = P.cross_entropy(y, logits, mask=sample_weight, chunk_size=self.chunk_size)
        return loss + sum(self.losses)


def test_a_causal_lm_that_owns_its_head_trains_as_keras_hubs_own():
    # keras-hub's model from its logits, averaging over the kept tokens
    # ("mean_with_sample_weight"), against the same backbone whose loss is
    # formed a few tokens at a time from the hidden states.
    reference = _gpt2(1, seed=3)
    reference.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
    )
    fused_backbone = _gpt2(1, seed=3).backbone
    fused = HeadOwningLM(fused_backbone, chunk_size=5)
    fused.compile(optimizer=keras.optimizers.SGD(0.5))
    histories = [
        model.fit(X, Y, sample_weight=SAMPLE_WEIGHT, batch_size=3, epochs=2, shuffle=False, verbose=0).history["loss"]
        for model in (reference, fused)
    ]
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    assert histories[0][-1] < histories[0][0]
    for a, b in zip(reference.backbone.get_weights(), fused_backbone.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_fused_distillation_of_a_keras_hub_lm_equals_unfused():
    results = {}
    for fused in (False, True):
        teacher, student = _gpt2(2, seed=1), _gpt2(1, seed=2)
        fuse = dict(head="token_embedding", teacher_head="token_embedding", chunk_size=5) if fused else {}
        distiller = Distiller(
            teacher,
            student,
            [LogitsDivergence(temperature=2.0, name="kd"), LogitsDivergence("js", beta=0.2, name="js")],
            [1.0, 0.5],
            student_loss_weight=0.3,
            **fuse,
        )
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        history = distiller.fit(
            X, Y, sample_weight=SAMPLE_WEIGHT, batch_size=3, epochs=2, shuffle=False, verbose=0
        ).history
        results[fused] = (history, to_numpy(student.predict(X, verbose=0)))
    for key in ("loss", "student_loss", "distillation/kd", "distillation/js"):
        np.testing.assert_allclose(results[True][0][key], results[False][0][key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(results[True][1], results[False][1], rtol=1e-4, atol=1e-5)


def _gemma(num_layers, seed, soft_cap=1.5):
    """A Gemma 2-style causal LM from a small config: its final logits
    soft-capped (c·tanh(z / c)), as Gemma 2's presets cap them at 30; a
    cap of 1.5 here, where the logits reach a few units, bends them."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=num_layers,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
        final_logit_soft_cap=soft_cap,
        dropout=0.0,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def test_a_soft_capped_gemma_distils_fused_as_its_own_logits_path():
    results = {}
    for fused in (False, True):
        teacher, student = _gemma(2, seed=1, soft_cap=2.0), _gemma(1, seed=2)
        fuse = dict(head="token_embedding", teacher_head="token_embedding", chunk_size=5) if fused else {}
        distiller = Distiller(teacher, student, LogitsDivergence(temperature=2.0, name="kd"), **fuse)
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        history = distiller.fit(
            X, Y, sample_weight=SAMPLE_WEIGHT, batch_size=3, epochs=2, shuffle=False, verbose=0
        ).history
        results[fused] = (history, to_numpy(student.predict(X, verbose=0)))
    logits = results[False][1]
    assert np.abs(logits).max() < 1.5 and np.abs(logits).max() > 1.0  # capped, and the cap binds
    for key in ("loss", "student_loss", "distillation/kd"):
        np.testing.assert_allclose(results[True][0][key], results[False][0][key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(results[True][1], logits, rtol=1e-4, atol=1e-5)


def test_a_soft_capped_gemma_fine_tunes_through_token_logprobs_as_from_its_logits():
    class FusedGemma(keras.Model):
        """Its loss −mean log p(label) over kept tokens, from the hidden
        states through the capped tied embedding, 5 tokens at a time."""

        def __init__(self, backbone, **kwargs):
            super().__init__(backbone.input, backbone(backbone.input), **kwargs)
            self.backbone = backbone

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            embedding = self.backbone.token_embedding
            logits = P.linear(y_pred, embedding.embeddings, transpose_kernel=True, soft_cap=embedding.logit_soft_cap)
            logprobs = P.token_logprobs(y, logits, mask=sample_weight, chunk_size=5)
            return -keras.ops.sum(logprobs) / keras.ops.sum(sample_weight) + sum(self.losses)

    reference = _gemma(1, seed=3)
    reference.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
    )
    fused_backbone = _gemma(1, seed=3).backbone
    fused = FusedGemma(fused_backbone)
    fused.compile(optimizer=keras.optimizers.SGD(0.5))
    histories = [
        model.fit(X, Y, sample_weight=SAMPLE_WEIGHT, batch_size=3, epochs=2, shuffle=False, verbose=0).history["loss"]
        for model in (reference, fused)
    ]
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    assert histories[0][-1] < histories[0][0]
    for a, b in zip(reference.backbone.get_weights(), fused_backbone.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["gemma", "gpt2", "llama"])
def test_linear_of_the_head_layer_gives_the_models_own_logits(model):
    # The layer says its kernel, orientation and soft cap: Gemma's capped tied embedding, GPT-2's tied one, an
    # untied reversible embedding (Llama's), each equal to the model's own logits; the tensor path without the
    # cap (the silent trap it replaces) is not.
    if model == "gemma":
        causal_lm = _gemma(1, seed=5)
    elif model == "gpt2":
        causal_lm = _gpt2(1, seed=5)
    else:
        keras.utils.set_random_seed(5)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB,
            num_layers=1,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=16,
            intermediate_dim=32,
            tie_word_embeddings=False,
        )
        causal_lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    backbone = causal_lm.backbone
    hidden = backbone(X)
    expected = to_numpy(causal_lm(X))
    got = to_numpy(P.linear(hidden, backbone.token_embedding).materialise("float32"))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    labels = X["token_ids"]
    fused = P.token_logprobs(labels, P.linear(hidden, backbone.token_embedding), chunk_size=5)
    formed = np.take_along_axis(expected - np.log(np.exp(expected).sum(-1, keepdims=True)), labels[..., None], -1)[
        ..., 0
    ]
    np.testing.assert_allclose(to_numpy(fused), formed, rtol=1e-4, atol=1e-5)
    if model == "gemma":
        uncapped = to_numpy(
            P.linear(hidden, backbone.token_embedding.embeddings, transpose_kernel=True).materialise("float32")
        )
        assert np.abs(uncapped - expected).max() > 0.1
