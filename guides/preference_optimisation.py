"""
# Preference optimisation: DPO from hidden states

Direct preference optimisation trains a language model on pairs of
completions, one preferred ("chosen") and one not ("rejected"), against a
frozen reference copy of the model: the loss rewards raising the chosen
completion's log-probability relative to the reference more than the
rejected one's (Rafailov et al., 2023). This guide runs it on a keras-hub
causal LM, on JAX, TensorFlow and PyTorch alike:

1. a GPT-2 built from config (nothing is downloaded) and its frozen copy as
   the reference;
2. preference pairs made by a rule: the policy samples two completions per
   prompt with `generate`, and the one with more tokens below 8 is chosen;
3. `ops.preference_loss` over each side's per-token log-probabilities,
   computed from the hidden states through the tied embedding a chunk of
   tokens at a time (`ops.linear`: no `[tokens, vocab]` logits, forward or
   backward), with TRL's reward logs beside it (`ops.preference_reward` as
   weight-0 terms): the reward margin and the accuracy rise;
4. switching to IPO, SimPO or ORPO;
5. KTO on unpaired data: each completion alone, desirable or not.

The formulas, which library calls each loss what, and the memory saved are
on the [Preference optimisation](../docs/preference_optimisation.md) page.
keras-hub is an optional dependency (Python 3.11+):
`pip install --no-deps keras-hub regex tokenizers`.

    KERAS_BACKEND=jax python guides/preference_optimisation.py
"""

import os

import keras
import numpy as np

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from keras_penalties.callbacks import PenaltyMonitor

try:
    import keras_hub
except ImportError:  # Python 3.10, or keras-hub not installed
    keras_hub = None
    print("This guide needs keras-hub: pip install --no-deps keras-hub regex tokenizers (Python 3.11+).")

STEPS = 6 * int(os.environ.get("GUIDE_ROUNDS", 3))
VOCAB, PROMPT, COMPLETION, HIDDEN = 32, 4, 8, 32
LENGTH = PROMPT + COMPLETION
PAIRS, BETA, CHUNK = 32, 0.1, 16

"""
## 1. A policy and its reference, built from config
"""


def gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=2 * HIDDEN, max_sequence_length=LENGTH, dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


if keras_hub is not None:
    keras.utils.set_random_seed(0)
    policy = gpt2()
    policy.compile(sampler=keras_hub.samplers.RandomSampler(seed=1))
    reference = gpt2().backbone
    reference.set_weights(policy.backbone.get_weights())
    reference.trainable = False

"""
## 2. Pairs decided by a rule

The policy completes each prompt twice; the completion with more tokens
below 8 is chosen, the other rejected (a tie keeps the first as chosen: its
margin then teaches nothing, and DPO's loss is symmetric enough not to
care). Each side's mask keeps its completion's labels.
"""


def score(tokens):
    return (tokens[:, PROMPT:] < 8).sum(axis=1)


def pairs(rng):
    prompts = np.repeat(rng.integers(8, VOCAB, size=(PAIRS, PROMPT)), 2, axis=0)
    token_ids = np.zeros((2 * PAIRS, LENGTH), "int32")
    token_ids[:, :PROMPT] = prompts
    padding = np.arange(LENGTH)[None, :].repeat(len(token_ids), 0) < PROMPT
    out = np.asarray(policy.generate({"token_ids": token_ids, "padding_mask": padding}, stop_token_ids=None)["token_ids"])
    first, second = out[0::2], out[1::2]
    swap = (score(second) > score(first))[:, None]
    return np.where(swap, second, first), np.where(swap, first, second)


"""
## 3. The loss from hidden states, and TRL's reward logs

Both sides go through the same backbone, and `ops.token_logprobs` reads
each label's log-probability from the hidden states `CHUNK` tokens at a
time. The
reference's log-probabilities are computed once per step, before training
(`ref_*` inputs). The objective holds the DPO loss (`"sigmoid"`: −log σ(β·h),
h the chosen's log-ratio to the reference minus the rejected's) and two
weight-0 terms that only log: the reward margin β·h and the accuracy (the
fraction of pairs with h > 0), TRL's `rewards/margins` and
`rewards/accuracies`.
"""


class TokenLogprobs(keras.layers.Layer):
    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, hidden, labels, mask):
        logits = P.linear(hidden, self.embedding.embeddings, transpose_kernel=True)
        return P.token_logprobs(labels, logits, mask=mask, chunk_size=CHUNK)


def sequence_inputs(prefix):
    shape = (LENGTH - 1,)
    return {
        f"{prefix}_ids": keras.Input(shape, dtype="int32", name=f"{prefix}_ids"),
        f"{prefix}_labels": keras.Input(shape, dtype="int32", name=f"{prefix}_labels"),
        f"{prefix}_mask": keras.Input(shape, name=f"{prefix}_mask"),
    }


def pair_logprobs(backbone, inputs):
    """Both sides' per-token log-probabilities, through the same backbone and head."""
    head = TokenLogprobs(backbone.token_embedding)
    sides = []
    for side in ("chosen", "rejected"):
        ids = inputs[f"{side}_ids"]
        hidden = backbone({"token_ids": ids, "padding_mask": keras.ops.ones_like(ids)})
        sides.append(head(hidden, inputs[f"{side}_labels"], inputs[f"{side}_mask"]))
    return sides


def preference_model(backbone, kind="sigmoid", **options):
    inputs = {**sequence_inputs("chosen"), **sequence_inputs("rejected")}
    chosen, rejected = pair_logprobs(backbone, inputs)
    masks = {"chosen_mask": "chosen_mask", "rejected_mask": "rejected_mask", "beta": BETA}
    tensors = {"chosen": chosen, "rejected": rejected, **{k: inputs[k] for k in ("chosen_mask", "rejected_mask")}}
    sides = ("chosen", "rejected")
    if kind not in ("simpo", "orpo"):
        for name in ("ref_chosen", "ref_rejected"):
            inputs[name] = keras.Input((LENGTH - 1,), name=name)
            tensors[name] = inputs[name]
        sides += ("ref_chosen", "ref_rejected")
    terms = {
        "loss": Term("preference_loss", inputs=sides, options={"kind": kind, **masks, **options}),
        "margin": Term("preference_reward", 0.0, inputs=sides, options={"statistic": "margin", "kind": kind, **masks}),
        "accuracy": Term("preference_reward", 0.0, inputs=sides, options={"statistic": "accuracy", "kind": kind, **masks}),
    }
    out = CompositeObjective(terms, name=kind)(tensors)["chosen"]
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=None)
    return model


def scorer(backbone):
    """Both sides' log-probabilities under `backbone`, compiled once."""
    inputs = {**sequence_inputs("chosen"), **sequence_inputs("rejected")}
    return keras.Model(inputs, list(pair_logprobs(backbone, inputs)))


def batch(chosen, rejected, with_reference=True):
    completion = (np.arange(LENGTH - 1)[None, :] >= PROMPT - 1).repeat(PAIRS, 0).astype("float32")
    data = {}
    for side, tokens in (("chosen", chosen), ("rejected", rejected)):
        data.update({f"{side}_ids": tokens[:, :-1], f"{side}_labels": tokens[:, 1:], f"{side}_mask": completion})
    if with_reference:
        data["ref_chosen"], data["ref_rejected"] = (np.asarray(x) for x in reference_scorer.predict_on_batch(data))
    return data


def train(model, steps, rng, with_reference=True, label="sigmoid"):
    monitor = PenaltyMonitor()
    for step in range(steps):
        data = batch(*pairs(rng), with_reference)
        logs = model.fit(data, batch_size=PAIRS, epochs=1, verbose=0, callbacks=[monitor]).history
        margin, accuracy = logs[f"{label}/margin"][0], logs[f"{label}/accuracy"][0]
        if step == 0:
            first = (margin, accuracy)
        if step % 3 == 0 or step == steps - 1:
            print(f"{label} step {step:2d}: loss {logs[f'{label}/loss'][0]:.4f}  margin {margin:+.4f}  accuracy {accuracy:.2f}")
    return first, (margin, accuracy)


if keras_hub is not None:
    reference_scorer = scorer(reference)
    model = preference_model(policy.backbone)
    rng = np.random.default_rng(2)
    (margin0, accuracy0), (margin1, accuracy1) = train(model, STEPS, rng)
    print(f"reward margin: {margin0:+.4f} at the first step -> {margin1:+.4f} at the last")
    print(f"accuracy: {accuracy0:.2f} at the first step -> {accuracy1:.2f} at the last")

"""
The margin starts at 0 (the policy is its reference, so no pair has a
positive margin and the accuracy reads 0) and grows: the policy raises its
chosen completions' log-probabilities relative to the reference and lowers
the rejected ones'; the accuracy, the fraction of pairs it ranks right,
rises towards 1.

## 4. IPO, SimPO, ORPO

The kind is one option. IPO (`kind="ipo"`) regresses h, from mean token
log-probabilities, onto 1/(2β); SimPO (`kind="simpo"`, `gamma=` its target
margin) and ORPO (`kind="orpo"`) need no reference model, so their terms
read the two sides alone; `nll=1.0` adds ORPO's NLL of the chosen
completion (−mean log p over its kept tokens: `kind="orpo", nll=1.0` is
TRL's ORPO loss; beside `"sigmoid"` it is RPO). A few steps of SimPO:
"""

if keras_hub is not None:
    simpo = preference_model(policy.backbone, kind="simpo", beta=2.0, gamma=0.5)
    train(simpo, 4, rng, with_reference=False, label="simpo")

"""
## 5. KTO on unpaired data

KTO needs no pairs: one completion a prompt, labelled desirable or not
(here: the chosen and the rejected of the pairs above, each on its own).
Its loss moves each completion's log-ratio to the reference, Δ, away from a
baseline z₀ — up for the desirable, down for the others — and z₀ comes
from mismatched pairs: each prompt with the previous example's completion,
as TRL builds them, scored by the policy (without a gradient) and by the
reference. `ops.unpaired_preference_loss` takes them as `kl_logprobs` and
`ref_kl_logprobs`; z₀ is their mean log-ratio, at least 0.
"""


def kto_model(backbone):
    inputs = {**sequence_inputs("x"), **sequence_inputs("kl")}
    for name in ("ref", "ref_kl"):
        inputs[name] = keras.Input((LENGTH - 1,), name=name)
    inputs["desirable"] = keras.Input((), name="desirable")
    head = TokenLogprobs(backbone.token_embedding)
    tensors = {k: inputs[k] for k in ("ref", "ref_kl", "desirable", "x_mask", "kl_mask")}
    for side in ("x", "kl"):
        hidden = backbone({"token_ids": inputs[f"{side}_ids"], "padding_mask": keras.ops.ones_like(inputs[f"{side}_ids"])})
        tensors[side] = head(hidden, inputs[f"{side}_labels"], inputs[f"{side}_mask"])
    tensors["kl"] = keras.ops.stop_gradient(tensors["kl"])
    options = {"beta": BETA, "mask": "x_mask", "kl_logprobs": "kl", "ref_kl_logprobs": "ref_kl", "kl_mask": "kl_mask"}
    term = Term("unpaired_preference_loss", inputs=("x", "ref", "desirable"), options=options)
    out = CompositeObjective({"loss": term}, name="kto")(tensors)["x"]
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=None)
    return model


def unpaired(rng):
    """Each pair's chosen (desirable) and rejected (undesirable) alone, and
    each prompt with the previous example's completion (the mismatched pairs)."""
    chosen, rejected = pairs(rng)
    tokens = np.concatenate([chosen, rejected])
    mismatched = np.concatenate([tokens[:, :PROMPT], np.roll(tokens[:, PROMPT:], 1, axis=0)], axis=1)
    completion = (np.arange(LENGTH - 1)[None, :] >= PROMPT - 1).repeat(len(tokens), 0).astype("float32")
    data = {"desirable": np.repeat([1.0, 0.0], PAIRS).astype("float32")}
    for side, ids in (("x", tokens), ("kl", mismatched)):
        data.update({f"{side}_ids": ids[:, :-1], f"{side}_labels": ids[:, 1:], f"{side}_mask": completion})
    for side, name in (("x", "ref"), ("kl", "ref_kl")):
        scored = {f"{s}_{k}": data[f"{side}_{k}"] for s in ("chosen", "rejected") for k in ("ids", "labels", "mask")}
        data[name] = np.asarray(reference_scorer.predict_on_batch(scored)[0])
    return data


if keras_hub is not None:
    kto = kto_model(policy.backbone)
    for step in range(4):
        logs = kto.fit(unpaired(rng), batch_size=2 * PAIRS, epochs=1, verbose=0, callbacks=[PenaltyMonitor()]).history
        if step == 0:
            kto_first = logs["kto/loss"][0]
    print(f"kto loss: {kto_first:.4f} at the first step -> {logs['kto/loss'][0]:.4f} at the last")
