"""Functional penalties, written once in `keras.ops`.

Every formula in keras-penalties lives here; the regularizer, loss and
composition classes call these functions. Each is a pure, differentiable
function of tensors that runs inside `jit` on JAX, TensorFlow and PyTorch.
Options are keyword-only.
"""

from keras_penalties.ops.divergences import (
    consistency,
    entropy,
    gaussian_kl,
    js_divergence,
    kl_divergence,
    kl_sparsity,
)
from keras_penalties.ops.magnitude import elastic_net, l1, l2, output_magnitude
from keras_penalties.ops.orthogonality import orthogonality

__all__ = [
    "consistency",
    "elastic_net",
    "entropy",
    "gaussian_kl",
    "js_divergence",
    "kl_divergence",
    "kl_sparsity",
    "l1",
    "l2",
    "orthogonality",
    "output_magnitude",
]
