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
"""

import re

import keras
import numpy as np
from keras import ops

from keras_penalties import _capture, gradients
from keras_penalties import ops as penalties
from keras_penalties.ops import _numerics as num

_METRIC_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_OPS = {name: getattr(penalties, name) for name in penalties.__all__}
_TRAIN, _EVAL = 0, 1


def _is_schedule(weight):
    return isinstance(weight, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(weight) and not isinstance(weight, (int, float, np.number))
    )


def check_weight(name, weight):
    """A term weight: a number ≥ 0 and finite, or a schedule of the step."""
    return weight if _is_schedule(weight) else num.non_negative(name, weight)


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
            functions.

    A Regularizer term contributes what it would as an `activity_regularizer=`
    (Keras divides it by the batch size).

    Example:

    >>> from keras_penalties import Term
    >>> Term("entropy", 0.1, options={"from_logits": True}).get_config()["penalty"]
    'entropy'
    """

    def __init__(self, penalty, weight=1.0, inputs=None, enabled=True, options=None):
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"`options` must be a dict or None; got {options!r}.")
        options = dict(options or {})
        if isinstance(penalty, str):
            if penalty not in _OPS:
                raise ValueError(
                    f"`penalty` must name a keras_penalties.ops function, one of "
                    f"{sorted(_OPS)}; got {penalty!r}."
                )
            penalty = _OPS[penalty]
        if any(penalty is fn for fn in _OPS.values()):
            self.kind = "op"
            options = penalty.check_options(**options)
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
        if isinstance(inputs, (str, int)):
            inputs = (inputs,)
        if inputs is not None:
            inputs = tuple(inputs)
            if not inputs or not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in inputs):
                raise ValueError(
                    f"`inputs` must be None or a non-empty sequence of names or positions; got {inputs!r}."
                )
        self.inputs = inputs
        self.enabled = num.boolean("enabled", enabled)

    @property
    def scheduled(self):
        return _is_schedule(self.weight)

    def copy(self):
        return Term(self.penalty, self.weight, self.inputs, self.enabled, self.options)

    def __call__(self, *tensors):
        """The unweighted value of the penalty on `tensors`."""
        if self.kind in ("op", "callable"):
            return self.penalty(*tensors, **self.options)
        if self.kind == "regularizer":
            if len(tensors) != 1:
                raise ValueError(f"a Regularizer takes one tensor; got {len(tensors)}.")
            (x,) = tensors
            value = self.penalty(x)
            if len(x.shape) > 0:
                value = value / ops.cast(ops.shape(x)[0], value.dtype)
            return value
        if len(tensors) == 2:
            return self.penalty(*tensors)
        from keras_penalties.losses import Entropy  # here: losses imports this module

        if len(tensors) == 1 and isinstance(self.penalty, Entropy):
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
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("penalty", "weight"):
            if isinstance(config[key], dict):
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)

    def __repr__(self):
        name = self.penalty.__name__ if self.kind == "op" else type(self.penalty).__name__
        return f"Term({name!r}, weight={self.weight!r}, inputs={self.inputs!r}, enabled={self.enabled})"


def build_terms(terms, weights=None):
    """Validates `terms` (dict name → Term or penalty) and `weights`; returns
    a dict name → Term, each error naming the offending term."""
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
        if not _METRIC_NAME.match(name):
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
    if len(value.shape) != 0:
        raise ValueError(
            f"Term {name!r} must return a scalar; it returned shape {tuple(value.shape)}. "
            "Use a reduction such as reduction='mean'."
        )
    return ops.cast(value, "float32")


@keras.saving.register_keras_serializable(package="keras_penalties")
class CompositeObjective(keras.layers.Layer):
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

    Example:

    >>> import numpy as np
    >>> from keras_penalties import CompositeObjective, Term
    >>> objective = CompositeObjective(
    ...     {"l1": "l1", "entropy": Term("entropy", 0.5, options={"from_logits": True})})
    >>> total, values = objective.compute(np.zeros((2, 4), "float32"))
    >>> round(float(total), 4), round(float(values["entropy"]), 4)  # 0 + 0.5·ln 4
    (0.6931, 1.3863)
    """

    def __init__(self, terms, weights=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.terms = build_terms(terms, weights)
        self.supports_masking = True
        n = len(self.terms)
        # Fixed for the life of the layer: the traced step evaluates these.
        self._schedules = [t.weight if t.scheduled else None for t in self.terms.values()]
        self._scheduled = np.array([s is not None for s in self._schedules])

        def state(name, shape, values, dtype="float32"):
            variable = self.add_weight(
                shape=shape, initializer="zeros", trainable=False, dtype=dtype, name=name
            )
            variable.assign(np.asarray(values, dtype=dtype))
            return variable

        self.term_weights = state(
            "term_weights", (n,), [0.0 if t.scheduled else t.weight for t in self.terms.values()]
        )
        self.term_enabled = state("term_enabled", (n,), [float(t.enabled) for t in self.terms.values()])
        # 1 where set_weight replaced a schedule by a number.
        self.weight_overridden = state("weight_overridden", (n,), np.zeros(n))
        self.step = state("step", (), 0, dtype="int32")
        # Running sums of each term's unweighted value, and batch counts; row
        # 0 for training calls, row 1 for the others (evaluate, predict).
        self.value_sums = state("value_sums", (2, n), np.zeros((2, n)))
        self.value_counts = state("value_counts", (2,), np.zeros(2))

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
            missing = [k for k in term.inputs if k not in inputs]
            if missing:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(term.inputs)}, but {missing} "
                    f"{'is' if len(missing) == 1 else 'are'} not among the fed inputs {sorted(inputs)}."
                )
            return tuple(inputs[k] for k in term.inputs)
        if isinstance(inputs, (list, tuple)):
            bad = [k for k in term.inputs if not isinstance(k, int) or not -len(inputs) <= k < len(inputs)]
            if bad:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(term.inputs)}, but the objective was fed a "
                    f"list of {len(inputs)} tensors; list inputs are chosen by position."
                )
            return tuple(inputs[k] for k in term.inputs)
        raise ValueError(
            f"Term {name!r} takes inputs {list(term.inputs)}, but the objective was fed a single "
            "tensor; feed a dict (or list) holding them."
        )

    def term_value(self, name, inputs):
        """One term's unweighted float32 scalar on `inputs`."""
        term = self.terms[name]
        return scalar(name, term(*self._arguments(name, term, inputs)))

    def _values(self, inputs):
        """Each term's unweighted value, in term order, stacked."""
        return ops.stack([self.term_value(name, inputs) for name in self.terms])

    def current_weights(self):
        """The weight vector used by the next step: schedules at the current step
        (unless `set_weight` replaced them), numbers as set."""
        if not self._scheduled.any():
            return self.term_weights.value
        scheduled = ops.stack(
            [
                ops.zeros((), "float32") if schedule is None else ops.cast(schedule(self.step.value), "float32")
                for schedule in self._schedules
            ]
        )
        use_schedule = ops.logical_and(
            ops.convert_to_tensor(self._scheduled), self.weight_overridden.value < 0.5
        )
        return ops.where(use_schedule, scheduled, self.term_weights.value)

    def effective_weights(self):
        """What each term's value is multiplied by in the total: its current
        weight, or 0 while disabled."""
        return self.current_weights() * self.term_enabled.value

    def _total(self, values):
        return ops.sum(values * self.effective_weights())

    def call(self, inputs, training=None):
        values = self._values(inputs)
        _capture.record(self, values)
        self.add_loss(self._total(values))
        row = np.zeros((2, 1), "float32")
        row[_EVAL if not training else _TRAIN] = 1.0
        row = ops.convert_to_tensor(row)
        self.value_sums.assign(self.value_sums.value + row * values[None, :])
        self.value_counts.assign(self.value_counts.value + row[:, 0])
        if training:
            self.step.assign(self.step.value + 1)
        return inputs

    def compute_output_spec(self, inputs, training=None):
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
        values = self._values(inputs)
        total = self._total(values)
        return total, {name: values[i] for i, (name, t) in enumerate(self.terms.items()) if t.enabled}

    # ------------------------------------------------------------ control

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
        from a callback; on JAX reach the layer through the callback's
        `self.model` (e.g. `self.model.get_layer(...)`), which syncs Keras'
        training state first, as for any variable changed by a callback.
        """
        index = self._index(name)
        if _is_schedule(weight):
            raise TypeError(
                f"set_weight takes a number; term {name!r} got a schedule. Schedules are "
                "traced into the training step, so give them when building the objective."
            )
        weight = num.non_negative("weight", weight)
        self._assign_entry(self.term_weights, index, weight)
        if self._scheduled[index]:
            self._assign_entry(self.weight_overridden, index, 1.0)
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

    # ------------------------------------------------------------ reporting

    def running_values(self, training=True):
        """Mean unweighted value of each term since the last reset, as floats
        (the numbers PenaltyMonitor logs); empty before the first call."""
        row = _TRAIN if training else _EVAL
        count = float(ops.convert_to_numpy(self.value_counts)[row])
        if count == 0:
            return {}
        sums = ops.convert_to_numpy(self.value_sums)[row]
        return {name: float(sums[i] / count) for i, name in enumerate(self.terms)}

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
            "contribution", "grad_norm", "grad_norm_weighted"}},
            "total_grad_norm"}`, contribution = weight × value, over the
            enabled terms. Gradient norms are `None` unless `grad_norms`.
        """
        total, values = self.compute(inputs)
        weights = ops.convert_to_numpy(self.current_weights())
        base = base_loss(inputs) if callable(base_loss) else base_loss
        base_value = None if base is None else float(ops.convert_to_numpy(base))
        norms = gradients.gradient_norms(self, inputs, base_loss=base_loss if callable(base_loss) else None) if grad_norms else {}
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
        return {**super().get_config(), "terms": serialize_terms(self.terms)}

    @classmethod
    def from_config(cls, config):
        return cls(**{**config, "terms": deserialize_terms(config["terms"])})
