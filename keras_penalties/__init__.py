"""keras-penalties: composable regularization penalties and loss terms for Keras 3."""

from keras_penalties import losses, ops, regularizers

__version__ = "0.1.0"

__all__ = ["losses", "ops", "regularizers", "__version__"]
