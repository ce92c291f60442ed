"""The composites' weighting rules, as Keras objects.

A rule decides the weight of each term of a `CompositeObjective` or
`CompositeLoss` and forms their total: it makes its variables on the
composite's state layer, gives the weights in use, forms the weighted total
and, at a training step, advances its state. `weighting=` takes a rule
(an instance), its name or its config dict, resolved once by `get` as
`keras.optimizers.get` resolves an optimizer; a composite saves its rule
with `keras.saving.serialize_keras_object`.

- `Weighting`: the base class; subclass it for a rule of your own.
- `Fixed` (`"fixed"`, or None): the terms' weights, numbers or schedules of
  the step, as set.
- `Uncertainty` (`"uncertainty"`, Kendall et al., 2018): trainable
  log-variances.
- `FAMO` (`"famo"`, Liu et al., 2023): logits with an Adam of their own,
  stepped once per training step.

Their math is written as pure functions of tensors below the classes'
methods; each argument check once (`_checked`).
"""

import inspect
import typing
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import _keras_internals, _replicas, backend
from keras_penalties import _validation as check
from keras_penalties._types import Weighting as WeightingArgument
from keras_penalties._types import WeightingName
from keras_penalties.composite.state import state_variable


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
        return check.non_negative(name, weight)
    try:
        first = float(ops.convert_to_numpy(weight(0)))
    except Exception as error:  # noqa: BLE001 -- reported with the argument's name
        raise TypeError(f"`{name}` is a schedule that cannot be evaluated at step 0: {error}") from error
    if not first >= 0:
        raise ValueError(f"`{name}` is a schedule whose value at step 0 is {first}; weights must be >= 0.")
    return weight


# FAMO (Liu et al., 2023), as its official implementation (Cranial-XIX/FAMO):
# the logits' Adam (torch's: β 0.9, 0.999, ε 1e-8, weight decay added to the
# gradient; `famo_step`; its learning rate and weight decay are `FAMO`'s
# arguments), and the ε added to each loss.
FAMO_EPSILON = 1e-8


def famo_step(logits, moments, step, delta, learning_rate, gamma, math=ops):
    """One FAMO update of the logits ξ from δ = log Dₜ₋₁ − log Dₜ, the
    change of the log-losses since the previous step, through softmax's
    Jacobian, d = z ⊙ (δ − z·δ), as the logits' gradient, plus γ·ξ; then
    Adam step `step` (≥ 1). Returns the new logits and moments (m, v
    stacked). `math`: Keras' ops, or `backend.SMALL_OPS`."""
    z = math.softmax(logits)
    gradient = z * (delta - math.sum(z * delta)) + gamma * logits
    m = 0.9 * moments[0] + 0.1 * gradient
    v = 0.999 * moments[1] + 0.001 * gradient * gradient
    m_hat = m / (1.0 - math.power(0.9, step))
    v_hat = v / (1.0 - math.power(0.999, step))
    return logits - learning_rate * m_hat / (math.sqrt(v_hat) + 1e-8), math.stack([m, v])


def famo_coefficients(logits, inverse_losses, math=ops):
    """FAMO's cᵢzᵢ, z = softmax(ξ), c = (Σⱼ zⱼ/Dⱼ)⁻¹, for the inverse losses
    1/Dᵢ: the model trains on Σ cᵢzᵢ·log Dᵢ (c, z held constant), whose
    gradient is Σ cᵢzᵢ/Dᵢ·∇Lᵢ; cᵢzᵢ/Dᵢ are the effective weights, and they
    sum to 1."""
    z = math.softmax(logits)
    return z / math.sum(z * inverse_losses)


def uncertainty_weights(log_variances):
    """Kendall et al. (2018), as LibMTL: term i weighs ½·exp(−sᵢ)."""
    return 0.5 * ops.exp(-log_variances)


def scaled_gradient(x, multiplier):
    """`x` in value; `multiplier` × its gradient on the way back."""
    if multiplier == 1.0:
        return x
    return multiplier * x + ops.stop_gradient((1.0 - multiplier) * x)


# Each rule option's check, by the option's name: the rules' constructors
# and 0.1.0's flat options (`from_arguments`) call the same one.
_CHECKS = {
    "learning_rate_multiplier": check.positive,
    "learning_rate": check.positive,
    "gamma": check.non_negative,
}


def _checked(option, value, name=None):
    """`value` of the rule option `option`, checked, as a float; errors name
    `name` (the argument as the caller wrote it), `option` by default."""
    return float(_CHECKS[option](name or option, value))


@keras.saving.register_keras_serializable(package="keras_penalties")
class Weighting:
    """The base class of a composite's weighting rule.

    A rule is asked, in this order: `make_variables` once, when the
    composite makes its state; `before_step` where the composite is
    computed in training; `weights` for the weights in use (logged as
    `"<composite>/<term>/weight"`, `weights_in_use()`); `total` for the
    composite's value, with `update=True` once per training step. The base
    class is the fixed rule: each term weighs what it was given.

    A rule of your own subclasses it, overrides what it changes, and, if
    its constructor takes arguments, `get_config` (their values;
    `from_config` calls the constructor with them). Register it with
    `keras.saving.register_keras_serializable` to save and reload it in a
    `.keras` file. Its variables belong on `owner` (`add_variable`): Keras
    tracks, trains and saves them there. Its update at a training step is
    `total`'s, with `update=True` (once per step; set `steps_in_training`
    so that a `CompositeLoss`, which Keras does not tell whether it is
    training, finds `fit`'s training steps): a rule may advance its state
    before forming the total, as FAMO does, or after.

    Example: the terms' own weights, scaled to sum to 1.

    >>> import keras, numpy as np
    >>> from keras_penalties import CompositeObjective
    >>> from keras_penalties.composite.weighting import Weighting
    >>> @keras.saving.register_keras_serializable(package="docs")
    ... class Normalized(Weighting):
    ...     def weights(self, owner, set_weights):
    ...         w = set_weights()
    ...         return w / keras.ops.sum(w)
    >>> objective = CompositeObjective({"a": "l1", "b": "l2"}, weights={"a": 1.0, "b": 3.0},
    ...                                weighting=Normalized())
    >>> objective.weights_in_use()
    {'a': 0.25, 'b': 0.75}
    >>> total, _ = objective.compute(np.ones((1, 2), "float32"))  # 0.25·2 + 0.75·2
    >>> round(float(total), 4)
    2.0
    """

    learned = False  # whether the rule learns the weights (nothing may set them)
    steps_in_training = False  # whether its state advances at each training step

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (none for the base class)."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Weighting":
        return cls(**config)

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.get_config().items())
        return f"{type(self).__name__}({options})"

    def add_variable(self, owner: Any, name: str, values: Any, trainable: bool = False) -> Any:
        """A float32 variable of the rule's state, initially `values`, made
        on `owner` as its attribute `name` (never autocast; a trainable one
        is trained by the model's optimizer and averaged over replicas)."""
        aggregation = "mean" if trainable else "only_first_replica"
        variable = state_variable(name, values, trainable=trainable, aggregation=aggregation)
        setattr(owner, name, variable)
        return variable

    def make_variables(self, owner: Any, count: int) -> None:
        """Makes the rule's variables on `owner`, the layer holding the
        composite's state, for `count` terms (`add_variable`)."""

    def weights(self, owner: Any, set_weights: Any) -> Any:
        """The weight vector in use, float32 [terms]; `set_weights()` gives
        the one the composite's numbers and schedules give at the step."""
        return set_weights()

    def before_step(self, owner: Any, training_model: Any) -> None:
        """Where the composite is computed in training, before the step is
        traced or run; `training_model()` gives the model training it (or None)."""

    def total(self, owner: Any, values: Any, weights: Any, enabled: Any, update: bool, model: Any) -> Any:
        """The composite's value: Σ wᵢ·valueᵢ over the enabled terms
        (`values`, `weights` from `weights`, `enabled` 1 or 0 each, float32
        [terms]). With `update`, a training step's: the rule's state
        advances. `model`: the model the composite's losses are added to
        (or None). Under several `tf.distribute` replicas the composite
        keeps that model's add_loss lists as they were around this call,
        so a rule may sum over the replicas and assign its state here."""
        return backend.reduce_sum(values * weights * enabled)


@keras.saving.register_keras_serializable(package="keras_penalties")
class Fixed(Weighting):
    """`weighting="fixed"` (or None): each term weighs what it was given (a
    number, or a schedule of the step that `set_weight` may replace by a
    number); the weights live in the composite's own variables
    (`term_weights`, `weight_overridden`)."""


@keras.saving.register_keras_serializable(package="keras_penalties")
class Uncertainty(Weighting):
    """Kendall et al. (2018), as LibMTL: a trainable log-variance sᵢ per term
    (initially 0, trained by the model's optimizer, never by its weight
    decay, which would pull every weight ½·exp(−sᵢ) towards ½); the total is
    Σ ½·exp(−sᵢ)·valueᵢ + ½·sᵢ over the enabled terms, and the weight
    reported ½·exp(−sᵢ). The terms' own weights are ignored.

    Args:
        learning_rate_multiplier: a number > 0 that scales the sᵢ'
            gradients (default 1), so that they can move faster than the
            model's weights under SGD-like optimizers. Adam and its kin
            divide by the gradient's running magnitude, so there it changes
            almost nothing: give the sᵢ a larger step through the
            optimizer's learning rate instead.

    The sᵢ are the composite's `log_variances`.
    """

    learned = True

    def __init__(self, learning_rate_multiplier: float = 1.0) -> None:
        self.learning_rate_multiplier = _checked("learning_rate_multiplier", learning_rate_multiplier)

    def get_config(self) -> dict[str, Any]:
        return {"learning_rate_multiplier": self.learning_rate_multiplier}

    def make_variables(self, owner: Any, count: int) -> None:
        self.add_variable(owner, "log_variances", np.zeros(count), trainable=True)

    def _learned(self, owner):
        return scaled_gradient(owner.log_variances.value, self.learning_rate_multiplier)

    def weights(self, owner: Any, set_weights: Any) -> Any:
        return uncertainty_weights(self._learned(owner))

    def before_step(self, owner: Any, training_model: Any) -> None:
        model = training_model()
        if getattr(model, "optimizer", None) is not None:
            _keras_internals.exclude_from_weight_decay(model.optimizer, [owner.log_variances])

    def total(self, owner: Any, values: Any, weights: Any, enabled: Any, update: bool, model: Any) -> Any:
        total = super().total(owner, values, weights, enabled, update, model)
        return total + 0.5 * ops.sum(self._learned(owner) * enabled)


@keras.saving.register_keras_serializable(package="keras_penalties")
class FAMO(Weighting):
    """Liu et al. (2023), as its official code (Cranial-XIX/FAMO): logits ξ
    per term (initially 0) with an Adam of their own, z = softmax(ξ); the
    total is Σ cᵢzᵢ·log Dᵢ over the enabled terms, Dᵢ = max(valueᵢ, 0) +
    1e-8, c = (Σⱼ zⱼ/Dⱼ)⁻¹ held constant, so that its gradient is
    Σ wᵢ·∇valueᵢ with the effective weights wᵢ = cᵢzᵢ/Dᵢ (they sum to 1; the
    weight reported). At each training step (`fit`'s, not `evaluate`'s) ξ
    first takes its Adam step on the change of the log-losses since the
    previous one. Its state: the logits, their Adam moments, the previous
    log-losses, the step count and the latest effective weights
    (`famo_logits`, `famo_moments`, `famo_previous`, `famo_steps`,
    `famo_last_weights` on the composite).

    Args:
        learning_rate: the logits' Adam's learning rate (> 0).
        gamma: its weight decay (≥ 0), added to the gradient as torch's
            Adam does. Both defaults are the official implementation's.
    """

    learned = True
    steps_in_training = True

    def __init__(self, learning_rate: float = 0.025, gamma: float = 0.01) -> None:
        self.learning_rate = _checked("learning_rate", learning_rate)
        self.gamma = _checked("gamma", gamma)

    def get_config(self) -> dict[str, Any]:
        return {"learning_rate": self.learning_rate, "gamma": self.gamma}

    def make_variables(self, owner: Any, count: int) -> None:
        self.add_variable(owner, "famo_logits", np.zeros(count))
        self.add_variable(owner, "famo_moments", np.zeros((2, count)))
        self.add_variable(owner, "famo_previous", np.zeros(count))
        self.add_variable(owner, "famo_steps", 0.0)
        self.add_variable(owner, "famo_last_weights", np.ones(count))

    def weights(self, owner: Any, set_weights: Any) -> Any:
        return owner.famo_last_weights.value

    def total(self, owner: Any, values: Any, weights: Any, enabled: Any, update: bool, model: Any) -> Any:
        math = backend.SMALL_OPS
        frozen = math.stop_gradient(values)
        # Each replica's values have the whole batch's as their mean.
        (values_in_sync,) = _replicas.mean_in_sync([frozen])
        log_losses = math.log(math.relu(values_in_sync) + FAMO_EPSILON)
        logits = owner.famo_logits.value
        if update:
            steps = owner.famo_steps.value
            # Operators, not `keras.ops` calls (each a dispatch on eager torch):
            # 0⁰ = 1, so `first` is 1 at the first step and 0 after. δ is 0
            # at the first step (no previous step to compare with); with ξ
            # still 0 there, Adam's step is 0 and its moments stay 0.
            first = 0.0**steps
            logits, moments = famo_step(
                logits,
                owner.famo_moments.value,
                steps + first,
                (owner.famo_previous.value - log_losses) * (1.0 - first),
                self.learning_rate,
                self.gamma,
                math,
            )
        inverse_losses = math.exp(-log_losses)
        coefficients = famo_coefficients(logits, inverse_losses, math)
        weights = coefficients * inverse_losses
        if update:
            backend.assign_all(
                [
                    (owner.famo_logits, logits),
                    (owner.famo_moments, moments),
                    (owner.famo_previous, log_losses),
                    (owner.famo_steps, steps + 1.0),
                    (owner.famo_last_weights, weights),
                ]
            )
        # The value is the whole batch's; the gradient is Σ wᵢ·∇Lᵢ of this
        # replica's own values, which Keras adds up to the whole batch's.
        own = values - frozen
        return math.sum((coefficients * log_losses + weights * own) * enabled)


RULES: dict[str, type[Weighting]] = {"fixed": Fixed, "uncertainty": Uncertainty, "famo": FAMO}
assert set(RULES) == set(typing.get_args(WeightingName))


def get(identifier: WeightingArgument) -> Weighting:
    """The weighting rule `identifier` gives, as `keras.optimizers.get`
    resolves an optimizer: a `Weighting` as it is; a name (`"fixed"`,
    `"uncertainty"`, `"famo"`; None: `"fixed"`) as that rule with its
    defaults; a config dict (`keras.saving.serialize_keras_object`'s, or
    `{"class_name": "famo", "config": {...}}`) as the rule it describes.

    >>> from keras_penalties.composite import weighting
    >>> weighting.get("famo")
    FAMO(learning_rate=0.025, gamma=0.01)
    >>> weighting.get("Fixed")
    Fixed()
    >>> weighting.get({"class_name": "uncertainty", "config": {"learning_rate_multiplier": 2.0}})
    Uncertainty(learning_rate_multiplier=2.0)
    """
    if identifier is None:
        return Fixed()
    if isinstance(identifier, Weighting):
        return identifier
    if isinstance(identifier, str):
        # As keras.optimizers.get: the name in any case ("famo", "FAMO").
        if identifier.lower() not in RULES:
            raise ValueError(f"`weighting` must be one of {', '.join(map(repr, RULES))}; got {identifier!r}.")
        return RULES[identifier.lower()]()
    if isinstance(identifier, dict):
        known = {**{cls.__name__: cls for cls in RULES.values()}, **RULES}
        try:
            rule = keras.saving.deserialize_keras_object(identifier, custom_objects=known)
        except (TypeError, ValueError) as error:
            raise TypeError(f"`weighting` config could not be read as a Weighting rule: {error}") from error
        if not isinstance(rule, Weighting):
            raise TypeError(f"`weighting` config describes {type(rule).__name__}, not a Weighting rule.")
        return rule
    raise TypeError(
        "`weighting` must be a Weighting rule, its name ('fixed', 'uncertainty', 'famo') or its config dict; "
        f"got {identifier!r}."
    )


# 0.1.0's flat options, each of one rule: {flat name: (rule, option)}. Saved
# configs of 0.1.0 hold all three, at their defaults beside other rules.
_FLAT_OPTIONS = {
    "weighting_learning_rate_multiplier": ("uncertainty", "learning_rate_multiplier"),
    "famo_learning_rate": ("famo", "learning_rate"),
    "famo_gamma": ("famo", "gamma"),
}


def from_arguments(weighting: WeightingArgument, arguments: dict[str, Any]) -> Weighting:
    """The rule of a composite's constructor: `weighting` as `get` takes
    it, with 0.1.0's flat options (`famo_learning_rate=`, ...) taken out of
    `arguments` (the constructor's keyword arguments, or a saved config)
    and given to the rule named beside them. A flat option away from its
    default is a ValueError beside another rule, or beside a rule given as
    an object or a config."""
    flat = {key: arguments.pop(key) for key in list(arguments) if key in _FLAT_OPTIONS}
    options: dict[str, float] = {}
    for key, value in flat.items():
        rule, option = _FLAT_OPTIONS[key]
        value = _checked(option, value, key)
        if value == inspect.signature(RULES[rule]).parameters[option].default:
            continue
        if not (weighting is None or isinstance(weighting, str)):
            raise ValueError(f"`weighting` given as a rule or config takes its options itself, not `{key}` beside it.")
        if weighting != rule:
            raise ValueError(f"`{key}` applies with weighting={rule!r}, not weighting={weighting!r}.")
        options[option] = value
    return RULES[str(weighting)](**options) if options else get(weighting)
