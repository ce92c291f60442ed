"""Regularizers for `kernel_regularizer=`, `bias_regularizer=` and `activity_regularizer=`.

Each is a `keras.regularizers.Regularizer` whose first argument is the
strength `factor` (≥ 0, finite); `reg(x)` returns factor × a penalty from
`keras_penalties.ops`, as a scalar in x's dtype, except that float16/bfloat16
inputs give a float32 value computed in float32 (mixed precision: the sum
neither overflows nor rounds in half precision, and a loss is float32). All round-trip through
`get_config`/`from_config` and are registered under the package
`"keras_penalties.regularizers"`, so models using them save and load.

Activity semantics: Keras (≥ 3.14) divides an activity regularizer's value by
the batch size before adding it. `L1`, `L2`, `ElasticNet` and `Orthogonality`
behave like Keras' own regularizers there (the added loss is their value
divided by the batch size). `Entropy` and `OutputMagnitude` are per-sample
penalties and return factor × the batch SUM, so the loss a layer adds is
factor × the per-sample MEAN whatever the batch size. `KLSparsity` is a batch
statistic and is multiplied by the batch size, so the layer adds exactly
factor × the KL sparsity penalty.
"""

from typing import Any, TypeVar

import keras
from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties import ops as penalties
from keras_penalties._saving import with_hint, without_hint
from keras_penalties.ops.divergences import ENTROPY_SIGNS, check_entropy_mode
from keras_penalties._types import Center, EntropyMode, OrthogonalityAxis, OrthogonalityMode, Tensor, TensorLike

_PACKAGE = "keras_penalties.regularizers"

_Regularizer = TypeVar("_Regularizer", bound="_PenaltyRegularizer")


def _factor(value: Any) -> float:
    """`factor` checked as Keras' own regularizers check theirs: anything but
    a finite number >= 0 is a `ValueError`, a string, None or a
    list included (`keras.regularizers.L1("a")` raises `ValueError` too)."""
    try:
        return check.non_negative("factor", value)
    except TypeError as error:
        raise ValueError(str(error)) from None


class _PenaltyRegularizer(keras.regularizers.Regularizer):
    """factor × `self.penalty(x, **options)`; subclasses name the penalty."""

    penalty: Any = None  # the ops function, a staticmethod in each subclass

    def __init__(self, factor: float, **options: Any) -> None:
        self.factor = _factor(factor)
        self._options = type(self).penalty.check_options(**options)
        for name, value in self._options.items():
            setattr(self, name, value)

    def value(self, x: TensorLike) -> Tensor:
        """The unscaled penalty this regularizer multiplies by `factor`."""
        return type(self).penalty(x, **self._options)

    def __call__(self, x: TensorLike) -> Tensor:
        # The factor multiplies as a Python number, in value's dtype (no
        # cast op to make it a tensor first, at every step on eager torch).
        return self.factor * self.value(_as_input(x))

    def get_config(self) -> dict[str, Any]:
        return with_hint({"factor": self.factor, **self._options})

    @classmethod
    def from_config(cls: type[_Regularizer], config: dict[str, Any]) -> _Regularizer:
        return cls(**without_hint(config))

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self._options.items())
        return f"{type(self).__name__}({self.factor}{options})"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class L1(_PenaltyRegularizer):
    """L1 regularizer: factor × Σ|x|.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import L1
    >>> float(L1(0.5)(ops.ones((2, 3))))
    3.0
    """

    penalty = staticmethod(penalties.l1)

    def __init__(self, factor: float) -> None:
        super().__init__(factor)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class L2(_PenaltyRegularizer):
    """L2 regularizer: factor × Σ(x − c)², no ½ (as `keras.regularizers.L2`).

    Args:
        factor: strength ≥ 0.
        center: `None` (c = 0), a number, or `"mean"` (x's own mean).
        clip: `None` or a positive bound on |x − c| before squaring.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import L2
    >>> float(L2(2.0)(ops.ones((5, 5))))
    50.0
    >>> float(L2(2.0, center=1.0)(ops.ones((5, 5))))
    0.0
    """

    penalty = staticmethod(penalties.l2)

    def __init__(self, factor: float, center: Center = None, clip: float | None = None) -> None:
        super().__init__(factor, center=center, clip=clip)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ElasticNet(_PenaltyRegularizer):
    """Elastic net: factor × (α·Σ|x| + (1 − α)·Σx²), α = `l1_ratio` in [0, 1].

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import ElasticNet
    >>> float(ElasticNet(1.0, l1_ratio=0.25)(ops.full((2,), 2.0)))  # .25·4 + .75·8
    7.0
    """

    penalty = staticmethod(penalties.elastic_net)

    def __init__(self, factor: float, l1_ratio: float = 0.5) -> None:
        super().__init__(factor, l1_ratio=l1_ratio)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Orthogonality(_PenaltyRegularizer):
    """Orthogonality of a kernel's vectors: factor × `ops.orthogonality`.

    A kernel is reshaped to [−1, units]; with `axis="columns"` each output
    unit's weight vector is one vector of the Gram matrix G. `mode`: `"soft"`
    Σ_{i≠j} G_ij², `"hard"` ‖G − I‖²_F, `"spectral"` σ_max(G − I). Meant for
    `kernel_regularizer=`.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import Orthogonality
    >>> float(Orthogonality(1.0)(ops.eye(3)))
    0.0
    >>> float(Orthogonality(1.0, mode="hard", normalize=False)(2 * ops.eye(2)))  # ‖4I − I‖²
    18.0
    """

    penalty = staticmethod(penalties.orthogonality)

    def __init__(
        self,
        factor: float,
        mode: OrthogonalityMode = "soft",
        axis: OrthogonalityAxis = "columns",
        normalize: bool = True,
    ) -> None:
        super().__init__(factor, mode=mode, axis=axis, normalize=normalize)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Entropy(_PenaltyRegularizer):
    """Entropy of a layer's output distribution (last axis), for `activity_regularizer=`.

    `mode="penalty"` adds +H (pushes towards confident outputs); `"bonus"`
    adds −H (rewards spread-out outputs, the RL entropy bonus). Returns
    factor × ±Σ_i H_i, the batch SUM; Keras divides an activity regularizer by
    the batch size, so the loss the layer adds is factor × the per-sample mean
    entropy, independent of batch size.

    Args:
        factor: strength ≥ 0.
        from_logits: whether the output holds logits (else probabilities).
        mode: `"penalty"` or `"bonus"`.
        normalize: divide H by ln(K), K the number of classes.
        temperature: T > 0, applied before the entropy.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import Entropy
    >>> reg = Entropy(0.1, from_logits=True, mode="bonus", normalize=True)
    >>> round(float(reg(ops.zeros((4, 8)))), 6)  # uniform: H/ln K = 1 per sample, summed
    -0.4
    """

    penalty = staticmethod(penalties.entropy)

    def __init__(
        self,
        factor: float,
        from_logits: bool = False,
        mode: EntropyMode = "penalty",
        normalize: bool = False,
        temperature: float = 1.0,
    ) -> None:
        self.mode = check_entropy_mode("mode", mode)
        super().__init__(
            factor,
            from_logits=from_logits,
            normalize=normalize,
            temperature=temperature,
        )

    def value(self, x: TensorLike) -> Tensor:
        return ENTROPY_SIGNS[self.mode] * penalties.entropy(x, reduction="sum", **self._options)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "mode": self.mode}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class KLSparsity(_PenaltyRegularizer):
    """Sparse-autoencoder penalty for `activity_regularizer=`: factor × Σ_j KL(ρ‖ρ̂_j).

    ρ̂_j is unit j's mean activation over the batch, ρ = `target` in (0, 1);
    activations must lie in (0, 1) (e.g. a sigmoid layer). The value is a batch
    statistic, so `reg(x)` is multiplied by the batch size to cancel Keras'
    division: the loss the layer adds is exactly factor × the penalty.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import KLSparsity
    >>> float(KLSparsity(1.0, target=0.5)(ops.full((4, 3), 0.5)))
    0.0
    """

    penalty = staticmethod(penalties.kl_sparsity)

    def __init__(self, factor: float, target: float = 0.05) -> None:
        super().__init__(factor, target=target)

    def value(self, x: TensorLike) -> Tensor:
        return _times_rows(super().value(x), x)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class OutputMagnitude(_PenaltyRegularizer):
    """Output norm penalty for `activity_regularizer=`: (‖x_i‖₂ − target)² per sample.

    Returns factor × the batch SUM, so the loss a layer adds is factor × the
    per-sample mean, independent of batch size.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.regularizers import OutputMagnitude
    >>> float(OutputMagnitude(1.0, target=1.0)(ops.zeros((3, 4))))  # (0 − 1)², 3 samples
    3.0
    """

    penalty = staticmethod(penalties.output_magnitude)

    def __init__(self, factor: float, target: float = 1.0) -> None:
        super().__init__(factor, target=target)

    def value(self, x: TensorLike) -> Tensor:
        return penalties.output_magnitude(x, reduction="sum", **self._options)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RouterLoadBalancing(_PenaltyRegularizer):
    """A mixture-of-experts router's load-balancing loss for
    `activity_regularizer=` on the router (a Dense producing [..., E]
    logits): the layer adds factor × `ops.router_load_balancing(output,
    top_k=top_k)` (+ z_loss × `ops.router_z_loss(output)`: a layer takes one
    activity regularizer, and ST-MoE uses both).

    Both are batch statistics, so `reg(x)` is multiplied by x's axis 0 to
    cancel Keras' division, for [B·S, H] rows as for [B, S, H] sequences.
    Every token counts, padding too: use it where batches are unpadded, else
    the op with a `mask` (or a `Term`). A model with one on each of L routers
    adds `pool="layer"`'s sum. The value is float32 from half precision.

    Args:
        factor: the load-balancing weight, ≥ 0.
        top_k: k, the experts each token is routed to (an int ≥ 1).
        z_loss: the router z-loss's weight, ≥ 0 (ST-MoE: 1e-3).

    Example:

    >>> import math
    >>> from keras_penalties.regularizers import RouterLoadBalancing
    >>> logits = [[math.log(3.0), 0.0], [0.0, math.log(3.0)]]  # balanced: 1
    >>> round(float(RouterLoadBalancing(0.01, top_k=1)(logits)), 6)  # × 2 rows
    0.02
    """

    penalty = staticmethod(penalties.router_load_balancing)

    def __init__(self, factor: float, top_k: int, z_loss: float = 0.0) -> None:
        super().__init__(factor, top_k=top_k)
        self.z_loss = check.non_negative("z_loss", z_loss)

    def value(self, x: TensorLike) -> Tensor:
        return _times_rows(super().value(x), x)

    def __call__(self, x: TensorLike) -> Tensor:
        x = _as_input(x)
        value = self.factor * self.value(x)
        if not self.z_loss:
            return value
        return value + self.z_loss * _times_rows(penalties.router_z_loss(x), x)

    def get_config(self) -> dict[str, Any]:
        return with_hint({"factor": self.factor, "top_k": self.top_k, "z_loss": self.z_loss})


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RouterZLoss(_PenaltyRegularizer):
    """The router z-loss for `activity_regularizer=` on a mixture-of-experts
    router: the layer adds factor × `ops.router_z_loss(output)` (ST-MoE's
    weight: 1e-3). A batch statistic, so `reg(x)` is multiplied by x's axis
    0, as `RouterLoadBalancing`'s; every token counts, padding too.

    Example:

    >>> import math
    >>> from keras_penalties.regularizers import RouterZLoss
    >>> round(float(RouterZLoss(1.0)([[0.0, 0.0]])), 6)  # (ln 2)², one row
    0.480453
    """

    penalty = staticmethod(penalties.router_z_loss)

    def __init__(self, factor: float) -> None:
        super().__init__(factor)

    def value(self, x: TensorLike) -> Tensor:
        return _times_rows(super().value(x), x)


def _as_input(x: TensorLike) -> Tensor:
    """x as a tensor a penalty reads: half precision as float32 (mixed
    precision: a loss contribution is float32, and the sum must not
    overflow, or round, in half precision before the factor scales it down:
    L1(1e-4) of 131072 float16 ones is 13.1)."""
    x = ops.convert_to_tensor(x)
    return ops.cast(x, "float32") if backend.is_half(x.dtype) else x


def _times_rows(value: Tensor, x: TensorLike) -> Tensor:
    """A batch statistic times x's axis 0, which Keras divides an activity
    regularizer's value by."""
    return value * ops.cast(ops.shape(ops.convert_to_tensor(x))[0], value.dtype)


__all__ = [
    "L1",
    "L2",
    "ElasticNet",
    "Orthogonality",
    "Entropy",
    "KLSparsity",
    "OutputMagnitude",
    "RouterLoadBalancing",
    "RouterZLoss",
]
