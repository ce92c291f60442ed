"""`PenaltyMonitor`: every penalty term's value, and gradient norms, in the training logs."""

import keras
from keras import ops

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


class _Mirror(keras.metrics.Metric):
    """Holds values the monitor reads outside the training step, so that Keras
    reports them like any metric (progress bar, History, evaluate's result)."""

    def __init__(self, keys, name):
        super().__init__(name=name)
        self.keys = list(keys)
        self.values = self.add_variable(shape=(len(self.keys),), initializer="zeros", name="values")

    def update_state(self, values):
        self.values.assign(ops.convert_to_tensor(values, self.values.dtype))

    def result(self):
        # A copy: on torch, indexing the variable gives views of its storage,
        # which a later update (validation) would change under the logs.
        values = ops.copy(self.values.value)
        return {key: values[i] for i, key in enumerate(self.keys)}


class PenaltyMonitor(keras.callbacks.Callback):
    """Reports each penalty term of a model in its fit/evaluate logs and History.

    Terms of every `CompositeObjective` layer appear as `"<layer name>/<term>"`
    and terms of a compiled `CompositeLoss` as `"<loss name>/<term>"`: the
    mean unweighted value over the epoch so far in the progress bar,
    epoch-averaged in History (`val_`-prefixed for validation), and in the
    dict `evaluate(..., return_dict=True)` returns. The values are the same
    on JAX, TensorFlow and PyTorch.

    How: objectives keep running sums in non-trainable variables, which every
    backend's training step carries; after each batch the monitor copies their
    means into a metric it adds to the model, and it adds each CompositeLoss's
    tracker, so Keras reports both. They are removed again when `fit` (or a
    standalone `evaluate`) ends.

    Example:

    ```python
    history = model.fit(x, y, validation_split=0.2, callbacks=[PenaltyMonitor()])
    history.history["objective/entropy"]
    model.evaluate(x, y, callbacks=[PenaltyMonitor()], return_dict=True)
    ```
    """

    def __init__(self):
        super().__init__()
        self.objectives = []
        self._mirrors = {}
        self._registered = []
        self._in_fit = False

    # ------------------------------------------------------------ metrics in the model

    def set_model(self, model):
        super().set_model(model)
        self.objectives = [layer for layer in _layers(model) if isinstance(layer, CompositeObjective)]
        for objective in self.objectives:
            if id(objective) not in self._mirrors:
                keys = [f"{objective.name}/{term}" for term in objective.terms]
                self._mirrors[id(objective)] = _Mirror(keys, name=f"{objective.name}_terms")
        self._register(model)

    def _metrics_to_register(self, model):
        metrics = [self._mirrors[id(objective)] for objective in self.objectives]
        return metrics + [loss.tracker for loss in _composite_losses(model)]

    def _register(self, model):
        added = False
        for metric in self._metrics_to_register(model):
            if not any(m is metric for m in model.metrics):
                # The model's tracking is locked once built; its own metrics
                # list is what Model.metrics (and JAX's metrics state) read.
                model._metrics.append(metric)
                self._registered.append(metric)
                added = True
        for loss in _composite_losses(model):
            loss.tracker_registered = True
        if added:
            # Steps traced before these metrics existed neither update nor
            # carry them: trace again.
            model.train_function = model.test_function = None

    def _unregister(self):
        model = self._model
        if not self._registered:
            return
        ids = {id(m) for m in self._registered}
        model._metrics[:] = [m for m in model._metrics if id(m) not in ids]
        self._registered = []
        for loss in _composite_losses(model):
            loss.tracker_registered = False
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

    def on_train_begin(self, logs=None):
        self._in_fit = True

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._unregister()

    def on_epoch_begin(self, epoch, logs=None):
        self._reset(training=True)

    def on_train_batch_end(self, batch, logs=None):
        self._mirror(True, logs)

    def on_test_begin(self, logs=None):
        self._reset(training=False)

    def on_test_batch_end(self, batch, logs=None):
        self._mirror(False, logs)

    def on_test_end(self, logs=None):
        if not self._in_fit:
            self._unregister()
