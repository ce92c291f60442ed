"""A fingerprint of what the package traces for three chunked ops: a
refactor that should change no computation shows it by printing the same
lines in the trees before and after (run from each tree's root).

    KERAS_BACKEND=tensorflow python -m bench.graph_fingerprint
    KERAS_BACKEND=jax python -m bench.graph_fingerprint

The ops, value and gradients w.r.t. the hidden states, kernel and bias:
cross-entropy from hidden states (`chunked_sum`), a frozen head's token
log-probabilities (`chunked_values`' row-Jacobian path) and a KL on formed
logits (`map_chunks`). TensorFlow: the count of each op type in the traced
step's graph and its function library (loop bodies, custom gradients).
JAX: a hash of the lowered HLO, metadata (source lines) removed. torch
traces nothing ahead: it has no fingerprint here.
"""

import collections
import hashlib
import os
import re

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_penalties import ops as P  # noqa: E402

CASES = ("cross_entropy_from_hidden", "frozen_head_logprobs", "kl_on_logits")


def loss(case, labels, h, k, b):
    if case == "cross_entropy_from_hidden":
        return P.cross_entropy(labels, P.linear(h, k, b), from_logits=True, chunk_size=16)
    if case == "frozen_head_logprobs":
        return keras.ops.sum(P.token_logprobs(labels, P.linear(h, keras.ops.stop_gradient(k)), chunk_size=16))
    logits = keras.ops.matmul(h, k)
    return P.kl_divergence(keras.ops.softmax(logits[::-1]), logits, from_logits=True, chunk_size=16)


def fingerprint(case):
    rng = np.random.default_rng(0)
    h, k = rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(16, 50)).astype("float32")
    b, labels = np.zeros(50, "float32"), rng.integers(0, 50, size=(64,))
    if keras.backend.backend() == "jax":
        import jax

        step = jax.jit(jax.value_and_grad(lambda *x: loss(case, labels, *x), argnums=(0, 1, 2)))
        text = re.sub(r", metadata=\{[^}]*\}", "", step.lower(h, k, b).as_text(dialect="hlo"))
        return hashlib.sha256(text.split("\n", 1)[1].encode()).hexdigest()[:16]
    import tensorflow as tf

    @tf.function
    def step(h, k, b):
        with tf.GradientTape() as tape:
            tape.watch([h, k, b])
            value = loss(case, labels, h, k, b)
        return value, tape.gradient(value, [h, k, b], unconnected_gradients="zero")

    graph = step.get_concrete_function(*map(tf.constant, (h, k, b))).graph.as_graph_def()
    ops = [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
    return sorted(collections.Counter(ops).items())


if __name__ == "__main__":
    for case in CASES:
        print(case, fingerprint(case))
