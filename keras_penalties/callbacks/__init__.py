"""Callbacks: `PenaltyMonitor` (every penalty term's value, and gradient
norms, in the training logs), the adaptive weightings
`DynamicWeightAverage` and `GradNorm`, and `ReferenceSync` (a reference
model that follows the policy)."""

from keras_penalties.callbacks.dynamic_weight_average import DynamicWeightAverage
from keras_penalties.callbacks.grad_norm import GradNorm, clip_and_renormalise, gradnorm_gradient
from keras_penalties.callbacks.penalty_monitor import PenaltyMonitor
from keras_penalties.callbacks.reference_sync import ReferenceSync

__all__ = [
    "PenaltyMonitor",
    "DynamicWeightAverage",
    "GradNorm",
    "gradnorm_gradient",
    "clip_and_renormalise",
    "ReferenceSync",
]
