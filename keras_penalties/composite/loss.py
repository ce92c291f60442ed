"""`CompositeLoss`, a weighted sum of named losses for `model.compile`, and
`LossState`, the layer that carries its variables into the model that
compiles it."""

import weakref
from typing import Any

import keras
from keras import ops

from keras_penalties import _keras_internals, _replicas, backend
from keras_penalties import _validation as check
from keras_penalties._replicas import whole_batch_values
from keras_penalties._saving import with_hint, without_hint
from keras_penalties._types import DType, Penalty, Tensor, TensorLike, Weighting
from keras_penalties.composite import capture
from keras_penalties.ops._dtypes import as_float32
from keras_penalties.composite import weighting as rules
from keras_penalties.composite.core import Composite, make_weight_variables
from keras_penalties.composite.state import RunningSums
from keras_penalties.composite.term import Term, deserialize_terms
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions


class LossState(keras.layers.Layer):
    """The variables of a `CompositeLoss`: its term weights and enabled flags
    (float32, never autocast), the weighting rule's own (`Uncertainty`'s
    trainable log-variances, `FAMO`'s state); and the running sums of its term values. Keras gives a loss no model, so
    the loss adds this layer to the model that compiles it (see
    `CompositeLoss.attach`); its variables then travel in the model's
    training state like a layer's, and `.keras` files save the weights'
    with the loss (the running sums are a run's, not saved)."""

    def __init__(self, terms: dict[str, Term], rule: Any, name: str, reported: int) -> None:
        super().__init__(name=name, trainable=True, autocast=False)
        make_weight_variables(self, terms, rule)
        self.running_sums = RunningSums(self, reported)
        self.built = True

    def call(self, inputs: Any) -> Any:
        return inputs

    def _saved(self) -> list[Any]:
        running = self.running_sums.variables
        return [v for v in self.trainable_weights + self.non_trainable_weights if all(v is not r for r in running)]

    def save_own_variables(self, store: Any) -> None:
        for i, variable in enumerate(self._saved()):
            store[f"{i}"] = variable

    def load_own_variables(self, store: Any) -> None:
        saved = self._saved()
        if len(store.keys()) != len(saved):
            raise ValueError(
                f"Layer '{self.name}' expected {len(saved)} variables, but received {len(store.keys())} "
                "variables during loading."
            )
        for i, variable in enumerate(saved):
            variable.assign(store[f"{i}"])


# The package name where 0.1.0 registered it: saved files name it so.
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
        weighting: how the terms are weighted: a rule of
            `keras_penalties.composite.weighting`, its name or its config
            dict (see `CompositeObjective`); a rule that steps its state
            (`FAMO`) steps at `fit`'s training steps only, not in
            `evaluate`.
        name, dtype: as for any `keras.losses.Loss`.
        **options: a rule's options in 0.1.0's flat form beside its name
            (see `weighting.from_arguments`).

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
        **options: float,
    ) -> None:
        rule = rules.from_arguments(weighting, options)
        if options:
            raise TypeError(f"CompositeLoss got unexpected keyword arguments: {', '.join(sorted(options))}.")
        super().__init__(name=name, dtype=dtype)
        self._set_terms(terms, weights, rule)
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
        model = _keras_internals.model_compiling_from_file()
        if model is not None:
            self.attach(model)

    def _use_state(self, state: LossState) -> None:
        self.state = state
        self._running = state.running_sums

    def _state_made_at(self, home: Any) -> None:
        """The state made again at `home` (where the model holding it keeps
        its variables) with the values it holds, if it was made elsewhere:
        a loss constructed outside a `tf.distribute` strategy's scope, or
        before a JAX distribution was set, and compiled inside it."""
        if home is self._home or home is None:  # never moved out of a distribution
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

    def _state_layer(self) -> Any:
        return self.state

    @property
    def term_weights(self) -> keras.Variable:
        return self.state.term_weights

    @property
    def term_enabled(self) -> keras.Variable:
        return self.state.term_enabled

    @property
    def log_variances(self) -> keras.Variable | None:
        """The `Uncertainty` rule's trainable sᵢ (None under other rules)."""
        return getattr(self.state, "log_variances", None)

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
        # Keras tells a loss nothing of training: in `fit`, a rule's state
        # (FAMO's) advances where the model's train_step computes the loss.
        training = self.weighting.steps_in_training and _keras_internals.in_train_step()
        return self._computed(y_true, y_pred, sample_weight, training)[0]

    def compute(
        self, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None = None, *, training: bool = False
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(total, values)`: the loss as calling it gives, and each enabled
        term's unweighted value, for a custom training loop.

        With `training=True` the call is a training step's: a rule that
        steps in training (`FAMO`) advances its state, as at each training
        step of `fit` (call it so once per step, inside the gradient tape).
        """
        total, values = self._computed(y_true, y_pred, sample_weight, check.boolean("training", training))
        return total, {name: values[i] for i, (name, t) in enumerate(self.terms.items()) if t.enabled}

    def _computed(
        self, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None, training: bool
    ) -> tuple[Tensor, Tensor]:
        if not self._attached:
            model = _keras_internals.model_computing(self)
            if model is not None:
                self.attach(model)
        self.weighting.before_step(self.state, self._model)
        tensors = [t for t in (y_true, y_pred) if ops.is_tensor(t)]
        with num.sharing(tensors), reductions.global_token_means(self._model_across_replicas()):
            values = backend.stack(
                [term.loss_value(name, y_true, y_pred, sample_weight) for name, term in self.terms.items()]
            )
        values = whole_batch_values(values, self._sums_over_samples)
        capture.record(self, values)
        reported = values
        if self.metric_keys:
            y_true, y_pred = as_float32(y_true), as_float32(y_pred)
            metrics = [v for term in self.terms.values() for v in term.loss_metric_values(y_true, y_pred)]
            reported = ops.concatenate([values, ops.stack(metrics)])
        # Keras tells a loss nothing of training: its values count as a
        # training call's (fit resets them before evaluate reads them).
        if not capture.active(self):  # a probe's pass, in a stateless scope, would keep nothing
            self._running.add(reported, training=True)
        # In a jax.jit of the user's own (no stateless scope) the rule's
        # state cannot take the trace's values: it stays.
        update = training and not backend.traced_outside_scope(values)
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
