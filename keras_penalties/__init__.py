"""keras-penalties: composable regularization penalties and loss terms for Keras 3."""

from keras_penalties import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
