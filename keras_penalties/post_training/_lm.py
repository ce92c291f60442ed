"""A causal language model as the post-training models read it: its hidden
states, its head, and each token's log-probability from them; a frozen
copy of it as a reference.

Per-token arrays align with their token ids: entry t belongs to token t,
whose log-probability is read from the hidden state at t − 1; column 0 is
never scored.
"""

from typing import Any

import keras
from keras import ops

from keras_penalties import ops as penalties
from keras_penalties._saving import with_hint, without_hint
from keras_penalties.distillation._parts import ModelHead


def is_keras_hub_lm(model: Any) -> bool:
    """Whether `model` is a keras-hub causal LM: a backbone whose token
    embedding is its head (read reversed)."""
    backbone = getattr(model, "backbone", None)
    return backbone is not None and hasattr(backbone, "token_embedding") and hasattr(model, "generate")


class LanguageModel:
    """`model`'s hidden states and head: a keras-hub `CausalLM` (its
    backbone, and the backbone's `token_embedding` reversed), or any Keras
    model whose output is logits with `head` its vocabulary projection (a
    layer or its name), read as the `Distiller`'s `head=` is. `argument`
    names the model in errors."""

    def __init__(self, model: keras.Model, head: Any = None, argument: str = "policy") -> None:
        self.model = model
        if head is None and is_keras_hub_lm(model):
            self.layer, self.hidden_model, self.keras_hub = model.backbone.token_embedding, model.backbone, True
            return
        if head is None:
            raise ValueError(
                f"`head`: {model.name} is not a keras-hub causal LM, so its vocabulary projection must be named: "
                "pass head= the Dense (or reversible embedding) layer, or its name, that produces its logits."
            )
        found = ModelHead(model, head, "head")
        self.layer, self.hidden_model, self.keras_hub = found.layer, found.hidden_model, False
        names = [getattr(t, "name", "").split(":")[0] for t in keras.tree.flatten(model.inputs)]
        self.input_keys = names if {"token_ids", "padding_mask"} <= set(names) else None

    def hidden(self, token_ids: Any, padding_mask: Any, training: Any = None) -> Any:
        """The hidden states [batch, length, H] that feed the head."""
        if self.keras_hub or self.input_keys:
            return self.hidden_model({"token_ids": token_ids, "padding_mask": padding_mask}, training=training)
        return self.hidden_model(token_ids, training=training)

    def token_logprobs(
        self, hidden: Any, token_ids: Any, mask: Any, chunk_size: Any, return_entropy: bool = False
    ) -> Any:
        """log p of tokens 1.. of each row from the hidden states at 0..
        ([batch, length − 1]; with `return_entropy`, and each position's
        entropy), 0 where `mask` (aligned with the ids) drops a token."""
        logits = penalties.linear(hidden[:, :-1], self.layer)
        return penalties.token_logprobs(
            token_ids[:, 1:], logits, mask=mask[:, 1:], chunk_size=chunk_size, return_entropy=return_entropy
        )


def frozen_copy(model: keras.Model) -> keras.Model:
    """A copy of `model` with its weights at this moment, not trainable: a
    keras-hub model rebuilt from its config (`keras.models.clone_model`
    loses its class), any other cloned."""
    if is_keras_hub_lm(model):
        copy = type(model).from_config(model.get_config())
    else:
        copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    copy.trainable = False
    return copy


def padded_to(x: Any, length: Any) -> Any:
    """[batch, n] padded with zeros on the right to `length` columns."""
    pad = length - ops.shape(x)[1]
    if isinstance(pad, int) and pad == 0:
        return x
    return ops.pad(x, [[0, 0], [0, pad]])


def side_by_side(*arrays: Any) -> Any:
    """The rows of several [batch_i, length_i] arrays in one array, each
    padded on the right to the longest (a concatenated forward: both sides
    of a pair through the model in one call). Lengths known only at run
    time must be equal."""
    lengths = [a.shape[1] for a in arrays]
    if any(n is None for n in lengths):
        return ops.concatenate(list(arrays), axis=0)
    longest = max(lengths)
    return ops.concatenate([padded_to(a, longest) for a in arrays], axis=0)


def aligned(values: Any) -> Any:
    """An array of the data aligned with the ids (entry t token t's): per
    token, tokens 1.. (as the models score them); per sequence as it is."""
    values = ops.cast(ops.convert_to_tensor(values), "float32")
    return values if len(values.shape) == 1 else values[:, 1:]


def head_name(head: Any) -> Any:
    """`head` as a config keeps it: None, or a layer's name."""
    return head if head is None or isinstance(head, str) else head.name


def models_config(policy: keras.Model, reference: Any, options: dict[str, Any]) -> dict[str, Any]:
    """A post-training model's config: its policy and reference serialized,
    then its `options`."""
    serialized = None if reference is None else keras.saving.serialize_keras_object(reference)
    return with_hint({"policy": keras.saving.serialize_keras_object(policy), "reference": serialized, **options})


def models_from_config(config: dict[str, Any]) -> tuple[keras.Model, Any, dict[str, Any]]:
    """The policy, the reference (or None) and the other options of a
    `models_config`."""
    config = without_hint(config)
    policy = keras.saving.deserialize_keras_object(config.pop("policy"))
    reference = config.pop("reference")
    return policy, None if reference is None else keras.saving.deserialize_keras_object(reference), config
