"""
# On-policy distillation

Distillation on a fixed corpus trains the student on text it would not
write; on-policy distillation trains it on its own samples. The student
samples completions, the teacher scores every position of them, and the
loss is the reverse KL, KL(student ‖ teacher), at each sampled position:
mode-seeking, it pulls the student towards what the teacher would say where
the student actually goes (Agarwal et al., 2024; Thinking Machines' Tinker,
2025). This guide runs it on JAX, TensorFlow and PyTorch alike:

1. a keras-hub student and a larger teacher, both built from config
   (nothing is downloaded);
2. the student samples with keras-hub's own `generate`;
3. `keras_penalties.distillation.Distiller` with a reverse-KL
   `LogitsDivergence`: the exact KL over the whole vocabulary, from both
   models' hidden states through both tied embeddings, a chunk of tokens at
   a time (neither model's `[tokens, vocab]` logits are formed, forward or
   backward); the per-token KL falls;
4. the cheaper forms: a teacher's top-k ids with the tail bin
   (`ops.topk_kl`), and Tinker's per-token advantages from the sampled
   tokens' log-ratio (`ops.discounted_cumsum`) trained by a `PolicyModel`.

keras-hub is an optional dependency (Python 3.11+):
`pip install --no-deps keras-hub regex tokenizers`.

    KERAS_BACKEND=jax python guides/on_policy_distillation.py
"""

import os

import keras
import numpy as np

from keras_penalties import ops as P
from keras_penalties.distillation import Distiller, LogitsDivergence
from keras_penalties.post_training import PolicyModel

try:
    import keras_hub
except ImportError:  # Python 3.10, or keras-hub not installed
    keras_hub = None
    print("This guide needs keras-hub: pip install --no-deps keras-hub regex tokenizers (Python 3.11+).")

STEPS = 8 * int(os.environ.get("GUIDE_ROUNDS", 3))
VOCAB, PROMPT, COMPLETION = 48, 4, 8
LENGTH = PROMPT + COMPLETION
BATCH, CHUNK = 32, 16

"""
## 1. A student and a larger teacher

Both are GPT-2 shapes from config: the teacher has two layers of width 64,
the student one of width 32. The teacher's embeddings are scaled up so its
distributions are sharp, far from the student's near-uniform start: there
is a KL to close.
"""


def gpt2(layers, width, seed):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=width,
        intermediate_dim=2 * width, max_sequence_length=LENGTH,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


if keras_hub is not None:
    teacher = gpt2(2, 64, seed=1)
    embeddings = teacher.backbone.token_embedding.embeddings
    embeddings.assign(embeddings * 15.0)
    teacher.trainable = False
    student = gpt2(1, 32, seed=2)
    student.compile(sampler=keras_hub.samplers.RandomSampler(seed=3))

"""
## 2. The loss: the exact reverse KL from both models' hidden states

At each position of a completion, KL(π_student ‖ π_teacher) over the whole
vocabulary: a `Distiller` with `LogitsDivergence(direction="reverse")`,
`head=` and `teacher_head=` naming each model's tied embedding, so the KL
is computed from the hidden states `CHUNK` positions at a time. The
`sample_weight` masks the prompt's positions out; no student loss
(`student_loss_weight=0`). The KL is logged per kept token as
`distillation/reverse_kl`.
"""

if keras_hub is not None:
    distiller = Distiller(
        teacher, student, LogitsDivergence(direction="reverse", name="reverse_kl"), student_loss_weight=0.0,
        head="token_embedding", teacher_head="token_embedding", chunk_size=CHUNK,
    )
    distiller.compile(optimizer=keras.optimizers.Adam(5e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

"""
## 3. The loop: the student samples, the teacher scores, the student learns

Each step the student completes 32 prompts with `generate`; the mask keeps
the completion's positions (the distributions that predict completion
tokens from position `PROMPT − 1` on).
"""


def sample(rng):
    token_ids = np.zeros((BATCH, LENGTH), "int32")
    token_ids[:, :PROMPT] = rng.integers(1, VOCAB, size=(BATCH, PROMPT))
    padding = np.arange(LENGTH)[None, :].repeat(BATCH, 0) < PROMPT
    out = student.generate({"token_ids": token_ids, "padding_mask": padding}, stop_token_ids=None)
    positions = np.arange(LENGTH)[None, :].repeat(BATCH, 0)
    return {
        "token_ids": np.asarray(out["token_ids"]),
        "padding_mask": np.ones((BATCH, LENGTH), "int32"),
        "mask": ((positions >= PROMPT - 1) & (positions < LENGTH - 1)).astype("float32"),
    }


if keras_hub is not None:
    rng = np.random.default_rng(4)
    for step in range(STEPS):
        data = sample(rng)
        x, y = {k: data[k] for k in ("token_ids", "padding_mask")}, np.roll(data["token_ids"], -1, axis=1)
        logs = distiller.fit(x, y, sample_weight=data["mask"], batch_size=16, verbose=0).history
        kl = logs["distillation/reverse_kl"][0]
        if step == 0:
            start = kl
        if step % 4 == 0 or step == STEPS - 1:
            print(f"step {step:2d}: reverse KL {kl:.4f} nats a token")
    print(f"reverse KL: {start:.4f} at the first step -> {kl:.4f} at the last")

"""
The student's own samples move with it: each step's KL is measured where
the student now goes, and falls as it learns to go where the teacher would.
"""

"""
## 4. Cheaper forms: a teacher's top-k, and per-token advantages

A remote teacher often returns only its top-k log-probabilities a position.
`ops.token_logprobs` with [..., K] labels gives the student's
log-probabilities of the same ids (fused from hidden states as above), and
`ops.topk_kl` the forward KL over them with one more bin for the rest of
the vocabulary (TRL's `loss_top_k` with `loss_add_tail`).

Tinker's on-policy distillation instead scores only the sampled token:
its per-token reverse KL estimate log π_student − log π_teacher, negated,
is a reward, and `ops.discounted_cumsum` turns it into per-token returns
(γ = 0 keeps each token's own): per-token advantages for a `PolicyModel`
(its `score` gives a model's log-probabilities of the tokens, aligned with
the ids; the teacher's come from a `PolicyModel` of the teacher, used only
to score).
"""

if keras_hub is not None:
    data = sample(np.random.default_rng(5))
    tokens = {"token_ids": data["token_ids"], "padding_mask": data["padding_mask"]}
    teacher_hidden = teacher.backbone(tokens)
    teacher_logits = P.linear(teacher_hidden, teacher.backbone.token_embedding)
    student_logits = P.linear(student.backbone(tokens), student.backbone.token_embedding)
    # The teacher's top 4 ids at each position, as a server would send them.
    formed = keras.ops.convert_to_numpy(keras.ops.matmul(teacher_hidden, keras.ops.transpose(embeddings)))
    top = np.argsort(-formed, axis=-1)[..., :4]
    teacher_top = P.token_logprobs(top, teacher_logits, chunk_size=CHUNK)
    student_top = P.token_logprobs(top, student_logits, chunk_size=CHUNK)
    topk = P.topk_kl(teacher_top, student_top, mask=data["mask"])
    exact = P.kl_divergence(teacher_logits, student_logits, from_logits=True, mask=data["mask"], chunk_size=CHUNK)
    topk, exact = (float(keras.ops.convert_to_numpy(v)) for v in (topk, exact))
    print(f"forward KL (nats a token): top-4 with the tail {topk:.4f}, exact {exact:.4f}")

    # Tinker: the sampled tokens' log-ratio as per-token advantages, one policy-gradient step a batch;
    # the exact reverse KL of `data` (held out) before and after.
    def reverse_kl():
        student_logits = P.linear(student.backbone(tokens), student.backbone.token_embedding)
        kl = P.kl_divergence(teacher_logits, student_logits, from_logits=True, direction="reverse", mask=data["mask"])
        return float(keras.ops.convert_to_numpy(kl))

    before = reverse_kl()
    tinker, teacher_scorer = PolicyModel(student, kind="importance_sampling", chunk_size=CHUNK), PolicyModel(teacher)
    tinker.compile(optimizer=keras.optimizers.Adam(1e-3))
    for step in range(STEPS // 2):
        batch = sample(rng)
        batch["completion_mask"] = np.roll(batch["mask"], 1, axis=1)  # aligned with the ids: the sampled tokens
        log_ratio = tinker.score(batch) - teacher_scorer.score(batch)
        batch["advantages"] = keras.ops.convert_to_numpy(P.discounted_cumsum(-log_ratio, 0.0, mask=batch["completion_mask"]))
        tinker.fit(batch, batch_size=BATCH, verbose=0)
    print(f"tinker: reverse KL (nats a token, held out) {before:.4f} before {STEPS // 2} steps -> {reverse_kl():.4f} after")
