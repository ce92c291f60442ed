"""Router and logit penalties (SPEC §14b), value + gradient, float32:

- `cross_entropy(z_loss=1e-4)` against `z_loss=0` from hidden states
  [2048×256 → 128256], chunked: the z-loss must cost no extra product
  (time ≤ 1.02, peak memory equal);
- `token_logprobs(return_logsumexp=True, return_top1=True)` against plain
  `token_logprobs`, the same pass (time ≤ 1.05);
- the router ops, load balancing and z-loss per layer, masked, at
  [16 layers × 8192 tokens × 64 experts, top 8] against the loop a
  keras-hub user writes: keras-hub 0.32's `compute_load_balancing_loss`
  on each layer (its [B, S, 1] mask is the padding mask: its `any` over
  the last axis is the mask itself) plus each layer's mean of
  logsumexp² (Megatron's `z_loss_func`) (time ≤ 1.1);
- torch only: our fused cross-entropy from hidden states against torch
  2.13's native `F.linear_cross_entropy` (chunked: `options=
  LinearCrossEntropyOptions()`) at the same shapes, both reading one
  [V, H] weight (time ≤ 1.2, peak memory ≤ 1.0).
"""

from keras import ops

from bench.case import Case, gradient_sides
from bench.head_inputs import HEAD_CHUNK, HEAD_SHAPE, head_inputs
from keras_penalties import ops as P

ROUTER_SHAPE = (16, 8192, 64, 8)  # layers, tokens (8 × 1024), experts, top k
_HEAD = "masked {} value+grad from hidden states [2048×256 → 128256], chunked"


def _cross_entropy(z_loss):
    return lambda m, y, ht, kt, h, k: P.cross_entropy(y, P.linear(h, k), mask=m, chunk_size=HEAD_CHUNK, z_loss=z_loss)


def _token_logprobs(extras):
    def fn(m, y, ht, kt, h, k):
        outputs = P.token_logprobs(
            y, P.linear(h, k), mask=m, chunk_size=HEAD_CHUNK, return_logsumexp=extras, return_top1=extras
        )
        if not extras:
            return ops.sum(outputs)
        logprobs, logsumexp, top1 = outputs
        return ops.sum(logprobs) + 1e-4 * ops.sum(ops.square(logsumexp)) + ops.sum(top1)

    return fn


def _router_inputs(small):
    layers, tokens, experts, _ = (2, 64, 8, 2) if small else ROUTER_SHAPE
    import numpy as np

    rng = np.random.default_rng(0)
    batch = 8 if not small else 4
    lengths = rng.integers(tokens // batch // 2, tokens // batch + 1, size=(batch, 1))
    mask = (np.arange(tokens // batch)[None, :] < lengths).astype("float32")
    logits = rng.standard_normal(size=(layers, tokens, experts), dtype=np.float32)
    return [ops.convert_to_tensor(mask), ops.convert_to_tensor(logits)]


def _top_k(small):
    return 2 if small else ROUTER_SHAPE[3]


def _ours_routers(k):
    def fn(mask, logits):
        layers = [logits[i] for i in range(logits.shape[0])]
        return P.router_load_balancing(layers, top_k=k, mask=mask, pool="layer") + 1e-3 * P.router_z_loss(
            layers, mask=mask, pool="layer"
        )

    return fn


def _keras_hub_loop(k):
    from keras_hub.src.models.qwen3_moe.qwen3_moe_decoder import compute_load_balancing_loss

    def fn(mask, logits):
        experts = logits.shape[-1]
        attention = ops.expand_dims(mask, -1)  # [B, S, 1]: keras-hub's `any` over the last axis gives the mask
        rows = ops.reshape(mask, (-1,))
        total = 0.0
        for i in range(logits.shape[0]):
            total = total + compute_load_balancing_loss(logits[i], experts, k, attention)
            z = ops.square(ops.logsumexp(logits[i], axis=-1))
            total = total + 1e-3 * ops.sum(z * rows) / ops.maximum(ops.sum(rows), 1.0)
        return total

    return fn


def _routers(small):
    k = _top_k(small)
    return gradient_sides(_router_inputs, _ours_routers(k), _keras_hub_loop(k), count=1)(small)


def _torch_inputs(small):
    """mask, labels (-100 where masked, for the peer), hidden states and a
    [V, H] weight (both sides read it: ours transposed in place)."""
    import numpy as np

    tokens, hidden, vocab = (64, 16, 1000) if small else HEAD_SHAPE
    rng = np.random.default_rng(0)
    mask = (rng.uniform(size=tokens) >= 0.25).astype("float32")
    labels = np.where(mask > 0, rng.integers(0, vocab, size=tokens), -100).astype("int64")
    h = rng.standard_normal(size=(tokens, hidden), dtype=np.float32)
    w = hidden**-0.5 * rng.standard_normal(size=(vocab, hidden), dtype=np.float32)
    return [ops.convert_to_tensor(a) for a in (mask, labels, h, w)]


def _torch_native(m, y, h, w):
    import torch
    import torch.nn.functional as F

    return F.linear_cross_entropy(h, w, y, ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions())


def _ours_transposed(m, y, h, w):
    return P.cross_entropy(y, P.linear(h, w, transpose_kernel=True), mask=m, chunk_size=HEAD_CHUNK)


ROUTER_CASES = [
    Case(
        _HEAD.format("cross-entropy with z_loss=1e-4"),
        "the same call with z_loss=0",
        "time ≤ 1.02, memory ≤ 1.00",
        gradient_sides(head_inputs, _cross_entropy(1e-4), _cross_entropy(0.0)),
        1.02,
        1.00,
    ),
    Case(
        _HEAD.format("token_logprobs with logsumexp and top1"),
        "token_logprobs alone, the same chunks",
        "time ≤ 1.05",
        gradient_sides(head_inputs, _token_logprobs(True), _token_logprobs(False)),
        1.05,
    ),
    Case(
        "router load balancing + z-loss per layer value+grad, masked [16 layers × 8192 tokens × 64 experts, top 8]",
        "keras-hub 0.32's compute_load_balancing_loss on each layer + each layer's logsumexp² mean (a loop)",
        "time ≤ 1.10",
        _routers,
        1.10,
    ),
]
# torch's native peer: a row of every backend's case list (the summary shows
# "–" elsewhere), measured on torch alone.
ROUTER_CASES.append(
    Case(
        _HEAD.format("cross-entropy") + " vs torch's F.linear_cross_entropy",
        "torch 2.13 F.linear_cross_entropy, chunked (LinearCrossEntropyOptions())",
        "time ≤ 1.20, memory ≤ 1.00",
        gradient_sides(_torch_inputs, _ours_transposed, _torch_native),
        1.20,
        1.00,
        backends=("torch",),
    )
)
