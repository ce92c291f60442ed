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
3. the loss is the exact reverse KL over the whole vocabulary, from both
   models' hidden states through both tied embeddings, a chunk of tokens at
   a time (`ops.linear` on each side: neither model's `[tokens, vocab]`
   logits are formed, forward or backward), and the per-token KL falls;
4. the cheaper forms: a teacher's top-k ids with the tail bin
   (`ops.topk_kl`), and Tinker's per-token advantages from the sampled
   tokens' log-ratio (`ops.discounted_cumsum`).

keras-hub is an optional dependency (Python 3.11+):
`pip install --no-deps keras-hub regex tokenizers`.

    KERAS_BACKEND=jax python guides/on_policy_distillation.py
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
    teacher = gpt2(2, 64, seed=1).backbone
    embeddings = teacher.token_embedding.embeddings
    embeddings.assign(embeddings * 15.0)
    teacher.trainable = False
    student = gpt2(1, 32, seed=2)
    student.compile(sampler=keras_hub.samplers.RandomSampler(seed=3))

"""
## 2. The loss: the exact reverse KL from both models' hidden states

At each position of a completion, KL(π_student ‖ π_teacher) over the whole
vocabulary: `ops.kl_divergence(teacher, student, direction="reverse")` on
`ops.linear` of each model's hidden states and its tied embedding
(`transpose_kernel=True`), `CHUNK` positions at a time. The prompt's
positions are masked out. The term sits in a `CompositeObjective`, so its
value (and, with a probe, its gradient norm) reaches the logs.
"""


def distillation_model():
    inputs = {
        "token_ids": keras.Input((LENGTH,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((LENGTH,), dtype="int32", name="padding_mask"),
        "mask": keras.Input((LENGTH,), name="mask"),
    }
    tokens = {"token_ids": inputs["token_ids"], "padding_mask": inputs["padding_mask"]}
    student_hidden, teacher_hidden = student.backbone(tokens), teacher(tokens)

    def reverse_kl(student_hidden, teacher_hidden, mask):
        logits = P.linear(student_hidden, student.backbone.token_embedding.embeddings, transpose_kernel=True)
        reference = P.linear(teacher_hidden, teacher.token_embedding.embeddings, transpose_kernel=True)
        return P.kl_divergence(
            reference, logits, from_logits=True, direction="reverse", mask=mask, chunk_size=CHUNK
        )

    objective = CompositeObjective(
        {"reverse_kl": Term(reverse_kl, inputs=("student", "teacher", "mask"))}, name="distill"
    )
    out = objective({"student": student_hidden, "teacher": teacher_hidden, "mask": inputs["mask"]})["student"]
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.Adam(5e-3), loss=None)
    return model


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
    model = distillation_model()
    rng = np.random.default_rng(4)
    for step in range(STEPS):
        data = sample(rng)
        logs = model.fit(data, batch_size=16, epochs=1, verbose=0, callbacks=[PenaltyMonitor()]).history
        kl = logs["distill/reverse_kl"][0]
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
(γ = 0 keeps each token's own) for a policy-gradient loss.
"""

if keras_hub is not None:
    data = sample(np.random.default_rng(5))
    tokens = {"token_ids": data["token_ids"], "padding_mask": data["padding_mask"]}
    student_hidden, teacher_hidden = student.backbone(tokens), teacher(tokens)
    teacher_logits = P.linear(teacher_hidden, teacher.token_embedding.embeddings, transpose_kernel=True)
    student_logits = P.linear(student_hidden, student.backbone.token_embedding.embeddings, transpose_kernel=True)
    # The teacher's top 4 ids at each position, as a server would send them.
    formed = keras.ops.convert_to_numpy(keras.ops.matmul(teacher_hidden, keras.ops.transpose(embeddings)))
    top = np.argsort(-formed, axis=-1)[..., :4]
    teacher_top = P.token_logprobs(top, teacher_logits, chunk_size=CHUNK)
    student_top = P.token_logprobs(top, student_logits, chunk_size=CHUNK)
    topk = P.topk_kl(teacher_top, student_top, mask=data["mask"])
    exact = P.kl_divergence(teacher_logits, student_logits, from_logits=True, mask=data["mask"], chunk_size=CHUNK)
    topk, exact = (float(keras.ops.convert_to_numpy(v)) for v in (topk, exact))
    print(f"forward KL: top-4 with the tail {topk:.4f}, exact {exact:.4f}")

    # Tinker's advantages from the sampled tokens' log-ratio (the next token at each position).
    labels = np.roll(data["token_ids"], -1, axis=1)
    log_ratio = P.token_logprobs(labels, student_logits, chunk_size=CHUNK) - P.token_logprobs(
        labels, teacher_logits, chunk_size=CHUNK
    )
    advantages = P.discounted_cumsum(-log_ratio, 0.0, mask=data["mask"])
    mean = float(keras.ops.convert_to_numpy(keras.ops.mean(advantages)))
    print(f"mean per-token advantage (negated reverse KL estimate): {mean:+.4f}")
