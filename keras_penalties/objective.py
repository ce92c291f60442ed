"""`CompositeObjective`, importable from here for a release: it lives in
`keras_penalties.composite.layer` (also `keras_penalties.CompositeObjective`)."""

from keras_penalties.composite.layer import CompositeObjective

__all__ = ["CompositeObjective"]
