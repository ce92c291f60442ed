"""`RouterLogits`: a model's internal mixture-of-experts router logits,
handed out as tensors of the current forward pass.

keras-hub's MoE blocks compute their routers' logits and return them to the
decoder, which drops them. Each router is a Keras layer with a public
`activity_regularizer` attribute, which Keras calls on the layer's output at
every call: `RouterLogits` sets it to a recorder that keeps that output and
returns what the router's own regularizer returned (0 without one), so the
model's outputs, gradients and losses are unchanged and no keras-hub code is
patched.
"""

import numbers
import threading
import warnings
from typing import Any, Sequence

import keras
from keras import ops

from keras_penalties import _keras_internals
from keras_penalties._saving import with_hint, without_hint

# keras-hub 0.32's router layers: Mixtral, Qwen-MoE and Qwen3-MoE; Qwen3.5-MoE.
ROUTER_NAMES = ("sparse_feedforward_gate_dense", "router_gate")
# keras-hub's own load-balancing coefficients (Mixtral; the Qwen models).
COEFFICIENTS = ("router_aux_loss_coef", "router_aux_loss_coefficient")


@keras.saving.register_keras_serializable(package="keras_penalties")
class RouterRecorder(keras.regularizers.Regularizer):
    """What `RouterLogits` sets a router's `activity_regularizer` to: it
    returns `regularizer(output)` (0 for None) and, once armed by a
    `RouterLogits`, keeps `output`, one per thread (`tf.distribute` runs each
    replica's step in a thread of its own). Its config holds the
    regularizer it wraps; a model that saves it (a plain Keras model whose
    routers were listed: keras-hub's blocks rebuild theirs from their own
    arguments) loads after `import keras_penalties`, as every class of the
    package does, and a loaded one records nothing until a `RouterLogits`
    arms it."""

    def __init__(self, regularizer: Any = None) -> None:
        self.regularizer = regularizer
        self.armed = False
        # One slot a thread, gone with its thread.
        self._latest = threading.local()

    def __call__(self, x: Any) -> Any:
        if self.armed:
            self._latest.output = x
        if self.regularizer is None:
            return ops.zeros((), dtype="float32")
        return self.regularizer(x)

    def latest(self) -> Any:
        """This thread's latest output, or None."""
        return getattr(self._latest, "output", None)

    def get_config(self) -> dict[str, Any]:
        wrapped = None if self.regularizer is None else keras.regularizers.serialize(self.regularizer)
        return with_hint({"regularizer": wrapped})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "RouterRecorder":
        wrapped = without_hint(config).get("regularizer")
        return cls(None if wrapped is None else keras.regularizers.deserialize(wrapped))


class _Routers:
    """The routers a `RouterLogits` reads, outside Keras' tracking (a layer
    holding them would own their weights)."""

    def __init__(self, layers: list) -> None:
        self.layers = layers


class RouterLogits(keras.layers.Layer):
    """The router logits a model computes inside its layers and does not
    return, as tensors of the current forward pass: a layer without weights.

    Each router's `activity_regularizer` becomes a `RouterRecorder`, which
    keeps the router's latest output and returns what the router's own
    activity regularizer returned (0 without one): `model`'s outputs,
    gradients and total loss are unchanged, it saves and loads as before
    (a loaded model records nothing until a new `RouterLogits` hooks it),
    and no keras-hub code is patched or subclassed.

    Args:
        model: the model (or backbone) whose routers to read.
        layers: None, every `keras.layers.Dense` nested in `model` named
            `"sparse_feedforward_gate_dense"` (keras-hub's Mixtral, Qwen-MoE,
            Qwen3-MoE) or `"router_gate"` (Qwen3.5-MoE), in the order
            `model` tracks its layers (a backbone's layer 0 first); or the
            router layers, each producing [..., E] logits.
        name: the layer's name.

    `routers(x)`: `x` is any tensor of the same forward pass (it orders the
    call after the model's in a functional graph). Returns a list with one
    [tokens, E] tensor per router, its logits from `model`'s latest call on
    this replica, flattened to rows, in the router's compute dtype,
    differentiable (gradients reach the router kernels and below);
    symbolically, [None, E] KerasTensors.

    Warns once when a nested layer has keras-hub's own load-balancing
    coefficient (`router_aux_loss_coef`, `router_aux_loss_coefficient`)
    non-zero: both losses would count. Not itself saved (it holds `model`).

    Raises:
        ValueError: no router found, `layers` empty or not Keras layers;
            called before `model` has run on this replica (naming the
            router).

    Example:

    >>> import keras, numpy as np
    >>> import keras_penalties as kp
    >>> inputs = keras.Input((3,))
    >>> router = keras.layers.Dense(4, name="router")
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(router(inputs)))
    >>> routers = kp.RouterLogits(model, layers=[router])
    >>> outputs = model(np.ones((5, 3), "float32"))
    >>> [tuple(t.shape) for t in routers(outputs)]
    [(5, 4)]
    """

    def __init__(
        self, model: keras.layers.Layer, *, layers: Sequence[keras.layers.Layer] | None = None, name: str | None = None
    ) -> None:
        super().__init__(name=name)
        routers = _routers(model, layers)
        self._hooked = _Routers(routers)
        self.built = True  # no weights to build
        for router in routers:
            recorder = router.activity_regularizer
            if not isinstance(recorder, RouterRecorder):
                recorder = RouterRecorder(recorder)
                router.activity_regularizer = recorder
            recorder.armed = True
        _warn_if_coefficient(model)

    @property
    def routers(self) -> list:
        """The router layers this reads."""
        return list(self._hooked.layers)

    def call(self, x: Any) -> list:
        logits = []
        for router in self._hooked.layers:
            latest = router.activity_regularizer.latest()
            if latest is None:
                raise ValueError(
                    f"RouterLogits: the router {router.name!r} has not run on this replica yet: call the model "
                    "before its routers."
                )
            logits.append(ops.reshape(latest, (-1, ops.shape(latest)[-1])))
        return logits

    def compute_output_spec(self, x: Any) -> list:
        return [
            keras.KerasTensor((None, _experts(router)), dtype=router.compute_dtype) for router in self._hooked.layers
        ]

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(
            "RouterLogits holds the model it reads and is not saved: rebuild it in code and load the weights."
        )


def _experts(router):
    units = getattr(router, "units", None)
    if isinstance(units, int):
        return units
    shape = getattr(router, "output_shape", None)
    return shape[-1] if shape else None


def _routers(model, layers):
    if layers is None:
        if not isinstance(model, keras.layers.Layer):
            raise ValueError(f"`model` must be a Keras model or layer; got {type(model).__name__}.")
        found = [
            layer
            for layer in _keras_internals.nested_layers(model)
            if isinstance(layer, keras.layers.Dense) and layer.name in ROUTER_NAMES
        ]
        if not found:
            raise ValueError(
                f"`model`: no router found in {model.name!r} (no Dense layer named one of {list(ROUTER_NAMES)}); "
                "pass the router layers as `layers=[...]`."
            )
        return found
    if isinstance(layers, keras.layers.Layer) or not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"`layers` must be a non-empty list of the router layers; got {layers!r}.")
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(f"`layers` must hold Keras layers (the routers); got {type(layer).__name__}.")
    return list(layers)


def _warn_if_coefficient(model):
    layers = [model, *_keras_internals.nested_layers(model)] if isinstance(model, keras.layers.Layer) else []
    for layer in layers:
        for name in COEFFICIENTS:
            value = getattr(layer, name, None)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and value:
                warnings.warn(
                    f"RouterLogits: {layer.name!r} has `{name}={value}`, its own load-balancing loss: with a "
                    f"penalty on these router logits both losses count. Build the model with `{name}=0.0`.",
                    stacklevel=3,
                )
                return
