"""
# RL fine-tuning against a reference model

Fine-tuning a language model with a reward (PPO, GRPO, DAPO) needs three
numbers per sampled token: its log-probability under the policy being
trained, under the policy that sampled it, and under a frozen reference
model. From them come the policy-gradient loss and the KL to the reference
that keeps the policy near where it started. Here GRPO is a model you
`compile` and `fit`, `keras_penalties.post_training.PolicyModel`, fed by
`Rollouts`, on JAX, TensorFlow and PyTorch alike:

1. a GPT-2 built from config (nothing is downloaded);
2. a task with a programmatic reward; `Rollouts` samples a group of
   completions per prompt with keras-hub's own `generate`, scores them and
   normalises the rewards within each group (the advantages);
3. `PolicyModel(policy, "copy", ...)`: the reference copied, the clipped
   policy loss averaged per sequence, β·k3 KL to the reference and an
   entropy bonus, each token's log-probability and entropy read from the
   hidden states through the tied embedding a chunk of tokens at a time
   (no `[tokens, vocab]` logits, forward or backward); TRL's logs;
4. SAPO beside GRPO by changing `kind`;
5. off-policy: a sampler that is not the trainer (here, sampling at
   another temperature), its importance weights, and GSPO's sequence-level
   ratio;
6. the same ops on log-probabilities that arrive as arrays from a trainer
   elsewhere, DPPO's trust region among them.

The formulas, which library calls each estimator what, and the aggregation
modes are on the [RL fine-tuning](../docs/rl_fine_tuning.md) page; TRL's
equivalent of each line on [Post-training models](../docs/post_training.md).
keras-hub is an optional dependency (Python 3.11+): `pip install --no-deps
keras-hub regex tokenizers`.

    KERAS_BACKEND=jax python guides/rl_fine_tuning.py
"""

import os

import keras
import numpy as np

from keras_penalties import ops as P
from keras_penalties.post_training import PolicyModel, Rollouts

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
## 1. A policy built from config

`generate` needs a sampler; with no preprocessor it takes token ids and a
padding mask (the prompt) and fills the rest.
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

"""
## 2. The task: prompts and a reward

The reward is programmatic: the fraction of a completion's tokens below 8,
about ¼ for a policy that samples uniformly. A reward function takes the
sampled token ids and the completion mask (NumPy) and gives one number a
completion. `Rollouts` samples `GROUP` completions of each prompt and
divides each reward's distance from its group's mean by the group's
standard deviation: the advantage, one a sequence.
"""


def reward(token_ids, completion_mask):
    return ((token_ids < 8) * completion_mask).sum(1) / completion_mask.sum(1)


prompts = np.random.default_rng(2).integers(8, VOCAB, size=(PROMPTS * STEPS, PROMPT))

"""
## 3. GRPO as a model: compile and fit

`PolicyModel(policy, "copy", ...)` copies the policy as its frozen
reference. The loss is the PPO-clipped policy loss (DAPO's asymmetric clip
(0.2, 0.28)) averaged per sequence (GRPO's aggregation), plus β·k3, the
estimate of KL(π‖π_ref) over the completion's tokens, minus a small bonus
times the policy's entropy. An epoch of `Rollouts(..., batches_per_epoch=1)`
is one round: 32 completions sampled from the policy's weights at its
start, trained on twice (`num_iterations=2`; the sampling policy's
log-probabilities are scored at generation, so on the second step the
ratio moves and the clip applies). The logs are TRL's names: `reward` (a
completion's, the mean of the batch), `kl` and `entropy` (nats a completion
token, token means).
"""

if keras_hub is not None:
    model = PolicyModel(
        policy, "copy", clip=(0.2, 0.28), reduction="sequence_mean",
        kl_weight=BETA, entropy_weight=BONUS, chunk_size=CHUNK,
    )
    model.compile(optimizer=keras.optimizers.Adam(3e-3))
    rollouts = Rollouts(
        model, prompts, reward, num_generations=GROUP, batch_size=PROMPTS,
        batches_per_epoch=1, max_length=LENGTH, num_iterations=2, seed=2,
    )
    logs = model.fit(rollouts, epochs=STEPS, verbose=0).history
    for step in [*range(0, STEPS, 3), STEPS - 1]:
        print(
            f"step {step:2d}: reward (a completion's) {logs['reward'][step]:.3f}  policy {logs['policy_loss'][step]:+.4f}  "
            f"kl {logs['kl'][step]:.4f} nats a token  entropy {logs['entropy'][step]:.3f} nats a token"
        )
    print(f"mean reward: {logs['reward'][0]:.3f} at the first step -> {logs['reward'][-1]:.3f} at the last")

"""
The reward rises from about ¼ towards 1 while the KL to the reference
levels off near ln 4 ≈ 1.39 nats a token: the least any policy that samples
only the 8 rewarded tokens can have from a near-uniform start. The β·k3 term
holds it there, and the entropy bonus keeps the policy spread over the 8
(at 50 steps the entropy settles near 2.2 nats, above ln 8 ≈ 2.08).

## 4. SAPO beside GRPO

Another policy loss is one argument. SAPO replaces PPO's clip with a soft
gate (`kind="sapo"`, its temperatures TRL's defaults); the reference stays
the one copied at the start. A few SAPO rounds from where GRPO left off:
"""

if keras_hub is not None:
    sapo = PolicyModel(policy, model.reference, kind="sapo", kl_weight=BETA, chunk_size=CHUNK)
    sapo.compile(optimizer=keras.optimizers.Adam(3e-3))
    sapo_rollouts = Rollouts(
        sapo, prompts, reward, num_generations=GROUP, batch_size=PROMPTS,
        batches_per_epoch=1, max_length=LENGTH, num_iterations=2, seed=3,
    )
    logs = sapo.fit(sapo_rollouts, epochs=3, verbose=0).history
    print(f"sapo: reward (a completion's) {logs['reward'][-1]:.3f}, kl {logs['kl'][-1]:.4f} nats a token at the last round")

"""
## 5. Off-policy: a sampler that is not the trainer

In production the sampler is rarely the policy being trained: vLLM at
another precision, `generate` at another temperature, a remote worker one
update behind. Its log-probabilities q of the sampled tokens differ from
the policy's π_old, and the policy gradient is biased unless each token is
reweighted by π_old/q. Here the policy samples at temperature 1.5 (a
sampler keras-hub makes exactly: `RandomSampler(temperature=1.5)`, given
to `Rollouts` for its generation only), so q is `token_logprobs(...,
temperature=1.5)` of the same model, which the data carries as
`sampler_logprobs` (from vLLM, its returned log-probabilities).

`importance_sampling` takes `ops.importance_weights`' options: here a
sequence's weight is the geometric mean of its tokens' ratios
(`level="geometric"`), and with `mode="mask"` a sequence whose weight
leaves `bounds` is dropped from the policy loss's mask (verl's rejection
sampling). The policy loss is GSPO's (`level="sequence"`: one ratio a
sequence, the mean of its tokens' log-ratios, clipped at GSPO's narrow
(3e-4, 4e-4)). The logs carry the mean importance ratio and the fraction of
completion tokens GSPO's clip acts on (`clip_ratio/region_mean`). No KL
term here: the k3 estimate is unbiased only on the policy's own samples,
and on the hot sampler's tokens it reads several nats a token (with
`kl_weight=0.1` it drags the policy back to its reference and the reward
falls); DAPO and GSPO train without one.
"""

SAMPLER_TEMPERATURE, BOUNDS, GSPO_CLIP = 1.5, (0.5, 2.0), (3e-4, 4e-4)


def with_sampler_logprobs(batch):
    """The batch with the hot sampler's log-probabilities of its tokens, aligned with the ids."""
    hidden = policy.backbone({"token_ids": batch["token_ids"], "padding_mask": batch["padding_mask"]})
    logits = P.linear(hidden[:, :-1], policy.backbone.token_embedding)
    q = P.token_logprobs(batch["token_ids"][:, 1:], logits, temperature=SAMPLER_TEMPERATURE, chunk_size=CHUNK)
    return {**batch, "sampler_logprobs": np.pad(keras.ops.convert_to_numpy(q), [(0, 0), (1, 0)])}


if keras_hub is not None:
    off = PolicyModel(
        policy, level="sequence", clip=GSPO_CLIP, chunk_size=CHUNK,
        importance_sampling={"level": "geometric", "mode": "mask", "bounds": BOUNDS},
    )
    off.compile(optimizer=keras.optimizers.Adam(3e-3))
    hot = Rollouts(
        off, prompts, reward, num_generations=GROUP, batch_size=PROMPTS, max_length=LENGTH, seed=4,
        sampler=keras_hub.samplers.RandomSampler(temperature=SAMPLER_TEMPERATURE, seed=5),
    )
    rewards = []
    for step in range(STEPS // 2):
        batch = with_sampler_logprobs(hot[step])
        logs = off.fit(batch, batch_size=PROMPTS * GROUP, verbose=0).history
        rewards.append(batch["rewards"].mean())
        if step % 3 == 0 or step == STEPS // 2 - 1:
            print(
                f"off-policy step {step:2d}: reward (a completion's) {rewards[-1]:.3f}  "
                f"importance ratio {logs['sampling/importance_sampling_ratio/mean'][0]:.3f} (a sequence's)  "
                f"clipped {logs['clip_ratio/region_mean'][0]:.2f} (of tokens)"
            )
    print(f"off-policy mean reward: {rewards[0]:.3f} at the first step -> {rewards[-1]:.3f} at the last")

"""
At temperature 1.5 the sampler spreads its samples wider than the policy
would: its first rewards are below the on-policy run's last, a few
sequences are rejected by the bounds, and trained on the corrected gradient
the policy sharpens until even the hotter sampler's reward climbs. The
level matters: with `level="token"` and `mode="mask"` the tokens rejected
are exactly the exploratory ones (an unrewarded token the policy gives ½
of what the hot sampler does), the negative advantages they carried are
lost, and the reward stalls; truncating instead (`{"level": "token",
"mode": "truncate", "bounds": (None, 2.0)}`, TRL's and verl's default
shape) keeps them all, at weights capped at 2.

## 6. Log-probabilities arriving as arrays

When the sampling and the reference run elsewhere (an inference server, a
trainer on another cluster), the log-probabilities arrive as arrays. The
same ops compute the same numbers from them, on any backend: here the
GRPO loss of a batch as TRL's `grpo` loss type defines it, and as verl's
`seq-mean-token-mean` and DAPO's token mean; then DPPO's, which keeps a
token's gradient only while its probability stays within a trust region
around the sampler's (`ops.trust_region_mask`, here |p − p_old| ≤ 0.05 on
the side the advantage pushes) and trains those with CISPO's truncated
loss (truncated at C = 3, verl's default).
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
kept = P.trust_region_mask(logprobs, old_logprobs, advantages, threshold=0.05, mask=mask)
dppo = P.policy_loss(logprobs, old_logprobs, advantages, kind="cispo", clip=(0.0, 2.0), weights=keras.ops.cast(kept, "float32"), mask=mask)
print(f"dppo: {float(keras.ops.sum(kept)):.0f} of {mask.sum():.0f} tokens in the trust region, policy loss {float(dppo):+.5f}")
