"""`PenaltyMonitor`: every penalty term's value, and gradient norms, in the
training logs."""

from typing import TYPE_CHECKING, Any, Callable

import keras

from keras_penalties import _validation as check
from keras_penalties.composite.state import term_means
from keras_penalties._types import Logs
from keras_penalties.callbacks._external import _check_external, _ExternalScores
from keras_penalties.callbacks._plot import _figure, _pyplot
from keras_penalties.callbacks._probe import _Cadence, _Probe, _probe_batch
from keras_penalties.callbacks._targets import _add_to_model, _composite_losses, _layers, _log_weights
from keras_penalties.composite.layer import CompositeObjective

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class PenaltyMonitor(keras.callbacks.Callback):
    """Reports every penalty term of a model, and its gradient norm, while it trains.

    Values: terms of every `CompositeObjective` layer appear as
    `"<layer name>/<term>"` and terms of a compiled `CompositeLoss` as
    `"<loss name>/<term>"`: their mean unweighted value over the epoch so far
    in the progress bar, epoch-averaged in History (`val_`-prefixed for
    validation) and in the dict `evaluate(..., return_dict=True)` returns; the
    same numbers on JAX, TensorFlow and PyTorch. They stay metrics of the
    model: a later `fit` or `evaluate` without the monitor reports them too.

    Probes: with `probe_data=(x, y)`, every `every_n_batches` training batches
    the monitor evaluates the model on that batch and logs, for each term —
    the terms above, and each layer's weight and activity regularizer as
    `"<layer name>/<weight>_regularizer"` / `"<layer name>/activity_regularizer"`
    (weight 1, its value being what it adds to the loss, factor included) —
    `"<term>/grad_norm"` (‖∂termᵢ/∂θ‖₂ over all trainable weights, unweighted)
    and `"<term>/grad_norm_weighted"`, plus `"base_loss/grad_norm"` (the
    compiled loss) and `"total/grad_norm"` (the whole training loss, what
    History calls `"loss"`), and the regularizers' values. They reach the
    progress bar on probe batches and, averaged over the epoch's probes,
    History (list the monitor before a CSVLogger or TensorBoard callback so
    they see them). The probe runs in
    inference mode and changes nothing: not the weights, the optimizer, the
    metrics or running statistics; training follows the same trajectory.

    Args:
        probe_data: `(x, y)`, `[x, y]` or `x`: a fixed, non-empty batch to
            probe on; None for no probes; `x` alone only where the model
            has no compiled loss (else the first probe raises a
            `ValueError`). With several JAX processes, the same batch in
            every process.
        every_n_batches: probe every this many training batches (≥ 1).
        grad_norms: compute gradient norms on probes (else values only).
        external: dict name → `f(x, y, y_pred)`: scores computed outside the
            compiled step (a service, a solver, a non-differentiable check)
            from NumPy arrays of the probe batch and the model's output on
            it, returning a float or a dict of floats. On every probe they
            run concurrently with the gradient probe, each in a thread of its
            own (one that hangs does not block the others or the
            interpreter's exit); each result is logged as
            `"external/<name>"` (a dict as `"external/<name>/<key>"`) with
            its wall time as `"external/<name>/seconds"`. One that raises,
            returns something else or runs past `external_timeout` logs NaN
            (its seconds: until it failed, or the timeout) and warns once
            with its name; training and the other scores go on. One still
            running from an earlier probe is not started again (NaN, 0 s).
            They never touch the loss or the gradients. Needs `probe_data`.
        external_timeout: seconds each external score may take (> 0).

    Attributes:
        history: one dict per probe: `"step"`, `"epoch"`, and for each term
            `"<term>"`, `"<term>/weight"`, `"<term>/contribution"` and, with
            gradient norms, `"<term>/grad_norm"`, `"<term>/grad_norm_weighted"`;
            plus `"base_loss"` (the compiled loss), `"total"` (the whole
            training loss) and their `/grad_norm`.

    Example:

    ```python
    monitor = PenaltyMonitor(probe_data=(x[:256], y[:256]), every_n_batches=50)
    history = model.fit(x, y, validation_split=0.2, callbacks=[monitor])
    history.history["objective/entropy"], history.history["total/grad_norm"]
    monitor.plot().savefig("penalties.png")
    ```
    """

    def __init__(
        self,
        probe_data: Any = None,
        every_n_batches: int = 100,
        grad_norms: bool = True,
        external: dict[str, Callable[[Any, Any, Any], float | dict[str, float]]] | None = None,
        external_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        self.external, self.external_timeout = _check_external(external, external_timeout)
        if self.external and probe_data is None:
            raise ValueError("`external` scores run on probes: give `probe_data` too.")
        every_n_batches = check.positive_integer("every_n_batches", every_n_batches)
        if not isinstance(grad_norms, bool):
            raise TypeError(f"`grad_norms` must be a bool; got {grad_norms!r}.")
        if probe_data is not None:
            probe_data = _probe_batch(probe_data)
        self.probe_data = probe_data
        self.every_n_batches = every_n_batches
        self.grad_norms = grad_norms
        self.history: list[dict[str, Any]] = []
        self.objectives: list[CompositeObjective] = []
        self._probes: dict[int, _Probe] = {}
        self._cadence = _Cadence(every_n_batches)
        self._epoch = 0
        self._epoch_probes: list[dict[str, float]] = []
        self._scores = _ExternalScores()

    # ------------------------------------------------------------ metrics in the model

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.objectives = [layer for layer in _layers(model) if isinstance(layer, CompositeObjective)]
        # Metrics of the model from now on: later fits and evaluations report
        # them too, and reuse the traced step.
        _add_to_model(model, [term_means(c) for c in self.objectives + _composite_losses(model)])

    # ------------------------------------------------------------ probes

    def probe(self) -> dict[str, Any]:
        """Probes `probe_data` now; returns (and appends to `history`) one entry."""
        model = self.model  # syncs JAX state
        if id(model) not in self._probes:
            self._probes[id(model)] = _Probe(
                model, self.objectives + _composite_losses(model), grad_norms=self.grad_norms
            )
        probe = self._probes[id(model)]
        if probe.has_loss and self.probe_data[1] is None:
            # Without y the compiled loss cannot run: "base_loss" would read 0
            # and "total" leave it out.
            raise ValueError(
                "`probe_data` holds x alone, and the model's compiled loss needs y: give probe_data=(x, y)."
            )
        calls = self._scores.start(self.external, model, self.probe_data)
        values, norms = probe(*self.probe_data)
        entry = {"step": self._cadence.step, "epoch": self._epoch}
        entry.update(self._scores.finish(calls, self.external_timeout))
        for i, (key, weight) in enumerate(zip(probe.term_keys, probe.weights())):
            value = float(values[i])
            entry.update({key: value, f"{key}/weight": weight, f"{key}/contribution": weight * value})
            if norms is not None:
                entry[f"{key}/grad_norm"] = float(norms[i])
                entry[f"{key}/grad_norm_weighted"] = weight * float(norms[i])
        for offset, key in ((-2, "base_loss"), (-1, "total")):
            entry[key] = float(values[offset])
            if norms is not None:
                entry[f"{key}/grad_norm"] = float(norms[offset])
        self.history.append(entry)
        return entry

    def _probe_logs(self, entry):
        probe = self._probes[id(self._model)]
        logs = {key: entry[key] for key in probe.regularizer_keys}
        logs.update({key: value for key, value in entry.items() if key.startswith("external/")})
        if self.grad_norms:
            for key in probe.term_keys:
                logs[f"{key}/grad_norm"] = entry[f"{key}/grad_norm"]
                logs[f"{key}/grad_norm_weighted"] = entry[f"{key}/grad_norm_weighted"]
            if probe.has_loss:
                logs["base_loss/grad_norm"] = entry["base_loss/grad_norm"]
            logs["total/grad_norm"] = entry["total/grad_norm"]
        return logs

    # ------------------------------------------------------------ callback hooks

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self._epoch = epoch
        self._epoch_probes = []
        self._cadence.epoch_began()

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        if self._cadence.batch_began(batch) is not None:
            self._after_batch(None)

    def _after_batch(self, logs):
        """The work due after a training batch; `logs` are the epoch's end
        logs when it was the epoch's last, else None."""
        epoch_end = logs is not None
        if self.probe_data is not None and self._cadence.probes():
            probe_logs = self._probe_logs(self.probe())
            self._epoch_probes.append(probe_logs)
            if epoch_end:
                logs.update(probe_logs)
        self._cadence.batch_done()

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self._cadence.epoch_ended() is not None:
            self._after_batch(logs if logs is not None else {})
        for owner in self.objectives + _composite_losses(self.model):
            if owner.weighting.learned:
                # Learned weights: what the next step uses.
                _log_weights(owner, logs)
        if logs is not None and self._epoch_probes:
            keys = dict.fromkeys(key for probe in self._epoch_probes for key in probe)
            for key in keys:
                values = [p[key] for p in self._epoch_probes if key in p]
                logs[key] = sum(values) / len(values)

    # ------------------------------------------------------------ plot

    def plot(self) -> "Figure":
        """A matplotlib Figure: each term's contribution (weight × value),
        gradient norm and, where it changed (a schedule, an adaptive
        weighting), weight over the probed steps. Needs matplotlib and probes."""
        plt = _pyplot()
        if not self.history:
            raise ValueError("No probes yet: give PenaltyMonitor probe_data and train first.")
        term_keys = self._probes[id(self._model)].term_keys
        return _figure(plt, self.history, term_keys, self.grad_norms, self.every_n_batches)
