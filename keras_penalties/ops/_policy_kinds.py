"""The per-token losses of `policy_loss`'s kinds, each from the log-ratio δ
(0 where the mask M drops a token), the advantages A (broadcast to the
tokens) and the options, and the checks of the options that depend on the
kind. Notation as `policy`'s; every input is already filled where M is 0."""

from keras import ops

from keras_penalties import _validation as check
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _ratios as ratios

# `clip=None`: each kind's default (GMPO's ε is the paper's and TRL's).
DEFAULT_CLIP = {"gmpo": (0.4, 0.4)}
PPO_CLIP = (0.2, 0.2)
# VESPO's log w is clamped into [ln 1e-8, 20], as TRL's `get_gamma_weights`.
VESPO_LOG_WEIGHT = (-18.420680743952367, 20.0)
# The kinds whose ratio is their own (no `level`), on [batch, tokens].
SEQUENCE_KINDS = ("gmpo", "vespo")


def pair_of(predicate, what):
    """A check of a pair of numbers each satisfying `predicate`."""

    def check_pair(name, value):
        values = ratios.pair(name, value)
        if not all(predicate(v) for v in values):
            raise ValueError(f"`{name}` must be two numbers {what}; got {value!r}.")
        return values

    return check_pair


def any_clip(name, value):
    """`clip`: None (the kind's default) or a pair of numbers; the kind
    checks the range (`kind_clip`)."""
    return None if value is None else ratios.pair(name, value)


def kind_clip(kind, clip):
    """The kind's clip: its default for None; (ε_low, ε_high) with 0 ≤ ε_low
    < 1 and ε_high ≥ 0 for a ratio's clip, each ≥ 0 for GMPO's log-space
    bounds."""
    if clip is None:
        return DEFAULT_CLIP.get(kind, PPO_CLIP)
    low, high = clip
    if kind == "gmpo":
        if low < 0 or high < 0:
            raise ValueError(f"`clip` must be log-ratio bounds (ε_low, ε_high), each >= 0, for 'gmpo'; got {clip!r}.")
    elif not (0.0 <= low < 1.0 and high >= 0.0):
        raise ValueError(f"`clip` must be (ε_low, ε_high) with 0 <= ε_low < 1 and ε_high >= 0; got {clip!r}.")
    return low, high


def check_level(kind, level):
    """A level other than "token" for the kinds with no ratio or their own."""
    if kind == "reinforce" and level != "token":
        raise ValueError(f"`level={level!r}` reads a ratio; kind='reinforce' has none: use level='token'.")
    if kind in SEQUENCE_KINDS and level != "token":
        raise ValueError(f"`level={level!r}`: kind={kind!r} forms its own sequence ratio; use level='token'.")


def check_shapes(kind, rank, per_token_advantages):
    """The kinds with their own sequence ratio read [batch, tokens]; GMPO one
    advantage a sequence."""
    if kind in SEQUENCE_KINDS:
        if rank != 2:
            raise ValueError(
                f"kind={kind!r} reads sequences: `logprobs` must be [batch, tokens] (rank 2); got rank {rank}."
            )
        if kind == "gmpo" and per_token_advantages:
            raise ValueError("kind='gmpo' takes one advantage a sequence: `advantages` must be [batch].")


def ratio_loss(kind, ratio, a, logprobs, clip, dual_clip, sapo_tau):
    """The per-token loss of a kind that reads the ratio r at a `level`."""
    low, high = clip
    if kind == "importance_sampling":
        return -ratio * a
    if kind == "ppo":
        loss = ops.maximum(-ratio * a, -num.clamp(ratio, 1.0 - low, 1.0 + high) * a)
        if dual_clip is not None:
            loss = ops.where(a < 0, ops.minimum(loss, -dual_clip * a), loss)
        return loss
    if kind == "cispo":
        return -ops.stop_gradient(num.clamp(ratio, high=1.0 + high)) * a * logprobs
    # "sapo": a soft gate σ(τ(r − 1))·4/τ in place of the clip, τ by A's sign.
    tau = ops.where(a > 0, ops.full_like(a, sapo_tau[0]), ops.full_like(a, sapo_tau[1]))
    return -ops.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * a


def gmpo_loss(delta, a, mask, clip):
    """GMPO: −A_i·exp(clamp(Σ_t M·c_t / max(n_i, 1), ±20)) on every token of
    sequence i, c_t the log-ratio clipped on A's side only (at ε_high where
    A > 0, at −ε_low elsewhere): the geometric mean of the clipped ratios,
    with its gradient through every token it does not clip."""
    low, high = clip
    clipped = ops.where(a > 0, num.clamp(delta, high=high), num.clamp(delta, low=-low))
    return ops.broadcast_to(-a * ratios.exp_clamped(ratios.sequence_mean(clipped, mask)), ops.shape(delta))


def vespo_loss(delta, a, logprobs, vespo_k, vespo_lambda):
    """VESPO: −sg(φ)·A·logprobs, φ = exp(λ + k·log w − λ·w) of the
    sequence's w, log w = clamp(Σ_t clamp(δ_t, ±20), [ln 1e-8, 20]) (a sum:
    δ is 0 on masked tokens), (k, λ) by A's sign (A ≥ 0: the first)."""
    log_w = num.clamp(
        ratios.sequence_sum(num.clamp(delta, -ratios.LOG_RATIO_LIMIT, ratios.LOG_RATIO_LIMIT)), *VESPO_LOG_WEIGHT
    )
    up = a >= 0
    k = ops.where(up, ops.full_like(a, vespo_k[0]), ops.full_like(a, vespo_k[1]))
    lam = ops.where(up, ops.full_like(a, vespo_lambda[0]), ops.full_like(a, vespo_lambda[1]))
    phi = ops.exp(lam + k * log_w - lam * ops.exp(log_w))
    return -ops.stop_gradient(phi) * a * logprobs


checks = {
    "sapo_tau": pair_of(lambda v: v > 0, "> 0"),
    "vespo_k": pair_of(lambda v: v >= 0, ">= 0"),
    "vespo_lambda": pair_of(lambda v: v > 0, "> 0"),
    "max_length": check.optional(check.positive_integer),
}
