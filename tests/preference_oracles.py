"""NumPy float64 transcriptions of peer libraries' preference-optimisation losses (DPO and its variants, CPO/SimPO,
ORPO), used only as test oracles.

Same rules as tests/rl_oracles.py: each function is a line-by-line transcription of a named function in TRL
(huggingface/trl) or Liger-Kernel (linkedin/Liger-Kernel), read at the commit cited above it, never written from this
package's code. Torch operations are replaced by their NumPy equivalents; `.detach()` only shows up in the separate
`*_grad` functions, which give by hand, in closed form, what torch autograd gives for the peer's code w.r.t. the
policy's per-sequence chosen and rejected log-probabilities (the reference log-probabilities are constants there).
Anything that only matters for distributed runs (accelerator gathers, process counts) is left at its single-process
value, and the peers' float32 casts are float64 here. "logps" below are per-sequence log-probabilities, [B] each;
row i of the chosen and rejected arrays forms pair i.
"""

import numpy as np

# --------------------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------------------
# Source read: huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24, VERSION 1.10.0.dev0),
# files trl/trainer/dpo_trainer.py (last changed in d2b72b720286f7f2a932df9146550969957fb9b6),
# trl/trainer/dpo_config.py, trl/experimental/cpo/cpo_trainer.py and trl/experimental/orpo/orpo_trainer.py (both last
# changed in 3b0ecdf8ced52291ee8329e6ca2a6cab59c4a3a9). `DPOTrainer.dpo_loss` no longer exists at that commit: the
# "Refactor DPO (#3906)" commit e3b7897c873f94c26bf1a661df19e428239be114 (2026-02-19) removed it together with
# `concatenated_forward`, `reference_free` and `rpo_alpha`, and moved the loss branches inline into
# `DPOTrainer._compute_loss`, which is what is transcribed here. The old reference_free=True is reproduced by passing
# zeros as the reference log-probabilities.


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _logsigmoid(x):
    # torch.nn.functional.logsigmoid, computed stably as -softplus(-x).
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_logsigmoid(x))


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss
# (and compute_ref_log_probs), the per_token_logps -> logps statements (ld_alpha=None, the default).
def trl_sequence_logps(per_token_logps, mask, loss_type="sigmoid"):
    """Per-sequence log-probability of TRL's DPOTrainer: the SUM of the completion tokens' log-probabilities.

    TRL sets per_token_logps[shift_completion_mask == 0] = 0.0 (an assignment: NaN or inf outside the mask is dropped)
    and sums over the sequence; `mask` here is that shifted completion mask ([B, T], aligned with per_token_logps).
    An empty row gives 0. The sum is used for EVERY loss_type at this commit, "ipo" and "sigmoid_norm" included:
    those two divide the summed log-ratios by the completion length inside the loss (see trl_dpo_loss), so
    loss_type does not change anything here. Before e3b7897c, concatenated_forward divided the logps of both the
    policy and the reference by loss_mask.sum(-1) (no clamp) when "ipo" was among the loss types.
    """
    per_token_logps = _f(per_token_logps)
    return np.where(_f(mask) == 0, 0.0, per_token_logps).sum(axis=1)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss
# from "chosen_logratios = ..." to the end of one iteration of the loss_type loop (f_divergence_type="reverse_kl",
# use_weighting=False, before per_sequence_loss.mean()), plus the exo_pair check of DPOTrainer.__init__ and the
# rewards of the "Log the metrics" block.
def trl_dpo_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta,
    label_smoothing=0.0,
    chosen_lengths=None,
    rejected_lengths=None,
    discopop_tau=0.05,
):
    """(losses [B], chosen_rewards [B], rejected_rewards [B]) of TRL's DPO trainer for one loss_type.

    u = chosen_logps - ref_chosen_logps and v likewise, on SUMMED token logps (trl_sequence_logps); x = beta (u - v).
    label_smoothing (ls) is used only by robust ((-(1 - ls) logsigmoid(x) + ls logsigmoid(-x)) / (1 - 2 ls); TRL only
    warns outside [0, 0.5)), exo_pair (ValueError at ls == 0.0) and aot/aot_unpaired (cDPO form on the batch-sorted
    differences); "sigmoid" is plain -logsigmoid(x) and IGNORES ls (the cDPO form went with the refactor). bco_pair has
    no running-mean shift any more; nca_pair, bco_pair, sppo_hard and apo_* use u and v separately; discopop mixes with
    m = sigmoid(x / discopop_tau). ipo: d = u / clamp(n_c, min=1) - v / clamp(n_r, min=1), loss (d - 1 / (2 beta))**2
    (IPO on per-token averaged log-ratios, beta = the paper's tau); sigmoid_norm: -logsigmoid(beta d). n_c, n_r
    (chosen_lengths, rejected_lengths) are row sums of TRL's UNSHIFTED completion_mask (equal to the shifted mask's
    counts unless a completion starts at position 0).
    "sft" (cross-entropy of the chosen tokens from the logits) raises NotImplementedError here. Rewards are
    beta * u and beta * v (detached in TRL), from the summed logps for every loss type, ipo included. The step loss is
    sum_k loss_weights[k] * per_sequence_loss_k.mean() over the configured loss_types (weights default to 1.0).
    """
    chosen_logps, rejected_logps = _f(chosen_logps), _f(rejected_logps)
    ref_chosen_logps, ref_rejected_logps = _f(ref_chosen_logps), _f(ref_rejected_logps)
    if loss_type == "exo_pair" and label_smoothing == 0.0:
        raise ValueError("Label smoothing must be greater than 0.0 when using 'exo_pair' loss.")
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = chosen_logratios, rejected_logratios  # f_divergence_type == "reverse_kl"
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
        ipo_delta = chosen_avg_score - rejected_avg_score
        if loss_type == "ipo":
            per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
        else:
            per_sequence_loss = -_logsigmoid(beta * ipo_delta)
    elif loss_type == "exo_pair":
        epsilon = np.float64(label_smoothing)
        qw, log_qw, log_pw = _sigmoid(beta * delta_score), _logsigmoid(beta * delta_score), np.log1p(-epsilon)
        ql, log_ql, log_pl = _sigmoid(-beta * delta_score), _logsigmoid(-beta * delta_score), np.log(epsilon)
        per_sequence_loss = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
    elif loss_type == "nca_pair":
        chosen_rewards, rejected_rewards = beta * chosen_scores, beta * rejected_scores
        per_sequence_loss = (
            -_logsigmoid(chosen_rewards) - 0.5 * _logsigmoid(-chosen_rewards) - 0.5 * _logsigmoid(-rejected_rewards)
        )
    elif loss_type == "robust":
        clean_loss_term = -(1 - label_smoothing) * _logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * _logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
    elif loss_type == "bco_pair":
        chosen_rewards, rejected_rewards = beta * chosen_scores, beta * rejected_scores
        per_sequence_loss = -_logsigmoid(chosen_rewards) - _logsigmoid(-rejected_rewards)
    elif loss_type == "sppo_hard":
        per_sequence_loss = (chosen_scores - 0.5 / beta) ** 2 + (rejected_scores + 0.5 / beta) ** 2
    elif loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            delta = np.sort(chosen_logps - rejected_logps, axis=0) - np.sort(ref_chosen_logps - ref_rejected_logps, 0)
        else:
            delta = np.sort(chosen_logratios, axis=0) - np.sort(rejected_logratios, axis=0)
        smoothed = _logsigmoid(-beta * delta) * label_smoothing
        per_sequence_loss = -_logsigmoid(beta * delta) * (1 - label_smoothing) - smoothed
    elif loss_type == "apo_zero":
        per_sequence_loss = (1 - _sigmoid(beta * chosen_logratios)) + _sigmoid(beta * rejected_logratios)
    elif loss_type == "apo_down":
        per_sequence_loss = _sigmoid(beta * chosen_logratios) + (1 - _sigmoid(beta * delta_score))
    elif loss_type == "discopop":
        logits = delta_score * beta
        log_ratio_modulation = _sigmoid(logits / discopop_tau)
        logistic_component, exp_component = -_logsigmoid(logits), np.exp(-logits)
        per_sequence_loss = logistic_component * (1 - log_ratio_modulation) + exp_component * log_ratio_modulation
    elif loss_type == "sft":
        raise NotImplementedError("TRL's 'sft' term is a token cross-entropy of the chosen logits, not of the logps")
    else:
        raise ValueError(f"Unknown loss type: {loss_type}")
    return per_sequence_loss, beta * chosen_logratios, beta * rejected_logratios


# Same source as trl_dpo_loss; the gradient torch autograd gives (references constant, relu'(0) = 0).
def trl_dpo_loss_grad(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta,
    label_smoothing=0.0,
    chosen_lengths=None,
    rejected_lengths=None,
    discopop_tau=0.05,
):
    """(d losses[i] / d chosen_logps[i], d losses[i] / d rejected_logps[i]), each [B], for trl_dpo_loss.

    Per-pair derivatives of the per_sequence_loss; the step loss is its mean, so divide by B (and multiply by the
    loss weight). For the losses of x = beta * (u - v), with q = sigmoid(x): d/dchosen = beta * g, d/drejected =
    -beta * g, where g is q - 1 (sigmoid), -[1 - x > 0] (hinge), ((1 - ls)(q - 1) - ls q) / (1 - 2 ls) (robust),
    q (1 - q) (x - log1p(-ls) + log(ls)) (exo_pair). "aot"/"aot_unpaired" (the sort permutes the pairs) and "sft"
    raise NotImplementedError.
    """
    u = _f(chosen_logps) - _f(ref_chosen_logps)
    v = _f(rejected_logps) - _f(ref_rejected_logps)
    x = beta * (u - v)
    q = _sigmoid(x)
    ls = label_smoothing
    if loss_type in ("sigmoid", "hinge", "robust", "exo_pair", "discopop", "apo_down"):
        if loss_type == "sigmoid":
            g = q - 1.0
        elif loss_type == "hinge":
            g = -((1.0 - x) > 0).astype(np.float64)
        elif loss_type == "robust":
            g = ((1 - ls) * (q - 1.0) - ls * q) / (1 - 2 * ls)
        elif loss_type == "exo_pair":
            if ls == 0.0:
                raise ValueError("Label smoothing must be greater than 0.0 when using 'exo_pair' loss.")
            g = q * (1.0 - q) * (x - np.log1p(-ls) + np.log(ls))
        elif loss_type == "discopop":
            m = _sigmoid(x / discopop_tau)
            dm = m * (1.0 - m) / discopop_tau
            g = (q - 1.0) * (1.0 - m) + _logsigmoid(x) * dm - np.exp(-x) * m + np.exp(-x) * dm
        else:  # apo_down: sigmoid(beta u) + 1 - sigmoid(x)
            qu = _sigmoid(beta * u)
            return beta * qu * (1.0 - qu) - beta * q * (1.0 - q), beta * q * (1.0 - q)
        return beta * g, -beta * g
    if loss_type in ("ipo", "sigmoid_norm"):
        n_c, n_r = np.maximum(_f(chosen_lengths), 1.0), np.maximum(_f(rejected_lengths), 1.0)
        d = u / n_c - v / n_r
        g = 2.0 * (d - 1.0 / (2.0 * beta)) if loss_type == "ipo" else beta * (_sigmoid(beta * d) - 1.0)
        return g / n_c, -g / n_r
    qu, qv = _sigmoid(beta * u), _sigmoid(beta * v)
    if loss_type == "nca_pair":
        return beta * (qu - 1.0 + 0.5 * qu), beta * 0.5 * qv
    if loss_type == "bco_pair":
        return beta * (qu - 1.0), beta * qv
    if loss_type == "sppo_hard":
        return 2.0 * (u - 0.5 / beta), 2.0 * (v + 0.5 / beta)
    if loss_type == "apo_zero":
        return -beta * qu * (1.0 - qu), beta * qv * (1.0 - qv)
    raise NotImplementedError(f"no closed-form per-pair gradient for loss_type {loss_type!r}")


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss,
# the "Rewards for chosen and rejected completions" / "Reward accuracy" / "Reward margins" / logps metrics.
def trl_dpo_metrics(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    """The reward metrics TRL's DPO logs for one step (one process): plain means over the B pairs.

    rewards/chosen = mean(beta * u), rewards/rejected = mean(beta * v), rewards/accuracies = mean of the strict
    beta * u > beta * v (a tie counts 0), rewards/margins = mean(beta * (u - v)), logps/chosen and logps/rejected the
    means of the summed policy logps. The same for every loss type (no length normalization for ipo). Each value is
    appended per step and `log` averages the appended values (a mean of step means).
    """
    chosen_rewards = beta * (_f(chosen_logps) - _f(ref_chosen_logps))
    rejected_rewards = beta * (_f(rejected_logps) - _f(ref_rejected_logps))
    return {
        "rewards/chosen": np.float64(chosen_rewards.mean()),
        "rewards/rejected": np.float64(rejected_rewards.mean()),
        "rewards/accuracies": np.float64((chosen_rewards > rejected_rewards).astype(np.float64).mean()),
        "rewards/margins": np.float64((chosen_rewards - rejected_rewards).mean()),
        "logps/chosen": np.float64(_f(chosen_logps).mean()),
        "logps/rejected": np.float64(_f(rejected_logps).mean()),
    }


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/experimental/cpo/cpo_trainer.py and
# trl/experimental/orpo/orpo_trainer.py, CPOTrainer.get_batch_logps / ORPOTrainer.get_batch_logps after the shift
# (labels[:, 1:], logits[:, :-1]; is_encoder_decoder=False).
def trl_get_batch_logps(per_token_logps, mask, average_log_prob):
    """(per_token_logps * mask).sum(-1), divided by mask.sum(-1) when average_log_prob (no clamp: empty row -> NaN).

    mask is labels[:, 1:] != -100 (the prompt and padding are -100). A multiplication, not a where: NaN outside the
    mask propagates (TRL's masked positions hold the finite log-prob of the dummy label 0). CPO averages for loss_type
    "ipo" and "simpo" and sums otherwise; ORPO always averages.
    """
    per_token_logps, mask = _f(per_token_logps), _f(mask)
    with np.errstate(invalid="ignore", divide="ignore"):
        if average_log_prob:
            return (per_token_logps * mask).sum(-1) / mask.sum(-1)
        return (per_token_logps * mask).sum(-1)


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/experimental/cpo/cpo_trainer.py, CPOTrainer.cpo_loss
# (alpha=0.0, the default: no AlphaPO reward transform).
def trl_cpo_loss(policy_chosen_logps, policy_rejected_logps, loss_type, beta, label_smoothing=0.0, simpo_gamma=0.5):
    """(losses, chosen_rewards, rejected_rewards) of TRL's CPO trainer; no reference model.

    logits = chosen - rejected (token-averaged logps for "simpo"/"ipo", sums for "sigmoid"/"hinge"); "simpo" first
    subtracts gamma / beta. sigmoid and simpo: -(1 - ls) logsigmoid(beta logits) - ls logsigmoid(-beta logits);
    hinge relu(1 - beta logits); ipo (logits - 1 / (2 beta))**2 (ls ignored, with a warning). Rewards beta * logps.
    The step loss is losses.mean() + cpo_alpha * nll (cpo_alpha defaults to 1.0; nll = CrossEntropyLoss of the
    chosen rows, mean over labels != -100).
    """
    policy_chosen_logps, policy_rejected_logps = _f(policy_chosen_logps), _f(policy_rejected_logps)
    logits = policy_chosen_logps - policy_rejected_logps
    if loss_type in ("simpo", "sigmoid"):
        if loss_type == "simpo":
            gamma_logratios = simpo_gamma / beta
            logits = logits - gamma_logratios
        losses = -_logsigmoid(beta * logits) * (1 - label_smoothing) - _logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "hinge":
        losses = np.maximum(1 - beta * logits, 0.0)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', 'simpo']")
    return losses, beta * policy_chosen_logps, beta * policy_rejected_logps


# Same source as trl_cpo_loss, loss_type="simpo".
def trl_simpo_loss(policy_chosen_logps, policy_rejected_logps, beta, simpo_gamma, label_smoothing=0.0):
    """SimPO in TRL: -(1 - ls) logsigmoid(beta (c - r - gamma / beta)) - ls logsigmoid(-beta (c - r - gamma / beta)).

    c, r are token-AVERAGED logps (trl_get_batch_logps with average_log_prob=True), so the margin gamma is in reward
    units: beta * (c - r) - gamma. Returns (losses, beta * c, beta * r).
    """
    return trl_cpo_loss(policy_chosen_logps, policy_rejected_logps, "simpo", beta, label_smoothing, simpo_gamma)


# Same source; the gradient autograd gives.
def trl_simpo_loss_grad(policy_chosen_logps, policy_rejected_logps, beta, simpo_gamma, label_smoothing=0.0):
    """(d losses[i] / d c[i], d losses[i] / d r[i]) = (beta (q - 1 + ls), -beta (q - 1 + ls)), q = sigmoid(beta l)."""
    logits = _f(policy_chosen_logps) - _f(policy_rejected_logps) - simpo_gamma / beta
    g = beta * (_sigmoid(beta * logits) - 1.0 + label_smoothing)
    return g, -g


def _trl_log1mexp(x):
    # trl/experimental/orpo/orpo_trainer.py, log1mexp: log(1 - exp(x)), branching at -ln 2.
    t = -0.6931471805599453
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(x < t, np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/experimental/orpo/orpo_trainer.py,
# ORPOTrainer.odds_ratio_loss (and log1mexp).
def trl_orpo_odds_ratio_loss(policy_chosen_logps, policy_rejected_logps, beta):
    """(losses, chosen_rewards, rejected_rewards, log_odds), each [B], of TRL's ORPO odds-ratio term.

    log_odds = (c - r) - (log1mexp(c) - log1mexp(r)), log1mexp(x) = log1p(-exp(x)) for x < -ln 2 else
    log(-expm1(x)); losses = +beta * logsigmoid(log_odds) (a quantity to MAXIMISE: the step loss is
    nll - losses.mean(), nll = CrossEntropyLoss over the whole prompt + response of the chosen rows). c, r are
    token-AVERAGED response logps (average_log_prob=True, mask labels != -100), cast to float32 in TRL. Rewards
    beta * c, beta * r. TRL itself returns mean(logsigmoid(log_odds)) and mean(log_odds) as the 4th and 5th items,
    logged as "log_odds_ratio" and "log_odds_chosen" respectively; log_odds is returned per pair here.
    """
    policy_chosen_logps, policy_rejected_logps = _f(policy_chosen_logps), _f(policy_rejected_logps)
    log_odds = (policy_chosen_logps - policy_rejected_logps) - (
        _trl_log1mexp(policy_chosen_logps) - _trl_log1mexp(policy_rejected_logps)
    )
    ratio = _logsigmoid(log_odds)
    losses = beta * ratio
    return losses, beta * policy_chosen_logps, beta * policy_rejected_logps, log_odds


# Same source; the gradient autograd gives (torch.where passes the gradient of the selected branch only).
def trl_orpo_odds_ratio_loss_grad(policy_chosen_logps, policy_rejected_logps, beta):
    """d losses[i] / d c[i] = beta sigmoid(-log_odds) / (1 - exp(c)), d / d r[i] = -beta sigmoid(-log_odds) /
    (1 - exp(r)); the step loss nll - losses.mean() gets -1/B times these."""
    c, r = _f(policy_chosen_logps), _f(policy_rejected_logps)
    log_odds = trl_orpo_odds_ratio_loss(c, r, beta)[3]
    s = beta * _sigmoid(-log_odds)
    return s / -np.expm1(c), -s / -np.expm1(r)


# --------------------------------------------------------------------------------------------------------------
# Liger-Kernel
# --------------------------------------------------------------------------------------------------------------
# Source read: linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c (2026-08-21, pyproject version 0.8.2):
# the dense torch references of test/chunked_loss/test_dpo_loss.py (last changed in
# 9497a29b79838b30a82f2174685afa65ff122f7c), test_cpo_loss.py (23e37726b8571bd829db16add71db9b2ce6b3b97),
# test_simpo_loss.py (reuses TorchLMHeadCPO), test_orpo_loss.py (bf2c67b77e6692a25c36cdc886e61eea74986883) and
# test/utils.py (HFAlignmentLoss), and the kernels' preference_loss_fn in src/liger_kernel/chunked_loss/*_loss.py.


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, test/utils.py, HFAlignmentLoss.get_batch_logps.
def liger_batch_logps(per_token_logps, labels, ignore_index=-100, average_log_prob=True):
    """Liger's reference: no shift; mask = labels != ignore_index; (lp * mask).sum(-1) [/ mask.sum(-1)] (empty -> NaN).

    The references' concatenated_forward/get_batch_loss_metrics default to average_log_prob=True, and the DPO tests
    pass True to both sides; the kernels default to True for SimPO and ORPO but to False (sums) for DPO and CPO.
    """
    per_token_logps = _f(per_token_logps)
    loss_mask = np.asarray(labels) != ignore_index
    with np.errstate(invalid="ignore", divide="ignore"):
        if average_log_prob:
            return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
        return (per_token_logps * loss_mask).sum(-1)


_LIGER_DPO_DEFAULT_LS = {"robust": 0.1, "exo_pair": 1e-3}  # HFRobustLoss / HFEXOPAIRLoss constructor defaults


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, test/chunked_loss/test_dpo_loss.py, alignment_loss
# of HFDPOLoss, HFAPOZeroLoss, HFAPODownLoss, HFSPPPOHARDLoss, HFNCAPAIRLoss, HFHingeLoss, HFBCOPAIRLoss, HFRobustLoss,
# HFEXOPAIRLoss, HFDiscoPOPLoss; and the checks of src/liger_kernel/chunked_loss/dpo_loss.py,
# LigerFusedLinearDPOFunction.preference_loss_fn, whose per-pair expressions are the same.
def liger_dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta,
    label_smoothing=None,
    discopop_tau=0.05,
):
    """(losses [B], chosen_rewards [B], rejected_rewards [B]) of Liger's DPO references (per pair, before reduction).

    u, v, x = beta (u - v) as in trl_dpo_loss, and the same formulas as TRL for sigmoid (no label smoothing either),
    hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop. label_smoothing=None takes
    the reference class default (robust 0.1, exo_pair 1e-3; the kernel's default is 0.0). "ipo" raises
    NotImplementedError (kernel: "requires per-sample completion-token counts"; no reference class exists); the kernel
    raises ValueError for exo_pair with ls <= 0, robust with ls outside [0, 0.5) and any other loss type. The kernel's
    loss is losses.sum() / (full batch // 2), the mean over pairs; the references' is alpha * nll + losses.mean().
    Missing references (use_ref_model=False) are 0 in the kernel.
    """
    ls = _LIGER_DPO_DEFAULT_LS.get(loss_type, 0.0) if label_smoothing is None else label_smoothing
    chosen_logps, rejected_logps = _f(policy_chosen_logps), _f(policy_rejected_logps)
    ref_chosen_logps = 0.0 if ref_chosen_logps is None else _f(ref_chosen_logps)
    ref_rejected_logps = 0.0 if ref_rejected_logps is None else _f(ref_rejected_logps)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    logits_diff = beta * (chosen_logratios - rejected_logratios)
    if loss_type == "sigmoid":
        losses = -_logsigmoid(logits_diff)
    elif loss_type == "hinge":
        losses = np.maximum(1 - logits_diff, 0.0)
    elif loss_type == "ipo":
        raise NotImplementedError("loss_type='ipo' is not yet supported by Liger DPO")
    elif loss_type == "exo_pair":
        if ls <= 0.0:
            raise ValueError("label_smoothing must be > 0 for loss_type='exo_pair'.")
        qw, log_qw, log_pw = _sigmoid(logits_diff), _logsigmoid(logits_diff), np.log1p(-np.float64(ls))
        ql, log_ql, log_pl = _sigmoid(-logits_diff), _logsigmoid(-logits_diff), np.log(np.float64(ls))
        losses = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
    elif loss_type == "nca_pair":
        losses = (
            -_logsigmoid(chosen_rewards) - 0.5 * _logsigmoid(-chosen_rewards) - 0.5 * _logsigmoid(-rejected_rewards)
        )
    elif loss_type == "robust":
        if not (0.0 <= ls < 0.5):
            raise ValueError(f"label_smoothing must lie in [0.0, 0.5) for loss_type='robust'. Got {ls}.")
        clean_loss_term = -(1 - ls) * _logsigmoid(logits_diff)
        flipped_loss_term = -ls * _logsigmoid(-logits_diff)
        losses = (clean_loss_term - flipped_loss_term) / (1 - 2 * ls)
    elif loss_type == "bco_pair":
        losses = -_logsigmoid(chosen_rewards) - _logsigmoid(-rejected_rewards)
    elif loss_type == "sppo_hard":
        a, b = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        losses = (a - 0.5 / beta) ** 2 + (b + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - _sigmoid(beta * chosen_logratios)) + _sigmoid(beta * rejected_logratios)
    elif loss_type == "apo_down":
        losses = _sigmoid(beta * chosen_logratios) + (1 - _sigmoid(beta * (chosen_logratios - rejected_logratios)))
    elif loss_type == "discopop":
        log_ratio_modulation = _sigmoid(logits_diff / discopop_tau)
        logistic_component, exp_component = -_logsigmoid(logits_diff), np.exp(-logits_diff)
        losses = logistic_component * (1 - log_ratio_modulation) + exp_component * log_ratio_modulation
    else:
        raise ValueError(f"Unsupported loss_type: {loss_type}.")
    return losses, chosen_rewards, rejected_rewards


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, test/chunked_loss/test_cpo_loss.py,
# HFCPOLoss.alignment_loss (the reference of both the CPO and the SimPO tests).
def liger_cpo_loss(
    policy_chosen_logps, policy_rejected_logps, beta, label_smoothing=0.0, simpo_gamma=0.5, loss_type="sigmoid"
):
    """Liger's CPO/SimPO reference: TRL's cpo_loss for "sigmoid" and "simpo" (gamma / beta subtracted from c - r).

    -(1 - ls) logsigmoid(beta l) - ls logsigmoid(-beta l), l = c - r (- gamma / beta for simpo); rewards beta * logps.
    TorchLMHeadCPO averages the logps for simpo only. Other loss types raise ValueError.
    """
    c, r = _f(policy_chosen_logps), _f(policy_rejected_logps)
    logits = c - r
    if loss_type == "simpo":
        logits = logits - (simpo_gamma / beta)
    elif loss_type != "sigmoid":
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of ['sigmoid']")
    losses = -_logsigmoid(beta * logits) * (1 - label_smoothing) - _logsigmoid(-beta * logits) * label_smoothing
    return losses, beta * c, beta * r


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c (file last changed in
# 9a5d7ba53baf496cfb49f068e47454a5b0a24f1b), src/liger_kernel/chunked_loss/simpo_loss.py,
# LigerFusedLinearSimPOFunction.preference_loss_fn, per pair (before .sum() / (full_target.shape[0] // 2)).
def liger_simpo_loss(chosen_logps, rejected_logps, beta, gamma, label_smoothing=0.0):
    """Liger kernel's SimPO: logits = beta (c - r) - gamma (gamma NOT divided by beta), then the cDPO form.

    Equal to TRL's beta (c - r - gamma / beta) up to rounding. c, r token-averaged (kernel default). Returns
    (losses, beta * c, beta * r).
    """
    c, r = _f(chosen_logps), _f(rejected_logps)
    logits = beta * (c - r) - gamma
    losses = -_logsigmoid(logits) * (1 - label_smoothing) - _logsigmoid(-logits) * label_smoothing
    return losses, beta * c, beta * r


# linkedin/Liger-Kernel @ ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c, test/chunked_loss/test_orpo_loss.py,
# HFORPOLoss.alignment_loss (src/liger_kernel/chunked_loss/orpo_loss.py, preference_loss_fn, has the same log_odds).
def liger_orpo_loss(policy_chosen_logps, policy_rejected_logps, beta):
    """(losses, chosen_rewards, rejected_rewards, log_odds) of Liger's ORPO reference.

    log_odds = (c - r) - (log1p(-exp(c)) - log1p(-exp(r))) (no log1mexp branch); losses = -beta * logsigmoid(log_odds)
    (a loss to MINIMISE; the reference's step loss is alpha * nll + losses.mean(), the kernel's -beta *
    sum(ratio) / n_pairs + nll). Rewards beta * logps.
    """
    c, r = _f(policy_chosen_logps), _f(policy_rejected_logps)
    with np.errstate(invalid="ignore", divide="ignore"):
        log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
    ratio = _logsigmoid(log_odds)
    return -beta * ratio, beta * c, beta * r, log_odds


# --------------------------------------------------------------------------------------------------------------
# Where TRL (f2cd577) and Liger (ead96b6) disagree
# --------------------------------------------------------------------------------------------------------------
# 1. Token aggregation in DPO: TRL sums the completion tokens' log-probs for every loss type (an empty row gives 0).
#    Liger's DPO kernel also sums by default (average_log_prob=False), but its tests compare kernel and reference at
#    average_log_prob=True (token means, empty row 0/0 = NaN), so the Liger DPO reference is not TRL's convention.
#    TRL's DPO-with-Liger path constructs LigerFusedLinearDPOLoss(beta, loss_type) and so sums.
# 2. IPO: TRL divides the SUMMED log-ratios by the completion lengths (clamp >= 1, from the unshifted completion
#    mask) inside the loss; its rewards stay on sums. Pre-refactor TRL (< e3b7897c) averaged the logps of policy and
#    reference in concatenated_forward (no clamp) and its rewards were on averages. Liger raises NotImplementedError.
# 3. Label smoothing: DPO "sigmoid" ignores it in both TRL (since the refactor; before it was the cDPO form) and
#    Liger. CPO/SimPO keep the cDPO form in both. robust is the same form in both; TRL only warns outside [0, 0.5),
#    Liger raises. exo_pair: TRL raises for ls == 0 (pre-refactor silently used 1e-3), Liger raises for ls <= 0; the
#    Liger reference defaults are robust 0.1, exo_pair 1e-3 (TRL 0.0). TRL's Liger path forwards neither
#    label_smoothing nor discopop_tau, so robust runs at 0 and exo_pair raises there.
# 4. SimPO margin: TRL (and Liger's HFCPOLoss) computes beta * ((c - r) - gamma / beta); the Liger kernel
#    beta * (c - r) - gamma. Same in exact arithmetic, a few ulps apart in floating point. Both average the tokens.
#    NLL term: TRL cpo_alpha (default 1.0) * nll; Liger SimPO alpha=1.0 with compute_nll_loss=True in the module.
# 5. ORPO: TRL's losses are +beta * logsigmoid(log_odds) with loss = nll - mean; Liger's are -beta * logsigmoid with
#    loss = nll + mean (same total). TRL uses the stable log1mexp (branch at -ln 2) and casts to float32; Liger uses
#    log1p(-exp(x)), which loses relative accuracy as the mean logp approaches 0. TRL's nll covers prompt + response
#    (labels = input_ids where attention_mask == 1); Liger's covers the target (or an explicit nll_target).
# 6. Loss types only in TRL: aot, aot_unpaired, sft, sigmoid_norm, ipo, and the f-divergence scores
#    (f_divergence_type). bco_pair no longer subtracts a running reward mean in either (pre-refactor TRL did).
# 7. Reduction: TRL takes the mean over the pairs of one micro-batch; Liger's kernels divide the chunk sums by
#    full_target.shape[0] // 2, the mean over all pairs of the call, independent of chunking.
