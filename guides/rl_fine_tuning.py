"""
# RL fine-tuning against a reference model

Fine-tuning a language model with a reward (PPO, GRPO, DAPO) needs three
numbers per sampled token: its log-probability under the policy being
trained, under the policy that sampled it, and under a frozen reference
model. From them come the policy-gradient loss and the KL to the reference
that keeps the policy near where it started. This guide runs GRPO on a
keras-hub causal LM, on JAX, TensorFlow and PyTorch alike:

1. a GPT-2 built from config (nothing is downloaded) and a frozen copy of it
   as the reference;
2. a task with a programmatic reward, and a group of completions per prompt
   sampled with keras-hub's own `generate`; the advantages are the rewards
   normalised within each group;
3. a model whose loss is a `CompositeObjective` of `ops.policy_loss`,
   β·`ops.kl_estimate` (k3) and an entropy bonus, all from the hidden states
   through the tied embedding a chunk of tokens at a time (`ops.linear` with
   `chunk_size`: no `[tokens, vocab]` logits forward or backward), each
   term's value and gradient norm in the logs (`PenaltyMonitor`);
4. off-policy: a sampler that is not the trainer (here, sampling at
   another temperature), its truncated or rejected importance weights, and
   GSPO's sequence-level ratio, with the fraction of tokens kept and
   clipped in the logs;
5. the same ops on log-probabilities that arrive as arrays from a trainer
   elsewhere.

The formulas, which library calls each estimator what, and the aggregation
modes are on the [RL fine-tuning](../docs/rl_fine_tuning.md) page.

keras-hub is an optional dependency (Python 3.11+); `make test` installs it
without its requirements, which would pull a second TensorFlow:
`pip install --no-deps keras-hub regex tokenizers`.

    KERAS_BACKEND=jax python guides/rl_fine_tuning.py
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

STEPS = 10 * int(os.environ.get("GUIDE_ROUNDS", 3))
VOCAB, PROMPT, COMPLETION, HIDDEN = 32, 4, 8, 32
LENGTH = PROMPT + COMPLETION
PROMPTS, GROUP = 4, 8  # 4 prompts × 8 completions a step
BETA, BONUS, CHUNK = 0.1, 0.01, 16

"""
## 1. A policy and its reference, built from config

The reference is the starting policy, frozen: a second backbone with the same
weights. `generate` needs a sampler; with no preprocessor it takes token ids
and a padding mask (the prompt) and fills the rest.
"""


def gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=2 * HIDDEN, max_sequence_length=LENGTH,
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
## 2. The task, and a group of completions per prompt

The reward is programmatic: the fraction of a completion's tokens below 8,
about ¼ for a policy that samples uniformly. GRPO normalises each
completion's reward by the mean and spread of its prompt's group: the
advantage is per sequence, and `policy_loss` broadcasts it over the
completion's tokens.
"""


def reward(tokens):
    return (tokens[:, PROMPT:] < 8).mean(axis=1)


def sample(rng):
    prompts = np.repeat(rng.integers(8, VOCAB, size=(PROMPTS, PROMPT)), GROUP, axis=0)
    token_ids = np.zeros((PROMPTS * GROUP, LENGTH), "int32")
    token_ids[:, :PROMPT] = prompts
    padding = np.arange(LENGTH)[None, :].repeat(len(token_ids), 0) < PROMPT
    out = policy.generate({"token_ids": token_ids, "padding_mask": padding}, stop_token_ids=None)
    return np.asarray(out["token_ids"])


def group_advantages(rewards):
    groups = rewards.reshape(PROMPTS, GROUP)
    return ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)).reshape(-1)


"""
## 3. The loss: three terms from the hidden states

A layer turns the backbone's hidden states into each sampled token's
log-probability (`ops.token_logprobs` on `ops.linear(hidden, embeddings,
transpose_kernel=True)`, `CHUNK` tokens at a time). The objective's terms
read them by name: the PPO-clipped policy loss averaged per sequence
(GRPO's aggregation), the k3 estimate of KL(π‖π_ref) over the completion's
tokens, weighted by β, and −entropy of the policy at each completion
position, weighted by a small bonus. The prompt's positions are masked out
of all three. `old_logprobs` are the sampling policy's, computed once per
step before its two minibatches: on the second, the ratio moves and PPO's
clip applies.
"""


class TokenLogprobs(keras.layers.Layer):
    def __init__(self, embedding, temperature=1.0, **kwargs):
        super().__init__(**kwargs)
        self.embedding, self.temperature = embedding, temperature

    def call(self, hidden, labels, mask):
        logits = P.linear(hidden, self.embedding.embeddings, transpose_kernel=True)
        return P.token_logprobs(labels, logits, temperature=self.temperature, mask=mask, chunk_size=CHUNK)


def token_inputs():
    """The sampled sequences: tokens, padding, next-token labels, and the
    mask of the completion's labels."""
    shape = (LENGTH - 1,)
    return {
        "token_ids": keras.Input(shape, dtype="int32", name="token_ids"),
        "padding_mask": keras.Input(shape, dtype="int32", name="padding_mask"),
        "labels": keras.Input(shape, dtype="int32", name="labels"),
        "mask": keras.Input(shape, name="mask"),
    }


def rl_model(backbone, policy_term=None):
    inputs = {
        **token_inputs(),
        "advantages": keras.Input((), name="advantages"),
        "old_logprobs": keras.Input((LENGTH - 1,), name="old_logprobs"),
        "ref_logprobs": keras.Input((LENGTH - 1,), name="ref_logprobs"),
    }
    hidden = backbone({"token_ids": inputs["token_ids"], "padding_mask": inputs["padding_mask"]})
    logprobs = TokenLogprobs(backbone.token_embedding)(hidden, inputs["labels"], inputs["mask"])

    def entropy_bonus(hidden, mask):  # −H: minimising it raises the entropy
        logits = P.linear(hidden, backbone.token_embedding.embeddings, transpose_kernel=True)
        return -P.entropy(logits, from_logits=True, mask=mask, chunk_size=CHUNK)

    grpo = Term(
        "policy_loss",
        inputs=("logprobs", "old_logprobs", "advantages"),
        options={"mask": "mask", "clip": (0.2, 0.28), "reduction": "sequence_mean"},
    )
    objective = CompositeObjective(
        {
            "policy": policy_term or grpo,
            "kl": Term("kl_estimate", BETA, inputs=("logprobs", "ref_logprobs"), options={"mask": "mask"}),
            "entropy": Term(entropy_bonus, BONUS, inputs=("hidden", "mask")),
        },
        name="grpo",
    )
    terms = {name: inputs[name] for name in ("old_logprobs", "advantages", "ref_logprobs", "mask")}
    out = objective({"logprobs": logprobs, "hidden": hidden, **terms})["logprobs"]
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=None)
    return model


def scorer(backbone, temperature=1.0):
    """The sampled tokens' log-probabilities under `backbone` (at a
    sampler's `temperature`), compiled once (`predict_on_batch`)."""
    inputs = token_inputs()
    hidden = backbone({"token_ids": inputs["token_ids"], "padding_mask": inputs["padding_mask"]})
    logprobs = TokenLogprobs(backbone.token_embedding, temperature)(hidden, inputs["labels"], inputs["mask"])
    return keras.Model(inputs, logprobs)


"""
## The loop: sample, score, train

Each step samples 32 completions, scores them, computes the reference's and
the sampling policy's log-probabilities of the sampled tokens, and trains on
them in two minibatches. `PenaltyMonitor` logs each term and its gradient
norm.
"""

def batch(tokens):
    rewards = reward(tokens)
    data = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((len(tokens), LENGTH - 1), "int32"),
        "labels": tokens[:, 1:],
        # Labels from position PROMPT − 1 on are the sampled tokens.
        "mask": (np.arange(LENGTH - 1)[None, :] >= PROMPT - 1).repeat(len(tokens), 0).astype("float32"),
        "advantages": group_advantages(rewards).astype("float32"),
    }
    scored = {k: data[k] for k in ("token_ids", "padding_mask", "labels", "mask")}
    data["ref_logprobs"] = np.asarray(reference_scorer.predict_on_batch(scored))
    data["old_logprobs"] = np.asarray(policy_scorer.predict_on_batch(scored))
    return rewards, data


if keras_hub is not None:
    model = rl_model(policy.backbone)
    policy_scorer, reference_scorer = scorer(policy.backbone), scorer(reference)
    rng = np.random.default_rng(2)
    # A fixed probe batch: each term's gradient norm on the same completions.
    monitor = PenaltyMonitor(probe_data={k: v[::4] for k, v in batch(sample(rng))[1].items()}, every_n_batches=2)
    for step in range(STEPS):
        rewards, data = batch(sample(rng))
        logs = model.fit(data, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[monitor]).history
        if step == 0:
            start = rewards.mean()
        if step % 3 == 0 or step == STEPS - 1:
            print(
                f"step {step:2d}: reward {rewards.mean():.3f}  policy {logs['grpo/policy'][0]:+.4f}  "
                f"kl {logs['grpo/kl'][0]:.4f} (grad norm {logs['grpo/kl/grad_norm'][0]:.3f})  "
                f"entropy {-logs['grpo/entropy'][0]:.3f}"
            )
    print(f"mean reward: {start:.3f} at the first step -> {rewards.mean():.3f} at the last")

"""
The reward rises from about ¼ towards 1 while the KL to the reference
levels off near ln 4 ≈ 1.39 nats a token: the least any policy that samples
only the 8 rewarded tokens can have from a near-uniform start. The β·k3 term
holds it there, and the entropy bonus keeps the policy spread over the 8
(at 50 steps the entropy settles near 2.2 nats, above ln 8 ≈ 2.08).

## DPPO and SAPO beside GRPO

Another policy loss is one term. DPPO keeps a token's gradient only while
its probability stays within a trust region around the sampler's
(`ops.trust_region_mask`, here |p − p_old| ≤ 0.15 on the side the advantage
pushes) and trains those with CISPO's truncated loss (truncated at C = 3,
verl's default); SAPO replaces PPO's clip with a soft gate
(`policy_loss(kind="sapo")`). A few DPPO steps from where GRPO left off:
"""


def dppo(logprobs, old_logprobs, advantages, mask):
    kept = P.trust_region_mask(logprobs, old_logprobs, advantages, threshold=0.15, mask=mask)
    weights = keras.ops.cast(kept, "float32")
    return P.policy_loss(logprobs, old_logprobs, advantages, kind="cispo", clip=(0.0, 2.0), weights=weights, mask=mask)


if keras_hub is not None:
    dppo_model = rl_model(policy.backbone, Term(dppo, inputs=("logprobs", "old_logprobs", "advantages", "mask")))
    for step in range(3):
        rewards, data = batch(sample(rng))
        logs = dppo_model.fit(data, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()])
    print(f"dppo: reward {rewards.mean():.3f}, policy {logs.history['grpo/policy'][0]:+.4f} at the last step")
    # SAPO: rl_model(policy.backbone, Term("policy_loss", inputs=("logprobs", "old_logprobs",
    # "advantages"), options={"kind": "sapo", "mask": "mask"})).

"""
## 4. Off-policy: a sampler that is not the trainer

In production the sampler is rarely the policy being trained: vLLM at
another precision, `generate` at another temperature, a remote worker one
update behind. Its log-probabilities q of the sampled tokens differ from
the policy's π_old, and the policy gradient is biased unless each token is
reweighted by π_old/q. Here the policy samples at temperature 1.5 (a
sampler keras-hub makes exactly: `RandomSampler(temperature=1.5)`), so q is
`token_logprobs(..., temperature=1.5)` of the same backbone.

`ops.importance_weights` gives the weights and the tokens they keep. Here
a sequence's weight is the geometric mean of its tokens' ratios
(`level="geometric"`), and with `mode="mask"` a sequence whose weight
leaves `bounds` is dropped from `kept`; passing `kept` as the loss's mask
takes its tokens out of the token-mean denominator too (verl's rejection
sampling; TRL's `*_mask` modes keep them there). The policy loss is GSPO's (`level="sequence"`: one ratio a
sequence, the mean of its tokens' log-ratios, clipped at GSPO's narrow
(3e-4, 4e-4)), weighted by the importance weights; the KL term is
`kl_estimate(..., old_logprobs=...)` with the sampler's log-probabilities,
unbiased for KL(π‖π_ref) although the tokens came from q. The logs carry
the fraction of tokens kept and the fraction of tokens GSPO's clip acts on
(`ops.clip_fraction`, TRL's `clip_ratio`).
"""

SAMPLER_TEMPERATURE, BOUNDS, GSPO_CLIP = 1.5, (0.5, 2.0), (3e-4, 4e-4)


def off_policy_model(backbone):
    inputs = {
        **token_inputs(),
        "advantages": keras.Input((), name="advantages"),
        "old_logprobs": keras.Input((LENGTH - 1,), name="old_logprobs"),
        "sampler_logprobs": keras.Input((LENGTH - 1,), name="sampler_logprobs"),
        "ref_logprobs": keras.Input((LENGTH - 1,), name="ref_logprobs"),
        "weights": keras.Input((LENGTH - 1,), name="weights"),
        "kept": keras.Input((LENGTH - 1,), name="kept"),
    }
    hidden = backbone({"token_ids": inputs["token_ids"], "padding_mask": inputs["padding_mask"]})
    logprobs = TokenLogprobs(backbone.token_embedding)(hidden, inputs["labels"], inputs["mask"])
    objective = CompositeObjective(
        {
            "gspo": Term(
                "policy_loss",
                inputs=("logprobs", "old_logprobs", "advantages"),
                options={"level": "sequence", "clip": GSPO_CLIP, "weights": "weights", "mask": "kept"},
            ),
            "kl": Term(
                "kl_estimate",
                BETA,
                inputs=("logprobs", "ref_logprobs"),
                options={"mask": "kept", "old_logprobs": "sampler_logprobs"},
            ),
        },
        name="off_policy",
    )
    names = ("old_logprobs", "sampler_logprobs", "ref_logprobs", "advantages", "weights", "kept")
    out = objective({"logprobs": logprobs, **{name: inputs[name] for name in names}})["logprobs"]
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=None)
    return model


def off_policy_batch(tokens):
    rewards, data = batch(tokens)
    scored = {k: data[k] for k in ("token_ids", "padding_mask", "labels", "mask")}
    data["sampler_logprobs"] = np.asarray(sampler_scorer.predict_on_batch(scored))
    weights, kept = P.importance_weights(
        data["old_logprobs"],
        data["sampler_logprobs"],
        level="geometric",
        mode="mask",
        bounds=BOUNDS,
        mask=data["mask"],
    )
    data["weights"] = keras.ops.convert_to_numpy(weights)
    data["kept"] = keras.ops.convert_to_numpy(kept).astype("float32")
    return rewards, data


if keras_hub is not None:
    sampler_scorer = scorer(policy.backbone, temperature=SAMPLER_TEMPERATURE)
    policy.compile(sampler=keras_hub.samplers.RandomSampler(seed=3, temperature=SAMPLER_TEMPERATURE))
    off_model = off_policy_model(policy.backbone)
    for step in range(STEPS // 2):
        rewards, data = off_policy_batch(sample(rng))
        logs = off_model.fit(data, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()])
        scored = {k: data[k] for k in ("token_ids", "padding_mask", "labels", "mask")}
        clipped = P.clip_fraction(
            policy_scorer.predict_on_batch(scored),
            data["old_logprobs"],
            data["advantages"],
            clip=GSPO_CLIP,
            level="sequence",
            mask=data["kept"],
        )
        if step == 0:
            off_start = rewards.mean()
        if step % 3 == 0 or step == STEPS // 2 - 1:
            kept = data["kept"].sum() / data["mask"].sum()
            print(
                f"off-policy step {step:2d}: reward {rewards.mean():.3f}  kept {kept:.2f}  "
                f"clipped {float(clipped['region']):.2f}  gspo {logs.history['off_policy/gspo'][0]:+.4f}  "
                f"kl {logs.history['off_policy/kl'][0]:.4f}"
            )
    print(f"off-policy mean reward: {off_start:.3f} at the first step -> {rewards.mean():.3f} at the last")
    # Truncated weights instead (TRL's `token_truncate`, verl's TIS): every token kept, its weight
    # π_old/q capped at 2; pass them as `weights` and the loss mask as it is.
    truncated, _ = P.importance_weights(
        data["old_logprobs"],
        data["sampler_logprobs"],
        level="token",
        mode="truncate",
        bounds=(None, 2.0),
        mask=data["mask"],
    )
    truncated = keras.ops.convert_to_numpy(truncated)[data["mask"] > 0]
    print(
        f"truncated token weights on the last batch: mean {truncated.mean():.3f}, "
        f"at the cap {np.mean(truncated >= 2.0):.2f}, below 1 {np.mean(truncated < 1.0):.2f}"
    )

"""
At temperature 1.5 the sampler spreads its samples wider than the policy
would: its first rewards are below the on-policy run's last, a few
sequences are rejected by the bounds, and trained on the corrected gradient
the policy sharpens until even the hotter sampler's reward climbs (about
0.87 → 0.95 over 15 steps). The level matters: with `level="token"` and
`mode="mask"` the tokens rejected are exactly the exploratory ones (an
unrewarded token the policy gives ½ of what the hot sampler does), the
negative advantages they carried are lost, and here the reward stalls
near 0.8; truncating instead (`mode="truncate"`, TRL's and verl's default
shape) keeps them all, at bounded weights: the last line above gives those
weights for the last batch (each token's π_old/q capped at 2; passed as
`weights=` with the loss mask as it is, they replace the mask-mode pair).
"""

"""
## 5. Log-probabilities arriving as arrays

When the sampling and the reference run elsewhere (an inference server, a
trainer on another cluster), the log-probabilities arrive as arrays. The
same ops compute the same numbers from them, on any backend: here the
GRPO loss of a batch as TRL's `grpo` loss type defines it, and as verl's
`seq-mean-token-mean` and DAPO's token mean.
"""

arrays = np.random.default_rng(3)
logprobs = -arrays.uniform(0.1, 3.0, size=(4, 6)).astype("float32")
old_logprobs = logprobs + arrays.normal(scale=0.1, size=(4, 6)).astype("float32")
ref_logprobs = logprobs + arrays.normal(scale=0.5, size=(4, 6)).astype("float32")
advantages = np.array([1.0, -1.0, 0.5, -0.5], "float32")
mask = np.ones((4, 6), "float32")
mask[1, 3:] = 0.0
for reduction in ("sequence_mean", "mean"):
    policy_term = P.policy_loss(logprobs, old_logprobs, advantages, clip=(0.2, 0.28), mask=mask, reduction=reduction)
    kl_term = P.kl_estimate(logprobs, ref_logprobs, estimator="k3", mask=mask, reduction=reduction)
    print(f"{reduction}: policy loss {float(policy_term):+.5f}, k3 {float(kl_term):.5f}")
