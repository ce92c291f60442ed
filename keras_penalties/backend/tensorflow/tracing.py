"""What TensorFlow's chunk loops ask of the trace they run in: whether XLA
compiles it, whether a tape records an input, whether the code running is
a chunk's body; and their chunks compiled by XLA on CPU."""

import contextvars
import functools

import tensorflow as tf

from keras_penalties import _keras_internals
from keras_penalties.backend import common


def in_xla():
    """Whether the graph being built will be compiled by XLA (`jit_compile`).
    TF has no public way to ask; without its private helper, assume so (the
    XLA-safe path works everywhere, at one more copy of the gradient)."""
    return _keras_internals.tf_graph_in_xla(tf.compat.v1.get_default_graph())


def traced_untaped():
    """Whether a gradient is being built for a graph traced with no tape
    recording its inputs: a `tf.function` differentiated by a tape outside
    it. The loops then kept no gradient, and form them when asked (a second
    loop). In eager mode an input no tape recorded needs none; `fit` traces
    its tape inside the step, so its inputs are recorded, and `evaluate`
    never asks."""
    return not tf.executing_eagerly()


def recorded(tensor):
    """Whether a gradient tape records `tensor` (someone may ask for its
    gradient). TF's own `custom_gradient` asks this; the helper is private,
    and without it every input counts as recorded."""
    return _keras_internals.tf_records_backprop([tensor])


# Whether the code running is the forward pass of a chunk of logits formed
# from hidden states (`chunked_sum`), whose gradient is taken once: where
# `label_cross_entropy` fuses.
in_chunk = contextvars.ContextVar("keras_penalties_tfin_chunk", default=False)


def chunk_body():
    return common.flag_set(in_chunk)


def compiled(fn, xla):
    """`fn` compiled by XLA (`tf.function(jit_compile=True)`) when it will
    be traced into a graph that XLA does not already compile and TF sees
    only CPUs (`compiles`); as it is eagerly, where each call would trace
    and compile it anew. A chunk's passes over its logits (softmax, logs,
    products, sums, and their gradients) then run fused, as on JAX, instead
    of one TF kernel and one chunk-sized buffer each."""
    return tf.function(fn, jit_compile=True, autograph=False) if compiles(xla) else fn


def compiles(xla):
    """Whether `compiled` compiles here."""
    return not xla and not tf.executing_eagerly() and _cpu_only()


@functools.cache
def _cpu_only():
    """Whether TF sees no device but CPUs, where compiling the chunks was
    shown to pay. With a GPU Keras' `fit` compiles the whole step with XLA
    anyway; a pluggable device may have no XLA compiler at all."""
    return all(d.device_type == "CPU" for d in tf.config.list_physical_devices())
