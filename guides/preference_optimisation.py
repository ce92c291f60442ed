"""
# Preference optimisation: DPO, SimPO and KTO on a keras-hub LM

Direct preference optimisation trains a language model on pairs of
completions, one preferred ("chosen") and one not ("rejected"), against a
frozen reference copy of the model: the loss rewards raising the chosen
completion's log-probability relative to the reference more than the
rejected one's (Rafailov et al., 2023). Here it is a model you `compile`
and `fit`, `keras_penalties.post_training.PreferenceModel`, on JAX,
TensorFlow and PyTorch alike:

1. a GPT-2 built from config (nothing is downloaded);
2. preference pairs made by a rule: the policy samples two completions per
   prompt with `generate`, and the one with more tokens below 8 is chosen;
3. `PreferenceModel(policy)`: the reference copied, each token's
   log-probability read from the hidden states through the tied embedding
   a chunk of tokens at a time (no `[tokens, vocab]` logits, forward or
   backward), TRL's reward logs: the reward margin and the accuracy rise;
4. SimPO and ORPO (no reference) by changing `kind`;
5. KTO on unpaired data: each completion alone, desirable or not.

The losses, which library calls each what, and TRL's equivalent of each
line are on the [Preference optimisation](../docs/preference_optimisation.md)
and [Post-training models](../docs/post_training.md) pages. keras-hub is an
optional dependency (Python 3.11+): `pip install --no-deps keras-hub regex
tokenizers`.

    KERAS_BACKEND=jax python guides/preference_optimisation.py
"""

import os

import keras
import numpy as np

from keras_penalties.post_training import PreferenceModel

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
## 1. A policy built from config
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

"""
## 2. Pairs decided by a rule

The policy completes each prompt twice; the completion with more tokens
below 8 is chosen, the other rejected (a tie keeps the first as chosen: its
margin then teaches nothing). A side's mask is 1 on its completion's
tokens, aligned with its ids.
"""


def score(tokens):
    return (tokens[:, PROMPT:] < 8).sum(axis=1)


def completions(prompts):
    token_ids = np.zeros((len(prompts), LENGTH), "int32")
    token_ids[:, :PROMPT] = prompts
    padding = np.arange(LENGTH)[None, :].repeat(len(prompts), 0) < PROMPT
    return np.asarray(policy.generate({"token_ids": token_ids, "padding_mask": padding}, stop_token_ids=None)["token_ids"])


MASK = (np.arange(LENGTH) >= PROMPT).astype("float32")[None].repeat(PAIRS, 0)


def pairs(rng):
    out = completions(np.repeat(rng.integers(8, VOCAB, size=(PAIRS, PROMPT)), 2, axis=0))
    first, second = out[0::2], out[1::2]
    swap = (score(second) > score(first))[:, None]
    chosen, rejected = np.where(swap, second, first), np.where(swap, first, second)
    return {"chosen_ids": chosen, "rejected_ids": rejected, "chosen_mask": MASK, "rejected_mask": MASK}


"""
## 3. DPO as a model: compile and fit

`PreferenceModel(policy)` copies the policy as its frozen reference, runs
both sides through the policy in one call, and computes DPO's loss
(`kind="sigmoid"`: −log σ(β·h), h the chosen's log-ratio to the reference
minus the rejected's) from the hidden states. Each step trains on fresh
pairs; the logs are TRL's: `rewards/margins` (β·h) and
`rewards/accuracies` (the fraction of pairs with h > 0).
"""

if keras_hub is not None:
    model = PreferenceModel(policy, kind="sigmoid", beta=BETA, chunk_size=CHUNK)
    model.compile(optimizer=keras.optimizers.Adam(3e-3))
    rng = np.random.default_rng(2)
    for step in range(STEPS):
        logs = model.fit(pairs(rng), batch_size=PAIRS, verbose=0).history
        margin, accuracy = logs["rewards/margins"][0], logs["rewards/accuracies"][0]
        if step == 0:
            first = margin, accuracy
        if step % 3 == 0 or step == STEPS - 1:
            print(
                f"sigmoid step {step:2d}: loss {logs['loss'][0]:.4f} (a pair's, mean)  "
                f"margin {margin:+.4f} (β·h, a pair's, mean)  accuracy {accuracy:.2f} (of pairs)"
            )
    print(f"reward margin: {first[0]:+.4f} at the first step -> {margin:+.4f} at the last (β·h, a pair's, mean)")
    print(f"accuracy: {first[1]:.2f} at the first step -> {accuracy:.2f} at the last (the fraction of pairs with h > 0)")

"""
The margin starts at 0 (the policy is its reference, so no pair has a
positive margin and the accuracy reads 0) and grows: the policy raises its
chosen completions' log-probabilities relative to the reference and lowers
the rejected ones'; the accuracy, the fraction of pairs it ranks right,
rises towards 1.

## 4. SimPO and ORPO

The kind is one argument. SimPO (`kind="simpo"`, `gamma` its target margin
in `loss_options`) and ORPO (`kind="orpo"`) have no reference model: none is
copied. `nll_weight=1.0` adds ORPO's NLL of the chosen completion (beside
`"sigmoid"` it is RPO). A few steps of SimPO:
"""

if keras_hub is not None:
    simpo = PreferenceModel(policy, kind="simpo", beta=2.0, loss_options={"gamma": 0.5}, chunk_size=CHUNK)
    simpo.compile(optimizer=keras.optimizers.Adam(3e-3))
    for step in range(4):
        logs = simpo.fit(pairs(rng), batch_size=PAIRS, verbose=0).history
        if step % 3 == 0:
            print(
                f"simpo step {step:2d}: loss {logs['loss'][0]:.4f} (a pair's, mean)  "
                f"accuracy {logs['rewards/accuracies'][0]:.2f} (of pairs)"
            )

"""
## 5. KTO on unpaired data

KTO needs no pairs: one completion a prompt, labelled desirable or not
(here: the chosen and the rejected of the pairs above, each on its own).
Its loss moves each completion's log-ratio to the reference up for the
desirable and down for the others, past a baseline z₀ formed from
mismatched pairs (`kl_ids`: each prompt with another example's
completion, as TRL builds them); TRL logs z₀ as `kl`.
"""


def unpaired(rng):
    data = pairs(rng)
    ids = np.concatenate([data["chosen_ids"], data["rejected_ids"]])
    mask = np.concatenate([MASK, MASK])
    mismatched = np.concatenate([ids[:, :PROMPT], np.roll(ids[:, PROMPT:], 1, axis=0)], axis=1)
    label = np.repeat([1.0, 0.0], PAIRS).astype("float32")
    return {"completion_ids": ids, "completion_mask": mask, "label": label, "kl_ids": mismatched, "kl_mask": mask}


if keras_hub is not None:
    kto = PreferenceModel(policy, kind="kto", beta=BETA, chunk_size=CHUNK)
    kto.compile(optimizer=keras.optimizers.Adam(3e-3))
    for step in range(4):
        logs = kto.fit(unpaired(rng), batch_size=2 * PAIRS, verbose=0).history
        if step == 0:
            kto_first = logs["rewards/margins"][0]
    last = logs["rewards/margins"][0]
    print(
        f"kto reward margin (the desirable completions' mean β·log-ratio − the undesirable's): "
        f"{kto_first:+.4f} at the first step -> {last:+.4f} at the last"
    )
