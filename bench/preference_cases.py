"""Preference optimisation: a DPO step from hidden states, the chosen and the
rejected completions 1024 tokens each (8 pairs of 128), H = 256,
V = 128256, value + gradients w.r.t. both sides' hidden states and the
kernel, float32: `ops.token_logprobs` on `ops.linear` for each side and
`ops.preference_loss` against the obvious path as TRL writes it (each
side's logits formed, a log-softmax, a gather, the masked sums, then
−log σ(β·h)). The reference's sums are precomputed (TRL's
`precompute_ref_log_probs`). And a KTO step from the chosen sides alone,
each example desirable or not, against the same obvious path."""

import os

import numpy as np
from keras import ops

from bench import native
from bench.case import Case, gradient_sides
from bench.rl_cases import _selective_log_softmax
from keras_penalties import ops as P

SHAPE = (1024, 256, 128256)  # tokens a side, hidden size, vocabulary
PAIRS, BETA = 8, 0.1
# Rows per chunk: the backend's "auto" budget, as the head rows (HEAD_CHUNK).
CHUNK = int(os.environ["HEAD_CHUNK"]) if os.environ.get("HEAD_CHUNK") else "auto"


def inputs(small, tokens=None):
    """Each side's completion mask and labels [pairs, tokens / pairs], the
    reference's per-sequence sums, then the differentiated hidden states of
    each side and the kernel."""
    tokens, hidden, vocab = (64, 16, 1000) if small else ((tokens or SHAPE[0]), *SHAPE[1:])
    per = tokens // PAIRS
    rng = np.random.default_rng(0)

    def tensor(x, dtype="float32"):
        return ops.convert_to_tensor(np.asarray(x, dtype))

    masks = [(rng.uniform(size=(PAIRS, per)) >= 0.25) | (np.arange(per) == 0) for _ in range(2)]
    return [
        *(tensor(m) for m in masks),
        *(tensor(rng.integers(0, vocab, size=(PAIRS, per)), "int32") for _ in range(2)),
        *(tensor(-rng.uniform(200.0, 400.0, size=PAIRS)) for _ in range(2)),
        *(tensor(rng.standard_normal((PAIRS, per, hidden))) for _ in range(2)),
        tensor(hidden**-0.5 * rng.standard_normal((hidden, vocab))),
    ]


def fused(chosen_mask, rejected_mask, chosen_labels, rejected_labels, ref_chosen, ref_rejected, hc, hr, kernel):
    # Both sides in one call (TRL's concatenated forward, the sides as long):
    # one loop, one kernel gradient buffer, where a call a side keeps two.
    both = [ops.concatenate(pair, axis=0) for pair in ((chosen_labels, rejected_labels), (hc, hr))]
    mask = ops.concatenate([chosen_mask, rejected_mask], axis=0)
    logprobs = P.token_logprobs(both[0], P.linear(both[1], kernel), mask=mask, chunk_size=CHUNK)
    chosen, rejected = logprobs[:PAIRS], logprobs[PAIRS:]
    return P.preference_loss(
        chosen, rejected, ref_chosen, ref_rejected, beta=BETA, chosen_mask=chosen_mask, rejected_mask=rejected_mask
    )


def obvious(chosen_mask, rejected_mask, chosen_labels, rejected_labels, ref_chosen, ref_rejected, hc, hr, kernel):
    """As TRL writes it: each side's logits formed, log-softmax and gather,
    the sums over the completion mask, −log σ(β·h) averaged over the pairs."""

    def side(labels, hidden, mask):
        rows = ops.reshape(hidden, (-1, ops.shape(hidden)[-1]))
        logprobs = _selective_log_softmax(ops.reshape(labels, (-1,)), native.matmul(rows, kernel))
        return ops.sum(ops.reshape(logprobs, ops.shape(labels)) * mask, axis=1)

    chosen, rejected = side(chosen_labels, hc, chosen_mask), side(rejected_labels, hr, rejected_mask)
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    return ops.mean(-ops.log_sigmoid(BETA * h))


def kto_inputs(small):
    """KTO's examples (the chosen side of `inputs` at 2048 tokens: 8
    completions of 256), their labels desirable or not, the reference's sums
    and z₀ (precomputed, as TRL computes the mismatched pairs'
    log-probabilities without a gradient), then the differentiated hidden
    states and kernel."""
    mask, _, labels, _, ref, _, hidden, _, kernel = inputs(small, tokens=2048)
    desirable = ops.convert_to_tensor(np.arange(PAIRS) % 2 == 0)
    return [mask, labels, ref, desirable, ops.convert_to_tensor(np.float32(0.5)), hidden, kernel]


def kto_fused(mask, labels, ref, desirable, z0, hidden, kernel):
    logprobs = P.token_logprobs(labels, P.linear(hidden, kernel), mask=mask, chunk_size=CHUNK)
    return P.unpaired_preference_loss(logprobs, ref, desirable, beta=BETA, kl_baseline=z0, mask=mask)


def kto_obvious(mask, labels, ref, desirable, z0, hidden, kernel):
    """As TRL writes it: the logits formed, log-softmax and gather, the sums,
    1 − σ(β(Δ − z₀)) for the desirable and 1 − σ(β(z₀ − Δ)) for the others."""
    rows = ops.reshape(hidden, (-1, ops.shape(hidden)[-1]))
    logprobs = _selective_log_softmax(ops.reshape(labels, (-1,)), native.matmul(rows, kernel))
    delta = ops.sum(ops.reshape(logprobs, ops.shape(labels)) * mask, axis=1) - ref
    losses = ops.where(desirable, 1.0 - ops.sigmoid(BETA * (delta - z0)), 1.0 - ops.sigmoid(BETA * (z0 - delta)))
    return ops.mean(losses)


PREFERENCE_CASES = [
    Case(
        "DPO step (sigmoid) value+grad from hidden states, chosen and rejected 1024 tokens each [256 → 128256], fused",
        "the obvious path (each side's logits formed, log-softmax, gather, sums, as TRL writes it)",
        "memory ≤ 0.10, time ≤ 1.40",
        gradient_sides(inputs, fused, obvious, count=3),
        1.40,
        0.10,
    ),
    Case(
        "KTO step value+grad from hidden states, 8 completions of 256 tokens [2048×256 → 128256], fused",
        "the obvious path (the logits formed, log-softmax, gather, sums, as TRL writes it)",
        "memory ≤ 0.10",
        gradient_sides(kto_inputs, kto_fused, kto_obvious),
        None,
        0.10,
    ),
]
