"""`LossState`: the layer that carries a `CompositeLoss`'s variables into
the model that compiles it."""

from typing import Any

import keras

from keras_penalties._composite import WeightState
from keras_penalties._term_means import RunningSums
from keras_penalties._types import Weighting
from keras_penalties.terms import Term


class LossState(keras.layers.Layer):
    """The variables of a `CompositeLoss`: its term weights and enabled flags
    (float32, never autocast) and, with `weighting="uncertainty"`, the
    trainable log-variances, or with `weighting="famo"` FAMO's state; and
    the running sums of its term values. Keras gives a loss no model, so
    the loss adds this layer to the model that compiles it (see
    `CompositeLoss.attach`); its variables then travel in the model's
    training state like a layer's, and `.keras` files save the weights'
    with the loss (the running sums are a run's, not saved)."""

    def __init__(self, terms: dict[str, Term], weighting: Weighting, name: str, reported: int) -> None:
        super().__init__(name=name, trainable=True, autocast=False)
        self.weight_state = WeightState(self, terms, weighting)
        self.running_sums = RunningSums(self, reported)
        self.built = True

    def call(self, inputs: Any) -> Any:
        return inputs

    def _saved(self) -> list[Any]:
        running = self.running_sums.variables
        return [v for v in self.trainable_weights + self.non_trainable_weights if all(v is not r for r in running)]

    def save_own_variables(self, store: Any) -> None:
        for i, variable in enumerate(self._saved()):
            store[f"{i}"] = variable

    def load_own_variables(self, store: Any) -> None:
        saved = self._saved()
        if len(store.keys()) != len(saved):
            raise ValueError(
                f"Layer '{self.name}' expected {len(saved)} variables, but received {len(store.keys())} "
                "variables during loading."
            )
        for i, variable in enumerate(saved):
            variable.assign(store[f"{i}"])
