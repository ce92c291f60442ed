"""The weighting rules of the composites, as pure functions of tensors, and
the checks of their arguments: term weights (numbers or schedules of the
step), uncertainty weighting (Kendall et al., 2018) and FAMO (Liu et al., 2023)."""

import typing

import keras
import numpy as np
from keras import ops

from keras_penalties import _validation as check
from keras_penalties._types import Weighting


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
