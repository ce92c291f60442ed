"""`ReferenceSync`: a reference model that follows the policy (TR-DPO)."""

from typing import Any

import keras

from keras_penalties import _validation as check
from keras_penalties._types import Logs


class ReferenceSync(keras.callbacks.Callback):
    """Every `every` optimizer steps the reference becomes α·policy +
    (1 − α)·reference, weight by weight (TR-DPO, Gorbatovski et al., 2024;
    TRL's `sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`).

    For a `PreferenceModel` or a `PolicyModel` with a reference (a copy, a
    model of the policy's architecture, or one loaded from a `.keras`
    file); a model without one is a ValueError when training begins. On
    JAX, where `fit` holds the weights outside the model, the weights are
    brought back to the model only at a sync (`callback.model`), so the
    steps between cost nothing.

    Args:
        alpha: α in [0, 1] (1: the reference is the policy's copy).
        every: optimizer steps between syncs, an int ≥ 1.

    Example:

    ```python
    model.fit(pairs, epochs=3, callbacks=[ReferenceSync(alpha=0.6, every=512)])
    ```
    """

    def __init__(self, alpha: float = 0.6, every: int = 512) -> None:
        super().__init__()
        self.alpha = check.closed_unit("alpha", alpha)
        self.every = check.positive_integer("every", every)
        self.steps, self.epoch_start, self.syncs = 0, 0, 0

    def on_train_begin(self, logs: Logs = None) -> None:
        if getattr(self.model, "reference", None) is None:
            raise ValueError(
                f"ReferenceSync: {self.model.name} has no reference model to sync; give it reference='copy' "
                "(or a model), not None."
            )
        self.steps, self.epoch_start, self.syncs = 0, 0, 0

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self.epoch_start = self.steps

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        # `batch` is the epoch's last step done (several a call with
        # `steps_per_execution`): optimizer steps, not calls, are counted.
        self.steps = self.epoch_start + batch + 1
        while (self.syncs + 1) * self.every <= self.steps:
            self.syncs += 1
            self.sync()

    def sync(self) -> None:
        """The reference's weights mixed with the policy's now."""
        model: Any = self.model  # on JAX, the trainer's weights back in the variables first
        policy, reference = model.policy.weights, model.reference.weights
        if len(policy) != len(reference) or any(p.shape != r.shape for p, r in zip(policy, reference)):
            raise ValueError(
                f"ReferenceSync: the reference's weights do not match the policy's ({len(reference)} against "
                f"{len(policy)}): it must have the policy's architecture."
            )
        for p, r in zip(policy, reference):
            r.assign(self.alpha * keras.ops.cast(p.value, r.dtype) + (1.0 - self.alpha) * r.value)
