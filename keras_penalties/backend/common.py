"""The one-device defaults of the backend contract (`backend/__init__.py`),
by concern, for every name a backend's concern module leaves out, and the
helpers the backends share (`flag_set`, `norm`, `TINY`). Keras' own ops:
what XLA and TF's graphs fuse; the replica functions of one replica."""

import concurrent.futures
import contextlib
import threading

import keras
import numpy as np
from keras import ops

from keras_penalties import _keras_internals


@contextlib.contextmanager
def flag_set(flag):
    """Within the block, the boolean ContextVar `flag` is True."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def norm(grads):
    """‖(g₁, g₂, …)‖₂ over all the tensors, in float32."""
    return ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads))


TINY = 1e-30  # below any gradient norm that matters, above float32's smallest normal


# autodiff (`gradients` and `parameter_probe` are every backend's own)


def traced_outside_scope(x):
    """Whether `x` belongs to a trace whose values no variable may hold
    (JAX only); False elsewhere."""
    return False


def keep_for_metrics(variables):
    """What `kept_for_metrics` needs to find the values of `variables` as a
    forward pass left them, when the same step reads its metrics; None
    where a step's metrics read the variables themselves (TF, torch)."""
    return None


def kept_for_metrics(kept, variables):
    """The values `keep_for_metrics` kept, where the code runs in a step
    whose metrics cannot read `variables` themselves; None where they can."""
    return None


# kernels


def softmax_pair(logits, axis, log_softmax=None):
    """`(softmax, log_softmax)` of logits along `axis` (`log_softmax`, if
    given, is that of these logits, already formed). Under XLA the two share
    their exp and sum; exp(log p) would take one more exp per element."""
    if log_softmax is None:
        log_softmax = ops.log_softmax(logits, axis=axis)
    return ops.softmax(logits, axis=axis), log_softmax


def js_rows(p, logp, q, logq, beta, axis, reuse=(False, False)):
    """β·Σ p (log p − log m) + (1 − β)·Σ q (log q − log m) along `axis`, with
    m = βp + (1 − β)q and log m as log(m + tiny), tiny the dtype's smallest
    normal number (finite where both underflow). `reuse`: whether `logp`
    and `logq` are the caller's own temporaries, which torch overwrites
    where nothing is differentiated."""
    logm = ops.log(beta * p + (1.0 - beta) * q + smallest_normal(p.dtype))
    return beta * ops.sum(p * (logp - logm), axis=axis) + (1.0 - beta) * ops.sum(q * (logq - logm), axis=axis)


def kl_rows(p, logp, logq, axis):
    """Σ p (log p − log q) along `axis`."""
    return ops.sum(p * (logp - logq), axis=axis)


def pick_labels(values, labels, axis):
    """values[..., labels[...], ...] along `axis`: each position's entry at
    its integer label (`labels` has `values`' shape without `axis`)."""
    return ops.squeeze(ops.take_along_axis(values, ops.expand_dims(labels, axis), axis=axis), axis)


def label_cross_entropy(logits, labels, axis):
    """−log softmax(logits)[label] along `axis` by a cheaper way than a
    log-softmax and `pick_labels`, or None where the backend has none."""
    return None


def label_logprobs(logits, labels, entropy, log_sum_sq=False, logsumexp=False):
    """[rows, K (+ 1) (+ 1) (+ 1)]: log softmax(logits) [rows, V] at each
    row's labels [rows, K] and, with `entropy`, the row's entropy, with
    `log_sum_sq` its log Σp² (a constant), with `logsumexp` its lse
    (differentiable), last, by a cheaper way than a log-softmax, a pick and
    an entropy, or None where the backend has none."""
    return None


def soft_cap(logits, cap):
    """cap·tanh(logits / cap): logits soft-capped (Gemma 2's heads); `cap`
    a Python float."""
    cap = ops.cast(cap, logits.dtype)
    return ops.tanh(logits / cap) * cap


def smallest_normal(dtype):
    """The smallest normal number of a float dtype, as a Python float."""
    return float(np.finfo(keras.backend.standardize_dtype(dtype)).tiny)


def is_half(dtype):
    return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")


def sum_of_squares(x):
    """Σx² over all of x. XLA and TF fuse square-then-sum into one pass
    (x·x on TF would be a matrix-vector product, slower)."""
    return ops.sum(ops.square(x))


def sum_abs(x):
    """Σ|x| over all of x, as a 1-norm: one reduction (under XLA and on TF
    the same loop as abs-then-sum). Its gradient is sign(x), 0 at 0."""
    return ops.norm(ops.reshape(x, (-1,)), ord=1)


def proximal_step(variables, threshold, shrink, center):
    """Each variable v ← c + k·(u − clip(u, −t, t)), u = v − c, in place: the
    proximal step of an L1 (`threshold` t), L2 (`shrink` k = 1/(1 + 2·step),
    with `center` c: None, a number or "mean", the variable's own mean) or
    elastic-net decay (both, c = 0). t and k are float32 scalars, or None
    for no thresholding / no shrinking. u − clip(u, ±t) is soft
    thresholding, sign(u)·max(|u| − t, 0), in one pass fewer: |u| ≤ t gives
    exactly 0."""
    for v in variables:
        x = v.value
        c = None if center is None else ops.mean(x) if center == "mean" else ops.cast(center, x.dtype)
        u = x if c is None else x - c
        if threshold is not None:
            t = ops.cast(threshold, x.dtype)
            u = u - ops.clip(u, -t, t)
        if shrink is not None:
            u = u * ops.cast(shrink, x.dtype)
        v.assign(u if c is None else c + u)


def unit_clip(grads, weights, clip_factor, eps):
    """Adaptive gradient clipping of each (gradient, weight) pair:
    g·min(1, λ·max(‖w‖, ε)/‖g‖) with norms per unit (over every axis but
    the last; the whole tensor for rank ≤ 1), computed in float32, and g
    unchanged where ‖g‖ = 0."""
    return [_unit_clip(g, w, clip_factor, eps) for g, w in zip(grads, weights)]


def _unit_clip(g, w, clip_factor, eps):
    grad = g
    if is_half(g.dtype) or is_half(w.dtype):
        g, w = ops.cast(g, "float32"), ops.cast(w, "float32")
    shape = (-1, g.shape[-1]) if len(g.shape) > 1 else (-1,)
    # √Σx² per unit rather than ops.norm, whose column norm is slow on torch.
    w_norm = ops.sqrt(ops.sum(ops.square(ops.reshape(w, shape)), axis=0))
    g_norm = ops.sqrt(ops.sum(ops.square(ops.reshape(g, shape)), axis=0))
    limit = clip_factor * ops.maximum(w_norm, eps)
    # min(1, limit/‖g‖), and 1 for a zero gradient (no 0/0).
    scale = ops.minimum(1.0, limit / ops.maximum(g_norm, TINY))
    return ops.cast(g * scale, grad.dtype)


# kernels: a composite's few-element state


def as_tensor(x):
    """`ops.convert_to_tensor(x)`."""
    return ops.convert_to_tensor(x)


def stack(tensors):
    """`ops.stack(tensors)` along a new first axis (a composite's term values)."""
    return ops.stack(tensors)


def add_to_row(variable, row, values):
    """variable[row] += values, for a [rows, ...] state variable, a Python
    int `row` and `values` of the shape of one row (a float for [rows])."""
    one_hot = np.zeros((variable.shape[0],) + (1,) * (len(variable.shape) - 1), "float32")
    one_hot[row] = 1.0
    variable.assign(variable.value + ops.convert_to_tensor(one_hot) * ops.expand_dims(ops.cast(values, "float32"), 0))


def reduce_sum(x, axis=None):
    """`ops.sum(x, axis)` of a float tensor."""
    return ops.sum(x, axis=axis)


def divide_by_count(total, n):
    """total / n for a count n (an int, or a tensor where the size is known
    only at run time), divided by as a tensor of total's dtype, as Keras'
    losses divide (CUDA torch multiplies by the reciprocal of a Python
    number: up to one ulp off)."""
    return total / ops.cast(n, total.dtype)


def increment(variable):
    """variable += 1, for a scalar (step count) variable."""
    variable.assign(variable.value + 1)


# The few-element math of a composite's update at every training step: Keras'
# ops (traced once on JAX and TF).
SMALL_OPS = ops


def assign_all(pairs):
    """variable.assign(value) for each `(variable, value)` pair."""
    for variable, value in pairs:
        variable.assign(value)


# distribution (chunks: `map_chunks`, `chunked_sum`, `chunked_values`,
# `project` and the chunk budgets are every backend's own)


def row_shards():
    """How many devices a chunked op's rows are split over inside one
    computation (JAX's `DataParallel`); 1 where each replica runs its own
    (TF, torch) or there is one device."""
    return 1


def replicas_in_sync():
    return 1


def gradients_in_sync():
    return 1


def sum_over_replicas(tensors, keep_losses_of=None):
    return list(tensors)


def gather_over_replicas(tensors, keep_losses_of=None):
    return list(tensors)


def variable_home(model=None):
    """Where a variable made now lives: nowhere in particular on one device."""
    return None


def one_process():
    return contextlib.nullcontext()


def made_at(home):
    return contextlib.nullcontext() if home is None else home.scope()


def loss_replicas():
    return 1


def outside_distribution(fn, in_strategy=False):
    """`fn()` run on the package's one host thread ("keras_penalties_host",
    started on first use), its result returned and its exception raised.
    A `tf.distribute` strategy's scope (`in_strategy`: whether the caller is
    in one, or in TF's graph mode), a Keras distribution, the dtype policy
    and a `StatelessScope` belong to the thread that set them: there `fn`
    sees none, and computes on whole values as one device would, without
    Keras' loss scaling for a distribution. From the host thread itself, or
    where the caller's thread has none of them either, `fn()` here (the hop
    costs time: bench/results/README.md)."""
    if getattr(_on_host, "active", False):
        return fn()
    plain = keras.distribution.distribution() is None and keras.config.dtype_policy().name == "float32"
    if plain and not in_strategy and not _keras_internals.in_stateless_scope():
        return fn()
    with _host_lock:
        if not _host:
            _host.append(concurrent.futures.ThreadPoolExecutor(1, "keras_penalties_host", _mark_host))
    return _host[0].submit(fn).result()


_host: list[concurrent.futures.ThreadPoolExecutor] = []


_host_lock = threading.Lock()


_on_host = threading.local()


def _mark_host():
    _on_host.active = True
