"""The composites' weighting rules: one object per rule, resolved once from
the `weighting` string as Keras resolves `"mse"` (`get`), each making its
variables on the composite's state layer, giving the weights in use and
the weighted total, and updating itself; their math as pure functions of
tensors, and the checks of their arguments.

- `FixedWeights` (`weighting=None`): the terms' weights, numbers or
  schedules of the step, as set.
- `Uncertainty` (`"uncertainty"`, Kendall et al., 2018): trainable
  log-variances.
- `FAMO` (`"famo"`, Liu et al., 2023): logits with an Adam of their own,
  stepped once per training step.
"""

import typing
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import _keras_internals, _replicas, backend
from keras_penalties import _validation as check
from keras_penalties._types import Weighting
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


WEIGHTINGS = tuple(a for a in typing.get_args(typing.get_args(Weighting)[0]))
_check_weighting = check.optional(check.choice(*WEIGHTINGS))


def check_weighting(weighting):
    """`weighting`: None (the terms' own weights), "uncertainty" or "famo"."""
    if weighting is not None and not isinstance(weighting, str):
        raise TypeError(f"`weighting` must be None, 'uncertainty' or 'famo'; got {weighting!r}.")
    return _check_weighting("weighting", weighting)


def check_famo(learning_rate, gamma, weighting):
    """`famo_learning_rate` (> 0) and `famo_gamma` (≥ 0); other than their
    defaults only with `weighting="famo"`."""
    learning_rate = float(check.positive("famo_learning_rate", learning_rate))
    gamma = float(check.non_negative("famo_gamma", gamma))
    if (learning_rate, gamma) != FAMO_DEFAULTS and weighting != "famo":
        raise ValueError(
            f"`famo_learning_rate` and `famo_gamma` apply with weighting='famo', not weighting={weighting!r}."
        )
    return learning_rate, gamma


# FAMO (Liu et al., 2023), as its official implementation (Cranial-XIX/FAMO):
# the logits' Adam (torch's: β 0.9, 0.999, ε 1e-8, weight decay added to the
# gradient; `famo_step`), its learning rate and weight decay, and the
# ε added to each loss.
FAMO_DEFAULTS = (0.025, 0.01)
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


def check_multiplier(multiplier, weighting):
    """`weighting_learning_rate_multiplier`: a number > 0, other than 1 only
    with `weighting="uncertainty"`."""
    multiplier = check.positive("weighting_learning_rate_multiplier", multiplier)
    if multiplier != 1.0 and weighting != "uncertainty":
        raise ValueError(
            "`weighting_learning_rate_multiplier` scales the gradients of learned weights; it "
            f"applies with weighting='uncertainty', not weighting={weighting!r}."
        )
    return float(multiplier)


def scaled_gradient(x, multiplier):
    """`x` in value; `multiplier` × its gradient on the way back."""
    if multiplier == 1.0:
        return x
    return multiplier * x + ops.stop_gradient((1.0 - multiplier) * x)


class FixedWeights:
    """`weighting=None`: each term weighs what it was given (a number, or a
    schedule of the step that `set_weight` may replace by a number); the
    weights live in the composite's own variables (`term_weights`,
    `weight_overridden`), which the rule reads."""

    name: Weighting = None
    learned = False  # whether the rule learns the weights (nothing may set them)
    steps_in_training = False  # whether its state advances at each training step

    def options(self) -> dict[str, Any]:
        """The rule's constructor options, as the composites' configs hold them."""
        return {}

    def make_variables(self, owner: Any, count: int) -> None:
        """Makes the rule's variables on `owner`, the layer holding the composite's state."""

    def weights(self, owner: Any, set_weights: Any) -> Any:
        """The weight vector in use; `set_weights()` gives the one the
        composite's numbers and schedules give at the step."""
        return set_weights()

    def before_step(self, owner: Any, training_model: Any) -> None:
        """Where the composite is computed in training, before the step is
        traced or run; `training_model()` gives the model training it (or None)."""

    def total(self, owner: Any, values: Any, weights: Any, enabled: Any, update: bool, model: Any) -> Any:
        """Σ wᵢ·valueᵢ over the enabled terms (`enabled`: 1 or 0 each). With
        `update`, a training step's: the rule's state advances. `model`: the
        model whose add_loss lists a cross-replica sum must keep (or None)."""
        return backend.reduce_sum(values * weights * enabled)


class Uncertainty(FixedWeights):
    """Kendall et al. (2018), as LibMTL: a trainable log-variance sᵢ per term
    (initially 0, trained by the model's optimizer without its weight
    decay); the total is Σ ½·exp(−sᵢ)·valueᵢ + ½·sᵢ over the enabled terms.
    `learning_rate_multiplier` scales the sᵢ' gradients."""

    name: Weighting = "uncertainty"
    learned = True

    def __init__(self, learning_rate_multiplier: float = 1.0) -> None:
        self.learning_rate_multiplier = float(check.positive("learning_rate_multiplier", learning_rate_multiplier))

    def options(self) -> dict[str, Any]:
        return {"weighting_learning_rate_multiplier": self.learning_rate_multiplier}

    def make_variables(self, owner: Any, count: int) -> None:
        owner.log_variances = state_variable("log_variances", np.zeros(count), trainable=True, aggregation="mean")

    def _learned(self, owner):
        return scaled_gradient(owner.log_variances.value, self.learning_rate_multiplier)

    def weights(self, owner: Any, set_weights: Any) -> Any:
        return uncertainty_weights(self._learned(owner))

    def before_step(self, owner: Any, training_model: Any) -> None:
        # Decay would pull every weight ½·exp(−sᵢ) towards ½.
        model = training_model()
        if getattr(model, "optimizer", None) is not None:
            _keras_internals.exclude_from_weight_decay(model.optimizer, [owner.log_variances])

    def total(self, owner: Any, values: Any, weights: Any, enabled: Any, update: bool, model: Any) -> Any:
        total = super().total(owner, values, weights, enabled, update, model)
        return total + 0.5 * ops.sum(self._learned(owner) * enabled)


class FAMO(FixedWeights):
    """Liu et al. (2023), as its official code: logits ξ per term (initially
    0) with an Adam of their own (`learning_rate`, weight decay `gamma`),
    z = softmax(ξ); the total is Σ cᵢzᵢ·log Dᵢ over the enabled terms,
    Dᵢ = max(valueᵢ, 0) + 1e-8, c = (Σⱼ zⱼ/Dⱼ)⁻¹ held constant, so that its
    gradient is Σ wᵢ·∇valueᵢ with the effective weights wᵢ = cᵢzᵢ/Dᵢ. At each
    training step ξ first steps on the change of the log-losses since the
    previous one. Its state: the logits, their Adam moments, the previous
    log-losses, the step count and the latest effective weights."""

    name: Weighting = "famo"
    learned = True
    steps_in_training = True

    def __init__(self, learning_rate: float = FAMO_DEFAULTS[0], gamma: float = FAMO_DEFAULTS[1]) -> None:
        self.learning_rate = float(check.positive("learning_rate", learning_rate))
        self.gamma = float(check.non_negative("gamma", gamma))

    def options(self) -> dict[str, Any]:
        return {"famo_learning_rate": self.learning_rate, "famo_gamma": self.gamma}

    def make_variables(self, owner: Any, count: int) -> None:
        owner.famo_logits = state_variable("famo_logits", np.zeros(count))
        owner.famo_moments = state_variable("famo_moments", np.zeros((2, count)))
        owner.famo_previous = state_variable("famo_previous", np.zeros(count))
        owner.famo_steps = state_variable("famo_steps", 0.0)
        owner.famo_last_weights = state_variable("famo_last_weights", np.ones(count))

    def weights(self, owner: Any, set_weights: Any) -> Any:
        return owner.famo_last_weights.value

    def total(self, owner: Any, values: Any, weights: Any, enabled: Any, update: bool, model: Any) -> Any:
        # Under several tf.distribute replicas (threads of one process) the
        # cross-replica sum and the state's assignments switch replica
        # threads: the model's add_loss lists are kept as they were around them.
        if backend.gradients_in_sync() == 1:
            return self._total(owner, values, enabled, update)
        with _keras_internals.added_losses_kept(model):
            return self._total(owner, values, enabled, update)

    def _total(self, owner, values, enabled, update):
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


def get(weighting: Any, multiplier: float = 1.0, famo: tuple[float, float] = FAMO_DEFAULTS) -> FixedWeights:
    """The rule `weighting` names (None, "uncertainty", "famo"), with its
    options checked (`multiplier` only for "uncertainty", `famo` only for
    "famo"), or `weighting` itself if it is a rule."""
    if isinstance(weighting, FixedWeights):
        if (multiplier, tuple(famo)) != (1.0, FAMO_DEFAULTS):
            raise ValueError("`weighting` given as a rule object takes its options itself, not as arguments beside it.")
        if weighting.name not in WEIGHTINGS + (None,):
            raise TypeError(
                f"`weighting` must be None, 'uncertainty', 'famo' or one of their rules; got {weighting!r}."
            )
        return weighting
    weighting = check_weighting(weighting)
    multiplier = check_multiplier(multiplier, weighting)
    learning_rate, gamma = check_famo(*famo, weighting)
    if weighting == "uncertainty":
        return Uncertainty(multiplier)
    if weighting == "famo":
        return FAMO(learning_rate, gamma)
    return FixedWeights()
