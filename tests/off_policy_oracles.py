"""NumPy float64 transcriptions of peer libraries' off-policy RL code (importance-sampling corrections, GSPO,
off-policy masks, top-k distillation, discounted returns), used only as test oracles.

Same rules as tests/rl_oracles.py: each function is a line-by-line transcription of a named function in TRL
(huggingface/trl) or verl (verl-project/verl, formerly volcengine/verl), read at the commit cited above it, never
written from this package's code. Torch operations are replaced by their NumPy equivalents; `.detach()` only shows
up in the separate `*_grad` functions, which give by hand, in closed form, what torch autograd gives for the peer's
code. Anything that only matters for distributed runs (process counts, gradient accumulation normalizers,
all-reduces) is left at its single-process value.
"""

import numpy as np

# --------------------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------------------
# Source read: huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24, VERSION 1.10.0.dev0),
# files trl/trainer/grpo_trainer.py, trl/trainer/utils.py, trl/experimental/gspo_token/grpo_trainer.py and
# trl/experimental/iw_opd/iw_opd_trainer.py.


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))


def _trl_advantages(advantages):
    # _compute_loss: "if advantages.dim() == 1: advantages = advantages.unsqueeze(1)"; (B, T) passes unchanged.
    advantages = np.asarray(advantages, dtype=np.float64)
    return advantages[:, None] if advantages.ndim == 1 else advantages


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer._generate_and_score_completions, the "vllm_importance_sampling_ratio" block (tool_mask=None).
def trl_vllm_is_weights(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_max=3.0, clip_min=None):
    """[B, T] weight that TRL multiplies into per_token_loss (inputs["importance_sampling_ratio"]).

    d = (old_per_token_logps - sampling_per_token_logps) * mask, old = the training model's logps at generation
    time, sampling = vLLM's. "token_*": r = exp(d) per token; "sequence_*": r = exp(sum_t d) per row (a product of
    token ratios, not a geometric mean), (B, 1) in TRL, broadcast to (B, T) here. No clamp of d before exp (a large
    sum overflows to inf). "*_truncate": clamp(r, clip_min, clip_max), either bound may be None (config rejects both
    None). "*_mask": r set to 0.0 where r < clip_min or r > clip_max (kept inclusive at the bounds, None = -inf / inf).
    Defaults: mode "sequence_mask", clip_max 3.0, clip_min None. Padding tokens get exp(0) = 1 in token modes (not
    0). The mask modes leave `mask` untouched: a rejected token still counts in every loss denominator
    (mask.sum(-1), mask.sum(), num_items_in_batch); only its numerator term is zeroed. The weight is a plain tensor
    (no gradient); it multiplies the policy term only, after the off-policy and entropy masks, before beta * KL is
    added, and it is not applied for loss_type "vespo".
    """
    mask = np.asarray(mask, dtype=np.float64)
    diff = (np.asarray(old_per_token_logps, np.float64) - np.asarray(sampling_per_token_logps, np.float64)) * mask
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(axis=-1, keepdims=True)
    elif mode not in ("token_mask", "token_truncate"):
        raise ValueError(f"Unknown vLLM importance sampling level: {mode}")
    with np.errstate(over="ignore"):
        ratio = np.exp(diff)
    if mode.endswith("_truncate"):
        ratio = np.clip(ratio, clip_min, clip_max)
    else:
        min_val = clip_min if clip_min is not None else -np.inf
        max_val = clip_max if clip_max is not None else np.inf
        ratio = np.where((ratio < min_val) | (ratio > max_val), 0.0, ratio)
    return np.broadcast_to(ratio, mask.shape).copy()


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer.get_off_policy_mask (and the advantages unsqueeze of _compute_loss before the call).
def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold):
    """DeepSeek-V3.2 off-policy sequence mask of TRL: 1.0 keep, 0.0 drop; multiplies the policy term only.

    avg_kl = sum_t (sampling - logp) * mask / clamp(sum_t mask, min=1) per row (logp detached; an empty row gives
    0); keep = (A >= 0) | (avg_kl <= threshold): a zero advantage is kept and both tests are inclusive. (B,)
    advantages give (B, 1); per-token (B, T) advantages broadcast and give (B, T) (sign tested per token).
    sampling_per_token_logps is vLLM's when present, else old_per_token_logps (else logp itself, so avg_kl = 0).
    """
    mask = np.asarray(mask, dtype=np.float64)
    kl_div = np.asarray(sampling_per_token_logps, np.float64) - np.asarray(per_token_logps, np.float64)
    avg_seq_kl = (kl_div * mask).sum(axis=1, keepdims=True) / np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    return ((_trl_advantages(advantages) >= 0) | (avg_seq_kl <= threshold)).astype(np.float64)


def _trl_log_weights(logp, old_logp, mask, level):
    log_ratio = np.asarray(logp, np.float64) - np.asarray(old_logp, np.float64)
    if level == "token":
        return log_ratio
    if level in ("sequence", "sequence_token"):
        # "sequence_token" is logp - logp.detach() + sg(seq): equal to seq in value (x - x == 0 exactly).
        return ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    raise ValueError(f"Unknown importance sampling level: {level}")


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss
# (levels "token"/"sequence") and trl/experimental/gspo_token/grpo_trainer.py, GRPOTrainer._compute_loss ("sequence_
# token"); loss_type grpo/bnpo/dr_grpo/dapo branch, delta=None, beta=0, no entropy/off-policy mask or vLLM weight.
def trl_gspo_token_loss(logp, old_logp, advantages, mask, eps_low, eps_high, level):
    """Per-token policy loss matrix [B, T] of TRL, before "* mask" and aggregation.

    coef_1 = exp(w), w = logp - old (token) or, per row, s = sum_t (logp - old) * mask / clamp(sum_t mask, min=1)
    (sequence, sequence_token); no clamp on w, and an empty row gives s = 0, coef_1 = 1. coef_2 = clamp(coef_1,
    1 - eps_low, 1 + eps_high); loss = -min(coef_1 * A, coef_2 * A), no dual clip. "sequence" keeps the loss (B, 1)
    with (B,) advantages and it is broadcast to (B, T) here; "sequence" and "sequence_token" agree in value and differ
    only in gradient. "sequence_token" exists only in trl/experimental/gspo_token (the main trainer raises for it).
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    coef_1 = np.exp(_trl_log_weights(logp, old_logp, mask, level))
    coef_2 = np.clip(coef_1, 1.0 - eps_low, 1.0 + eps_high)
    return np.broadcast_to(-np.minimum(coef_1 * advantages, coef_2 * advantages), mask.shape).copy()


# Same sources as trl_gspo_token_loss; the gradient torch autograd gives (old_logp a constant; torch.min splits the
# gradient at ties, and coef_1 == coef_2 exactly inside [1 - eps_low, 1 + eps_high], where torch.clamp passes it).
def trl_gspo_token_loss_grad(logp, old_logp, advantages, mask, eps_low, eps_high, level):
    """d sum(trl_gspo_token_loss * mask) / d logp, per token, [B, T].

    With g = -A * coef_1 * keep, keep = not ((A > 0 & coef_1 > 1 + eps_high) | (A < 0 & coef_1 < 1 - eps_low)):
    token: g * mask. sequence_token: g * mask (the sequence ratio is detached; each token gets its own A).
    sequence: coef_1 depends on every kept token, so grad[i, u] = mask[i, u] / clamp(n_i, min=1) * sum_t mask[i, t] *
    g[i, t], n_i = sum_t mask[i, t]; with (B,) advantages that is mask[i, u] * n_i / clamp(n_i, 1) * g_i.
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    coef_1 = np.exp(_trl_log_weights(logp, old_logp, mask, level))
    clipped = ((advantages > 0) & (coef_1 > 1.0 + eps_high)) | ((advantages < 0) & (coef_1 < 1.0 - eps_low))
    g = np.broadcast_to(-advantages * coef_1 * ~clipped, mask.shape)
    if level == "sequence":
        return mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) * (g * mask).sum(-1, keepdims=True)
    return g * mask


def _trl_nan_reduce(fn, x):
    # trl.trainer.utils.nanmin / nanmax: NaN when every entry is NaN, else the reduction over the non-NaN entries.
    x = x[~np.isnan(x)]
    return np.float64(np.nan) if x.size == 0 else np.float64(fn(x))


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# the "Log the metrics" block (masked_seq_mean, global_masked_mean with one process; delta=None).
def trl_clip_ratio_metrics(logp, old_logp, advantages, mask, eps_low, eps_high, level="token"):
    """TRL's logged clip metrics for one micro-batch on one process, as a dict keyed like TRL's metric names.

    On coef_1 (the unclipped ratio of trl_gspo_token_loss, after the delta clamp when delta is set), strict tests:
    low = coef_1 < 1 - eps_low & A < 0, high = coef_1 > 1 + eps_high & A > 0, region = low | high (loss_type "cispo"
    logs only "cispo_clip_ratio", coef_1 > eps_high & A > 0, averaged like *_mean). *_mean: sum(x * mask) /
    clamp(sum(mask), min=1) when x is (B, T); when x is (B, 1) ("sequence" level, (B,) advantages) it is sum(x) / B:
    every row counts once, empty rows too. low_min / high_max: nanmin / nanmax over rows of sum_t(x * mask) /
    sum_t(mask) (no clamp: an empty row is NaN and skipped; (B, 1) x is used as is).
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    coef_1 = np.exp(_trl_log_weights(logp, old_logp, mask, level))

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return np.float64(x.sum() / max(float(x.shape[0]), 1.0))
        return np.float64((x * mask).sum() / max(mask.sum(), 1.0))

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x[:, 0]
        with np.errstate(invalid="ignore", divide="ignore"):
            return (x * mask).sum(-1) / mask.sum(-1)

    low = ((coef_1 < 1.0 - eps_low) & (advantages < 0)).astype(np.float64)
    high = ((coef_1 > 1.0 + eps_high) & (advantages > 0)).astype(np.float64)
    return {
        "clip_ratio/low_mean": global_masked_mean(low),
        "clip_ratio/high_mean": global_masked_mean(high),
        "clip_ratio/region_mean": global_masked_mean(np.maximum(low, high)),
        "clip_ratio/low_min": _trl_nan_reduce(np.min, masked_seq_mean(low)),
        "clip_ratio/high_max": _trl_nan_reduce(np.max, masked_seq_mean(high)),
    }


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# the per_token_kl block with args.use_bias_correction_kl=True (levels "token" and "sequence").
def trl_bias_corrected_kl(logp, old_logp, ref_logp, mask, level="token"):
    """[B, T] KL term of TRL with use_bias_correction_kl: (exp(ref - logp) - (ref - logp) - 1) * coef_1.

    coef_1 = exp(w) as in trl_gspo_token_loss (per token, or one ratio per row for "sequence"), taken before the
    delta clamp, NOT detached, with no clamp. It is added as beta * kl after the vLLM weight and masks, so the KL term
    is never multiplied by the vLLM IS weight, the off-policy mask or the entropy mask.
    """
    logp, ref_logp = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
    coef_1 = np.exp(_trl_log_weights(logp, old_logp, np.asarray(mask, np.float64), level))
    return (np.exp(ref_logp - logp) - (ref_logp - logp) - 1.0) * coef_1


# Same source as trl_bias_corrected_kl; what autograd gives (gradient through both the KL and coef_1).
def trl_bias_corrected_kl_grad(logp, old_logp, ref_logp, mask, level="token"):
    """d sum(trl_bias_corrected_kl * mask) / d logp, [B, T].

    token: mask * r * (k + 1 - exp(ref - logp)) with r = exp(logp - old), k the KL. sequence: mask * r_i * (1 -
    exp(ref - logp)) + mask / clamp(n_i, min=1) * r_i * sum_t mask * k.
    """
    logp, ref_logp = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    r = np.exp(_trl_log_weights(logp, old_logp, mask, level))
    k = np.exp(ref_logp - logp) - (ref_logp - logp) - 1.0
    dk = 1.0 - np.exp(ref_logp - logp)
    if level == "token":
        return mask * r * (k + dk)
    return mask * r * dk + mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) * r * (mask * k).sum(-1, keepdims=True)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer._get_per_token_logps_and_entropies (one chunk, text only) and trl/trainer/utils.py,
# entropy_from_logits and selective_log_softmax.
def trl_logps_and_entropies(logits, input_ids, logits_to_keep, temperature=1.0):
    """(per_token_logps, entropies), both [B, T] with T = logits_to_keep, from the model's [B, L, V] logits.

    logits[:, :-1][:, -T:] / temperature (entropy of the tempered distribution, the same tempered logits as the
    logps); completion_ids = input_ids[:, -T:]; entropy = -sum(exp(logp) * logp) over V, so a -inf logit gives
    0 * -inf = NaN in TRL (and here). Entropies are detached unless the entropy bonus is on (see trl_entropy_grad).
    """
    logits = np.asarray(logits, dtype=np.float64)[:, :-1, :][:, -logits_to_keep:, :] / temperature
    completion_ids = np.asarray(input_ids)[:, -logits_to_keep:]
    logps = _log_softmax(logits)
    per_token_logps = np.take_along_axis(logps, completion_ids[..., None], axis=-1)[..., 0]
    with np.errstate(invalid="ignore"):
        entropies = -(np.exp(logps) * logps).sum(-1)
    return per_token_logps, entropies


# Same source as trl_logps_and_entropies; autograd's gradient of the entropy (the entropy bonus path).
def trl_entropy_grad(logits, logits_to_keep, temperature=1.0):
    """d sum(entropies) / d logits, [B, L, V]: -p * (log p + H) / temperature on the kept positions, 0 elsewhere."""
    logits = np.asarray(logits, dtype=np.float64)
    logps = _log_softmax(logits[:, :-1, :][:, -logits_to_keep:, :] / temperature)
    h = -(np.exp(logps) * logps).sum(-1, keepdims=True)
    grad = np.zeros_like(logits)
    grad[:, logits.shape[1] - 1 - logits_to_keep : logits.shape[1] - 1, :] = -np.exp(logps) * (logps + h) / temperature
    return grad


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8 (file last changed in
# 126ce88c303bf16b964ecd1740c877db42f9a010), trl/experimental/iw_opd/iw_opd_trainer.py,
# IWOPDTrainer.generalized_jsd_loss with beta=0 (forward KL), _add_tail_bucket, _jsd_divergence and
# _reduce_divergence_loss (reduction="batchmean", num_items_in_batch=None).
def trl_iwopd_topk_forward_kl(student_logits, teacher_logits, labels, top_k, temperature=1.0, add_tail=True):
    """(per-position KL [B, T], batchmean loss) of TRL's loss_top_k / loss_add_tail forward KL (beta = 0).

    Both logits / temperature, full log_softmax each; support = the teacher's top_k ids (torch.topk; ties at the
    k-th value are ambiguous, avoid them). add_tail: each side gets a (K+1)-th bin log(1 - sum_k p_k) =
    log(-expm1(min(logsumexp(top-k logps), -1e-7))), the top-k logps themselves NOT renormalized; without the tail
    both sides are renormalized over the support. KL = sum_bins nan_to_num(p_t * (log p_t - log p_s), nan=0) (also
    maps +-inf to +-float max). top_k == 0 or V <= top_k: full-vocabulary F.kl_div(log_s, log_t, log_target=True).
    Loss = sum over positions with labels != -100 / clamp(count, min=1).
    """
    s = np.asarray(student_logits, dtype=np.float64) / temperature
    t = np.asarray(teacher_logits, dtype=np.float64) / temperature
    if top_k > 0 and s.shape[-1] > top_k:
        support = np.argsort(-t, axis=-1, kind="stable")[..., :top_k]
        s_lp = np.take_along_axis(_log_softmax(s), support, axis=-1)
        t_lp = np.take_along_axis(_log_softmax(t), support, axis=-1)

        def add_tail_bucket(lp):
            top = np.max(lp, axis=-1, keepdims=True)
            log_sum = np.minimum(top + np.log(np.sum(np.exp(lp - top), axis=-1, keepdims=True)), -1e-7)
            return np.concatenate([lp, np.log(-np.expm1(log_sum))], axis=-1)

        s_lp, t_lp = (
            (add_tail_bucket(s_lp), add_tail_bucket(t_lp)) if add_tail else (_log_softmax(s_lp), _log_softmax(t_lp))
        )
        with np.errstate(invalid="ignore"):
            per_bin = np.nan_to_num(np.exp(t_lp) * (t_lp - s_lp), nan=0.0)
    else:
        s_lp, t_lp = _log_softmax(s), _log_softmax(t)
        per_bin = np.exp(t_lp) * (t_lp - s_lp)
    divergence = per_bin.sum(-1)
    valid = np.asarray(labels) != -100
    return divergence, np.float64(divergence[valid].sum() / max(valid.sum(), 1))


# --------------------------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------------------------
# Source read: verl-project/verl, commit 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22, 0.10.0.dev), files
# verl/trainer/ppo/rollout_corr_helper.py, verl/trainer/ppo/core_algos.py, verl/trainer/distillation/losses.py,
# verl/trainer/distillation/fsdp/losses.py and verl/utils/torch_functional.py (masked_sum, masked_mean).


def _verl_masked_sum(values, mask, axis=None, keepdims=False):
    # verl.utils.torch_functional.masked_sum: where(mask, values, 0) * mask, summed (NaN outside the mask dropped).
    values, mask = np.asarray(values, np.float64), np.asarray(mask, np.float64)
    return np.sum(np.where(mask != 0, values, 0.0) * mask, axis=axis, keepdims=keepdims)


def _verl_masked_mean(values, mask, axis=None, keepdims=False):
    # verl.utils.torch_functional.masked_mean: masked_sum / (mask.sum + 1e-8).
    mask = np.asarray(mask, np.float64)
    return _verl_masked_sum(values, mask, axis, keepdims) / (mask.sum(axis=axis, keepdims=keepdims) + 1e-8)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/rollout_corr_helper.py,
# compute_rollout_correction_weights and _parse_rollout_is_threshold (as called by
# compute_rollout_correction_and_rejection_mask; torch.distributed not initialized).
def verl_rollout_is_weights(old_log_prob, rollout_log_prob, response_mask, rollout_is, threshold=2.0, normalize=False):
    """[B, T] "rollout_is_weights" of verl (detached; multiplied into pg_losses by every policy loss).

    log_ratio = old_log_prob - rollout_log_prob. "token": exp(clamp(log_ratio, -20, 20)); "sequence": exp(clamp(
    masked_sum_t log_ratio, -20, 20)) broadcast over the row (a product, not a geometric mean); then * response_mask
    (padding weight 0). threshold float or "u": TIS, min(w, u) (no lower bound); "l_u" string: IcePop, w kept where
    l <= w <= u (inclusive) else 0. The mask is unchanged, so IcePop-zeroed tokens stay in agg_loss's denominator.
    normalize (rollout_is_batch_normalize): divide by the masked mean weight (token: masked_mean with + 1e-8;
    sequence: mean over non-empty rows of the per-row masked_mean) when that mean > 1e-8.
    """
    if isinstance(threshold, bool):
        raise TypeError("rollout_is_threshold must be a float or a string")
    spec = threshold.strip() if isinstance(threshold, str) else threshold
    lower, upper = map(float, spec.split("_", 1)) if isinstance(spec, str) and "_" in spec else (None, float(spec))
    if upper <= 0 or (lower is not None and (lower <= 0 or lower > upper)):
        raise ValueError(f"invalid rollout_is_threshold {threshold!r}")
    mask = np.asarray(response_mask, dtype=np.float64)
    if not mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    log_ratio = np.asarray(old_log_prob, np.float64) - np.asarray(rollout_log_prob, np.float64)
    if rollout_is == "token":
        raw = np.exp(np.clip(log_ratio, -20.0, 20.0))
    elif rollout_is == "sequence":
        raw = np.broadcast_to(np.exp(np.clip(_verl_masked_sum(log_ratio, mask, -1, True), -20.0, 20.0)), mask.shape)
    else:
        raise ValueError(f"Invalid rollout_is: {rollout_is}")
    raw = raw * mask
    weights = np.minimum(raw, upper) if lower is None else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    if normalize:
        if rollout_is == "token":
            weights_mean = _verl_masked_mean(weights, mask)
        else:
            seq_mask = (mask.sum(-1) > 0).astype(np.float64)
            weights_mean = (_verl_masked_mean(weights, mask, -1) * seq_mask).sum() / max(seq_mask.sum(), 1e-8)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
    return weights


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/rollout_corr_helper.py,
# compute_rollout_rejection_mask and _parse_rollout_rs_thresholds (metrics left out).
def verl_rollout_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_rs, threshold):
    """[B, T] modified response_mask of verl's rejection sampling (it REPLACES batch["response_mask"]).

    lr = clamp(old - rollout, -20, 20); k1 = -lr (log pi_rollout / pi_train), k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr.
    Options (comma separated, all must pass): token_kN per token, seq_sum_kN = masked_sum, seq_mean_kN = masked_sum /
    (count + 1e-8), seq_max_k2/k3 = max over kept tokens (0 for an empty row). k1: keep iff log(l) <= stat <= log(u)
    ("l_u", or "u" giving l = 1/u); note the bounds apply to pi_rollout / pi_train. k2/k3: keep iff stat <= u.
    Rejected tokens leave every agg_loss denominator (the mask itself is zeroed), unlike TRL's *_mask modes.
    """
    mask = np.asarray(response_mask, dtype=np.float64)
    lr = np.clip(np.asarray(old_log_prob, np.float64) - np.asarray(rollout_log_prob, np.float64), -20.0, 20.0)
    stats = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    specs = [p.strip() for p in threshold.split(",") if p.strip()] if isinstance(threshold, str) else [str(threshold)]
    if len(specs) not in (1, len(options)):
        raise ValueError("rollout_rs_threshold needs one threshold or one per option")
    specs = specs * len(options) if len(specs) == 1 else specs
    combined = np.ones_like(mask)
    for option, spec in zip(options, specs):
        kind = option[-2:]
        if kind == "k1":
            lower_s, upper_s = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
            lower_log, upper_log = np.log(float(lower_s)), np.log(float(upper_s))
        elif "_" in spec:
            raise ValueError(f"rollout_rs_threshold for {option} takes a single upper bound")
        tok = stats[kind]
        if option.startswith("token_"):
            stat = tok
        elif option.startswith("seq_sum_"):
            stat = _verl_masked_sum(tok, mask, -1, True)
        elif option.startswith("seq_mean_"):
            stat = _verl_masked_mean(tok, mask, -1, True)
        elif option in ("seq_max_k2", "seq_max_k3"):
            stat = np.max(np.where(mask != 0, tok, -np.inf), axis=-1, keepdims=True)
            stat = np.where(stat == -np.inf, 0.0, stat)
        else:
            raise ValueError(f"Invalid rollout_rs option: {option}")
        keep = (stat >= lower_log) & (stat <= upper_log) if kind == "k1" else stat <= float(spec)
        combined = combined * np.broadcast_to(keep, mask.shape)
    return mask * combined


def _verl_gspo_ratio(log_prob, old_log_prob, response_mask):
    # seq = masked mean of log_prob - old_log_prob (seq_lengths clamped to >= 1), clamped at max=10, exponentiated.
    mask = np.asarray(response_mask, dtype=np.float64)
    negative_approx_kl = np.asarray(log_prob, np.float64) - np.asarray(old_log_prob, np.float64)
    seq = ((negative_approx_kl * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    return mask, seq, np.broadcast_to(np.exp(np.minimum(seq, 10.0)), mask.shape)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_gspo (registered "gspo"): pg_losses before agg_loss, rollout_is_weights=None.
def verl_gspo_token_loss(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high):
    """Per-token GSPO loss matrix [B, T] of verl: max(-A * s, -A * clamp(s, 1 - clip_low, 1 + clip_high)).

    s = exp(min(sg(seq) + log_prob - sg(log_prob), 10)), seq = sum_t (log_prob - old) * mask / clamp(sum_t mask,
    min=1) per row: one value per row (upper clamp at 10 only, no lower clamp), no dual clip. advantages (B, T).
    verl aggregates it with agg_loss "seq-mean-token-mean" whatever loss_agg_mode says.
    """
    _, _, ratio = _verl_gspo_ratio(log_prob, old_log_prob, response_mask)
    a = np.asarray(advantages, dtype=np.float64)
    return np.maximum(-a * ratio, -a * np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))


# Same source as verl_gspo_token_loss; autograd's gradient (seq detached, torch.clamp(max=10) passing at <= 10).
def verl_gspo_token_loss_grad(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high):
    """d sum(verl_gspo_token_loss * mask) / d log_prob = mask * -A * s * keep * [seq <= 10], keep as in TRL's grad."""
    mask, seq, ratio = _verl_gspo_ratio(log_prob, old_log_prob, response_mask)
    a = np.asarray(advantages, dtype=np.float64)
    clipped = ((a > 0) & (ratio > 1.0 + clip_high)) | ((a < 0) & (ratio < 1.0 - clip_low))
    return mask * -a * ratio * ~clipped * (seq <= 10.0)


# Same source as verl_gspo_token_loss: the "actor/pg_clipfrac" metric ("actor/pg_clipfrac_lower" is always 0.0).
def verl_gspo_clipfrac(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high):
    """masked_mean(pg_losses2 > pg_losses1, mask) with + 1e-8: strict, both sides, per token over the mask."""
    mask, _, ratio = _verl_gspo_ratio(log_prob, old_log_prob, response_mask)
    a = np.asarray(advantages, dtype=np.float64)
    return np.float64(_verl_masked_mean(-a * np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) > -a * ratio, mask))


def _verl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp):
    lsm = _log_softmax(student_logits)
    lq_raw = np.take_along_axis(lsm, np.asarray(teacher_topk_ids), axis=-1)
    lp = np.asarray(teacher_topk_log_probs, dtype=np.float64)
    if log_prob_min_clamp is None:
        return lsm, lq_raw, lq_raw, lp
    return lsm, lq_raw, np.maximum(lq_raw, log_prob_min_clamp), np.maximum(lp, log_prob_min_clamp)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/distillation/fsdp/losses.py,
# compute_forward_kl_topk and kl_divergence (no sequence parallelism, use_chunked_topk off), then
# verl/trainer/distillation/losses.py, compute_forward_kl_topk (clamp_min(0)) and distillation_loss (loss_max_clamp).
def verl_forward_kl_topk(
    student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp=-10.0, loss_max_clamp=10.0
):
    """[B, T] per-token distillation loss of verl's "forward_kl_topk" as passed to agg_loss (defaults = config's).

    There is NO tail bin and no renormalization: sum_k p_k * (log p_k - log q_k) over the teacher's K ids, with
    log q = log_softmax(student_logits) gathered at those ids, both log-prob sets clamp_min(log_prob_min_clamp)
    (p = exp of the clamped teacher value), then clamp_min(0) (top-k sums can go negative), then clamp to
    [-loss_max_clamp, loss_max_clamp]. verl computes kl_divergence in float32.
    """
    _, _, lq, lp = _verl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp)
    loss = np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0)
    return loss if loss_max_clamp is None else np.clip(loss, -loss_max_clamp, loss_max_clamp)


# Same source as verl_forward_kl_topk; autograd's gradient w.r.t. the student logits (torch.clamp/clamp_min pass the
# gradient at their bounds).
def verl_forward_kl_topk_grad(
    student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp=-10.0, loss_max_clamp=10.0
):
    """d sum(verl_forward_kl_topk) / d student_logits, [B, T, V].

    g_k = -p_k * [log q_k >= log_prob_min_clamp] * [raw >= 0] * [|clamped| <= loss_max_clamp]; d/dz_j = sum_k g_k *
    ([j == id_k] - softmax_j) (repeated ids add up).
    """
    lsm, lq_raw, lq, lp = _verl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp)
    raw = (np.exp(lp) * (lp - lq)).sum(-1, keepdims=True)
    ok = raw >= 0.0
    if loss_max_clamp is not None:
        ok = ok & (np.maximum(raw, 0.0) <= loss_max_clamp)
    g = -np.exp(lp) * ok * (True if log_prob_min_clamp is None else lq_raw >= log_prob_min_clamp)
    onehot = np.asarray(teacher_topk_ids)[..., None] == np.arange(lsm.shape[-1])
    return (g[..., None] * onehot).sum(-2) - np.exp(lsm) * g.sum(-1, keepdims=True)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_reinforce_plus_plus_outcome_advantage, the returns loop (masked_whiten of the advantages left out).
def verl_discounted_returns(token_level_rewards, response_mask, gamma):
    """REINFORCE++ returns [B, T]: G_t = (r_t + gamma * G_next) * mask_t, computed right to left.

    On a masked token (mask 0, e.g. a tool observation) the running return is carried through unchanged (no
    discount, its reward dropped) and the stored return is 0. No bootstrap: the running return starts at 0.
    """
    rewards = np.asarray(token_level_rewards, dtype=np.float64)
    mask = np.asarray(response_mask, dtype=np.float64)
    returns = np.zeros_like(rewards)
    running_return = np.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        new_running_return = rewards[:, t] + gamma * running_return
        returns[:, t] = new_running_return * mask[:, t]
        running_return = new_running_return * mask[:, t] + running_return * (1 - mask[:, t])
    return returns


# --------------------------------------------------------------------------------------------------------------
# Where TRL and verl disagree (at the commits above)
# --------------------------------------------------------------------------------------------------------------
# - Rollout/vLLM IS ratio: TRL exponentiates with no clamp (sequence sum may overflow to inf); verl clamps the log
#   ratio (token, or the sequence sum) to [-20, 20]. Both use a sequence SUM (product of ratios) there.
# - Bounds: TRL *_truncate clamps to [clip_min, clip_max] (lower optional, default max 3.0); verl TIS has an upper
#   bound only (default 2.0). Mask modes (TRL *_mask, verl IcePop "l_u") both keep l <= w <= u inclusive.
# - Padding: TRL token-mode weights are 1 on padding, verl's are 0 (harmless: both losses multiply by the mask).
# - Rejection and denominators: TRL *_mask and verl IcePop zero the weight but keep the token in the denominator;
#   verl rollout_rs zeroes response_mask, so its rejected tokens leave the denominator. TRL's off-policy mask
#   (advantage-gated, mean KL of sampling vs current logps) has no verl counterpart; verl's seq_mean_k1 is ungated.
# - GSPO: both use a masked MEAN with clamp(len, min=1); verl clamps the log ratio at max=10 (gradient 0 beyond),
#   TRL does not. verl always aggregates "seq-mean-token-mean" (empty rows dropped); TRL uses loss_type ("grpo":
#   empty rows count 0 in the mean). TRL's main trainer has only "sequence" (gradient spread over the row's tokens);
#   "sequence_token" (= verl's form, per-token gradient) lives in trl/experimental/gspo_token.
# - Clip metrics: TRL logs low/high/region separately with sign-of-A tests on the ratio (sequence level: averaged
#   over all B rows); verl's GSPO logs only pg_clipfrac = masked_mean(pg_losses2 > pg_losses1), lower = 0.
# - Top-k distillation: TRL (IW-OPD, loss_top_k/loss_add_tail) adds a tail bin or renormalizes, no clamps; verl's
#   forward_kl_topk has neither, clamps log-probs at -10, the loss at >= 0 and at 10.
