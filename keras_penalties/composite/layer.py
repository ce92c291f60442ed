"""`CompositeObjective`: a pass-through layer that `add_loss`es Σ wᵢ·termᵢ
of the tensors flowing through it, and keeps each term's running value.
Its weights and weighted total are `composite.core.Composite`'s, shared with
`CompositeLoss`.

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

import types
import weakref
from typing import Any, Callable

import keras
import numpy as np
from keras import ops

from keras_penalties.composite import capture
from keras_penalties import _keras_internals, backend, gradients
from keras_penalties._saving import with_hint, without_hint
from keras_penalties._types import Penalty, Tensor, TensorLike, Weight, Weighting
from keras_penalties import _validation as check
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops._dtypes import as_float32
from keras_penalties.composite import weighting as rules
from keras_penalties.composite.core import Composite, make_weight_variables
from keras_penalties.composite.state import state_variable
from keras_penalties._replicas import whole_batch_values
from keras_penalties.composite.state import RunningSums
from keras_penalties.composite.term import Term, deserialize_terms


# The package name where 0.1.0 registered it: saved files name it so.
@keras.saving.register_keras_serializable(package="keras_penalties")
class CompositeObjective(Composite, keras.layers.Layer):
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
        weighting: how the terms are weighted: a rule of
            `keras_penalties.composite.weighting` (`Fixed()`, the default,
            each term weighs what it was given; `Uncertainty(...)`, learned
            log-variances; `FAMO(...)`, FAMO's logits; or a `Weighting` of
            your own), its name (`"fixed"`, `"uncertainty"`, `"famo"`) or
            its config dict. The rule's docstring says what it does and
            takes; the composite keeps it as its `weighting` attribute.
        **kwargs: as for any `keras.layers.Layer`, and a rule's options in
            0.1.0's flat form beside its name (see `weighting.from_arguments`).

    Example:

    >>> import numpy as np
    >>> from keras_penalties import CompositeObjective, Term
    >>> objective = CompositeObjective(
    ...     {"l1": "l1", "entropy": Term("entropy", 0.5, options={"from_logits": True})})
    >>> total, values = objective.compute(np.zeros((2, 4), "float32"))
    >>> round(float(total), 4), round(float(values["entropy"]), 4)  # 0 + 0.5·ln 4
    (0.6931, 1.3863)
    """

    def __init__(
        self,
        terms: dict[str, Term | Penalty],
        weights: dict[str, Weight] | None = None,
        name: str | None = None,
        weighting: Weighting = None,
        **kwargs: Any,
    ) -> None:
        rule = rules.from_arguments(weighting, kwargs)
        # A pass-through: inputs keep their dtype under a mixed policy.
        kwargs.setdefault("autocast", False)
        super().__init__(name=name, **kwargs)
        self._set_terms(terms, weights, rule)
        self.supports_masking = True
        # Per forward pass: the weights of its step, and the losses it added.
        self._passes: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        # The model training the objective, found at its first training call
        # (`_training_model`), weakly; in a plain holder, which Keras'
        # attribute tracking skips.
        # `home`: where the state variables were made (see `_made_where_used`).
        self._kept = types.SimpleNamespace(model=lambda: None, home=backend.variable_home())
        self._make_state()
        # Built with its state, as a layer without a `build` of its own is;
        # `build` (below) keeps Keras from locking the state, which
        # `_made_where_used` may make again.
        self.built = True

    def _make_state(self):
        with keras.name_scope(self.name, caller=self):
            make_weight_variables(self, self.terms, self.weighting, overridable=True)
            # Training steps taken: every replica advances it alike.
            self.step = state_variable("step", 0, dtype="int32", local=True)
            # Running sums of each term's unweighted value (then of its
            # custom metrics), and call counts.
            self._running = RunningSums(self, len(self.reported_keys))

    def build(self, input_shape: Any = None) -> None:
        """The state is made at construction (and, where the layer is used
        under a distribution it was not made in, again there: see
        `__call__`); a file's build config finds it built."""
        self._made_where_used()
        self.built = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._made_where_used()
        return super().__call__(*args, **kwargs)

    def _made_where_used(self) -> None:
        """Under a `tf.distribute` strategy's scope or a JAX distribution
        that the state was not made in (the objective constructed before
        it), the state made again there with the values it holds, as Keras
        makes a layer's weights where it builds them; on the package's host
        thread, since Keras' symbolic build is a stateless scope (a graph
        on TF). State is never moved out of a distribution."""
        home = backend.variable_home()
        if home is self._kept.home or home is None:
            return

        def make() -> None:
            names = [name for name, value in vars(self).items() if isinstance(value, keras.Variable)]
            values = {name: ops.convert_to_numpy(getattr(self, name)) for name in names}
            for name in names:
                delattr(self, name)  # Keras untracks a deleted variable
            with backend.made_at(home):
                self._make_state()
            for name in names:
                getattr(self, name).assign(values[name])

        backend.outside_distribution(make)
        self._kept.home = home

    def _state_layer(self) -> Any:
        return self

    # ------------------------------------------------------------ computation

    def term_value(self, name: str, inputs: Any) -> Tensor:
        """One term's unweighted float32 scalar on `inputs` (half-precision
        tensors are computed in float32)."""
        return self._term_value(name, as_float32(inputs))

    def _term_value(self, name, inputs):
        return self.terms[name].value(name, inputs)

    def _values(self, inputs):
        """Each term's unweighted value, in term order, stacked; `inputs`
        already as `as_float32` gives them."""
        return backend.stack([term.value(name, inputs) for name, term in self.terms.items()])

    def _metric_values(self, inputs):
        """Each term's custom metrics (`metric_keys` order), as a list of
        scalars; `inputs` already as `as_float32` gives them."""
        return [value for name, term in self.terms.items() for value in term.metric_values(name, inputs)]

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
                backend.increment(self.step)
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

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        floats = as_float32(inputs)  # half-precision activations, once per call
        # A masked mean over tokens is the global batch's under a strategy.
        global_means = reductions.global_token_means(_keras_internals.calling_layer())
        with num.sharing(keras.tree.flatten(floats)), global_means:
            values = self._values(floats)
            metric_values = self._metric_values(floats) if self.metric_keys else []
        capture.record(self, values)
        values = whole_batch_values(values, self._sums_over_samples)
        # In a jax.jit of the user's own (no stateless scope) the state
        # variables cannot take the trace's values: the call changes none.
        training = bool(training) and not backend.traced_outside_scope(values)
        state = self._pass(training)
        if training:
            self.weighting.before_step(self, self._training_model)
        # The rule's state (FAMO's) advances once per training step (at a
        # shared objective's first call of the step).
        update = training and not state["losses"]
        self._add_loss_of_pass(state, self._total(values, state["weights"], update=update))
        if metric_values:
            values = ops.concatenate([values, ops.stack(metric_values)])
        # Under a strategy each replica adds its own values; the variables
        # read as their mean, which is the whole batch's value.
        if not capture.active(self):  # a probe's pass, in a stateless scope, would keep nothing
            self._running.add(values, training)
        return inputs

    def _training_model(self):
        """The model training the objective (`_keras_internals.model_training`),
        found once and kept weakly."""
        model = self._kept.model()
        if model is None:
            model = _keras_internals.model_training()
            if model is not None:
                self._kept.model = weakref.ref(model)
        return model

    def _model_across_replicas(self):
        """The model whose forward pass this call is part of (whose add_loss
        lists a cross-replica sum must keep)."""
        return _keras_internals.calling_layer()

    def compute_output_spec(self, inputs: Any, training: bool | None = None) -> Any:
        # Check what each term reads now, when the model is built.
        for name, term in self.terms.items():
            term.arguments(name, inputs)
        # The same specs, as new tensors: returning the inputs themselves would
        # make the functional graph a cycle.
        return keras.tree.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype, sparse=t.sparse), inputs)

    def compute(self, inputs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """`(total, values)` for `inputs`, with no side effects.

        `total` is Σ wᵢ·termᵢ over enabled terms (a float32 scalar tensor) and
        `values` maps each enabled term to its unweighted scalar. Usable in a
        custom training loop, or on tensors received from elsewhere (e.g. a
        remote trainer's logprobs). Under a tf.distribute strategy, and in
        torch processes under DDP while gradients are recorded, a masked
        token mean is the global batch's (its count summed over the
        replicas) and a sum over samples counts at its whole weight: each
        replica's values average to the global batch's. In a custom loop
        with several replicas in one process, read `model.losses` before
        calling it.
        """
        floats = as_float32(inputs)
        global_means = reductions.global_token_means(_keras_internals.calling_layer())
        with num.sharing(keras.tree.flatten(floats)), global_means:
            values = self._values(floats)
        values = whole_batch_values(values, self._sums_over_samples)
        total = self._total(values)
        return total, {name: values[i] for i, (name, t) in enumerate(self.terms.items()) if t.enabled}

    def gradient_functions(
        self, base_loss: Callable[[Any], Tensor] | None = None
    ) -> dict[str, Callable[[Any], Tensor]]:
        """Scalar functions of the objective's inputs whose gradient norms
        `keras_penalties.gradients.gradient_norms` reports: each enabled
        term's unweighted value, `"base_loss"` (with `base_loss`) and
        `"total"`, Σ wᵢ·termᵢ over the enabled terms (plus `base_loss`)."""

        def term(name: str) -> Callable[[Any], Tensor]:
            return lambda x: self.term_value(name, x)

        functions = {name: term(name) for name, t in self.terms.items() if t.enabled}
        if base_loss is None:
            functions["total"] = lambda x: self.compute(x)[0]
        else:
            functions["base_loss"] = base_loss
            functions["total"] = lambda x: self.compute(x)[0] + base_loss(x)
        return functions

    # ------------------------------------------------------------ reporting

    def report(
        self, inputs: Any, *, base_loss: TensorLike | Callable[[Any], Tensor] | None = None, grad_norms: bool = False
    ) -> dict[str, Any]:
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
        grad_norms = check.boolean("grad_norms", grad_norms)
        # A report of the inputs given, in each process alone (no collective
        # that a process printing it alone would wait on).
        with backend.one_process():
            return self._report(inputs, base_loss, grad_norms)

    def _report(self, inputs, base_loss, grad_norms):
        total, values = self.compute(inputs)
        weights = ops.convert_to_numpy(self.current_weights())
        base = base_loss(inputs) if callable(base_loss) else base_loss
        base_value = None if base is None else float(ops.convert_to_numpy(base))
        functions = self.gradient_functions(base_loss if callable(base_loss) else None)
        norms = gradients.function_norms(functions, inputs) if grad_norms else {}
        metrics = dict(
            zip(self.metric_keys, (float(ops.convert_to_numpy(v)) for v in self._metric_values(as_float32(inputs))))
        )
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

    def get_config(self) -> dict[str, Any]:
        return with_hint({**super().get_config(), **self._composite_config()})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompositeObjective":
        config = without_hint(config)
        return cls(**{**config, "terms": deserialize_terms(config["terms"])})
