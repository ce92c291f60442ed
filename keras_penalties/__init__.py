"""keras-penalties: composable regularization penalties and loss terms for Keras 3."""

from keras_penalties import callbacks, gradients, losses, ops, optimizers, regularizers
from keras_penalties.composite.layer import CompositeObjective
from keras_penalties.composite.term import Term
from keras_penalties.routers import RouterLogits

__version__ = "0.1.0"

__all__ = [
    "CompositeObjective",
    "RouterLogits",
    "Term",
    "callbacks",
    "gradients",
    "losses",
    "ops",
    "optimizers",
    "regularizers",
    "__version__",
]
