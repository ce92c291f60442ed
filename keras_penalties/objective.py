"""Composition: named, weighted penalty terms as one objective.

- `Term`: one penalty with its weight (a number or a schedule of the training
  step), the inputs it reads and its options.
- `CompositeObjective`: a pass-through layer that `add_loss`es Σ wᵢ·termᵢ of
  the tensors flowing through it, and keeps each term's running value.
- `CompositeLoss` (in `keras_penalties.losses`): the same for `compile(loss=)`.

Weights, enabled flags, the step count that drives schedules and the running
per-term values live in non-trainable variables, not Python floats: a change
made during `fit` takes effect on the next step without retracing, on every
backend (under JAX's `jit` a Python float would be baked into the trace), and
they flow out of JAX's stateless training step like BatchNormalization's
statistics. `keras_penalties.callbacks.PenaltyMonitor` turns the running
values into `"<objective>/<term>"` entries of fit/evaluate logs and History.

Mixed precision: the state is float32 and never autocast, and terms see
float32 copies of half-precision activations. Several devices: each replica
contributes its terms scaled so that Keras' division of every added loss by
the number of replicas gives the one-device loss (a sum over samples is
multiplied by the replicas, a per-sample mean is not), and the running values
combine across replicas by their mean.
"""

import functools
import re
import weakref

import keras
import numpy as np
from keras import ops

from keras_penalties import _capture, _keras_internals, backend, gradients
from keras_penalties._saving import with_hint, without_hint
from keras_penalties import ops as penalties
from keras_penalties.ops import _numerics as num

METRIC_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")
_OPS = {name: getattr(penalties, name) for name in penalties.PENALTIES}
_TRAIN, _EVAL = 0, 1


def _is_schedule(weight):
    return isinstance(weight, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(weight) and not isinstance(weight, (int, float, np.number))
    )


_check_weighting = num.optional(num.choice("uncertainty"))


def check_weighting(weighting):
    """`weighting`: None (the terms' own weights) or "uncertainty"."""
    if weighting is not None and not isinstance(weighting, str):
        raise TypeError(f"`weighting` must be None or 'uncertainty'; got {weighting!r}.")
    return _check_weighting("weighting", weighting)


def uncertainty_weights(log_variances):
    """Kendall et al. (2018), as LibMTL: term i weighs ½·exp(−sᵢ)."""
    return 0.5 * ops.exp(-log_variances)


def uncertainty_offset(log_variances, enabled):
    """The ½·Σsᵢ the uncertainty-weighted total adds, over enabled terms."""
    return 0.5 * ops.sum(log_variances * enabled)


def check_weight(name, weight):
    """A term weight: a number ≥ 0 and finite, or a schedule of the step that
    is ≥ 0 at step 0."""
    if isinstance(weight, type):
        raise TypeError(f"`{name}` must be a number or a schedule instance; got the class {weight.__name__}.")
    if not _is_schedule(weight):
        return num.non_negative(name, weight)
    try:
        first = float(ops.convert_to_numpy(weight(0)))
    except Exception as error:  # noqa: BLE001 -- reported with the argument's name
        raise TypeError(f"`{name}` is a schedule that cannot be evaluated at step 0: {error}") from error
    if not first >= 0:
        raise ValueError(f"`{name}` is a schedule whose value at step 0 is {first}; weights must be >= 0.")
    return weight


# Without a `reduction` option these terms use Keras' activity-regularizer
# scale in a composite, so their strength does not depend on the batch size.
_BATCH_MEAN_BY_DEFAULT = ("l1", "l2", "elastic_net")


def as_float32(tensors):
    """Half-precision tensors of a structure as float32 copies; the others as they are."""
    return keras.tree.map_structure(
        lambda t: ops.cast(t, "float32") if hasattr(t, "dtype") and num.is_half(t.dtype) else t, tensors
    )


def whole_batch_values(values, sums):
    """Each replica's term values scaled so that their mean over replicas is
    the whole batch's value: a sum over samples (where `sums`) times the
    number of replicas in sync, a per-sample mean as is. Keras divides each
    replica's loss by that number before it adds up their gradients."""
    replicas = backend.replicas_in_sync()
    if replicas == 1 or not any(sums):
        return values
    return values * ops.convert_to_tensor(np.where(sums, float(replicas), 1.0).astype("float32"))


def _loadable(name, obj):
    """What `Term.from_config` may rebuild: Keras objects, schedules, ops
    functions and objects registered with Keras; a `.keras` file naming any
    other importable function (`keras.config.set_floatx`) is refused."""
    if isinstance(obj, (keras.regularizers.Regularizer, keras.losses.Loss,
                        keras.optimizers.schedules.LearningRateSchedule)):
        return obj
    if any(obj is fn for fn in _OPS.values()):
        return obj
    registered = keras.saving.get_registered_name(obj)
    if ">" in registered and keras.saving.get_registered_object(registered) is obj:
        return obj
    raise ValueError(
        f"Term `{name}` {obj!r} is neither a keras_penalties.ops function, a Loss, a "
        "Regularizer, a schedule, nor a function registered with "
        "keras.saving.register_keras_serializable; refusing to load it."
    )


def _op_named(argument, name):
    """The ops function `name` names; a ValueError naming `argument` otherwise."""
    if name not in _OPS:
        raise ValueError(
            f"`{argument}` must name a keras_penalties.ops function, one of {sorted(_OPS)}; got {name!r}."
        )
    return _OPS[name]


def _metric_op(argument, name):
    """An ops function named as a metric (by `argument`), with the default
    reduction a term by that name gets."""
    fn = _op_named(argument, name)
    if name in _BATCH_MEAN_BY_DEFAULT:
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
    if isinstance(fn, functools.partial) and any(fn.func is op for op in _OPS.values()):
        return fn.func.__name__
    if any(fn is op for op in _OPS.values()):
        return fn.__name__
    return keras.saving.serialize_keras_object(fn)


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

    def __init__(self, penalty, weight=1.0, inputs=None, enabled=True, options=None, metrics=None):
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"`options` must be a dict or None; got {options!r}.")
        options = dict(options or {})
        if isinstance(penalty, type):
            raise TypeError(
                f"`penalty` must be an instance, not the class {penalty.__name__}: "
                f"write e.g. {penalty.__name__}(...)."
            )
        if isinstance(penalty, str):
            penalty = _op_named("penalty", penalty)
        if any(penalty is fn for fn in _OPS.values()):
            self.kind = "op"
            if penalty.__name__ in _BATCH_MEAN_BY_DEFAULT:
                options.setdefault("reduction", "sum_over_batch_size")
            options = penalty.check_options(**options)
            mask = options.get("mask")
            if mask is not None and (isinstance(mask, bool) or not isinstance(mask, (str, int))):
                raise TypeError(
                    "A Term's `options['mask']` names the input that holds the mask (a dict key "
                    f"or a list position, like `inputs`); got {type(mask).__name__}. Feed the "
                    "mask to the objective beside the tensors and name it here."
                )
        elif isinstance(penalty, (keras.regularizers.Regularizer, keras.losses.Loss)):
            if options:
                raise ValueError(
                    f"`options` apply to ops functions and plain callables; "
                    f"configure a {type(penalty).__name__} through its constructor."
                )
            self.kind = "regularizer" if isinstance(penalty, keras.regularizers.Regularizer) else "loss"
        elif callable(penalty):
            self.kind = "callable"
        else:
            raise TypeError(
                "`penalty` must be an ops function name, an ops function, a "
                f"Regularizer, a Loss or a callable; got {penalty!r}."
            )
        self.penalty = penalty
        self.options = options
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
    def mask_input(self):
        """The name or position of the input holding the term's mask, or None."""
        return self.options.get("mask") if self.kind == "op" else None

    @property
    def reads(self):
        """Every input the term reads: its `inputs`, then its mask's."""
        return self.inputs if self.mask_input is None else self.inputs + (self.mask_input,)

    @property
    def scheduled(self):
        return _is_schedule(self.weight)

    @property
    def sums_over_samples(self):
        """Whether the value is a sum over samples (it then grows with the
        batch, and a distributed step adds the replicas' values) rather than
        a per-sample mean or a statistic of the batch."""
        if self.kind == "op":
            return self.options.get("reduction") == "sum"
        if self.kind == "loss":
            return getattr(self.penalty, "reduction", None) == "sum"
        return False

    def copy(self):
        return Term(self.penalty, self.weight, self.inputs, self.enabled, self.options, self.metrics)

    def metric_values(self, *tensors):
        """Each of the term's `metrics` on `tensors` (those `reads` names, the
        mask excluded), as float32 scalars, in order."""
        if self.mask_input is not None:
            tensors = tensors[:-1]
        return [scalar(name, fn(*tensors)) for name, fn in self.metrics.items()]

    def __call__(self, *tensors):
        """The unweighted value of the penalty on `tensors` (those `reads`
        names: the mask, if the term has one, comes last)."""
        if self.mask_input is not None:
            *tensors, mask = tensors
            return self.penalty(*tensors, **{**self.options, "mask": mask})
        if self.kind in ("op", "callable"):
            return self.penalty(*tensors, **self.options)
        if self.kind == "regularizer":
            if len(tensors) != 1:
                raise ValueError(f"a Regularizer takes one tensor; got {len(tensors)}.")
            (x,) = tensors
            value = self.penalty(x)
            if len(x.shape) > 0:
                # As Keras divides an activity regularizer (0 for no samples).
                value = value / ops.cast(num.batch_size(x), value.dtype)
            return value
        if len(tensors) == 2:
            return self.penalty(*tensors)
        if len(tensors) == 1 and not getattr(self.penalty, "needs_y_true", True):
            return self.penalty(None, tensors[0])
        raise ValueError(
            f"a Loss takes two tensors (y_true, y_pred); got {len(tensors)}. "
            "Give the term `inputs=(reference, prediction)`."
        )

    def get_config(self):
        penalty = self.penalty.__name__ if self.kind == "op" else keras.saving.serialize_keras_object(self.penalty)
        weight = keras.saving.serialize_keras_object(self.weight) if self.scheduled else self.weight
        return {
            "penalty": penalty,
            "weight": weight,
            "inputs": None if self.inputs is None else list(self.inputs),
            "enabled": self.enabled,
            "options": dict(self.options),
            "metrics": {name: _serialize_metric(fn) for name, fn in self.metrics.items()},
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("penalty", "weight"):
            if isinstance(config[key], dict):
                config[key] = _loadable(key, keras.saving.deserialize_keras_object(config[key]))
        config["metrics"] = {
            name: _loadable(f"metrics[{name!r}]", keras.saving.deserialize_keras_object(fn)) if isinstance(fn, dict) else fn
            for name, fn in (config.get("metrics") or {}).items()
        }
        return cls(**config)

    def __repr__(self):
        name = self.penalty.__name__ if self.kind == "op" else type(self.penalty).__name__
        return f"Term({name!r}, weight={self.weight!r}, inputs={self.inputs!r}, enabled={self.enabled})"


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


def scalar(name, value):
    """A term's value as a float32 scalar; anything else is an error naming it."""
    value = ops.convert_to_tensor(value)
    if len(value.shape) == 1 and value.shape[0] == 0:
        # A Keras Loss hands an empty batch's per-sample values back unreduced.
        value = ops.sum(value)
    if len(value.shape) != 0:
        raise ValueError(
            f"Term {name!r} must return a scalar; it returned shape {tuple(value.shape)}. "
            "Use a reduction such as reduction='mean'."
        )
    return ops.cast(value, "float32")


class WeightControl:
    """The weights of a `CompositeObjective` and a `CompositeLoss`:
    `set_weight`, `enable`, `disable`, the weights in use and the weighted
    total. They need `terms`, `weighting`, `term_weights`, `term_enabled`,
    `log_variances`, `current_weights()` and `_weight_was_set(index)`."""

    def _index(self, name):
        if name not in self.terms:
            raise ValueError(f"Unknown term {name!r}; terms are {list(self.terms)}.")
        return list(self.terms).index(name)

    def _assign_entry(self, variable, index, value):
        array = np.array(ops.convert_to_numpy(variable))
        array[index] = value
        variable.assign(array)

    def set_weight(self, name, weight):
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
        if _is_schedule(weight):
            raise TypeError(
                f"set_weight takes a number; term {name!r} got a schedule. Schedules are "
                "traced into the training step, so give them when building the objective."
            )
        weight = num.non_negative("weight", weight)
        self._assign_entry(self.term_weights, index, weight)
        self._weight_was_set(index)
        self.terms[name].weight = weight

    def enable(self, name):
        """Counts the term in the total from the next step on."""
        self._assign_entry(self.term_enabled, self._index(name), 1.0)
        self.terms[name].enabled = True

    def disable(self, name):
        """Leaves the term out of the total from the next step on; its value is
        still computed and reported."""
        self._assign_entry(self.term_enabled, self._index(name), 0.0)
        self.terms[name].enabled = False

    def weights_in_use(self):
        """Each term's weight for the next step as a float (a disabled term's
        too): `{name: weight}`; ½·exp(−sᵢ) under uncertainty weighting."""
        weights = ops.convert_to_numpy(self.current_weights())
        return {name: float(weights[i]) for i, name in enumerate(self.terms)}

    def effective_weights(self):
        """What each term's value is multiplied by in the total: its current
        weight, or 0 while disabled."""
        return self.current_weights() * self.term_enabled.value

    def _total(self, values, weights=None):
        """Σ wᵢ·valueᵢ over the enabled terms (`weights`: the current ones by
        default), plus Σ ½·sᵢ under uncertainty weighting."""
        weights = self.current_weights() if weights is None else weights
        total = ops.sum(values * weights * self.term_enabled.value)
        if self.log_variances is not None:
            total = total + uncertainty_offset(self.log_variances.value, self.term_enabled.value)
        return total


@keras.saving.register_keras_serializable(package="keras_penalties")
class CompositeObjective(WeightControl, keras.layers.Layer):
    """A pass-through layer that adds Σ wᵢ·termᵢ of its inputs to the model's loss.

    Place it on activations (or a dict of them) inside a model: it returns its
    input unchanged and `add_loss`es the weighted sum of its terms. Each term's
    running unweighted value is kept for `PenaltyMonitor`, which reports it as
    `"<name>/<term>"` in fit/evaluate logs and History.

    Args:
        terms: dict name → `Term` or penalty (anything `Term` accepts); names
            are non-empty, unique, and usable as metric names.
        weights: optional dict name → number or schedule, overriding the
            terms' own weights.
        name: the layer name, also the prefix of the logged values.
        weighting: None (the terms' weights), or `"uncertainty"` (Kendall et
            al., 2018, as LibMTL): a trainable log-variance sᵢ per term,
            initially 0, trained by the model's optimizer; the total is
            Σ ½·exp(−sᵢ)·termᵢ + ½·sᵢ over enabled terms, the terms' own
            weights are ignored, and the weight reported is ½·exp(−sᵢ).

    Example:

    >>> import numpy as np
    >>> from keras_penalties import CompositeObjective, Term
    >>> objective = CompositeObjective(
    ...     {"l1": "l1", "entropy": Term("entropy", 0.5, options={"from_logits": True})})
    >>> total, values = objective.compute(np.zeros((2, 4), "float32"))
    >>> round(float(total), 4), round(float(values["entropy"]), 4)  # 0 + 0.5·ln 4
    (0.6931, 1.3863)
    """

    def __init__(self, terms, weights=None, name=None, weighting=None, **kwargs):
        # A pass-through: inputs keep their dtype under a mixed policy.
        kwargs.setdefault("autocast", False)
        weighting = check_weighting(weighting)
        super().__init__(name=name, **kwargs)
        self.terms = build_terms(terms, weights)
        self.weighting = weighting
        self.supports_masking = True
        n = len(self.terms)
        # Fixed for the life of the layer: the traced step evaluates these.
        self._schedules = [t.weight if t.scheduled else None for t in self.terms.values()]
        self._scheduled = np.array([s is not None for s in self._schedules])
        self._sums_over_samples = np.array([t.sums_over_samples for t in self.terms.values()])
        # Per forward pass: the weights of its step, and the losses it added.
        self._passes = weakref.WeakKeyDictionary()

        def state(name, values, dtype="float32", aggregation="only_first_replica", local=False):
            # float32 and never autocast: under a mixed policy a weight of 1e5
            # would read inf and a step count would stall at 2049. Under a
            # tf.distribute strategy, weights are the same on every replica
            # (set from callbacks); the step and running values are each
            # replica's own (`local`, "on_read": no cross-replica sync inside
            # the forward pass): the step advances alike on each and reads
            # as the first's, running values read as their mean.
            values = np.asarray(values, dtype=dtype)
            with keras.name_scope(self.name, caller=self):
                return keras.Variable(
                    initializer=values, shape=values.shape, dtype=dtype, trainable=False, autocast=False,
                    aggregation=aggregation, synchronization="on_read" if local else "auto", name=name,
                )

        self.term_weights = state("term_weights", [0.0 if t.scheduled else t.weight for t in self.terms.values()])
        self.term_enabled = state("term_enabled", [float(t.enabled) for t in self.terms.values()])
        # 1 where set_weight replaced a schedule by a number.
        self.weight_overridden = state("weight_overridden", np.zeros(n))
        # Training steps taken: every replica advances it alike.
        self.step = state("step", 0, dtype="int32", local=True)
        # Running sums of each term's unweighted value, and call counts; row
        # 0 for training calls, row 1 for the others (evaluate, predict).
        # Each term's custom metrics are reported as "<term>/<metric>", after the terms.
        self.metric_keys = [f"{name}/{metric}" for name, t in self.terms.items() for metric in t.metrics]
        self.value_sums = state(
            "value_sums", np.zeros((2, n + len(self.metric_keys))), aggregation="mean", local=True
        )
        self.value_counts = state("value_counts", np.zeros(2), aggregation="mean", local=True)
        # weighting="uncertainty": each term's log-variance sᵢ, trained by the
        # model's optimizer (float32, never autocast, like the state above).
        self.log_variances = None
        if weighting == "uncertainty":
            with keras.name_scope(self.name, caller=self):
                self.log_variances = keras.Variable(
                    initializer=np.zeros(n, "float32"), shape=(n,), dtype="float32", trainable=True,
                    autocast=False, name="log_variances",
                )

    # ------------------------------------------------------------ computation

    def _arguments(self, name, term, inputs):
        if term.inputs is None:
            if isinstance(inputs, dict):
                raise ValueError(
                    f"Term {name!r} has no `inputs`, but the objective was fed a dict with keys "
                    f"{sorted(inputs)}; give the term inputs=(...) naming the entries it takes."
                )
            return tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        if isinstance(inputs, dict):
            missing = [k for k in term.reads if k not in inputs]
            if missing:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(term.reads)}, but {missing} "
                    f"{'is' if len(missing) == 1 else 'are'} not among the fed inputs {sorted(inputs)}."
                )
            return tuple(inputs[k] for k in term.reads)
        if isinstance(inputs, (list, tuple)):
            bad = [k for k in term.reads if not isinstance(k, int) or not -len(inputs) <= k < len(inputs)]
            if bad:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(term.reads)}, but the objective was fed a "
                    f"list of {len(inputs)} tensors; list inputs are chosen by position."
                )
            return tuple(inputs[k] for k in term.reads)
        raise ValueError(
            f"Term {name!r} takes inputs {list(term.inputs)}, but the objective was fed a single "
            "tensor; feed a dict (or list) holding them."
        )

    def term_value(self, name, inputs):
        """One term's unweighted float32 scalar on `inputs` (half-precision
        tensors are computed in float32)."""
        return self._term_value(name, as_float32(inputs))

    def _term_value(self, name, inputs):
        term = self.terms[name]
        return scalar(name, term(*self._arguments(name, term, inputs)))

    def _values(self, inputs):
        """Each term's unweighted value, in term order, stacked; `inputs`
        already as `as_float32` gives them."""
        return ops.stack([self._term_value(name, inputs) for name in self.terms])

    def _metric_values(self, inputs):
        """Each term's custom metrics (`metric_keys` order), as a list of
        scalars; `inputs` already as `as_float32` gives them."""
        values = []
        for name, term in self.terms.items():
            if term.metrics:
                values.extend(term.metric_values(*self._arguments(name, term, inputs)))
        return values

    def _weights_at(self, step):
        if self.log_variances is not None:
            return uncertainty_weights(self.log_variances.value)
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

    def current_weights(self):
        """The weight vector used by the next step: schedules at the current step
        (unless `set_weight` replaced them), numbers as set."""
        return self._weights_at(self.step.value)

    def _pass(self, training):
        """The state of the forward pass this call belongs to.

        A shared encoder calls the objective once per view in one training
        step: every call of a step reads the weights of that step, and the
        step count advances once. A pass is JAX's stateless scope in `fit`
        (there each layer call is its own outermost call), else the
        outermost layer call (the model's).
        """
        token = _keras_internals.stateless_scope() or _keras_internals.current_call_context()
        state = None if token is None else self._passes.get(token)
        if state is None:
            step = self.step.value
            state = {"weights": self._weights_at(step), "losses": []}
            if training:
                self.step.assign(step + 1)
            if token is not None:
                self._passes[token] = state
        return state

    def _add_loss_of_pass(self, state, total):
        # Keras clears a layer's losses whenever a layer is entered afresh;
        # on JAX each call in `fit` is, so a second call would drop the
        # first call's penalty (plain Keras regularizers do lose it there).
        # Add back whatever of this pass was dropped.
        held = _keras_internals.own_losses(self)
        for loss in state["losses"]:
            if not any(loss is h for h in held):
                self.add_loss(loss)
        self.add_loss(total)
        state["losses"].append(total)

    def call(self, inputs, training=None):
        floats = as_float32(inputs)  # half-precision activations, once per call
        values = self._values(floats)
        _capture.record(self, values)
        values = whole_batch_values(values, self._sums_over_samples)
        state = self._pass(training)
        self._add_loss_of_pass(state, self._total(values, state["weights"]))
        row = np.zeros((2, 1), "float32")
        row[_EVAL if not training else _TRAIN] = 1.0
        row = ops.convert_to_tensor(row)
        if self.metric_keys:
            values = ops.concatenate([values, ops.stack(self._metric_values(floats))])
        # Under a strategy each replica adds its own values; the variables
        # read as their mean, which is the whole batch's value.
        self.value_sums.assign(self.value_sums.value + row * values[None, :])
        self.value_counts.assign(self.value_counts.value + row[:, 0])
        return inputs

    def compute_output_spec(self, inputs, training=None):
        # Check what each term reads now, when the model is built.
        for name, term in self.terms.items():
            self._arguments(name, term, inputs)
        # The same specs, as new tensors: returning the inputs themselves would
        # make the functional graph a cycle.
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor(t.shape, t.dtype, sparse=t.sparse), inputs
        )

    def compute(self, inputs):
        """`(total, values)` for `inputs`, with no side effects.

        `total` is Σ wᵢ·termᵢ over enabled terms (a float32 scalar tensor) and
        `values` maps each enabled term to its unweighted scalar. Usable in a
        custom training loop, or on tensors received from elsewhere (e.g. a
        remote trainer's logprobs).
        """
        values = self._values(as_float32(inputs))
        total = self._total(values)
        return total, {name: values[i] for i, (name, t) in enumerate(self.terms.items()) if t.enabled}

    def _weight_was_set(self, index):
        if self._scheduled[index]:
            self._assign_entry(self.weight_overridden, index, 1.0)

    # ------------------------------------------------------------ reporting

    def running_values(self, training=True):
        """Mean unweighted value of each term (and of each custom metric, as
        `"<term>/<metric>"`) since the last reset, as floats (the numbers
        PenaltyMonitor logs); empty before the first call."""
        row = _TRAIN if training else _EVAL
        count = float(ops.convert_to_numpy(self.value_counts)[row])
        if count == 0:
            return {}
        sums = ops.convert_to_numpy(self.value_sums)[row]
        return {name: float(sums[i] / count) for i, name in enumerate(self.reported_keys)}

    @property
    def reported_keys(self):
        """What `running_values` reports, in order: each term, then each
        term's custom metrics as `"<term>/<metric>"`."""
        return list(self.terms) + self.metric_keys

    def reset_running_values(self, training=True):
        row = _TRAIN if training else _EVAL
        self._assign_entry(self.value_sums, row, 0.0)
        self._assign_entry(self.value_counts, row, 0.0)

    def report(self, inputs, *, base_loss=None, grad_norms=False):
        """A JSON-ready breakdown of the objective on `inputs` (plain floats).

        Args:
            inputs: what the objective is fed (tensor, list or dict).
            base_loss: the task loss, a scalar, or a callable of `inputs` (then
                its gradient counts in the norms).
            grad_norms: also compute gradient norms w.r.t. `inputs`.

        Returns:
            `{"loss_total", "regularizer_total", "base_loss": {"value",
            "grad_norm"}, "regularizers": {name: {"value", "weight",
            "contribution", "grad_norm", "grad_norm_weighted", "custom"}},
            "total_grad_norm"}`, contribution = weight × value, over the
            enabled terms. Gradient norms are `None` unless `grad_norms`.
        """
        if base_loss is not None and not callable(base_loss):
            if isinstance(base_loss, (str, bytes, bool)) or not (
                isinstance(base_loss, (int, float, np.number)) or hasattr(base_loss, "shape")
            ):
                raise TypeError(f"`base_loss` must be None, a scalar or a callable of `inputs`; got {base_loss!r}.")
        grad_norms = num.boolean("grad_norms", grad_norms)
        total, values = self.compute(inputs)
        weights = ops.convert_to_numpy(self.current_weights())
        base = base_loss(inputs) if callable(base_loss) else base_loss
        base_value = None if base is None else float(ops.convert_to_numpy(base))
        norms = gradients.gradient_norms(self, inputs, base_loss=base_loss if callable(base_loss) else None) if grad_norms else {}
        metrics = dict(zip(self.metric_keys, (float(ops.convert_to_numpy(v)) for v in self._metric_values(as_float32(inputs)))))
        regularizers = {}
        for i, name in enumerate(self.terms):
            if name not in values:
                continue
            value, weight = float(ops.convert_to_numpy(values[name])), float(weights[i])
            norm = norms.get(name)
            regularizers[name] = {
                "value": value,
                "weight": weight,
                "contribution": weight * value,
                "grad_norm": norm,
                "grad_norm_weighted": None if norm is None else weight * norm,
                "custom": {m: metrics[f"{name}/{m}"] for m in self.terms[name].metrics},
            }
        regularizer_total = float(ops.convert_to_numpy(total))
        return {
            "loss_total": regularizer_total + (base_value or 0.0),
            "regularizer_total": regularizer_total,
            "base_loss": {"value": base_value, "grad_norm": norms.get("base_loss")},
            "regularizers": regularizers,
            "total_grad_norm": norms.get("total"),
        }

    def get_config(self):
        return with_hint(
            {**super().get_config(), "terms": serialize_terms(self.terms), "weighting": self.weighting}
        )

    @classmethod
    def from_config(cls, config):
        config = without_hint(config)
        return cls(**{**config, "terms": deserialize_terms(config["terms"])})
