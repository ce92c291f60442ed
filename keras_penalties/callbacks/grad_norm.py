"""`GradNorm`: term weights that balance the terms' gradient norms, stepped
on every probe by an optimizer of their own; and its NumPy math."""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Logs
from keras_penalties.callbacks._probe import _Probe, _probe_batch
from keras_penalties.callbacks._targets import (
    _add_to_model,
    _check_target,
    _layers,
    _log_weights,
    _settable_target,
    _Target,
)
from keras_penalties.losses import CompositeLoss


class GradNorm(keras.callbacks.Callback):
    """GradNorm (Chen et al., 2018): weights that balance the terms' gradient norms.

    Every `every_n_batches` training batches it probes `probe_data` (as
    `PenaltyMonitor` does: compiled once, in inference mode, changing no
    state) for each term's unweighted value Lᵢ and gradient norm
    gᵢ = ‖∇_W termᵢ‖ with respect to all of `layer`'s trainable weights W
    (the last shared layer). As the paper trains them, the weights wᵢ are
    parameters of L_grad = Σᵢ |Gᵢ − Ḡ·rᵢ^α|, with Gᵢ = wᵢ·gᵢ, Ḡ their mean,
    rᵢ = (Lᵢ/Lᵢ(0)) / meanⱼ(Lⱼ/Lⱼ(0)) and the target Ḡ·rᵢ^α held constant:
    each probe takes one step of `optimizer` on

        ∂L_grad/∂wᵢ = sign(Gᵢ − Ḡ·rᵢ^α) · gᵢ,

    then clips the weights at 0 and rescales them so Σwᵢ = K (K terms).
    Adam's per-weight normalisation removes the scale of gᵢ, so a term with
    small gradients moves as fast as one with large ones (a plain signed step
    of size ∝ gᵢ starves it). Lᵢ(0) is the first probe of each `fit`. The
    batch logs of a probe (progress bar) and each epoch's logs (History) get
    `"<target>/<term>/weight"`, the weight in use after the latest probe.

    Args:
        target: a `CompositeObjective` or `CompositeLoss` of the model, or
            its name.
        layer: the shared layer (or its name) whose weights the norms are
            taken over.
        alpha: α ≥ 0, how strongly slower terms are pulled up (0: equal norms).
        optimizer: the weights' own optimizer, a `keras.optimizers.Optimizer`
            instance (or identifier) that is not the model's. GradNorm steps
            a copy of it (same class and config) whose state is the weights'
            alone and lasts across `fit` calls. Default
            `keras.optimizers.Adam(0.025)`, the paper's and LibMTL's.
        probe_data: `(x, y)` or `x`, a fixed batch (`y` is needed for a
            `CompositeLoss`).
        every_n_batches: probe every this many training batches (≥ 1).

    It overrides `on_train_batch_end` (the weights must be set before the
    next step), so while it is among the callbacks Keras dispatches batch
    ends synchronously.

    Attributes:
        history: one dict per probe: `"step"`, `"values"`, `"grad_norms"`
            and `"weights"` (after the update), each a dict by term.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_penalties.callbacks import GradNorm
    >>> gradnorm = GradNorm("objective", "shared", probe_data=(np.zeros((4, 3)), np.zeros((4, 1))))
    >>> type(gradnorm.optimizer).__name__, round(float(ops.convert_to_numpy(gradnorm.optimizer.learning_rate)), 6)
    ('Adam', 0.025)
    """

    def __init__(
        self,
        target: _Target,
        layer: keras.layers.Layer | str,
        *,
        alpha: float = 1.5,
        optimizer: keras.optimizers.Optimizer | str | dict[str, Any] | None = None,
        probe_data: Any,
        every_n_batches: int = 1,
    ) -> None:
        super().__init__()
        self.target_spec = _check_target(target)
        if not (isinstance(layer, keras.layers.Layer) or (isinstance(layer, str) and layer)):
            raise TypeError(f"`layer` must be a Layer of the model or its name; got {layer!r}.")
        self.layer_spec = layer
        self.alpha = check.non_negative("alpha", alpha)
        self.optimizer = _own_optimizer(optimizer)
        self.every_n_batches = check.positive_integer("every_n_batches", every_n_batches)
        if probe_data is None:
            raise TypeError("`probe_data` is required: GradNorm measures gradient norms on a fixed batch.")
        self.probe_data = _probe_batch(probe_data)
        self.target: Any = None  # the CompositeObjective or CompositeLoss, from set_model
        self.layer: Any = None
        self.history: list[dict[str, Any]] = []
        self._probes: dict[int, _Probe] = {}
        # The weights as the optimizer's variable (before clipping), and the
        # step of the copy of `optimizer` that moves them, both made through
        # `backend.outside_distribution`.
        self._weights = self._apply = None

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if self.optimizer is getattr(model, "optimizer", None):
            raise ValueError(
                "`optimizer` is the model's optimizer; GradNorm's weights need one of their own "
                "(its state would mix with the model's). Pass a new instance, e.g. keras.optimizers.Adam(0.025)."
            )
        self.target = _settable_target(model, self.target_spec, "GradNorm")
        layers = _layers(model)
        found = [layer for layer in layers if layer is self.layer_spec or layer.name == self.layer_spec]
        if not found:
            raise ValueError(f"`layer` {self.layer_spec!r} is not a layer of the model.")
        self.layer = found[0]
        if not self.layer.trainable_weights:
            raise ValueError(f"`layer` {self.layer.name!r} has no trainable weights to take gradient norms over.")
        if isinstance(self.target, CompositeLoss):
            if self.probe_data[1] is None:
                raise ValueError("`probe_data` must be (x, y) for a CompositeLoss target: its terms need y.")
            _add_to_model(model, [])

    def _probe(self):
        model = self.model  # syncs JAX state
        if id(model) not in self._probes:
            # The terms as they count in the loss: a shared objective's calls summed.
            # Every term reaches the shared layer through the heads: their
            # gradients are taken in one batched backward pass (eager torch).
            self._probes[id(model)] = _Probe(
                model,
                [self.target],
                everything=False,
                calls="sum",
                variables=list(self.layer.trainable_weights),
                batched=True,
            )
        return self._probes[id(model)]

    def _step_weights(self, weights, gradient):
        """One step of the optimizer from `weights` along `gradient` (NumPy).

        It runs through `backend.outside_distribution`, on the package's
        host thread where a distribution or a dtype policy is in effect:
        Keras' and TF's distribution and dtype-policy state is per thread,
        so the weights and the optimizer's state are plain float32
        variables there even while `fit` runs inside a `tf.distribute`
        scope (where an optimizer applied from a callback has no replica
        context) or a Keras distribution."""

        def step():
            if self._weights is None or tuple(self._weights.shape) != weights.shape:
                self._weights = keras.Variable(
                    weights.astype("float32"), dtype="float32", trainable=True, name="gradnorm_weights"
                )
                # A copy built here: one made in a strategy scope applies only there.
                stepper = type(self.optimizer).from_config(self.optimizer.get_config())
                self._apply = backend.optimizer_step(stepper, [self._weights])
            (new,) = self._apply([weights.astype("float32")], [gradient.astype("float32")])
            return np.asarray(ops.convert_to_numpy(new), "float64")

        return backend.outside_distribution(step)

    def on_train_begin(self, logs: Logs = None) -> None:
        self._step = 0
        self._initial: np.ndarray | None = None

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._step += 1
        if self._step % self.every_n_batches:
            return
        values, norms = self._probe()(*self.probe_data)
        values, norms = np.asarray(values, "float64"), np.asarray(norms, "float64")
        if self._initial is None:
            self._initial = values
        weights = np.array(list(self.target.weights_in_use().values()), "float64")
        gradient = gradnorm_gradient(weights, values, norms, self._initial, self.alpha)
        new = clip_and_renormalise(self._step_weights(weights, gradient))
        self.target._set_weights(new)
        names = list(self.target.terms)
        self.history.append(
            {
                "step": self._step,
                "values": dict(zip(names, values.tolist())),
                "grad_norms": dict(zip(names, norms.tolist())),
                "weights": dict(zip(names, new.tolist())),
            }
        )
        _log_weights(self.target, logs, new)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        self.model  # noqa: B018
        _log_weights(self.target, logs)


def _own_optimizer(optimizer):
    """GradNorm's `optimizer`: None (Adam(0.025)), an optimizer instance or a
    Keras identifier."""
    if optimizer is None:
        return keras.optimizers.Adam(learning_rate=0.025)
    if isinstance(optimizer, type):
        raise TypeError(f"`optimizer` must be an optimizer instance; got the class {optimizer.__name__}.")
    if isinstance(optimizer, (str, dict)):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError as error:
            raise ValueError(f"`optimizer`: {error}") from error
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a keras.optimizers.Optimizer; got {optimizer!r}.")
    return optimizer


def gradnorm_gradient(
    weights: np.ndarray, values: np.ndarray, norms: np.ndarray, initial: np.ndarray, alpha: float
) -> np.ndarray:
    """∂L_grad/∂wᵢ = sign(Gᵢ − Ḡ·rᵢ^α)·gᵢ (NumPy, float64), as `GradNorm` documents."""
    weighted = weights * norms
    ratios = np.divide(values, initial, out=np.ones_like(values), where=initial != 0)
    relative = ratios / ratios.mean() if ratios.mean() > 0 else np.ones_like(ratios)
    goal = weighted.mean() * relative**alpha
    return np.sign(weighted - goal) * norms


def clip_and_renormalise(weights: np.ndarray) -> np.ndarray:
    """The weights clipped at 0 and rescaled to sum to their count (all 1 if none is left)."""
    clipped = np.maximum(weights, 0.0)
    total = clipped.sum()
    return clipped * len(clipped) / total if total > 0 else np.ones_like(clipped)
