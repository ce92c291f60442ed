"""NumPy float64 transcriptions of peer libraries' policy-loss variants (SAPO, GMPO, VESPO, LUSPO, Dr. GRPO, DPPO, the
high-entropy token mask and log sum p^2), used only as test oracles.

Same rules as tests/rl_oracles.py and tests/off_policy_oracles.py: each function is a line-by-line transcription of a
named function in TRL (huggingface/trl) or verl (verl-project/verl, formerly volcengine/verl), read at the commit or
release cited above it, never written from this package's code. Torch operations are replaced by their NumPy
equivalents; `.detach()` only shows up in the separate `*_grad` functions, which give by hand, in closed form, what
torch autograd gives for the peer's code, w.r.t. the policy's per-token log-probabilities (`logp` in TRL's naming,
`log_prob` in verl's). Anything that only matters for distributed runs (process counts, gradient accumulation
normalizers, all-gathers, dp_size) is left at its single-process value, and the KL term is left out (beta = 0).
Per-token inputs are [B, T] arrays, masks [B, T] arrays of 0/1; TRL takes advantages (B,) (or (B, T)), verl (B, T).
"""

import math

import numpy as np

# --------------------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------------------
# Sources read:
# - huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24, VERSION 1.10.0.dev0), files
#   trl/trainer/grpo_trainer.py, trl/trainer/grpo_config.py, trl/trainer/dpo_trainer.py,
#   trl/experimental/gmpo/gmpo_trainer.py and trl/experimental/gmpo/gmpo_config.py (read with git show).
# - trl 1.16.0, the PyPI wheel trl-1.16.0-py3-none-any.whl (sha256 c4726e13...0396, files dated 2026-10-15, so later
#   than f2cd577), files trl/trainer/grpo_trainer.py, trl/trainer/grpo_config.py and trl/kernels/chunked_logprob.py.
#   Between the two, the parts used here differ only in the "luspo" aggregation and the "vespo"/"dapo"/"cispo"
#   normalizer's gradient-accumulation rescale (a no-op on one process with steps_per_generation = accumulation).


def _trl_advantages(advantages):
    # _compute_loss: "if advantages.dim() == 1: advantages = advantages.unsqueeze(1)"; (B, T) passes unchanged.
    advantages = np.asarray(advantages, dtype=np.float64)
    return advantages[:, None] if advantages.ndim == 1 else advantages


def _sigmoid(x):
    # torch.sigmoid, 1 / (1 + exp(-x)), written so that neither branch overflows.
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _trl_log_importance_weights(logp, old_logp, mask, level):
    # grpo_trainer.py @ f2cd577 lines 3054-3064: token: logp - old; sequence: masked mean over the row with the count
    # clamped to >= 1, kept (B, 1). old_logp=None is TRL's `per_token_logps.detach()` shortcut (equal in value).
    logp = np.asarray(logp, dtype=np.float64)
    old_logp = logp if old_logp is None else np.asarray(old_logp, dtype=np.float64)
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    raise ValueError(f"Unknown importance sampling level: {level}. Possible values are 'token' and 'sequence'.")


def _spread_sequence_grad(g, mask, level):
    # d/d logp_u of a quantity that depends on the row's sequence log-weight s_i (level "sequence"), given the
    # derivatives g (shape (B, 1) or (B, T)) already multiplied by their upstream weights: ds_i / dlogp_u =
    # mask[i, u] / clamp(n_i, min=1). For level "token" the dependence is per token and g is returned as is.
    if level == "token":
        return g
    return mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) * g.sum(-1, keepdims=True)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# lines 3054-3066 (coef_1) and 3092-3095 (loss_type "sapo"); defaults from trl/trainer/grpo_config.py lines 704-719
# (sapo_temperature_neg 1.05, sapo_temperature_pos 1.0; the same in trl 1.16.0 grpo_config.py lines 714-729).
def trl_sapo_per_token_loss(logp, old_logp, advantages, mask, temperature_pos=1.0, temperature_neg=1.05, level="token"):
    """[B, T] SAPO per-token loss of TRL before "* mask" and aggregation: -sigmoid(tau * (coef_1 - 1)) * 4 / tau * A.

    coef_1 = exp(logp - old) per token, or (level "sequence", importance_sampling_level) exp of the row's masked mean
    log ratio (count clamped to >= 1), one value per row. No clamp of the log ratio (exp can overflow to inf; the gate
    is then 4 / tau, finite). tau = temperature_pos where A > 0, else temperature_neg (A == 0 takes the negative
    temperature; its loss is 0 anyway). With (B,) advantages and level "sequence", TRL's loss is (B, 1); it is
    broadcast to (B, T) here. delta and the entropy/off-policy masks are not applied in this branch (the masks
    multiply per_token_loss afterwards, see trl_high_entropy_mask).
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    with np.errstate(over="ignore"):
        coef_1 = np.exp(_trl_log_importance_weights(logp, old_logp, mask, level))
    temperatures = np.where(advantages > 0, temperature_pos, temperature_neg)
    soft_coef_1 = _sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    per_token_loss = -soft_coef_1 * advantages
    return np.broadcast_to(per_token_loss, mask.shape).copy()


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# lines 3124-3128 (loss_type in ["grpo", "sapo"]): the returned loss before the gradient accumulation normalizer.
def trl_sapo_loss(logp, old_logp, advantages, mask, temperature_pos=1.0, temperature_neg=1.05, level="token"):
    """Scalar SAPO loss of TRL (single process, beta = 0, no vLLM importance sampling, no entropy/off-policy mask).

    mean over ALL B rows of sum_t(l * mask) / clamp(sum_t mask, min=1): an empty row counts 0 in the numerator and
    is still one of the B rows of the mean.
    """
    mask = np.asarray(mask, dtype=np.float64)
    per_token_loss = trl_sapo_per_token_loss(logp, old_logp, advantages, mask, temperature_pos, temperature_neg, level)
    return np.float64(((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean())


# Same source as trl_sapo_per_token_loss; the gradient torch autograd gives (old_logp a constant).
def trl_sapo_per_token_loss_grad(
    logp, old_logp, advantages, mask, temperature_pos=1.0, temperature_neg=1.05, level="token"
):
    """d sum(trl_sapo_per_token_loss * mask) / d logp, [B, T].

    With sigma = sigmoid(tau * (coef_1 - 1)): g = -4 * A * sigma * (1 - sigma) * coef_1 (the tau cancels). token:
    g * mask. sequence: mask[i, u] / clamp(n_i, min=1) * sum_t mask[i, t] * g[i, t]. An overflowed coef_1 = inf gives
    0 * inf = NaN, as in torch. (For trl_sapo_loss divide row i by clamp(n_i, min=1) and by B.)
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    with np.errstate(over="ignore"):
        coef_1 = np.exp(_trl_log_importance_weights(logp, old_logp, mask, level))
    temperatures = np.where(advantages > 0, temperature_pos, temperature_neg)
    sigma = _sigmoid(temperatures * (coef_1 - 1))
    with np.errstate(invalid="ignore"):
        g = np.broadcast_to(-4.0 * advantages * sigma * (1.0 - sigma) * coef_1, mask.shape) * mask
    return _spread_sequence_grad(g, mask, level)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer.get_gamma_weights, lines 2941-2989 (a @staticmethod under @torch.no_grad(): the result carries no
# gradient). Identical in trl 1.16.0 (lines 2970-3018). Defaults: grpo_config.py @ f2cd577 lines 720-749 and
# trl 1.16.0 grpo_config.py lines 195-207 (docstring) / 730-759 (fields): k_pos 2.0, lambda_pos 3.0, k_neg 3.0,
# lambda_neg 2.0.
def trl_vespo_gamma_weights(
    advantages,
    log_ratio_per_token,
    mask,
    importance_sampling_ratio=None,
    k_pos=2.0,
    lambda_pos=3.0,
    k_neg=3.0,
    lambda_neg=2.0,
):
    """VESPO's sequence weight phi(w) = exp(lambda + k * log w - lambda * w), (B, 1) for (B,) advantages.

    log w = clamp(sum_t clamp(log_ratio, -20, 20) * mask [+ sum_t clamp(log(is_ratio), log(1e-8), 20)], log(1e-8),
    20): a SUM over the row (a product of ratios, not TRL's GSPO mean). log_ratio_per_token = logp - old_logp, not
    clamped before. importance_sampling_ratio is the [B, T] vLLM weight (TRL allows only the token_* modes with VESPO);
    its logs are summed over ALL T positions, unmasked (padding has weight 1 there, so log 0; a token_mask-rejected
    token has weight 0, log -inf, clamped to log(1e-8)). k, lambda: the *_pos values where A >= 0 (zero included),
    else *_neg; lambda is clamped to >= 1e-4. NaN and +-inf in phi become 0 (nan_to_num(nan=0, posinf=0, neginf=0)).
    With (B, T) advantages phi is (B, T). TRL builds k and lambda with torch.where on Python floats (float32).
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = np.clip(np.asarray(log_ratio_per_token, dtype=np.float64), -20.0, 20.0)
    seq_log_ratio = np.sum(log_ratio_clamped * mask, axis=-1, keepdims=True)
    if importance_sampling_ratio is not None:
        with np.errstate(divide="ignore"):
            log_is_ratio = np.clip(np.log(np.asarray(importance_sampling_ratio, np.float64)), lower_clamp, 20.0)
        seq_log_ratio = seq_log_ratio + np.sum(log_is_ratio, axis=-1, keepdims=True)
    log_w_seq = np.clip(seq_log_ratio, lower_clamp, 20.0)
    w_seq = np.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = np.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = np.maximum(np.where(is_nonneg_adv, lambda_pos, lambda_neg), 1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    with np.errstate(over="ignore"):
        return np.nan_to_num(np.exp(log_phi), nan=0.0, posinf=0.0, neginf=0.0)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# lines 3054 (log_ratio), 3096-3107 (loss_type "vespo"); the same in trl 1.16.0 (lines 3125-3136).
def trl_vespo_per_token_loss(
    logp,
    old_logp,
    advantages,
    mask,
    importance_sampling_ratio=None,
    k_pos=2.0,
    lambda_pos=3.0,
    k_neg=3.0,
    lambda_neg=2.0,
):
    """[B, T] VESPO per-token loss of TRL before "* mask": -phi_seq * A * logp (phi from trl_vespo_gamma_weights).

    The ratio enters through phi only (log_ratio = logp - old, whatever importance_sampling_level says; TRL warns
    unless it is "token"). importance_sampling_ratio goes into phi; TRL does NOT also multiply the loss by it for
    "vespo" (line 3117, `self.loss_type != "vespo"`). old_logp=None means old = logp (phi = exp(lambda - lambda)).
    """
    logp = np.asarray(logp, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    old = logp if old_logp is None else np.asarray(old_logp, dtype=np.float64)
    phi_seq = trl_vespo_gamma_weights(
        advantages, logp - old, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg
    )
    return -phi_seq * _trl_advantages(advantages) * logp


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# lines 3139-3142 (loss_type in ["cispo", "dapo", "vespo"]); trl 1.16.0 lines 3168-3174 add, in train mode, a factor
# current_gradient_accumulation_steps / steps_per_generation to the normalizer (1 when they are equal, the default).
def trl_vespo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    importance_sampling_ratio=None,
    num_items_in_batch=None,
    k_pos=2.0,
    lambda_pos=3.0,
    k_neg=3.0,
    lambda_neg=2.0,
):
    """Scalar VESPO loss of TRL: sum(l * mask) / clamp(num_items_in_batch, min=1) (one process).

    num_items_in_batch is the kept-token count of the whole generation batch; it defaults to sum(mask) here (one
    micro-batch per generation batch). An all-empty batch gives 0.
    """
    mask = np.asarray(mask, dtype=np.float64)
    per_token_loss = trl_vespo_per_token_loss(
        logp, old_logp, advantages, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg
    )
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    return np.float64((per_token_loss * mask).sum() / max(float(num_items_in_batch), 1.0))


# Same source as trl_vespo_per_token_loss; autograd's gradient (get_gamma_weights runs under torch.no_grad()).
def trl_vespo_per_token_loss_grad(
    logp,
    old_logp,
    advantages,
    mask,
    importance_sampling_ratio=None,
    k_pos=2.0,
    lambda_pos=3.0,
    k_neg=3.0,
    lambda_neg=2.0,
):
    """d sum(trl_vespo_per_token_loss * mask) / d logp = -phi_seq * A * mask (phi detached), [B, T]."""
    logp = np.asarray(logp, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    old = logp if old_logp is None else np.asarray(old_logp, dtype=np.float64)
    phi_seq = trl_vespo_gamma_weights(
        advantages, logp - old, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg
    )
    return np.broadcast_to(-phi_seq * _trl_advantages(advantages), mask.shape) * mask


def _trl_clipped_coefs(logp, old_logp, advantages, mask, epsilon, epsilon_high, level, delta):
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    with np.errstate(over="ignore"):
        coef_1 = np.exp(_trl_log_importance_weights(logp, old_logp, mask, level))
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    coef_1_used = coef_1 if delta is None else np.minimum(coef_1, delta)
    return coef_1, coef_2, coef_1_used, eps_low, eps_high


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# lines 3054-3066 (coef_1) and 3083-3091 (loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]); the same in
# trl 1.16.0 (lines 3112-3120). epsilon 0.2, epsilon_high None (= epsilon), delta None: grpo_config.py lines 683-703.
def trl_luspo_per_token_loss(
    logp, old_logp, advantages, mask, epsilon=0.2, epsilon_high=None, level="token", delta=None
):
    """The clipped per-token loss TRL aggregates for "luspo" (and grpo/bnpo/dr_grpo/dapo), in TRL's OWN shape.

    coef_1 = exp(w) (w as in trl_sapo_per_token_loss: token, or the GSPO sequence mean, no clamp), coef_2 =
    clamp(coef_1, 1 - epsilon, 1 + epsilon_high), then (delta set) coef_1 = clamp(coef_1, max=delta) AFTER coef_2;
    loss = -min(coef_1 * A, coef_2 * A). Shape: (B, 1) for level "sequence" with (B,) advantages, else (B, T); it is
    NOT broadcast, because trl_luspo_loss at f2cd577 averages over whatever shape it gets. TRL's config default level
    is "token" and it warns for "luspo" unless level is "sequence" (grpo_trainer.py lines 891-895).
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    _, coef_2, coef_1, _, _ = _trl_clipped_coefs(logp, old_logp, advantages, mask, epsilon, epsilon_high, level, delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    return -np.minimum(per_token_loss1, per_token_loss2)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, lines 3143-3148, and
# trl 1.16.0 trl/trainer/grpo_trainer.py, lines 3175-3182 (loss_type "luspo"; before the accumulation normalizer).
def trl_luspo_loss(per_token_loss, mask, version="1.16.0"):
    """Scalar LUSPO loss of TRL from trl_luspo_per_token_loss's output ((B, 1) or (B, T)) and the [B, T] mask.

    "1.16.0": (per_token_loss * mask).sum(-1).mean(): each row's masked token sum, averaged over all B rows; a (B, 1)
    loss becomes l_i * n_i. "f2cd577": (per_token_loss * mask.sum(1, keepdim=True)).mean(): the same l_i * n_i mean
    for a (B, 1) loss, but for a (B, T) loss (level "token") it is mean over all B * T entries of l_it * n_i: the
    padding positions are NOT masked (their l_it is counted, weighted by the row length) and the divisor is B * T.
    """
    per_token_loss = np.asarray(per_token_loss, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    if version == "1.16.0":
        return np.float64((per_token_loss * mask).sum(-1).mean())
    if version == "f2cd577":
        return np.float64((per_token_loss * mask.sum(1, keepdims=True)).mean())
    raise ValueError(f"Unknown TRL version for luspo: {version}")


# Same sources as trl_luspo_per_token_loss and trl_luspo_loss; autograd's gradient of the scalar (torch.min splits
# the gradient at ties, torch.clamp passes it at and inside its bounds).
def trl_luspo_loss_grad(
    logp, old_logp, advantages, mask, epsilon=0.2, epsilon_high=None, level="token", delta=None, version="1.16.0"
):
    """d trl_luspo_loss(trl_luspo_per_token_loss(...)) / d logp, [B, T].

    With c = coef_1 (unclamped), a = min(c, delta) * A, b = clamp(c, 1 - eps, 1 + eps_high) * A: da = A * c * [c <=
    delta], db = A * c * [1 - eps <= c <= 1 + eps_high], h = -(da if a < b, db if b < a, (da + db) / 2 if a == b).
    The upstream weight of each loss entry is n_i / B ("1.16.0", (B, 1)), mask / B ("1.16.0", (B, T)), or n_i /
    size(loss) ("f2cd577", padding included); level "sequence" spreads each row's total over its kept tokens as
    mask[i, u] / clamp(n_i, min=1).
    """
    mask = np.asarray(mask, dtype=np.float64)
    advantages = _trl_advantages(advantages)
    c, coef_2, coef_1, eps_low, eps_high = _trl_clipped_coefs(
        logp, old_logp, advantages, mask, epsilon, epsilon_high, level, delta
    )
    a, b = coef_1 * advantages, coef_2 * advantages
    da = advantages * c * (True if delta is None else c <= delta)
    db = advantages * c * ((c >= 1 - eps_low) & (c <= 1 + eps_high))
    h = -np.where(a < b, da, np.where(b < a, db, (da + db) / 2))
    n = mask.sum(-1, keepdims=True)
    batch = mask.shape[0]
    if version == "1.16.0":
        upstream = n / batch if h.shape[-1] == 1 else mask / batch
    elif version == "f2cd577":
        upstream = np.broadcast_to(n, h.shape) / h.size
    else:
        raise ValueError(f"Unknown TRL version for luspo: {version}")
    return np.broadcast_to(_spread_sequence_grad(h * upstream, mask, level), mask.shape).copy()


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss,
# lines 3134-3138 (loss_type "dr_grpo"); the same in trl 1.16.0 (lines 3163-3167).
def trl_dr_grpo_aggregate(per_token_loss, mask, max_completion_length):
    """sum(per_token_loss * mask) / (B * max_completion_length): B = per_token_loss.size(0), max_completion_length
    the configured GRPOConfig.max_completion_length (not T, not the longest row). Empty rows count in B; an all-empty
    batch gives 0. per_token_loss may be (B, 1) (level "sequence"), broadcast against the mask.
    """
    per_token_loss = np.asarray(per_token_loss, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    return np.float64((per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length))


def _trl_gmpo_terms(logp, old_logp, advantages, mask, epsilon, epsilon_high, entropy_mask):
    logp = np.asarray(logp, dtype=np.float64)
    old = logp if old_logp is None else np.asarray(old_logp, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    advantages = np.asarray(advantages, dtype=np.float64)
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logp - old
    clamped_log_ratio = np.clip(log_ratio, -eps_low, eps_high)
    advantages_col = advantages[:, None]
    clipped_log_ratio = np.where(
        advantages_col > 0, np.minimum(log_ratio, clamped_log_ratio), np.maximum(log_ratio, clamped_log_ratio)
    )
    seq_mask = mask * np.asarray(entropy_mask, dtype=np.float64) if entropy_mask is not None else mask
    denom = np.maximum(seq_mask.sum(-1), 1.0)
    log_importance_weights = (clipped_log_ratio * seq_mask).sum(-1) / denom
    with np.errstate(over="ignore"):
        coef = np.exp(log_importance_weights)
    return log_ratio, advantages, advantages_col, seq_mask, denom, coef, eps_low, eps_high


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8 (directory last changed in c1f6f24e1),
# trl/experimental/gmpo/gmpo_trainer.py, GMPOTrainer._compute_loss, lines 82-105 (beta = 0); epsilon default 0.4 from
# trl/experimental/gmpo/gmpo_config.py lines 41-47 (epsilon_high None = epsilon, GRPOTrainer.__init__ line 921).
def trl_gmpo_per_sequence_loss(logp, old_logp, advantages, mask, epsilon=0.4, epsilon_high=None, entropy_mask=None):
    """(B,) GMPO loss of TRL: -exp(mean over kept tokens of the clipped log ratio) * A.

    Clipping in log space: clamped = clamp(logp - old, -epsilon, epsilon_high); where A > 0, min(log_ratio, clamped)
    (upper clip only), else (A <= 0) max(log_ratio, clamped) (lower clip only). The mean divides by clamp(count,
    min=1): an empty row gives exp(0) = 1, loss -A. advantages must be (B,) (TRL unsqueezes them to (B, 1)).
    entropy_mask (trl_high_entropy_mask, when top_entropy_quantile < 1) narrows the tokens of the geometric mean
    (seq_mask = mask * entropy_mask), instead of multiplying a per-token loss as in GRPOTrainer.
    """
    terms = _trl_gmpo_terms(logp, old_logp, advantages, mask, epsilon, epsilon_high, entropy_mask)
    advantages, coef = terms[1], terms[5]
    return -coef * advantages


# Same source, line 120: `loss = per_sequence_loss.mean()` (before the gradient accumulation normalizer).
def trl_gmpo_loss(logp, old_logp, advantages, mask, epsilon=0.4, epsilon_high=None, entropy_mask=None):
    """Scalar GMPO loss of TRL: the plain mean of trl_gmpo_per_sequence_loss over all B rows (empty rows included)."""
    return np.float64(
        trl_gmpo_per_sequence_loss(logp, old_logp, advantages, mask, epsilon, epsilon_high, entropy_mask).mean()
    )


# Same source as trl_gmpo_loss; autograd's gradient (torch.minimum/maximum split at ties, clamp passes inside).
def trl_gmpo_loss_grad(logp, old_logp, advantages, mask, epsilon=0.4, epsilon_high=None, entropy_mask=None):
    """d trl_gmpo_loss / d logp, [B, T]: -A_i * coef_i * seq_mask[i, u] * k[i, u] / clamp(n_i, min=1) / B.

    k = [log_ratio <= epsilon_high] where A > 0, [log_ratio >= -epsilon] where A <= 0 (1 where the unclipped log
    ratio is used, 0 where the clamp bound replaces it); n_i = sum_t seq_mask[i, t].
    """
    log_ratio, advantages, advantages_col, seq_mask, denom, coef, eps_low, eps_high = _trl_gmpo_terms(
        logp, old_logp, advantages, mask, epsilon, epsilon_high, entropy_mask
    )
    k = np.where(advantages_col > 0, log_ratio <= eps_high, log_ratio >= -eps_low)
    return (-advantages * coef / denom)[:, None] * seq_mask * k / seq_mask.shape[0]


def _torch_quantile_linear(values, q):
    # torch.quantile(x, q) (interpolation="linear"), aten/src/ATen/native/Sorting.cpp quantile_compute: sort; any NaN
    # gives NaN; rank = q * (n - 1); below = rank truncated, above = ceil(rank); values_below.lerp_(values_above,
    # rank - below), torch's lerp being `w < 0.5 ? a + w * (b - a) : b - (b - a) * (1 - w)`.
    x = np.sort(values)
    if np.isnan(x).any():
        return x.dtype.type(np.nan)
    rank = x.dtype.type(q) * x.dtype.type(x.size - 1)
    below, above = int(rank), int(np.ceil(rank))
    weight = rank - x.dtype.type(below)
    lo, hi = x[below], x[above]
    return lo + weight * (hi - lo) if weight < 0.5 else hi - (hi - lo) * (1 - weight)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py,
# GRPOTrainer.get_high_entropy_mask, lines 1396-1432 (one process: pad_across_processes and gather are no-ops), called
# at lines 3020-3023 with threshold = 1 - top_entropy_quantile and applied at lines 3114-3115. Identical in trl 1.16.0
# (lines 1380-1416).
def trl_high_entropy_mask(entropies, mask, threshold, quantile_dtype=np.float64):
    """[B, T] 0/1 (TRL: bool) mask of kept tokens whose entropy is >= the threshold-quantile of the kept entropies.

    TRL calls it with threshold = 1 - top_entropy_quantile (config default 1.0 = off, no mask). The quantile is
    torch.quantile (linear interpolation, numpy's default "linear" method) over entropies[mask.bool()] only, which
    TRL casts to float32 (`.float()`): pass quantile_dtype=np.float32 to mimic that cast (then the threshold is a
    float32 number compared with the float64 entropies, which can drop a token sitting exactly on the quantile, e.g.
    the median of an odd count). Comparison is >=, on entropies * mask, and the result is ANDed with mask.bool():
    padding is never kept. No kept token anywhere: all False (zeros). A NaN among the kept entropies makes the
    quantile NaN and the mask all False. Applied as per_token_loss = per_token_loss * mask_out after the off-policy
    mask and before the vLLM weight and the KL term; the loss denominators (mask) are unchanged.
    """
    entropies = np.asarray(entropies, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    local = entropies[mask.astype(bool)].astype(quantile_dtype)
    pad_value = -1e9
    gathered = local[local != pad_value]
    if gathered.size == 0:
        return np.zeros_like(entropies)
    entropy_threshold = np.float64(_torch_quantile_linear(gathered, threshold))
    masked_entropies = entropies * mask
    entropy_mask = masked_entropies >= entropy_threshold
    return (entropy_mask & mask.astype(bool)).astype(np.float64)


# trl 1.16.0 (PyPI wheel), trl/kernels/chunked_logprob.py, ChunkedLogProbFunction.forward line 381 (and _forward_tile
# lines 235-251: z = logits * logit_scale [softcap] / temperature, sq_sum_exp += exp(z - m)^2, rescaled by the running
# max); marked non-differentiable at line 390. trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8,
# trl/trainer/dpo_trainer.py lines 1565-1576 (use_weighting, WPO) computes the same value under torch.no_grad() as
# logsumexp(2 * logits) - 2 * logsumexp(logits) on the untempered shift_logits.
def trl_log_sum_sq_probs(logits, temperature=1.0):
    """log sum_v p_v^2 per position, p = softmax(logits / temperature) over the last axis; shape logits.shape[:-1].

    = log(sum exp(2 (z - m))) - 2 log(sum exp(z - m)) with z = logits / temperature, m = max z, i.e. logsumexp(2z)
    - 2 logsumexp(z). The kernel folds in float32; no gradient flows (non-differentiable output, used detached for
    the WPO weights exp(mean_t (logp - log sum p^2))). logit_scale = 1 and no softcap (the DPO trainer's defaults).
    """
    z = np.asarray(logits, dtype=np.float64) * (1 / temperature)
    running_max = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - running_max)
    sum_exp = e.sum(-1)
    sq_sum_exp = (e * e).sum(-1)
    return np.log(sq_sum_exp) - 2 * np.log(sum_exp)


# --------------------------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------------------------
# Source read: verl-project/verl, commit 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22, 0.10.0.dev), files
# verl/trainer/ppo/core_algos.py, verl/workers/config/actor.py, verl/trainer/config/actor/actor.yaml,
# verl/base_config.py (BaseConfig.get), verl/utils/torch_functional.py (masked_sum, masked_mean) and
# examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh (read with git show).


def _verl_masked_sum(values, mask, axis=None, keepdims=False):
    # verl.utils.torch_functional.masked_sum: where(mask, values, 0) * mask, summed (NaN outside the mask dropped).
    values, mask = np.asarray(values, np.float64), np.asarray(mask, np.float64)
    return np.sum(np.where(mask != 0, values, 0.0) * mask, axis=axis, keepdims=keepdims)


def _verl_masked_mean(values, mask, axis=None, keepdims=False):
    # verl.utils.torch_functional.masked_mean: masked_sum / (mask.sum + 1e-8).
    mask = np.asarray(mask, np.float64)
    return _verl_masked_sum(values, mask, axis, keepdims) / (mask.sum(axis=axis, keepdims=keepdims) + 1e-8)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py, agg_loss, lines
# 1140-1206 (dp_size=1, batch_num_tokens=None, global_batch_size=None).
def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    loss_mat = np.asarray(loss_mat, dtype=np.float64)
    loss_mask = np.asarray(loss_mask, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        if loss_agg_mode == "token-mean":
            return np.float64(_verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum())
        if loss_agg_mode == "token-sum":
            return np.float64(_verl_masked_sum(loss_mat, loss_mask))
        if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            seq_losses = np.sum(loss_mat * loss_mask, axis=-1)  # token-sum
            seq_mask = (np.sum(loss_mask, axis=-1) > 0).astype(np.float64)  # exclude fully masked sequences
            loss = _verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()  # seq-mean
            if loss_agg_mode == "seq-mean-token-sum-norm":
                if loss_scale_factor is None:
                    loss_scale_factor = loss_mask.shape[-1]
                loss = loss / loss_scale_factor
            return np.float64(loss)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_count = np.sum(loss_mask, axis=-1)  # per-sequence token count
            seq_losses = np.sum(loss_mat * loss_mask, axis=-1) / (seq_count + 1e-8)  # token-mean
            seq_mask = (seq_count > 0).astype(np.float64)  # exclude fully masked sequences
            return np.float64(_verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum())  # seq-mean
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py, agg_loss, lines
# 1181-1193 (loss_agg_mode "seq-mean-token-sum-norm", the Dr. GRPO aggregation), single process.
def verl_agg_seq_mean_token_sum_norm(loss_mat, loss_mask, loss_scale_factor=None):
    """sum over rows of sum_t(loss_mat * mask) / (number of rows with >= 1 kept token) / loss_scale_factor.

    loss_scale_factor defaults to loss_mask.shape[-1] (the padded response length T of the micro-batch, not a
    configured maximum; ActorConfig.loss_scale_factor, default None, can fix it). Empty rows leave the divisor; an
    all-empty batch gives 0/0 = NaN. (With dp_size > 1 verl divides by the global batch size instead.)
    """
    return _verl_agg_loss(loss_mat, loss_mask, "seq-mean-token-sum-norm", loss_scale_factor)


def _verl_sapo_terms(log_prob, old_log_prob, advantages, tau_pos, tau_neg):
    negative_approx_kl = np.clip(np.asarray(log_prob, np.float64) - np.asarray(old_log_prob, np.float64), -20.0, 20.0)
    ratio = np.exp(negative_approx_kl)
    advantages = np.asarray(advantages, dtype=np.float64)
    taus = np.where(advantages > 0, tau_pos, tau_neg)
    return negative_approx_kl, ratio, advantages, taus


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_sapo (registered "sapo"), lines 1621-1680 (pg_losses, rollout_is_weights=None); tau_pos 1.0 and
# tau_neg 1.05 from verl/workers/config/actor.py lines 168-169 (actor.yaml lines 46, 49).
def verl_sapo_per_token_loss(log_prob, old_log_prob, advantages, tau_pos=1.0, tau_neg=1.05):
    """[B, T] SAPO pg_losses of verl: -sigmoid(tau * (ratio - 1)) * (4 / tau) * A.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)), token level only; tau = tau_pos where A > 0, tau_neg where
    A <= 0. advantages (B, T).
    """
    _, ratio, advantages, taus = _verl_sapo_terms(log_prob, old_log_prob, advantages, tau_pos, tau_neg)
    gates = _sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return -gates * advantages


# Same source, lines 1686-1689: agg_loss(..., loss_agg_mode="seq-mean-token-mean") whatever loss_agg_mode says.
def verl_sapo_loss(
    log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05
):
    """Scalar SAPO loss of verl: seq-mean-token-mean of verl_sapo_per_token_loss (loss_agg_mode is ignored, as in
    verl). Per row sum_t(l * mask) / (n_i + 1e-8), then the mean over rows with n_i > 0 only (NaN if none).
    verl reports pg_clipfrac = pg_clipfrac_lower = 0.0 and ppo_kl = masked_mean(-clamped log ratio).
    """
    del loss_agg_mode  # accepted and unused, like verl's
    pg_losses = verl_sapo_per_token_loss(log_prob, old_log_prob, advantages, tau_pos, tau_neg)
    return _verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


# Same source as verl_sapo_per_token_loss; autograd's gradient (torch.clamp passes it at and inside [-20, 20]).
def verl_sapo_per_token_loss_grad(log_prob, old_log_prob, advantages, response_mask, tau_pos=1.0, tau_neg=1.05):
    """d sum(verl_sapo_per_token_loss * mask) / d log_prob = mask * -4 * A * s * (1 - s) * ratio * [|lr| <= 20],
    s = sigmoid(tau * (ratio - 1)), lr = log_prob - old_log_prob. (For verl_sapo_loss divide row i by n_i + 1e-8 and
    by the number of non-empty rows.)
    """
    mask = np.asarray(response_mask, dtype=np.float64)
    raw = np.asarray(log_prob, np.float64) - np.asarray(old_log_prob, np.float64)
    _, ratio, advantages, taus = _verl_sapo_terms(log_prob, old_log_prob, advantages, tau_pos, tau_neg)
    s = _sigmoid(taus * (ratio - 1.0))
    return mask * -4.0 * advantages * s * (1.0 - s) * ratio * ((raw >= -20.0) & (raw <= 20.0))


def _verl_clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high):
    # clip_ratio_low/high fall back to clip_ratio when None (ActorConfig defaults: 0.2, 0.2, 0.2).
    low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    high = clip_ratio_high if clip_ratio_high is not None else clip_ratio
    return low, high


def _verl_gmpo_terms(log_prob, old_log_prob, advantages, response_mask, clip_ratio, clip_ratio_low, clip_ratio_high):
    cliprange_low, cliprange_high = _verl_clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = np.asarray(response_mask, dtype=np.float64)
    advantages = np.asarray(advantages, dtype=np.float64)
    negative_approx_kl = np.asarray(log_prob, np.float64) - np.asarray(old_log_prob, np.float64)  # no clamp
    sgn_advantage = np.sign(advantages)
    negative_approx_kl_clamp = np.clip(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = np.minimum(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = mask.sum(-1)
    with np.errstate(over="ignore"):
        ratio = np.exp((negative_approx_kl_min * mask).sum(-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * mask).sum(-1) / (response_mask_sum + 1e-8)
    return negative_approx_kl, sgn_advantage, mask, response_mask_sum, ratio, advantage, cliprange_low, cliprange_high


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_geo_mean (registered "geo_mean"), lines 1927-1987 (pg_losses, rollout_is_weights=None).
def verl_gmpo_per_sequence_loss(
    log_prob, old_log_prob, advantages, response_mask, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2
):
    """(B,) GMPO pg_losses of verl: -mean_t(A) * exp(sum_t(x * mask) / (n + 1e-8)).

    x = sign(A) * min(sign(A) * lr, sign(A) * clamp(lr, -clip_ratio_low, clip_ratio_high)), lr = log_prob - old (NO
    [-20, 20] clamp; the line is commented out): upper clip where A > 0, lower clip where A < 0, and x = 0 where
    A == 0. mean_t(A) = sum_t(A * mask) / (n + 1e-8) (verl only supports sequence-constant advantages). Empty row:
    ratio exp(0) = 1, advantage 0, loss 0. Bounds are log-space; verl's defaults are the PPO ones (0.2), not 0.4.
    """
    terms = _verl_gmpo_terms(
        log_prob, old_log_prob, advantages, response_mask, clip_ratio, clip_ratio_low, clip_ratio_high
    )
    ratio, advantage = terms[4], terms[5]
    return -advantage * ratio


# Same source, line 1999: `pg_loss = torch.mean(pg_losses)` (loss_agg_mode is unused).
def verl_gmpo_loss(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
):
    """Scalar GMPO loss of verl: plain mean of verl_gmpo_per_sequence_loss over all B rows (loss_agg_mode unused)."""
    del loss_agg_mode  # "not used", per verl's docstring
    return np.float64(
        verl_gmpo_per_sequence_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_ratio, clip_ratio_low, clip_ratio_high
        ).mean()
    )


# Same source as verl_gmpo_loss; autograd's gradient (torch.min splits at ties, torch.clamp passes inside/at bounds).
def verl_gmpo_loss_grad(
    log_prob, old_log_prob, advantages, response_mask, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2
):
    """d verl_gmpo_loss / d log_prob, [B, T]: -Abar_i * ratio_i * mask[i, u] * k[i, u] / (n_i + 1e-8) / B.

    k = [lr <= clip_ratio_high] where A > 0, [lr >= -clip_ratio_low] where A < 0, 0 where A == 0 (sign 0).
    """
    lr, sgn, mask, n, ratio, advantage, low, high = _verl_gmpo_terms(
        log_prob, old_log_prob, advantages, response_mask, clip_ratio, clip_ratio_low, clip_ratio_high
    )
    k = np.where(sgn > 0, lr <= high, np.where(sgn < 0, lr >= -low, False))
    return (-advantage * ratio / (n + 1e-8))[:, None] * mask * k / mask.shape[0]


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_dppo_tv (registered "dppo_tv"), lines 1431-1437 (valid_mask).
def verl_dppo_tv_mask(log_prob, old_log_prob, advantages, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2):
    """[B, T] 0/1 valid_mask of DPPO-Binary-TV (1 = the token keeps its gradient; it is detached).

    With p = exp(log_prob), q = exp(old_log_prob) (probabilities, no clamp): A > 0: p - q <= clip_ratio_high; A <= 0
    (zero included): p - q >= -clip_ratio_low. Both tests inclusive. The clip_ratio* values are TV thresholds here.
    """
    low, high = _verl_clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    prob = np.exp(np.asarray(log_prob, dtype=np.float64))
    old_prob = np.exp(np.asarray(old_log_prob, dtype=np.float64))
    valid_positive_mask = (prob - old_prob) <= high
    valid_negative_mask = (prob - old_prob) >= -low
    return np.where(np.asarray(advantages) > 0, valid_positive_mask, valid_negative_mask).astype(np.float64)


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_dppo_kl (registered "dppo_kl"), lines 1512-1521 (valid_mask).
def verl_dppo_kl_mask(log_prob, old_log_prob, advantages, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2):
    """[B, T] 0/1 valid_mask of DPPO-Binary-KL (1 = the token keeps its gradient; it is detached).

    binary_kl = q * (log q - log p) + (1 - q) * log((1 - q + 1e-8) / (1 - p + 1e-8)), p = exp(log_prob), q =
    exp(old_log_prob): the KL between Bernoulli(q) and Bernoulli(p), with 1e-8 added to both complements only (not
    inside the first term). A > 0: binary_kl <= clip_ratio_high OR p <= q; A <= 0 (zero included): binary_kl <=
    clip_ratio_low OR p >= q. So A > 0 masks only tokens whose probability rose too far (binary KL above the high
    threshold and p > q), A <= 0 only those whose probability fell too far (above the low threshold and p < q).
    """
    low, high = _verl_clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_prob = np.asarray(log_prob, dtype=np.float64)
    old_log_prob = np.asarray(old_log_prob, dtype=np.float64)
    prob = np.exp(log_prob)
    old_prob = np.exp(old_log_prob)
    with np.errstate(divide="ignore", invalid="ignore"):
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * np.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
    valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
    valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
    return np.where(np.asarray(advantages) > 0, valid_positive_mask, valid_negative_mask).astype(np.float64)


def _verl_dppo_terms(
    log_prob, old_log_prob, advantages, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c
):
    if loss_mode == "dppo_tv":
        valid_mask = verl_dppo_tv_mask(log_prob, old_log_prob, advantages, clip_ratio, clip_ratio_low, clip_ratio_high)
    elif loss_mode == "dppo_kl":
        valid_mask = verl_dppo_kl_mask(log_prob, old_log_prob, advantages, clip_ratio, clip_ratio_low, clip_ratio_high)
    else:
        raise ValueError(f"Unknown DPPO loss_mode: {loss_mode}")
    negative_approx_kl = np.clip(np.asarray(log_prob, np.float64) - np.asarray(old_log_prob, np.float64), -20.0, 20.0)
    ratio = np.exp(negative_approx_kl)
    truncated_ratio = np.minimum(ratio, clip_ratio_c)
    return negative_approx_kl, ratio, truncated_ratio, valid_mask


# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py,
# compute_policy_loss_dppo_tv lines 1418-1439 and compute_policy_loss_dppo_kl lines 1499-1523 (pg_losses,
# rollout_is_weights=None). clip_ratio_c: both read `config.get("clip_ratio_c", 20.0)`, but ActorConfig always has
# the attribute (verl/workers/config/actor.py line 164, actor.yaml line 83: 3.0), so BaseConfig.get returns 3.0 unless
# set; the 20.0 is only reached by a config without that field. Example config, examples/dppo_trainer/
# run_qwen3_30b_a3b_megatron.sh: lines 18-19 `dppo_tv) CLIP_DEFAULT=0.15`, `dppo_kl) CLIP_DEFAULT=0.05` (used for
# both clip_ratio_low and clip_ratio_high, lines 23-24), line 79 `actor_rollout_ref.actor.clip_ratio_c=10000.0` (no
# truncation in practice), and line 76 loss_agg_mode=seq-mean-token-sum-norm.
def verl_dppo_per_token_loss(
    log_prob,
    old_log_prob,
    advantages,
    loss_mode,
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
):
    """[B, T] DPPO pg_losses of verl: -A * sg(min(ratio, clip_ratio_c)) * log_prob * sg(valid_mask).

    loss_mode "dppo_tv" or "dppo_kl" (valid_mask from verl_dppo_tv_mask / verl_dppo_kl_mask); ratio =
    exp(clamp(log_prob - old, -20, 20)). No dual clip: the TIS truncation at clip_ratio_c replaces it, upper side only.
    """
    _, _, truncated_ratio, valid_mask = _verl_dppo_terms(
        log_prob, old_log_prob, advantages, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    advantages = np.asarray(advantages, dtype=np.float64)
    return -advantages * truncated_ratio * np.asarray(log_prob, dtype=np.float64) * valid_mask


# Same sources, lines 1445-1447 / 1529-1531: agg_loss with the configured loss_agg_mode (default "token-mean").
def verl_dppo_loss(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    loss_mode,
    loss_agg_mode="token-mean",
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_scale_factor=None,
):
    """Scalar DPPO loss of verl: agg_loss(verl_dppo_per_token_loss, response_mask, loss_agg_mode) on one rank.

    Masked-out (invalid) tokens stay in every denominator (response_mask is not changed). loss_scale_factor only
    matters for "seq-mean-token-sum-norm" (the example's mode); verl passes config.global_batch_info, which on a
    single process carries none of dp_size / batch_num_tokens / global_batch_size.
    """
    pg_losses = verl_dppo_per_token_loss(
        log_prob, old_log_prob, advantages, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    return _verl_agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)


# Same sources as verl_dppo_per_token_loss; autograd's gradient (truncated_ratio and valid_mask are detached).
def verl_dppo_per_token_loss_grad(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    loss_mode,
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
):
    """d sum(verl_dppo_per_token_loss * mask) / d log_prob = -A * min(ratio, clip_ratio_c) * valid_mask * mask."""
    _, _, truncated_ratio, valid_mask = _verl_dppo_terms(
        log_prob, old_log_prob, advantages, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    mask = np.asarray(response_mask, dtype=np.float64)
    return -np.asarray(advantages, dtype=np.float64) * truncated_ratio * valid_mask * mask


# Same sources, lines 1422 / 1503 (ppo_kl) and 1449-1456 / 1534-1541 (pg_clipfrac, pg_clipfrac_lower).
def verl_dppo_metrics(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    loss_mode,
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
):
    """verl's DPPO metrics, keyed like verl: masked means with + 1e-8 in the denominator.

    "actor/pg_clipfrac" = masked_mean(1 - valid_mask): the fraction of kept tokens whose gradient is masked;
    "actor/pg_clipfrac_lower" = masked_mean([ratio > clip_ratio_c] * valid_mask), ratio = exp(clamp(lr, -20, 20))
    (strict >; the truncated fraction among valid tokens); "actor/ppo_kl" = masked_mean(-clamp(lr, -20, 20)).
    """
    negative_approx_kl, ratio, _, valid_mask = _verl_dppo_terms(
        log_prob, old_log_prob, advantages, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    mask = np.asarray(response_mask, dtype=np.float64)
    return {
        "actor/pg_clipfrac": np.float64(_verl_masked_mean(1.0 - valid_mask, mask)),
        "actor/ppo_kl": np.float64(_verl_masked_mean(-negative_approx_kl, mask)),
        "actor/pg_clipfrac_lower": np.float64(_verl_masked_mean((ratio > clip_ratio_c) * valid_mask, mask)),
    }


# --------------------------------------------------------------------------------------------------------------
# Where TRL and verl disagree (at the commits above)
# --------------------------------------------------------------------------------------------------------------
# - SAPO ratio: TRL exp(logp - old) with no clamp (overflow: gate 4/tau, gradient NaN), optionally at the sequence
#   level (GSPO mean, importance_sampling_level="sequence"); verl clamps the log ratio to [-20, 20] (gradient 0
#   outside) and is token-level only. Both pick tau_pos for A > 0 and tau_neg for A <= 0; defaults 1.0 / 1.05 in both.
# - SAPO aggregation: TRL (loss_type "sapo", like "grpo") = mean over ALL B rows of sum / clamp(n, min=1), empty row
#   0 and counted; verl forces "seq-mean-token-mean" (ignoring loss_agg_mode): / (n + 1e-8), empty rows dropped from
#   the mean, all-empty batch NaN.
# - GMPO: same log-space clip rule for A > 0 / A < 0. TRL default bounds 0.4 (GMPOConfig.epsilon), verl 0.2 (the PPO
#   clip_ratio*). A == 0: TRL uses the lower clip (max branch), verl zeroes the token's log term (sign 0); either way
#   the row's loss is 0 for a zero sequence advantage. Divisors: TRL clamp(n, min=1) over mask * entropy_mask, verl
#   n + 1e-8 over the response mask; TRL takes (B,) advantages, verl averages (B, T) advantages over the kept tokens.
#   Empty row: TRL's loss is -A_i (coef exp(0) = 1 times the row's own advantage), verl's is 0 (its advantage is the
#   masked mean, 0 / 1e-8 = 0); both count it in the plain mean over all B rows. Neither clamps to [-20, 20].
# - Dr. GRPO: TRL divides the total by B * max_completion_length (configured max, empty rows in B, empty batch 0);
#   verl's seq-mean-token-sum-norm divides by the number of NON-EMPTY rows times loss_mask.shape[-1] (the padded
#   length, unless loss_scale_factor is set); empty batch NaN. They agree when no row is empty and T equals the max.
# - VESPO, LUSPO, the entropy mask and log sum p^2 exist only in TRL; DPPO (TV / binary-KL masks, TIS at
#   clip_ratio_c) exists only in verl. VESPO tests the advantage with >= 0, SAPO and DPPO with > 0.
# - Sequence ratios: TRL's GSPO level (SAPO/LUSPO) is exp of a masked MEAN of log ratios (no clamp); VESPO's w is exp
#   of a masked SUM clamped per token to [-20, 20] and in total to [log 1e-8, 20].
