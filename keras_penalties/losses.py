"""Losses for `model.compile(loss=...)`.

Each is a `keras.losses.Loss` over a function of `keras_penalties.ops`: `call`
returns the per-sample values, and Keras' `Loss.__call__` applies
`sample_weight`, masks and `reduction` ("sum_over_batch_size" by default) as
for any Keras loss. `y_true` is the reference or target, `y_pred` the model's
output. All round-trip through `get_config`/`from_config` and are registered
under the package `"keras_penalties.losses"`.
"""

import keras

from keras_penalties import ops as penalties
from keras_penalties.regularizers import ENTROPY_MODES, check_entropy_mode

_PACKAGE = "keras_penalties.losses"


class _PenaltyLoss(keras.losses.Loss):
    """Per-sample `self.penalty(y_true, y_pred, reduction="none", **options)`."""

    penalty = None

    def __init__(self, reduction, name, dtype, **options):
        self._options = type(self).penalty.check_options(**options)
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        for key, value in self._options.items():
            setattr(self, key, value)

    def call(self, y_true, y_pred):
        return type(self).penalty(y_true, y_pred, reduction="none", **self._options)

    def get_config(self):
        return {**super().get_config(), "dtype": self.dtype, **self._options}


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

    Example:

    >>> from keras_penalties.losses import KLDivergence
    >>> round(float(KLDivergence()([[0.5, 0.5]], [[0.25, 0.75]])), 6)
    0.143841
    """

    penalty = staticmethod(penalties.kl_divergence)

    def __init__(
        self,
        from_logits=False,
        direction="forward",
        temperature=1.0,
        axis=-1,
        reduction="sum_over_batch_size",
        name="kl_divergence",
        dtype=None,
    ):
        super().__init__(
            reduction,
            name,
            dtype,
            from_logits=from_logits,
            direction=direction,
            temperature=temperature,
            axis=axis,
        )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class JSDivergence(_PenaltyLoss):
    """Jensen-Shannon divergence between y_true and y_pred: symmetric, in [0, ln 2].

    Example:

    >>> from keras_penalties.losses import JSDivergence
    >>> round(float(JSDivergence()([[1.0, 0.0]], [[0.0, 1.0]])), 6)  # ln 2
    0.693147
    """

    penalty = staticmethod(penalties.js_divergence)

    def __init__(
        self,
        from_logits=False,
        temperature=1.0,
        axis=-1,
        reduction="sum_over_batch_size",
        name="js_divergence",
        dtype=None,
    ):
        super().__init__(
            reduction, name, dtype, from_logits=from_logits, temperature=temperature, axis=axis
        )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Entropy(_PenaltyLoss):
    """Entropy of the predicted distribution; `y_true` is ignored.

    `mode="penalty"`: +H (confidence, e.g. entropy minimisation on unlabeled
    data); `mode="bonus"`: −H (exploration bonus). Usually one term of a
    `CompositeLoss`.

    Example:

    >>> from keras_penalties.losses import Entropy
    >>> float(Entropy(from_logits=True, normalize=True)(None, [[0.0, 0.0]]))
    1.0
    """

    penalty = staticmethod(penalties.entropy)

    def __init__(
        self,
        from_logits=False,
        mode="penalty",
        normalize=False,
        temperature=1.0,
        axis=-1,
        reduction="sum_over_batch_size",
        name="entropy",
        dtype=None,
    ):
        self.mode = check_entropy_mode("mode", mode)
        super().__init__(
            reduction,
            name,
            dtype,
            from_logits=from_logits,
            normalize=normalize,
            temperature=temperature,
            axis=axis,
        )

    def __call__(self, y_true, y_pred, sample_weight=None):
        # y_true may be None (nothing to compare with); Loss.__call__ would
        # try to convert it.
        return super().__call__(y_pred if y_true is None else y_true, y_pred, sample_weight)

    def call(self, y_true, y_pred):
        return ENTROPY_MODES[self.mode] * penalties.entropy(y_pred, reduction="none", **self._options)

    def get_config(self):
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
        metric="mse",
        from_logits=False,
        axis=-1,
        reduction="sum_over_batch_size",
        name="consistency",
        dtype=None,
    ):
        super().__init__(reduction, name, dtype, metric=metric, from_logits=from_logits, axis=axis)


__all__ = ["KLDivergence", "JSDivergence", "Entropy", "Consistency"]
