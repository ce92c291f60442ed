"""Backend-agnostic autodiff: the one module that branches on the Keras backend.

Keras 3 has no multi-backend gradient op, so this module dispatches to
`jax.grad`, `tf.GradientTape` or `torch.autograd.grad`. Every other module in
keras-penalties is plain `keras.ops`.
"""

import keras
from keras import ops


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
