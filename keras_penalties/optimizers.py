"""Optimizer wrappers: proximal (decoupled) decay and gradient transforms.

Each wrapper is a `keras.optimizers.Optimizer` around another one (any Keras
optimizer, or another wrapper), as Keras' `LossScaleOptimizer` is: pass it
to `model.compile(optimizer=...)`. `learning_rate` and `iterations` are the
inner optimizer's; its state is saved with the model. η_t below is the inner
optimizer's learning rate at step t (schedules included) and t its
`iterations` before the step.

- `ProximalDecay(optimizer, regularizer)`: after the inner update,
  v ← prox_{η_t·R}(v) for R an `L1`, `L2` or `ElasticNet` regularizer, with
  the same `factor` as `kernel_regularizer=` would use. The decay is
  decoupled from the inner optimizer's gradient statistics, so L1 gives exact
  zeros under Adam too.
- `GradientNoise`, `AdaptiveGradientClipping`, `GradientCentralization`:
  transform each gradient before the inner optimizer sees it.

`exclude` (a list of strings; every wrapper but `GradientNoise`, whose
noise goes on every gradient) leaves alone every variable whose `path`
contains one of them, as Keras' `exclude_from_weight_decay(var_names=...)`.
A variable with a `None` gradient is left alone by every wrapper.
"""

import itertools
import math
from typing import Any, Sequence, TypeAlias, TypeVar

import keras
from keras import ops

from keras_penalties import _keras_internals, _replicas, backend, regularizers
from keras_penalties import _validation as check
from keras_penalties._saving import with_hint, without_hint
from keras_penalties._types import Tensor

_PACKAGE = "keras_penalties"
# The inner optimizer: an instance, or a name `keras.optimizers.get` resolves.
_Optimizer: TypeAlias = keras.optimizers.Optimizer | str
# Variables left alone: those whose `path` contains one of these strings.
_Exclude: TypeAlias = str | list[str] | tuple[str, ...] | None
_Wrapped = TypeVar("_Wrapped", bound="_Wrapper")


def _check_exclude(exclude):
    if exclude is None:
        return []
    if isinstance(exclude, str):
        exclude = [exclude]
    if not isinstance(exclude, (list, tuple)) or not all(isinstance(s, str) for s in exclude):
        raise TypeError(f"`exclude` must be None or a list of strings; got {exclude!r}.")
    return list(exclude)


class _Wrapper(keras.optimizers.Optimizer):
    """Forwards everything but `apply` to `inner_optimizer`, as `LossScaleOptimizer`.

    Subclasses implement `_apply(grads, variables)` with stateful reads and
    assigns; `stateless_apply` (JAX) runs it in a `StatelessScope`, as the
    base class runs `apply`.
    """

    built: bool  # Keras' Optimizer sets it; declared for type checkers (Keras has no types)

    def __init__(self, optimizer: _Optimizer, *, exclude: _Exclude = None, name: str | None = None) -> None:
        optimizer = check.optimizer("optimizer", optimizer)
        exclude = _check_exclude(exclude)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self.exclude = exclude

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The wrapped optimizer (also `inner_optimizer`, as in `LossScaleOptimizer`)."""
        return self.inner_optimizer

    def build(self, var_list: list[keras.Variable]) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._build_own(var_list)
        super().build(var_list)

    def _build_own(self, var_list):
        """Creates the wrapper's own state; most have none."""

    @property
    def variables(self) -> list[keras.Variable]:
        return _keras_internals.optimizer_own_variables(self) + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> keras.Variable:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Tensor) -> Tensor:
        # A LossScaleOptimizer nested inside scales the loss it unscales.
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: list[keras.Variable]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply(
        self, grads: Sequence[Tensor | None], trainable_variables: Sequence[keras.Variable] | None = None
    ) -> None:
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the optimizer "
                    "must already be built: call `optimizer.build(trainable_variables)`."
                )
            trainable_variables = _keras_internals.optimizer_trainable_variables(self)
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if len(grads) == 0:
            return
        self._apply(list(grads), trainable_variables)

    def _included(self, variable):
        return not any(s in variable.path for s in self.exclude)

    def _inner_apply(self, grads, variables):
        if _keras_internals.in_stateless_scope():
            # JAX: the inner optimizer's own stateless path, which a
            # LossScaleOptimizer needs (its `apply` branches with `cond`).
            inner = self.inner_optimizer
            new_values, new_state = inner.stateless_apply(
                [v.value for v in inner.variables], grads, [v.value for v in variables]
            )
            for v, value in zip(variables, new_values):
                v.assign(value)
            for v, value in zip(inner.variables, new_state):
                v.assign(value)
        else:
            self.inner_optimizer.apply(grads, variables)

    def get_config(self) -> dict[str, Any]:
        # Not super().get_config(): the base options belong to the inner
        # optimizer, as in LossScaleOptimizer.
        return with_hint(
            {
                "name": self.name,
                "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **self._options(),
            }
        )

    def _options(self):
        return {"exclude": list(self.exclude)}

    @classmethod
    def from_config(
        cls: type[_Wrapped], config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> _Wrapped:
        config = without_hint(config)
        optimizer = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(optimizer, **cls._deserialize_options(config, custom_objects))

    @classmethod
    def _deserialize_options(cls, config, custom_objects):
        return config


_PROXIMAL_TYPES = (regularizers.L1, regularizers.L2, regularizers.ElasticNet)


def _check_proximal(regularizer):
    if not isinstance(regularizer, _PROXIMAL_TYPES):
        raise ValueError(
            "`regularizer` must be a keras_penalties.regularizers L1, L2 or ElasticNet "
            f"(penalties with a closed-form proximal step); got {regularizer!r}."
        )
    if isinstance(regularizer, regularizers.L2) and regularizer.clip is not None:
        raise ValueError(
            f"`regularizer`: L2 with `clip` has no closed-form proximal step; got {regularizer!r}. "
            "Use L2 without clip, or keep it as a coupled kernel_regularizer=."
        )
    return regularizer


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ProximalDecay(_Wrapper):
    """Decoupled L1 / L2 / elastic-net decay: v ← prox_{η_t·R}(v) after each update.

    The exact proximal step of R = `regularizer` (a `keras_penalties.regularizers`
    `L1`, `L2` or `ElasticNet`, with the `factor` it would have as a coupled
    `kernel_regularizer=`), scaled by the inner optimizer's current learning
    rate η_t:

    - `L1(f)`: v ← sign(v)·max(|v| − η_t·f, 0) (soft thresholding);
    - `L2(f, center=c)`: v ← c + (v − c)/(1 + 2η_t·f); `center="mean"` uses
      the variable's own mean after the update;
    - `ElasticNet(f, α)`: the L1 step at f·α, then the L2 step at f·(1 − α).

    With SGD this is the proximal-gradient method (ISTA) and, to first order
    in η, the same as the coupled penalty. With Adam it is not: Adam divides a
    coupled penalty's gradient by its running RMS, so every weight moves by
    about η a step whatever the penalty, and the L1 pull never lands on 0.
    Here the threshold η_t·f is in weight units, while Adam moves a weight
    by η_t·m̂/(√v̂ + ε), about η_t whatever the gradient's scale: a weight
    settles at exactly 0 when |m̂|/√v̂ < f, that is when its minibatch
    gradients mostly cancel. Useful factors are therefore fractions below 1
    (0.05–0.5), not the 1e-4 of a coupled L1 on a loss; f ≥ 1 zeroes every
    weight. A step the inner optimizer skips (a `LossScaleOptimizer` on
    non-finite gradients) or only accumulates (`gradient_accumulation_steps`)
    applies no decay.

    Args:
        optimizer: the inner `keras.optimizers.Optimizer` (or its name).
        regularizer: `L1`, `L2` (without `clip`) or `ElasticNet`.
        exclude: strings; a variable whose `path` contains one is not decayed.
        name: the optimizer's name.

    Example:

    >>> import keras
    >>> from keras_penalties.optimizers import ProximalDecay
    >>> from keras_penalties.regularizers import L1
    >>> w = keras.Variable([0.5, -0.05, 2.0])
    >>> opt = ProximalDecay(keras.optimizers.SGD(0.1), L1(1.0))
    >>> opt.apply([keras.ops.zeros(3)], [w])  # threshold 0.1 · 1.0
    >>> [round(float(x), 6) for x in w.numpy()]
    [0.4, 0.0, 1.9]
    """

    def __init__(
        self,
        optimizer: _Optimizer,
        regularizer: regularizers.L1 | regularizers.L2 | regularizers.ElasticNet,
        *,
        exclude: _Exclude = None,
        name: str | None = None,
    ) -> None:
        regularizer = _check_proximal(regularizer)
        super().__init__(optimizer, exclude=exclude, name=name)
        self.regularizer = regularizer

    def _apply(self, grads, variables):
        eta = ops.cast(self.inner_optimizer.learning_rate, "float32")
        # A copy: torch's variable is updated in place.
        before = ops.copy(self.inner_optimizer.iterations)
        self._inner_apply(grads, variables)
        # No decay on a step the inner optimizer skipped (LossScaleOptimizer
        # on non-finite gradients) or only accumulated (gradient_accumulation_steps).
        stepped = ops.greater(self.inner_optimizer.iterations, before)
        step = eta * ops.cast(stepped, "float32") * self.regularizer.factor
        decayed = [v for g, v in zip(grads, variables) if g is not None and self._included(v)]
        threshold, shrink, center = self._prox_parts(step)
        backend.proximal_step(decayed, threshold, shrink, center)

    def _prox_parts(self, step):
        """(threshold, shrink, center) of the proximal step of R at `step` = η_t·f."""
        reg = self.regularizer
        if isinstance(reg, regularizers.L1):
            return step, None, None
        if isinstance(reg, regularizers.L2):
            return None, 1.0 / (1.0 + 2.0 * step), None if reg.center == 0 else reg.center
        # The L1 step at f·α, then the L2 step at f·(1 − α).
        return step * reg.l1_ratio, 1.0 / (1.0 + 2.0 * step * (1.0 - reg.l1_ratio)), None

    def _options(self):
        return {"regularizer": keras.saving.serialize_keras_object(self.regularizer), **super()._options()}

    @classmethod
    def _deserialize_options(cls, config, custom_objects):
        regularizer = keras.saving.deserialize_keras_object(config.pop("regularizer"), custom_objects=custom_objects)
        return {"regularizer": regularizer, **config}


class _GradientTransform(_Wrapper):
    """Maps each gradient (with its variable) before the inner optimizer runs."""

    def _apply(self, grads, variables):
        # Under tf.distribute each replica holds its part of the gradient and
        # the inner optimizer sums them: a nonlinear transform must see the
        # whole gradient, and hands each replica an equal share of the result.
        whole, shares = _replicas.split_in_sync(grads)
        self._inner_apply(shares(self._transform_all(whole, variables)), variables)

    def _transform_all(self, grads, variables):
        return [g if g is None or not self._included(v) else self._transform(g, v) for g, v in zip(grads, variables)]


def _axes_but_last(x):
    return tuple(range(len(x.shape) - 1))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GradientNoise(_GradientTransform):
    """Annealed Gaussian gradient noise: g ← g + N(0, σ_t²), σ_t = stddev·(1 + t)^(−decay/2).

    Neelakantan et al. (2015), "Adding Gradient Noise Improves Learning for
    Very Deep Networks" (they anneal the variance η/(1 + t)^γ, γ = 0.55; here
    σ₀ = `stddev`). t is the inner optimizer's `iterations` before the step.
    Noise is independent per variable and per step, drawn from a
    `keras.random.SeedGenerator` whose state is an optimizer variable: an int
    `seed` makes runs reproducible, also under `jit`, and the state is saved.

    Args:
        optimizer: the inner `keras.optimizers.Optimizer` (or its name).
        stddev: σ₀ ≥ 0.
        decay: the exponent γ ≥ 0 of the variance's decay.
        seed: `None` or an int.
        name: the optimizer's name.

    Example:

    >>> import keras
    >>> from keras_penalties.optimizers import GradientNoise
    >>> opt = GradientNoise(keras.optimizers.SGD(1.0), stddev=0.0)
    >>> w = keras.Variable([1.0, 2.0])
    >>> opt.apply([keras.ops.ones(2)], [w])  # σ = 0: plain SGD
    >>> w.numpy().tolist()
    [0.0, 1.0]
    """

    def __init__(
        self,
        optimizer: _Optimizer,
        *,
        stddev: float = 0.01,
        decay: float = 0.55,
        seed: int | None = None,
        name: str | None = None,
    ) -> None:
        stddev = check.non_negative("stddev", stddev)
        decay = check.non_negative("decay", decay)
        seed = None if seed is None else check.integer("seed", seed)
        super().__init__(optimizer, name=name)
        self.stddev, self.decay, self.seed = stddev, decay, seed

    def _build_own(self, var_list):
        with keras.name_scope(self.name, caller=self):
            self._seed_generator = keras.random.SeedGenerator(self.seed, name="noise_seed")
        _keras_internals.track_optimizer_variable(self, self._seed_generator.state)

    def _transform_all(self, grads, variables):
        if self.stddev == 0.0:
            return grads
        t = ops.cast(self.inner_optimizer.iterations, "float32")
        sigma = self.stddev * ops.power(1.0 + t, -self.decay / 2.0)
        # One draw per dtype for every gradient, split into them: a draw
        # per variable pays the seed generator's step each time (and on
        # torch a fresh torch.Generator seeded from it).
        groups = {}
        for i, g in enumerate(grads):
            if g is not None:
                groups.setdefault(keras.backend.standardize_dtype(g.dtype), []).append(i)
        out = list(grads)
        for dtype, indices in groups.items():
            sizes = [math.prod(grads[i].shape) for i in indices]
            noise = keras.random.normal((sum(sizes),), dtype=dtype, seed=self._seed_generator)
            pieces = ops.split(noise, list(itertools.accumulate(sizes[:-1]))) if len(sizes) > 1 else [noise]
            scale = ops.cast(sigma, dtype)
            for i, piece in zip(indices, pieces):
                out[i] = grads[i] + scale * ops.reshape(piece, grads[i].shape)
        return out

    def _options(self):
        return {"stddev": self.stddev, "decay": self.decay, "seed": self.seed}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AdaptiveGradientClipping(_GradientTransform):
    """Unit-wise adaptive gradient clipping: g ← g·min(1, λ·max(‖w‖, ε)/‖g‖).

    Brock et al. (2021), "High-Performance Large-Scale Image Recognition
    Without Normalization". Norms are per unit: over every axis but the last
    (a Dense kernel's column, a Conv kernel's filter), and over the whole
    tensor for rank ≤ 1. A unit whose gradient norm is 0 is left unchanged.
    w is the variable before the update.

    Args:
        optimizer: the inner `keras.optimizers.Optimizer` (or its name).
        clip_factor: λ ≥ 0.
        eps: ε ≥ 0, the smallest weight norm a unit is credited with.
        exclude: strings; a variable whose `path` contains one is not clipped
            (the paper leaves the final classifier layer alone).
        name: the optimizer's name.

    Example:

    >>> import keras
    >>> from keras_penalties.optimizers import AdaptiveGradientClipping
    >>> opt = AdaptiveGradientClipping(keras.optimizers.SGD(1.0), clip_factor=0.1)
    >>> w = keras.Variable([3.0, 4.0])  # ‖w‖ = 5: gradients clipped to norm 0.5
    >>> opt.apply([keras.ops.convert_to_tensor([0.0, 10.0])], [w])
    >>> [round(float(x), 6) for x in w.numpy()]
    [3.0, 3.5]
    """

    def __init__(
        self,
        optimizer: _Optimizer,
        *,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        exclude: _Exclude = None,
        name: str | None = None,
    ) -> None:
        clip_factor = check.non_negative("clip_factor", clip_factor)
        eps = check.non_negative("eps", eps)
        super().__init__(optimizer, exclude=exclude, name=name)
        self.clip_factor, self.eps = clip_factor, eps

    def _transform_all(self, grads, variables):
        clipped = [i for i, (g, v) in enumerate(zip(grads, variables)) if g is not None and self._included(v)]
        out = list(grads)
        new = backend.unit_clip(
            [grads[i] for i in clipped], [variables[i].value for i in clipped], self.clip_factor, self.eps
        )
        for i, g in zip(clipped, new):
            out[i] = g
        return out

    def _options(self):
        return {"clip_factor": self.clip_factor, "eps": self.eps, **super()._options()}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GradientCentralization(_GradientTransform):
    """Gradient centralization: g ← g − mean of g over every axis but the last (rank ≥ 2).

    Yong et al. (2020), "Gradient Centralization: A New Optimization Technique
    for Deep Neural Networks". Each output unit's gradient (a Dense kernel's
    column, a Conv kernel's filter) gets mean 0; biases and other rank ≤ 1
    variables are unchanged.

    Args:
        optimizer: the inner `keras.optimizers.Optimizer` (or its name).
        exclude: strings; a variable whose `path` contains one is not centralized.
        name: the optimizer's name.

    Example:

    >>> import keras
    >>> from keras_penalties.optimizers import GradientCentralization
    >>> opt = GradientCentralization(keras.optimizers.SGD(1.0))
    >>> w = keras.Variable(keras.ops.zeros((2, 1)))
    >>> opt.apply([keras.ops.convert_to_tensor([[1.0], [3.0]])], [w])  # column mean 2
    >>> w.numpy().ravel().tolist()
    [1.0, -1.0]
    """

    def __init__(self, optimizer: _Optimizer, *, exclude: _Exclude = None, name: str | None = None) -> None:
        super().__init__(optimizer, exclude=exclude, name=name)

    def _transform(self, grad, variable):
        if len(grad.shape) < 2:
            return grad
        return grad - ops.mean(grad, axis=_axes_but_last(grad), keepdims=True)


__all__ = ["ProximalDecay", "GradientNoise", "AdaptiveGradientClipping", "GradientCentralization"]
