"""Independent NumPy (float64) oracles for MoE router losses, transcribed from their sources.

Sources (commit SHAs read from the repositories themselves):

- HF: huggingface/transformers, src/transformers/models/mixtral/modular_mixtral.py
  @ 7792ab1a984cb369352b985f63393090ab0819c3 (``load_balancing_loss_func``; same math in the generated
  src/transformers/models/mixtral/modeling_mixtral.py @ af3efdd71ee5b568dfdb71bb41d316df830147af).
- keras-hub: keras-team/keras-hub, keras_hub/src/models/qwen3_moe/qwen3_moe_decoder.py and
  keras_hub/src/layers/modeling/transformer_layer_utils.py @ 71453d08f59edc90d276e999319fc51e61cbf82c (master,
  0.32.0.dev0). The v0.32.0 tag was not in the available snapshot; these files (git blobs fd4e5919, 1331422a)
  are byte-identical to the installed keras-hub 0.32.0 wheel and to tag v0.31.1
  (e68fccb7055e7ae4d15766d61ab4eca715d15692).
- Megatron: NVIDIA/Megatron-LM, megatron/core/transformer/moe/moe_utils.py
  @ d98e8a64ddf34856e74b24714e3bedb2f5a39553 (``z_loss_func``); ST-MoE (arXiv:2202.08906) eq. 5.
"""

import numpy as np


def _softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _logsumexp(z):
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0]


def _top_k_one_hot(probs, num_experts, top_k):
    """one_hot(topk(probs, k).indices, E): [N, k, E]; the k largest (argsort, ties measure-zero)."""
    selected = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    return np.eye(num_experts, dtype=np.float64)[selected]


def hf_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask=None):
    """HF transformers ``load_balancing_loss_func`` (Mixtral; modular_mixtral.py @ 7792ab1a, see module doc).

    gate_logits: L arrays [B*S, E] (a list is taken as HF's tuple), concatenated over layers; attention_mask
    [B, S] or None. Returns E * sum_{k,e} tokens_per_expert[k, e] * router_prob_per_expert[e], with
    tokens_per_expert [k, E] the (masked) token mean of one_hot(top-k) -- not averaged over k, so the loss
    scales with k (uniform routing gives k) -- and both means pooled over all L layers at once.
    The mask is broadcast to [L, B, S, k, E] (and [L, B, S, E]) and reshaped, i.e. the same [B, S] mask is
    applied to every layer (num_hidden_layers = rows // (B*S)). No epsilon: an all-zero mask gives 0/0 = nan.
    """
    if gate_logits is None:
        return 0
    concatenated = np.concatenate([np.asarray(g, dtype=np.float64) for g in gate_logits], axis=0)
    routing_weights = _softmax(concatenated)
    expert_mask = _top_k_one_hot(routing_weights, num_experts, top_k)
    if attention_mask is None:
        tokens_per_expert = expert_mask.mean(axis=0)
        router_prob_per_expert = routing_weights.mean(axis=0)
    else:
        mask = np.asarray(attention_mask, dtype=np.float64)
        batch_size, sequence_length = mask.shape
        num_layers = concatenated.shape[0] // (batch_size * sequence_length)
        shape5 = (num_layers, batch_size, sequence_length, top_k, num_experts)
        expert_attention_mask = np.broadcast_to(mask[None, :, :, None, None], shape5).reshape(-1, top_k, num_experts)
        tokens_per_expert = (expert_mask * expert_attention_mask).sum(axis=0) / expert_attention_mask.sum(axis=0)
        shape4 = (num_layers, batch_size, sequence_length, num_experts)
        router_mask = np.broadcast_to(mask[None, :, :, None], shape4).reshape(-1, num_experts)
        router_prob_per_expert = (routing_weights * router_mask).sum(axis=0) / router_mask.sum(axis=0)
    overall_loss = np.sum(tokens_per_expert * router_prob_per_expert[None, :])
    return overall_loss * num_experts


def keras_hub_load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """keras-hub 0.32 ``compute_load_balancing_loss`` (qwen3_moe_decoder.py @ 71453d08, see module doc).

    One layer: router_logits [B*S, E]; attention_mask the [B, S, S] self-attention mask, token mask =
    ``any`` over its last axis, flattened to [B*S]. Returns E * sum_e f_e * P_e where f = token mean of
    one_hot(top-k) [k, E] then mean over k (so sum_e f_e = 1; uniform routing gives 1), P = token mean of
    softmax; masked means divide by max(kept, 1e-9). mixtral_decoder.py's version takes a [B, S] mask
    (sliced to the first B*S/S rows, used as given, no ``any``) but is otherwise the same math.
    """
    routing_weights = _softmax(router_logits)
    expert_mask = _top_k_one_hot(routing_weights, num_experts, top_k)
    if attention_mask is None:
        tokens_per_expert = expert_mask.mean(axis=0)
        router_prob_per_expert = routing_weights.mean(axis=0)
    else:
        flat_mask = np.any(np.asarray(attention_mask), axis=-1).reshape(-1).astype(np.float64)[:, None]
        kept = max(flat_mask.sum(), 1e-9)
        tokens_per_expert = (expert_mask * flat_mask[:, None, :]).sum(axis=0) / kept
        router_prob_per_expert = (routing_weights * flat_mask).sum(axis=0) / kept
    tokens_per_expert = tokens_per_expert.mean(axis=0)
    return np.sum(tokens_per_expert * router_prob_per_expert) * num_experts


def megatron_z_loss(logits, z_loss_coeff, padding_mask=None):
    """Megatron-LM ``z_loss_func`` (moe_utils.py @ d98e8a64, see module doc), logits [N, E].

    coeff * mean(logsumexp(logits)^2); padding_mask [N] with True = padding (excluded), mean over valid
    tokens with the count clamped to >= 1.
    """
    z_loss_values = np.square(_logsumexp(logits))
    if padding_mask is None:
        return np.mean(z_loss_values) * z_loss_coeff
    valid = ~np.asarray(padding_mask, dtype=bool)
    return (z_loss_values * valid).sum() / max(valid.sum(), 1.0) * z_loss_coeff


def st_moe_z_loss(router_logits_list, mask=None):
    """ST-MoE router z-loss (eq. 5): mean of logsumexp(z)^2 over every (layer, kept token) pair.

    router_logits_list: L arrays [N, E] (or one array); mask [N], 1/True = keep, shared by all layers (so this
    is also the mean of the per-layer means). 0 when nothing is kept. Equals megatron_z_loss(z, 1.0,
    padding_mask=~mask) for one layer.
    """
    if isinstance(router_logits_list, np.ndarray):
        router_logits_list = [router_logits_list]
    z2 = np.stack([np.square(_logsumexp(z)) for z in router_logits_list])  # [L, N]
    keep = np.ones(z2.shape[1]) if mask is None else np.asarray(mask, dtype=np.float64)
    return (z2 * keep).sum() / max(keep.sum() * z2.shape[0], 1.0)


def qwen_padding_token_mask(padding_mask):
    """[B*S] bool token mask keras-hub's Qwen3-MoE load-balancing loss sees for a [B, S] padding mask.

    Qwen3MoeTransformerDecoder._compute_self_attention_mask = minimum(merge_padding_and_attention_mask
    (padding as [B, 1, S], int32), compute_causal_mask (query i >= key j)); the loss keeps a token if ``any``
    of its row is 1, i.e. any real token at or before it. With right padding a padded position still attends
    to the real tokens before it, so it is kept: only rows with no real token (or left padding) are dropped.
    """
    pad = np.asarray(padding_mask).astype(np.int32)
    seq_len = pad.shape[1]
    causal = np.arange(seq_len)[:, None] >= np.arange(seq_len)[None, :]  # [S_query, S_key]
    merged = np.minimum(pad[:, None, :], causal[None].astype(np.int32))  # [B, S, S]
    return np.any(merged, axis=-1).reshape(-1)
