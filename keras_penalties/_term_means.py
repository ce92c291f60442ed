"""Each composite's running term means as a Keras metric, which Keras puts
in `fit`/`evaluate` logs once the metric is one of the model's metrics (the
package's callbacks make it one): `TermMeans` keeps a `CompositeLoss`'s,
`ObjectiveMeans` reads a `CompositeObjective`'s own running sums."""

import weakref
from typing import Any

import keras
from keras import ops


class ObjectiveMeans(keras.metrics.Metric):
    """A CompositeObjective's running term means as a metric of its model.

    Its result is a dict `{"<objective>/<key>": mean}` (see
    `CompositeObjective.running_means`), which Keras spreads into the logs
    once the metric is one of the model's metrics (the package's callbacks
    make it one). The objective itself keeps the sums, in variables that
    flow out of every backend's forward pass; this metric only reads them,
    and resetting it (as Keras does when `fit` starts an epoch and when
    `evaluate` starts) zeroes them.
    """

    def __init__(self, objective):
        super().__init__(name=f"{objective.name}_terms")
        self._objective = weakref.ref(objective)
        self.keys = [f"{objective.name}/{key}" for key in objective.reported_keys]

    def update_state(self, *args, **kwargs):
        # The objective adds to its sums as it runs.
        pass

    def reset_state(self):
        objective = self._objective()
        if objective is not None:
            objective.reset_running_values(training=None)

    def result(self):
        objective = self._objective()
        means = objective.running_means() if objective is not None else ops.zeros((len(self.keys),), "float32")
        return {key: means[i] for i, key in enumerate(self.keys)}


_objective_means: weakref.WeakKeyDictionary[Any, ObjectiveMeans] = weakref.WeakKeyDictionary()


def objective_means(objective: Any) -> ObjectiveMeans:
    """The one `ObjectiveMeans` metric of `objective` (kept outside the
    layer, so that Keras neither tracks nor saves it with the layer)."""
    if objective not in _objective_means:
        _objective_means[objective] = ObjectiveMeans(objective)
    return _objective_means[objective]


class TermMeans(keras.metrics.Metric):
    """Running means of a CompositeLoss's unweighted term values.

    Its result is a dict `{"<loss name>/<term>": mean}`, which Keras spreads
    into the logs once the metric is one of the model's metrics (PenaltyMonitor
    registers it).
    """

    def __init__(self, loss_name, term_names, **kwargs):
        super().__init__(name=f"{loss_name}_terms", **kwargs)
        self.keys = [f"{loss_name}/{term}" for term in term_names]
        self.sums = self.add_variable(shape=(len(term_names),), initializer="zeros", name="sums")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, values):
        self.sums.assign(self.sums + ops.cast(values, self.sums.dtype))
        self.count.assign(self.count + 1.0)

    def result(self):
        means = self.sums / ops.maximum(self.count, 1.0)
        return {key: means[i] for i, key in enumerate(self.keys)}
