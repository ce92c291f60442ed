"""Importance ratios of sampled tokens, shared by the policy losses and the
off-policy ops: the log-ratio on kept tokens, its sequence sum and mean,
the clamp before the exponential, and the checks of their options."""

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions

# The log-ratio's clamp before its exponential (verl's, TRL's): e^20 ≈ 4.9e8.
LOG_RATIO_LIMIT = 20.0


def pair(name, value):
    """A pair of numbers, as a tuple."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"`{name}` must be a pair of numbers; got {value!r}.")
    return tuple(check.number(name, v) for v in value)


def bounds(name, value):
    """(low, high), either None, with 0 ≤ low < high where both are given."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"`{name}` must be a pair (low, high), either None; got {value!r}.")
    low, high = (None if v is None else check.number(name, v) for v in value)
    # 0 <= low < high holds for a high alone too: every ratio is >= 0, so a high of 0 keeps nothing.
    if (low is not None and low < 0) or (high is not None and high <= 0):
        raise ValueError(f"`{name}` must be (low, high) with 0 <= low < high (either None); got {value!r}.")
    if low is not None and high is not None and not low < high:
        raise ValueError(f"`{name}` must be (low, high) with 0 <= low < high (either None); got {value!r}.")
    return low, high


def check_level_rank(level, rank, token_levels=("token",)):
    """A sequence level reads [batch, tokens] inputs."""
    if level not in token_levels and rank != 2:
        raise ValueError(
            f"`level={level!r}` forms one ratio a sequence: the log-probabilities must be [batch, tokens] "
            f"(rank 2); got rank {rank}."
        )


def log_ratio(logprobs, other, mask):
    """logprobs − sg(other), 0 where `mask` (bool, or None) drops a token,
    whatever `other` holds there (a sampler's padding may be -inf)."""
    delta = logprobs - ops.stop_gradient(ops.cast(other, logprobs.dtype))
    return delta if mask is None else ops.where(mask, delta, ops.zeros_like(delta))


def sequence_sum(delta):
    """Σ_t δ of each sequence of [batch, tokens], as [batch, 1]."""
    return ops.sum(delta, axis=1, keepdims=True)


def sequence_mean(delta, mask):
    """Σ_t δ·M / max(Σ_t M, 1) of each sequence, as [batch, 1] (δ is 0 where
    M is)."""
    kept = ops.ones_like(delta) if mask is None else ops.cast(mask, delta.dtype)
    return sequence_sum(delta) / ops.maximum(ops.sum(kept, axis=1, keepdims=True), 1.0)


def exp_clamped(log):
    """exp(clamp(log, ±20)): finite at any log-ratio."""
    return ops.exp(num.clamp(log, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def policy_log_ratio(delta, mask, level):
    """The log-ratio a policy loss reads per token at `level`: δ itself
    (`"token"`); the sequence's mean δ, with its gradient through every kept
    token (`"sequence"`, GSPO); that mean's value with each token's own
    gradient (`"sequence_token"`, GSPO-token)."""
    if level == "token":
        return delta
    mean = sequence_mean(delta, mask)
    if level == "sequence":
        return ops.broadcast_to(mean, ops.shape(delta))
    return ops.stop_gradient(mean) + delta - ops.stop_gradient(delta)


def broadcast_advantages(advantages, like, dtype):
    """`advantages` ([batch] per sequence, or `like`'s shape per token) as a
    constant that broadcasts against `like`."""
    a = ops.stop_gradient(ops.cast(advantages, dtype))
    if len(a.shape) == 1 and len(like.shape) > 1:
        a = ops.reshape(a, (-1,) + (1,) * (len(like.shape) - 1))
    return a


def check_advantages(advantages, logprobs):
    """`advantages` per sequence ([batch]) or per token (logprobs' shape)."""
    per_sequence = len(advantages.shape) == 1 and len(logprobs.shape) > 1
    expected = (logprobs.shape[0],) if per_sequence else tuple(logprobs.shape)
    if reductions.shapes_differ(tuple(advantages.shape), expected):
        sequences = f"per sequence ({logprobs.shape[0]},) or " if len(logprobs.shape) > 1 else ""
        raise ValueError(
            f"`advantages` must be {sequences}per token {tuple(logprobs.shape)}; got {tuple(advantages.shape)}."
        )


def ratio_clip(name, value):
    """(ε_low, ε_high) with 0 ≤ ε_low < 1 and ε_high ≥ 0."""
    low, high = pair(name, value)
    if not (0.0 <= low < 1.0 and high >= 0.0):
        raise ValueError(f"`{name}` must be (ε_low, ε_high) with 0 <= ε_low < 1 and ε_high >= 0; got {value!r}.")
    return low, high


def log_prob_pair(names, logprobs, other, mask):
    """Two log-probability tensors (one shape) in their compute dtype, the
    mask as bool (None stays None), the compute dtype."""
    logprobs, other = backend.as_tensor(logprobs), backend.as_tensor(other)
    check.check_same_shape(names, logprobs, other)
    mask = reductions.sample_mask(mask, logprobs, None)
    compute, _ = dtypes.dtype_pair([logprobs])
    return dtypes.cast_to(logprobs, compute), ops.cast(other, compute), mask, compute


def kept_or_all(mask, like):
    """`mask`, or every position of `like` where it is None."""
    return ops.ones(ops.shape(like), "bool") if mask is None else mask
