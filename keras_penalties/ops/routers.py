"""Penalties on a mixture-of-experts router's logits: the load-balancing loss
(Switch Transformer, GShard, Mixtral) and the router z-loss (ST-MoE).

Notation: z_{l,t} ∈ R^E, the router logits of layer l at token t;
p = softmax(z) in float32; T_{l,t} the k experts with the largest z (as
`keras.ops.top_k`); M_t the mask, the same for every layer. For a set S of
kept (l, t): f_i(S) = Σ_S 1[i ∈ T] / (k·|S|), the fraction of S's routings
sent to expert i (Σ_i f_i = 1), and P_i(S) = Σ_S p_i / |S|.

Within a composite under data parallelism (§11) the routing counts, the
probability sums and |S| are summed over the replicas before f and P are
formed: the value and gradient are one device's on the global batch.
"""

import numbers
from typing import Literal, Sequence, Union

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Tensor, TensorLike
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _reductions as reductions

RouterLogits = Union[TensorLike, Sequence[TensorLike]]
Pool = Literal["all", "layer"]
POOL = check.choice("all", "layer")


def _top_k(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an int in [1, E], the experts each token is routed to; got {value!r}.")
    return int(value)


@check.options(tensors=("mask",), top_k=_top_k, pool=POOL)
def router_load_balancing(
    router_logits: RouterLogits,
    *,
    top_k: int,
    mask: TensorLike | None = None,
    pool: Pool = "all",
) -> Tensor:
    """The load-balancing loss of a mixture-of-experts router: E·Σ_i f_i·P_i.

    Routing that is uniform in both counts and probabilities gives 1, for
    every k and E. f is a constant (routing is discrete): the gradient
    reaches the logits through P only, ∂/∂z_{l,t} = (E·M_t/|S|)·
    p_{l,t}⊙(f − ⟨f, p_{l,t}⟩).

    Hugging Face's pooled `load_balancing_loss_func(gate_logits, E, k,
    attention_mask)` equals k × `router_load_balancing(list(gate_logits),
    top_k=k, mask=attention_mask)` (its f counts tokens: Σ f = k), so an HF
    coefficient is multiplied by k here. keras-hub's per-layer
    `compute_load_balancing_loss` is one layer's value with its mask, and
    its MoE models add it once per layer: `pool="layer"`.

    Args:
        router_logits: one MoE layer's logits [..., E] (every axis but the
            last indexes a routed token; E known statically), or a list or
            tuple of L such tensors of one shape, one per layer (a list of
            nested Python numbers is one tensor: give layers as arrays).
        top_k: k, the experts each token is routed to, 1 ≤ k ≤ E.
            Required.
        mask: None (every token kept), or a tensor with as many elements as
            one layer has tokens, read in row-major order ([B, S] matches
            [B·S, E] rows), the same for every layer; nonzero keeps a token
            (a padding mask). A dropped token's logits may hold anything.
        pool: `"all"`, S every kept (l, t) of every layer, one number (HF's
            pooled form); or `"layer"`, the sum over layers of each layer's
            value over its kept tokens (keras-hub's and Megatron's per-layer
            sum, which grows with L).

    Returns:
        A scalar in the logits' float dtype (computed in float32 from half
        precision); 0, with a zero gradient, where no token is kept.

    Raises:
        ValueError: `top_k` not an int in [1, E]; `pool` not `"all"` or
            `"layer"`; logits of rank < 2 or with E unknown; an empty list,
            or layers of different shapes; a mask whose element count
            differs from one layer's tokens.

    Example:

    >>> from keras_penalties import ops as P
    >>> # Two tokens, E = 2, k = 1: each expert gets one token (f = ½, ½),
    >>> # with probabilities p = (¾, ¼) and (¼, ¾): P = (½, ½).
    >>> import math
    >>> logits = [[math.log(3.0), 0.0], [0.0, math.log(3.0)]]
    >>> round(float(P.router_load_balancing(logits, top_k=1)), 6)  # 2·(½·½ + ½·½)
    1.0
    >>> round(float(P.router_load_balancing(logits, top_k=1, mask=[1, 0])), 6)  # f = (1, 0), P = (¾, ¼)
    1.5
    """
    layers, dtype = _layers(router_logits)
    experts = layers[0].shape[-1]
    if top_k > experts:
        raise ValueError(f"`top_k` must be an int in [1, E] = [1, {experts}]; got {top_k}.")
    z, kept = _masked_logits(layers, mask)
    n_layers = len(layers)
    probs = ops.softmax(z, axis=-1)
    _, chosen = ops.top_k(ops.stop_gradient(z), k=top_k)  # [L, N, k]
    weight = ops.ones_like(z[0, :, 0]) if kept is None else kept  # (a symbolic N has no ops.ones)
    # Σ_t M_t·1[i ∈ T_{l,t}] as [L, E]: a segment sum, no [L, N, k, E] one-hot.
    segments = chosen + ops.reshape(ops.arange(n_layers, dtype=chosen.dtype) * experts, (n_layers, 1, 1))
    routed = ops.broadcast_to(ops.reshape(weight, (1, -1, 1)), ops.shape(chosen))
    counts = ops.segment_sum(ops.reshape(routed, (-1,)), ops.reshape(segments, (-1,)), num_segments=n_layers * experts)
    counts = ops.reshape(counts, (n_layers, experts))
    prob_sums = ops.einsum("n,lne->le", weight, probs)  # Σ_t M_t·p_{l,t}
    size = ops.sum(weight)  # one layer's kept tokens
    if pool == "all":
        counts, prob_sums, size = ops.sum(counts, axis=0), ops.sum(prob_sums, axis=0), size * n_layers
    global_counts, global_size = reductions.whole_batch_sums([counts, size])
    fractions = ops.stop_gradient(global_counts / (top_k * ops.maximum(global_size, 1.0)))
    value = float(experts) * ops.sum(fractions * prob_sums) / reductions.whole_batch_divisor(global_size)
    return dtypes.from_compute(value, dtype)


@check.options(tensors=("mask",), pool=POOL)
def router_z_loss(
    router_logits: RouterLogits,
    *,
    mask: TensorLike | None = None,
    pool: Pool = "all",
) -> Tensor:
    """The router z-loss (ST-MoE, eq. 5): the mean over the kept (l, t) of
    (logsumexp_i z_{l,t,i})², in float32 with the max shifted out.

    ST-MoE weighs it 1e-3. Its gradient is 2·lse·softmax(z) at each kept
    token over their number.

    Args:
        router_logits: one layer's logits [..., E], or a list or tuple of L
            such tensors of one shape (as `router_load_balancing`).
        mask: None, or the tokens that count, as `router_load_balancing`'s.
        pool: `"all"`, the mean over every layer's kept tokens; or
            `"layer"`, the sum over layers of each layer's mean (Megatron's
            `z_loss_func`, added per layer): L times `"all"`.

    Returns:
        A scalar in the logits' float dtype; 0 where no token is kept. From
        float16 logits a value beyond float16's range is inf.

    Raises:
        ValueError: as `router_load_balancing`'s, without `top_k`.

    Example:

    >>> from keras_penalties import ops as P
    >>> # logsumexp of (0, 0) is ln 2, of (ln 3, 0) is ln 4 = 2 ln 2
    >>> import math
    >>> logits = [[0.0, 0.0], [math.log(3.0), 0.0]]
    >>> round(float(P.router_z_loss(logits)), 6)  # (ln²2 + 4 ln²2) / 2
    1.201133
    >>> round(float(P.router_z_loss(logits, mask=[1, 0])), 6)  # ln²2
    0.480453
    """
    layers, dtype = _layers(router_logits)
    z, kept = _masked_logits(layers, mask)
    squares = ops.square(ops.logsumexp(z, axis=-1))  # [L, N]
    if kept is None:
        total, size = ops.sum(squares), ops.sum(ops.ones_like(squares[0]))
    else:
        total, size = ops.sum(squares * kept), ops.sum(kept)
    if pool == "all":
        size = size * len(layers)
    return dtypes.from_compute(total / reductions.kept_divisor(size), dtype)


def _layers(router_logits):
    """The layers' logits as tensors (one shape, rank ≥ 2, E static), and
    the dtype of the value."""
    several = isinstance(router_logits, (list, tuple)) and not _is_nested_numbers(router_logits)
    layers = [backend.as_tensor(t) for t in router_logits] if several else [backend.as_tensor(router_logits)]
    if not layers:
        raise ValueError("`router_logits` must hold at least one layer's logits; got an empty list.")
    for t in layers:
        if len(t.shape) < 2:
            raise ValueError(
                "`router_logits` must be [..., E]: every axis but the last a routed token; got a tensor "
                f"of shape {tuple(t.shape)}."
            )
        if not isinstance(t.shape[-1], int):
            raise ValueError("`router_logits`: the number of experts E (the last axis) must be known statically.")
        if reductions.shapes_differ(tuple(t.shape), tuple(layers[0].shape)):
            raise ValueError(
                f"`router_logits`: every layer's logits must have one shape; got {tuple(layers[0].shape)} "
                f"and {tuple(t.shape)}."
            )
    _, dtype = dtypes.dtype_pair(layers)
    return layers, dtype


def _is_nested_numbers(value):
    """Whether a list is one tensor written as nested Python numbers (a
    single layer's logits from NumPy-like lists) rather than a list of
    layers' tensors."""
    first = value[0] if len(value) else None
    while isinstance(first, (list, tuple)):
        first = first[0] if len(first) else None
    return isinstance(first, numbers.Number) and not isinstance(first, bool)


def _masked_logits(layers, mask):
    """`(z, kept)`: the logits as float32 [L, N, E], 0 at dropped tokens
    (whatever they held), and the mask as float32 [N] (None: all kept)."""
    experts = layers[0].shape[-1]
    z = ops.stack([ops.reshape(dtypes.cast_to(t, "float32"), (-1, experts)) for t in layers])
    if mask is None:
        return z, None
    mask = ops.convert_to_tensor(mask)
    tokens, elements = _static_size(layers[0].shape[:-1]), _static_size(mask.shape)
    if tokens is not None and elements is not None and tokens != elements:
        raise ValueError(
            f"`mask` must have one element per routed token of a layer ({tokens}, from logits "
            f"{tuple(layers[0].shape)}); got shape {tuple(mask.shape)}."
        )
    keep = ops.reshape(ops.cast(mask, "bool"), (-1,))
    z = ops.where(ops.reshape(keep, (1, -1, 1)), z, ops.zeros_like(z))
    return z, ops.cast(keep, "float32")


def _static_size(shape):
    """The number of elements of `shape`, or None where a size is known only at run time."""
    size = 1
    for d in shape:
        if d is None:
            return None
        size *= d
    return size
