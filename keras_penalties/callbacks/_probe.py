"""The probe shared by `PenaltyMonitor` and `GradNorm`: the fixed batch,
checked; one compiled, stateless measure of term values and gradient norms
(and GradNorm's update after it, in the same call); and the monitor's batch
cadence."""

import keras
from keras import ops

from keras_penalties.composite import capture
from keras_penalties import _keras_internals, gradients
from keras_penalties.callbacks._targets import _layers
from keras_penalties.composite.loss import CompositeLoss


def _probe_batch(probe_data):
    """`(x, y)`, `[x, y]` or `x` as tensors, checked before any tensor work."""
    x, y = tuple(probe_data) if isinstance(probe_data, (tuple, list)) and len(probe_data) == 2 else (probe_data, None)
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
    but what an `update` assigns (see `gradients.parameter_probe`), it
    measures the term values of `composites` and, with `everything`, the model's weight and activity
    regularizers, the compiled loss and the total training loss — in that
    order, as `keys` lists them (then "base_loss", "total") — with each one's
    gradient norm over `variables` (all trainable ones by default).

    A composite called several times per pass (a shared encoder on two
    views) gives the mean of its calls (`calls="mean"`, as its logs) or
    their sum (`calls="sum"`, as it counts in the loss). `batched` and
    `update`: see `gradients.parameter_probe`.
    """

    def __init__(
        self,
        model,
        composites,
        *,
        everything=True,
        calls="mean",
        variables=None,
        grad_norms=True,
        batched=False,
        update=None,
    ):
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
            model, self._outputs, size, grad_norms=grad_norms, variables=variables, batched=batched, update=update
        )

    def __call__(self, x, y):
        """`(values, norms)`, NumPy vectors in `keys` order (norms None
        without `grad_norms`), and the update's result with `update`."""
        return self._measure(x, y)

    def _outputs(self, x, y):
        """The measured values as a list of float32 scalars (run in a stateless scope)."""
        loss = None
        with capture.capturing(self.composites) as captured:
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
