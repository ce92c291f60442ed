"""`GradNorm`: term weights that balance the terms' gradient norms, stepped
on every probe by an optimizer of their own; and its math."""

from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Logs, Tensor, TensorLike
from keras_penalties.callbacks._probe import _Probe, _probe_batch
from keras_penalties.callbacks._targets import (
    _add_to_model,
    _check_target,
    _layers,
    _log_weights,
    _settable_target,
    _Target,
)
from keras_penalties.composite.loss import CompositeLoss


class _State(NamedTuple):
    """GradNorm's variables: the weights its optimizer steps, each term's
    value at a fit's first probe Lᵢ(0), whether the next probe is a fit's
    first (1 or 0), and α."""

    weights: keras.Variable
    initial: keras.Variable
    first_probe: keras.Variable
    alpha: keras.Variable


class GradNorm(keras.callbacks.Callback):
    """GradNorm (Chen et al., 2018): weights that balance the terms' gradient norms.

    Every `every_n_batches` training batches it probes `probe_data` (as
    `PenaltyMonitor` does: compiled once, in inference mode, changing no
    state of the model but the weights it sets) for each term's unweighted
    value Lᵢ and gradient norm gᵢ = ‖∇_W termᵢ‖ with respect to all of
    `layer`'s trainable weights W (the last shared layer). As the paper trains them, the weights wᵢ are
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
            alone and lasts across `fit` calls until a step fails. Default
            `keras.optimizers.Adam(0.025)`, the paper's and LibMTL's.
        probe_data: `(x, y)` or `x`, a fixed batch (`y` is needed for a
            `CompositeLoss`).
        every_n_batches: probe every this many training batches (≥ 1).

    It overrides `on_train_batch_end` (the weights must be set before the
    next step), so while it is among the callbacks Keras dispatches batch
    ends synchronously. The weights' step, clipping and assignment run in
    the probe's own call (compiled on JAX and TF: one call a probe). A step
    that leaves a weight not finite (a term value or gradient norm that is
    not, or an overflow) raises a `ValueError` and leaves the Terms'
    weights as they were; GradNorm's own optimizer, whose state holds the
    failed step, starts afresh at the next probe.

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
        self.alpha = alpha
        self.optimizer = _own_optimizer(optimizer)
        self.every_n_batches = check.positive_integer("every_n_batches", every_n_batches)
        if probe_data is None:
            raise TypeError("`probe_data` is required: GradNorm measures gradient norms on a fixed batch.")
        self.probe_data = _probe_batch(probe_data)
        self.target: Any = None  # the CompositeObjective or CompositeLoss, from set_model
        self.layer: Any = None
        self.history: list[dict[str, Any]] = []
        self._probes: dict[int, _Probe] = {}
        # GradNorm's own variables (made through `backend.outside_distribution`,
        # see `_new_state`) and the copy of `optimizer` that steps the weights.
        self._state: _State | None = None
        self._stepper: Any = None

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
        if self._state is None or self._state.weights.shape[0] != len(self.target.terms):
            self._new_state(len(self.target.terms))
            self._probes = {}
        if id(model) not in self._probes:
            # The weights' step runs in the probe's own compiled call.
            update = (self._update, [*self._state, *self._stepper.variables])
            self._probes[id(model)] = self._measurement(model, update)
        return self._probes[id(model)]

    def _measurement(self, model, update=None):
        """The probe of `model`'s terms as they count in the loss (a shared
        objective's calls summed) and their norms over `layer`'s weights,
        with `update` in its call (`bench.out_of_reach` times it without).
        Every term reaches the shared layer through the heads: their
        gradients are taken in one batched backward pass (eager torch)."""
        return _Probe(
            model,
            [self.target],
            everything=False,
            calls="sum",
            variables=list(self.layer.trainable_weights),
            batched=True,
            update=update,
        )

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, alpha: float) -> None:
        # The compiled probe reads α from a variable: a new value takes effect at the next probe.
        self._alpha = check.non_negative("alpha", alpha)
        state = getattr(self, "_state", None)
        if state is not None:
            backend.outside_distribution(lambda: state.alpha.assign(self._alpha))

    def _new_state(self, count):
        """The weights the optimizer steps, the first probe's values Lᵢ(0),
        whether the next probe is a fit's first and α, with the copy of
        `optimizer` that steps the weights (its state lasts across fits
        until a step fails).

        They are made through `backend.outside_distribution`, on the
        package's host thread where a distribution or a dtype policy is in
        effect: Keras' and TF's distribution and dtype-policy state is per
        thread, so they are plain float32 variables even while `fit` runs
        inside a `tf.distribute` scope (where an optimizer applied from a
        callback has no replica context; TF's probe runs on that thread
        there) or a Keras distribution."""

        def make():
            ones = np.ones(count, "float32")
            self._state = _State(
                keras.Variable(ones, dtype="float32", name="gradnorm_weights"),
                keras.Variable(ones, dtype="float32", trainable=False, name="gradnorm_initial_values"),
                keras.Variable(1.0, dtype="float32", trainable=False, name="gradnorm_first_probe"),
                keras.Variable(self.alpha, dtype="float32", trainable=False, name="gradnorm_alpha"),
            )
            # A copy built here: one made in a strategy scope applies only there.
            self._stepper = type(self.optimizer).from_config(self.optimizer.get_config())
            self._stepper.build([self._state.weights])

        backend.outside_distribution(make)

    def _update(self, values, norms):
        """The probe's update, inside its call: one step of the optimizer from
        the weights in use, clipped and renormalised (`on_train_batch_end`
        sets them on the target). Stepped weights that are not finite are
        returned as they are (`on_train_batch_end` raises)."""
        weights, initial, first, alpha = self._state
        initial.assign(ops.where(first.value > 0.5, values, initial.value))
        first.assign(0.0)
        in_use = ops.cast(self.target.current_weights(), "float32")
        weights.assign(in_use)
        self._stepper.apply([gradnorm_gradient(in_use, values, norms, initial.value, alpha.value)], [weights])
        stepped = weights.value
        finite = ops.all(ops.isfinite(stepped))
        return ops.where(finite, clip_and_renormalise(stepped), stepped)

    def on_train_begin(self, logs: Logs = None) -> None:
        self._step = 0
        state = self._state
        if state is not None:  # Lᵢ(0) is the first probe of each fit
            backend.outside_distribution(lambda: state.first_probe.assign(1.0))

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._step += 1
        if self._step % self.every_n_batches:
            return
        values, norms, new = self._probe()(*self.probe_data)
        if not np.all(np.isfinite(new)):
            # The optimizer took the step (Adam's moments NaN with a NaN
            # gradient, every later step with them): the next probe makes
            # GradNorm's state, and the probe that steps it, afresh.
            self._state = None
            raise ValueError(
                f"GradNorm's new weights for {self.target.name!r} are not finite: {new.tolist()} "
                f"(term values {values.tolist()}, gradient norms {norms.tolist()}); the weights were left as they were."
            )
        self.target.set_term_weights(new)
        values, norms = np.asarray(values, "float64"), np.asarray(norms, "float64")
        names = list(self.target.terms)
        self.history.append(
            {
                "step": self._step,
                "values": dict(zip(names, values.tolist())),
                "grad_norms": dict(zip(names, norms.tolist())),
                "weights": dict(zip(names, np.asarray(new, "float64").tolist())),
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
    return check.optimizer("optimizer", optimizer)


def gradnorm_gradient(
    weights: TensorLike, values: TensorLike, norms: TensorLike, initial: TensorLike, alpha: float
) -> Tensor:
    """∂L_grad/∂wᵢ = sign(Gᵢ − Ḡ·rᵢ^α)·gᵢ, as `GradNorm` documents (float32).

    Example:

    >>> from keras import ops
    >>> from keras_penalties.callbacks import gradnorm_gradient
    >>> # G = (1, 3), Ḡ = 2, equal loss ratios: the first term is pulled up
    >>> ops.convert_to_numpy(gradnorm_gradient([1.0, 1.0], [2.0, 2.0], [1.0, 3.0], [1.0, 1.0], 1.5)).tolist()
    [-1.0, 3.0]
    """
    weights, values, norms, initial = (ops.cast(t, "float32") for t in (weights, values, norms, initial))
    weighted = weights * norms
    known = initial != 0
    ratios = ops.where(known, values / ops.where(known, initial, 1.0), 1.0)
    mean = ops.mean(ratios)
    relative = ops.where(mean > 0, ratios / mean, 1.0)  # values only: no gradient sees the other branch
    return ops.sign(weighted - ops.mean(weighted) * relative**alpha) * norms


def clip_and_renormalise(weights: TensorLike) -> Tensor:
    """The weights clipped at 0 and rescaled to sum to their count (all 1 if none is left; float32).

    Example:

    >>> from keras import ops
    >>> from keras_penalties.callbacks import clip_and_renormalise
    >>> ops.convert_to_numpy(clip_and_renormalise([3.0, -1.0, 1.0])).tolist()
    [2.25, 0.0, 0.75]
    """
    clipped = ops.relu(ops.cast(weights, "float32"))
    total = ops.sum(clipped)
    return ops.where(total > 0, clipped * (clipped.shape[0] / total), 1.0)
