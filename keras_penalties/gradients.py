"""Backend-agnostic autodiff.

Keras 3 has no multi-backend gradient op; these functions take gradients with
the backend's native autodiff (`jax.grad`, `tf.GradientTape`,
`torch.autograd.grad`) through `keras_penalties.backend`, the one place that
branches on the Keras backend.
"""

from typing import Any, Callable, Protocol, Sequence

import keras
import numpy as np
from keras import ops

from keras_penalties import backend
from keras_penalties import ops as penalties
from keras_penalties._types import Reduction, Tensor, TensorLike


class HasGradientFunctions(Protocol):
    """What `gradient_norms` needs of an objective (a `CompositeObjective`
    has it): the scalar functions of its inputs to take norms of."""

    def gradient_functions(
        self, base_loss: Callable[[Any], Tensor] | None = None
    ) -> dict[str, Callable[[Any], Tensor]]: ...


def _as_float(x: TensorLike) -> Tensor:
    x = ops.convert_to_tensor(x)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        x = ops.cast(x, keras.config.floatx())
    return x


def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"`{name}` must be a callable; got {fn!r}.")


def _gradients(fn: Callable[..., Tensor], tensors: Sequence[Tensor]) -> list[Tensor]:
    """Gradients of the scalar `fn(*tensors)` w.r.t. each of `tensors`, kept
    differentiable (double backprop) on every backend."""
    return backend.gradients(fn, tensors)


def input_gradient(fn: Callable[[Tensor], Tensor], x: TensorLike) -> Tensor:
    """∇ₓ Σ fn(x): the gradient of a function's summed output w.r.t. its input.

    Works eagerly and inside a traced function (`jax.jit`, `tf.function`) and
    stays differentiable, so a penalty built on it can itself be trained
    (double backprop). Summing makes a per-sample `fn` give per-sample
    gradients.

    Args:
        fn: a callable of one tensor returning a tensor.
        x: the input; converted to a float tensor.

    Returns:
        A tensor with the shape and dtype of `x`.

    Example:

    >>> from keras_penalties.gradients import input_gradient
    >>> from keras import ops
    >>> [float(g) for g in input_gradient(lambda t: ops.square(t), [1.0, -2.0])]
    [2.0, -4.0]
    """
    _check_callable("fn", fn)
    (grad,) = _gradients(lambda t: ops.sum(fn(t)), [_as_float(x)])
    return grad


def gradient_norms(
    objective: HasGradientFunctions, inputs: Any, *, base_loss: Callable[[Any], Tensor] | None = None
) -> dict[str, float]:
    """‖∂termᵢ/∂inputs‖₂ for each enabled term of a `CompositeObjective`.

    Norms are unweighted and taken over every tensor of `inputs` (a tensor,
    list or dict). `"total"` is ‖∂Σwᵢ·termᵢ/∂inputs‖₂ over the enabled terms.
    With `base_loss`, a callable of `inputs` returning a scalar, the result
    also holds `"base_loss"` and the total includes it.

    Example:

    >>> import numpy as np
    >>> from keras_penalties import CompositeObjective
    >>> from keras_penalties.gradients import gradient_norms
    >>> norms = gradient_norms(CompositeObjective({"l2": "l2"}), np.array([[3.0, 4.0]]))
    >>> round(norms["l2"], 4), round(norms["total"], 4)  # one sample: ‖2x‖ = 10
    (10.0, 10.0)
    """
    if not hasattr(objective, "gradient_functions"):
        raise TypeError(f"`objective` must be a CompositeObjective; got {objective!r}.")
    if base_loss is not None:
        _check_callable("base_loss", base_loss)
    with backend.one_process():  # a measurement on the inputs given, in each process alone
        return function_norms(objective.gradient_functions(base_loss), inputs)


def function_norms(functions: dict[str, Callable[[Any], Tensor]], inputs: Any) -> dict[str, float]:
    """‖∂fᵢ/∂inputs‖₂ for each scalar function of `functions` (name → fn),
    over every tensor of `inputs` (a tensor, list or dict), as floats.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.gradients import function_norms
    >>> function_norms({"sq": lambda x: ops.sum(ops.square(x))}, [3.0, 4.0])  # ‖2x‖ = 10
    {'sq': 10.0}
    """
    if not isinstance(functions, dict):
        raise TypeError(f"`functions` must be a dict of name -> callable; got {functions!r}.")
    for name, fn in functions.items():
        _check_callable(f"functions[{name!r}]", fn)
    flat = [_as_float(t) for t in keras.tree.flatten(inputs)]

    def pack(tensors: Sequence[Tensor]) -> Any:
        return keras.tree.pack_sequence_as(inputs, list(tensors))

    def norm(fn: Callable[..., Tensor]) -> float:
        grads = _gradients(lambda *ts: fn(pack(ts)), flat)
        return float(ops.convert_to_numpy(ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))))

    return {name: norm(fn) for name, fn in functions.items()}


def gradient_penalty(
    fn: Callable[[Tensor], Tensor], x: TensorLike, *, target: float = 1.0, reduction: Reduction = "mean"
) -> Tensor:
    """(‖∇ₓ fn(x)ᵢ‖₂ − target)² per sample: the gradient penalty.

    The norm is over all non-batch axes of the input gradient, with a finite
    (zero) gradient where the input gradient is zero. `target=1` is the
    WGAN-GP penalty (Gulrajani et al., 2017); `target=0` the R1/R2 penalty
    ‖∇ₓ fn(x)‖² (Mescheder et al., 2018). Differentiable again, so adding it to
    a loss trains `fn`'s weights, inside `fit` on every backend.

    Args:
        fn: the critic, a callable of a batch returning one score per sample
            (scores are summed, so samples' gradients stay separate).
        x: the batch, shape [batch, ...].
        target: the gradient norm each sample is pulled towards (≥ 0).
        reduction: `"mean"` (default) or `"sum"` over samples, or `"none"`.

    Example:

    >>> from keras import ops
    >>> from keras_penalties.gradients import gradient_penalty
    >>> critic = lambda x: ops.sum(ops.multiply(x, [3.0, 4.0]), axis=-1)  # ‖∇‖ = 5 everywhere
    >>> float(gradient_penalty(critic, [[1.0, 2.0], [0.0, 0.0]]))  # (5 − 1)²
    16.0
    """
    _check_callable("fn", fn)
    options = penalties.output_magnitude.check_options(target=target, reduction=reduction)
    return penalties.output_magnitude(input_gradient(fn, x), **options)


def interpolated_gradient_penalty(
    fn: Callable[[Tensor], Tensor],
    real: TensorLike,
    fake: TensorLike,
    *,
    target: float = 1.0,
    seed: int | keras.random.SeedGenerator | None = None,
) -> Tensor:
    """WGAN-GP: the gradient penalty at random points between real and fake samples.

    x̂ = ε·real + (1 − ε)·fake with one ε ~ U(0, 1) per sample, drawn with
    `keras.random.uniform`; returns the mean over samples of
    (‖∇ fn(x̂)ᵢ‖₂ − target)².

    Args:
        fn: the critic.
        real, fake: batches of the same shape [batch, ...].
        target: the gradient norm to pull towards.
        seed: an int (the same ε every call: reproducible) or a
            `keras.random.SeedGenerator` (fresh ε each call; inside `fit` on
            JAX it must belong to the model, e.g. `self.seed_generator` set in
            a Model's `__init__`, so its state advances with the step).

    Example:

    >>> from keras import ops
    >>> from keras_penalties.gradients import interpolated_gradient_penalty
    >>> critic = lambda x: ops.sum(ops.multiply(x, [3.0, 4.0]), axis=-1)
    >>> float(interpolated_gradient_penalty(critic, [[1.0, 2.0]], [[0.0, 1.0]], seed=0))
    16.0
    """
    _check_callable("fn", fn)
    penalties.output_magnitude.check_options(target=target)
    real, fake = ops.convert_to_tensor(real), ops.convert_to_tensor(fake)
    for name, t in (("real", real), ("fake", fake)):
        if not keras.backend.is_float_dtype(t.dtype):
            raise TypeError(
                f"`{name}` must be a floating-point batch (the critic is differentiated "
                f"at points between real and fake); got dtype {keras.backend.standardize_dtype(t.dtype)}."
            )
    if tuple(real.shape) != tuple(fake.shape):
        raise ValueError(
            f"`real` and `fake` must have the same shape; got {tuple(real.shape)} and {tuple(fake.shape)}."
        )
    shape = (ops.shape(real)[0],) + (1,) * (len(real.shape) - 1)
    epsilon = keras.random.uniform(shape, dtype=real.dtype, seed=seed)
    mixed = epsilon * real + (1.0 - epsilon) * ops.cast(fake, real.dtype)
    return gradient_penalty(fn, mixed, target=target)


def parameter_probe(
    model: keras.Model,
    outputs_fn: Callable[[Any, Any], list[Tensor]],
    num_outputs: int,
    *,
    grad_norms: bool = True,
    variables: Sequence[keras.Variable] | None = None,
    batched: bool = False,
    update: tuple[Callable[[Tensor, Tensor], Tensor], Sequence[keras.Variable]] | None = None,
) -> Callable[[Any, Any], tuple[np.ndarray, ...]]:
    """Builds, once, a probe of a model's penalty terms and their gradient norms.

    `outputs_fn(x, y)` is backend-agnostic code that calls the model and
    returns a list of `num_outputs` scalars (term values, losses); each
    one's gradient is taken on its own, through only what it depends on (a
    stacked vector would make every backward pass cover the whole model). It runs
    inside a `keras.StatelessScope`: the variables are read through the scope
    (on torch the non-trainable ones as they are: the same tensors) and
    whatever the forward pass assigns (running statistics, metric
    trackers) is discarded, so probing changes no state. Under a distribution
    strategy it runs as one device on the whole batch. The returned
    `probe(x, y)` (arrays or tensors) gives `(values, norms)` as NumPy arrays, `norms[i]` being
    ‖∂ outputs[i] / ∂θ‖₂ over all of `model.trainable_variables`, or over
    `variables` (some of them, e.g. one layer's weights) when given (`None`
    when `grad_norms` is false). It is compiled once (jax.jit, tf.function)
    and leaves no `.grad` on torch tensors. With `batched`, where every
    output reaches `variables` through the same layers (GradNorm's terms,
    through its shared layer), eager torch takes the gradients in one
    backward pass batched over the outputs, each node dispatched once: the
    pass then holds its intermediate gradients once an output. Where vmap
    cannot batch a backward (the chunked ops' loops write in place) it
    takes a pass an output from then on. With `update`, `(fn, state)`,
    `fn(values, norms)` (backend-agnostic code on the float32 vectors) runs
    after the measurement in the same compiled call, outside its stateless
    scope, reading the model's variables as they are and assigning the
    model's (not `variables`) or those of `state` (the caller's); the probe
    then gives `(values, norms, result)`, `result` being what `fn` returned.
    """
    trainable = list(model.trainable_variables if variables is None else variables)
    others = [v for v in model.variables + model.metrics_variables if not any(v is t for t in trainable)]

    def outputs(
        trainable_values: Sequence[Tensor], other_values: Sequence[Tensor] | None, x: Any, y: Any
    ) -> list[Tensor]:
        mapping = list(zip(trainable, trainable_values))
        if other_values is None:
            # The others read as they are (a backend whose variables hold the
            # tensors it differentiates): all but the trainable ones, whose
            # regularizers Keras reads from the scope alone.
            mapping += [(v, v.value) for v in others if v.trainable]
        else:
            mapping += list(zip(others, other_values))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
            return outputs_fn(x, y)

    probe = backend.parameter_probe(trainable, others, outputs, num_outputs, grad_norms, batched, update)

    def numpy_probe(x: Any, y: Any) -> tuple[np.ndarray, ...]:
        # NumPy batches become tensors, as jit and tf.function make them, so
        # `outputs_fn` reads tensors on torch too.
        x, y = (None if t is None else keras.tree.map_structure(backend.as_tensor, t) for t in (x, y))
        values, norms, result = probe(x, y)
        numpy: tuple[Any, ...] = ops.convert_to_numpy(values), None if norms is None else ops.convert_to_numpy(norms)
        return numpy if update is None else (*numpy, ops.convert_to_numpy(result))

    return numpy_probe
