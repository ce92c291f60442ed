"""Language-model heads: lazy logits from hidden states, and cross-entropy.

At LLM scale the [tokens, vocab] logits are the memory: a student's logits,
their gradient and a teacher's logits are three such arrays. `linear`
describes the logits `hidden @ kernel (+ bias)` without forming them; the
token-level ops (`kl_divergence`, `js_divergence`, `entropy`,
`cross_entropy`) accept it wherever they take logits, and with `chunk_size`
form a chunk's logits only while that chunk is computed (Liger-Kernel's fused
linear losses, on every Keras backend).
"""

import functools
from typing import Any

import keras
from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import ChunkSize, Tensor, TensorLike, TokenReduction
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops._tokens import LinearLogits, token_columns, token_level


def layer_head(layer: Any, argument: str = "kernel") -> tuple[Any, Any, bool, float | None]:
    """`(kernel, bias, transpose_kernel, soft_cap)` of a vocabulary
    projection layer: a `keras.layers.Dense` (linear: its kernel and bias),
    or a reversible embedding (keras-hub's `ReversibleEmbedding`; tied: its
    embeddings, transposed; untied: its reverse embeddings), with its
    `logit_soft_cap` (Gemma 2's heads). `argument` names it in errors."""
    cap = getattr(layer, "logit_soft_cap", None) or None
    if getattr(layer, "quantization_mode", None):
        raise ValueError(f"`{argument}`: {layer.name} is quantized; a fused head needs a float kernel.")
    if hasattr(layer, "tie_weights") and hasattr(layer, "embeddings"):
        if layer.tie_weights:
            return layer.embeddings, None, True, cap
        return layer.reverse_embeddings, None, False, cap
    if isinstance(layer, keras.layers.Dense):
        if layer.activation is not keras.activations.linear:
            raise ValueError(f"`{argument}`: {layer.name} has an activation; a head's output must be its logits.")
        return layer.kernel, (layer.bias if layer.use_bias else None), False, None
    tensor = "a tensor, " if argument == "kernel" else ""
    raise TypeError(
        f"`{argument}` must be {tensor}a keras.layers.Dense or a reversible embedding (keras-hub's "
        f"ReversibleEmbedding); got {type(layer).__name__}."
    )


@check.options(transpose_kernel=check.boolean, soft_cap=check.optional(check.positive))
def linear(
    hidden: TensorLike,
    kernel: TensorLike | keras.layers.Layer,
    bias: TensorLike | None = None,
    *,
    transpose_kernel: bool = False,
    soft_cap: float | None = None,
) -> LinearLogits:
    """The logits `hidden @ kernel (+ bias)`, described but not formed.

    Pass the result, with `from_logits=True`, wherever `kl_divergence`,
    `js_divergence`, `entropy` or `cross_entropy` take logits, for either
    or both of their arguments. Without `chunk_size` the logits are formed
    whole (in float32 from half-precision inputs), as the layer would form
    them. With `chunk_size`, a chunk's logits exist only while that chunk is
    computed, forward and backward, and gradients reach `hidden`, `kernel`
    and `bias` (summed over chunks): for 16 k tokens and a 256 k
    vocabulary, the 16.8 GB float32 logits and their gradient are never
    formed.

    Args:
        hidden: the hidden states [..., H] that feed the vocabulary
            projection (e.g. a causal LM backbone's output).
        kernel: [H, V], a `keras.layers.Dense` kernel; or [V, H] with
            `transpose_kernel=True`, a tied embedding such as keras-hub's
            `ReversibleEmbedding.embeddings` (read transposed in place,
            never copied); or the head layer itself, a `Dense` or a
            keras-hub `ReversibleEmbedding` (`causal_lm.backbone.
            token_embedding`), which says its kernel, bias, orientation and
            soft cap: `linear(hidden, layer)` forms a keras-hub model's
            logits as its own head does, Gemma's cap included.
        bias: None, or [V].
        transpose_kernel: whether `kernel` is [V, H].
        soft_cap: None, or c > 0: the logits are c·tanh(z / c) of
            z = hidden @ kernel (+ bias), in float32 inside each chunk, with
            its gradient (Gemma 2's `final_logit_soft_cap`, keras-hub's
            `ReversibleEmbedding(logit_soft_cap=...)`).

    Returns:
        A `LinearLogits` of shape `hidden.shape[:-1] + (V,)`.

    Raises:
        ValueError: `kernel` not of rank 2, its H axis not `hidden`'s last
            axis, `bias` not of shape [V], or `soft_cap` ≤ 0; with a layer,
            `bias`, `transpose_kernel` or `soft_cap` given (the layer says
            them), a Dense with an activation, a quantized layer.
        TypeError: a layer that is neither a Dense nor a reversible
            embedding.

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> hidden = [[math.log(3.0), 0.0]]       # logits [ln 3, 0]: p = [3/4, 1/4]
    >>> logits = P.linear(hidden, [[1.0, 0.0], [0.0, 1.0]])
    >>> logits.shape
    (1, 2)
    >>> round(float(P.cross_entropy([0], logits, chunk_size=1)), 6)  # −ln(3/4)
    0.287682
    """
    if isinstance(kernel, keras.layers.Layer):
        given = [
            name
            for name, set_ in (
                ("bias", bias is not None),
                ("transpose_kernel", transpose_kernel),
                ("soft_cap", soft_cap is not None),
            )
            if set_
        ]
        if given:
            raise ValueError(
                f"`kernel` is the layer {kernel.name}, which says its bias, orientation and soft cap: leave "
                f"{', '.join(f'`{name}`' for name in given)} at the default."
            )
        kernel, bias, transpose_kernel, soft_cap = layer_head(kernel)
    hidden, kernel = ops.convert_to_tensor(hidden), ops.convert_to_tensor(kernel)
    check.check_rank("hidden", hidden, 1, "a feature axis")
    if len(kernel.shape) != 2:
        raise ValueError(
            "`kernel` must have rank 2 ([H, V], or [V, H] with transpose_kernel=True); "
            f"got shape {tuple(kernel.shape)}."
        )
    features, axis_name = (kernel.shape[1], "second") if transpose_kernel else (kernel.shape[0], "first")
    if hidden.shape[-1] is not None and features is not None and hidden.shape[-1] != features:
        raise ValueError(
            f"`kernel`'s {axis_name} axis ({features}) must equal `hidden`'s last axis ({hidden.shape[-1]}): "
            f"got kernel {tuple(kernel.shape)} for hidden {tuple(hidden.shape)}"
            + ("" if transpose_kernel else " (a tied [V, H] embedding needs transpose_kernel=True)")
            + "."
        )
    lazy = LinearLogits(hidden, kernel, None, transpose_kernel, soft_cap)
    if bias is not None:
        bias = ops.convert_to_tensor(bias)
        if len(bias.shape) != 1 or (
            bias.shape[0] is not None and lazy.classes is not None and bias.shape[0] != lazy.classes
        ):
            raise ValueError(f"`bias` must have shape ({lazy.classes},), one per class; got {tuple(bias.shape)}.")
        lazy.bias = bias
    return lazy


@check.options(
    tensors=("mask",),
    from_logits=check.boolean,
    label_smoothing=check.closed_unit,
    temperature=check.positive,
    axis=check.integer,
    reduction=check.TOKEN_REDUCTION,
    chunk_size=check.chunk_size,
    z_loss=check.non_negative,
    together=lambda options: _z_loss_needs_logits(options.get("z_loss", 0.0), options.get("from_logits", True)),
)
def cross_entropy(
    labels: TensorLike,
    logits: TensorLike | LinearLogits,
    *,
    from_logits: bool = True,
    mask: TensorLike | None = None,
    label_smoothing: float = 0.0,
    temperature: float = 1.0,
    axis: int = -1,
    reduction: TokenReduction = "mean",
    chunk_size: ChunkSize = None,
    z_loss: float = 0.0,
) -> Tensor:
    """Cross-entropy of integer labels: −log p(label) along `axis`, in nats.

    The hard-label half of distillation, and plain causal-LM training. Equal
    to `keras.losses.sparse_categorical_crossentropy(labels, logits,
    from_logits=True)` at each kept position; with `label_smoothing` ε, to
    Keras' convention for `categorical_crossentropy`: the one-hot target
    becomes (1 − ε)·onehot + ε/K, so the value is
    −(1 − ε)·log p(label) − ε·mean_k log p_k.

    Args:
        labels: integer class indices, the shape of `logits` without
            `axis` (e.g. [batch, tokens]). A negative label masks its
            position (Hugging Face's -100: counted nowhere); where `mask`
            drops a position its label is not read; a kept label ≥ K gives
            NaN there.
        logits: logits (the default), probabilities with
            `from_logits=False` (used as given, like `kl_divergence`:
            unlike Keras, not clipped at 1e-7), or `ops.linear(...)`.
        from_logits: whether `logits` holds logits.
        mask: None, or the positions that count (as in `kl_divergence`);
            `"mean"` averages over the kept positions, Liger-Kernel's
            `ignore_index` convention.
        label_smoothing: ε in [0, 1].
        temperature: T > 0 dividing the logits.
        axis: the class axis.
        reduction: `"mean"` (default), `"sum"`, `"none"`, or over the
            sequences of [batch, tokens] labels `"sequence_mean"` /
            `"sequence_sum"` (see `kl_estimate`).
        chunk_size: None, "auto", or rows per chunk (as in `kl_divergence`);
            with `ops.linear(...)` logits every reduction forms no
            [positions, classes] array, forward or backward.
        z_loss: λ ≥ 0, the logit z-loss (PaLM; OLMo's 1e-5, Liger's
            `lse_square_scale`): each kept position's value is CE_t +
            λ·lse_t², lse_t the logsumexp of the logits the cross-entropy
            reads (after `ops.linear`'s soft cap, over `temperature`), from
            the chunks the pass forms anyway (no extra product); its
            gradient adds 2λ·lse_t·softmax(z_t). Every reduction applies to
            the sum; `label_smoothing` is unaffected.

    Raises:
        ValueError: `z_loss` < 0 or not finite, or > 0 with
            `from_logits=False` (no logits, no logsumexp); a bad option,
            shape or axis (named).

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> logits = [[0.0, 0.0], [math.log(3.0), 0.0]]  # p = [½, ½] and [¾, ¼]
    >>> round(float(P.cross_entropy([0, 1], logits)), 6)  # (ln 2 + ln 4) / 2
    1.039721
    >>> round(float(P.cross_entropy([0, 1], logits, mask=[1, 0])), 6)  # ln 2
    0.693147
    >>> round(float(P.cross_entropy([0], [[0.0, 0.0]], z_loss=0.1)), 6)  # ln 2 + 0.1·ln²2
    0.741192
    """
    values = functools.partial(
        _cross_entropy_values,
        from_logits=from_logits,
        label_smoothing=label_smoothing,
        temperature=temperature,
        z_loss=z_loss,
    )
    return token_level(
        values, (logits,), ("logits",), axis, reduction, mask, chunk_size, from_logits=from_logits, labels=labels
    )


@check.options(
    tensors=("mask",),
    temperature=check.positive,
    chunk_size=check.chunk_size,
    return_entropy=check.boolean,
    return_log_sum_sq=check.boolean,
    return_logsumexp=check.boolean,
    return_top1=check.boolean,
)
def token_logprobs(
    labels: TensorLike,
    logits: TensorLike | LinearLogits,
    *,
    temperature: float = 1.0,
    mask: TensorLike | None = None,
    chunk_size: ChunkSize = None,
    return_entropy: bool = False,
    return_log_sum_sq: bool = False,
    return_logsumexp: bool = False,
    return_top1: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """log p(label) at each position: the sampled tokens' log-probabilities.

    The shape of `labels` (TRL's `selective_log_softmax`), equal to
    −`cross_entropy(labels, logits, reduction="none")`. With
    `ops.linear(...)` logits and `chunk_size`, no [tokens, vocab] logits are
    formed, forward or backward, and the gradient reaches `hidden`,
    `kernel` and `bias` (each chunk's logits are formed again in the
    backward pass). What `kl_estimate` and `policy_loss` take.

    `labels` with one more axis ([..., K]: several ids a position) give
    [..., K] log-probabilities of those ids, fused and chunked the same way:
    a sampler's top-k or top-p set replayed (its renormalised
    log-probability is the label's minus the logsumexp over the set), or a
    teacher's top-k for `topk_kl`.

    Args:
        labels: integer token ids, the logits' shape without the class
            axis (e.g. [batch, tokens]), or that plus K ids a position. A
            negative id masks its position (Hugging Face's -100); a kept
            id ≥ V gives NaN there.
        logits: logits [..., V] or `ops.linear(...)`.
        temperature: T > 0 dividing the logits (a sampler's temperature).
        mask: None, or the positions that count: the others are 0 and carry
            no gradient, whatever their labels and logits hold.
        chunk_size: None, "auto", or rows per chunk (as in `kl_divergence`).
        return_entropy: also return the entropy (nats) of softmax(logits /
            T) at each position, from the same chunks (no extra matrix
            product), with its gradient (TRL's
            `_get_per_token_logps_and_entropies`): `(logprobs, entropy)`.
        return_log_sum_sq: also return log Σ_v p_v² of p = softmax(logits /
            T) at each position, logsumexp(2z/T) − 2·logsumexp(z/T), from
            the same chunks (no extra matrix product), a constant (no
            gradient, as TRL's fused head marks it): WPO's input
            (`preference_loss(..., chosen_log_sum_sq=...)`).
        return_logsumexp: also return lse_t = logsumexp(logits / T) at each
            position (nats), differentiable, from the same chunks:
            λ·mean(lse²) over the kept positions is the logit z-loss of any
            loss built from log-probabilities (RL, DPO).
        return_top1: also return 1.0 where the label's logit is the largest
            at its position (ties count), else 0: a constant of `labels`'
            shape (one per id with [..., K] labels), from the same chunks;
            its mean over the kept positions is TRL's `mean_token_accuracy`.

    Returns:
        The log-probabilities, `labels`' shape; with any `return_*`, a tuple
        `(logprobs, entropy, log_sum_sq, logsumexp, top1)` of those asked
        for, in that order, each extra one of the positions' shape (one a
        position, also with K ids) but `top1`, of `labels`' shape. In the
        logits' dtype; 0 at masked positions.

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> logits = [[math.log(3.0), 0.0]]  # p = [¾, ¼]
    >>> [round(float(v), 6) for v in P.token_logprobs([1], logits)]  # ln ¼
    [-1.386294]
    >>> logprobs, entropy = P.token_logprobs([[0, 1]], logits, return_entropy=True)
    >>> [round(float(v), 6) for v in logprobs[0]], round(float(entropy[0]), 6)  # ln ¾, ln ¼; −Σ p ln p
    ([-0.287682, -1.386294], 0.562335)
    """
    ids = ops.convert_to_tensor(labels)
    if not isinstance(logits, LinearLogits):
        logits = backend.as_tensor(logits)
    positions = len(logits.shape) - 1
    if len(ids.shape) not in (positions, positions + 1):
        raise ValueError(
            f"`labels` must have the logits' shape without the class axis, {tuple(logits.shape[:-1])}, or that "
            f"plus K ids a position; got {tuple(ids.shape)}."
        )
    several = len(ids.shape) == positions + 1
    if not several and not (return_entropy or return_log_sum_sq or return_logsumexp or return_top1):
        values = cross_entropy(
            labels,
            logits,
            from_logits=True,
            temperature=temperature,
            mask=mask,
            reduction="none",
            chunk_size=chunk_size,
        )
        return ops.negative(values)
    columns = functools.partial(
        _logprob_columns,
        temperature=temperature,
        entropy=return_entropy,
        log_sum_sq=return_log_sum_sq,
        logsumexp=return_logsumexp,
        top1=return_top1,
        several=several,
    )
    extra = int(return_entropy) + int(return_log_sum_sq) + int(return_logsumexp)
    groups = 2 if return_top1 else 1
    values = token_columns(columns, logits, ids, mask, chunk_size, several, extra, groups)
    width = ids.shape[-1] if several else 1
    if not isinstance(width, int):  # K known at run time only
        width = (ops.shape(values)[-1] - extra) // groups
    logprobs = values[..., :width]
    top1 = values[..., width : 2 * width] if return_top1 else None
    if not several:
        logprobs = logprobs[..., 0]
        top1 = None if top1 is None else top1[..., 0]
    rest = [values[..., groups * width + i] for i in range(extra)]
    if not rest and top1 is None:
        return logprobs
    return (logprobs, *rest, *([] if top1 is None else [top1]))


def _logprob_columns(
    logits: Tensor,
    *,
    labels: Tensor,
    temperature: float,
    entropy: bool,
    log_sum_sq: bool,
    several: bool,
    logsumexp: bool = False,
    top1: bool = False,
    axis: int = -1,
) -> Tensor:
    """[rows, K (+ K) (+ 1) (+ 1) (+ 1)]: log p of each row's labels ([rows]
    or [rows, K]), then with `top1` whether each label's logit is the
    row's largest (a constant), with `entropy` the row's entropy, with
    `log_sum_sq` its log Σ p² (a constant), with `logsumexp` its lse, from
    the same logits (classes on the last `axis`)."""
    labels = labels if several else labels[:, None]
    scaled = logits if temperature == 1.0 else logits / temperature
    width = ops.shape(labels)[1]
    fused = backend.label_logprobs(scaled, labels, entropy, log_sum_sq, logsumexp)
    if fused is None:
        fused = _label_columns(logits, labels, temperature, entropy, log_sum_sq, several)
        if logsumexp:  # lse = z_label / T − log p(label), from the label's logit (a gather)
            picked = ops.expand_dims(backend.pick_labels(scaled, labels[:, 0], -1), -1)
            fused = ops.concatenate([fused, picked - fused[:, :1]], axis=-1)
    if not top1:
        return fused
    # Whether each label's logit is the row's largest: a constant, after the labels' log-probabilities.
    picked = ops.stop_gradient(ops.take_along_axis(scaled, labels, axis=-1))
    won = ops.cast(picked >= ops.max(ops.stop_gradient(scaled), axis=-1, keepdims=True), picked.dtype)
    return ops.concatenate([fused[:, :width], won, fused[:, width:]], axis=-1)


def _label_columns(
    logits: Tensor, labels: Tensor, temperature: float, entropy: bool, log_sum_sq: bool, several: bool
) -> Tensor:
    """`_logprob_columns`' log-probabilities, entropy and log Σ p² where the
    backend has no fused kernel."""
    logp = num.log_probs(logits, from_logits=True, temperature=temperature, axis=-1)
    if several:
        columns = [ops.take_along_axis(logp, labels, axis=-1)]
    else:
        columns = [ops.expand_dims(backend.pick_labels(logp, labels[:, 0], -1), -1)]
    if entropy:
        columns.append(-ops.sum(ops.exp(logp) * logp, axis=-1, keepdims=True))
    if log_sum_sq:  # from p = exp(log p), which the gradient forms too (XLA shares it)
        p = ops.exp(logp)
        columns.append(ops.stop_gradient(ops.log(ops.sum(p * p, axis=-1, keepdims=True))))
    return ops.concatenate(columns, axis=-1) if len(columns) > 1 else columns[0]


def _z_loss_needs_logits(z_loss: float, from_logits: bool) -> None:
    if z_loss and not from_logits:
        raise ValueError("`z_loss` > 0 needs logits (`from_logits=True`): it is λ·logsumexp(logits)².")


def _cross_entropy_values(
    logits: Tensor,
    *,
    labels: Tensor,
    from_logits: bool,
    label_smoothing: float,
    temperature: float,
    axis: int,
    z_loss: float = 0.0,
) -> Tensor:
    if from_logits and not label_smoothing and temperature == 1.0:
        fused = backend.label_cross_entropy(logits, labels, axis)
        if fused is not None:
            return fused if not z_loss else fused + z_loss * _lse_squared(logits, labels, -fused, axis, temperature)
    if z_loss and not label_smoothing and len(logits.shape) == 2 and axis in (-1, 1):
        # torch's chunk kernel: log p(label) and lse in one pass, lse's gradient in the same backward.
        scaled = logits if temperature == 1.0 else logits / temperature
        fused = backend.label_logprobs(scaled, labels[:, None], False, False, True)
        if fused is not None:
            return -fused[:, 0] + z_loss * ops.square(fused[:, 1])
    logp = num.log_probs(logits, from_logits=from_logits, temperature=temperature, axis=axis)
    picked = backend.pick_labels(logp, labels, axis)
    values = -picked
    if label_smoothing:
        values = -(1.0 - label_smoothing) * picked - label_smoothing * reductions.mean(logp, axis=axis)
    if not z_loss:
        return values
    return values + z_loss * _lse_squared(logits, labels, picked, axis, temperature)


def _lse_squared(logits: Tensor, labels: Tensor, picked: Tensor, axis: int, temperature: float) -> Tensor:
    """lse² at each position from log p(label) `picked`, which the
    cross-entropy formed anyway: lse = z_label / T − log p(label) (a gather,
    no pass over the classes)."""
    lse = backend.pick_labels(logits, labels, axis)
    lse = (lse if temperature == 1.0 else lse / temperature) - picked
    return ops.square(lse)
