"""Safe math for every penalty in `keras_penalties.ops`: logs and norms whose
values and gradients stay finite at exact zeros and at extreme logits, and,
within `sharing`, each given tensor's (log-)softmax formed once for all the
terms that read it."""

import contextlib
import contextvars

from keras import ops

from keras_penalties import backend

# Why a divergence, an entropy or a cross-entropy needs rank >= 1.
DISTRIBUTION_AXIS = "a distribution axis"


def safe_log(x):
    """log(x) floored at the dtype's smallest normal number.

    The floor makes log(0) finite (about -87 in float32) and its gradient zero,
    so 0 * log(0) is 0 in the value and NaN-free in the gradient.
    """
    tiny = backend.smallest_normal(x.dtype)
    return ops.log(ops.where(x > tiny, x, tiny))


def clamp(x, low=None, high=None):
    """`x` clamped into [low, high] (either None: no bound on that side),
    written with `where`: the gradient is 0 beyond a bound and, at the
    bound itself, the unclamped one, on every backend (`clip`, `minimum`
    and `maximum` halve it at ties on JAX and torch)."""
    if high is not None:
        x = ops.where(x > high, ops.full_like(x, high), x)
    if low is not None:
        x = ops.where(x < low, ops.full_like(x, low), x)
    return x


# log(1 − e^x) is formed at x ≤ −1e-7: finite, value and gradient, as x → 0
# (where 1 − e^x is a mass left over, or ORPO's odds).
LOG_MASS_LIMIT = -1e-7


def log1m_exp(x):
    """log(1 − e^x) for x ≤ 0, as log(−expm1(x)) with x clamped at −1e-7
    (about −16.1 there): finite in value and gradient up to x = 0."""
    return ops.log(-ops.expm1(clamp(x, high=LOG_MASS_LIMIT)))


def safe_norm(x, axis=None, keepdims=False):
    """Euclidean norm with a zero (not NaN) gradient where the norm is zero."""
    sq = ops.sum(ops.square(x), axis=axis, keepdims=keepdims)
    nonzero = sq > 0
    root = ops.sqrt(ops.where(nonzero, sq, ops.ones_like(sq)))
    return ops.where(nonzero, root, ops.zeros_like(sq))


def log_probs(x, *, from_logits, temperature, axis):
    """Log-probabilities along `axis` of logits or probabilities.

    Logits are divided by `temperature` and log-softmaxed. Probabilities are
    used as given at temperature 1; otherwise p^(1/T) is renormalised, which
    is log_softmax(log(p) / T).
    """
    if from_logits:
        return _shared(x, ("log", temperature, axis), lambda: ops.log_softmax(_scaled(x, temperature), axis=axis))
    logp = safe_log(x)
    if temperature != 1.0:
        logp = ops.log_softmax(logp / temperature, axis=axis)
    return logp


def probs_and_log_probs(x, *, from_logits, temperature, axis):
    """`(p, log p)` along `axis`; given probabilities at T=1 are kept exactly."""
    if from_logits:

        def pair():
            logp = _shared_value(x, ("log", temperature, axis))
            p, logp = backend.softmax_pair(_scaled(x, temperature), axis, logp)
            _share(x, ("log", temperature, axis), logp)
            return p, logp

        return _shared(x, ("pair", temperature, axis), pair)
    logp = log_probs(x, from_logits=False, temperature=temperature, axis=axis)
    if temperature == 1.0:
        return x, logp
    return ops.exp(logp), logp


def _scaled(logits, temperature):
    return logits / temperature if temperature != 1.0 else logits


# Inside `sharing(tensors)`, the (log-)softmax of each of those tensors is
# formed once per temperature and axis, however many terms ask for it: an
# objective's entropy bonus and KL on the same logits share one
# log-softmax, as hand-written code would. Where the backend says so
# (`backend.SHARES_SOFTMAX`: on eager torch each is a pass over the logits
# and a node of the backward pass; XLA and TF's graph optimizer merge
# them anyway, and a TF GradientTape inside a term would not see a softmax
# formed before it). Only the tensors named are shared, never a chunk of
# them: a chunk loop keeps one chunk's temporaries alive at a time. A
# context variable, so that each thread has its own.
_SHARING = contextvars.ContextVar("keras_penalties_sharing", default=None)


@contextlib.contextmanager
def sharing(tensors):
    """Within: the log-probabilities of any of `tensors` are computed once
    (where `backend.SHARES_SOFTMAX`)."""
    if not backend.SHARES_SOFTMAX:
        yield
        return
    # The dict holds the tensors, so their ids stay theirs while it lives.
    token = _SHARING.set(({id(t): t for t in tensors}, {}))
    try:
        yield
    finally:
        _SHARING.reset(token)


def shared(*tensors):
    """Whether any of `tensors` is a (log-)softmax `sharing` holds for
    other terms (so not to be overwritten)."""
    held = _SHARING.get()
    if held is None:
        return False
    values = [v for value in held[1].values() for v in (value if isinstance(value, tuple) else (value,))]
    return any(t is v for t in tensors for v in values)


def _shared(x, key, make):
    held = _SHARING.get()
    if held is None or id(x) not in held[0]:
        return make()
    cache = held[1]
    if (id(x), key) not in cache:
        cache[id(x), key] = make()
    return cache[id(x), key]


def _shared_value(x, key):
    held = _SHARING.get()
    return None if held is None else held[1].get((id(x), key))


def _share(x, key, value):
    held = _SHARING.get()
    if held is not None and id(x) in held[0]:
        held[1].setdefault((id(x), key), value)
