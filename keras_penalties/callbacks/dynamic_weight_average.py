"""`DynamicWeightAverage`: term weights from how fast each term falls, set
at each epoch's end."""

from typing import Any

import keras
import numpy as np

from keras_penalties import _validation as check
from keras_penalties.composite.state import term_means
from keras_penalties._types import Logs
from keras_penalties.callbacks._targets import _add_to_model, _check_target, _log_weights, _settable_target, _Target


class DynamicWeightAverage(keras.callbacks.Callback):
    """Dynamic Weight Average (Liu et al., 2019): weights from how fast each term falls.

    At the end of epoch e ≥ 1 it sets the weights of epoch e + 1 to
    wᵢ = K·exp(rᵢ/T) / Σⱼ exp(rⱼ/T) with rᵢ = Lᵢ(e) / Lᵢ(e − 1), the ratio of
    the term's unweighted epoch means (K terms; a term whose previous mean is
    0 gets r = 1). The first two epochs of each `fit` use weight 1, replacing
    the Terms' weights. Each epoch's logs (History, TensorBoard) get
    `"<target>/<term>/weight"`: the weight used during that epoch.

    Args:
        target: a `CompositeObjective` or `CompositeLoss` of the model, or
            its name.
        temperature: T > 0; large T gives equal weights.

    Example:

    ```python
    model.fit(x, y, epochs=20, callbacks=[DynamicWeightAverage("objective")])
    ```
    """

    def __init__(self, target: _Target, temperature: float = 2.0) -> None:
        super().__init__()
        self.target_spec = _check_target(target)
        self.temperature = check.positive("temperature", temperature)
        self.target: Any = None  # the CompositeObjective or CompositeLoss, from set_model
        self.epoch_means: list[np.ndarray] = []

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.target = _settable_target(model, self.target_spec, "DynamicWeightAverage")
        _add_to_model(model, [term_means(self.target)])

    def _set(self, weights):
        self.model  # noqa: B018 -- on JAX, reading .model syncs the training state first
        self.target.set_term_weights(weights)

    def on_train_begin(self, logs: Logs = None) -> None:
        self.epoch_means = []
        self._set(np.ones(len(self.target.terms)))

    def _epoch_means(self, logs):
        """The target's training means of the epoch: from the epoch's logs,
        where Keras put its metric's result before validation reset it; else
        (a custom `train_step` that returns other logs) from the metric."""
        keys = [f"{self.target.name}/{name}" for name in self.target.terms]
        if logs is None or not all(key in logs for key in keys):
            self.model  # noqa: B018 -- on JAX, reading .model syncs the training state first
            metric = term_means(self.target)
            logs = metric.result()
        return np.array([float(logs[key]) for key in keys], "float64")

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        self.epoch_means.append(self._epoch_means(logs))
        _log_weights(self.target, logs)
        if len(self.epoch_means) >= 2:
            current, previous = self.epoch_means[-1], self.epoch_means[-2]
            ratios = np.divide(current, previous, out=np.ones_like(current), where=previous != 0)
            scaled = ratios / self.temperature
            scaled = np.exp(scaled - scaled.max())
            self._set(len(scaled) * scaled / scaled.sum())

    def get_config(self) -> dict[str, Any]:
        target = self.target_spec if isinstance(self.target_spec, str) else self.target_spec.name
        return {"target": target, "temperature": self.temperature}
