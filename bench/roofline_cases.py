"""Roofline rows (issue 45): the fused heads from hidden states beside the
matrix products they cannot avoid, timed in the same run.

Cross-entropy from hidden states [2048, 256] through a [256, 128256] head,
value + gradients w.r.t. the hidden states and the kernel, needs three
products of that size: the logits, then the hidden states' and the kernel's
gradients from the logits' gradient. KL to a frozen teacher's head needs a
fourth, the teacher's logits. The reference side is exactly those products,
the backend's own matmul (autodiff of Σ c·(h @ k) with a constant c of the
logits' shape gives the two gradient products), so the ratio is the fused
head's distance from what the hardware must do anyway. Each row also gives
both sides' rate as a fraction of the backend's measured matmul peak
(`native.matmul_peak`), and ours' peak memory over its floor: the
gradients it returns plus one chunk's logits and their gradient.
"""

import numpy as np
from keras import ops

from bench import native
from bench.case import Case, gradient_sides
from keras_penalties import ops as P
from keras_penalties.ops._chunks import chunk_rows

SHAPE = (2048, 256, 128256)


def _inputs(small):
    """mask, labels, the teacher's hidden states and kernel, a constant of the
    logits' shape (the products' stand-in for the logits' gradient), then
    the differentiated hidden states and kernel."""
    tokens, hidden, vocab = (64, 16, 1000) if small else SHAPE
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return ops.convert_to_tensor(scale * rng.standard_normal(size=shape, dtype=np.float32))

    return [
        ops.convert_to_tensor((rng.uniform(size=tokens) >= 0.25).astype("float32")),
        ops.convert_to_tensor(rng.integers(0, vocab, size=tokens).astype("int32")),
        normal(tokens, hidden),
        normal(hidden, vocab, scale=hidden**-0.5),
        normal(tokens, vocab, scale=1e-3),
        normal(tokens, hidden),
        normal(hidden, vocab, scale=hidden**-0.5),
    ]


def _fused_cross_entropy(m, y, ht, kt, c, h, k):
    return P.cross_entropy(y, P.linear(h, k), mask=m, chunk_size="auto")


def _fused_kl(m, y, ht, kt, c, h, k):
    return P.kl_divergence(P.linear(ht, kt), P.linear(h, k), from_logits=True, mask=m, chunk_size="auto")


def _products(teacher):
    """The unavoidable products: h @ k, and through autodiff c @ kᵀ and
    hᵀ @ c; with `teacher`, the teacher's logits too (summed into the
    value, so that no compiler drops them)."""

    def products(m, y, ht, kt, c, h, k):
        value = ops.sum(native.matmul(h, k) * c)
        return value + ops.sum(native.matmul(ht, kt)) * 1e-9 if teacher else value

    return products


def _flops(products):
    """2·T·H·V operations per product."""
    return lambda small: products * 2.0 * np.prod((64, 16, 1000) if small else SHAPE)


def _memory_floor(chunk_logits):
    """The gradients that are outputs ([T, H] and [H, V] float32) and one
    chunk's `chunk_logits` [rows, V] buffers (the logits and their
    gradient; KL also the teacher's logits), rows as "auto" picks them."""

    def floor(small):
        tokens, hidden, vocab = (64, 16, 1000) if small else SHAPE
        rows = chunk_rows("auto", vocab, tokens, heads=True)
        return 4.0 * (tokens * hidden + hidden * vocab + chunk_logits * rows * vocab)

    return floor


_NAME = "roofline: masked {} value+grad from hidden states [2048×256 → 128256], chunked"

ROOFLINE_CASES = [
    Case(
        _NAME.format(what),
        f"the {products} products it needs (the backend's matmul)",
        "time ≤ 1.25, memory ≤ 1.5 of its floor",
        gradient_sides(_inputs, fused, _products(teacher=products == 4)),
        1.25,
        flops=_flops(products),
        memory_floor=_memory_floor(products - 1),  # the logits' buffers: a chunk's, its gradient, a teacher's
        floor_limit=1.5,
    )
    for what, fused, products in (("cross-entropy", _fused_cross_entropy, 3), ("kl forward", _fused_kl, 4))
]
