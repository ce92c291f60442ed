"""Helpers every test module shares: conversion, gradients, finite differences.

The suite runs once per backend (KERAS_BACKEND); nothing here branches on it
except `float64_scope`, because JAX keeps float64 off unless asked, and
`compiled`, each backend's compiler.
"""

import contextlib

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import backend
from keras_penalties.gradients import input_gradient

BACKEND = keras.backend.backend()


def to_numpy(x):
    """A tensor as a NumPy array; half precision goes through float32
    (NumPy cannot hold bfloat16, and TF's bfloat16 fails np.array)."""
    x = ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    if dtype in ("float16", "bfloat16"):
        x = ops.cast(x, "float32")
    return np.asarray(ops.convert_to_numpy(x))


def grad(fn, x):
    """NumPy gradient of Σ fn(x) w.r.t. x, through the package's own dispatcher."""
    return to_numpy(input_gradient(fn, ops.convert_to_tensor(x)))


def grads(fn, *xs):
    """NumPy gradients of the scalar fn(*xs) w.r.t. each of xs, in one
    backward pass (one compilation of fn on eager JAX, not one per input)."""
    return [to_numpy(g) for g in backend.gradients(fn, [ops.convert_to_tensor(x) for x in xs])]


def compiled(fn):
    """`fn` compiled once, as `fit` would: `jax.jit` (an eager call of a
    chunked op traces and compiles its scan every time, about 0.3 s, which
    finite differences over a hundred coordinates cannot afford), a
    `tf.function` on TensorFlow; on torch `fn` itself."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


@contextlib.contextmanager
def float64_scope():
    """Lets float64 tensors be float64 on every backend (JAX needs x64 on)."""
    if BACKEND == "jax":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


def central_difference(fn, x, eps=1e-6):
    """d fn / dx by central differences; fn maps a float64 array to a scalar."""
    x = np.array(x, dtype=np.float64)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = eps
        out[i] = (float(fn(x + step)) - float(fn(x - step))) / (2 * eps)
    return out


def assert_raises_as_listed(case):
    """`case` is `(call, error type, message regex)`: calling raises so."""
    call, error, message = case
    with pytest.raises(error, match=message):
        call()


def assert_finite(x, what):
    x = np.asarray(x)
    assert np.all(np.isfinite(x)), f"{what} has non-finite entries: {x}"


def assert_config_round_trip(obj, get, package):
    """`obj` survives get_config/from_config and Keras' registry (`get` is
    e.g. keras.regularizers.get), with every option intact."""
    config = obj.get_config()
    rebuilt = type(obj).from_config(config)
    assert type(rebuilt) is type(obj)
    assert rebuilt.get_config() == config
    serialized = keras.saving.serialize_keras_object(obj)
    assert serialized["registered_name"] == f"{package}>{type(obj).__name__}"
    revived = get(serialized)
    assert type(revived) is type(obj)
    assert revived.get_config() == config
    return rebuilt


def save_and_load(model, directory):
    """Saves to .keras and loads back with the default safe_mode=True."""
    path = str(directory / "model.keras")
    model.save(path)
    return keras.saving.load_model(path)
