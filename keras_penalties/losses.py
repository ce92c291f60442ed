"""Losses for `model.compile(loss=...)`.

Each is a `keras.losses.Loss` over a function of `keras_penalties.ops`: `call`
returns the per-sample values, and Keras' `Loss.__call__` applies
`sample_weight`, masks and `reduction` ("sum_over_batch_size" by default) as
for any Keras loss. Where it would only reduce (float32 or float64 tensors of
the loss's dtype, no sample weight, no mask, one replica), the ops function
reduces them itself, the same arithmetic without Keras' per-call work.
`y_true` is the reference or target, `y_pred` the model's output. All
round-trip through `get_config`/`from_config` and are registered under the
package `"keras_penalties.losses"`.

`CompositeLoss` (a weighted sum of named losses) lives with the other
composite in `keras_penalties.composite`; it is importable from here too.
"""

import inspect
from typing import Any, TypeVar

import keras

from keras_penalties import ops as penalties
from keras_penalties.composite.adapters import loss_result, ops_reduction
from keras_penalties._saving import with_hint, without_hint
from keras_penalties._types import (
    ChunkSize,
    Direction,
    DType,
    EntropyMode,
    LossReduction,
    Metric,
    Reduction,
    Tensor,
    TensorLike,
)
from keras_penalties.ops.divergences import ENTROPY_SIGNS, check_entropy_mode

_PACKAGE = "keras_penalties.losses"
_Loss = TypeVar("_Loss", bound="_PenaltyLoss")


def _options(fn: Any) -> frozenset[str]:
    # An ops function's options: its keyword-only parameters but the call's own.
    parameters = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY) - {"reduction", "mask"}


class _PenaltyLoss(keras.losses.Loss):
    """Per-sample `self.penalty(y_true, y_pred, reduction="none", **options)`."""

    penalty: Any = None  # the ops function, a staticmethod in each subclass

    def __init__(self, arguments: dict[str, Any]) -> None:
        # `arguments`: the subclass constructor's own (its `locals()`): Keras'
        # reduction, name and dtype, and the ops function's options.
        penalty = type(self).penalty
        options = {k: v for k, v in arguments.items() if k in _options(penalty)}
        self._options = penalty.check_options(**options)
        super().__init__(name=arguments["name"], reduction=arguments["reduction"], dtype=arguments["dtype"])
        for key, value in self._options.items():
            setattr(self, key, value)

    def __call__(self, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None = None) -> Tensor:
        # A subclass that overrides `call` goes through Keras as it expects.
        if type(self).call is _PenaltyLoss.call:
            reduction = ops_reduction(
                self, y_true if getattr(self, "needs_y_true", True) else None, y_pred, sample_weight
            )
            if reduction is not None:
                # What Keras would compute, in the ops' own reduction.
                return self._reduced(y_true, y_pred, reduction)
        return loss_result(self, super().__call__(y_true, y_pred, sample_weight))

    def call(self, y_true: TensorLike, y_pred: TensorLike) -> Tensor:
        return self._reduced(y_true, y_pred, "none")

    def _reduced(self, y_true: Tensor, y_pred: Tensor, reduction: Reduction) -> Tensor:
        """The penalty with the ops' `reduction` ("none": per sample)."""
        return type(self).penalty(y_true, y_pred, reduction=reduction, **self._options)

    def get_config(self) -> dict[str, Any]:
        return with_hint({**super().get_config(), "dtype": self.dtype, **self._options})

    @classmethod
    def from_config(cls: type[_Loss], config: dict[str, Any]) -> _Loss:
        return super().from_config(without_hint(config))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class KLDivergence(_PenaltyLoss):
    """KL divergence between the target and predicted distributions, in nats.

    forward: KL(y_true‖y_pred) = Σ y_true (log y_true − log y_pred);
    reverse: KL(y_pred‖y_true) (mode-seeking); symmetric: their mean. With
    probabilities and the defaults it agrees with `keras.losses.KLDivergence`
    (which clips at 1e-7; here 0·log 0 = 0 exactly).

    Args:
        from_logits: whether y_true and y_pred hold logits (e.g. teacher and
            student logits) rather than probabilities.
        direction: `"forward"`, `"reverse"` or `"symmetric"`.
        temperature: T > 0 applied to both (distillation temperature).
        axis: the class axis.
        reduction, name, dtype: as for any `keras.losses.Loss`.
        chunk_size: None, "auto", or rows per chunk for LLM-sized logits
            (`ops.kl_divergence`).

    A token mask is Keras' own: a `y_pred` carrying a Keras mask (from
    `Embedding(mask_zero=True)` or `Masking`) counts its kept positions only,
    and "sum_over_batch_size" divides by their number. A `sample_weight` of
    0/1 per token zeroes the masked positions but still divides by all of them
    (Keras' convention for sample weights).

    Example:

    >>> from keras_penalties.losses import KLDivergence
    >>> round(float(KLDivergence()([[0.5, 0.5]], [[0.25, 0.75]])), 6)
    0.143841
    """

    penalty = staticmethod(penalties.kl_divergence)

    def __init__(
        self,
        from_logits: bool = False,
        direction: Direction = "forward",
        temperature: float = 1.0,
        axis: int = -1,
        reduction: LossReduction = "sum_over_batch_size",
        name: str = "kl_divergence",
        dtype: DType = None,
        chunk_size: ChunkSize = None,
    ) -> None:
        super().__init__(locals())


@keras.saving.register_keras_serializable(package=_PACKAGE)
class JSDivergence(_PenaltyLoss):
    """Jensen-Shannon divergence between y_true and y_pred: symmetric, in [0, ln 2].

    `beta` in (0, 1) gives the generalized JSD of on-policy distillation,
    β·KL(y_true‖m) + (1 − β)·KL(y_pred‖m), m = β·y_true + (1 − β)·y_pred
    (`ops.js_divergence`). `chunk_size` and masks as in `KLDivergence`.

    Example:

    >>> from keras_penalties.losses import JSDivergence
    >>> round(float(JSDivergence()([[1.0, 0.0]], [[0.0, 1.0]])), 6)  # ln 2
    0.693147
    """

    penalty = staticmethod(penalties.js_divergence)

    def __init__(
        self,
        from_logits: bool = False,
        temperature: float = 1.0,
        beta: float = 0.5,
        axis: int = -1,
        reduction: LossReduction = "sum_over_batch_size",
        name: str = "js_divergence",
        dtype: DType = None,
        chunk_size: ChunkSize = None,
    ) -> None:
        super().__init__(locals())


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Entropy(_PenaltyLoss):
    """Entropy of the predicted distribution; `y_true` is ignored.

    `mode="penalty"`: +H (confidence, e.g. entropy minimisation on unlabeled
    data); `mode="bonus"`: −H (exploration bonus). Usually one term of a
    `CompositeLoss`. `chunk_size` and masks as in `KLDivergence`.

    Example:

    >>> from keras_penalties.losses import Entropy
    >>> float(Entropy(from_logits=True, normalize=True)(None, [[0.0, 0.0]]))
    1.0
    """

    penalty = staticmethod(penalties.entropy)
    # A term of a CompositeObjective may give it the prediction alone, and
    # the direct reduction does not check y_true's dtype.
    needs_y_true = False

    def __init__(
        self,
        from_logits: bool = False,
        mode: EntropyMode = "penalty",
        normalize: bool = False,
        temperature: float = 1.0,
        axis: int = -1,
        reduction: LossReduction = "sum_over_batch_size",
        name: str = "entropy",
        dtype: DType = None,
        chunk_size: ChunkSize = None,
    ) -> None:
        self.mode = check_entropy_mode("mode", mode)
        super().__init__(locals())

    def __call__(
        self, y_true: TensorLike | None, y_pred: TensorLike, sample_weight: TensorLike | None = None
    ) -> Tensor:
        # y_true may be None (nothing to compare with); Loss.__call__ would
        # try to convert it.
        return super().__call__(y_pred if y_true is None else y_true, y_pred, sample_weight)

    def _reduced(self, y_true: Tensor, y_pred: Tensor, reduction: Reduction) -> Tensor:
        return ENTROPY_SIGNS[self.mode] * penalties.entropy(y_pred, reduction=reduction, **self._options)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "mode": self.mode}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Consistency(_PenaltyLoss):
    """Disagreement between y_pred and y_true (e.g. two views of one input).

    metric: `"mse"`, `"l1"` (mean over `axis`), `"cosine"` (1 − cos per
    sample), `"kl"` (symmetric KL) or `"js"`.

    Example:

    >>> from keras_penalties.losses import Consistency
    >>> float(Consistency()([[1.0, 2.0]], [[1.0, 4.0]]))
    2.0
    """

    penalty = staticmethod(penalties.consistency)

    def __init__(
        self,
        metric: Metric = "mse",
        from_logits: bool = False,
        axis: int = -1,
        reduction: LossReduction = "sum_over_batch_size",
        name: str = "consistency",
        dtype: DType = None,
    ) -> None:
        super().__init__(locals())


# ---------------------------------------------------------------- CompositeLoss


from keras_penalties.composite.loss import CompositeLoss  # noqa: E402  (importable from here)

__all__ = ["KLDivergence", "JSDivergence", "Entropy", "Consistency", "CompositeLoss"]
