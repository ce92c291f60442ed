"""
# Distilling a language model without its logits

At LLM scale the `[tokens, vocab]` logits are the memory: every training
step of token-level distillation holds the student's logits, their gradient
and the teacher's logits, three such arrays (16 k tokens × a 256 k
vocabulary in float32 is 16.8 GB each). This guide distils a keras-hub
causal LM into a smaller one without forming any of them:

1. a GPT-2 teacher and student built from config (nothing is downloaded);
2. `keras_penalties.distillation.Distiller` with `head=` and `teacher_head=`:
   the losses are computed from the hidden states that feed the tied
   embeddings, a chunk of tokens at a time, with the padding mask as
   `sample_weight`; the same numbers as the unfused Distiller;
3. a causal LM that owns its head: a `compute_loss` that calls
   `ops.cross_entropy` on `ops.linear(hidden, embeddings)`.

keras-hub is an optional dependency (Python 3.11+); `make test` installs it
without its requirements, which would pull a second TensorFlow:
`pip install --no-deps keras-hub regex tokenizers`.

    KERAS_BACKEND=torch python guides/distilling_a_language_model.py
"""

import os

import keras
import numpy as np

from keras_penalties import ops as P
from keras_penalties.distillation import Distiller, LogitsDivergence

try:
    import keras_hub
except ImportError:  # Python 3.10, or keras-hub not installed
    keras_hub = None
    print("This guide needs keras-hub: pip install --no-deps keras-hub regex tokenizers (Python 3.11+).")

EPOCHS = int(os.environ.get("GUIDE_ROUNDS", 3))
VOCAB, LENGTH, CHUNK = 2048, 32, 64

"""
## Data: padded token sequences

Next-token prediction: the inputs are tokens 0..L−1, the labels tokens 1..L.
Sequences are right-padded, as keras-hub's preprocessors make them; a label
counts where it is not padding, which is exactly the `sample_weight`.
"""

rng = np.random.default_rng(0)
tokens = rng.integers(1, VOCAB, size=(64, LENGTH + 1))
lengths = rng.integers(LENGTH // 4, LENGTH + 2, size=64)
padding = (np.arange(LENGTH + 1)[None, :] < lengths[:, None]).astype("int32")
tokens = tokens * padding
x = {"token_ids": tokens[:, :-1], "padding_mask": padding[:, :-1]}
y = tokens[:, 1:]
sample_weight = padding[:, 1:].astype("float32")

"""
## 1. A teacher and a student, built from config
"""


def gpt2(num_layers, hidden_dim, seed):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_heads=2, hidden_dim=hidden_dim,
        intermediate_dim=2 * hidden_dim, max_sequence_length=LENGTH,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


if keras_hub is not None:
    teacher = gpt2(num_layers=2, hidden_dim=64, seed=1)
    teacher.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    teacher.fit(x, y, sample_weight=sample_weight, epochs=EPOCHS, shuffle=False, verbose=0)  # keras-hub makes a tf.data pipeline of it

"""
## 2. The Distiller, fused

`head="token_embedding"` names the student's vocabulary projection: GPT-2's
tied embedding, read backwards (`[V, H]`, used transposed in place). The
training step returns the hidden states that feed it, and each loss —
T²·KL to the teacher at temperature 2, and the student's own sparse
cross-entropy — reads `ops.linear(hidden, embeddings)` `CHUNK` tokens at a
time: the logits of a chunk exist only while it is computed, forward and
backward. `teacher_head` does the same for the teacher. Each distillation
loss is logged as `distillation/<name>`; the padding mask reaches every
loss.
"""

if keras_hub is not None:
    student = gpt2(num_layers=1, hidden_dim=32, seed=2)
    distiller = Distiller(
        teacher, student, LogitsDivergence(temperature=2.0, name="kd"), student_loss_weight=0.5,
        head="token_embedding", teacher_head="token_embedding", chunk_size=CHUNK,
    )
    distiller.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = distiller.fit(x, y, sample_weight=sample_weight, batch_size=16, epochs=EPOCHS, verbose=0)
    print(f"T²·KL per kept token: {history.history['distillation/kd'][0]:.4f} -> {history.history['distillation/kd'][-1]:.4f}")
    print(f"student cross-entropy: {history.history['student_loss'][0]:.4f} -> {history.history['student_loss'][-1]:.4f}")

    # evaluate forms the logits as usual: the same numbers, and compiled metrics.
    print("evaluate:", {k: round(v, 4) for k, v in distiller.evaluate(x, y, sample_weight=sample_weight, verbose=0, return_dict=True).items()})

    tokens_per_step = 16 * LENGTH
    formed = 3 * tokens_per_step * VOCAB * 4
    print(f"per step, not formed: 3 arrays of [{tokens_per_step}, {VOCAB}] float32 = {formed / 2**20:.1f} MB "
          f"(the logits a chunk forms: [{CHUNK}, {VOCAB}], {CHUNK * VOCAB * 4 / 2**20:.2f} MB each)")
    print(f"at 16384 tokens × a 256000 vocabulary: {3 * 16384 * 256000 * 4 / 1e9:.1f} GB not formed; "
          "measured peaks are on the Performance page (docs/performance.md)")

"""
## 3. A causal LM that owns its head

Without a teacher, the same fused loss trains a language model directly: the
model outputs its backbone's hidden states, and `compute_loss` computes the
cross-entropy from them through the tied embedding. `mask=sample_weight`
averages over the kept tokens (Liger-Kernel's `ignore_index` convention;
keras-hub's own `GPT2CausalLM` with
`SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")`
computes the same number).
"""


class FusedCausalLM(keras.Model):
    def __init__(self, backbone, chunk_size, **kwargs):
        inputs = backbone.input
        super().__init__(inputs, backbone(inputs), **kwargs)
        self.backbone = backbone
        self.chunk_size = chunk_size

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        logits = P.linear(y_pred, self.backbone.token_embedding.embeddings, transpose_kernel=True)
        return P.cross_entropy(y, logits, mask=sample_weight, chunk_size=self.chunk_size) + sum(self.losses)


if keras_hub is not None:
    lm = FusedCausalLM(gpt2(num_layers=1, hidden_dim=32, seed=3).backbone, chunk_size=CHUNK)
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    losses = lm.fit(x, y, sample_weight=sample_weight, batch_size=16, epochs=EPOCHS, verbose=0).history["loss"]
    print(f"fused causal LM cross-entropy per kept token: {losses[0]:.4f} -> {losses[-1]:.4f}")
