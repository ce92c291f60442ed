"""Functional penalties, written once in `keras.ops`.

Every formula in keras-penalties lives here; the regularizer, loss and
composition classes call these functions. Each is a pure, differentiable
function of tensors that runs inside `jit` on JAX, TensorFlow and PyTorch.
Options are keyword-only.
"""

# Re-exported by name (`x as x`); `__all__` adds the penalty names from one list.
import typing as _typing

from keras_penalties._types import PenaltyName as _PenaltyName
from keras_penalties.ops.divergences import (
    consistency as consistency,
    entropy as entropy,
    gaussian_kl as gaussian_kl,
    js_divergence as js_divergence,
    kl_divergence as kl_divergence,
    kl_sparsity as kl_sparsity,
)
from keras_penalties.ops._tokens import LinearLogits as LinearLogits
from keras_penalties.ops.heads import cross_entropy as cross_entropy, linear as linear, token_logprobs as token_logprobs
from keras_penalties.ops.magnitude import (
    elastic_net as elastic_net,
    l1 as l1,
    l2 as l2,
    output_magnitude as output_magnitude,
)
from keras_penalties.ops.off_policy import importance_weights as importance_weights, off_policy_mask as off_policy_mask
from keras_penalties.ops.orthogonality import orthogonality as orthogonality
from keras_penalties.ops.policy import (
    clip_fraction as clip_fraction,
    kl_estimate as kl_estimate,
    policy_loss as policy_loss,
)
from keras_penalties.ops.preference import (
    preference_loss as preference_loss,
    preference_reward as preference_reward,
)
from keras_penalties.ops.returns import discounted_cumsum as discounted_cumsum
from keras_penalties.ops.routers import router_load_balancing as router_load_balancing, router_z_loss as router_z_loss
from keras_penalties.ops.token_masks import entropy_mask as entropy_mask, trust_region_mask as trust_region_mask
from keras_penalties.ops.topk import topk_kl as topk_kl
from keras_penalties.ops.unpaired import unpaired_preference_loss as unpaired_preference_loss

# The functions a `Term` may name: each returns a scalar penalty.
PENALTIES = _typing.get_args(_PenaltyName)
# The others return tensors (logits described, per-token values, weights,
# masks, fractions), called in the model, the training step or the data
# pipeline.
TENSOR_OPS = (
    "LinearLogits",
    "linear",
    "token_logprobs",
    "importance_weights",
    "off_policy_mask",
    "clip_fraction",
    "discounted_cumsum",
    "trust_region_mask",
    "entropy_mask",
)

__all__ = [*TENSOR_OPS, *PENALTIES]
