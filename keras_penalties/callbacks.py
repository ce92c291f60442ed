"""`PenaltyMonitor`: every penalty term's value, and gradient norms, in the training logs."""

import keras
from keras import ops

from keras_penalties import _capture, gradients
from keras_penalties.losses import CompositeLoss
from keras_penalties.objective import CompositeObjective


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


class _Mirror(keras.metrics.Metric):
    """Holds values the monitor reads outside the training step, so that Keras
    reports them like any metric (progress bar, History, evaluate's result)."""

    def __init__(self, keys, name):
        super().__init__(name=name)
        self.keys = list(keys)
        self.values = self.add_variable(shape=(len(self.keys),), initializer="zeros", name="values")
        self.reset_state()

    def update_state(self, values):
        self.values.assign(ops.convert_to_tensor(values, self.values.dtype))

    def reset_state(self):
        # Keras resets metrics when fit or evaluate starts; until the monitor
        # copies values in, they read NaN ("not measured"), never stale numbers.
        self.values.assign(ops.full(self.values.shape, float("nan"), self.values.dtype))

    def result(self):
        # A copy: on torch, indexing the variable gives views of its storage,
        # which a later update (validation) would change under the logs.
        values = ops.copy(self.values.value)
        return {key: values[i] for i, key in enumerate(self.keys)}


class _ProbeSources:
    """Everything a probe measures in one model, in a fixed order: objective
    terms, CompositeLoss terms, weight regularizers, activity regularizers,
    then the compiled loss and the total training loss."""

    def __init__(self, model, objectives):
        self.model = model
        self.objectives = objectives
        self.composite_losses = _composite_losses(model)
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
        self.term_keys = (
            [f"{o.name}/{t}" for o in objectives for t in o.terms]
            + [f"{c.name}/{t}" for c in self.composite_losses for t in c.terms]
            + [key for key, _ in self.weight_regularizers]
            + [key for key, _ in self.activity_regularizers]
        )
        # Keys whose values nothing else reports.
        self.regularizer_keys = [key for key, _ in self.weight_regularizers + self.activity_regularizers]
        self.has_loss = getattr(model, "_compile_loss", None) is not None

    @property
    def size(self):
        return len(self.term_keys) + 2

    def outputs(self, x, y):
        """The measured values as one float32 vector (run in a stateless scope)."""
        with _capture.capturing(self.objectives + self.composite_losses) as captured:
            y_pred = self.model(x, training=False)
            loss = ops.zeros((), "float32")
            if self.has_loss and y is not None:
                loss = ops.cast(self.model._compile_loss(y, y_pred), "float32")
        values = []
        for owner in self.objectives + self.composite_losses:
            (owner_values,) = captured[id(owner)]
            values.extend(owner_values[i] for i in range(len(owner.terms)))
        for _, variable in self.weight_regularizers:
            values.append(variable.regularizer(variable))
        for _, layer in self.activity_regularizers:
            values.append(sum(layer._get_own_losses()))
        total = loss + sum(ops.cast(v, "float32") for v in self.model.losses)
        return [ops.cast(v, "float32") for v in values] + [loss, total]

    def weights(self):
        """Each term's current effective weight (0 when disabled)."""
        weights = []
        for objective in self.objectives:
            weights.extend(float(w) for w in ops.convert_to_numpy(objective.effective_weights()))
        for loss in self.composite_losses:
            weights.extend(loss.effective_weights())
        weights.extend(1.0 for _ in self.regularizer_keys)
        return weights


class PenaltyMonitor(keras.callbacks.Callback):
    """Reports every penalty term of a model, and its gradient norm, while it trains.

    Values: terms of every `CompositeObjective` layer appear as
    `"<layer name>/<term>"` and terms of a compiled `CompositeLoss` as
    `"<loss name>/<term>"`: their mean unweighted value over the epoch so far
    in the progress bar, epoch-averaged in History (`val_`-prefixed for
    validation) and in the dict `evaluate(..., return_dict=True)` returns; the
    same numbers on JAX, TensorFlow and PyTorch. (Objectives keep running sums
    in non-trainable variables, which every backend's step carries; the
    monitor copies their means into a metric it adds to the model, and adds
    each CompositeLoss's tracker, so Keras reports them. The metrics stay with
    the model, so later fits do not retrace: in a fit without the monitor an
    objective's entries read NaN, and a CompositeLoss keeps reporting its
    terms.)

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
            probe on; None for no probes.
        every_n_batches: probe every this many training batches (≥ 1). The
            objectives' values in the progress bar are refreshed at the same
            interval and after each epoch's last batch (reading them waits
            for the step, which costs time when done every batch); History
            and evaluate get exact epoch averages either way.
        grad_norms: compute gradient norms on probes (else values only).

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

    def __init__(self, probe_data=None, every_n_batches=100, grad_norms=True):
        super().__init__()
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or every_n_batches < 1:
            raise ValueError(f"`every_n_batches` must be an int >= 1; got {every_n_batches!r}.")
        if not isinstance(grad_norms, bool):
            raise TypeError(f"`grad_norms` must be a bool; got {grad_norms!r}.")
        if probe_data is not None:
            probe_data = _probe_batch(probe_data)
        self.probe_data = probe_data
        self.every_n_batches = every_n_batches
        self.grad_norms = grad_norms
        self.history = []
        self.objectives = []
        self._mirrors = {}
        self._probes = {}
        self._step = 0
        self._epoch = 0
        self._epoch_probes = []
        self._ended = None  # the batch whose end-of-batch work is pending

    # ------------------------------------------------------------ metrics in the model

    def set_model(self, model):
        super().set_model(model)
        self.objectives = [layer for layer in _layers(model) if isinstance(layer, CompositeObjective)]
        for objective in self.objectives:
            if id(objective) not in self._mirrors:
                keys = [f"{objective.name}/{term}" for term in objective.terms]
                self._mirrors[id(objective)] = _Mirror(keys, name=f"{objective.name}_terms")
        self._register(model)

    def _register(self, model):
        metrics = [self._mirrors[id(o)] for o in self.objectives] + [l.tracker for l in _composite_losses(model)]
        added = False
        for metric in metrics:
            if not any(m is metric for m in model.metrics):
                # The model's tracking is locked once built; its own metrics
                # list is what Model.metrics (and JAX's metrics state) read.
                model._metrics.append(metric)
                added = True
        for loss in _composite_losses(model):
            loss.tracker_registered = True
        if added:
            # Steps traced before these metrics existed neither update nor
            # carry them: trace again, once. The metrics then stay, so later
            # fits reuse the traced step.
            model.train_function = model.test_function = None

    # ------------------------------------------------------------ values

    def _mirror(self, training, logs):
        """Copies each objective's running means into its mirror metric and the batch logs."""
        if not self.objectives:
            return
        self.model  # noqa: B018 -- on JAX, reading .model syncs the training state first
        for objective in self.objectives:
            values = objective.running_values(training)
            if values:
                self._mirrors[id(objective)].update_state(list(values.values()))
                if logs is not None:
                    logs.update({f"{objective.name}/{term}": v for term, v in values.items()})

    def _reset(self, training):
        if self.objectives:
            self.model  # noqa: B018
            for objective in self.objectives:
                objective.reset_running_values(training)

    # ------------------------------------------------------------ probes

    def probe(self):
        """Probes `probe_data` now; returns (and appends to `history`) one entry."""
        model = self.model  # syncs JAX state
        if id(model) not in self._probes:
            sources = _ProbeSources(model, self.objectives)
            fn = gradients.parameter_probe(model, sources.outputs, sources.size, grad_norms=self.grad_norms)
            self._probes[id(model)] = (sources, fn)
        sources, fn = self._probes[id(model)]
        values, norms = fn(*self.probe_data)
        entry = {"step": self._step, "epoch": self._epoch}
        for i, (key, weight) in enumerate(zip(sources.term_keys, sources.weights())):
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
        sources, _ = self._probes[id(self._model)]
        logs = {key: entry[key] for key in sources.regularizer_keys}
        if self.grad_norms:
            for key in sources.term_keys:
                logs[f"{key}/grad_norm"] = entry[f"{key}/grad_norm"]
                logs[f"{key}/grad_norm_weighted"] = entry[f"{key}/grad_norm_weighted"]
            if sources.has_loss:
                logs["base_loss/grad_norm"] = entry["base_loss/grad_norm"]
            logs["total/grad_norm"] = entry["total/grad_norm"]
        return logs

    # ------------------------------------------------------------ callback hooks

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_probes = []
        self._ended = None
        self._reset(training=True)

    def _due(self, batch):
        """Whether to read the objectives after this batch: every
        every_n_batches, and after an epoch's last batch, whose values Keras
        puts in the epoch logs. Reading them syncs the training state (on JAX)
        and waits for the step, so it is not done after every batch."""
        steps = (self.params or {}).get("steps")
        return (batch + 1) % self.every_n_batches == 0 or steps is None or batch + 1 >= steps

    # No on_train_batch_end: Keras dispatches batch ends asynchronously (JAX,
    # torch) unless a callback overrides that hook, and then does so for every
    # batch. The work due after batch k runs at the start of batch k + 1, on
    # the main thread, where a JAX state sync is safe; the epoch's last batch
    # is caught up in on_epoch_end, whose logs History records.

    def on_train_batch_begin(self, batch, logs=None):
        self._catch_up()
        self._ended = batch

    def _catch_up(self, logs=None):
        """The work due after the last batch that ended, if not done yet."""
        batch, self._ended = self._ended, None
        if batch is None:
            return
        if self._due(batch) or logs is not None:
            self._mirror(True, logs)
        if self.probe_data is not None and self._step % self.every_n_batches == 0:
            probe_logs = self._probe_logs(self.probe())
            self._epoch_probes.append(probe_logs)
            if logs is not None:
                logs.update(probe_logs)
        self._step += 1

    def on_epoch_end(self, epoch, logs=None):
        self._catch_up(logs if logs is not None else {})
        if logs is not None and self._epoch_probes:
            for key in self._epoch_probes[0]:
                logs[key] = sum(p[key] for p in self._epoch_probes) / len(self._epoch_probes)

    def on_test_begin(self, logs=None):
        self._reset(training=False)

    def on_test_batch_end(self, batch, logs=None):
        self._mirror(False, logs)

    # ------------------------------------------------------------ plot

    def plot(self):
        """A matplotlib Figure: each term's contribution (weight × value) and
        gradient norm over the probed steps. Needs matplotlib and probes."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            from matplotlib import pyplot as plt
        except ImportError as error:
            raise ImportError("PenaltyMonitor.plot() needs matplotlib: pip install matplotlib") from error
        if not self.history:
            raise ValueError("No probes yet: give PenaltyMonitor probe_data and train first.")
        sources, _ = self._probes[id(self._model)]
        steps = [entry["step"] for entry in self.history]
        rows = 2 if self.grad_norms else 1
        figure, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows), sharex=True, squeeze=False)
        for key in sources.term_keys:
            axes[0, 0].plot(steps, [e[f"{key}/contribution"] for e in self.history], label=key)
        axes[0, 0].plot(steps, [e["base_loss"] for e in self.history], "k--", label="base loss")
        axes[0, 0].set_ylabel("contribution to the loss")
        axes[0, 0].legend(fontsize="small")
        if self.grad_norms:
            for key in sources.term_keys:
                axes[1, 0].plot(steps, [e[f"{key}/grad_norm_weighted"] for e in self.history], label=key)
            axes[1, 0].plot(steps, [e["base_loss/grad_norm"] for e in self.history], "k--", label="base loss")
            axes[1, 0].plot(steps, [e["total/grad_norm"] for e in self.history], "k", label="total")
            axes[1, 0].set_yscale("log")
            axes[1, 0].set_ylabel("weighted ‖∂/∂θ‖")
            axes[1, 0].legend(fontsize="small")
        axes[-1, 0].set_xlabel("training step")
        figure.tight_layout()
        return figure
