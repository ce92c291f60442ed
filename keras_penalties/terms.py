"""Terms: what a composite is made of, how each is evaluated, and its weights.

- `Term`: one named penalty with its weight (a number or a schedule of the
  training step), the inputs it reads, its options and its custom metrics.
- One small adapter per kind of penalty — an ops function, a Regularizer, a
  Loss, any other callable — says how that kind is called on the tensors a
  `CompositeObjective` feeds it, and on `(y_true, y_pred, sample_weight)` in
  a `CompositeLoss`; whether its value is a sum over samples; how it is saved.
  A `Term` holds one; nothing branches on the kind.
- `Composite`: what `CompositeObjective` and `CompositeLoss` share — their
  terms, the weight state (weights, enabled flags, schedules, uncertainty
  weighting) with `set_weight`/`enable`/`disable`, and the weighted total.
- Helpers both use: `build_terms`, `scalar`, `as_float32`,
  `whole_batch_values`, `state_variable`.

Imports `ops`, `backend`, `_saving` and Keras; the composites
(`objective.py`) import it.
"""

import functools
import inspect
import re
from typing import Any, Callable

import keras
import numpy as np
from keras import ops

from keras_penalties import _keras_internals, backend
from keras_penalties import ops as penalties
from keras_penalties._types import InputKeys, Penalty, PenaltyName, Tensor, TensorLike, Weight
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions

METRIC_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")
_OPS = {name: getattr(penalties, name) for name in penalties.PENALTIES}
# Penalties on magnitudes: `reduction="none"` gives one value per element (not
# per sample), and without a `reduction` option a composite uses Keras'
# activity-regularizer scale (the mean over the batch), so their strength does
# not depend on the batch size.
_MAGNITUDE_OPS = ("l1", "l2", "elastic_net")
# A Keras Loss with one of these reductions divides by the batch size (and,
# under a tf.distribute strategy, by the number of replicas).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


# ---------------------------------------------------------------- helpers


def is_schedule(weight):
    """Whether a weight is a schedule of the step rather than a number."""
    return isinstance(weight, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(weight) and not isinstance(weight, (int, float, np.number))
    )


def check_weight(name, weight):
    """A term weight: a number ≥ 0 and finite, or a schedule of the step that
    is ≥ 0 at step 0."""
    if isinstance(weight, type):
        raise TypeError(f"`{name}` must be a number or a schedule instance; got the class {weight.__name__}.")
    if not is_schedule(weight):
        return num.non_negative(name, weight)
    try:
        first = float(ops.convert_to_numpy(weight(0)))
    except Exception as error:  # noqa: BLE001 -- reported with the argument's name
        raise TypeError(f"`{name}` is a schedule that cannot be evaluated at step 0: {error}") from error
    if not first >= 0:
        raise ValueError(f"`{name}` is a schedule whose value at step 0 is {first}; weights must be >= 0.")
    return weight


WEIGHTINGS = ("uncertainty", "famo")
_check_weighting = num.optional(num.choice(*WEIGHTINGS))


def check_weighting(weighting):
    """`weighting`: None (the terms' own weights), "uncertainty" or "famo"."""
    if weighting is not None and not isinstance(weighting, str):
        raise TypeError(f"`weighting` must be None, 'uncertainty' or 'famo'; got {weighting!r}.")
    return _check_weighting("weighting", weighting)


def check_famo(learning_rate, gamma, weighting):
    """`famo_learning_rate` (> 0) and `famo_gamma` (≥ 0); other than their
    defaults only with `weighting="famo"`."""
    learning_rate = float(num.positive("famo_learning_rate", learning_rate))
    gamma = float(num.non_negative("famo_gamma", gamma))
    if (learning_rate, gamma) != FAMO_DEFAULTS and weighting != "famo":
        raise ValueError(
            f"`famo_learning_rate` and `famo_gamma` apply with weighting='famo', not weighting={weighting!r}."
        )
    return learning_rate, gamma


# FAMO (Liu et al., 2023), as its official implementation (Cranial-XIX/FAMO):
# the logits' Adam (torch's: β 0.9, 0.999, ε 1e-8, weight decay added to the
# gradient), its learning rate and weight decay, and the ε added to each loss.
FAMO_DEFAULTS = (0.025, 0.01)
_FAMO_EPSILON = 1e-8


def famo_coefficients(logits, log_losses):
    """FAMO's cᵢzᵢ, z = softmax(ξ), c = (Σⱼ zⱼ/Dⱼ)⁻¹: the model trains on
    Σ cᵢzᵢ·log Dᵢ (c, z held constant), whose gradient is Σ cᵢzᵢ/Dᵢ·∇Lᵢ;
    cᵢzᵢ/Dᵢ are the effective weights, and they sum to 1."""
    z = ops.softmax(logits)
    return z / ops.sum(z * ops.exp(-log_losses))


def famo_step(logits, moments, step, previous, log_losses, learning_rate, gamma):
    """One FAMO update of the logits ξ: the change of the log-losses since
    the previous step, δ = log Dₜ₋₁ − log Dₜ, through softmax's Jacobian,
    d = z ⊙ (δ − z·δ), as the logits' gradient, plus γ·ξ; then Adam step
    `step` (≥ 1). Returns the new logits and moments (m, v stacked)."""
    z = ops.softmax(logits)
    delta = previous - log_losses
    gradient = z * (delta - ops.sum(z * delta)) + gamma * logits
    m = 0.9 * moments[0] + 0.1 * gradient
    v = 0.999 * moments[1] + 0.001 * gradient * gradient
    m_hat = m / (1.0 - ops.power(0.9, step))
    v_hat = v / (1.0 - ops.power(0.999, step))
    return logits - learning_rate * m_hat / (ops.sqrt(v_hat) + 1e-8), ops.stack([m, v])


def uncertainty_weights(log_variances):
    """Kendall et al. (2018), as LibMTL: term i weighs ½·exp(−sᵢ)."""
    return 0.5 * ops.exp(-log_variances)


def check_multiplier(multiplier, weighting):
    """`weighting_learning_rate_multiplier`: a number > 0, other than 1 only
    with `weighting="uncertainty"`."""
    multiplier = num.positive("weighting_learning_rate_multiplier", multiplier)
    if multiplier != 1.0 and weighting != "uncertainty":
        raise ValueError(
            "`weighting_learning_rate_multiplier` scales the gradients of learned weights; it "
            f"applies with weighting='uncertainty', not weighting={weighting!r}."
        )
    return float(multiplier)


def _scaled_gradient(x, multiplier):
    """`x` in value; `multiplier` × its gradient on the way back."""
    if multiplier == 1.0:
        return x
    return multiplier * x + ops.stop_gradient((1.0 - multiplier) * x)


def _has_optimizer(model, _):
    return getattr(model, "optimizer", None) is not None


def as_float32(tensors):
    """Half-precision tensors of a structure as float32 copies; the others as they are."""
    if not isinstance(tensors, (list, tuple, dict)):
        # A lone tensor, what most objectives get: no structure to walk
        # (keras.tree's walk is most of this function's time on eager torch).
        return _as_float32(tensors)
    return keras.tree.map_structure(_as_float32, tensors)


def _as_float32(t):
    return ops.cast(t, "float32") if hasattr(t, "dtype") and num.is_half(t.dtype) else t


def scalar(name, value):
    """A term's value as a float32 scalar; anything else is an error naming it."""
    if not ops.is_tensor(value):
        value = ops.convert_to_tensor(value)
    if len(value.shape) == 1 and value.shape[0] == 0:
        # A Keras Loss hands an empty batch's per-sample values back unreduced.
        value = ops.sum(value)
    if len(value.shape) != 0:
        raise ValueError(
            f"Term {name!r} must return a scalar; it returned shape {tuple(value.shape)}. "
            "Use a reduction such as reduction='mean'."
        )
    return value if keras.backend.standardize_dtype(value.dtype) == "float32" else ops.cast(value, "float32")


def loss_result(loss, value):
    """`value`, what Keras' `Loss.__call__` returned, as a scalar: Keras hands
    an empty batch's per-sample values back unreduced."""
    if loss.reduction not in (None, "none") and tuple(value.shape) == (0,):
        return ops.sum(value)
    return value


# Keras' Loss reductions that an ops function's own reduction equals when
# nothing is weighted: "sum_over_batch_size" divides the sum of the
# per-sample values by their number, as the ops' "mean" does.
_OPS_REDUCTION = {"sum_over_batch_size": "mean", "sum": "sum"}


def ops_reduction(loss, y_true, y_pred, sample_weight):
    """The ops `reduction` that gives what Keras' `Loss.__call__` would for
    this call of `loss` when all it would do is reduce the per-sample
    values: no `sample_weight`, no Keras mask on `y_pred`, the tensors
    already of the loss's dtype, float32 or float64 (`y_true` None where the
    loss does not read it), and no tf.distribute replicas to divide a mean
    by; else None, and Keras' own `__call__` is the way. Around an Entropy
    term of the bench's fit step, Keras' per-call work (conversions, mask
    lookups, a sum and a division as separate ops) took about as long as the
    entropy itself on eager torch (126 µs against 161 µs)."""
    reduction = _OPS_REDUCTION.get(loss.reduction)
    if reduction is None or sample_weight is not None or loss.dtype not in ("float32", "float64"):
        # (A half-precision loss would round each sample's value before
        # Keras sums them; the ops sum in float32.)
        return None
    if backend.loss_replicas() != 1:
        return None
    for t in (y_pred, y_true):
        if t is not None and not (ops.is_tensor(t) and keras.backend.standardize_dtype(t.dtype) == loss.dtype):
            return None
    return reduction if _keras_internals.keras_mask(y_pred) is None else None


def whole_batch_values(values, sums):
    """Each replica's term values scaled so that their mean over replicas is
    the whole batch's value: a sum over samples (where `sums`) times the
    number of replicas in sync, a per-sample mean as is. Keras divides each
    replica's loss by that number before it adds up their gradients."""
    replicas = backend.replicas_in_sync()
    if replicas == 1 or not any(sums):
        return values
    return values * ops.convert_to_tensor(np.where(sums, float(replicas), 1.0).astype("float32"))


def state_variable(name, values, dtype="float32", trainable=False, aggregation="only_first_replica", local=False):
    """A composite's state as a variable, float32 (or `dtype`) and never
    autocast: under a mixed policy a weight of 1e5 would read inf and a step
    count would stall at 2049. Under a tf.distribute strategy, weights are the
    same on every replica (set from callbacks); `local` state (the step, the
    running values) is each replica's own ("on_read": no cross-replica sync
    inside the forward pass) and reads by `aggregation`."""
    values = np.asarray(values, dtype=dtype)
    return keras.Variable(
        initializer=values, shape=values.shape, dtype=dtype, trainable=trainable, autocast=False,
        aggregation=aggregation, synchronization="on_read" if local else "auto", name=name,
    )


# ---------------------------------------------------------------- adapters


def _op_named(argument, name):
    """The ops function `name` names; a ValueError naming `argument` otherwise."""
    if name not in _OPS:
        raise ValueError(
            f"`{argument}` must name a keras_penalties.ops function, one of {sorted(_OPS)}; got {name!r}."
        )
    return _OPS[name]


def _is_op(fn):
    return any(fn is op for op in _OPS.values())


class _Penalty:
    """How one kind of penalty is called. The defaults are a plain callable's:
    `fn(*tensors, **options)`; in a CompositeLoss, `fn(y_pred, **options)` on
    float32 copies, which must be a scalar."""

    mask_input = None  # the name or position of the input holding a mask
    sums_over_samples = False  # whether the value grows with the batch
    takes_labels = False  # whether a CompositeLoss feeds (y_true, y_pred)

    def __init__(self, fn, options):
        self.fn = fn
        self.options = options

    def __call__(self, *tensors):
        """The unweighted value on `tensors`."""
        return self.fn(*tensors, **self.options)

    def loss_tensors(self, y_true, y_pred):
        """What the penalty reads of a CompositeLoss's (y_true, y_pred)."""
        return (y_true, y_pred) if self.takes_labels else (y_pred,)

    def loss_value(self, name, y_true, y_pred, sample_weight):
        """The unweighted float32 value in a CompositeLoss on this replica's
        batch, as one device would compute it on that batch."""
        return scalar(name, self(*self.loss_tensors(as_float32(y_true), as_float32(y_pred))))

    def config(self):
        return keras.saving.serialize_keras_object(self.fn)

    @property
    def label(self):
        return type(self.fn).__name__


def _weighed_like_a_loss(name, loss, y_true, y_pred, sample_weight):
    """A Keras Loss's value with `sample_weight` and the Keras mask `y_pred`
    carries (read before any cast: a float32 copy of a half `y_pred` has
    none), as one device would compute it on this replica's batch."""
    value = scalar(name, loss(y_true, y_pred, sample_weight=sample_weight))
    if getattr(loss, "reduction", None) in _MEAN_REDUCTIONS:
        # Keras' Loss divided its mean by the replicas in scope; undo it.
        value = value * float(backend.loss_replicas())
    return value


class _OpPenalty(_Penalty):
    """A `keras_penalties.ops` function: options checked now; its `mask`
    option names the input holding the mask; in a CompositeLoss, fed
    (y_true, y_pred) when its signature takes two tensors, and reduced as a
    Loss term is when it has per-sample values."""

    def __init__(self, fn, options):
        if fn.__name__ in _MAGNITUDE_OPS:
            options.setdefault("reduction", "sum_over_batch_size")
        options = fn.check_options(**options)
        mask = options.get("mask")
        if mask is not None and (isinstance(mask, bool) or not isinstance(mask, (str, int))):
            raise TypeError(
                "A Term's `options['mask']` names the input that holds the mask (a dict key "
                f"or a list position, like `inputs`); got {type(mask).__name__}. Feed the "
                "mask to the objective beside the tensors and name it here."
            )
        super().__init__(fn, options)
        self.mask_input = mask
        self.sums_over_samples = options.get("reduction") == "sum"
        required = [
            p for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is inspect.Parameter.empty
        ]
        self.takes_labels = len(required) == 2
        # Per-sample values to weigh: a Loss of them. A batch statistic
        # (`kl_sparsity`, `orthogonality`, …) has no sample to weigh, and
        # reduction="none" is no scalar (an error where it is computed).
        has_samples = "reduction" in inspect.signature(fn).parameters and options.get("reduction") != "none"
        self._loss = _OpLoss(self) if has_samples else None

    def __call__(self, *tensors):
        if self.mask_input is not None:
            *tensors, mask = tensors
            return self.fn(*tensors, **{**self.options, "mask": mask})
        return self.fn(*tensors, **self.options)

    def loss_value(self, name, y_true, y_pred, sample_weight):
        if self._loss is None:
            return super().loss_value(name, y_true, y_pred, sample_weight)
        return _weighed_like_a_loss(name, self._loss, y_true, y_pred, sample_weight)

    def per_sample(self, *tensors):
        """One value per sample (per position for the divergences)."""
        values = self.fn(*tensors, **{**self.options, "reduction": "none"})
        if self.fn.__name__ in _MAGNITUDE_OPS and len(values.shape) > 1:
            # One value per sample: its sum ("sum", "sum_over_batch_size") or
            # its mean ("mean") over every axis but the batch.
            axes = tuple(range(1, len(values.shape)))
            mean = self.options.get("reduction") == "mean"
            values = ops.mean(values, axis=axes) if mean else ops.sum(values, axis=axes)
        return values

    def config(self):
        return self.fn.__name__

    @property
    def label(self):
        return self.fn.__name__


class _OpLoss(keras.losses.Loss):
    """An ops-function term of a `CompositeLoss` as a Keras Loss, so that it
    meets sample weights and masks exactly as a Loss term does: `call` gives
    the per-sample values, and Keras' own `Loss.__call__` applies
    `sample_weight`, the Keras mask `y_pred` carries and the reduction —
    `"sum"` for a term with `options={"reduction": "sum"}`, else
    `"sum_over_batch_size"` (Keras' default, which the ops' `"mean"` equals
    when nothing is weighted)."""

    def __init__(self, penalty):
        reduction = "sum" if penalty.options.get("reduction") == "sum" else "sum_over_batch_size"
        super().__init__(name=penalty.fn.__name__, reduction=reduction, dtype="float32")
        self.penalty = penalty

    def __call__(self, y_true, y_pred, sample_weight=None):
        if not self.penalty.takes_labels:
            y_true = y_pred  # not read; Loss.__call__ converts it
        return loss_result(self, super().__call__(y_true, y_pred, sample_weight))

    def call(self, y_true, y_pred):
        return self.penalty.per_sample(*self.penalty.loss_tensors(y_true, y_pred))


class _RegularizerPenalty(_Penalty):
    """A `keras.regularizers.Regularizer` on one tensor, divided by the batch
    size as Keras divides an activity regularizer (0 for no samples); in a
    CompositeLoss, on y_pred."""

    def __call__(self, *tensors):
        if len(tensors) != 1:
            raise ValueError(f"a Regularizer takes one tensor; got {len(tensors)}.")
        (x,) = tensors
        value = self.fn(x)
        if len(x.shape) > 0:
            value = value / ops.cast(reductions.batch_size(x), value.dtype)
        return value


class _LossPenalty(_Penalty):
    """A `keras.losses.Loss` on (y_true, y_pred), or on y_pred alone when it
    says it needs no y_true; in a CompositeLoss, with the sample weights and
    the mask, exactly as if it were compiled alone."""

    takes_labels = True

    def __init__(self, fn, options):
        super().__init__(fn, options)
        self.sums_over_samples = getattr(fn, "reduction", None) == "sum"

    def __call__(self, *tensors):
        if len(tensors) == 2:
            return self.fn(*tensors)
        if len(tensors) == 1 and not getattr(self.fn, "needs_y_true", True):
            return self.fn(None, tensors[0])
        raise ValueError(
            f"a Loss takes two tensors (y_true, y_pred); got {len(tensors)}. "
            "Give the term `inputs=(reference, prediction)`."
        )

    def loss_value(self, name, y_true, y_pred, sample_weight):
        return _weighed_like_a_loss(name, self.fn, y_true, y_pred, sample_weight)


def _penalty(penalty, options):
    """The adapter for `penalty` (anything `Term` accepts) with `options`."""
    if isinstance(penalty, type):
        raise TypeError(
            f"`penalty` must be an instance, not the class {penalty.__name__}: "
            f"write e.g. {penalty.__name__}(...)."
        )
    if isinstance(penalty, str):
        penalty = _op_named("penalty", penalty)
    if _is_op(penalty):
        return _OpPenalty(penalty, options)
    if isinstance(penalty, (keras.regularizers.Regularizer, keras.losses.Loss)):
        if options:
            raise ValueError(
                f"`options` apply to ops functions and plain callables; "
                f"configure a {type(penalty).__name__} through its constructor."
            )
        kind = _RegularizerPenalty if isinstance(penalty, keras.regularizers.Regularizer) else _LossPenalty
        return kind(penalty, options)
    if callable(penalty):
        return _Penalty(penalty, options)
    raise TypeError(
        "`penalty` must be an ops function name, an ops function, a "
        f"Regularizer, a Loss or a callable; got {penalty!r}."
    )


# ---------------------------------------------------------------- metrics


def _metric_op(argument, name):
    """An ops function named as a metric (by `argument`), with the default
    reduction a term by that name gets."""
    fn = _op_named(argument, name)
    if name in _MAGNITUDE_OPS:
        return functools.partial(fn, reduction="sum_over_batch_size")
    return fn


def _check_metrics(metrics):
    """`metrics`: None or a dict name → ops function name or callable."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"`metrics` must be a dict of name -> function or ops function name; got {metrics!r}.")
    checked = {}
    for name, fn in metrics.items():
        if not isinstance(name, str) or not METRIC_NAME_PATTERN.match(name):
            raise ValueError(
                f"`metrics` names must be non-empty strings usable as metric names "
                f"(letters, digits, '_', '.', '-'); got {name!r}."
            )
        if isinstance(fn, str):
            fn = _metric_op(f"metrics[{name!r}]", fn)
        elif not callable(fn) or isinstance(fn, type):
            raise TypeError(f"`metrics[{name!r}]` must be a callable or an ops function name; got {fn!r}.")
        checked[name] = fn
    return checked


def _serialize_metric(fn):
    if isinstance(fn, functools.partial) and _is_op(fn.func):
        return fn.func.__name__
    if _is_op(fn):
        return fn.__name__
    return keras.saving.serialize_keras_object(fn)


def _loadable(name, obj):
    """What `Term.from_config` may rebuild: Keras objects, schedules, ops
    functions and objects registered with Keras; a `.keras` file naming any
    other importable function (`keras.config.set_floatx`) is refused."""
    if isinstance(obj, (keras.regularizers.Regularizer, keras.losses.Loss,
                        keras.optimizers.schedules.LearningRateSchedule)):
        return obj
    if _is_op(obj):
        return obj
    registered = keras.saving.get_registered_name(obj)
    if ">" in registered and keras.saving.get_registered_object(registered) is obj:
        return obj
    raise ValueError(
        f"Term `{name}` {obj!r} is neither a keras_penalties.ops function, a Loss, a "
        "Regularizer, a schedule, nor a function registered with "
        "keras.saving.register_keras_serializable; refusing to load it."
    )


# ---------------------------------------------------------------- Term


@keras.saving.register_keras_serializable(package="keras_penalties")
class Term:
    """One named entry of a `CompositeObjective` or `CompositeLoss`.

    Args:
        penalty: the name of a `keras_penalties.ops` function (`"l1"`,
            `"entropy"`, `"kl_divergence"`, …, called with `**options`), such
            a function itself, a `keras.regularizers.Regularizer`, a
            `keras.losses.Loss`, or any callable returning a scalar.
        weight: a number ≥ 0, or a `keras.optimizers.schedules.LearningRateSchedule`
            (or any serializable callable of the step): its value at training
            step t (0-based, as for learning rates) weights step t.
        inputs: names (for dict inputs) or positions (for list inputs) of the
            tensors the penalty takes, in order; a Loss gets them as
            (y_true, y_pred). `None`: the single tensor (or all list entries).
        enabled: whether the term counts in the total.
        options: keyword options for the penalty; checked now for ops
            functions. The `mask` option of `kl_divergence`,
            `js_divergence` and `entropy` names an input (a dict key or a
            list position, like `inputs`): the token mask fed beside the
            tensors, e.g. `options={"from_logits": True, "mask": "mask"}`.
        metrics: dict name → callable of the same tensors (or the name of an
            ops function, with the default reduction a term of that name
            gets), returning a scalar: extra numbers reported beside the term
            as `"<objective>/<term>/<metric>"` (with `PenaltyMonitor`) and
            under `"custom"` in `report`, never added to the loss.

    A Regularizer term contributes what it would as an `activity_regularizer=`
    (Keras divides it by the batch size).

    Saving: a term, weight or metric that is your own function is saved by
    name and loads only if it is registered with
    `@keras.saving.register_keras_serializable(package=...)`; otherwise
    `load_model` fails with "Could not locate function '<name>'". Ops
    function names, Losses, Regularizers and schedules need nothing.

    Example:

    >>> from keras_penalties import Term
    >>> Term("entropy", 0.1, options={"from_logits": True}).get_config()["penalty"]
    'entropy'
    """

    def __init__(
        self,
        penalty: Penalty,
        weight: Weight = 1.0,
        inputs: InputKeys = None,
        enabled: bool = True,
        options: dict[str, Any] | None = None,
        metrics: dict[str, PenaltyName | Callable[..., Any]] | None = None,
    ) -> None:
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"`options` must be a dict or None; got {options!r}.")
        self._penalty = _penalty(penalty, dict(options or {}))
        self.penalty = self._penalty.fn
        self.options = self._penalty.options
        self.weight = check_weight("weight", weight)
        if isinstance(inputs, (str, int)) and not isinstance(inputs, bool):
            inputs = (inputs,)
        if inputs is not None:
            if not isinstance(inputs, (list, tuple)):
                raise TypeError(
                    f"`inputs` must be None, a name, a position, or a sequence of them; got {inputs!r}."
                )
            inputs = tuple(inputs)
            if not inputs or not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in inputs):
                raise ValueError(
                    f"`inputs` must be None or a non-empty sequence of names or positions; got {inputs!r}."
                )
        self.inputs = inputs
        if self.mask_input is not None and inputs is None:
            raise ValueError(
                f"`options['mask']`={self.mask_input!r} names an input, so the term needs "
                "`inputs=(...)` naming the tensors it takes from the same dict or list."
            )
        self.enabled = num.boolean("enabled", enabled)
        self.metrics = _check_metrics(metrics)

    @property
    def mask_input(self) -> str | int | None:
        """The name or position of the input holding the term's mask, or None."""
        return self._penalty.mask_input

    @property
    def reads(self):
        """Every input the term reads: its `inputs`, then its mask's."""
        return self.inputs if self.mask_input is None else self.inputs + (self.mask_input,)

    @property
    def scheduled(self) -> bool:
        return is_schedule(self.weight)

    @property
    def sums_over_samples(self) -> bool:
        """Whether the value is a sum over samples (it then grows with the
        batch, and a distributed step adds the replicas' values) rather than
        a per-sample mean or a statistic of the batch."""
        return self._penalty.sums_over_samples

    def copy(self) -> "Term":
        return Term(self.penalty, self.weight, self.inputs, self.enabled, self.options, self.metrics)

    # -------------------------------------------- in a CompositeObjective

    def arguments(self, name: str, inputs: Any) -> tuple[Any, ...]:
        """The tensors of `inputs` (a tensor, list or dict, as fed to the
        objective) that the term `name` reads, in order."""
        if self.inputs is None:
            if isinstance(inputs, dict):
                raise ValueError(
                    f"Term {name!r} has no `inputs`, but the objective was fed a dict with keys "
                    f"{sorted(inputs)}; give the term inputs=(...) naming the entries it takes."
                )
            return tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        if isinstance(inputs, dict):
            missing = [k for k in self.reads if k not in inputs]
            if missing:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(self.reads)}, but {missing} "
                    f"{'is' if len(missing) == 1 else 'are'} not among the fed inputs {sorted(inputs)}."
                )
            return tuple(inputs[k] for k in self.reads)
        if isinstance(inputs, (list, tuple)):
            bad = [k for k in self.reads if not isinstance(k, int) or not -len(inputs) <= k < len(inputs)]
            if bad:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(self.reads)}, but the objective was fed a "
                    f"list of {len(inputs)} tensors; list inputs are chosen by position."
                )
            return tuple(inputs[k] for k in self.reads)
        raise ValueError(
            f"Term {name!r} takes inputs {list(self.inputs)}, but the objective was fed a single "
            "tensor; feed a dict (or list) holding them."
        )

    def value(self, name: str, inputs: Any) -> Tensor:
        """The term's unweighted float32 scalar on what an objective was fed."""
        return scalar(name, self(*self.arguments(name, inputs)))

    def metric_values(self, name: str, inputs: Any) -> list[Tensor]:
        """Each of the term's `metrics` on what an objective was fed (the
        tensors the term reads, its mask excluded), as float32 scalars."""
        tensors = self.arguments(name, inputs)
        if self.mask_input is not None:
            tensors = tensors[:-1]
        return self._metrics_on(tensors)

    def __call__(self, *tensors: TensorLike) -> Tensor:
        """The unweighted value of the penalty on `tensors` (those `reads`
        names: the mask, if the term has one, comes last)."""
        return self._penalty(*tensors)

    # -------------------------------------------- in a CompositeLoss

    def loss_value(
        self, name: str, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None = None
    ) -> Tensor:
        """The term's unweighted float32 value in a CompositeLoss, on this
        replica's batch as one device would compute it on that batch;
        `y_true` and `y_pred` as Keras passed them (a Loss reads the mask
        `y_pred` carries before any cast)."""
        return self._penalty.loss_value(name, y_true, y_pred, sample_weight)

    def loss_metric_values(self, y_true: TensorLike, y_pred: TensorLike) -> list[Tensor]:
        """Each of the term's `metrics` on what it reads of (y_true, y_pred)."""
        return self._metrics_on(self._penalty.loss_tensors(y_true, y_pred))

    def _metrics_on(self, tensors):
        return [scalar(name, fn(*tensors)) for name, fn in self.metrics.items()]

    # -------------------------------------------- saving

    def get_config(self) -> dict[str, Any]:
        weight = keras.saving.serialize_keras_object(self.weight) if self.scheduled else self.weight
        return {
            "penalty": self._penalty.config(),
            "weight": weight,
            "inputs": None if self.inputs is None else list(self.inputs),
            "enabled": self.enabled,
            "options": dict(self.options),
            "metrics": {name: _serialize_metric(fn) for name, fn in self.metrics.items()},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Term":
        config = dict(config)
        for key in ("penalty", "weight"):
            if isinstance(config[key], dict):
                config[key] = _loadable(key, keras.saving.deserialize_keras_object(config[key]))
        config["metrics"] = {
            name: _loadable(f"metrics[{name!r}]", keras.saving.deserialize_keras_object(fn)) if isinstance(fn, dict) else fn
            for name, fn in (config.get("metrics") or {}).items()
        }
        return cls(**config)

    def __repr__(self) -> str:
        return (
            f"Term({self._penalty.label!r}, weight={self.weight!r}, inputs={self.inputs!r}, "
            f"enabled={self.enabled})"
        )


def build_terms(terms, weights=None):
    """Validates `terms` (dict name → Term or penalty) and `weights`; returns
    a dict name → Term, each error naming the offending term."""
    if weights is not None and not isinstance(weights, dict):
        raise TypeError(f"`weights` must be a dict of term name -> weight, or None; got {weights!r}.")
    if isinstance(terms, dict):
        items = list(terms.items())
    elif isinstance(terms, (list, tuple)) and all(isinstance(t, tuple) and len(t) == 2 for t in terms):
        items = list(terms)
    else:
        raise TypeError(f"`terms` must be a dict of name -> Term or penalty; got {terms!r}.")
    if not items:
        raise ValueError("`terms` must hold at least one term.")
    built = {}
    for name, term in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Term names must be non-empty strings; got {name!r}.")
        if not METRIC_NAME_PATTERN.match(name):
            raise ValueError(
                f"Term name {name!r} cannot be a metric name: use letters, digits, '_', '.' or '-'."
            )
        if name in built:
            raise ValueError(f"Duplicate term name {name!r}.")
        try:
            built[name] = term.copy() if isinstance(term, Term) else Term(term)
        except (ValueError, TypeError) as error:
            raise type(error)(f"Term {name!r}: {error}") from error
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(built))
    if unknown:
        raise ValueError(f"`weights` names unknown term(s) {unknown}; terms are {list(built)}.")
    for name, weight in weights.items():
        try:
            weight = check_weight("weight", weight)
        except (ValueError, TypeError) as error:
            raise type(error)(f"Term {name!r}: {error}") from error
        built[name].weight = weight
    return built


def serialize_terms(terms):
    return {name: keras.saving.serialize_keras_object(term) for name, term in terms.items()}


def deserialize_terms(config):
    return {name: keras.saving.deserialize_keras_object(term) for name, term in config.items()}


# ---------------------------------------------------------------- Composite


def weight_state(owner, terms, weighting):
    """Creates the variables of a composite's weights on `owner` (a layer),
    in the caller's name scope: each term's weight (0 for a scheduled one:
    the schedule gives it) and enabled flag; with `weighting="uncertainty"`
    the trainable log-variances sᵢ (initially 0, trained by the model's
    optimizer); with `weighting="famo"` FAMO's logits ξ (initially 0), their
    Adam moments, the previous step's log-losses, the count of training
    steps and the latest effective weights (1 before the first step)."""
    n = len(terms)
    owner.term_weights = state_variable("term_weights", [0.0 if t.scheduled else t.weight for t in terms.values()])
    owner.term_enabled = state_variable("term_enabled", [float(t.enabled) for t in terms.values()])
    owner.log_variances = None
    if weighting == "uncertainty":
        owner.log_variances = state_variable("log_variances", np.zeros(n), trainable=True, aggregation="mean")
    owner.famo_logits = None
    if weighting == "famo":
        owner.famo_logits = state_variable("famo_logits", np.zeros(n))
        owner.famo_moments = state_variable("famo_moments", np.zeros((2, n)))
        owner.famo_previous = state_variable("famo_previous", np.zeros(n))
        owner.famo_steps = state_variable("famo_steps", 0.0)
        owner.famo_last_weights = state_variable("famo_last_weights", np.ones(n))


class Composite:
    """What `CompositeObjective` and `CompositeLoss` share: their terms, their
    weights (`set_weight`, `enable`, `disable`, the weights in use, the
    weighted total) and the keys they report.

    A subclass calls `_set_terms` first, then provides `term_weights`,
    `term_enabled` and `log_variances` (from `weight_state`), FAMO's state
    on `_weight_owner()` and, where weights may be schedules, `step` and
    `weight_overridden`."""

    step = None  # a CompositeObjective's training-step count
    # What the subclass provides, declared for type checkers (the Keras base
    # classes they also derive from have no types).
    name: str
    term_weights: Any
    term_enabled: Any
    weight_overridden: Any

    def _composite_config(self):
        """The config entries both composites share."""
        return {
            "terms": serialize_terms(self.terms),
            "weighting": self.weighting,
            "weighting_learning_rate_multiplier": self.weighting_learning_rate_multiplier,
            "famo_learning_rate": self.famo_learning_rate,
            "famo_gamma": self.famo_gamma,
        }

    def _set_terms(self, terms, weights, weighting, multiplier=1.0, famo=FAMO_DEFAULTS):
        self.terms = build_terms(terms, weights)
        self.weighting = check_weighting(weighting)
        self.weighting_learning_rate_multiplier = check_multiplier(multiplier, self.weighting)
        self.famo_learning_rate, self.famo_gamma = check_famo(*famo, self.weighting)
        # Fixed for the life of the composite: the traced step evaluates these.
        self._schedules = [t.weight if t.scheduled else None for t in self.terms.values()]
        self._scheduled = np.array([s is not None for s in self._schedules])
        self._sums_over_samples = np.array([t.sums_over_samples for t in self.terms.values()])
        # Each term's custom metrics, reported as "<term>/<metric>" after the terms.
        self.metric_keys = [f"{name}/{metric}" for name, t in self.terms.items() for metric in t.metrics]

    @property
    def reported_keys(self) -> list[str]:
        """What the composite reports, in order: each term, then each term's
        custom metrics as `"<term>/<metric>"`."""
        return list(self.terms) + self.metric_keys

    def _index(self, name):
        if name not in self.terms:
            raise ValueError(f"Unknown term {name!r}; terms are {list(self.terms)}.")
        return list(self.terms).index(name)

    def _assign_entry(self, variable, index, value):
        array = np.array(ops.convert_to_numpy(variable))
        array[index] = value
        variable.assign(array)

    def set_weight(self, name: str, weight: float) -> None:
        """Sets a term's weight to a number from the next step on, without retracing.

        A number replaces the term's schedule, if it had one. Schedules are part
        of the traced step and are set at construction. Inside `fit`, call it
        from a callback; on JAX reach the objective through the callback's
        `self.model` first (e.g. `self.model.get_layer(...)`), which syncs
        Keras' training state, as for any variable changed by a callback. With
        `weighting="uncertainty"` the weights are learned: a `ValueError`.
        """
        index = self._index(name)
        if self.weighting is not None:
            raise ValueError(
                f"set_weight: {self.name!r} has weighting={self.weighting!r}, which learns its "
                "weights; build it without `weighting` to set them."
            )
        if is_schedule(weight):
            raise TypeError(
                f"set_weight takes a number; term {name!r} got a schedule. Schedules are "
                "traced into the training step, so give them when building the objective."
            )
        weight = num.non_negative("weight", weight)
        self._assign_entry(self.term_weights, index, weight)
        if self._scheduled[index]:
            self._assign_entry(self.weight_overridden, index, 1.0)
        self.terms[name].weight = weight

    def enable(self, name: str) -> None:
        """Counts the term in the total from the next step on."""
        self._assign_entry(self.term_enabled, self._index(name), 1.0)
        self.terms[name].enabled = True

    def disable(self, name: str) -> None:
        """Leaves the term out of the total from the next step on; its value is
        still computed and reported."""
        self._assign_entry(self.term_enabled, self._index(name), 0.0)
        self.terms[name].enabled = False

    def _learned_log_variances(self):
        """The sᵢ as the total reads them: their gradient scaled by
        `weighting_learning_rate_multiplier`."""
        return _scaled_gradient(self.log_variances.value, self.weighting_learning_rate_multiplier)

    def _no_weight_decay_on_log_variances(self):
        """Keeps the model's optimizer from decaying the sᵢ (decay would pull
        every weight ½·exp(−sᵢ) towards ½). Keras hands neither a layer nor
        a loss its model: the model is the one whose training step (a method
        of it) is running, found among the Python frames; called where the
        composite is computed, before the optimizer's step is traced or run."""
        if self.log_variances is None:
            return
        model = _keras_internals.calling_model(_has_optimizer)
        if model is not None:
            _keras_internals.exclude_from_weight_decay(model.optimizer, [self.log_variances])

    def _famo(self, values, update):
        """FAMO's total Σ cᵢzᵢ·log Dᵢ over the enabled terms for this step's
        unweighted `values` (Dᵢ = max(Lᵢ, 0) + ε: Lᵢ,min is 0); with `update`
        (once per training step) the logits first move by the change of the
        log-losses since the previous training step, and the state advances.
        Under several tf.distribute replicas its cross-replica sum and its
        state's assignments switch replica threads: the model's add_loss
        lists are kept as they were around them."""
        if backend.replicas_in_sync() == 1:
            return self._famo_total(values, update)
        with _keras_internals.added_losses_kept(self._model_across_replicas()):
            return self._famo_total(values, update)

    def _famo_total(self, values, update):
        state = self._weight_owner()
        frozen = ops.stop_gradient(values)
        values_in_sync = frozen
        replicas = backend.replicas_in_sync()
        if replicas > 1:
            # Each replica's values have the whole batch's as their mean.
            (values_in_sync,) = backend.sum_over_replicas([values_in_sync])
            values_in_sync = values_in_sync / float(replicas)
        log_losses = ops.log(ops.maximum(values_in_sync, 0.0) + _FAMO_EPSILON)
        logits = state.famo_logits.value
        if update:
            steps = state.famo_steps.value
            new_logits, moments = famo_step(
                logits, state.famo_moments.value, ops.maximum(steps, 1.0), state.famo_previous.value,
                log_losses, self.famo_learning_rate, self.famo_gamma,
            )
            seen = steps > 0.5  # no previous step to compare with at the first
            logits = ops.where(seen, new_logits, logits)
            state.famo_logits.assign(logits)
            state.famo_moments.assign(ops.where(seen, moments, state.famo_moments.value))
            state.famo_previous.assign(log_losses)
            state.famo_steps.assign(steps + 1.0)
        coefficients = ops.stop_gradient(famo_coefficients(logits, log_losses))
        weights = coefficients * ops.exp(-log_losses)
        if update:
            state.famo_last_weights.assign(weights)
        # The value is the whole batch's; the gradient is Σ wᵢ·∇Lᵢ of this
        # replica's own values, which Keras adds up to the whole batch's.
        own = values - frozen
        return ops.sum((coefficients * log_losses + weights * own) * self.term_enabled.value)

    def _model_across_replicas(self):
        """The model whose add_loss lists a cross-replica sum must keep as
        they were (see `backend.sum_over_replicas`); the composites say
        which."""
        return None

    def _weight_owner(self):
        """Where the weight variables live: the composite (a method, not a
        property: Keras' saving walks properties, and this is the object
        itself), or a CompositeLoss's LossState."""
        return self

    def _weights_at(self, step):
        if self.weighting == "famo":
            return self._weight_owner().famo_last_weights.value
        if self.log_variances is not None:
            return uncertainty_weights(self._learned_log_variances())
        if not self._scheduled.any():
            return self.term_weights.value
        scheduled = ops.stack(
            [
                ops.zeros((), "float32") if schedule is None else ops.cast(schedule(step), "float32")
                for schedule in self._schedules
            ]
        )
        use_schedule = ops.logical_and(
            ops.convert_to_tensor(self._scheduled), self.weight_overridden.value < 0.5
        )
        return ops.where(use_schedule, scheduled, self.term_weights.value)

    def current_weights(self) -> Tensor:
        """The weight vector of the next step: schedules at the current step
        (unless `set_weight` replaced them), numbers as set, ½·exp(−sᵢ) under
        uncertainty weighting."""
        return self._weights_at(None if self.step is None else self.step.value)

    def weights_in_use(self) -> dict[str, float]:
        """Each term's weight for the next step as a float (a disabled term's
        too): `{name: weight}`; ½·exp(−sᵢ) under uncertainty weighting; under
        FAMO the effective weights of the latest training step."""
        weights = ops.convert_to_numpy(self.current_weights())
        return {name: float(weights[i]) for i, name in enumerate(self.terms)}

    def effective_weights(self) -> Tensor:
        """What each term's value is multiplied by in the total: its current
        weight, or 0 while disabled."""
        return self.current_weights() * self.term_enabled.value

    def _total(self, values, weights=None, update=False):
        """Σ wᵢ·valueᵢ over the enabled terms (`weights`: the current ones by
        default), plus Σ ½·sᵢ over them under uncertainty weighting; under
        FAMO Σ cᵢzᵢ·log Dᵢ (see `_famo`; the state advances with `update`)."""
        if self.weighting == "famo":
            return self._famo(values, update)
        if weights is None:
            weights = self.current_weights()
        total = backend.reduce_sum(values * weights * self.term_enabled.value)
        if self.log_variances is not None:
            total = total + 0.5 * ops.sum(self._learned_log_variances() * self.term_enabled.value)
        return total
