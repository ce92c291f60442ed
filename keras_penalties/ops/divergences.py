"""Distribution penalties: KL, JS, entropy, consistency and KL sparsity.

Conventions shared by all of them:

- Natural logarithms (nats).
- `from_logits=False`: inputs are probabilities along `axis`;
  `from_logits=True`: inputs are logits (log-probabilities are valid logits).
  From logits, only log-softmax / logsumexp are used, never softmax-then-log.
- `temperature` T divides logits, or turns probabilities p into p^(1/T)
  renormalised, before the divergence. At T = 1 probabilities are used as
  given, not renormalised (as in `keras.losses.KLDivergence`).
- 0·log 0 = 0, and gradients stay finite for exact zeros in p or q and for
  logits of ±1e4.
- `reduction` reduces the per-sample values, i.e. over every axis but `axis`.
"""

import functools
import math
from typing import Any, get_args

import numpy as np
from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import (
    ChunkSize,
    Direction,
    EntropyMode,
    Metric,
    Reduction,
    Tensor,
    TensorLike,
    TokenReduction,
)
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops._tokens import LinearLogits, token_level

DIRECTIONS = get_args(Direction)
# The sign each entropy `mode` of the Entropy regularizer and loss puts on H.
ENTROPY_SIGNS = {"penalty": 1.0, "bonus": -1.0}
check_entropy_mode = check.choice(*get_args(EntropyMode))
METRICS = get_args(Metric)


_DISTRIBUTION_OPTIONS: dict[str, Any] = dict(
    from_logits=check.boolean,
    temperature=check.positive,
    axis=check.integer,
    reduction=check.REDUCTION,
)
_TOKEN_OPTIONS: dict[str, Any] = dict(chunk_size=check.chunk_size)
# The token-level ops' mask, which a Term feeds from its inputs.
_TOKEN_TENSORS = ("mask",)


def _check_pair(p: Tensor, q: Tensor, names: tuple[str, str], axis: int, min_rank: int = 1) -> int:
    check.check_same_shape(names, p, q)
    if min_rank:
        check.check_rank(names[0], p, min_rank, num.DISTRIBUTION_AXIS)
    return check.check_axis("axis", axis, max(len(p.shape), 1))


@check.options(tensors=_TOKEN_TENSORS, direction=check.choice(*DIRECTIONS), **_DISTRIBUTION_OPTIONS, **_TOKEN_OPTIONS)
def kl_divergence(
    p: TensorLike | LinearLogits,
    q: TensorLike | LinearLogits,
    *,
    from_logits: bool = False,
    direction: Direction = "forward",
    temperature: float = 1.0,
    axis: int = -1,
    reduction: Reduction = "mean",
    mask: TensorLike | None = None,
    chunk_size: ChunkSize = None,
) -> Tensor:
    """Kullback-Leibler divergence between two distributions along `axis`.

    forward: KL(p‖q) = Σ p (log p − log q); reverse: KL(q‖p);
    symmetric: ½(KL(p‖q) + KL(q‖p)). In nats. `p` is the reference (e.g. a
    teacher or target), `q` the approximation (e.g. a model's output).

    Args:
        p, q: tensors of the same shape; probabilities along `axis`, or
            logits if `from_logits`. Either or both may be `ops.linear(...)`
            lazy logits (hidden states and a vocabulary projection), with
            `from_logits=True` and the classes on the last axis.
        from_logits: whether p and q are logits.
        direction: `"forward"`, `"reverse"` or `"symmetric"`.
        temperature: T > 0 applied to both distributions (see module doc).
        axis: the distribution axis.
        reduction: `"mean"` (default) or `"sum"` over the remaining axes, or
            `"none"` for the per-sample values.
        mask: None, or a tensor of the per-sample shape (the inputs' shape
            without `axis`), nonzero where a position counts (e.g. 0 for
            padding and prompt tokens). Masked positions add nothing to the
            value or the gradient; `"mean"` divides by the number kept (0 when
            none is); with `"none"` they are 0.
        chunk_size: None, "auto", or an int >= 1: compute the per-sample
            values `chunk_size` rows at a time (the rows are every position,
            all axes but `axis` flattened), one chunk's temporaries alive at
            a time, forward and backward (one loop, a scan on JAX, that
            forms each row's gradient with its value; first order only).
            `"auto"` picks the rows from the number of classes: the
            elements per chunk measured fastest on that backend (about
            16 M on JAX, 1 M on TensorFlow, 4 M on torch; 8 M, 16 M and
            8 M from `ops.linear(...)` inputs). Value +
            gradient then hold temporaries of `chunk_size × classes` instead
            of the whole array's: for LLM logits, e.g. [8192, 128256]. With
            `ops.linear(...)` inputs the logits themselves are formed a
            chunk at a time, and each chunk's gradient w.r.t. the hidden
            states, kernel and bias is taken in the forward pass
            (`reduction` "mean" or "sum"). Equal to the unchunked result to
            float32 rounding.

    Returns:
        A scalar in the inputs' float dtype (computed in float32 from half
        precision), or the per-sample values with `reduction="none"`; 0
        where no position is kept.

    Raises:
        ValueError: p and q of different shapes, an `axis` out of range,
            an unknown `direction` or `reduction`, `temperature` ≤ 0, a
            `mask` not of the per-sample shape, `chunk_size` < 1,
            `ops.linear(...)` inputs without `from_logits=True` or with
            `axis` not last.

    Example:

    >>> from keras_penalties import ops as P
    >>> round(float(P.kl_divergence([0.5, 0.5], [0.25, 0.75])), 6)  # ½ln2 + ½ln(2/3)
    0.143841
    >>> float(P.kl_divergence([[1.0, 0.0], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]], mask=[0, 1]))
    0.0
    """
    values = functools.partial(_kl_values, direction=direction, from_logits=from_logits, temperature=temperature)
    return token_level(values, (p, q), ("p", "q"), axis, reduction, mask, chunk_size, from_logits=from_logits)


def _kl_values(
    p: Tensor, q: Tensor, *, direction: Direction, from_logits: bool, temperature: float, axis: int
) -> Tensor:
    kw = dict(from_logits=from_logits, temperature=temperature, axis=axis)
    # Only the weighting distribution is needed as probabilities: forming the
    # other would cost a pass over the tensor outside jit.
    if direction == "forward":
        p, logp = num.probs_and_log_probs(p, **kw)
        return backend.kl_rows(p, logp, num.log_probs(q, **kw), axis)
    if direction == "reverse":
        q, logq = num.probs_and_log_probs(q, **kw)
        return backend.kl_rows(q, logq, num.log_probs(p, **kw), axis)
    p, logp = num.probs_and_log_probs(p, **kw)
    q, logq = num.probs_and_log_probs(q, **kw)
    return 0.5 * (backend.kl_rows(p, logp, logq, axis) + backend.kl_rows(q, logq, logp, axis))


def _js_values(p: Tensor, q: Tensor, *, from_logits: bool, temperature: float, axis: int, beta: float = 0.5) -> Tensor:
    kw = dict(from_logits=from_logits, temperature=temperature, axis=axis)
    p, logp = num.probs_and_log_probs(p, **kw)
    q, logq = num.probs_and_log_probs(q, **kw)
    # m = βp + (1 − β)q is as exact as p and q, and log(m + tiny) is the
    # cheapest log m: a logaddexp of the logs, or a select, keeps XLA from
    # fusing the sums (5 GB of temporaries for the value on [8192, 32000]
    # instead of none). Where both underflow, m = 0 and log m is finite.
    # logp and logq are this function's own, unless an objective shares
    # one with its other terms: the backend may reuse those that are.
    return backend.js_rows(p, logp, q, logq, beta, axis, reuse=(not num.shared(logp), not num.shared(logq)))


def _beta(name: str, value: float) -> float:
    value = check.number(name, value)
    if value == 0.0 or value == 1.0:
        raise ValueError(
            f"`{name}` must lie strictly between 0 and 1; got {value!r}. The generalized "
            "JS divergence vanishes at both ends (to first order it is β·KL(p‖q) near 0 "
            "and (1 − β)·KL(q‖p) near 1): use kl_divergence(direction='forward' or "
            "'reverse') instead."
        )
    if not 0.0 < value < 1.0:
        raise ValueError(f"`{name}` must lie strictly between 0 and 1; got {value!r}.")
    return value


@check.options(tensors=_TOKEN_TENSORS, beta=_beta, **_DISTRIBUTION_OPTIONS, **_TOKEN_OPTIONS)
def js_divergence(
    p: TensorLike | LinearLogits,
    q: TensorLike | LinearLogits,
    *,
    from_logits: bool = False,
    temperature: float = 1.0,
    beta: float = 0.5,
    axis: int = -1,
    reduction: Reduction = "mean",
    mask: TensorLike | None = None,
    chunk_size: ChunkSize = None,
) -> Tensor:
    """Generalized Jensen-Shannon divergence: β·KL(p‖m) + (1 − β)·KL(q‖m), m = βp + (1 − β)q.

    At β = ½ (the default) it is the JS divergence: symmetric, in nats,
    0 ≤ JS ≤ ln 2. Other β give the generalized JSD of on-policy
    distillation (Agarwal et al., 2024, "On-Policy Distillation of Language
    Models"), which leans towards β·KL(p‖q) as β → 0 and (1 − β)·KL(q‖p) as
    β → 1; β must lie strictly inside (0, 1), since the divergence vanishes at
    both ends (use `kl_divergence` there). Other arguments, `mask` and
    `chunk_size` included, as in `kl_divergence`.

    Returns:
        As `kl_divergence`'s.

    Raises:
        ValueError: as `kl_divergence`'s, and `beta` outside (0, 1).

    Example:

    >>> from keras_penalties import ops as P
    >>> round(float(P.js_divergence([1.0, 0.0], [0.0, 1.0])), 6)  # ln 2
    0.693147
    >>> round(float(P.js_divergence([1.0, 0.0], [0.0, 1.0], beta=0.25)), 6)  # −.25 ln .25 − .75 ln .75
    0.562335
    """
    values = functools.partial(_js_values, from_logits=from_logits, temperature=temperature, beta=beta)
    return token_level(values, (p, q), ("p", "q"), axis, reduction, mask, chunk_size, from_logits=from_logits)


@check.options(
    tensors=_TOKEN_TENSORS,
    normalize=check.boolean,
    **{**_DISTRIBUTION_OPTIONS, "reduction": check.TOKEN_REDUCTION},
    **_TOKEN_OPTIONS,
)
def entropy(
    x: TensorLike | LinearLogits,
    *,
    from_logits: bool = False,
    normalize: bool = False,
    temperature: float = 1.0,
    axis: int = -1,
    reduction: TokenReduction = "mean",
    mask: TensorLike | None = None,
    chunk_size: ChunkSize = None,
) -> Tensor:
    """Shannon entropy H = −Σ p log p ≥ 0 along `axis`, in nats.

    Args:
        x: probabilities along `axis`, or logits if `from_logits`, or
            `ops.linear(...)` lazy logits (as in `kl_divergence`).
        from_logits: whether x holds logits.
        normalize: divide by ln(K), K the size of `axis`, so 0 ≤ H ≤ 1
            (a single-class axis has entropy 0).
        temperature: T > 0 (see module doc).
        axis: the distribution axis.
        reduction: `"mean"` (default), `"sum"` or `"none"` over the remaining
            axes, or over the sequences of [batch, tokens] values
            `"sequence_mean"` / `"sequence_sum"` (see `kl_estimate`).
        mask: None, or the per-sample positions that count (as in
            `kl_divergence`).
        chunk_size: None, or rows per chunk (as in `kl_divergence`).

    Returns:
        A scalar in the input's float dtype, or the per-position values
        with `reduction="none"`; 0 where no position is kept.

    Raises:
        ValueError: an `axis` out of range, an unknown `reduction` (a
            sequence reduction on values not of rank 2), `temperature` ≤
            0, a `mask` not of the per-sample shape, `chunk_size` < 1.

    Example:

    >>> from keras_penalties import ops as P
    >>> round(float(P.entropy([0.25, 0.25, 0.25, 0.25])), 6)  # ln 4
    1.386294
    >>> float(P.entropy([0.25, 0.25, 0.25, 0.25], normalize=True))
    1.0
    """
    values = functools.partial(_entropy_values, from_logits=from_logits, normalize=normalize, temperature=temperature)
    return token_level(values, (x,), ("x",), axis, reduction, mask, chunk_size, from_logits=from_logits)


def _entropy_values(x: Tensor, *, from_logits: bool, normalize: bool, temperature: float, axis: int) -> Tensor:
    p, logp = num.probs_and_log_probs(x, from_logits=from_logits, temperature=temperature, axis=axis)
    values = -backend.reduce_sum(p * logp, axis=axis)
    if normalize:
        # A one-class axis has H = 0; dividing by ln 1 = 0 would make it NaN.
        log_k = ops.log(ops.cast(ops.shape(x)[axis], values.dtype))
        values = ops.where(log_k > 0, values / ops.where(log_k > 0, log_k, 1.0), 0.0)
    return values


@check.options(
    metric=check.choice(*METRICS),
    from_logits=check.boolean,
    axis=check.integer,
    reduction=check.REDUCTION,
)
def consistency(
    a: TensorLike,
    b: TensorLike,
    *,
    metric: Metric = "mse",
    from_logits: bool = False,
    axis: int = -1,
    reduction: Reduction = "mean",
) -> Tensor:
    """Disagreement between two views of the same samples (consistency regularization).

    metric:
        - `"mse"`: mean over `axis` of (a − b)²;
        - `"l1"`: mean over `axis` of |a − b|;
        - `"cosine"`: 1 − cos(a_i, b_i), each sample taken over all non-batch
          axes (axis 0 is the batch; `axis` is not used); 0 for a zero vector's
          similarity;
        - `"kl"`: symmetric KL along `axis`;
        - `"js"`: Jensen-Shannon divergence along `axis`.

    With `from_logits=True` inputs are logits along `axis`: kl/js work from
    their log-softmax, mse/l1/cosine compare the softmax probabilities.

    Returns:
        A scalar in the inputs' float dtype, or the per-sample values with
        `reduction="none"`.

    Raises:
        ValueError: a and b of different shapes, an unknown `metric` or
            `reduction`, an `axis` out of range.

    Example:

    >>> from keras_penalties import ops as P
    >>> float(P.consistency([[1.0, 2.0]], [[1.0, 4.0]]))  # ((0)² + 2²) / 2
    2.0
    >>> float(P.consistency([[1.0, 0.0]], [[0.0, 1.0]], metric="cosine"))
    1.0
    """
    # mse and l1 of two scalars are defined; the other metrics need an axis.
    (a, b), dtype = dtypes.to_compute(a, b)
    axis = _check_pair(a, b, ("a", "b"), axis, min_rank=0 if metric in ("mse", "l1") else 1)
    if metric == "kl":
        pa, loga = num.probs_and_log_probs(a, from_logits=from_logits, temperature=1.0, axis=axis)
        pb, logb = num.probs_and_log_probs(b, from_logits=from_logits, temperature=1.0, axis=axis)
        values = 0.5 * (backend.kl_rows(pa, loga, logb, axis) + backend.kl_rows(pb, logb, loga, axis))
    elif metric == "js":
        values = _js_values(a, b, from_logits=from_logits, temperature=1.0, axis=axis)
    else:
        if from_logits:
            a, b = ops.softmax(a, axis=axis), ops.softmax(b, axis=axis)
        if metric == "mse":
            values = reductions.mean(ops.square(a - b), axis=axis)
        elif metric == "l1":
            values = reductions.mean(ops.abs(a - b), axis=axis)
        else:
            if len(a.shape) < 2:
                raise ValueError(
                    "`metric='cosine'` compares samples along axis 0: `a` and "
                    f"`b` need rank >= 2; got shape {tuple(a.shape)}."
                )
            features = tuple(range(1, len(a.shape)))
            na = num.safe_norm(a, axis=features)
            nb = num.safe_norm(b, axis=features)
            dot = ops.sum(a * b, axis=features)
            denom = na * nb
            positive = denom > 0
            cos = ops.where(positive, dot / ops.where(positive, denom, 1.0), 0.0)
            values = 1.0 - cos
    return dtypes.from_compute(reductions.reduce(values, reduction), dtype)


@check.options(target=check.open_unit, axis=check.integer)
def kl_sparsity(x: TensorLike, *, target: float = 0.05, axis: int = 0) -> Tensor:
    """Sparse-autoencoder penalty: Σ_j KL(ρ‖ρ̂_j) between Bernoulli means.

    ρ̂_j is unit j's mean activation over the batch axis `axis`, ρ = `target`;
    KL(ρ‖ρ̂) = ρ log(ρ/ρ̂) + (1 − ρ) log((1 − ρ)/(1 − ρ̂)), summed over units
    (every other axis). Activations must lie in (0, 1), e.g. after a sigmoid;
    ρ̂ of exactly 0 or 1 gives a large finite value, not Inf.

    Args:
        x: activations, shape [batch, ...units].
        target: ρ in (0, 1), the desired mean activation.
        axis: the batch axis (an int).

    Returns:
        A scalar in x's float dtype; 0 for an empty batch.

    Raises:
        ValueError: `target` outside (0, 1), x of rank 0, an `axis` out of
            range.

    Example:

    >>> from keras_penalties import ops as P
    >>> x = [[0.05, 0.5], [0.05, 0.5]]  # unit 0 far below ρ = 0.5, unit 1 on it
    >>> round(float(P.kl_sparsity(x, target=0.5)), 4)  # ½ln(.5/.05) + ½ln(.5/.95)
    0.8304
    """
    (x,), dtype = dtypes.to_compute(x)
    check.check_rank("x", x, 1, "a batch axis")
    axis = check.check_axis("axis", axis, len(x.shape))
    rho_hat = reductions.mean(x, axis=axis)
    values = target * (math.log(target) - num.safe_log(rho_hat)) + (1.0 - target) * (
        math.log(1.0 - target) - num.safe_log(1.0 - rho_hat)
    )
    # No samples, no statistic: 0 rather than the KL of an empty mean of 0.
    samples = ops.cast(ops.shape(x)[axis], values.dtype)
    return dtypes.from_compute(ops.where(samples > 0, ops.sum(values), 0.0), dtype)


@check.options(axis=check.integer, reduction=check.REDUCTION)
def gaussian_kl(
    mean: TensorLike,
    log_var: TensorLike,
    mean_ref: TensorLike | None = None,
    log_var_ref: TensorLike | None = None,
    *,
    axis: int = -1,
    reduction: Reduction = "mean",
) -> Tensor:
    """KL(N(μ, σ²) ‖ N(μ₀, σ₀²)) of diagonal Gaussians, summed over `axis`: the VAE KL term.

    Per sample: Σ_axis ½[log σ₀² − log σ² + (σ² + (μ − μ₀)²)/σ₀² − 1] with
    σ² = exp(log_var). Without a reference it is the KL to N(0, 1), the
    term a VAE adds: −½Σ(1 + log σ² − μ² − σ²). `mean_ref` and `log_var_ref`
    each default to 0 on their own and broadcast against `mean`.

    Args:
        mean, log_var: the encoder's μ and log σ², the same shape, rank ≥ 1.
        mean_ref, log_var_ref: the reference Gaussian's μ₀ and log σ₀², or None.
        axis: the latent axis summed over.
        reduction: `"mean"` (default) or `"sum"` over samples, or `"none"`.

    Returns:
        A scalar (or the per-sample values) in the inputs' float dtype.

    Example:

    >>> from keras_penalties import ops as P
    >>> float(P.gaussian_kl([[0.0, 0.0]], [[0.0, 0.0]]))  # N(0, 1) to itself
    0.0
    >>> round(float(P.gaussian_kl([[1.0]], [[0.0]])), 4)  # ½μ²
    0.5
    """
    names = ("mean", "log_var")
    tensors = [mean, log_var] + [t for t in (mean_ref, log_var_ref) if t is not None]
    converted, dtype = dtypes.to_compute(*tensors)
    mu, log_var = converted[:2]
    refs = iter(converted[2:])
    mu_ref = next(refs) if mean_ref is not None else None
    lv_ref = next(refs) if log_var_ref is not None else None
    check.check_same_shape(names, mu, log_var)
    check.check_rank("mean", mu, 1, "a latent axis")
    axis = check.check_axis("axis", axis, len(mu.shape))
    for name, ref in (("mean_ref", mu_ref), ("log_var_ref", lv_ref)):
        if ref is not None:
            try:
                np.broadcast_shapes(
                    tuple(1 if d is None else d for d in ref.shape), tuple(1 if d is None else d for d in mu.shape)
                )
            except ValueError:
                raise ValueError(
                    f"`{name}` must broadcast against `mean` {tuple(mu.shape)}; got shape {tuple(ref.shape)}."
                ) from None
    diff = mu if mu_ref is None else mu - mu_ref
    if lv_ref is None:
        terms = ops.exp(log_var) + ops.square(diff) - 1.0 - log_var
    else:
        terms = ops.exp(log_var - lv_ref) + ops.square(diff) * ops.exp(-lv_ref) - 1.0 - log_var + lv_ref
    values = 0.5 * ops.sum(terms, axis=axis)
    return dtypes.from_compute(reductions.reduce(values, reduction), dtype)
