"""The LLM-head benchmarks' inputs, shared by bench/cases.py and
bench/router_cases.py: a batch of tokens' hidden states and a vocabulary
kernel at [2048×256 → 128256]."""

import os

import numpy as np
from keras import ops

HEAD_SHAPE = (2048, 256, 128256)  # tokens, hidden size, vocabulary
# Rows per chunk: "auto" (the backend's budget: 65 rows of 128256 on JAX and
# torch, 130 on TF); HEAD_CHUNK=... overrides it, to explore.
HEAD_CHUNK = int(os.environ["HEAD_CHUNK"]) if os.environ.get("HEAD_CHUNK") else "auto"


def head_inputs(small):
    """mask (25 % of tokens masked), labels, a frozen teacher's hidden states
    and kernel, then the student's: the last two are differentiated."""
    tokens, hidden, vocab = (64, 16, 1000) if small else HEAD_SHAPE
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return ops.convert_to_tensor((scale * rng.standard_normal(size=shape, dtype=np.float32)))

    return [
        ops.convert_to_tensor((rng.uniform(size=tokens) >= 0.25).astype("float32")),
        ops.convert_to_tensor(rng.integers(0, vocab, size=tokens).astype("int32")),
        normal(tokens, hidden),
        normal(hidden, vocab, scale=hidden**-0.5),
        normal(tokens, hidden),
        normal(hidden, vocab, scale=hidden**-0.5),
    ]
