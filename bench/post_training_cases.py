"""The post-training models' training steps (`train_on_batch`: forward,
backward, SGD update) on a policy whose body is tiny (an embedding) and
whose head is a Dense [256 → 128256], so the step is the head and the
losses: 2048 tokens a step, float32.

- a `PreferenceModel` DPO step (8 pairs, each side 128 tokens, the
  reference's sums precomputed in the data) against the same step wired by
  hand from the ops (as the guides wired it: both sides through the policy
  in one call, `ops.token_logprobs` on `ops.linear(hidden, head)`,
  `ops.preference_loss`), and against the logits formed (a log-softmax and
  a gather, as TRL writes it);
- a `PolicyModel` GRPO step (16 completions of 128 tokens, sequence-mean
  PPO loss, no KL) against the same wired by hand, and against the logits
  formed.
"""

import os

import keras
import numpy as np
from keras import ops

from bench.case import Case
from keras_penalties import ops as P
from keras_penalties.post_training import PolicyModel, PreferenceModel

SHAPE = (2048, 256, 128256)  # tokens a step, hidden size, vocabulary
LENGTH, BETA = 128, 0.1
CHUNK = int(os.environ["HEAD_CHUNK"]) if os.environ.get("HEAD_CHUNK") else "auto"


def _sizes(small):
    return ((64, 16, 1000), 8) if small else (SHAPE, LENGTH)


def _policy(vocab, hidden, length):
    keras.utils.set_random_seed(0)
    ids = keras.Input((length,), dtype="int32")
    body = keras.layers.Embedding(vocab, hidden, name="body")(ids)
    return keras.Model(ids, keras.layers.Dense(vocab, name="head")(body), name="policy")


def _logprobs(model, ids, mask, formed):
    """log p of tokens 1.. from the policy's head: fused in chunks, or the logits formed."""
    hidden = model.get_layer("body")(ids)[:, :-1]
    labels, mask = ids[:, 1:], ops.cast(mask[:, 1:], "float32")
    head = model.get_layer("head")
    if not formed:
        return P.token_logprobs(labels, P.linear(hidden, head), mask=mask, chunk_size=CHUNK)
    logp = ops.log_softmax(head(hidden), axis=-1)
    return ops.take_along_axis(logp, ops.expand_dims(labels, -1), axis=-1)[..., 0] * mask


class _ByHand(keras.Model):
    """A training step wired by hand around the policy: `loss(model, x, formed)`."""

    def __init__(self, policy, loss, formed):
        super().__init__(name="by_hand")
        self.policy, self.loss_fn, self.formed = policy, loss, formed

    def call(self, x):
        return x

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return self.loss_fn(self.policy, x, self.formed)


def _dpo_loss(policy, x, formed):
    ids = ops.concatenate([x["chosen_ids"], x["rejected_ids"]], axis=0)
    mask = ops.concatenate([x["chosen_mask"], x["rejected_mask"]], axis=0)
    logprobs = _logprobs(policy, ids, mask, formed)
    pairs = ops.shape(x["chosen_ids"])[0]
    return P.preference_loss(
        logprobs[:pairs],
        logprobs[pairs:],
        x["ref_chosen_logprobs"],
        x["ref_rejected_logprobs"],
        beta=BETA,
        chosen_mask=x["chosen_mask"][:, 1:],
        rejected_mask=x["rejected_mask"][:, 1:],
    )


def _grpo_loss(policy, x, formed):
    logprobs = _logprobs(policy, x["token_ids"], x["completion_mask"], formed)
    mask = x["completion_mask"][:, 1:]
    return P.policy_loss(logprobs, ops.stop_gradient(logprobs), x["advantages"], mask=mask, reduction="sequence_mean")


def _dpo_data(small):
    (tokens, _, vocab), length = _sizes(small)
    pairs, rng = tokens // (2 * length), np.random.default_rng(1)
    mask = (np.arange(length) >= length // 8).astype("float32")[None].repeat(pairs, 0)
    return {
        "chosen_ids": rng.integers(0, vocab, size=(pairs, length)).astype("int32"),
        "rejected_ids": rng.integers(0, vocab, size=(pairs, length)).astype("int32"),
        "chosen_mask": mask,
        "rejected_mask": mask,
        "ref_chosen_logprobs": -rng.uniform(200.0, 400.0, size=pairs).astype("float32"),
        "ref_rejected_logprobs": -rng.uniform(200.0, 400.0, size=pairs).astype("float32"),
    }


def _grpo_data(small):
    (tokens, _, vocab), length = _sizes(small)
    rows, rng = tokens // length, np.random.default_rng(2)
    return {
        "token_ids": rng.integers(0, vocab, size=(rows, length)).astype("int32"),
        "completion_mask": (np.arange(length) >= length // 8).astype("float32")[None].repeat(rows, 0),
        "advantages": rng.normal(size=rows).astype("float32"),
    }


def _steps(kind, versus):
    """A case's build: the model's step (ours) against the step wired by hand
    (`versus="hand"`: fused the same way; `"formed"`: the logits formed)."""

    def build(small):
        (_, hidden, vocab), length = _sizes(small)
        data = (_dpo_data if kind == "dpo" else _grpo_data)(small)

        def step(ours):
            policy = _policy(vocab, hidden, length)
            if not ours:
                model = _ByHand(policy, _dpo_loss if kind == "dpo" else _grpo_loss, formed=versus == "formed")
            elif kind == "dpo":
                model = PreferenceModel(policy, None, beta=BETA, head="head", chunk_size=CHUNK)
            else:
                model = PolicyModel(policy, reduction="sequence_mean", head="head", chunk_size=CHUNK)
            model.compile(optimizer=keras.optimizers.SGD(0.01))
            return lambda: model.train_on_batch(data)

        return {"ours": step(True), "reference": step(False)}

    return build


_NAMES = {
    "dpo": "PreferenceModel DPO train step, 8 pairs of 128 tokens a side [2048×256 → 128256]",
    "grpo": "PolicyModel GRPO train step, 16 completions of 128 tokens [2048×256 → 128256]",
}
POST_TRAINING_CASES = [
    case
    for kind in ("dpo", "grpo")
    for case in (
        Case(
            _NAMES[kind],
            "the same step wired by hand from the ops (fused the same way), as the guides wired it",
            "time ≤ 1.05, memory ≤ 1.05",
            _steps(kind, "hand"),
            1.05,
            1.05,
        ),
        Case(
            _NAMES[kind] + " vs logits formed",
            "the step wired by hand with the logits formed (log-softmax, gather, as TRL writes it)",
            "memory ≤ 0.10",
            _steps(kind, "formed"),
            None,
            0.10,
        ),
    )
]
