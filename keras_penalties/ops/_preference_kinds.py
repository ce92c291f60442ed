"""What `preference_loss` knows of each kind, one record a kind: its loss
of a pair, whether a sequence's value is the mean of its tokens (or their
sum), whether it has a reference model, and whether it is built on the
score difference h (and so takes a `divergence`); and the f-divergence
scores those kinds take. Notation as `preference`'s."""

import math
from typing import Callable, NamedTuple

from keras import ops

from keras_penalties._types import Tensor
from keras_penalties.ops import _numerics as num

# TRL's f-divergence scores clamp their exponents: here at 40, so that
# values and gradients are finite at |Δ| = 1e4, ipo's square included.
_EXPONENT_LIMIT = 40.0


class Pair(NamedTuple):
    """A pair's numbers: the policy's sequence values c, r; their
    log-ratios to the reference, c − c_ref and r − r_ref; and h, the
    difference of their scores."""

    c: Tensor
    r: Tensor
    chosen: Tensor
    rejected: Tensor
    h: Tensor


class Options(NamedTuple):
    beta: float
    epsilon: float
    gamma: float
    tau: float


class Kind(NamedTuple):
    loss: Callable[[Pair, Options], Tensor]
    mean: bool = False  # a sequence's value is its kept tokens' mean
    reference_free: bool = False
    on_h: bool = False  # built on h: takes a `divergence`


def _log_sigmoid(x):
    return ops.log_sigmoid(x)


def _sigmoid(p, o):
    x = o.beta * p.h
    return -(1.0 - o.epsilon) * _log_sigmoid(x) - o.epsilon * _log_sigmoid(-x)


def _robust(p, o):
    x = o.beta * p.h
    return (-(1.0 - o.epsilon) * _log_sigmoid(x) + o.epsilon * _log_sigmoid(-x)) / (1.0 - 2.0 * o.epsilon)


def _nca_pair(p, o):
    chosen, rejected = o.beta * p.chosen, o.beta * p.rejected
    return -_log_sigmoid(chosen) - 0.5 * _log_sigmoid(-chosen) - 0.5 * _log_sigmoid(-rejected)


def _sppo_hard(p, o):
    return ops.square(p.chosen - 1.0 / (2.0 * o.beta)) + ops.square(p.rejected + 1.0 / (2.0 * o.beta))


def _simpo(p, o):
    margin = o.beta * (p.c - p.r)
    return -(1.0 - o.epsilon) * _log_sigmoid(margin - o.gamma) - o.epsilon * _log_sigmoid(o.gamma - margin)


def _orpo(p, o):
    # The odds ratio's term; its NLL on the chosen is `nll`.
    return -o.beta * _log_sigmoid((p.c - p.r) - (num.log1m_exp(p.c) - num.log1m_exp(p.r)))


def _exo_pair(p, o):
    x = o.beta * p.h
    return ops.sigmoid(x) * (_log_sigmoid(x) - math.log1p(-o.epsilon)) + ops.sigmoid(-x) * (
        _log_sigmoid(-x) - math.log(o.epsilon)
    )


def _discopop(p, o):
    # σ(x/τ)·e^{−x} as exp(logσ(x/τ) − x): finite at any margin for τ < 1.
    x = o.beta * p.h
    gate = ops.sigmoid(x / o.tau)
    return (1.0 - gate) * -_log_sigmoid(x) + ops.exp(_log_sigmoid(x / o.tau) - x)


KINDS = {
    "sigmoid": Kind(_sigmoid, on_h=True),
    "robust": Kind(_robust, on_h=True),
    "hinge": Kind(lambda p, o: ops.relu(1.0 - o.beta * p.h), on_h=True),
    "ipo": Kind(lambda p, o: ops.square(p.h - 1.0 / (2.0 * o.beta)), mean=True, on_h=True),
    "nca_pair": Kind(_nca_pair),
    "sppo_hard": Kind(_sppo_hard),
    "apo_zero": Kind(lambda p, o: 1.0 - ops.sigmoid(o.beta * p.chosen) + ops.sigmoid(o.beta * p.rejected)),
    "apo_down": Kind(lambda p, o: ops.sigmoid(o.beta * p.chosen) + 1.0 - ops.sigmoid(o.beta * (p.chosen - p.rejected))),
    "simpo": Kind(_simpo, mean=True, reference_free=True),
    "orpo": Kind(_orpo, mean=True, reference_free=True),
    "bco_pair": Kind(lambda p, o: -_log_sigmoid(o.beta * p.chosen) - _log_sigmoid(-o.beta * p.rejected)),
    "exo_pair": Kind(_exo_pair, on_h=True),
    "discopop": Kind(_discopop, on_h=True),
    "sigmoid_norm": Kind(lambda p, o: -_log_sigmoid(o.beta * p.h), mean=True, on_h=True),
}


def check_options(kind, divergence, epsilon):
    """The options a kind refuses, before any tensor work."""
    if divergence != "reverse_kl" and not KINDS[kind].on_h:
        on_h = ", ".join(repr(k) for k, facts in KINDS.items() if facts.on_h)
        raise ValueError(f"`divergence={divergence!r}` scores h: kind={kind!r} is not built on it (those are {on_h}).")
    if kind == "exo_pair" and epsilon == 0.0:
        raise ValueError("kind='exo_pair' needs `label_smoothing` > 0 (its log ε; the EXO paper uses 1e-3).")


def score(delta, divergence, alpha):
    """f(Δ) of a log-ratio Δ for TRL's `f_divergence_type` (TRL 1.16's
    f′): Δ (`"reverse_kl"`), 1 − e^{−Δ}, ln 2 + logσ(Δ), (e^{(α−1)Δ} −
    1)/(α − 1) (Δ where |α − 1| < 1e-6); exponents clamped at 40 (a zero
    gradient beyond)."""
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return delta
    if divergence == "forward_kl":
        return 1.0 - ops.exp(num.clamp(-delta, high=_EXPONENT_LIMIT))
    if divergence == "js_divergence":
        return math.log(2.0) + _log_sigmoid(delta)
    # The exponent's bound keeps the score itself under e^40 (α near 1 divides by a small α − 1).
    limit = _EXPONENT_LIMIT + math.log(abs(alpha - 1.0))
    return ops.expm1(num.clamp((alpha - 1.0) * delta, high=limit)) / (alpha - 1.0)
