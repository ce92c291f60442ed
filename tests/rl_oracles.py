"""NumPy float64 transcriptions of peer libraries' RL fine-tuning loss code, used only as test oracles.

Each function below is a line-by-line transcription of a named function in verl (verl-project/verl, formerly
volcengine/verl), TRL (huggingface/trl) or Liger-Kernel (linkedin/Liger-Kernel), read at the commit cited above it;
it is never written from this package's code, so that a test comparing the two checks the package against what the
peers really compute (including their clamps, epsilons and treatment of empty sequences). Torch operations are
replaced by their NumPy equivalents, `.detach()` only shows up in the separate `*_grad` functions, and anything that
only matters for distributed runs (dp_size, gradient accumulation normalizers, vLLM importance weights) is left at
its single-process value.
"""

import numpy as np

# --------------------------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------------------------
# Source read: verl-project/verl (the renamed volcengine/verl), commit 1dda039b9c6311889a9c9a26040677e1254814f9
# (2026-08-22, verl/version/version = 0.10.0.dev), file verl/trainer/ppo/core_algos.py, and
# verl/utils/torch_functional.py for masked_sum.

_VERL_KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _verl_base_kind(kind):
    # kl_penalty strips one trailing "+" before dispatching to kl_penalty_forward (fix of PR #6058, April 2026).
    # Before that fix (e.g. volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7, 0.8.0.dev) the "+" name was
    # passed through unchanged and every "+" estimator raised NotImplementedError.
    base = kind[:-1] if kind.endswith("+") else kind
    if base == "full":
        raise NotImplementedError("verl raises NotImplementedError for kl_penalty='full'")
    if base not in _VERL_KL_KINDS:
        raise NotImplementedError(f"verl has no kl_penalty {kind!r}")
    return base


def _verl_masked_sum(values, mask):
    # verl.utils.torch_functional.masked_sum: torch.where(mask.bool(), values, 0.0) * mask, summed; NaN or inf
    # outside the mask is dropped (unlike a plain values * mask).
    values = np.asarray(values, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    return np.sum(np.where(mask != 0, values, 0.0) * mask)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# kl_penalty (straight-through wrapper) and kl_penalty_forward (the estimators).
def verl_kl_penalty(logprob, ref_logprob, kind):
    """Per-token value of verl's `kl_penalty(logprob, ref_logprob, kind)`.

    With d = logprob - ref_logprob: "kl"/"k1" = d, "abs" = |d|, "mse"/"k2" = d**2 / 2, and "low_var_kl"/"k3" =
    clamp(exp(k) - k - 1, -10, 10) with k = clamp(-d, -20, 20). A "+" suffix ("k1+", "k3+", ...) keeps the value
    of the named estimator exactly (b - b.detach() + f.detach() is f in value) and only changes the gradient.
    """
    base = _verl_base_kind(kind)
    logprob = np.asarray(logprob, dtype=np.float64)
    ref_logprob = np.asarray(ref_logprob, dtype=np.float64)
    if base in ("kl", "k1"):
        return logprob - ref_logprob
    if base == "abs":
        return np.abs(logprob - ref_logprob)
    if base in ("mse", "k2"):
        return 0.5 * np.square(logprob - ref_logprob)
    # "low_var_kl" / "k3" (Schulman, Approximating KL divergence, 2020)
    kl = np.clip(ref_logprob - logprob, -20.0, 20.0)
    kld = np.exp(kl) - kl - 1.0
    return np.clip(kld, -10.0, 10.0)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# kl_penalty / kl_penalty_forward; the derivative torch autograd gives for that code.
def verl_kl_penalty_grad(logprob, ref_logprob, kind):
    """d verl_kl_penalty / d logprob, per token, as torch autograd computes it for verl's code.

    "+" forms (other than "k2+"/"mse+", which are k2 anyway): the straight-through term 0.5 * d**2 gives d.
    "abs": sign(d), 0 at d == 0 (torch.abs backward). "k3": (1 - exp(k)) * [-20 <= k <= 20] * [-10 <= kld <= 10]
    with k = ref_logprob - logprob, i.e. zero where either torch.clamp is active (torch.clamp passes the gradient at
    the bounds themselves). ref_logprob gets no gradient in verl (it is a stored tensor); not returned here.
    """
    base = _verl_base_kind(kind)
    logprob = np.asarray(logprob, dtype=np.float64)
    ref_logprob = np.asarray(ref_logprob, dtype=np.float64)
    d = logprob - ref_logprob
    if kind.endswith("+") and kind not in ("mse", "k2"):
        # backward_score = 0.5 * (logprob - ref_logprob).square(); forward_score is detached.
        return d
    if base in ("kl", "k1"):
        return np.ones_like(d)
    if base == "abs":
        return np.sign(d)
    if base in ("mse", "k2"):
        return d
    raw_kl = ref_logprob - logprob
    inner_ok = (raw_kl >= -20.0) & (raw_kl <= 20.0)
    kl = np.clip(raw_kl, -20.0, 20.0)
    kld = np.exp(kl) - kl - 1.0
    outer_ok = (kld >= -10.0) & (kld <= 10.0)
    # d kld / d kl = exp(kl) - 1, d kl / d logprob = -1.
    return (1.0 - np.exp(kl)) * inner_ok * outer_ok


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py, agg_loss
# (single process: dp_size=1, batch_num_tokens=None, global_batch_size=None).
def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """verl's `agg_loss(loss_mat, loss_mask, loss_agg_mode)` on one rank.

    Empty sequences (no kept token), at this commit:
      - "token-mean": masked_sum / loss_mask.sum(); empty rows simply add nothing. An all-empty batch gives 0/0 = NaN.
      - "token-sum": masked_sum (added in v0.9.0).
      - "seq-mean-token-sum": per-row sum(loss_mat * mask), then the mean over the rows with at least one kept token
        only (seq_mask = row count > 0); empty rows are NOT in the denominator. All-empty batch: 0/0 = NaN.
      - "seq-mean-token-sum-norm": the "seq-mean-token-sum" value divided by loss_scale_factor, which defaults to
        loss_mask.shape[-1] (the padded horizon, not the max or actual length). Empty rows again not counted.
      - "seq-mean-token-mean": per-row sum(loss_mat * mask) / (row count + 1e-8), then the mean over the non-empty
        rows only: empty rows are excluded from the numerator AND the denominator. All-empty batch: 0/0 = NaN.
    The + 1e-8 is transcribed literally; in verl's usual float32 it vanishes for counts >= 1, in float64 it makes a
    relative difference of about 1e-8 / count, so compare with rtol >= 1e-7.

    History worth knowing: up to v0.6.0 both seq-mean modes were torch.mean over ALL rows (an empty row gave 0/0 =
    NaN in seq-mean-token-mean and counted as 0 in the denominator of seq-mean-token-sum); the exclusion of empty
    rows came with commit 4424616d7 (v0.6.1). Before v0.7.1 (commit b8d91ef8d), "seq-mean-token-sum-norm" was
    sum over all rows / loss_mask.shape[-1], with no division by the number of sequences.
    """
    loss_mat = np.asarray(loss_mat, dtype=np.float64)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        if mode == "token-mean":
            return np.float64(_verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum())
        if mode == "token-sum":
            return np.float64(_verl_masked_sum(loss_mat, loss_mask))
        if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            seq_losses = np.sum(loss_mat * loss_mask, axis=-1)  # token-sum
            seq_mask = (np.sum(loss_mask, axis=-1) > 0).astype(np.float64)  # exclude fully masked sequences
            loss = _verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()  # seq-mean
            if mode == "seq-mean-token-sum-norm":
                if loss_scale_factor is None:
                    loss_scale_factor = loss_mask.shape[-1]
                loss = loss / loss_scale_factor
            return np.float64(loss)
        if mode == "seq-mean-token-mean":
            seq_count = np.sum(loss_mask, axis=-1)  # per-sequence token count
            seq_losses = np.sum(loss_mat * loss_mask, axis=-1) / (seq_count + 1e-8)  # token-mean
            seq_mask = (seq_count > 0).astype(np.float64)  # exclude fully masked sequences
            return np.float64(_verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum())  # seq-mean
    raise ValueError(f"Invalid loss_agg_mode: {mode}")


def _verl_ratio(log_prob, old_log_prob):
    # negative_approx_kl = log_prob - old_log_prob, clamped to [-20, 20] "for stability", then exponentiated.
    negative_approx_kl = np.clip(
        np.asarray(log_prob, dtype=np.float64) - np.asarray(old_log_prob, dtype=np.float64), -20.0, 20.0
    )
    return np.exp(negative_approx_kl)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_vanilla (registered as "vanilla"): pg_losses before agg_loss, rollout_is_weights=None.
def verl_ppo_token_loss(log_prob, old_log_prob, advantages, clip_low, clip_high, clip_c=None):
    """Per-token PPO loss matrix of verl (to be minimised; before aggregation and masking).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20));
    l = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)), and for A < 0 the dual clip
    min(l, -A * clip_c). verl always applies the dual clip, with clip_ratio_c = 3.0 by default (it asserts
    clip_c > 1); clip_c=None here means no dual clip (as clip_c -> inf), which verl itself cannot express.
    advantages must broadcast against log_prob (verl passes a full (batch, response_length) matrix).
    """
    advantages = np.asarray(advantages, dtype=np.float64)
    ratio = _verl_ratio(log_prob, old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_pg_losses1 = np.maximum(pg_losses1, pg_losses2)
    if clip_c is None:
        return clip_pg_losses1
    if not clip_c > 1.0:
        raise ValueError(f"verl asserts clip_ratio_c > 1.0, got {clip_c}")
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = np.minimum(pg_losses3, clip_pg_losses1)
    return np.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_cispo (registered as "cispo"): pg_losses before agg_loss, rollout_is_weights=None.
def verl_cispo_token_loss(log_prob, old_log_prob, advantages, clip_low, clip_high):
    """Per-token CISPO loss of verl: -sg(clamp(ratio, 1 - clip_low, 1 + clip_high)) * A * log_prob.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)) as in the PPO loss. Note the bounds are 1 -/+ eps here,
    whereas TRL's "cispo" clamps the ratio at epsilon_high itself with no lower bound.
    """
    log_prob = np.asarray(log_prob, dtype=np.float64)
    clipped_ratio = np.clip(_verl_ratio(log_prob, old_log_prob), 1.0 - clip_low, 1.0 + clip_high)
    return -clipped_ratio * np.asarray(advantages, dtype=np.float64) * log_prob


# Same source as verl_cispo_token_loss; the gradient autograd gives (clipped_ratio is .detach()ed).
def verl_cispo_token_loss_grad(log_prob, old_log_prob, advantages, clip_low, clip_high):
    """d verl_cispo_token_loss / d log_prob, per token: -clamp(ratio, 1 - clip_low, 1 + clip_high) * A."""
    clipped_ratio = np.clip(_verl_ratio(log_prob, old_log_prob), 1.0 - clip_low, 1.0 + clip_high)
    return -clipped_ratio * np.asarray(advantages, dtype=np.float64) * np.ones_like(clipped_ratio)


# --------------------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------------------
# Source read: huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24, VERSION 1.10.0.dev0),
# files trl/trainer/grpo_trainer.py and trl/trainer/utils.py.


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer._compute_loss, the per_token_kl expression.
def trl_per_token_kl(logp, ref_logp):
    """TRL's per-token KL: exp(ref - logp) - (ref - logp) - 1, with no clamp.

    With d = logp - ref this is exp(-d) + d - 1, verl's "k3"/"low_var_kl" before verl's clamps.
    """
    logp = np.asarray(logp, dtype=np.float64)
    ref_logp = np.asarray(ref_logp, dtype=np.float64)
    return np.exp(ref_logp - logp) - (ref_logp - logp) - 1.0


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer._compute_loss (importance_sampling_level="token", delta=None, no entropy / off-policy mask, no vLLM
# importance sampling, use_bias_correction_kl=False, one process, the returned policy loss before the gradient
# accumulation normalizer).
def trl_grpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    beta,
    eps_low,
    eps_high,
    loss_type,
    max_completion_length=None,
    num_items_in_batch=None,
):
    """Scalar GRPO loss of TRL (to be minimised).

    coef_1 = exp(logp - old_logp) (no clamp; old_logp=None means old = logp, TRL's detach shortcut, so coef_1 = 1),
    coef_2 = clamp(coef_1, 1 - eps_low, 1 + eps_high), per_token_loss = -min(coef_1 * A, coef_2 * A)
    (+ beta * trl_per_token_kl when beta != 0). For loss_type "cispo": -clamp(coef_1, max=eps_high) * A * logp, with
    eps_high the ratio cap itself (TRL's epsilon_high, e.g. 5.0), not 1 + eps_high. advantages is (B,) (one per
    sequence, broadcast over tokens) or (B, T). Aggregations, M = mask:
      - "grpo": mean over ALL B rows of sum(l * M, -1) / clamp(sum(M, -1), min=1); an empty row counts as 0 in the
        numerator and 1 in the denominator (unlike verl's seq-mean-token-mean, which drops it).
      - "bnpo": sum(l * M) / clamp(sum(M), min=1); all-empty batch gives 0.
      - "dr_grpo": sum(l * M) / (B * max_completion_length) (the configured max, not T).
      - "dapo" and "cispo": sum(l * M) / clamp(num_items_in_batch, min=1), num_items_in_batch being the kept-token
        count of the whole generation batch (gathered over processes, then divided by num_processes); it defaults
        to sum(M) here, which is the single-process, single-micro-batch case.
    """
    logp = np.asarray(logp, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    advantages = np.asarray(advantages, dtype=np.float64)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    old_logp = logp if old_logp is None else np.asarray(old_logp, dtype=np.float64)
    coef_1 = np.exp(logp - old_logp)
    if loss_type == "cispo":
        clamped_ratios = np.minimum(coef_1, eps_high)
        per_token_loss = -clamped_ratios * advantages * logp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        coef_2 = np.clip(coef_1, 1.0 - eps_low, 1.0 + eps_high)
        per_token_loss = -np.minimum(coef_1 * advantages, coef_2 * advantages)
    else:
        raise ValueError(f"Unknown loss type: {loss_type}")
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * trl_per_token_kl(logp, ref_logp)
    if loss_type == "grpo":
        return np.float64(((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean())
    if loss_type == "bnpo":
        return np.float64((per_token_loss * mask).sum() / max(mask.sum(), 1.0))
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo divides by batch size * max_completion_length; pass max_completion_length")
        return np.float64((per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length))
    # "dapo" and "cispo"
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    return np.float64((per_token_loss * mask).sum() / max(float(num_items_in_batch), 1.0))


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/utils.py, selective_log_softmax
# (its float32/float64 branch: gathered logit minus logsumexp over the last axis).
def trl_selective_log_softmax(logits, labels):
    """log_softmax(logits)[..., labels]: labels of shape (...) give (...), labels of shape (..., K) give (..., K)."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels)
    squeeze = labels.ndim == logits.ndim - 1
    if squeeze:
        labels = labels[..., None]
    selected_logits = np.take_along_axis(logits, labels, axis=-1)
    top = np.max(logits, axis=-1, keepdims=True)
    logsumexp_values = top + np.log(np.sum(np.exp(logits - top), axis=-1, keepdims=True))
    per_token_logps = selected_logits - logsumexp_values
    if squeeze:
        per_token_logps = per_token_logps[..., 0]
    return per_token_logps


# --------------------------------------------------------------------------------------------------------------
# Liger-Kernel
# --------------------------------------------------------------------------------------------------------------


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c (2026-08-21, pyproject version 0.8.2; the test file
# last changed in e07abecd612d45cdbb0a2c811595fb84ead910f3), test/chunked_loss/test_grpo_loss.py,
# TorchLMHeadGRPO.forward (the dense reference for LigerFusedLinearGRPOLoss), first four statements.
def liger_token_logprobs(hidden, weight, bias, labels, temperature=1.0, log_softmax_dtype=np.float64):
    """Chosen-token log-probabilities of Liger's dense GRPO reference.

    logits = hidden @ weight.T (+ bias), weight shaped [V, H] like torch.nn.Linear(H, V).weight; divided by
    temperature when temperature != 1.0; log_softmax over V; gather at labels. Liger runs the matmul in the model
    dtype and the log_softmax in float32 (`logits.float()`); here the matmul is float64 and the log_softmax runs in
    log_softmax_dtype (pass np.float32 to mimic Liger's cast). Returns float64 of labels' shape.
    """
    logits = np.asarray(hidden, dtype=np.float64) @ np.asarray(weight, dtype=np.float64).T
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.astype(log_softmax_dtype)
    top = np.max(logits, axis=-1, keepdims=True)
    log_probs = logits - top - np.log(np.sum(np.exp(logits - top), axis=-1, keepdims=True))
    labels = np.asarray(labels)
    return np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0].astype(np.float64)
