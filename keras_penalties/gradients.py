"""Backend-agnostic autodiff: the one module that branches on the Keras backend.

Keras 3 has no multi-backend gradient op, so this module dispatches to
`jax.grad`, `tf.GradientTape` or `torch.autograd.grad`. Every other module in
keras-penalties is plain `keras.ops`.
"""

import keras
from keras import ops


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
    x = ops.convert_to_tensor(x)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        x = ops.cast(x, keras.config.floatx())
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.grad(lambda t: ops.sum(fn(t)))(x)
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.sum(fn(x))
        return tape.gradient(y, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if backend == "torch":
        import torch

        with torch.enable_grad():
            # A tensor outside the graph gets a leaf of its own; one inside it
            # is used as is, so the gradient stays connected to what made it.
            if not x.requires_grad:
                x = x.detach().requires_grad_(True)
            y = torch.sum(fn(x))
            if not y.requires_grad:
                return torch.zeros_like(x)
            (grad,) = torch.autograd.grad(y, x, create_graph=True, allow_unused=True)
        return torch.zeros_like(x) if grad is None else grad
    raise RuntimeError(
        f"keras_penalties.gradients supports the jax, tensorflow and torch "
        f"backends; the current backend is {backend!r}."
    )
