"""Callbacks: `PenaltyMonitor` (every penalty term's value, and gradient
norms, in the training logs) and the adaptive weightings
`DynamicWeightAverage` and `GradNorm`."""

import concurrent.futures
import math
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

import keras
import numpy as np
from keras import ops

from keras_penalties import _capture, _keras_internals, gradients
from keras_penalties._types import Logs
from keras_penalties._term_means import objective_means
from keras_penalties.objective import CompositeLoss, CompositeObjective
from keras_penalties.terms import METRIC_NAME_PATTERN
from keras_penalties.ops import _numerics as num

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What `target` may be: a composite of the model, or its name there.
_Target: TypeAlias = CompositeObjective | CompositeLoss | str


def _layers(model):
    """Every layer inside `model`, depth first, each once."""
    seen, stack, found = set(), list(reversed(model.layers)), []
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        found.append(layer)
        stack.extend(reversed(getattr(layer, "layers", [])))
    return found


def _composite_losses(model):
    losses = getattr(model, "loss", None)
    return [loss for loss in keras.tree.flatten(losses) if isinstance(loss, CompositeLoss)]


def _add_to_model(model, metrics):
    """Makes `metrics` part of the model's metrics, and each CompositeLoss's
    variables part of the model; the next step is traced again if any was new."""
    added = False
    for metric in metrics:
        if not any(m is metric for m in model.metrics):
            _keras_internals.add_model_metric(model, metric)
            added = True
    for loss in _composite_losses(model):
        added = loss.attach(model) or added
    if added:
        # Steps traced before these existed neither update nor carry them:
        # trace again, once. They then stay, so later fits reuse the step.
        model.train_function = model.test_function = None


def _check_target(target):
    if isinstance(target, (CompositeObjective, CompositeLoss)):
        return target
    if isinstance(target, str) and target:
        return target
    raise TypeError(
        f"`target` must be a CompositeObjective, a CompositeLoss, or the name of one in the model; got {target!r}."
    )


def _find_target(model, target):
    """The model's CompositeObjective layer or compiled CompositeLoss that
    `target` is or names; a ValueError naming `target` otherwise."""
    candidates = [layer for layer in _layers(model) if isinstance(layer, CompositeObjective)]
    candidates += _composite_losses(model)
    for candidate in candidates:
        if candidate is target or candidate.name == target:
            return candidate
    shown = target if isinstance(target, str) else f"{type(target).__name__} {target.name!r}"
    raise ValueError(
        f"`target` {shown!r} is not a CompositeObjective layer or compiled CompositeLoss of the model; "
        f"it has {[c.name for c in candidates] or 'none'}."
    )


def _settable_target(model, target, method):
    """`_find_target`, refusing a target whose weights are learned: the
    adaptive `method` sets them."""
    found = _find_target(model, target)
    if found.weighting is not None:
        raise ValueError(
            f"`target` {found.name!r} has weighting={found.weighting!r}, which learns its "
            f"weights; {method} sets them: build it without `weighting`."
        )
    return found


def _log_weights(target, logs):
    if logs is not None:
        logs.update({f"{target.name}/{term}/weight": w for term, w in target.weights_in_use().items()})


def _probe_batch(probe_data):
    """`(x, y)`, `[x, y]` or `x` as tensors, checked before any tensor work."""
    x, y = (
        tuple(probe_data)
        if isinstance(probe_data, (tuple, list)) and len(probe_data) == 2
        else (probe_data, None)
    )
    for name, part in (("x", x), ("y", y)):
        for leaf in keras.tree.flatten(part):
            if isinstance(leaf, (str, bytes)) or (leaf is not None and not hasattr(leaf, "shape")):
                raise TypeError(
                    f"`probe_data` must be (x, y), [x, y] or x, arrays or tensors; its {name} holds {leaf!r}."
                )
    x = keras.tree.map_structure(ops.convert_to_tensor, x)
    y = None if y is None else keras.tree.map_structure(ops.convert_to_tensor, y)
    for leaf in keras.tree.flatten(x):
        if len(leaf.shape) == 0:
            raise TypeError(f"`probe_data` must be a batch; its x holds a scalar {leaf!r}.")
        if leaf.shape[0] == 0:
            raise ValueError("`probe_data` has no samples: give a batch of at least one.")
    return x, y


def _check_external(external, timeout):
    """`external` (dict name → callable) and `external_timeout`, checked."""
    if external is None:
        external = {}
    if not isinstance(external, dict):
        raise TypeError(f"`external` must be a dict of name -> function, or None; got {external!r}.")
    for name, fn in external.items():
        if not isinstance(name, str) or not METRIC_NAME_PATTERN.match(name):
            raise ValueError(
                f"`external` names must be non-empty strings of letters, digits, '_', '.' or '-'; got {name!r}."
            )
        if not callable(fn):
            raise TypeError(f"`external[{name!r}]` must be a function f(x, y, y_pred); got {fn!r}.")
    return dict(external), num.positive("external_timeout", timeout)


class _Score:
    """One external score's call, in a daemon thread of its own: a call that
    hangs holds only its own thread (and does not hold up the interpreter's
    exit), so it never starves the other scores."""

    def __init__(self, fn, args):
        self.result, self.error, self.seconds = None, None, None
        self.start = time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self.result = fn(*args)
        except Exception as error:  # noqa: BLE001 -- reported by name, training goes on
            self.error = error
        self.seconds = time.perf_counter() - self.start


def _as_score(name, result):
    """A score's result as {log key: float}; a TypeError if it is neither a
    number nor a dict of numbers."""
    def number(key, value):
        value = np.asarray(value)
        if value.size != 1 or not np.issubdtype(value.dtype, np.number):
            raise TypeError(f"returned {result!r}, not a number or a dict of numbers")
        return float(value)

    if isinstance(result, dict):
        return {f"external/{name}/{key}": number(key, value) for key, value in result.items()}
    return {f"external/{name}": number(name, result)}


class _Cadence:
    """When `PenaltyMonitor` works. Keras dispatches batch ends asynchronously
    (JAX, torch) unless a callback overrides that hook, and then for every
    callback, so the monitor has no batch-end hook: the work due after batch
    k runs at the begin of batch k + 1, on the main thread (where a JAX state
    sync is safe), and after an epoch's last batch at the epoch's end, whose
    logs History records.

    `step` counts training batches over the whole fit (a probe every
    `every` of them); `pending` is the batch whose end-of-batch work has not
    run yet.
    """

    def __init__(self, every):
        self.every = every
        self.step = 0
        self.pending = None

    def epoch_began(self):
        self.pending = None

    def batch_began(self, batch):
        """The batch whose work is now due (None if none), and `batch` pending."""
        ended, self.pending = self.pending, batch
        return ended

    def epoch_ended(self):
        """The epoch's last batch if its work is still due, else None."""
        ended, self.pending = self.pending, None
        return ended

    def probes(self):
        """Whether the batch that just ended is probed."""
        return self.step % self.every == 0

    def batch_done(self):
        self.step += 1


class _Probe:
    """One probe of a model, compiled once, shared by `PenaltyMonitor` and
    `GradNorm`: on a fixed batch, in inference mode and changing no state
    (see `gradients.parameter_probe`), it measures the term values of
    `composites` and, with `everything`, the model's weight and activity
    regularizers, the compiled loss and the total training loss — in that
    order, as `keys` lists them (then "base_loss", "total") — with each one's
    gradient norm over `variables` (all trainable ones by default).

    A composite called several times per pass (a shared encoder on two
    views) gives the mean of its calls (`calls="mean"`, as its logs) or
    their sum (`calls="sum"`, as it counts in the loss).
    """

    def __init__(self, model, composites, *, everything=True, calls="mean", variables=None, grad_norms=True):
        self.model = model
        self.composites = list(composites)
        self.calls = calls
        self.everything = everything
        self.term_keys = [f"{c.name}/{t}" for c in self.composites for t in c.terms]
        self.weight_regularizers, self.activity_regularizers = [], []
        if everything:
            owners = {}
            for layer in _layers(model):
                for variable in layer.trainable_weights:
                    owners[id(variable)] = layer
            self.weight_regularizers = [
                (f"{owners[id(v)].name}/{v.name}_regularizer", v)
                for v in model.trainable_variables
                if getattr(v, "regularizer", None) is not None and id(v) in owners
            ]
            self.activity_regularizers = [
                (f"{layer.name}/activity_regularizer", layer)
                for layer in _layers(model)
                if getattr(layer, "activity_regularizer", None) is not None
            ]
        # Keys whose values nothing else reports.
        self.regularizer_keys = [key for key, _ in self.weight_regularizers + self.activity_regularizers]
        self.term_keys += self.regularizer_keys
        self.has_loss = _keras_internals.compiled_loss(model) is not None
        # A CompositeLoss records its terms only when the compiled loss runs.
        self._with_loss = self.has_loss and (everything or any(isinstance(c, CompositeLoss) for c in self.composites))
        size = len(self.term_keys) + 2 * everything
        self._measure = gradients.parameter_probe(
            model, self._outputs, size, grad_norms=grad_norms, variables=variables
        )

    def __call__(self, x, y):
        """`(values, norms)`, NumPy vectors in `keys` order (norms None
        without `grad_norms`)."""
        return self._measure(x, y)

    def _outputs(self, x, y):
        """The measured values as a list of float32 scalars (run in a stateless scope)."""
        loss = None
        with _capture.capturing(self.composites) as captured:
            y_pred = self.model(x, training=False)
            if self._with_loss and y is not None:
                loss = _keras_internals.compiled_loss(self.model)(y, y_pred)
        values = []
        for composite in self.composites:
            records = captured[id(composite)]
            combined = sum(records[1:], records[0])
            if self.calls == "mean":
                combined = combined / len(records)
            values.extend(combined[i] for i in range(len(composite.terms)))
        for _, variable in self.weight_regularizers:
            values.append(variable.regularizer(variable))
        for _, layer in self.activity_regularizers:
            values.append(sum(_keras_internals.own_losses(layer)))
        values = [ops.cast(v, "float32") for v in values]
        if not self.everything:
            return values
        loss = ops.zeros((), "float32") if loss is None else ops.cast(loss, "float32")
        total = loss + sum(ops.cast(v, "float32") for v in self.model.losses)
        return values + [loss, total]

    def weights(self):
        """Each measured term's current effective weight (0 when disabled; 1
        for a regularizer)."""
        weights = []
        for composite in self.composites:
            weights.extend(float(w) for w in ops.convert_to_numpy(composite.effective_weights()))
        weights.extend(1.0 for _ in self.regularizer_keys)
        return weights


class PenaltyMonitor(keras.callbacks.Callback):
    """Reports every penalty term of a model, and its gradient norm, while it trains.

    Values: terms of every `CompositeObjective` layer appear as
    `"<layer name>/<term>"` and terms of a compiled `CompositeLoss` as
    `"<loss name>/<term>"`: their mean unweighted value over the epoch so far
    in the progress bar, epoch-averaged in History (`val_`-prefixed for
    validation) and in the dict `evaluate(..., return_dict=True)` returns; the
    same numbers on JAX, TensorFlow and PyTorch. The monitor makes them
    metrics of the model, and they stay so: a later `fit` or `evaluate`
    without the monitor reports them too, without retracing.

    Probes: with `probe_data=(x, y)`, every `every_n_batches` training batches
    the monitor evaluates the model on that batch and logs, for each term —
    the terms above, and each layer's weight and activity regularizer as
    `"<layer name>/<weight>_regularizer"` / `"<layer name>/activity_regularizer"`
    (weight 1, its value being what it adds to the loss, factor included) —
    `"<term>/grad_norm"` (‖∂termᵢ/∂θ‖₂ over all trainable weights, unweighted)
    and `"<term>/grad_norm_weighted"`, plus `"base_loss/grad_norm"` (the
    compiled loss) and `"total/grad_norm"` (the whole training loss, what
    History calls `"loss"`), and the
    regularizers' values. They reach the progress bar on probe batches and,
    averaged over the epoch's probes, History (list the monitor before a
    CSVLogger or TensorBoard callback so they see them). The probe runs in
    inference mode through a stateless scope, is compiled once per model, and
    changes nothing: no optimizer or metric state, no running statistics, no
    torch `.grad`, the same training trajectory.

    Args:
        probe_data: `(x, y)`, `[x, y]` or `x`: a fixed, non-empty batch to
            probe on; None for no probes. With several JAX processes, the
            same batch in every process.
        every_n_batches: probe every this many training batches (≥ 1).
        grad_norms: compute gradient norms on probes (else values only).
        external: dict name → `f(x, y, y_pred)`: scores computed outside the
            compiled step (a service, a solver, a non-differentiable check)
            from NumPy arrays of the probe batch and the model's output on
            it, returning a float or a dict of floats. On every probe they
            run concurrently, each in a daemon thread of its own, while the
            gradient probe runs; each result is logged as
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
        every_n_batches = num.positive_integer("every_n_batches", every_n_batches)
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
        self._running: dict[str, _Score] = {}  # external score name -> its call, while one runs past its probe
        self._warned: set[str] = set()
        self._score_keys: dict[str, list[str]] = {}  # external score name -> the log keys its results gave

    # ------------------------------------------------------------ metrics in the model

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.objectives = [layer for layer in _layers(model) if isinstance(layer, CompositeObjective)]
        trackers = [loss.tracker for loss in _composite_losses(model)]
        _add_to_model(model, [objective_means(o) for o in self.objectives] + trackers)
        for loss in _composite_losses(model):
            loss.tracker_registered = True

    # ------------------------------------------------------------ probes

    def probe(self) -> dict[str, Any]:
        """Probes `probe_data` now; returns (and appends to `history`) one entry."""
        model = self.model  # syncs JAX state
        if id(model) not in self._probes:
            self._probes[id(model)] = _Probe(
                model, self.objectives + _composite_losses(model), grad_norms=self.grad_norms
            )
        probe = self._probes[id(model)]
        calls = self._start_external(model)
        values, norms = probe(*self.probe_data)
        entry = {"step": self._cadence.step, "epoch": self._epoch}
        entry.update(self._finish_external(calls))
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

    def _start_external(self, model):
        """Starts every external score on the probe batch and the model's
        output on it; returns name → call (None for one still running from an
        earlier probe, which is not started twice)."""
        if not self.external:
            return {}
        x, y = self.probe_data
        to_numpy = lambda t: keras.tree.map_structure(lambda a: np.asarray(ops.convert_to_numpy(a)), t)  # noqa: E731
        args = (to_numpy(x), None if y is None else to_numpy(y), to_numpy(model(x, training=False)))
        calls = {}
        for name, fn in self.external.items():
            running = self._running.get(name)
            calls[name] = None if running is not None and running.thread.is_alive() else _Score(fn, args)
        return calls

    def _finish_external(self, calls):
        """Waits for the scores, each until `external_timeout` after it
        started; returns their log entries (NaN for a failure)."""
        results = {}
        for name, call in calls.items():
            if call is None:
                error, seconds = "still running from an earlier probe", 0.0
            else:
                call.thread.join(max(0.0, call.start + self.external_timeout - time.perf_counter()))
                if call.thread.is_alive():
                    self._running[name] = call
                    error, seconds = f"timed out after {self.external_timeout} s", self.external_timeout
                else:
                    self._running.pop(name, None)
                    error, seconds = call.error, call.seconds
                    if error is None:
                        try:
                            scores = _as_score(name, call.result)
                        except TypeError as bad:
                            error = bad
                        else:
                            self._score_keys[name] = list(scores)
                            results.update(scores)
            if error is not None:
                results.update({key: math.nan for key in self._score_keys.get(name, [f"external/{name}"])})
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"PenaltyMonitor: external score {name!r} failed ({error}); it logs NaN "
                        "where it fails, and training goes on. (Warned once.)",
                        stacklevel=2,
                    )
            results[f"external/{name}/seconds"] = float(seconds)
        return results

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
            if owner.weighting is not None:
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
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            from matplotlib import pyplot as plt
        except ImportError as error:
            raise ImportError("PenaltyMonitor.plot() needs matplotlib: pip install matplotlib") from error
        if not self.history:
            raise ValueError("No probes yet: give PenaltyMonitor probe_data and train first.")
        probe = self._probes[id(self._model)]
        steps = [entry["step"] for entry in self.history]
        # Weights that changed while training (schedules, adaptive methods) get a panel.
        moving = [k for k in probe.term_keys if len({e[f"{k}/weight"] for e in self.history}) > 1]
        rows = 1 + self.grad_norms + bool(moving)
        figure, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows), sharex=True, squeeze=False)
        for key in probe.term_keys:
            axes[0, 0].plot(steps, [e[f"{key}/contribution"] for e in self.history], label=key)
        axes[0, 0].plot(steps, [e["base_loss"] for e in self.history], "k--", label="base_loss (compiled loss)")
        axes[0, 0].plot(steps, [e["total"] for e in self.history], "k", label="total (training loss)")
        axes[0, 0].set_ylabel("contribution to the loss\n(weight × term)")
        axes[0, 0].legend(fontsize="small")
        if self.grad_norms:
            for key in probe.term_keys:
                axes[1, 0].plot(steps, [e[f"{key}/grad_norm_weighted"] for e in self.history], label=key)
            axes[1, 0].plot(steps, [e["base_loss/grad_norm"] for e in self.history], "k--", label="base_loss (compiled loss)")
            axes[1, 0].plot(steps, [e["total/grad_norm"] for e in self.history], "k", label="total (training loss)")
            axes[1, 0].set_yscale("log")
            axes[1, 0].set_ylabel("weighted gradient norm\n‖∂(w·term)/∂θ‖")
            axes[1, 0].legend(fontsize="small")
        if moving:
            for key in moving:
                axes[-1, 0].plot(steps, [e[f"{key}/weight"] for e in self.history], label=key)
            axes[-1, 0].set_ylabel("term weight")
            axes[-1, 0].legend(fontsize="small")
        axes[-1, 0].set_xlabel("training step (probes every %d batches)" % self.every_n_batches)
        figure.suptitle(f"Penalty terms while training ({keras.backend.backend()} backend)")
        figure.tight_layout()
        return figure


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
        self.temperature = num.positive("temperature", temperature)
        self.target: Any = None  # the CompositeObjective or CompositeLoss, from set_model
        self.epoch_means: list[np.ndarray] = []

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.target = _settable_target(model, self.target_spec, "DynamicWeightAverage")
        if isinstance(self.target, CompositeLoss):
            _add_to_model(model, [self.target.tracker])
            self.target.tracker_registered = True
        else:
            _add_to_model(model, [objective_means(self.target)])

    def _set(self, weights):
        self.model  # noqa: B018 -- on JAX, reading .model syncs the training state first
        for name, weight in zip(self.target.terms, weights):
            self.target.set_weight(name, float(weight))

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
            metric = self.target.tracker if isinstance(self.target, CompositeLoss) else objective_means(self.target)
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
        self.alpha = num.non_negative("alpha", alpha)
        self.optimizer = _own_optimizer(optimizer)
        self.every_n_batches = num.positive_integer("every_n_batches", every_n_batches)
        if probe_data is None:
            raise TypeError("`probe_data` is required: GradNorm measures gradient norms on a fixed batch.")
        self.probe_data = _probe_batch(probe_data)
        self.target: Any = None  # the CompositeObjective or CompositeLoss, from set_model
        self.layer: Any = None
        self.history: list[dict[str, Any]] = []
        self._probes: dict[int, _Probe] = {}
        # The weights as the optimizer's variable (before clipping), and the
        # copy of `optimizer` that steps them, both made on the host thread.
        self._weights = self._stepper = None

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if self.optimizer is getattr(model, "optimizer", None):
            raise ValueError(
                "`optimizer` is the model's optimizer; GradNorm's weights need one of their own "
                "(its state would mix with the model's). Pass a new instance, e.g. keras.optimizers.Adam(0.025)."
            )
        self.target = _settable_target(model, self.target_spec, "GradNorm")
        layers = _layers(model)
        found = [l for l in layers if l is self.layer_spec or l.name == self.layer_spec]
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
            self._probes[id(model)] = _Probe(
                model, [self.target], everything=False, calls="sum", variables=list(self.layer.trainable_weights)
            )
        return self._probes[id(model)]

    def _step_weights(self, weights, gradient):
        """One step of the optimizer from `weights` along `gradient` (NumPy).

        It runs on a host thread of its own: Keras' and TF's distribution
        and dtype-policy state is per thread, so the weights and the
        optimizer's state are plain float32 variables there even while
        `fit` runs inside a `tf.distribute` scope (where an optimizer
        applied from a callback has no replica context) or a Keras
        distribution."""

        def step():
            if self._weights is None or tuple(self._weights.shape) != weights.shape:
                self._weights = keras.Variable(
                    weights.astype("float32"), dtype="float32", trainable=True, name="gradnorm_weights"
                )
                # A copy built here: one made in a strategy scope applies only there.
                self._stepper = type(self.optimizer).from_config(self.optimizer.get_config())
            self._weights.assign(weights.astype("float32"))
            self._stepper.apply([ops.convert_to_tensor(gradient.astype("float32"))], [self._weights])
            return np.asarray(ops.convert_to_numpy(self._weights), "float64")

        return _host_thread().submit(step).result()

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
        for name, weight in zip(self.target.terms, new):
            self.target.set_weight(name, float(weight))
        names = list(self.target.terms)
        self.history.append({
            "step": self._step,
            "values": dict(zip(names, values.tolist())),
            "grad_norms": dict(zip(names, norms.tolist())),
            "weights": dict(zip(names, new.tolist())),
        })
        _log_weights(self.target, logs)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        self.model  # noqa: B018
        _log_weights(self.target, logs)


_HOST: list[concurrent.futures.ThreadPoolExecutor] = []


def _host_thread():
    """The one worker thread that runs GradNorm's optimizers."""
    if not _HOST:
        _HOST.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="keras_penalties_host"))
    return _HOST[0]


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
