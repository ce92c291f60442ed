"""RL fine-tuning cases: each sampled token's log-probability from
hidden states at 2048 tokens, H = 256, V = 128256, against the logits formed
first (our chunked call on them) and against the obvious peer (a
log-softmax of the formed logits, then a gather, as TRL's
`selective_log_softmax` writes it); post-training rows: with the entropy from
the same chunks against without it, a frozen head against the formed
logits with the same frozen head, a soft-capped head against the same
uncapped, with log Σp² (WPO's input) against without it; and a GRPO
loss step (PPO-clipped policy loss + β·k3 to reference log-probabilities)
and a SAPO loss step fused against the same written the obvious way.
Value + gradients w.r.t. the hidden states and the kernel, float32."""

import os

import numpy as np
from keras import ops

from bench import native
from bench.case import Case, gradient_sides
from keras_penalties import ops as P

SHAPE = (2048, 256, 128256)  # tokens, hidden size, vocabulary
# Rows per chunk: the backend's "auto" budget, as the head rows (HEAD_CHUNK).
CHUNK = int(os.environ["HEAD_CHUNK"]) if os.environ.get("HEAD_CHUNK") else "auto"
BETA, CLIP = 0.04, (0.2, 0.28)


def _inputs(small):
    """weights (a per-token advantage, 0 on the 25 % of tokens masked), the
    sampled tokens, the sampling policy's and the reference's
    log-probabilities, then the differentiated hidden states and kernel."""
    tokens, hidden, vocab = (64, 16, 1000) if small else SHAPE
    rng = np.random.default_rng(0)
    kept = rng.uniform(size=tokens) >= 0.25

    def tensor(x, dtype="float32"):
        return ops.convert_to_tensor(np.asarray(x, dtype))

    return [
        tensor(kept * rng.standard_normal(tokens)),
        tensor(rng.integers(0, vocab, size=tokens), "int32"),
        tensor(-rng.uniform(8.0, 14.0, size=tokens)),
        tensor(-rng.uniform(8.0, 14.0, size=tokens)),
        tensor(rng.standard_normal((tokens, hidden))),
        tensor(hidden**-0.5 * rng.standard_normal((hidden, vocab))),
    ]


def _selective_log_softmax(labels, logits):
    """log softmax(logits)[label]: the backend's log-softmax over the formed
    logits, then a gather (TRL's `selective_log_softmax`)."""
    if native.BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        return jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]
    if native.BACKEND == "torch":
        import torch

        return torch.log_softmax(logits, -1).gather(-1, labels.long()[:, None]).squeeze(-1)
    import tensorflow as tf

    return tf.gather(tf.nn.log_softmax(logits), labels, batch_dims=1)


def _weighted(values, weights):
    return ops.sum(values * weights)


_LOGPROBS = {
    # fused: from hidden states; ours on the logits formed first; the peer on them
    "fused": lambda w, y, old, ref, h, k: _weighted(P.token_logprobs(y, P.linear(h, k), chunk_size=CHUNK), w),
    "formed": lambda w, y, old, ref, h, k: _weighted(P.token_logprobs(y, native.matmul(h, k), chunk_size=CHUNK), w),
    "peer": lambda w, y, old, ref, h, k: _weighted(_selective_log_softmax(y, native.matmul(h, k)), w),
}


def _grpo_fused(w, y, old, ref, h, k):
    mask = ops.not_equal(w, 0.0)
    logprobs = P.token_logprobs(y, P.linear(h, k), mask=mask, chunk_size=CHUNK)
    loss = P.policy_loss(logprobs, old, w, clip=CLIP, mask=mask)
    return loss + BETA * P.kl_estimate(logprobs, ref, mask=mask)


def _grpo_obvious(w, y, old, ref, h, k):
    """The same loss as TRL's GRPO writes it: formed logits, a log-softmax and
    a gather, the clipped ratio and exp(ref − logp) − (ref − logp) − 1."""
    mask = ops.cast(ops.not_equal(w, 0.0), "float32")
    logprobs = _selective_log_softmax(y, native.matmul(h, k))
    ratio = ops.exp(logprobs - old)
    clipped = ops.clip(ratio, 1.0 - CLIP[0], 1.0 + CLIP[1])
    policy = -ops.minimum(ratio * w, clipped * w)
    kl = ops.exp(ref - logprobs) - (ref - logprobs) - 1.0
    return ops.sum((policy + BETA * kl) * mask) / ops.maximum(ops.sum(mask), 1.0)


SAPO_TAU = (1.0, 1.05)


def _sapo_fused(w, y, old, ref, h, k):
    mask = ops.not_equal(w, 0.0)
    logprobs = P.token_logprobs(y, P.linear(h, k), mask=mask, chunk_size=CHUNK)
    return P.policy_loss(logprobs, old, w, kind="sapo", mask=mask)


def _sapo_obvious(w, y, old, ref, h, k):
    """SAPO as TRL writes it: formed logits, a log-softmax and a gather, the
    gate σ(τ(r − 1))·4/τ with τ by the advantage's sign, a token mean."""
    mask = ops.cast(ops.not_equal(w, 0.0), "float32")
    ratio = ops.exp(_selective_log_softmax(y, native.matmul(h, k)) - old)
    tau = ops.where(w > 0, SAPO_TAU[0], SAPO_TAU[1])
    loss = -ops.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * w
    return ops.sum(loss * mask) / ops.maximum(ops.sum(mask), 1.0)


def _with_log_sum_sq(w, y, old, ref, h, k):
    logprobs, log_sum_sq = P.token_logprobs(y, P.linear(h, k), chunk_size=CHUNK, return_log_sum_sq=True)
    return _weighted(logprobs, w) + 0.0 * ops.sum(log_sum_sq)


def _with_entropy(w, y, old, ref, h, k):
    logprobs, entropy = P.token_logprobs(y, P.linear(h, k), chunk_size=CHUNK, return_entropy=True)
    return _weighted(logprobs, w) + 0.01 * ops.sum(entropy)


def _frozen_inputs(small):
    """`_inputs` with the kernel before the hidden states: only the hidden
    states are differentiated (a frozen head, as in a LoRA fine-tune)."""
    *rest, h, k = _inputs(small)
    return [*rest, k, h]


def _frozen(formed):
    def fn(w, y, old, ref, k, h):
        logits = native.matmul(h, k) if formed else P.linear(h, k)
        return _weighted(P.token_logprobs(y, logits, chunk_size=CHUNK), w)

    return fn


def _capped(cap):
    return lambda w, y, old, ref, h, k: _weighted(
        P.token_logprobs(y, P.linear(h, k, soft_cap=cap), chunk_size=CHUNK), w
    )


NAME = "token_logprobs value+grad from hidden states [2048×256 → 128256], chunked"
_PEER = "log-softmax of the formed logits + gather (as TRL writes it)"

RL_CASES = [
    Case(
        NAME + " vs logits formed first",
        "our chunked call on the logits",
        "time ≤ 1.10",
        gradient_sides(_inputs, _LOGPROBS["fused"], _LOGPROBS["formed"]),
        1.10,
    ),
    Case(NAME, _PEER, "memory ≤ 0.10", gradient_sides(_inputs, _LOGPROBS["fused"], _LOGPROBS["peer"]), None, 0.10),
    Case(
        NAME + ", with return_entropy=True",
        "token_logprobs alone",
        "time ≤ 1.10",
        gradient_sides(_inputs, _with_entropy, _LOGPROBS["fused"]),
        1.10,
    ),
    Case(
        NAME + ", with return_log_sum_sq=True",
        "token_logprobs alone",
        "time ≤ 1.05",
        gradient_sides(_inputs, _with_log_sum_sq, _LOGPROBS["fused"]),
        1.05,
    ),
    Case(
        NAME + ", frozen head (hidden gradient only)",
        "our call on the logits formed first, the same frozen head",
        "time ≤ 1.10",
        gradient_sides(_frozen_inputs, _frozen(False), _frozen(True), count=1),
        1.10,
    ),
    Case(
        NAME + ", soft-capped head (c = 30)",
        "the same head uncapped",
        "time ≤ 1.10",
        gradient_sides(_inputs, _capped(30.0), _capped(None)),
        1.10,
    ),
    Case(
        "GRPO loss step (PPO clip + β·k3) value+grad from hidden states [2048×256 → 128256], fused",
        "the same written the obvious way (formed logits, log-softmax, gather)",
        "reported",
        gradient_sides(_inputs, _grpo_fused, _grpo_obvious),
    ),
    Case(
        "SAPO loss step value+grad from hidden states [2048×256 → 128256], fused",
        "the same written the obvious way (formed logits, log-softmax, gather)",
        "memory ≤ 0.10",
        gradient_sides(_inputs, _sapo_fused, _sapo_obvious),
        None,
        0.10,
    ),
]
