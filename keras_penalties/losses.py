"""Losses for `model.compile(loss=...)`.

Each is a `keras.losses.Loss` over a function of `keras_penalties.ops`: `call`
returns the per-sample values, and Keras' `Loss.__call__` applies
`sample_weight`, masks and `reduction` ("sum_over_batch_size" by default) as
for any Keras loss. `y_true` is the reference or target, `y_pred` the model's
output. All round-trip through `get_config`/`from_config` and are registered
under the package `"keras_penalties.losses"`.
"""

import inspect
import weakref

import keras
import numpy as np
from keras import ops

from keras_penalties import _capture, _keras_internals, backend
from keras_penalties._saving import with_hint, without_hint
from keras_penalties import ops as penalties
from keras_penalties.objective import (
    WeightControl,
    as_float32,
    build_terms,
    check_weighting,
    deserialize_terms,
    scalar,
    serialize_terms,
    uncertainty_weights,
    whole_batch_values,
)
from keras_penalties.regularizers import ENTROPY_MODES, check_entropy_mode

_PACKAGE = "keras_penalties.losses"
# A Keras Loss with one of these reductions divides by the batch size (and,
# under a tf.distribute strategy, by the number of replicas).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _reduced(loss, value):
    """`value`, what Keras' `Loss.__call__` returned, as a scalar: Keras hands
    an empty batch's per-sample values back unreduced."""
    if loss.reduction not in (None, "none") and tuple(value.shape) == (0,):
        return ops.sum(value)
    return value


class _PenaltyLoss(keras.losses.Loss):
    """Per-sample `self.penalty(y_true, y_pred, reduction="none", **options)`."""

    penalty = None

    def __init__(self, reduction, name, dtype, **options):
        self._options = type(self).penalty.check_options(**options)
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        for key, value in self._options.items():
            setattr(self, key, value)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return _reduced(self, super().__call__(y_true, y_pred, sample_weight))

    def call(self, y_true, y_pred):
        return type(self).penalty(y_true, y_pred, reduction="none", **self._options)

    def get_config(self):
        return with_hint({**super().get_config(), "dtype": self.dtype, **self._options})

    @classmethod
    def from_config(cls, config):
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
        chunk_size: None, or rows per rematerialised chunk for LLM-sized
            logits (`ops.kl_divergence`).

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

    def __init__(self, from_logits=False, direction="forward", temperature=1.0, axis=-1,
                 reduction="sum_over_batch_size", name="kl_divergence", dtype=None, chunk_size=None):
        super().__init__(reduction, name, dtype, from_logits=from_logits, direction=direction,
                         temperature=temperature, axis=axis, chunk_size=chunk_size)


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

    def __init__(self, from_logits=False, temperature=1.0, beta=0.5, axis=-1, reduction="sum_over_batch_size",
                 name="js_divergence", dtype=None, chunk_size=None):
        super().__init__(reduction, name, dtype, from_logits=from_logits, temperature=temperature, beta=beta,
                         axis=axis, chunk_size=chunk_size)


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
    # A term of a CompositeObjective may give it the prediction alone.
    needs_y_true = False

    def __init__(self, from_logits=False, mode="penalty", normalize=False, temperature=1.0, axis=-1,
                 reduction="sum_over_batch_size", name="entropy", dtype=None, chunk_size=None):
        self.mode = check_entropy_mode("mode", mode)
        super().__init__(reduction, name, dtype, from_logits=from_logits, normalize=normalize,
                         temperature=temperature, axis=axis, chunk_size=chunk_size)

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


class TermMeans(keras.metrics.Metric):
    """Running means of a CompositeLoss's unweighted term values.

    Its result is a dict `{"<loss name>/<term>": mean}`, which Keras spreads
    into the logs once the metric is one of the model's metrics (PenaltyMonitor
    registers it).
    """

    def __init__(self, loss_name, term_names, **kwargs):
        super().__init__(name=f"{loss_name}_terms", **kwargs)
        self.keys = [f"{loss_name}/{term}" for term in term_names]
        self.sums = self.add_variable(shape=(len(term_names),), initializer="zeros", name="sums")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, values):
        self.sums.assign(self.sums + ops.cast(values, self.sums.dtype))
        self.count.assign(self.count + 1.0)

    def result(self):
        means = self.sums / ops.maximum(self.count, 1.0)
        return {key: means[i] for i, key in enumerate(self.keys)}


class LossState(keras.layers.Layer):
    """The variables of a `CompositeLoss`: its term weights and enabled flags
    (float32, never autocast) and, with `weighting="uncertainty"`, the
    trainable log-variances. Keras gives a loss no model, so the loss adds this
    layer to the model that compiles it (see `CompositeLoss.attach`); its
    variables then travel in the model's training state like a layer's, and
    `.keras` files save them with the loss."""

    def __init__(self, terms, weighting, name):
        super().__init__(name=name, trainable=True, autocast=False)
        n = len(terms)

        def state(name, values, trainable=False):
            values = np.asarray(values, "float32")
            return keras.Variable(
                initializer=values, shape=values.shape, dtype="float32", trainable=trainable, autocast=False,
                aggregation="mean" if trainable else "only_first_replica", name=name,
            )

        self.term_weights = state("term_weights", [t.weight for t in terms.values()])
        self.term_enabled = state("term_enabled", [float(t.enabled) for t in terms.values()])
        self.log_variances = state("log_variances", np.zeros(n), trainable=True) if weighting else None
        self.built = True

    def call(self, inputs):
        return inputs


def _computes(loss):
    # Keras calls a compiled loss from its model's compute_loss only.
    return lambda model, _: any(item is loss for item in keras.tree.flatten(getattr(model, "loss", None)))


def _loading(model, function):
    # A .keras file's compile config is deserialized inside
    # Model.compile_from_config, which builds the optimizer right after
    # compiling: the variables must be the model's by then.
    return function == "compile_from_config"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CompositeLoss(WeightControl, keras.losses.Loss):
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
        weighting: None, or `"uncertainty"`: Σ ½·exp(−sᵢ)·lossᵢ + ½·sᵢ with a
            trainable sᵢ per term, trained by the model's optimizer (see
            `CompositeObjective`).
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

    def __init__(self, terms, weights=None, name="composite_loss", dtype=None, weighting=None):
        weighting = check_weighting(weighting)
        super().__init__(name=name, dtype=dtype)
        self.terms = build_terms(terms, weights)
        self.weighting = weighting
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
        self._sums_over_samples = [t.sums_over_samples for t in self.terms.values()]
        self._op_losses = {term_name: _as_loss(term) for term_name, term in self.terms.items()}
        self.state = LossState(self.terms, weighting, name=f"{self.name}_state")
        self.metric_keys = [f"{name}/{metric}" for name, t in self.terms.items() for metric in t.metrics]
        self.tracker = TermMeans(self.name, list(self.terms) + self.metric_keys)
        # Set by PenaltyMonitor once the tracker is one of the model's metrics.
        self.tracker_registered = False
        self._attached = []  # weak references to the models holding `state`
        model = _keras_internals.calling_model(_loading)
        if model is not None:
            self.attach(model)

    @property
    def term_weights(self):
        return self.state.term_weights

    @property
    def term_enabled(self):
        return self.state.term_enabled

    @property
    def log_variances(self):
        return self.state.log_variances

    def _weight_was_set(self, index):
        pass

    def attach(self, model):
        """Adds the loss's variables to `model` (once); returns whether they
        were new to it. The loss does so itself when `model` first computes
        it (its symbolic build, at the start of `fit`/`evaluate`, before the
        optimizer is built) or compiles it from a `.keras` file, and the
        package's callbacks do in `set_model`."""
        self._attached = [ref for ref in self._attached if ref() is not None]
        if any(ref() is model for ref in self._attached):
            return False
        self._attached.append(weakref.ref(model))
        if any(v is self.term_weights for v in model.variables):
            return False
        _keras_internals.add_sublayer(model, self.state)
        return True

    def current_weights(self):
        """The weight vector of the next step (½·exp(−sᵢ) under uncertainty)."""
        if self.log_variances is not None:
            return uncertainty_weights(self.log_variances.value)
        return self.term_weights.value

    def _metric_values(self, y_true, y_pred):
        """Each term's custom metrics on (y_true, y_pred), or on y_pred alone
        where the term takes one tensor, in `metric_keys` order."""
        values = []
        for term in self.terms.values():
            if term.metrics:
                values.extend(term.metric_values(*((y_true, y_pred) if _takes_both(term) else (y_pred,))))
        return values

    def _term_value(self, name, term, y_true, y_pred, sample_weight):
        """The term's unweighted float32 value on this replica's batch, as one
        device would compute it on that batch. `y_true` and `y_pred` are as
        Keras passed them: a Loss reads the mask `y_pred` carries before it
        casts (a float32 copy of a half `y_pred` would have none)."""
        loss = term.penalty if term.kind == "loss" else self._op_losses[name]
        if loss is not None:
            value = scalar(name, loss(y_true, y_pred, sample_weight=sample_weight))
            if getattr(loss, "reduction", None) in _MEAN_REDUCTIONS:
                # Keras' Loss divided its mean by the replicas in scope; undo it.
                value = value * float(backend.loss_replicas())
            return value
        y_true, y_pred = as_float32(y_true), as_float32(y_pred)
        if _takes_both(term):
            return scalar(name, term(y_true, y_pred))
        return scalar(name, term(y_pred))

    def __call__(self, y_true, y_pred, sample_weight=None):
        if not self._attached:
            model = _keras_internals.calling_model(_computes(self))
            if model is not None:
                self.attach(model)
        values = ops.stack(
            [
                self._term_value(name, term, y_true, y_pred, sample_weight)
                for name, term in self.terms.items()
            ]
        )
        y_true, y_pred = as_float32(y_true), as_float32(y_pred)
        values = whole_batch_values(values, self._sums_over_samples)
        _capture.record(self, values)
        if self.tracker_registered:
            # The tracker's sums add up over replicas and steps; its count
            # too, so it reports the mean of the replicas' values.
            tracked = values
            if self.metric_keys:
                tracked = ops.concatenate([values, ops.stack(self._metric_values(y_true, y_pred))])
            self.tracker.update_state(tracked)
        total = self._total(values)
        divisor = backend.loss_replicas()
        if divisor > 1:
            # As Keras' own losses do: the replicas' gradients are summed.
            total = total / float(divisor)
        return ops.cast(total, self.dtype)

    def call(self, y_true, y_pred):
        return self(y_true, y_pred)

    def get_config(self):
        return with_hint({
            "name": self.name,
            "dtype": self.dtype,
            "terms": serialize_terms(self.terms),
            "weighting": self.weighting,
        })

    @classmethod
    def from_config(cls, config):
        config = without_hint(config)
        return cls(**{**config, "terms": deserialize_terms(config["terms"])})


def _takes_both(term):
    """Whether a CompositeLoss term is fed (y_true, y_pred): a Loss, or an ops
    function of two tensors (kl_divergence(p, q), cross_entropy(labels,
    logits), gaussian_kl(mean, log_var), …); the others get y_pred alone."""
    if term.kind == "loss":
        return True
    if term.kind != "op":
        return False
    required = [
        p
        for p in inspect.signature(term.penalty).parameters.values()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is inspect.Parameter.empty
    ]
    return len(required) == 2


# Ops whose reduction="none" is elementwise, not per sample.
_ELEMENTWISE_OPS = ("l1", "l2", "elastic_net")


class _OpLoss(keras.losses.Loss):
    """An ops-function term of a `CompositeLoss` as a Keras Loss, so that it
    meets sample weights and masks exactly as a Loss term does: `call` gives
    the per-sample values (per position for the divergences), and Keras'
    own `Loss.__call__` applies `sample_weight`, the Keras mask `y_pred`
    carries and the reduction — `"sum"` for a term with
    `options={"reduction": "sum"}`, else `"sum_over_batch_size"` (Keras'
    default, which the ops' `"mean"` equals when nothing is weighted)."""

    def __init__(self, term):
        reduction = "sum" if term.options.get("reduction") == "sum" else "sum_over_batch_size"
        super().__init__(name=term.penalty.__name__, reduction=reduction, dtype="float32")
        self.term = term
        self.takes_both = _takes_both(term)

    def __call__(self, y_true, y_pred, sample_weight=None):
        if not self.takes_both:
            y_true = y_pred  # not read; Loss.__call__ converts it
        return _reduced(self, super().__call__(y_true, y_pred, sample_weight))

    def call(self, y_true, y_pred):
        options = {**self.term.options, "reduction": "none"}
        tensors = (y_true, y_pred) if self.takes_both else (y_pred,)
        values = self.term.penalty(*tensors, **options)
        if self.term.penalty.__name__ in _ELEMENTWISE_OPS and len(values.shape) > 1:
            # One value per sample: its sum ("sum", "sum_over_batch_size") or
            # its mean ("mean") over every axis but the batch.
            axes = tuple(range(1, len(values.shape)))
            mean = self.term.options.get("reduction") == "mean"
            values = ops.mean(values, axis=axes) if mean else ops.sum(values, axis=axes)
        return values


def _as_loss(term):
    """An ops-function term with per-sample values as an `_OpLoss`; None for
    the others (a Loss is one already; a batch statistic such as
    `kl_sparsity` or `orthogonality` has no sample to weigh)."""
    if term.kind != "op" or "reduction" not in inspect.signature(term.penalty).parameters:
        return None
    if term.options.get("reduction") == "none":
        return None  # not a scalar: an error where the term is computed
    return _OpLoss(term)

__all__ = ["KLDivergence", "JSDivergence", "Entropy", "Consistency", "CompositeLoss"]
