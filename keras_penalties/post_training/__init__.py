"""Post-training that fits: causal LMs trained on preferences and policy
gradients as `keras.Model`s that `compile` and `fit` train on every backend,
as `keras.distillation.Distiller` trains a student."""

from keras_penalties.post_training.policy import PolicyModel
from keras_penalties.post_training.preference import PreferenceModel
from keras_penalties.post_training.rollouts import Rollouts

__all__ = ["PolicyModel", "PreferenceModel", "Rollouts"]
