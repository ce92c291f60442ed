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

`CompositeLoss` is a weighted sum of named losses, with the weights and the
weighted total of `CompositeObjective` (`_composite.Composite`).
"""

import inspect
import weakref
from typing import Any, TypeVar

import keras
from keras import ops

from keras_penalties import _capture, _keras_internals, _replicas, backend
from keras_penalties import ops as penalties
from keras_penalties._adapters import as_float32, loss_result, ops_reduction
from keras_penalties._composite import Composite
from keras_penalties._replicas import whole_batch_values
from keras_penalties._saving import with_hint, without_hint
from keras_penalties._loss_state import LossState
from keras_penalties._types import (
    ChunkSize,
    Direction,
    DType,
    EntropyMode,
    LossReduction,
    Metric,
    Penalty,
    Reduction,
    Tensor,
    TensorLike,
    Weighting,
)
from keras_penalties import _validation as check
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions
from keras_penalties.regularizers import ENTROPY_MODES, check_entropy_mode
from keras_penalties.terms import Term, deserialize_terms

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
        return ENTROPY_MODES[self.mode] * penalties.entropy(y_pred, reduction=reduction, **self._options)

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


def _computes(loss: keras.losses.Loss) -> Any:
    # Keras calls a compiled loss from its model's compute_loss only.
    return lambda model, _: any(item is loss for item in keras.tree.flatten(getattr(model, "loss", None)))


def _loading(model: keras.Model, function: str) -> bool:
    # A .keras file's compile config is deserialized inside
    # Model.compile_from_config, which builds the optimizer right after
    # compiling: the variables must be the model's by then.
    return function == "compile_from_config"


@keras.saving.register_keras_serializable(package="keras_penalties.losses")
class CompositeLoss(Composite, keras.losses.Loss):
    """A weighted sum of named losses: Σ wᵢ·lossᵢ(y_true, y_pred).

    Each term reduces itself (with its own `reduction`, the sample weights and
    the mask), so the total is what compiling each loss with `loss_weights`
    would give. Terms are computed in float32 (also from half-precision
    predictions) and the total is the loss's `dtype`. Under
    `tf.distribute.MirroredStrategy` the total and the reported values equal
    the one-device ones: a per-sample mean is divided by the replicas as
    Keras' own losses are, a sum over samples is not. With `PenaltyMonitor` in `fit`'s callbacks, each term's
    unweighted batch value appears in the logs as `"<loss name>/<term>"`.

    Weights live in variables: `set_weight`, `enable` and `disable` (from a
    callback, as for a `CompositeObjective`) take effect on the next step of
    a compiled `fit` without retracing, on every backend. Keras gives a loss
    no reference to its model, so the loss adds its variables (a `LossState`
    layer) to the model that compiles it when that model first computes it:
    `model.weights` then lists them, and `model.layers` of a subclassed model
    shows the layer.

    Args:
        terms: dict name → `keras.losses.Loss`, or a `Term` over a Loss or an
            ops function. An ops function is called as
            `fn(y_true, y_pred, **options)` when its signature takes two
            tensors (`kl_divergence`, `js_divergence`, `consistency`,
            `cross_entropy`, `gaussian_kl`), else `fn(y_pred, **options)`.
            One with a `reduction` option is reduced as a Loss term is: its
            per-sample values meet `sample_weight` and the Keras mask, then
            its `"mean"` (the default) or `"sum"` over samples. A batch
            statistic (`kl_sparsity`, `orthogonality`, …) must return a
            scalar and sees neither.
        weights: dict name → number ≥ 0 (default 1 each). Scheduled weights
            need the step count that a `CompositeObjective` layer carries:
            use one for them.
        weighting: None, `"uncertainty"`: Σ ½·exp(−sᵢ)·lossᵢ + ½·sᵢ with a
            trainable sᵢ per term, trained by the model's optimizer without
            its weight decay, or `"famo"`: Σ cᵢzᵢ·log Dᵢ (see
            `CompositeObjective`).
        weighting_learning_rate_multiplier: scales the gradients of the sᵢ
            (see `CompositeObjective`).
        famo_learning_rate, famo_gamma: with `weighting="famo"` (see
            `CompositeObjective`; FAMO's logits move at `fit`'s training
            steps only, not in `evaluate`).
        name, dtype: as for any `keras.losses.Loss`.

    Example:

    >>> import keras
    >>> from keras_penalties.losses import CompositeLoss, Entropy
    >>> loss = CompositeLoss(
    ...     {"ce": keras.losses.CategoricalCrossentropy(from_logits=True),
    ...      "ent": Entropy(from_logits=True, mode="bonus")},
    ...     weights={"ce": 1.0, "ent": 0.01})
    >>> round(float(loss([[1.0, 0.0]], [[0.0, 0.0]])), 4)  # ln 2 − 0.01·ln 2
    0.6862
    """

    def __init__(
        self,
        terms: dict[str, Term | Penalty],
        weights: dict[str, float] | None = None,
        name: str = "composite_loss",
        dtype: DType = None,
        weighting: Weighting = None,
        weighting_learning_rate_multiplier: float = 1.0,
        famo_learning_rate: float = 0.025,
        famo_gamma: float = 0.01,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self._set_terms(terms, weights, weighting, weighting_learning_rate_multiplier, (famo_learning_rate, famo_gamma))
        for term_name, term in self.terms.items():
            if term.scheduled:
                raise ValueError(
                    f"Term {term_name!r}: CompositeLoss weights are numbers; a schedule needs "
                    "per-step state, which a CompositeObjective layer carries."
                )
            if term.inputs is not None:
                raise ValueError(
                    f"Term {term_name!r}: a CompositeLoss term takes (y_true, y_pred); "
                    "`inputs` applies to CompositeObjective."
                )
        self._home = backend.variable_home()  # where `state` is made
        self._use_state(LossState(self.terms, self.weighting, f"{self.name}_state", len(self.reported_keys)))
        self._attached: list[weakref.ref[Any]] = []  # weak references to the models holding `state`
        model = _keras_internals.calling_model(_loading)
        if model is not None:
            self.attach(model)

    def _use_state(self, state: LossState) -> None:
        self.state = state
        self._weight_state, self._running = state.weight_state, state.running_sums

    def _state_made_at(self, home: Any) -> None:
        """The state made again at `home` (where the model holding it keeps
        its variables) with the values it holds, if it was made elsewhere:
        a loss constructed outside a `tf.distribute` strategy's scope, or
        before a JAX distribution was set, and compiled inside it."""
        if home is self._home:
            return
        old = self.state

        def make() -> LossState:
            with backend.made_at(home):
                state = LossState(self.terms, self.weighting, old.name, len(self.reported_keys))
            state.set_weights(old.get_weights())
            return state

        # Attached in the model's symbolic build (a stateless scope, which
        # makes no variable; a graph on TF): made on the host thread.
        self._use_state(backend.outside_distribution(make))
        self._home = home

    @property
    def term_weights(self) -> keras.Variable:
        return self._weight_state.term_weights

    @property
    def term_enabled(self) -> keras.Variable:
        return self._weight_state.term_enabled

    @property
    def log_variances(self) -> keras.Variable | None:
        return self._weight_state.log_variances

    def attach(self, model: keras.Model) -> bool:
        """Adds the loss's variables to `model` (once); returns whether they
        were new to it. The loss does so itself when `model` first computes
        it (its symbolic build, at the start of `fit`/`evaluate`, before the
        optimizer is built) or compiles it from a `.keras` file, and the
        package's callbacks do in `set_model`."""
        self._attached = [ref for ref in self._attached if ref() is not None]
        if any(ref() is model for ref in self._attached):
            return False
        self._attached.append(weakref.ref(model))
        self._state_made_at(backend.variable_home(model))
        if any(v is self.term_weights for v in model.variables):
            return False
        _keras_internals.add_sublayer(model, self.state)
        return True

    def __call__(self, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None = None) -> Tensor:
        # Keras tells a loss nothing of training: in `fit`, FAMO's state
        # advances where the model's train_step computes the loss.
        training = self.weighting == "famo" and _keras_internals.in_train_step()
        return self._computed(y_true, y_pred, sample_weight, training)[0]

    def compute(
        self, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None = None, *, training: bool = False
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(total, values)`: the loss as calling it gives, and each enabled
        term's unweighted value, for a custom training loop.

        With `training=True` the call is a training step's: under
        `weighting="famo"` FAMO's state advances first, as at each training
        step of `fit` (call it so once per step, inside the gradient tape).
        """
        total, values = self._computed(y_true, y_pred, sample_weight, check.boolean("training", training))
        return total, {name: values[i] for i, (name, t) in enumerate(self.terms.items()) if t.enabled}

    def _computed(
        self, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None, training: bool
    ) -> tuple[Tensor, Tensor]:
        if not self._attached:
            model = _keras_internals.calling_model(_computes(self))
            if model is not None:
                self.attach(model)
        self._no_weight_decay_on_log_variances(self._model())
        tensors = [t for t in (y_true, y_pred) if ops.is_tensor(t)]
        with num.sharing(tensors), reductions.global_token_means(self._model_across_replicas()):
            values = backend.stack(
                [term.loss_value(name, y_true, y_pred, sample_weight) for name, term in self.terms.items()]
            )
        values = whole_batch_values(values, self._sums_over_samples)
        _capture.record(self, values)
        reported = values
        if self.metric_keys:
            y_true, y_pred = as_float32(y_true), as_float32(y_pred)
            metrics = [v for term in self.terms.values() for v in term.loss_metric_values(y_true, y_pred)]
            reported = ops.concatenate([values, ops.stack(metrics)])
        # Keras tells a loss nothing of training: its values count as a
        # training call's (fit resets them before evaluate reads them).
        if not _capture.active(self):  # a probe's pass, in a stateless scope, would keep nothing
            self._running.add(reported, training=True)
        # In a jax.jit of the user's own (no stateless scope) FAMO's state
        # cannot take the trace's values: it stays.
        update = self.weighting == "famo" and training and not backend.traced_outside_scope(values)
        total = self._total(values, update=update)
        return ops.cast(_replicas.share(total), self.dtype), values

    def _model(self) -> keras.Model | None:
        """The model holding the loss's variables (the latest attached that
        is alive), or None."""
        return next((m for m in (r() for r in reversed(self._attached)) if m is not None), None)

    def _model_across_replicas(self) -> keras.Model | None:
        """Under several tf.distribute replicas, the model computing this loss
        (whose add_loss lists a cross-replica sum must keep: Keras reads them
        after the loss); else None."""
        return None if _replicas.in_sync() == 1 else self._model()

    def call(self, y_true: TensorLike, y_pred: TensorLike) -> Tensor:
        return self(y_true, y_pred)

    def get_config(self) -> dict[str, Any]:
        return with_hint({"name": self.name, "dtype": self.dtype, **self._composite_config()})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompositeLoss":
        config = without_hint(config)
        return cls(**{**config, "terms": deserialize_terms(config["terms"])})


__all__ = ["KLDivergence", "JSDivergence", "Entropy", "Consistency", "CompositeLoss"]
