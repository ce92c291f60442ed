"""Functional penalties, written once in `keras.ops`.

Every formula in keras-penalties lives here; the regularizer, loss and
composition classes call these functions. Each is a pure, differentiable
function of tensors that runs inside `jit` on JAX, TensorFlow and PyTorch.
Options are keyword-only.
"""

from typing import get_args

from keras_penalties._types import PenaltyName
from keras_penalties.ops.divergences import (
    consistency,
    entropy,
    gaussian_kl,
    js_divergence,
    kl_divergence,
    kl_sparsity,
)
from keras_penalties.ops._tokens import LinearLogits
from keras_penalties.ops.heads import cross_entropy, linear
from keras_penalties.ops.magnitude import elastic_net, l1, l2, output_magnitude
from keras_penalties.ops.orthogonality import orthogonality

__all__ = [
    "LinearLogits",
    "consistency",
    "cross_entropy",
    "elastic_net",
    "entropy",
    "gaussian_kl",
    "js_divergence",
    "kl_divergence",
    "kl_sparsity",
    "l1",
    "l2",
    "linear",
    "orthogonality",
    "output_magnitude",
]

# The functions a `Term` may name: each returns a scalar penalty (not
# `linear`, which describes logits for them).
PENALTIES = get_args(PenaltyName)
