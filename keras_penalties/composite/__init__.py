"""Composition: several penalties and losses weighed into one.

`Term` says what a term computes and how it weighs; `CompositeObjective`
(a layer, inside a model) and `CompositeLoss` (for `compile`) hold terms
and their weights, report each term's value, and take a weighting rule
(`keras_penalties.composite.weighting`). The modules, each one job:

- `term`: `Term`, a penalty with its weight, inputs and options.
- `adapters`: what a term calls, made into a scalar: ops, regularizers,
  Keras losses.
- `weighting`: the weighting rules (fixed, uncertainty, FAMO) as objects,
  and their math as functions.
- `state`: the composites' variables and running sums, and the metric that
  reads them into the logs.
- `core`: what both composites share: terms, weights, the weighted total.
- `layer`: `CompositeObjective`.
- `loss`: `CompositeLoss`.
- `capture`: a probe's view of each composite's values in one forward pass.
"""

from keras_penalties.composite.layer import CompositeObjective
from keras_penalties.composite.loss import CompositeLoss
from keras_penalties.composite.term import Term

__all__ = ["Term", "CompositeObjective", "CompositeLoss"]
