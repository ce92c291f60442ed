"""Each composite's running term means, one way for both composites:
`RunningSums`, the variables a composite adds each call's values to (on
every call, whatever callbacks a run has), and `TermMeans`, the metric that
reads them inside the step. Keras puts the metric's result in `fit` and
`evaluate` logs once it is one of the model's metrics (the package's
callbacks make it one)."""

import weakref
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import backend


def state_variable(name, values, dtype="float32", trainable=False, aggregation="only_first_replica", local=False):
    """A composite's state as a variable, float32 (or `dtype`) and never
    autocast: under a mixed policy a weight of 1e5 would read inf and a step
    count would stall at 2049. Under a tf.distribute strategy, weights are the
    same on every replica (set from callbacks); `local` state (the step, the
    running values) is each replica's own ("on_read": no cross-replica sync
    inside the forward pass) and reads by `aggregation`."""
    values = np.asarray(values, dtype=dtype)
    return keras.Variable(
        initializer=values,
        shape=values.shape,
        dtype=dtype,
        trainable=trainable,
        autocast=False,
        aggregation=aggregation,
        synchronization="on_read" if local else "auto",
        name=name,
    )


_TRAIN, _EVAL = 0, 1


class RunningSums:
    """Running sums of a composite's reported values and their call counts,
    made on `owner` (a layer): row 0 for training calls, row 1 for the
    others (evaluate, predict). Under a strategy each replica adds its own,
    and they read as the replicas' mean, the whole batch's value."""

    def __init__(self, owner: Any, size: int) -> None:
        owner.value_sums = state_variable("value_sums", np.zeros((2, size)), aggregation="mean", local=True)
        owner.value_counts = state_variable("value_counts", np.zeros(2), aggregation="mean", local=True)
        self.sums, self.counts = owner.value_sums, owner.value_counts
        # The sums and counts as the last forward pass left them, where the
        # step's metrics are read in a scope of their own (JAX).
        self.kept: Any = None

    @property
    def variables(self) -> list[Any]:
        return [self.sums, self.counts]

    def add(self, values: Any, training: bool) -> None:
        """Adds one call's values (and 1 to its count), kept for the step's metrics."""
        if backend.traced_outside_scope(values):
            return
        row = _TRAIN if training else _EVAL
        backend.add_to_row(self.sums, row, values)
        backend.add_to_row(self.counts, row, 1.0)
        self.kept = backend.keep_for_metrics((self.sums, self.counts))

    def means(self) -> Any:
        """Each value's mean since the last reset, a float32 tensor: the
        training calls' if there were any, else the others'; 0 before any
        call. In JAX's metric scope, the values the step's forward pass
        kept, read once (a second read in that scope gives 0)."""
        state = backend.kept_for_metrics(self.kept, (self.sums, self.counts))
        self.kept = None  # read: a traced step's tracers are not kept past it
        sums, counts = state if state is not None else (self.sums.value, self.counts.value)
        row = ops.where(counts[_TRAIN] > 0, _TRAIN, _EVAL)
        return sums[row] / ops.maximum(counts[row], 1.0)

    def values(self, keys: list[str], training: bool) -> dict[str, float]:
        """`{key: mean}` over the training calls or the others, as floats;
        empty before the first such call."""
        row = _TRAIN if training else _EVAL
        count = float(ops.convert_to_numpy(self.counts)[row])
        if count == 0:
            return {}
        sums = ops.convert_to_numpy(self.sums)[row]
        return {key: float(sums[i] / count) for i, key in enumerate(keys)}

    def reset(self, training: bool | None) -> None:
        """Zeroes the training row (`training=True`), the other (False) or both (None)."""
        rows = [_TRAIN, _EVAL] if training is None else _TRAIN if training else _EVAL
        for variable in self.variables:
            array = np.array(ops.convert_to_numpy(variable))
            array[rows] = 0.0
            variable.assign(array)


class TermMeans(keras.metrics.Metric):
    """A composite's running term means as a metric of its model.

    Its result is a dict `{"<composite>/<key>": mean}` (see the composite's
    `running_means`), which Keras spreads into the logs once the metric is
    one of the model's metrics. The composite keeps the sums, in variables
    that flow out of every backend's forward pass; this metric only reads
    them, and resetting it (as Keras does when `fit` starts an epoch and
    when `evaluate` starts) zeroes them.
    """

    def __init__(self, composite: Any) -> None:
        super().__init__(name=f"{composite.name}_terms")
        self._composite = weakref.ref(composite)
        self.keys = [f"{composite.name}/{key}" for key in composite.reported_keys]

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        # The composite adds to its sums as it runs.
        pass

    def reset_state(self) -> None:
        composite = self._composite()
        if composite is not None:
            composite.reset_running_values(training=None)

    def result(self) -> Any:
        composite = self._composite()
        means = composite.running_means() if composite is not None else ops.zeros((len(self.keys),), "float32")
        return {key: means[i] for i, key in enumerate(self.keys)}


_term_means: weakref.WeakKeyDictionary[Any, TermMeans] = weakref.WeakKeyDictionary()


def term_means(composite: Any) -> TermMeans:
    """The one `TermMeans` metric of `composite` (kept outside it, so that
    Keras neither tracks nor saves it with the composite)."""
    if composite not in _term_means:
        _term_means[composite] = TermMeans(composite)
    return _term_means[composite]
