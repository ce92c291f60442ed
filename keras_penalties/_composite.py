"""What both composites share: the weight state (weights, enabled flags,
schedules, learned weights) with `set_weight`/`enable`/`disable`, and the
weighted total of the terms' values."""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import _keras_internals, _replicas, backend
from keras_penalties import _validation as check
from keras_penalties._weighting import (
    FAMO_DEFAULTS,
    FAMO_EPSILON,
    check_famo,
    check_multiplier,
    check_weighting,
    famo_coefficients,
    famo_step,
    is_schedule,
    scaled_gradient,
    uncertainty_weights,
)
from keras_penalties._types import Tensor
from keras_penalties.terms import build_terms, serialize_terms


def state_variable(name, values, dtype="float32", trainable=False, aggregation="only_first_replica", local=False):
    """A composite's state as a variable, float32 (or `dtype`) and never
    autocast: under a mixed policy a weight of 1e5 would read inf and a step
    count would stall at 2049. Under a tf.distribute strategy, weights are the
    same on every replica (set from callbacks); `local` state (the step, the
    running values) is each replica's own ("on_read": no cross-replica sync
    inside the forward pass) and reads by `aggregation`."""
    values = np.asarray(values, dtype=dtype)
    return keras.Variable(
        initializer=values,
        shape=values.shape,
        dtype=dtype,
        trainable=trainable,
        autocast=False,
        aggregation=aggregation,
        synchronization="on_read" if local else "auto",
        name=name,
    )


class WeightState:
    """The variables of a composite's weights, made on `owner` (a layer: Keras
    tracks them there, trains the learned ones and saves them with it), in
    the caller's name scope: each term's weight (0 for a scheduled one: the
    schedule gives it) and enabled flag; with `weighting="uncertainty"` the
    trainable log-variances sᵢ (initially 0, trained by the model's
    optimizer); with `weighting="famo"` FAMO's logits ξ (initially 0), their
    Adam moments, the previous step's log-losses, the count of training
    steps and the latest effective weights (1 before the first step); with
    `overridable`, 1 for each schedule `set_weight` replaced by a number."""

    def __init__(self, owner, terms, weighting, overridable=False):
        n = len(terms)
        owner.term_weights = state_variable("term_weights", [0.0 if t.scheduled else t.weight for t in terms.values()])
        owner.term_enabled = state_variable("term_enabled", [float(t.enabled) for t in terms.values()])
        owner.log_variances = None
        if weighting == "uncertainty":
            owner.log_variances = state_variable("log_variances", np.zeros(n), trainable=True, aggregation="mean")
        self.term_weights, self.term_enabled, self.log_variances = (
            owner.term_weights,
            owner.term_enabled,
            owner.log_variances,
        )
        if weighting == "famo":
            owner.famo_logits = state_variable("famo_logits", np.zeros(n))
            owner.famo_moments = state_variable("famo_moments", np.zeros((2, n)))
            owner.famo_previous = state_variable("famo_previous", np.zeros(n))
            owner.famo_steps = state_variable("famo_steps", 0.0)
            owner.famo_last_weights = state_variable("famo_last_weights", np.ones(n))
            self.famo_logits, self.famo_moments, self.famo_previous = (
                owner.famo_logits,
                owner.famo_moments,
                owner.famo_previous,
            )
            self.famo_steps, self.famo_last_weights = owner.famo_steps, owner.famo_last_weights
        self.weight_overridden = None
        if overridable:
            owner.weight_overridden = state_variable("weight_overridden", np.zeros(n))
            self.weight_overridden = owner.weight_overridden


class Composite:
    """What `CompositeObjective` and `CompositeLoss` share: their terms, their
    weights (`set_weight`, `enable`, `disable`, the weights in use, the
    weighted total) and the keys they report.

    A subclass calls `_set_terms` first, then makes its `WeightState` as
    `_weight_state`, its `_term_means.RunningSums` as `_running` and, where
    weights may be schedules, its `step`."""

    step = None  # a CompositeObjective's training-step count
    # What the subclass provides, declared for type checkers (the Keras base
    # classes they also derive from have no types).
    name: str
    _weight_state: WeightState
    _running: Any  # the composite's _term_means.RunningSums

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
        weight = check.non_negative("weight", weight)
        self._assign_entry(self._weight_state.term_weights, index, weight)
        if self._scheduled[index]:
            self._assign_entry(self._weight_state.weight_overridden, index, 1.0)
        self.terms[name].weight = weight

    def _set_weights(self, weights):
        """Every term's weight at once, as `set_weight` would set each (one
        assignment per variable): the adaptive callbacks' path, called
        with numbers ≥ 0 in `terms` order."""
        if self.weighting is not None:
            raise ValueError(f"{self.name!r} has weighting={self.weighting!r}, which learns its weights.")
        weights = np.asarray(weights, "float32")
        if weights.shape != (len(self.terms),) or not np.all(weights >= 0) or not np.all(np.isfinite(weights)):
            raise ValueError(f"Expected {len(self.terms)} finite weights >= 0; got {weights.tolist()}.")
        self._assign_weights(weights)
        self._note_weights(weights)

    def _assign_weights(self, weights, when=None):
        """`_set_weights`' assignments, unchecked (a float32 vector; traceable:
        GradNorm's probe makes them in its compiled call, then `_note_weights`);
        with `when`, a boolean scalar tensor, only if it is true (else every
        variable keeps its value)."""
        state = self._weight_state
        assignments = [(state.term_weights, weights)]
        if self._scheduled.any():  # every schedule replaced by its number
            assignments.append((state.weight_overridden, self._scheduled.astype("float32")))
        for variable, value in assignments:
            variable.assign(value if when is None else ops.where(when, value, variable.value))

    def _note_weights(self, weights):
        """Each Term's `weight` set to its number in `weights` (NumPy), as the variables hold them."""
        for term, weight in zip(self.terms.values(), np.asarray(weights, "float32").tolist()):
            term.weight = weight

    def enable(self, name: str) -> None:
        """Counts the term in the total from the next step on."""
        self._assign_entry(self._weight_state.term_enabled, self._index(name), 1.0)
        self.terms[name].enabled = True

    def disable(self, name: str) -> None:
        """Leaves the term out of the total from the next step on; its value is
        still computed and reported."""
        self._assign_entry(self._weight_state.term_enabled, self._index(name), 0.0)
        self.terms[name].enabled = False

    def running_means(self) -> Tensor:
        """Each reported key's mean since the running values were last reset,
        a float32 tensor in `reported_keys` order, computed where it is
        called (inside a compiled step too): the training calls' means if
        there were any, else the others' (evaluate); 0 before any call."""
        return self._running.means()

    def running_values(self, training: bool = True) -> dict[str, float]:
        """Mean unweighted value of each term (and of each custom metric, as
        `"<term>/<metric>"`) over the training calls (`training=True`) or
        the others since the last reset, as floats; empty before the first
        call."""
        return self._running.values(self.reported_keys, training)

    def reset_running_values(self, training: bool | None = True) -> None:
        """Zeroes the running values of training calls (`training=True`),
        of the others (False), or of both (None)."""
        self._running.reset(training)

    def _learned_log_variances(self):
        """The sᵢ as the total reads them: their gradient scaled by
        `weighting_learning_rate_multiplier`."""
        return scaled_gradient(self._weight_state.log_variances.value, self.weighting_learning_rate_multiplier)

    def _no_weight_decay_on_log_variances(self, model):
        """Keeps `model`'s optimizer (the model training the composite) from
        decaying the sᵢ: decay would pull every weight ½·exp(−sᵢ) towards ½.
        Called where the composite is computed, before the optimizer's step
        is traced or run."""
        if self._weight_state.log_variances is not None and getattr(model, "optimizer", None) is not None:
            _keras_internals.exclude_from_weight_decay(model.optimizer, [self._weight_state.log_variances])

    def _famo(self, values, update):
        """FAMO's total Σ cᵢzᵢ·log Dᵢ over the enabled terms for this step's
        unweighted `values` (Dᵢ = max(Lᵢ, 0) + ε: Lᵢ,min is 0); with `update`
        (once per training step) the logits first move by the change of the
        log-losses since the previous training step, and the state advances.
        Under several tf.distribute replicas its cross-replica sum and its
        state's assignments switch replica threads: the model's add_loss
        lists are kept as they were around them."""
        if _replicas.in_sync() == 1:
            return self._famo_total(values, update)
        with _keras_internals.added_losses_kept(self._model_across_replicas()):
            return self._famo_total(values, update)

    def _famo_total(self, values, update):
        state, math = self._weight_state, backend.SMALL_OPS
        frozen = math.stop_gradient(values)
        # Each replica's values have the whole batch's as their mean.
        (values_in_sync,) = _replicas.mean_in_sync([frozen])
        log_losses = math.log(math.relu(values_in_sync) + FAMO_EPSILON)
        logits = state.famo_logits.value
        if update:
            steps = state.famo_steps.value
            # Operators, not `keras.ops` calls (5 µs each on eager torch):
            # 0⁰ = 1, so `first` is 1 at the first step and 0 after. δ is 0
            # at the first step (no previous step to compare with); with ξ
            # still 0 there, Adam's step is 0 and its moments stay 0 (a
            # non-finite first value makes ξ NaN a step sooner than before).
            first = 0.0**steps
            logits, moments = famo_step(
                logits,
                state.famo_moments.value,
                steps + first,
                (state.famo_previous.value - log_losses) * (1.0 - first),
                self.famo_learning_rate,
                self.famo_gamma,
                math,
            )
        inverse_losses = math.exp(-log_losses)
        coefficients = famo_coefficients(logits, inverse_losses, math)
        weights = coefficients * inverse_losses
        if update:
            backend.assign_all(
                [
                    (state.famo_logits, logits),
                    (state.famo_moments, moments),
                    (state.famo_previous, log_losses),
                    (state.famo_steps, steps + 1.0),
                    (state.famo_last_weights, weights),
                ]
            )
        # The value is the whole batch's; the gradient is Σ wᵢ·∇Lᵢ of this
        # replica's own values, which Keras adds up to the whole batch's.
        own = values - frozen
        return math.sum((coefficients * log_losses + weights * own) * state.term_enabled.value)

    def _model_across_replicas(self):
        """The model whose add_loss lists a cross-replica sum must keep as
        they were (see `backend.sum_over_replicas`); the composites say
        which."""
        return None

    def _weights_at(self, step):
        if self.weighting == "famo":
            return self._weight_state.famo_last_weights.value
        if self._weight_state.log_variances is not None:
            return uncertainty_weights(self._learned_log_variances())
        if not self._scheduled.any():
            return self._weight_state.term_weights.value
        scheduled = ops.stack(
            [
                ops.zeros((), "float32") if schedule is None else ops.cast(schedule(step), "float32")
                for schedule in self._schedules
            ]
        )
        use_schedule = ops.logical_and(
            ops.convert_to_tensor(self._scheduled), self._weight_state.weight_overridden.value < 0.5
        )
        return ops.where(use_schedule, scheduled, self._weight_state.term_weights.value)

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
        return self.current_weights() * self._weight_state.term_enabled.value

    def _total(self, values, weights=None, update=False):
        """Σ wᵢ·valueᵢ over the enabled terms (`weights`: the current ones by
        default), plus Σ ½·sᵢ over them under uncertainty weighting; under
        FAMO Σ cᵢzᵢ·log Dᵢ (see `_famo`; the state advances with `update`)."""
        if self.weighting == "famo":
            return self._famo(values, update)
        if weights is None:
            weights = self.current_weights()
        total = backend.reduce_sum(values * weights * self._weight_state.term_enabled.value)
        if self._weight_state.log_variances is not None:
            total = total + 0.5 * ops.sum(self._learned_log_variances() * self._weight_state.term_enabled.value)
        return total
