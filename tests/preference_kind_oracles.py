"""NumPy float64 transcriptions of peer libraries' less common preference-loss kinds (DPO's bco_pair, exo_pair,
discopop and sigmoid_norm, the f-divergence scores, WPO weights, the NLL terms of RPO and ORPO, and KTO), used only
as test oracles.

Same rules as tests/rl_oracles.py and tests/preference_oracles.py: each function is a line-by-line transcription of a
named function in TRL (huggingface/trl) or Liger-Kernel (linkedin/Liger-Kernel), read at the commit or release cited
above it, never written from this package's code. Torch operations are replaced by their NumPy equivalents;
`.detach()` (and `torch.no_grad()`) only shows up in the separate `*_grad` functions, which give by hand, in closed
form, what torch autograd gives for the peer's code w.r.t. the policy's per-sequence log-probabilities (chosen and
rejected for the paired losses, the one completion per example for KTO; the reference log-probabilities, the KL
baseline and the WPO weights are constants there). Anything that only matters for distributed runs (accelerator
gathers, process counts) is left at its single-process value, and the peers' float32 casts are float64 here. "logps"
below are per-sequence log-probabilities, [B] each; row i of the chosen and rejected arrays forms pair i. Per-token
arrays are [B, T], aligned with the next-token labels (TRL's shifted masks), and "mask" is 1 on the tokens that count.
"""

import numpy as np

# --------------------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------------------
# Sources read:
# * huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24, VERSION 1.10.0.dev0): files
#   trl/trainer/dpo_trainer.py and trl/trainer/kto_trainer.py (both last changed in
#   d2b72b720286f7f2a932df9146550969957fb9b6), trl/trainer/dpo_config.py (df887458b3076de9e61fa36bd726830016365063),
#   trl/trainer/kto_config.py (2ee37b88647ef9c291eb39170009160c0ac4cc49) and trl/experimental/orpo/orpo_trainer.py
#   (3b0ecdf8ced52291ee8329e6ca2a6cab59c4a3a9). Cited below as "trl@f2cd577".
# * trl 1.16.0, the PyPI wheel trl-1.16.0-py3-none-any.whl (sha256
#   c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396; no git commit of that release was available
#   here): trl/trainer/dpo_trainer.py, dpo_config.py, kto_trainer.py, kto_config.py, trl/trainer/utils.py
#   (add_fused_lm_head, FusedCausalLMOutput), trl/kernels/chunked_logprob.py and
#   trl/experimental/orpo/orpo_trainer.py. Cited below as "trl 1.16.0".
# Line numbers are those of the files at these versions.


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _logsigmoid(x):
    # torch.nn.functional.logsigmoid, computed stably as -softplus(-x).
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_logsigmoid(x))


def _logsumexp(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


# trl@f2cd577, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss lines 1343-1362 (policy) and 1384-1394
# (reference), compute_ref_log_probs lines 1197-1218; trl 1.16.0, dpo_trainer.py, _compute_loss lines 1296-1316 and
# 1339-1347, compute_ref_log_probs lines 1243-1283 (ld_alpha=None, the default); the ipo / sigmoid_norm lengths from
# _compute_loss lines 1446-1448 and 1552-1554 (f2cd577), 1399-1401 and 1505-1507 (1.16.0). KTO forms its per-sequence
# values the same way (kto_trainer.py line 1509 at f2cd577, 1401 at 1.16.0).
def trl_sequence_values(per_token_logps, mask, loss_type="sigmoid", completion_mask=None):
    """(values [B], lengths [B] or None): TRL's per-sequence values for a DPO loss kind, from per-token logps.

    values: the SUM of the completion tokens' log-probabilities for EVERY loss_type (sigmoid_norm and ipo included).
    At f2cd577 TRL assigns per_token_logps[shift_completion_mask == 0] = 0.0 and sums (NaN or inf outside the mask is
    dropped; an empty row gives 0); at 1.16.0 the fused LM head returns log_probs that are zero where the label is
    -100 (labels = input_ids with completion_mask == 0 set to -100, shifted inside the head, i.e. the same
    shift_completion_mask) and TRL sums them. `mask` is that shifted completion mask, aligned with per_token_logps.
    lengths: only for "ipo" and "sigmoid_norm", the row sums of TRL's UNSHIFTED completion_mask ([B, T + 1]; pass it as
    completion_mask, else mask.sum(1) is used, which is equal unless a completion token sits at position 0), not yet
    clamped: the loss divides the summed log-RATIOS (policy minus reference) by lengths.clamp(min=1) (see
    trl_dpo_kind_loss). So sigmoid_norm is -logsigmoid(beta * (mean_c - mean_r)) with mean_c the per-token mean of the
    policy-minus-reference log-probs, but the per-sequence values themselves are sums. ld_alpha (LD-DPO, default
    None) would weight the tokens past the shorter completion's length by ld_alpha; not transcribed.
    """
    per_token_logps = _f(per_token_logps)
    values = np.where(_f(mask) == 0, 0.0, per_token_logps).sum(axis=1)
    if loss_type not in ("ipo", "sigmoid_norm"):
        return values, None
    lengths = _f(mask if completion_mask is None else completion_mask).sum(axis=1)
    return values, lengths


_F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The clamp_max of the alpha-divergence exponent for float32 (and bfloat16) log-ratios; float16 uses 11.0. TRL's dict
# has no float64 key (float64 log-ratios raise KeyError there); the float32 value is used here.
_ALPHA_CLAMP_MAX = 80.0


# trl@f2cd577, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss lines 1400-1428.
def trl_f2cd577_f_divergence_scores(chosen_logratios, rejected_logratios, f_divergence_type="reverse_kl", alpha=0.5):
    """(chosen_scores, rejected_scores) of TRL@f2cd577: the per-side scores f'(t) with the constants dropped.

    reverse_kl: r; forward_kl: -exp(-r); js_divergence: logsigmoid(r); alpha_divergence (alpha =
    f_alpha_divergence_coef, default 0.5): exp(min((alpha - 1) r, 80)) / (alpha - 1), and r itself when
    |alpha - 1| < 1e-6. r is the log-ratio, policy minus reference, of the summed logps.
    """
    chosen_logratios, rejected_logratios = _f(chosen_logratios), _f(rejected_logratios)
    if f_divergence_type == "reverse_kl":  # standard DPO
        chosen_scores = chosen_logratios
        rejected_scores = rejected_logratios
    elif f_divergence_type == "forward_kl":
        # f'(t) = 1 - 1/t  -> drop constant -> -exp(-logratio)
        chosen_scores = -np.exp(-chosen_logratios)
        rejected_scores = -np.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        # f'(t) = log(2t/(t+1)) -> drop log 2
        chosen_scores = _logsigmoid(chosen_logratios)
        rejected_scores = _logsigmoid(rejected_logratios)
    elif f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # limit case f'(t) -> log(t), fall back to reverse_kl
            chosen_scores = chosen_logratios
            rejected_scores = rejected_logratios
        else:
            coef = 1.0 / (alpha - 1.0)
            t_chosen = (alpha - 1.0) * chosen_logratios
            t_rejected = (alpha - 1.0) * rejected_logratios
            t_chosen_float = np.minimum(t_chosen, _ALPHA_CLAMP_MAX)
            t_rejected_float = np.minimum(t_rejected, _ALPHA_CLAMP_MAX)
            chosen_scores = np.exp(t_chosen_float) * coef
            rejected_scores = np.exp(t_rejected_float) * coef
    else:
        raise ValueError(f"Unknown f_divergence_type: {f_divergence_type}")
    return chosen_scores, rejected_scores


# trl 1.16.0, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss lines 1353-1381.
def trl116_f_divergence_scores(chosen_logratios, rejected_logratios, f_divergence_type="reverse_kl", alpha=0.5):
    """(chosen_scores, rejected_scores) of TRL 1.16.0: the per-side scores f'(t) WITH their constants.

    reverse_kl: r; forward_kl: 1 - exp(-r); js_divergence: log(2) + logsigmoid(r); alpha_divergence:
    (exp(min((alpha - 1) r, 80)) - 1) / (alpha - 1), and r itself when |alpha - 1| < 1e-6. The constants cancel in
    chosen - rejected but not once each side is divided by its own length (ipo, sigmoid_norm).
    """
    chosen_logratios, rejected_logratios = _f(chosen_logratios), _f(rejected_logratios)
    if f_divergence_type == "reverse_kl":  # standard DPO
        chosen_scores = chosen_logratios
        rejected_scores = rejected_logratios
    elif f_divergence_type == "forward_kl":
        # f'(t) = 1 - 1/t
        chosen_scores = 1 - np.exp(-chosen_logratios)
        rejected_scores = 1 - np.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        # f'(t) = log(2t/(t+1)) = log 2 + logsigmoid(log t)
        chosen_scores = np.log(2.0) + _logsigmoid(chosen_logratios)
        rejected_scores = np.log(2.0) + _logsigmoid(rejected_logratios)
    elif f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # limit case f'(t) -> log(t), fall back to reverse_kl
            chosen_scores = chosen_logratios
            rejected_scores = rejected_logratios
        else:
            coef = 1.0 / (alpha - 1.0)
            t_chosen = (alpha - 1.0) * chosen_logratios
            t_rejected = (alpha - 1.0) * rejected_logratios
            t_chosen_float = np.minimum(t_chosen, _ALPHA_CLAMP_MAX)
            t_rejected_float = np.minimum(t_rejected, _ALPHA_CLAMP_MAX)
            chosen_scores = (np.exp(t_chosen_float) - 1.0) * coef
            rejected_scores = (np.exp(t_rejected_float) - 1.0) * coef
    else:
        raise ValueError(f"Unknown f_divergence_type: {f_divergence_type}")
    return chosen_scores, rejected_scores


# trl 1.16.0, trl/trainer/dpo_trainer.py, _compute_loss lines 1353-1383 (delta_score) and, with lengths, the ipo /
# sigmoid_norm normalisation of lines 1399-1402 and 1505-1508.
def trl116_f_divergence_logits(
    chosen_logratios,
    rejected_logratios,
    f_divergence_type="reverse_kl",
    alpha=0.5,
    chosen_lengths=None,
    rejected_lengths=None,
):
    """h [B] of TRL 1.16.0, the quantity the loss kinds take (beta NOT applied).

    Without lengths: delta_score = f(chosen_logratios) - f(rejected_logratios) (trl116_f_divergence_scores), which
    sigmoid takes as -logsigmoid(beta h), hinge relu(1 - beta h), robust / exo_pair / discopop through x = beta h.
    With lengths (ipo, sigmoid_norm): f(chosen) / clamp(n_c, min=1) - f(rejected) / clamp(n_r, min=1); ipo is then
    (h - 1 / (2 beta))**2 and sigmoid_norm -logsigmoid(beta h). Which loss types accept a non-default f_divergence_type
    is checked by DPOTrainer.__init__ (see trl_dpo_kind_loss).
    """
    chosen_scores, rejected_scores = trl116_f_divergence_scores(
        chosen_logratios, rejected_logratios, f_divergence_type, alpha
    )
    if chosen_lengths is None and rejected_lengths is None:
        return chosen_scores - rejected_scores
    chosen_avg_score = chosen_scores / np.maximum(_f(chosen_lengths), 1.0)
    rejected_avg_score = rejected_scores / np.maximum(_f(rejected_lengths), 1.0)
    return chosen_avg_score - rejected_avg_score


# trl@f2cd577, trl/trainer/dpo_trainer.py, _compute_loss lines 1400-1430 (delta_score) and, with lengths, lines
# 1446-1449 and 1552-1555.
def trl_f2cd577_f_divergence_logits(
    chosen_logratios,
    rejected_logratios,
    f_divergence_type="reverse_kl",
    alpha=0.5,
    chosen_lengths=None,
    rejected_lengths=None,
):
    """h [B] of TRL@f2cd577, as trl116_f_divergence_logits but on the older constant-free scores."""
    chosen_scores, rejected_scores = trl_f2cd577_f_divergence_scores(
        chosen_logratios, rejected_logratios, f_divergence_type, alpha
    )
    if chosen_lengths is None and rejected_lengths is None:
        return chosen_scores - rejected_scores
    chosen_avg_score = chosen_scores / np.maximum(_f(chosen_lengths), 1.0)
    rejected_avg_score = rejected_scores / np.maximum(_f(rejected_lengths), 1.0)
    return chosen_avg_score - rejected_avg_score


def _f_divergence_score_derivative(logratios, f_divergence_type, alpha):
    # d score / d logratio, what autograd gives for both versions' scores (the constants drop out). torch.clamp(max=)
    # passes the gradient where the input is <= max.
    r = _f(logratios)
    if f_divergence_type == "reverse_kl":
        return np.ones_like(r)
    if f_divergence_type == "forward_kl":
        return np.exp(-r)
    if f_divergence_type == "js_divergence":
        return _sigmoid(-r)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return np.ones_like(r)
        t = (alpha - 1.0) * r
        return np.where(t <= _ALPHA_CLAMP_MAX, np.exp(np.minimum(t, _ALPHA_CLAMP_MAX)), 0.0)
    raise ValueError(f"Unknown f_divergence_type: {f_divergence_type}")


# trl 1.16.0, trl/trainer/dpo_trainer.py, DPOTrainer.__init__ lines 810-815.
_TRL116_F_DIVERGENCE_LOSS_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
_TRL_KIND_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "robust", "bco_pair", "discopop", "sigmoid_norm")


def _trl_check_kind(loss_type, label_smoothing, f_divergence_type, version):
    if version not in ("1.16.0", "f2cd577"):
        raise ValueError(f"version must be '1.16.0' or 'f2cd577', got {version!r}")
    if loss_type not in _TRL_KIND_LOSS_TYPES:
        raise NotImplementedError(f"trl_dpo_kind_loss transcribes {_TRL_KIND_LOSS_TYPES}, not {loss_type!r}")
    # trl 1.16.0 lines 810-815 (absent at f2cd577, which accepts any f_divergence_type for every loss type).
    if version == "1.16.0" and f_divergence_type != "reverse_kl" and loss_type not in _TRL116_F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"`f_divergence_type='{f_divergence_type}'` is only supported for the following loss types: "
            f"{sorted(_TRL116_F_DIVERGENCE_LOSS_TYPES)}. You provided {[loss_type]}. Use the default "
            "`f_divergence_type='reverse_kl'` with these losses."
        )
    # DPOTrainer.__init__, f2cd577 lines 779-783, 1.16.0 lines 829-833 (robust outside [0, 0.5) only warns).
    if loss_type == "exo_pair" and label_smoothing == 0.0:
        raise ValueError(
            "Label smoothing must be greater than 0.0 when using 'exo_pair' loss. The EXO paper recommends a "
            "value of 1e-3."
        )


# trl@f2cd577, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss lines 1396-1430 (log-ratios, scores) and the
# branches sigmoid 1434-1435, hinge 1437-1438, ipo 1440-1451, exo_pair 1453-1464, robust 1475-1478, bco_pair
# 1480-1483, discopop 1530-1540, sigmoid_norm 1551-1556; trl 1.16.0, dpo_trainer.py, lines 1349-1383 and sigmoid
# 1387-1388, hinge 1390-1391, ipo 1393-1404, exo_pair 1406-1417, robust 1428-1431, bco_pair 1433-1436, discopop
# 1483-1493, sigmoid_norm 1504-1509; DPOTrainer.__init__ checks (f2cd577 lines 769-783, 1.16.0 lines 810-833).
# Defaults from dpo_config.py (beta 0.1, label_smoothing 0.0, discopop_tau 0.05, f_divergence_type "reverse_kl",
# f_alpha_divergence_coef 0.5) at both versions. One loss type, use_weighting=False, before per_sequence_loss.mean().
def trl_dpo_kind_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta,
    label_smoothing=0.0,
    discopop_tau=0.05,
    chosen_lengths=None,
    rejected_lengths=None,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    version="1.16.0",
):
    """per_sequence_loss [B] of TRL's DPOTrainer for one loss kind, from SUMMED per-sequence logps.

    u = chosen_logps - ref_chosen_logps, v likewise; S = the f-divergence score of the version
    (trl116_f_divergence_scores or trl_f2cd577_f_divergence_scores; S(r) = r for reverse_kl); h = S(u) - S(v);
    x = beta h. bco_pair: -logsigmoid(beta S(u)) - logsigmoid(-beta S(v)) at f2cd577, -logsigmoid(beta u) -
    logsigmoid(-beta v) at 1.16.0 (which rejects a non-default f_divergence_type for it); no running reward mean.
    exo_pair (ls = label_smoothing > 0, ValueError at 0.0): sigmoid(x) (logsigmoid(x) - log1p(-ls)) + sigmoid(-x)
    (logsigmoid(-x) - log(ls)). discopop: m = sigmoid(x / discopop_tau); -logsigmoid(x) (1 - m) + exp(-x) m.
    sigmoid_norm: -logsigmoid(beta d), d = S(u) / clamp(n_c, min=1) - S(v) / clamp(n_r, min=1) with n_c, n_r
    (chosen_lengths, rejected_lengths) the completion lengths (trl_sequence_values). Also transcribed for the
    f-divergence checks: sigmoid -logsigmoid(x), hinge relu(1 - x), robust ((1 - ls)(-logsigmoid(x)) -
    ls(-logsigmoid(-x))) / (1 - 2 ls), ipo (d - 1 / (2 beta))**2. For reverse_kl both versions give the same numbers.
    The step loss is sum_k loss_weights[k] * mean(per_sequence_loss_k) (see trl_dpo_combined_loss).
    """
    _trl_check_kind(loss_type, label_smoothing, f_divergence_type, version)
    chosen_logps, rejected_logps = _f(chosen_logps), _f(rejected_logps)
    ref_chosen_logps, ref_rejected_logps = _f(ref_chosen_logps), _f(ref_rejected_logps)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    scores = trl116_f_divergence_scores if version == "1.16.0" else trl_f2cd577_f_divergence_scores
    chosen_scores, rejected_scores = scores(
        chosen_logratios, rejected_logratios, f_divergence_type, f_alpha_divergence_coef
    )
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        per_sequence_loss = -_logsigmoid(beta * delta_score)
    elif loss_type == "hinge":
        per_sequence_loss = np.maximum(1 - beta * delta_score, 0.0)
    elif loss_type in ("ipo", "sigmoid_norm"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"{loss_type!r} divides by the completion lengths; pass chosen_lengths, rejected_lengths")
        chosen_avg_score = chosen_scores / np.maximum(_f(chosen_lengths), 1.0)
        rejected_avg_score = rejected_scores / np.maximum(_f(rejected_lengths), 1.0)
        delta = chosen_avg_score - rejected_avg_score
        if loss_type == "ipo":
            per_sequence_loss = (delta - 1 / (2 * beta)) ** 2
        else:
            per_sequence_loss = -_logsigmoid(beta * delta)
    elif loss_type == "exo_pair":
        epsilon = np.float64(label_smoothing)
        qw = _sigmoid(beta * delta_score)
        log_qw = _logsigmoid(beta * delta_score)
        log_pw = np.log1p(-epsilon)
        ql = _sigmoid(-beta * delta_score)
        log_ql = _logsigmoid(-beta * delta_score)
        log_pl = np.log(epsilon)
        per_sequence_loss = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
    elif loss_type == "robust":
        clean_loss_term = -(1 - label_smoothing) * _logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * _logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
    elif loss_type == "bco_pair":
        if version == "1.16.0":
            chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
        else:
            chosen_rewards, rejected_rewards = beta * chosen_scores, beta * rejected_scores
        per_sequence_loss = -_logsigmoid(chosen_rewards) - _logsigmoid(-rejected_rewards)
    else:  # discopop
        logits = delta_score * beta
        log_ratio_modulation = _sigmoid(logits / discopop_tau)
        logistic_component = -_logsigmoid(logits)
        exp_component = np.exp(-logits)
        per_sequence_loss = logistic_component * (1 - log_ratio_modulation) + exp_component * log_ratio_modulation
    return per_sequence_loss


# Same source as trl_dpo_kind_loss; the gradient torch autograd gives (references constant, relu'(0) = 0).
def trl_dpo_kind_loss_grad(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta,
    label_smoothing=0.0,
    discopop_tau=0.05,
    chosen_lengths=None,
    rejected_lengths=None,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    version="1.16.0",
):
    """(d per_sequence_loss[i] / d chosen_logps[i], d per_sequence_loss[i] / d rejected_logps[i]), each [B].

    With x = beta h, q = sigmoid(x) and S' the score derivative (1, exp(-r), sigmoid(-r), or exp((alpha - 1) r) below
    the clamp and 0 above it, for reverse_kl, forward_kl, js_divergence, alpha_divergence; the same in both versions):
    d/dchosen = beta g S'(u), d/drejected = -beta g S'(v), where g is q - 1 (sigmoid), -[1 - x > 0] (hinge),
    ((1 - ls)(q - 1) - ls q) / (1 - 2 ls) (robust), q (1 - q)(x - log1p(-ls) + log(ls)) (exo_pair),
    (q - 1)(1 - m) + logsigmoid(x) m' - exp(-x) m + exp(-x) m' with m = sigmoid(x / tau), m' = m (1 - m) / tau
    (discopop). ipo / sigmoid_norm: 2 (d - 1 / (2 beta)) or beta (sigmoid(beta d) - 1), times S'(u) / clamp(n_c, 1)
    and -S'(v) / clamp(n_r, 1). bco_pair: beta (sigmoid(beta S(u)) - 1) S'(u) and beta sigmoid(beta S(v)) S'(v)
    (S = identity at 1.16.0). The step loss is the mean over the pairs (times the loss weight, and the WPO weight if
    used).
    """
    _trl_check_kind(loss_type, label_smoothing, f_divergence_type, version)
    u = _f(chosen_logps) - _f(ref_chosen_logps)
    v = _f(rejected_logps) - _f(ref_rejected_logps)
    scores = trl116_f_divergence_scores if version == "1.16.0" else trl_f2cd577_f_divergence_scores
    su, sv = scores(u, v, f_divergence_type, f_alpha_divergence_coef)
    du = _f_divergence_score_derivative(u, f_divergence_type, f_alpha_divergence_coef)
    dv = _f_divergence_score_derivative(v, f_divergence_type, f_alpha_divergence_coef)
    ls = label_smoothing
    if loss_type in ("ipo", "sigmoid_norm"):
        n_c, n_r = np.maximum(_f(chosen_lengths), 1.0), np.maximum(_f(rejected_lengths), 1.0)
        d = su / n_c - sv / n_r
        g = 2.0 * (d - 1.0 / (2.0 * beta)) if loss_type == "ipo" else beta * (_sigmoid(beta * d) - 1.0)
        return g * du / n_c, -g * dv / n_r
    if loss_type == "bco_pair":
        if version == "1.16.0":
            su, sv, du, dv = u, v, np.ones_like(u), np.ones_like(v)
        return beta * (_sigmoid(beta * su) - 1.0) * du, beta * _sigmoid(beta * sv) * dv
    x = beta * (su - sv)
    q = _sigmoid(x)
    if loss_type == "sigmoid":
        g = q - 1.0
    elif loss_type == "hinge":
        g = -((1.0 - x) > 0).astype(np.float64)
    elif loss_type == "robust":
        g = ((1 - ls) * (q - 1.0) - ls * q) / (1 - 2 * ls)
    elif loss_type == "exo_pair":
        g = q * (1.0 - q) * (x - np.log1p(-ls) + np.log(ls))
    else:  # discopop
        m = _sigmoid(x / discopop_tau)
        dm = m * (1.0 - m) / discopop_tau
        g = (q - 1.0) * (1.0 - m) + _logsigmoid(x) * dm - np.exp(-x) * m + np.exp(-x) * dm
    return beta * g * du, -beta * g * dv


# trl@f2cd577, trl/trainer/dpo_trainer.py, _compute_loss lines 1569-1571 (lse1, lse2, log_denom); trl 1.16.0 computes
# the same quantity in the fused LM head (trl/kernels/chunked_logprob.py line 381, log(sq_sum_exp) - 2 log(sum_exp),
# returned as FusedCausalLMOutput.log_sum_sq_probs, zero where the label is -100; trl/trainer/utils.py lines
# 1655-1661).
def trl_log_sum_sq_probs(logits):
    """log(sum_v p_v^2) per position, [B, T] from logits [B, T, V]: logsumexp(2 z) - 2 logsumexp(z) (no gradient)."""
    logits = _f(logits)
    lse1 = _logsumexp(logits, axis=-1)
    lse2 = _logsumexp(2.0 * logits, axis=-1)
    return lse2 - 2.0 * lse1


# trl@f2cd577, trl/trainer/dpo_trainer.py, _compute_loss lines 1565-1576 (use_weighting=True; per_token_logps was
# zeroed outside the mask at line 1348); trl 1.16.0, dpo_trainer.py lines 1518-1526.
def trl_wpo_weights(
    chosen_per_token_logps,
    chosen_log_sum_sq,
    chosen_mask,
    rejected_per_token_logps,
    rejected_log_sum_sq,
    rejected_mask,
):
    """WPO weights [B] of TRL's DPOTrainer: w_c * w_r, computed under torch.no_grad (constants for the gradient).

    Per side: aligned = (per_token_logps - log_sum_sq) * mask (a multiplication, after TRL's zeroing of
    per_token_logps outside the mask), w = exp(aligned.sum(1) / mask.sum(1).clamp_min(1)), i.e. exp of the mean over
    the completion tokens of log p(y_t) - log sum_v p_v^2 (an empty row gives exp(0) = 1). log_sum_sq from
    trl_log_sum_sq_probs. The weights multiply EVERY loss type's per_sequence_loss inside the loss-type loop, "sft"
    included, in both versions; there the sft per_sequence_loss is batch_loss.expand(B), and the in-place
    `per_sequence_loss *= ...` on that expanded tensor raises RuntimeError in torch for B > 1 (for B = 1 the one
    pair's weight multiplies the NLL). aot / aot_unpaired with use_weighting raise NotImplementedError in __init__.
    """

    def side(per_token_logps, log_sum_sq, mask):
        mask = _f(mask)
        per_token_logps = np.where(mask == 0, 0.0, _f(per_token_logps))
        completion_lengths = np.maximum(mask.sum(axis=1), 1.0)
        aligned_logps = (per_token_logps - _f(log_sum_sq)) * mask
        mean_logps = aligned_logps.sum(axis=1) / completion_lengths
        return np.exp(mean_logps)

    chosen_weights = side(chosen_per_token_logps, chosen_log_sum_sq, chosen_mask)
    rejected_weights = side(rejected_per_token_logps, rejected_log_sum_sq, rejected_mask)
    return chosen_weights * rejected_weights


# trl@f2cd577, trl/trainer/dpo_trainer.py, _compute_loss lines 1542-1549 (loss_type "sft": F.cross_entropy of the
# chosen rows' shifted logits at the masked positions); trl 1.16.0, dpo_trainer.py lines 1495-1502
# (-chosen_per_token_logps[chosen_mask.bool()].mean()).
def trl_sft_nll(chosen_per_token_logps, chosen_mask):
    """Scalar NLL of TRL's "sft" loss type: minus the mean log-prob over ALL chosen completion tokens of the batch.

    A token mean across the batch (sum over every kept token / their total count), not a mean of per-sequence means;
    no prompt tokens (the shifted completion mask). An empty mask gives NaN (torch's mean of nothing). TRL expands the
    scalar to [B] and adds loss_weight * its mean: RPO is loss_type=["sigmoid", "sft"], loss_weights=[1.0, alpha].
    """
    chosen_per_token_logps = _f(chosen_per_token_logps)
    selected = chosen_per_token_logps[_f(chosen_mask) != 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.float64(-(selected.sum() / selected.size) if selected.size else np.nan)


# Same source; the gradient autograd gives w.r.t. the per-token log-probs.
def trl_sft_nll_grad(chosen_per_token_logps, chosen_mask):
    """d trl_sft_nll / d chosen_per_token_logps, [B, T]: -1 / N on the N kept tokens, 0 elsewhere."""
    mask = _f(chosen_mask) != 0
    n = mask.sum()
    return np.where(mask, -1.0 / max(n, 1), 0.0) * np.ones_like(_f(chosen_per_token_logps))


# trl@f2cd577, trl/trainer/dpo_trainer.py, _compute_loss lines 1432-1433 and 1565-1578 (the loss-type loop,
# `loss += per_sequence_loss.mean() * loss_weight`); trl 1.16.0 lines 1385-1386 and 1518-1528. loss_weights default
# to 1.0 each (dpo_config.py; DPOTrainer.__init__ `args.loss_weights or [1.0] * len(self.loss_types)`).
def trl_dpo_combined_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_types,
    beta,
    loss_weights=None,
    chosen_per_token_logps=None,
    chosen_mask=None,
    wpo_weights=None,
    **kind_kwargs,
):
    """Scalar step loss of TRL's DPOTrainer for several loss types: sum_k w_k * mean(per_sequence_loss_k * wpo).

    Kinds from trl_dpo_kind_loss (kind_kwargs go there); "sft" is trl_sft_nll(chosen_per_token_logps, chosen_mask)
    broadcast to [B]. wpo_weights (trl_wpo_weights) multiply each kind's per-pair loss; with "sft" and B > 1 that
    raises RuntimeError, as torch does on the expanded tensor.
    """
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else loss_weights
    batch_size = _f(chosen_logps).shape[0]
    loss = 0.0
    for loss_type, loss_weight in zip(loss_types, loss_weights, strict=True):
        if loss_type == "sft":
            per_sequence_loss = np.full(batch_size, trl_sft_nll(chosen_per_token_logps, chosen_mask))
            if wpo_weights is not None and batch_size > 1:
                raise RuntimeError(
                    "unsupported operation: more than one element of the written-to tensor refers to a single memory "
                    "location. Please clone() the tensor before performing the operation."
                )
        else:
            per_sequence_loss = trl_dpo_kind_loss(
                chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, loss_type, beta, **kind_kwargs
            )
        if wpo_weights is not None:
            per_sequence_loss = per_sequence_loss * _f(wpo_weights)
        loss += per_sequence_loss.mean() * loss_weight
    return np.float64(loss)


def _trl_log1mexp(x):
    # trl@f2cd577 trl/experimental/orpo/orpo_trainer.py lines 88-92, log1mexp: log(1 - exp(x)), branching at -ln 2.
    t = -0.6931471805599453
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(x < t, np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


# trl@f2cd577, trl/experimental/orpo/orpo_trainer.py: ORPOTrainer.concatenated_forward lines 782-803 (the chosen NLL:
# nn.CrossEntropyLoss over labels = input_ids where attention_mask == 1, shifted) and 805-812 (get_batch_logps with
# average_log_prob=True, lines 708-746), odds_ratio_loss lines 673-706, get_batch_loss_metrics line 851
# (`loss = policy_nll_loss - losses.mean()`). Identical in trl 1.16.0's trl/experimental/orpo/orpo_trainer.py
# (odds_ratio_loss through concatenated_forward unchanged; the total at line 848). beta default 0.1 (orpo_config.py).
def trl_orpo_total_loss(
    chosen_per_token_logps,
    chosen_mask,
    rejected_per_token_logps,
    rejected_mask,
    beta=0.1,
    chosen_nll_mask=None,
):
    """Scalar ORPOTrainer loss: nll - mean(beta * logsigmoid(log_odds)) (aux loss off).

    c, r: token-AVERAGED logps, (per_token_logps * mask).sum(-1) / mask.sum(-1) with mask = labels[:, 1:] != -100
    (the response tokens; empty row -> NaN), cast to float32 in TRL. log_odds = (c - r) - (log1mexp(c) - log1mexp(r)).
    nll: nn.CrossEntropyLoss (mean over the non-ignored tokens of ALL chosen rows together) whose labels are the
    chosen rows' input_ids wherever attention_mask == 1, i.e. PROMPT AND RESPONSE: pass that shifted mask as
    chosen_nll_mask (attention_mask[:, 1:] of the chosen rows, with chosen_per_token_logps covering the prompt too);
    it defaults to chosen_mask (response only), which is NOT TRL's.
    """
    chosen_per_token_logps, rejected_per_token_logps = _f(chosen_per_token_logps), _f(rejected_per_token_logps)
    chosen_mask, rejected_mask = _f(chosen_mask), _f(rejected_mask)
    nll_mask = chosen_mask if chosen_nll_mask is None else _f(chosen_nll_mask)
    selected = chosen_per_token_logps[nll_mask != 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        policy_nll_loss = -(selected.sum() / selected.size) if selected.size else np.nan
        policy_chosen_logps = (chosen_per_token_logps * chosen_mask).sum(-1) / chosen_mask.sum(-1)
        policy_rejected_logps = (rejected_per_token_logps * rejected_mask).sum(-1) / rejected_mask.sum(-1)
    log_odds = (policy_chosen_logps - policy_rejected_logps) - (
        _trl_log1mexp(policy_chosen_logps) - _trl_log1mexp(policy_rejected_logps)
    )
    ratio = _logsigmoid(log_odds)
    losses = beta * ratio
    return np.float64(policy_nll_loss - losses.mean())


# trl@f2cd577, trl/trainer/kto_trainer.py, KTOTrainer._prepare_dataset lines 1096-1111 (add_kl_completion_ids, lines
# 1105-1106, mapped with batched=True, batch_size=per_device_train_batch_size); trl 1.16.0 kto_trainer.py line 1151.
def trl_kto_kl_completion_index(n_examples, per_device_train_batch_size):
    """Index array [n] (int64): example i's KL completion is completion_ids[index[i]] (its prompt stays its own).

    Within each consecutive block of per_device_train_batch_size examples (the last one may be shorter) the
    completions are rotated by one: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}). The collator then builds
    KL_input_ids = prompt_ids + KL_completion_ids and KL_completion_mask = 0 on the prompt, 1 on the completion.
    """
    index = np.arange(n_examples)
    out = np.empty(n_examples, dtype=np.int64)
    for start in range(0, n_examples, per_device_train_batch_size):
        block = index[start : start + per_device_train_batch_size]
        out[start : start + len(block)] = np.concatenate([block[-1:], block[:-1]])
    return out


def _kto_kl(policy_KL_logps, reference_KL_logps, loss_type):
    # trl@f2cd577 kto_trainer.py lines 1552-1556 (calculate_KL = loss_type not in ["apo_zero_unpaired"], line 777).
    if loss_type != "apo_zero_unpaired":
        kl = (_f(policy_KL_logps) - _f(reference_KL_logps)).mean()
        kl = np.maximum(np.mean(kl), 0.0)  # gather_for_metrics(kl).mean() on one process; clamp(min=0)
    else:
        kl = np.float64(0.0)  # torch.zeros(1)
    return np.float64(kl)


# trl@f2cd577, trl/trainer/kto_trainer.py, KTOTrainer._compute_loss lines 1478-1590 and 1657 (`losses.nanmean()`):
# per-sequence logps at line 1509 (sum over completion_mask[:, 1:], as trl_sequence_values), KL logps from
# _compute_kl_logps lines 1280-1330 (under torch.no_grad, summed over KL_completion_mask[:, 1:]), the KL baseline at
# lines 1552-1556, losses at 1557-1592. trl 1.16.0 kto_trainer.py: the same statements at lines 1401, 1442-1482
# and 1548.
# Defaults (kto_config.py, both versions): beta 0.1, desirable_weight 1.0, undesirable_weight 1.0, loss_type "kto".
def trl_kto_loss(
    policy_logps,
    reference_logps,
    desirable,
    policy_KL_logps=None,
    reference_KL_logps=None,
    beta=0.1,
    desirable_weight=1.0,
    undesirable_weight=1.0,
    loss_type="kto",
):
    """(loss, losses, kl) of TRL's KTOTrainer (aux loss off): scalar, [B] in TRL's order, scalar.

    kl = max(mean(policy_KL_logps - reference_KL_logps), 0) (detached; 0 for "apo_zero_unpaired", which computes no
    KL). The KL logps are the summed logps of the mismatched completions (trl_kto_kl_completion_index) under the
    policy (no_grad) and the reference. With lr = policy_logps - reference_logps:
    "kto": desirable 1 - sigmoid(beta (lr - kl)), undesirable 1 - sigmoid(beta (kl - lr));
    "apo_zero_unpaired": desirable 1 - sigmoid(beta lr), undesirable sigmoid(beta lr).
    losses = concat(desirable_weight * desirable losses, undesirable_weight * undesirable losses): ALL DESIRABLE
    EXAMPLES FIRST, each group in batch order (order = concat(flatnonzero(desirable), flatnonzero(~desirable)) maps
    them back). loss = nanmean(losses): a plain mean over the B examples, NOT normalised by the weights.
    """
    policy_logps, reference_logps = _f(policy_logps), _f(reference_logps)
    bool_labels = np.asarray(desirable, dtype=bool)
    chosen_idx = np.flatnonzero(bool_labels)
    rejected_idx = np.flatnonzero(~bool_labels)
    chosen_logps, rejected_logps = policy_logps[chosen_idx], policy_logps[rejected_idx]
    ref_chosen_logps, ref_rejected_logps = reference_logps[chosen_idx], reference_logps[rejected_idx]
    if loss_type not in ("kto", "apo_zero_unpaired"):
        raise ValueError(f"Unknown loss type: {loss_type}")
    kl = _kto_kl(policy_KL_logps, reference_KL_logps, loss_type)
    if chosen_logps.shape[0] != 0 or ref_chosen_logps.shape[0] != 0:
        chosen_logratios = chosen_logps - ref_chosen_logps
        if loss_type == "kto":
            chosen_losses = 1 - _sigmoid(beta * (chosen_logratios - kl))
        else:
            chosen_losses = 1 - _sigmoid(beta * chosen_logratios)
    else:
        chosen_losses = np.zeros(0)
    if rejected_logps.shape[0] != 0 or ref_rejected_logps.shape[0] != 0:
        rejected_logratios = rejected_logps - ref_rejected_logps
        if loss_type == "kto":
            rejected_losses = 1 - _sigmoid(beta * (kl - rejected_logratios))
        else:
            rejected_losses = _sigmoid(beta * rejected_logratios)
    else:
        rejected_losses = np.zeros(0)
    losses = np.concatenate((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    with np.errstate(invalid="ignore"):
        loss = np.float64(np.nanmean(losses)) if np.any(~np.isnan(losses)) else np.float64(np.nan)
    return loss, losses, kl


# Same source as trl_kto_loss; the gradient autograd gives (kl constant: computed under no_grad and detached).
def trl_kto_loss_grad(
    policy_logps,
    reference_logps,
    desirable,
    policy_KL_logps=None,
    reference_KL_logps=None,
    beta=0.1,
    desirable_weight=1.0,
    undesirable_weight=1.0,
    loss_type="kto",
):
    """d loss / d policy_logps, [B] in the ORIGINAL batch order, for the scalar of trl_kto_loss.

    With z the sigmoid's argument and s = sigmoid(z): desirable -desirable_weight * beta s (1 - s) / N, undesirable
    +undesirable_weight * beta s (1 - s) / N (z = beta (kl - lr) for kto, beta lr for apo_zero_unpaired), N the
    number of non-NaN losses (nanmean).
    """
    policy_logps, reference_logps = _f(policy_logps), _f(reference_logps)
    bool_labels = np.asarray(desirable, dtype=bool)
    kl = _kto_kl(policy_KL_logps, reference_KL_logps, loss_type)
    lr = policy_logps - reference_logps
    if loss_type == "kto":
        s_c, s_r = _sigmoid(beta * (lr - kl)), _sigmoid(beta * (kl - lr))
    else:
        s_c = s_r = _sigmoid(beta * lr)
    grad = np.where(
        bool_labels, -desirable_weight * beta * s_c * (1.0 - s_c), undesirable_weight * beta * s_r * (1.0 - s_r)
    )
    _, losses, _ = trl_kto_loss(
        policy_logps,
        reference_logps,
        desirable,
        policy_KL_logps,
        reference_KL_logps,
        beta,
        desirable_weight,
        undesirable_weight,
        loss_type,
    )
    n = np.sum(~np.isnan(losses))
    return grad / n


# --------------------------------------------------------------------------------------------------------------
# Liger-Kernel
# --------------------------------------------------------------------------------------------------------------
# Source read: linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c (2026-08-21): files
# src/liger_kernel/chunked_loss/dpo_loss.py (last changed in 9497a29b79838b30a82f2174685afa65ff122f7c),
# fused_linear_preference.py (af1fe545517660f8c1f2e7e1f6ea5d46b3186235), orpo_loss.py and kto_loss.py (both
# 9a5d7ba53baf496cfb49f068e47454a5b0a24f1b), fused_linear_unpaired_preference.py
# (ee5aaf26b934808504f71ee4d20614358fa3cdbf). Liger's targets are already shifted by the caller; `mask` below is
# target != ignore_index.


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, src/liger_kernel/chunked_loss/dpo_loss.py,
# LigerFusedLinearDPOFunction.preference_loss_fn lines 46-58 (references, rewards, logits_diff), exo_pair 74-87,
# bco_pair 108-110, discopop 139-145; per pair, before `losses.sum() / n_pairs`. Defaults (lines 9-19, 166-176,
# 249-261): beta 0.1, label_smoothing 0.0, discopop_tau 0.05, average_log_prob False (summed logps).
def liger_dpo_kind_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta=0.1,
    label_smoothing=0.0,
    discopop_tau=0.05,
):
    """(losses [B], chosen_rewards [B], rejected_rewards [B]) of Liger's DPO kernel for bco_pair, exo_pair, discopop.

    The same formulas as TRL's reverse_kl: bco_pair -logsigmoid(beta u) - logsigmoid(-beta v); exo_pair (ValueError
    for ls <= 0, also at the module's construction) and discopop on x = beta (u - v). Missing references (None,
    use_ref_model=False) are 0. The kernel's loss is losses.sum() / (full_target.shape[0] // 2), the mean over all
    pairs of the call. "sigmoid_norm" and "ipo" are not Liger loss types (ipo raises NotImplementedError, anything
    else ValueError).
    """
    chosen_logps, rejected_logps = _f(chosen_logps), _f(rejected_logps)
    ref_chosen_logps = np.float64(0.0) if ref_chosen_logps is None else _f(ref_chosen_logps)
    ref_rejected_logps = np.float64(0.0) if ref_rejected_logps is None else _f(ref_rejected_logps)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_rewards = beta * chosen_logratios
    rejected_rewards = beta * rejected_logratios
    logits_diff = beta * (chosen_logratios - rejected_logratios)
    if loss_type == "exo_pair":
        if label_smoothing <= 0.0:
            raise ValueError("label_smoothing must be > 0 for loss_type='exo_pair'. The EXO paper recommends 1e-3.")
        epsilon = np.float64(label_smoothing)
        qw = _sigmoid(logits_diff)
        log_qw = _logsigmoid(logits_diff)
        log_pw = np.log1p(-epsilon)
        ql = _sigmoid(-logits_diff)
        log_ql = _logsigmoid(-logits_diff)
        log_pl = np.log(epsilon)
        losses = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
    elif loss_type == "bco_pair":
        losses = -_logsigmoid(chosen_rewards) - _logsigmoid(-rejected_rewards)
    elif loss_type == "discopop":
        log_ratio_modulation = _sigmoid(logits_diff / discopop_tau)
        logistic_component = -_logsigmoid(logits_diff)
        exp_component = np.exp(-logits_diff)
        losses = logistic_component * (1 - log_ratio_modulation) + exp_component * log_ratio_modulation
    elif loss_type == "ipo":
        raise NotImplementedError(
            "loss_type='ipo' is not yet supported by Liger DPO because it requires per-sample completion-token "
            "counts to length-normalize the squared margin."
        )
    elif loss_type in ("sigmoid", "hinge", "nca_pair", "robust", "sppo_hard", "apo_zero", "apo_down"):
        raise NotImplementedError(f"{loss_type!r}: see tests/preference_oracles.py liger_dpo_loss")
    else:
        raise ValueError(
            f"Unsupported loss_type: {loss_type}. Supported types are: sigmoid, hinge, exo_pair, nca_pair, "
            "robust, bco_pair, sppo_hard, apo_zero, apo_down, discopop"
        )
    return losses, chosen_rewards, rejected_rewards


# Same source as liger_dpo_kind_loss; the gradient autograd (torch.func.grad) gives.
def liger_dpo_kind_loss_grad(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta=0.1,
    label_smoothing=0.0,
    discopop_tau=0.05,
):
    """(d losses[i] / d chosen_logps[i], d losses[i] / d rejected_logps[i]): TRL's reverse_kl formulas
    (trl_dpo_kind_loss_grad); the kernel's loss divides the sum by n_pairs, so divide these by B."""
    # Same checks as the value (ValueError / NotImplementedError for the kinds Liger rejects or not transcribed here).
    liger_dpo_kind_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, loss_type, beta, 0.5)
    if loss_type == "exo_pair" and label_smoothing <= 0.0:
        raise ValueError("label_smoothing must be > 0 for loss_type='exo_pair'. The EXO paper recommends 1e-3.")
    ref_c = np.zeros_like(_f(chosen_logps)) if ref_chosen_logps is None else ref_chosen_logps
    ref_r = np.zeros_like(_f(rejected_logps)) if ref_rejected_logps is None else ref_rejected_logps
    return trl_dpo_kind_loss_grad(
        chosen_logps, rejected_logps, ref_c, ref_r, loss_type, beta, label_smoothing, discopop_tau
    )


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, src/liger_kernel/chunked_loss/
# fused_linear_preference.py, LigerFusedLinearPreferenceBase.chunk_forward lines 293-303 (F.nll_loss with
# reduction="sum", ignore_index) and _compute_loss lines 386-389 (divided by the count of non-ignored chosen targets
# of the FULL batch) and 425 (`loss = alpha * chosen_nll_loss + preference_loss`, alpha default 1.0).
def liger_chosen_nll(chosen_per_token_logps, chosen_mask):
    """Liger's chosen NLL: -sum of the chosen rows' kept-token log-probs / their count (token mean over the batch).

    The tokens are those of nll_target when given, else of the preference target (the response tokens); the count is
    of the same array's chosen half. Chunking does not change it (each chunk's sum is divided by the full count).
    Empty -> 0/0 = NaN. compute_nll_loss defaults to False for DPO (LigerFusedLinearDPOLoss) and to True for ORPO.
    """
    mask = _f(chosen_mask) != 0
    per_token = np.where(mask, _f(chosen_per_token_logps), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.float64(-per_token.sum() / mask.sum())


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, src/liger_kernel/chunked_loss/orpo_loss.py,
# LigerFusedLinearORPOFunction.preference_loss_fn lines 31-35 and forward lines 46-89 (compute_nll_loss=True,
# average_log_prob left at the base's True), with fused_linear_preference.py chunk_forward lines 305-312 and
# _compute_loss lines 386-389, 425 (alpha=1.0).
def liger_orpo_total_loss(
    chosen_per_token_logps,
    chosen_mask,
    rejected_per_token_logps,
    rejected_mask,
    beta=0.1,
    chosen_nll_mask=None,
    compute_nll_loss=True,
):
    """Scalar loss of LigerFusedLinearORPOLoss: nll - beta * sum(logsigmoid(log_odds)) / n_pairs.

    c, r token-averaged ((lp * mask).sum(-1) / mask.sum(-1)); log_odds = (c - r) - (log1p(-exp(c)) - log1p(-exp(r)))
    (no log1mexp branch). nll = liger_chosen_nll over chosen_nll_mask (the nll_target's kept tokens; defaults to
    chosen_mask, the preference target, which is Liger's default), 0 when compute_nll_loss=False.
    """
    chosen_per_token_logps, rejected_per_token_logps = _f(chosen_per_token_logps), _f(rejected_per_token_logps)
    chosen_mask, rejected_mask = _f(chosen_mask) != 0, _f(rejected_mask) != 0
    chosen_nll_loss = 0.0
    if compute_nll_loss:
        nll_mask = chosen_mask if chosen_nll_mask is None else chosen_nll_mask
        chosen_nll_loss = liger_chosen_nll(chosen_per_token_logps, nll_mask)
    with np.errstate(invalid="ignore", divide="ignore"):
        chosen_logps = (chosen_per_token_logps * chosen_mask).sum(-1) / chosen_mask.sum(-1)
        rejected_logps = (rejected_per_token_logps * rejected_mask).sum(-1) / rejected_mask.sum(-1)
        log_odds = (chosen_logps - rejected_logps) - (
            np.log1p(-np.exp(chosen_logps)) - np.log1p(-np.exp(rejected_logps))
        )
    ratio = _logsigmoid(log_odds)
    preference_loss = -beta * ratio.sum() / chosen_logps.shape[0]
    return np.float64(1.0 * chosen_nll_loss + preference_loss)


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, src/liger_kernel/chunked_loss/kto_loss.py,
# LigerFusedLinearKTOFunction.preference_loss_fn lines 55-69 (defaults beta 0.1, kl None; module defaults
# use_ref_model False, average_log_prob False, lines 156-163), with fused_linear_unpaired_preference.py
# chunk_forward lines 222-256 (summed logps by default) at chunk_size=1 (the default).
def liger_kto_loss(policy_logps, reference_logps, preference_labels, beta=0.1, kl=None):
    """(loss, losses [B], chosen_rewards_sum, rejected_rewards_sum) of Liger's KTO kernel, batch order kept.

    lr = policy_logps - reference_logps (policy_logps alone when reference_logps is None, use_ref_model=False);
    m = +1 desirable, -1 undesirable; losses = 1 - sigmoid(beta (lr - kl) m) (1 - sigmoid(beta lr m) when kl is
    None). kl is used AS GIVEN: no clamp, no detach inside the kernel, and no desirable / undesirable weights.
    loss = losses.sum() / B. The reward sums are sum(beta lr) over the desirable / undesirable examples (at
    chunk_size=1; with larger chunks the kernel's rewards * labels.unsqueeze(1) broadcasts to [chunk, chunk]).
    """
    policy_logps = _f(policy_logps)
    labels = np.asarray(preference_labels, dtype=bool)
    if reference_logps is not None:
        logratios_chunk = policy_logps - _f(reference_logps)
    else:
        logratios_chunk = policy_logps
    multiplier_chunk = np.where(labels, 1.0, -1.0)
    if kl is not None:
        losses = 1 - _sigmoid(beta * (logratios_chunk - _f(kl)) * multiplier_chunk)
    else:
        losses = 1 - _sigmoid(beta * logratios_chunk * multiplier_chunk)
    rewards = beta * logratios_chunk
    chosen_rewards_sum = np.float64(rewards[labels].sum())
    rejected_rewards_sum = np.float64(rewards[~labels].sum())
    return np.float64(losses.sum() / policy_logps.shape[0]), losses, chosen_rewards_sum, rejected_rewards_sum


# Same source; the gradient autograd (torch.func.grad) gives w.r.t. the policy logps (kl a constant here).
def liger_kto_loss_grad(policy_logps, reference_logps, preference_labels, beta=0.1, kl=None):
    """d loss / d policy_logps, [B]: -beta m s (1 - s) / B, s = sigmoid(beta (lr - kl) m)."""
    policy_logps = _f(policy_logps)
    labels = np.asarray(preference_labels, dtype=bool)
    lr = policy_logps - (0.0 if reference_logps is None else _f(reference_logps))
    m = np.where(labels, 1.0, -1.0)
    s = _sigmoid(beta * (lr - (0.0 if kl is None else _f(kl))) * m)
    return -beta * m * s * (1.0 - s) / policy_logps.shape[0]


# --------------------------------------------------------------------------------------------------------------
# Where TRL 1.16.0, TRL@f2cd577 and Liger (ead96b6) disagree
# --------------------------------------------------------------------------------------------------------------
# 1. f-divergence scores: f2cd577 drops the constants (forward_kl -exp(-r), js logsigmoid(r), alpha exp(t) / (a - 1));
#    1.16.0 keeps them (1 - exp(-r), log 2 + logsigmoid(r), (exp(t) - 1) / (a - 1)). Same h = S(u) - S(v) for sigmoid,
#    hinge, robust, exo_pair, discopop; different for ipo and sigmoid_norm, which divide each side by its own length
#    before differencing (the constant c gives c (1 / n_c - 1 / n_r)). Both clamp the alpha exponent (a - 1) r at 80
#    (float32 / bfloat16; 11 for float16; float64 has no entry) and fall back to reverse_kl for |a - 1| < 1e-6.
# 2. Which kinds take the scores: at f2cd577 every kind accepts any f_divergence_type, and nca_pair, bco_pair,
#    sppo_hard use the per-side scores (apo_zero the log-ratios, apo_down the chosen log-ratio and delta_score). 1.16.0
#    (__init__ lines 810-815) accepts a non-default type only for sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust,
#    discopop, sft, and nca_pair, bco_pair, sppo_hard, apo_down use the plain log-ratios. With reverse_kl the two
#    versions' losses are identical for all kinds here.
# 3. sft / NLL: f2cd577 computes F.cross_entropy of the chosen shifted logits at the masked positions, 1.16.0
#    -mean(per_token_logps[mask]) from the fused head: the same number (token mean over all chosen completion tokens).
#    WPO weights multiply every kind, sft included, in both versions (sft + use_weighting fails in torch for B > 1).
#    WPO's log sum_v p_v^2 comes from the full logits at f2cd577 and from the fused head (same value) at 1.16.0.
# 4. Lengths: ipo / sigmoid_norm divide by the UNSHIFTED completion_mask's row sums (clamp 1); WPO by the SHIFTED
#    mask's row sums (clamp_min 1). Liger has neither ipo nor sigmoid_norm nor f-divergences nor WPO.
# 5. Liger DPO kinds (bco_pair, exo_pair, discopop) match TRL's reverse_kl formulas. Liger's DPO sums the token
#    logps by default (average_log_prob=False), like TRL; its NLL term is off by default (compute_nll_loss=False) and
#    when on is alpha * (token mean over the chosen targets), added to the pair-mean preference loss. TRL 1.16.0's DPO
#    no longer calls LigerFusedLinearDPOLoss (use_liger_kernel is deprecated; its own fused head is used);
#    f2cd577's Liger path constructs LigerFusedLinearDPOLoss(beta, loss_type) only, so label_smoothing and
#    discopop_tau stay at the kernel defaults (exo_pair raises there).
# 6. ORPO: unchanged between f2cd577 and 1.16.0. TRL: nll over prompt + response (attention mask), log1mexp with the
#    -ln 2 branch, float32 logps, loss = nll - mean(beta logsigmoid). Liger: nll over the target (response) unless
#    nll_target is passed, log1p(-exp(x)), loss = nll - beta * sum(logsigmoid) / n_pairs (the same total form).
# 7. KTO: TRL's loss block is identical in f2cd577 and 1.16.0 (kl = clamp(mean(KL_policy - KL_ref), min=0), detached;
#    losses ordered desirable-first; desirable_weight / undesirable_weight; nanmean over B). Liger's kernel takes kl as
#    given (no clamp), has no class weights, keeps the batch order and divides the sum by B (no NaN skipping).
#    f2cd577's Liger KTO path (absent in 1.16.0) passes TRL's clamped kl, so the weights are ignored there, and it
#    builds LigerFusedLinearKTOLoss(beta, use_ref_model=(ref_model is not None)): with a PEFT model and no ref_model
#    the kernel uses the policy logps alone as the log-ratio.
