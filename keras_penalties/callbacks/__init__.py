"""Callbacks: `PenaltyMonitor` (every penalty term's value, and gradient
norms, in the training logs) and the adaptive weightings
`DynamicWeightAverage` and `GradNorm`."""

from keras_penalties.callbacks.dynamic_weight_average import DynamicWeightAverage
from keras_penalties.callbacks.grad_norm import GradNorm, clip_and_renormalise, gradnorm_gradient
from keras_penalties.callbacks.penalty_monitor import PenaltyMonitor

__all__ = ["PenaltyMonitor", "DynamicWeightAverage", "GradNorm", "gradnorm_gradient", "clip_and_renormalise"]
