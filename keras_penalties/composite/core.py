"""What both composites share: their terms, the variables of their weights
(numbers, schedules, enabled flags, the weighting rule's), setting them
(`set_weight`, `set_term_weights`, `enable`, `disable`), the weights in use
and the weighted total of the terms' values."""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import _keras_internals, backend
from keras_penalties import _validation as check
from keras_penalties.composite import weighting as rules
from keras_penalties.composite.weighting import is_schedule
from keras_penalties._types import Tensor
from keras_penalties.composite.state import state_variable
from keras_penalties.composite.term import build_terms, serialize_terms


def make_weight_variables(owner, terms, rule, overridable=False):
    """The variables of a composite's weights, made on `owner` (a layer: Keras
    tracks them there, trains the learned ones and saves them with it), in
    the caller's name scope, in the order saved files hold them: each
    term's weight (0 for a scheduled one: the schedule gives it) and
    enabled flag, the weighting rule's own, and with `overridable` 1 for
    each schedule `set_weight` replaced by a number."""
    owner.term_weights = state_variable("term_weights", [0.0 if t.scheduled else t.weight for t in terms.values()])
    owner.term_enabled = state_variable("term_enabled", [float(t.enabled) for t in terms.values()])
    rule.make_variables(owner, len(terms))
    owner.weight_overridden = None
    if overridable:
        owner.weight_overridden = state_variable("weight_overridden", np.zeros(len(terms)))


class Composite:
    """What `CompositeObjective` and `CompositeLoss` share: their terms, their
    weights (`set_weight`, `enable`, `disable`, the weights in use, the
    weighted total) and the keys they report.

    A subclass calls `_set_terms` first, then makes its weight variables
    (`make_weight_variables`) on the layer `_state_layer` gives, its
    `state.RunningSums` as `_running` and, where weights may be schedules,
    its `step`."""

    step = None  # a CompositeObjective's training-step count
    # What the subclass provides, declared for type checkers (the Keras base
    # classes they also derive from have no types).
    name: str
    weighting: rules.Weighting  # the weighting rule
    _running: Any  # the composite's state.RunningSums

    def _state_layer(self) -> Any:
        """The layer holding the composite's variables (the objective itself,
        a loss's `LossState`): a method, since Keras' saving walks a layer's
        attributes and would walk into the objective from itself."""
        raise NotImplementedError

    def _composite_config(self):
        """The config entries both composites share (the rule as Keras
        serializes an object)."""
        return {
            "terms": serialize_terms(self.terms),
            "weighting": keras.saving.serialize_keras_object(self.weighting),
        }

    def _set_terms(self, terms, weights, weighting):
        self.terms = build_terms(terms, weights)
        # The rule (`rules.get`'s), resolved once: every use below asks it.
        self.weighting = weighting
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

    def _refuse_learned(self, what):
        if self.weighting.learned:
            raise ValueError(
                f"{what}: {self.name!r} has weighting={self.weighting!r}, which learns its "
                "weights; build it without `weighting` to set them."
            )

    def set_weight(self, name: str, weight: float) -> None:
        """Sets a term's weight to a number from the next step on, without retracing.

        A number replaces the term's schedule, if it had one. Schedules are part
        of the traced step and are set at construction. Inside `fit`, call it
        from a callback; on JAX reach the objective through the callback's
        `self.model` first (e.g. `self.model.get_layer(...)`), which syncs
        Keras' training state, as for any variable changed by a callback. With
        learned weights (a rule that learns them: `Uncertainty`, `FAMO`): a `ValueError`.
        """
        index = self._index(name)
        self._refuse_learned("set_weight")
        if is_schedule(weight):
            raise TypeError(
                f"set_weight takes a number; term {name!r} got a schedule. Schedules are "
                "traced into the training step, so give them when building the objective."
            )
        weight = check.non_negative("weight", weight)
        state = self._state_layer()
        self._assign_entry(state.term_weights, index, weight)
        if self._scheduled[index]:
            self._assign_entry(state.weight_overridden, index, 1.0)
        self.terms[name].weight = weight

    def set_term_weights(self, weights: Any) -> None:
        """Sets every term's weight at once from the next step on, as
        `set_weight` would set each, in one assignment per variable: the way
        a callback that adapts the weights sets them (`DynamicWeightAverage`
        and `GradNorm` do). `weights`: numbers ≥ 0 in `terms` order, or a
        dict term name → number covering every term. Call it from a
        callback as `set_weight`; with learned weights, a `ValueError`.

        Example:

        >>> from keras_penalties import CompositeObjective
        >>> objective = CompositeObjective({"l1": "l1", "l2": "l2"})
        >>> objective.set_term_weights({"l1": 0.5, "l2": 2.0})
        >>> objective.weights_in_use()
        {'l1': 0.5, 'l2': 2.0}
        """
        self._refuse_learned("set_term_weights")
        if isinstance(weights, dict):
            if set(weights) != set(self.terms):
                raise ValueError(f"`weights` must name every term {list(self.terms)}; got {list(weights)}.")
            weights = [weights[name] for name in self.terms]
        weights = np.asarray(weights, "float32")
        if weights.shape != (len(self.terms),) or not np.all(weights >= 0) or not np.all(np.isfinite(weights)):
            raise ValueError(f"`weights`: expected {len(self.terms)} finite numbers >= 0; got {weights.tolist()}.")
        state = self._state_layer()
        state.term_weights.assign(weights)
        if self._scheduled.any():  # every schedule replaced by its number
            state.weight_overridden.assign(self._scheduled.astype("float32"))
        for term, weight in zip(self.terms.values(), weights.tolist()):
            term.weight = weight

    def enable(self, name: str) -> None:
        """Counts the term in the total from the next step on."""
        self._assign_entry(self._state_layer().term_enabled, self._index(name), 1.0)
        self.terms[name].enabled = True

    def disable(self, name: str) -> None:
        """Leaves the term out of the total from the next step on; its value is
        still computed and reported."""
        self._assign_entry(self._state_layer().term_enabled, self._index(name), 0.0)
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

    def _model_across_replicas(self):
        """The model whose add_loss lists a cross-replica sum must keep as
        they were (see `backend.sum_over_replicas`); the composites say
        which."""
        return None

    def _weights_at(self, step):
        return self.weighting.weights(self._state_layer(), lambda: self._set_weights_at(step))

    def _set_weights_at(self, step):
        """The weights as set: numbers, and schedules at `step` unless
        `set_weight` replaced them."""
        state = self._state_layer()
        if not self._scheduled.any():
            return state.term_weights.value
        scheduled = ops.stack(
            [
                ops.zeros((), "float32") if schedule is None else ops.cast(schedule(step), "float32")
                for schedule in self._schedules
            ]
        )
        use_schedule = ops.logical_and(ops.convert_to_tensor(self._scheduled), state.weight_overridden.value < 0.5)
        return ops.where(use_schedule, scheduled, state.term_weights.value)

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
        return self.current_weights() * self._state_layer().term_enabled.value

    def _total(self, values, weights=None, update=False):
        """The weighting rule's total of `values` over the enabled terms
        (`weights`: the current ones by default); with `update` (once per
        training step) the rule's state advances."""
        if weights is None:
            weights = self.current_weights()
        state, model = self._state_layer(), self._model_across_replicas()
        if backend.gradients_in_sync() == 1:
            return self.weighting.total(state, values, weights, state.term_enabled.value, update, model)
        # Several tf.distribute replicas (threads of one process): a rule's
        # cross-replica sum or assignment switches replica threads, whose
        # forward passes share the model's add_loss lists; they are kept.
        with _keras_internals.added_losses_kept(model):
            return self.weighting.total(state, values, weights, state.term_enabled.value, update, model)
