"""Backend-agnostic autodiff: the one module that branches on the Keras backend.

Keras 3 has no multi-backend gradient op, so this module dispatches to
`jax.grad`, `tf.GradientTape` or `torch.autograd.grad`. Every other module in
keras-penalties is plain `keras.ops`.
"""

import functools

import keras
from keras import ops

from keras_penalties import ops as penalties


def _as_float(x):
    x = ops.convert_to_tensor(x)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        x = ops.cast(x, keras.config.floatx())
    return x


def _gradients(fn, tensors):
    """Gradients of the scalar `fn(*tensors)` w.r.t. each of `tensors`, kept
    differentiable (double backprop) on every backend."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return list(jax.grad(lambda ts: fn(*ts))(list(tensors)))
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            for t in tensors:
                tape.watch(t)
            y = fn(*tensors)
        return tape.gradient(y, list(tensors), unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if backend == "torch":
        import torch

        with torch.enable_grad():
            # A tensor outside the graph gets a leaf of its own; one inside it
            # is used as is, so the gradient stays connected to what made it.
            tensors = [t if t.requires_grad else t.detach().requires_grad_(True) for t in tensors]
            y = fn(*tensors)
            if not y.requires_grad:
                return [torch.zeros_like(t) for t in tensors]
            grads = torch.autograd.grad(y, tensors, create_graph=True, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]
    raise RuntimeError(
        f"keras_penalties.gradients supports the jax, tensorflow and torch "
        f"backends; the current backend is {backend!r}."
    )


def input_gradient(fn, x):
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
    (grad,) = _gradients(lambda t: ops.sum(fn(t)), [_as_float(x)])
    return grad


def gradient_norms(objective, inputs, *, base_loss=None):
    """‖∂termᵢ/∂inputs‖₂ for each enabled term of a `CompositeObjective`.

    Norms are unweighted and taken over every tensor of `inputs` (a tensor,
    list or dict). `"total"` is ‖∂Σwᵢ·termᵢ/∂inputs‖₂ over the enabled terms.
    With `base_loss`, a callable of `inputs` returning a scalar, the result
    also holds `"base_loss"` and the total includes it.

    Example:

    >>> from keras_penalties import CompositeObjective
    >>> from keras_penalties.gradients import gradient_norms
    >>> norms = gradient_norms(CompositeObjective({"l2": "l2"}), [[3.0, 4.0]])
    >>> round(norms["l2"], 4), round(norms["total"], 4)  # ‖2x‖ = 10
    (10.0, 10.0)
    """
    flat = [_as_float(t) for t in keras.tree.flatten(inputs)]

    def pack(tensors):
        return keras.tree.pack_sequence_as(inputs, list(tensors))

    def norm(fn):
        grads = _gradients(lambda *ts: fn(pack(ts)), flat)
        return float(ops.convert_to_numpy(ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))))

    norms = {
        name: norm(lambda x, name=name: objective.term_value(name, x))
        for name, term in objective.terms.items()
        if term.enabled
    }
    if base_loss is None:
        norms["total"] = norm(lambda x: objective.compute(x)[0])
    else:
        norms["base_loss"] = norm(base_loss)
        norms["total"] = norm(lambda x: objective.compute(x)[0] + base_loss(x))
    return norms


def gradient_penalty(fn, x, *, target=1.0, reduction="mean"):
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
    options = penalties.output_magnitude.check_options(target=target, reduction=reduction)
    return penalties.output_magnitude(input_gradient(fn, x), **options)


def interpolated_gradient_penalty(fn, real, fake, *, target=1.0, seed=None):
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
    penalties.output_magnitude.check_options(target=target)
    real, fake = ops.convert_to_tensor(real), ops.convert_to_tensor(fake)
    if tuple(real.shape) != tuple(fake.shape):
        raise ValueError(
            f"`real` and `fake` must have the same shape; got {tuple(real.shape)} and {tuple(fake.shape)}."
        )
    shape = (ops.shape(real)[0],) + (1,) * (len(real.shape) - 1)
    epsilon = keras.random.uniform(shape, dtype=real.dtype, seed=seed)
    mixed = epsilon * real + (1.0 - epsilon) * ops.cast(fake, real.dtype)
    return gradient_penalty(fn, mixed, target=target)


def parameter_probe(model, outputs_fn, num_outputs, *, grad_norms=True):
    """Builds, once, a probe of a model's penalty terms and their gradient norms.

    `outputs_fn(x, y)` is backend-agnostic code that calls the model and
    returns a list of `num_outputs` scalars (term values, losses); each
    one's gradient is taken on its own, through only what it depends on (a
    stacked vector would make every backward pass cover the whole model). It runs
    inside a `keras.StatelessScope`: every variable is read through the scope
    and whatever the forward pass assigns (running statistics, metric
    trackers) is discarded, so probing changes no state. The returned
    `probe(x, y)` gives `(values, norms)` as NumPy arrays, `norms[i]` being
    ‖∂ outputs[i] / ∂θ‖₂ over all of `model.trainable_variables` (`None` when
    `grad_norms` is false). It is compiled once (jax.jit, tf.function) and
    leaves no `.grad` on torch tensors.
    """
    trainable = list(model.trainable_variables)
    others = [v for v in model.variables + model.metrics_variables if not any(v is t for t in trainable)]

    def outputs(trainable_values, other_values, x, y):
        mapping = list(zip(trainable, trainable_values)) + list(zip(others, other_values))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
            return outputs_fn(x, y)

    def norm(grads):
        return ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads))

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        @jax.jit
        def run(trainable_values, other_values, x, y):
            if not grad_norms:
                return ops.stack(outputs(trainable_values, other_values, x, y)), None

            def entry(i, tv):
                values = outputs(tv, other_values, x, y)
                return values[i], ops.stack(values)

            # One gradient per output: JAX keeps the other outputs' zero
            # cotangents symbolic, so each backward pass covers only what its
            # output depends on (a kernel regularizer: its kernel), and XLA
            # merges the repeated forward passes.
            norms = []
            for i in range(num_outputs):
                (_, values), grads = jax.value_and_grad(functools.partial(entry, i), has_aux=True)(trainable_values)
                norms.append(norm(grads))
            return values, ops.stack(norms)

        def probe(x, y):
            return run([v.value for v in trainable], [v.value for v in others], x, y)

    elif backend == "tensorflow":
        import tensorflow as tf

        @tf.function(reduce_retracing=True)
        def probe(x, y):
            values_in = [tf.identity(v.value) for v in trainable]
            other_values = [tf.identity(v.value) for v in others]
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(values_in)
                entries = outputs(values_in, other_values, x, y)
            values = tf.stack(entries)
            if not grad_norms:
                return values, None
            # Each entry's gradient traverses only the ops it depends on.
            zero = tf.UnconnectedGradients.ZERO
            return values, tf.stack([norm(tape.gradient(e, values_in, unconnected_gradients=zero)) for e in entries])

    elif backend == "torch":
        import torch

        def probe(x, y):
            params = [v.value for v in trainable]
            with torch.enable_grad():
                entries = outputs(params, [v.value for v in others], x, y)
                values = torch.stack([e.detach() for e in entries])
                if not grad_norms:
                    return values, None
                norms = []
                for entry in entries:
                    # Each entry's backward traverses only its own graph.
                    if not entry.requires_grad:
                        norms.append(torch.zeros(()))
                        continue
                    grads = torch.autograd.grad(entry, params, retain_graph=True, allow_unused=True)
                    norms.append(norm([g for g in grads if g is not None]) if any(g is not None for g in grads) else torch.zeros(()))
            return values, torch.stack(norms).detach()

    else:
        raise RuntimeError(f"parameter_probe supports jax, tensorflow and torch; got {backend!r}.")

    def numpy_probe(x, y):
        values, norms = probe(x, y)
        return ops.convert_to_numpy(values), None if norms is None else ops.convert_to_numpy(norms)

    return numpy_probe
