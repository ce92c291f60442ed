"""`ops.linear` and `ops.cross_entropy`: divergences, entropy and
cross-entropy from hidden states and a vocabulary projection.

Values against NumPy float64 on the materialised logits and against Keras'
own cross-entropy; gradients w.r.t. hidden states, kernel and bias against
central differences and against autodiff of the same op on logits formed
with `ops.matmul`; chunked equal to unchunked with masks, partial chunks,
half precision, empty and fully masked inputs, in `fit` and `jit`.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import backend
from keras_penalties import ops as P
from keras_penalties.gradients import input_gradient
from tests import oracles as O
from tests.testing import BACKEND, assert_finite, central_difference, compiled, float64_scope, grad, grads, to_numpy

RNG = np.random.default_rng(23)
B, T, H, V = 2, 5, 6, 11  # 10 positions: chunks of 4 leave a partial last chunk
STUDENT_HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
TEACHER_HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
KERNEL = RNG.normal(size=(H, V)).astype("float32")  # a Dense kernel [H, V]
EMBEDDING = RNG.normal(size=(V, H)).astype("float32")  # a tied embedding [V, H]
BIAS = RNG.normal(size=(V,)).astype("float32")
LABELS = RNG.integers(0, V, size=(B, T))
MASK = (RNG.uniform(size=(B, T)) < 0.6).astype("float32")
MASK[0, 0], MASK[0, 1] = 1.0, 0.0
CHUNKS = (None, 4, 64)  # formed whole, a partial last chunk, one padded chunk
HALF_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def _student(hidden=STUDENT_HIDDEN, kernel=KERNEL, bias=BIAS):
    return P.linear(hidden, kernel, bias)


def _teacher(hidden=TEACHER_HIDDEN, embedding=EMBEDDING):
    return P.linear(hidden, embedding, transpose_kernel=True)


STUDENT_LOGITS = O.np_linear(STUDENT_HIDDEN, KERNEL, BIAS)
TEACHER_LOGITS = O.np_linear(TEACHER_HIDDEN, EMBEDDING, transpose_kernel=True)

# name -> (ours(teacher, student, **kw), oracle per-position values(teacher logits, student logits))
FUNCTIONS = {
    "kl_forward_t2": (
        lambda t, s, **kw: P.kl_divergence(t, s, from_logits=True, temperature=2.0, **kw),
        lambda t, s: O.np_kl_divergence(t, s, True, temperature=2.0, reduction="none"),
    ),
    "kl_reverse": (
        lambda t, s, **kw: P.kl_divergence(t, s, from_logits=True, direction="reverse", **kw),
        lambda t, s: O.np_kl_divergence(t, s, True, direction="reverse", reduction="none"),
    ),
    "kl_symmetric": (
        lambda t, s, **kw: P.kl_divergence(t, s, from_logits=True, direction="symmetric", **kw),
        lambda t, s: O.np_kl_divergence(t, s, True, direction="symmetric", reduction="none"),
    ),
    "js_beta_t": (
        lambda t, s, **kw: P.js_divergence(t, s, from_logits=True, beta=0.3, temperature=0.5, **kw),
        lambda t, s: O.np_js_divergence(t, s, True, beta=0.3, temperature=0.5, reduction="none"),
    ),
    "entropy_normalized": (
        lambda t, s, **kw: P.entropy(s, from_logits=True, normalize=True, **kw),
        lambda t, s: O.np_entropy(s, True, normalize=True, reduction="none"),
    ),
    # Plain cross-entropy: on TF, chunks from hidden states take the fused
    # sparse_softmax_cross_entropy_with_logits.
    "cross_entropy": (
        lambda t, s, **kw: P.cross_entropy(LABELS[: s.shape[0], : s.shape[1]], s, **kw),
        lambda t, s: O.np_cross_entropy(LABELS, s, reduction="none"),
    ),
    "cross_entropy_smoothed": (
        lambda t, s, **kw: P.cross_entropy(
            LABELS[: s.shape[0], : s.shape[1]], s, label_smoothing=0.1, temperature=1.5, **kw
        ),
        lambda t, s: O.np_cross_entropy(LABELS, s, label_smoothing=0.1, temperature=1.5, reduction="none"),
    ),
}


def _reduced(values, reduction, mask):
    kept = np.ones(values.shape, bool) if mask is None else mask != 0
    return {
        "mean": values[kept].sum() / max(kept.sum(), 1),
        "sum": values[kept].sum(),
        "none": np.where(kept, values, 0.0),
    }[reduction]


# "mean" with a mask and "sum" without: the other pairs rescale the same sums.
# Per-position values only formed whole (chunks of lazy logits reduce).
REDUCTIONS = (("mean", MASK), ("sum", None))


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("lazy", ["both", "student"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_values_match_the_oracle_on_the_materialised_logits(name, lazy, chunk_size):
    ours, oracle = FUNCTIONS[name]
    values = oracle(TEACHER_LOGITS, STUDENT_LOGITS)
    teacher = _teacher() if lazy == "both" else TEACHER_LOGITS.astype("float32")
    for reduction, mask in REDUCTIONS + (() if chunk_size else (("none", MASK),)):
        got = to_numpy(ours(teacher, _student(), chunk_size=chunk_size, mask=mask, reduction=reduction))
        np.testing.assert_allclose(got, _reduced(values, reduction, mask), rtol=1e-5, atol=1e-6, err_msg=reduction)


def _materialised(hidden, kernel, bias=None, transpose_kernel=False):
    """The logits formed the obvious way, for autodiff to differentiate."""
    kernel = ops.transpose(kernel) if transpose_kernel else kernel
    logits = ops.matmul(hidden, kernel)
    return logits if bias is None else ops.add(logits, bias)


INPUTS = {
    "student_hidden": STUDENT_HIDDEN,
    "kernel": KERNEL,
    "bias": BIAS,
    "teacher_hidden": TEACHER_HIDDEN,
    "embedding": EMBEDDING,
}


def _loss(name, fused, chunk_size, mask, student_hidden, kernel, bias, teacher_hidden, embedding):
    """`name`'s value of the teacher and student logits, lazy (`fused`) or
    formed with ops.matmul."""
    if fused:
        teacher = P.linear(teacher_hidden, embedding, transpose_kernel=True)
        student = P.linear(student_hidden, kernel, bias)
    else:
        teacher = _materialised(teacher_hidden, embedding, transpose_kernel=True)
        student = _materialised(student_hidden, kernel, bias)
    return FUNCTIONS[name][0](teacher, student, chunk_size=chunk_size, mask=mask)


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_gradients_reach_hidden_kernel_and_bias_as_through_materialised_logits(name, chunk_size):
    fused = grads(lambda *x: _loss(name, True, chunk_size, MASK, *x), *INPUTS.values())
    expected = grads(lambda *x: _loss(name, False, None, MASK, *x), *INPUTS.values())
    for wrt, g, e in zip(INPUTS, fused, expected):
        assert_finite(g, f"{name} d/d{wrt}")
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)


@pytest.mark.parametrize("name", ["kl_forward_t2", "js_beta_t", "cross_entropy_smoothed"])
def test_fused_gradients_match_finite_differences(name):
    # Float64 end to end, the fused path chunked with a partial last chunk.
    small = [(v[:1, :3] if v.ndim == 3 else v).astype(np.float64) for v in INPUTS.values()]
    mask = np.array([[1.0, 0.0, 1.0]])

    with float64_scope():
        loss = compiled(lambda *x: _loss(name, True, 2, mask, *x))
        actual = grads(loss, *small)
        for i, wrt in enumerate(INPUTS):

            def one(x, i=i):
                return to_numpy(loss(*small[:i], x, *small[i + 1 :]))

            np.testing.assert_allclose(actual[i], central_difference(one, small[i]), rtol=1e-6, atol=1e-8, err_msg=wrt)


def test_repeated_compiled_calls_give_the_same_gradients():
    # The kernel's gradient is summed in place (TF, torch): every call of a
    # compiled step must start from zero (seen: a folded tf.zeros constant
    # kept the previous call's sum).
    def step(hidden, kernel, bias):
        loss = lambda h, k, b: P.cross_entropy(LABELS, P.linear(h, k, b), mask=MASK, chunk_size=4)  # noqa: E731
        return backend.gradients(loss, [hidden, kernel, bias])

    step = compiled(step)
    args = [ops.convert_to_tensor(x) for x in (STUDENT_HIDDEN, KERNEL, BIAS)]
    first = [to_numpy(g) for g in step(*args)]
    expected = grads(lambda h, k, b: P.cross_entropy(LABELS, _materialised(h, k, b), mask=MASK), *args)
    for _ in range(2):
        for g, e in zip(step(*args), expected):
            np.testing.assert_allclose(to_numpy(g), e, rtol=1e-5, atol=1e-6)
    for g, e in zip(first, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_compiled_loss_differentiated_from_outside(lazy):
    # The gradient of a compiled function taken outside it (a tf.function
    # under an outer GradientTape): nothing records the inputs while it is
    # traced, so the chunk loops keep no gradient and must form it when asked.
    def loss(hidden, kernel):
        logits = P.linear(hidden, kernel) if lazy else ops.matmul(hidden, kernel)
        return P.kl_divergence(TEACHER_LOGITS.astype("float32"), logits, from_logits=True, mask=MASK, chunk_size=4)

    def formed(hidden, kernel):
        return P.kl_divergence(
            TEACHER_LOGITS.astype("float32"), _materialised(hidden, kernel), from_logits=True, mask=MASK
        )

    for got, expected in zip(grads(compiled(loss), STUDENT_HIDDEN, KERNEL), grads(formed, STUDENT_HIDDEN, KERNEL)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_tied_embedding_is_read_transposed():
    # [V, H] with transpose_kernel equals its transpose as a [H, V] kernel,
    # and the gradient reaches the embedding in its own layout.
    for chunk_size in (None, 4):
        tied = P.entropy(
            P.linear(STUDENT_HIDDEN, EMBEDDING, transpose_kernel=True), from_logits=True, chunk_size=chunk_size
        )
        dense = P.entropy(P.linear(STUDENT_HIDDEN, EMBEDDING.T.copy()), from_logits=True, chunk_size=chunk_size)
        np.testing.assert_allclose(to_numpy(tied), to_numpy(dense), rtol=1e-6)
        g = grad(
            lambda e: P.entropy(
                P.linear(STUDENT_HIDDEN, e, transpose_kernel=True), from_logits=True, chunk_size=chunk_size
            ),
            EMBEDDING,
        )
        g_dense = grad(
            lambda k: P.entropy(P.linear(STUDENT_HIDDEN, k), from_logits=True, chunk_size=chunk_size),
            EMBEDDING.T.copy(),
        )
        np.testing.assert_allclose(g, g_dense.T, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="TF adds the kernel's gradient in blocks of a fixed number of elements (the sizes here make one block); "
    "JAX's blocks follow the chunk's rows (chunks of 2 and 4 above make several), "
    "torch adds it whole in place (addmm_)",
)
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("elements", [1, 25])
def test_the_kernel_gradient_in_several_blocks(elements, graph, monkeypatch):
    # 1 element: a block per kernel row; 25: the student's [6, 11] kernel in
    # three blocks of 2 rows (they divide its rows: the sum seen as one row
    # per block), the teacher's tied [11, 6] embedding in blocks of 4, 4 and
    # 3 rows (no divisor of 11 from 4 down to 2: added row by row). In a
    # tf.function the blocks' products are ordered by control dependencies
    # inside the chunk loop; eagerly they are not.
    import tensorflow as tf

    from keras_penalties.backend.tensorflow import blocks as tf_blocks

    monkeypatch.setattr(tf_blocks, "_KERNEL_BLOCK_ELEMENTS", elements)

    def fused_grads(*x):
        return backend.gradients(lambda *y: _loss("js_beta_t", True, 4, MASK, *y), list(x))

    if graph:
        fused_grads = tf.function(fused_grads)
    fused = [to_numpy(g) for g in fused_grads(*[tf.constant(x) for x in INPUTS.values()])]
    expected = grads(lambda *x: _loss("js_beta_t", False, None, MASK, *x), *INPUTS.values())
    for wrt, g, e in zip(INPUTS, fused, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="TF runs a chunk's loss in blocks of rows inside the chunk's compiled function (a tf.function or XLA; "
    "the sizes here make one block unless the budget is cut); JAX and torch take the chunk's loss whole",
)
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("elements", [V, 2 * V])
@pytest.mark.parametrize(
    "name, teacher",
    [("js_beta_t", "lazy"), ("js_beta_t", "formed"), ("kl_reverse", "frozen"), ("cross_entropy", "lazy")],
)
def test_a_chunks_loss_in_blocks_of_rows(name, teacher, elements, jit_compile, monkeypatch):
    # Chunks of 4 rows: blocks of 1 row (V elements) or of 2 (2V). With the
    # teacher's logits formed first, their gradient comes from the blocks
    # too; a frozen teacher's head gives the blocks one gradient fewer.
    import tensorflow as tf

    from keras_penalties.backend.tensorflow import blocks as tf_blocks
    from keras_penalties.backend.tensorflow import chunks as tf_chunks

    # The budget TF's chunk loop reads for its blocks.
    monkeypatch.setattr(tf_chunks, "CHUNK_ELEMENTS", elements)
    blocks = []
    block_rows = tf_blocks._block_rows
    monkeypatch.setattr(tf_blocks, "_block_rows", lambda *a: blocks.append(block_rows(*a)) or blocks[-1])

    def loss(fused, chunk_size, student_hidden, kernel, bias, teacher_hidden, embedding):
        if teacher == "frozen":
            teacher_hidden, embedding = ops.stop_gradient(teacher_hidden), ops.stop_gradient(embedding)
        if teacher == "formed" or not fused:
            teacher_logits = _materialised(teacher_hidden, embedding, transpose_kernel=True)
        else:
            teacher_logits = P.linear(teacher_hidden, embedding, transpose_kernel=True)
        student = P.linear(student_hidden, kernel, bias) if fused else _materialised(student_hidden, kernel, bias)
        return FUNCTIONS[name][0](teacher_logits, student, chunk_size=chunk_size, mask=MASK)

    @tf.function(jit_compile=jit_compile)
    def fused(*x):
        return backend.gradients(lambda *y: loss(True, 4, *y), list(x))

    got = [to_numpy(g) for g in fused(*[tf.constant(x) for x in INPUTS.values()])]
    assert blocks == [elements // V], blocks  # the blocked path ran, with blocks of that many rows
    expected = grads(lambda *x: loss(False, None, *x), *INPUTS.values())
    for wrt, g, e in zip(INPUTS, got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's blocks of a chunk's rows (see above); the others have none")
def test_blocks_of_a_chunk_stay_near_the_budget():
    from keras_penalties.backend.tensorflow import blocks as tf_blocks

    budget = backend.CHUNK_ELEMENTS  # 2**20: 8 rows of 128256, 32 of 32000

    def block_rows(rows, classes):
        return tf_blocks._block_rows(rows, classes, budget)

    assert block_rows(128, 128256) == 8 and block_rows(130, 128256) == 5  # 5 divides 130; 4..8 allowed
    assert block_rows(509, 32000) == 509  # no divisor in 16..32: the chunk whole, not 509 blocks of 1
    assert block_rows(16, 32000) == 16 and block_rows(64, None) == 64  # within the budget; classes unknown
    assert block_rows(64, budget) == 1


# --------------------------------------------------------------- cross-entropy


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_cross_entropy_equals_keras_sparse_categorical_crossentropy(chunk_size):
    logits = STUDENT_LOGITS.astype("float32")
    keras_values = to_numpy(keras.losses.sparse_categorical_crossentropy(LABELS, logits, from_logits=True))
    ours = to_numpy(P.cross_entropy(LABELS, logits, reduction="none", chunk_size=chunk_size))
    np.testing.assert_allclose(ours, keras_values, rtol=1e-5, atol=1e-6)
    # Label smoothing: Keras' categorical convention on the one-hot labels.
    one_hot = np.eye(V, dtype="float32")[LABELS]
    smoothed = to_numpy(keras.losses.categorical_crossentropy(one_hot, logits, from_logits=True, label_smoothing=0.2))
    ours = to_numpy(P.cross_entropy(LABELS, logits, label_smoothing=0.2, reduction="none", chunk_size=chunk_size))
    np.testing.assert_allclose(ours, smoothed, rtol=1e-5, atol=1e-6)
    # Probabilities (all well above Keras' 1e-7 clip), and another class axis.
    probs = to_numpy(ops.softmax(logits))
    ours = to_numpy(
        P.cross_entropy(
            LABELS, np.moveaxis(probs, -1, 1), from_logits=False, axis=1, reduction="none", chunk_size=chunk_size
        )
    )
    expected = to_numpy(keras.losses.sparse_categorical_crossentropy(LABELS, probs))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_cross_entropy_reads_no_label_where_the_mask_drops_it():
    # Liger's ignore_index = -100 is our mask; -100 is never used as an index.
    labels = np.where(MASK != 0, LABELS, -100)
    for chunk_size in (None, 4):
        got = P.cross_entropy(labels, _student(), mask=MASK, chunk_size=chunk_size)
        expected = _reduced(O.np_cross_entropy(LABELS, STUDENT_LOGITS, reduction="none"), "mean", MASK)
        np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5)


def test_cross_entropy_oracle_by_hand():
    # Uniform logits over 4 classes: −log ¼ whatever the label; smoothing
    # leaves it unchanged (every log p is log ¼).
    zeros = np.zeros((3, 4), "float32")
    for smoothing in (0.0, 0.5):
        got = P.cross_entropy([0, 2, 3], zeros, label_smoothing=smoothing)
        np.testing.assert_allclose(to_numpy(got), np.log(4.0), rtol=1e-6)


def _forward_mode(fn, x, tangent):
    """d/dε fn(x + ε·tangent) at 0 by each backend's forward mode."""
    if BACKEND == "jax":
        import jax

        return to_numpy(jax.jvp(fn, (ops.convert_to_tensor(x),), (ops.convert_to_tensor(tangent),))[1])
    if BACKEND == "torch":
        import torch

        return to_numpy(torch.func.jvp(fn, (ops.convert_to_tensor(x),), (ops.convert_to_tensor(tangent),))[1])
    import tensorflow as tf

    x = tf.constant(x)
    with tf.autodiff.ForwardAccumulator(x, tf.constant(tangent)) as accumulator:
        y = fn(x)
    return to_numpy(accumulator.jvp(y))


@pytest.mark.parametrize("axis", [-1, 1])
def test_cross_entropy_has_a_forward_mode_derivative(axis):
    # JAX picks the label with a forward-mode rule of its own (whose
    # transpose XLA fuses; reverse mode through a gather is a scatter into
    # a zeroed buffer): jvp on every backend against Σ_k (p_k − [k = label])·t_k.
    logits = STUDENT_LOGITS.astype("float32")
    tangent = np.random.default_rng(7).normal(size=logits.shape).astype("float32")
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.mean(np.sum((p - np.eye(V)[LABELS]) * tangent, -1))
    move = (lambda a: a) if axis == -1 else (lambda a: np.moveaxis(a, -1, 1))
    got = _forward_mode(lambda x: P.cross_entropy(LABELS, x, axis=axis), move(logits), move(tangent))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- dtypes and edges


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_hidden_states_give_float32_logits_per_chunk(dtype):
    # A mixed-precision model: half hidden states, a float32 kernel (a
    # variable read outside the layer), or a half one (autocast inside it).
    # Chunked equals the whole logits formed in float32 from the same inputs,
    # the result has the inputs' common dtype and gradients their own.
    hidden = ops.cast(STUDENT_HIDDEN, dtype)
    rounded = to_numpy(hidden).astype(np.float64)
    for kernel in (KERNEL, ops.cast(KERNEL, dtype)):
        # The result has the inputs' common float dtype: float32 beside a
        # float32 kernel, half when everything is half.
        out_dtype = keras.backend.standardize_dtype(ops.convert_to_tensor(kernel).dtype)
        teacher = ops.cast(TEACHER_LOGITS, out_dtype)
        chunked = P.kl_divergence(teacher, P.linear(hidden, kernel), from_logits=True, mask=MASK, chunk_size=4)
        whole = P.kl_divergence(teacher, P.linear(hidden, kernel), from_logits=True, mask=MASK)
        assert keras.backend.standardize_dtype(chunked.dtype) == out_dtype
        np.testing.assert_allclose(
            to_numpy(chunked), to_numpy(whole), rtol=1e-6 if out_dtype == "float32" else HALF_RTOL[dtype]
        )
        logits = rounded @ to_numpy(kernel).astype(np.float64)
        expected = _reduced(
            O.np_kl_divergence(to_numpy(teacher).astype(np.float64), logits, True, reduction="none"), "mean", MASK
        )
        rtol = 1e-5 if out_dtype == "float32" else HALF_RTOL[dtype]
        np.testing.assert_allclose(to_numpy(chunked), expected, rtol=rtol)
        g = input_gradient(
            lambda h: P.kl_divergence(teacher, P.linear(h, kernel), from_logits=True, chunk_size=4), hidden
        )
        assert keras.backend.standardize_dtype(g.dtype) == dtype
        whole_g = input_gradient(lambda h: P.kl_divergence(teacher, P.linear(h, kernel), from_logits=True), hidden)
        np.testing.assert_allclose(to_numpy(g), to_numpy(whole_g), rtol=HALF_RTOL[dtype], atol=1e-6)


def test_nothing_kept_gives_zero_and_finite_gradients():
    nothing = np.zeros((B, T), "float32")
    for reduction in ("mean", "sum"):
        for fn in (
            lambda k: P.kl_divergence(
                _teacher(), _student(kernel=k), from_logits=True, mask=nothing, chunk_size=4, reduction=reduction
            ),
            lambda k: P.cross_entropy(LABELS, _student(kernel=k), mask=nothing, chunk_size=4, reduction=reduction),
        ):
            assert float(to_numpy(fn(KERNEL))) == 0.0
            g = grad(fn, KERNEL)
            assert_finite(g, "gradient")
            assert not g.any()


def test_no_positions_give_zero_with_finite_gradients():
    empty = np.zeros((0, T, H), "float32")
    for chunk_size in (None, 3):
        value = P.js_divergence(_teacher(empty), _student(empty), from_logits=True, chunk_size=chunk_size)
        assert float(to_numpy(value)) == 0.0
        g = grad(lambda h: P.cross_entropy(np.zeros((0, T), "int32"), _student(h), chunk_size=chunk_size), empty)
        assert g.shape == empty.shape
        gk = grad(lambda k: P.entropy(_student(empty, kernel=k), from_logits=True, chunk_size=chunk_size), KERNEL)
        assert_finite(gk, "kernel gradient")


def test_extreme_logits_stay_finite():
    # Hidden states large enough for logits of about ±1e4.
    hidden = STUDENT_HIDDEN * 3e3
    for fn in (
        lambda h: P.kl_divergence(_teacher(), _student(h), from_logits=True, chunk_size=4),
        lambda h: P.js_divergence(_teacher(), _student(h), from_logits=True, chunk_size=4),
        lambda h: P.cross_entropy(LABELS, _student(h), chunk_size=4, label_smoothing=0.1),
    ):
        assert np.isfinite(float(to_numpy(fn(hidden))))
        assert_finite(grad(fn, hidden), "gradient")


# --------------------------------------------------------------- under jit and fit


class HeadLoss(keras.layers.Layer):
    """A causal LM's head as a loss layer: receives the hidden states, adds
    cross-entropy to the labels plus a reverse-KL pull towards fixed teacher
    logits, all through `ops.linear` on its own vocabulary projection, and
    returns the hidden states (a layer that owns its head)."""

    def __init__(self, chunk_size, **kwargs):
        super().__init__(**kwargs)
        self.chunk_size = chunk_size
        self.head = keras.layers.Dense(V, name="head")

    def build(self, input_shape):
        self.head.build(input_shape[0])

    def call(self, inputs):
        hidden, labels, teacher, mask = inputs
        logits = P.linear(hidden, self.head.kernel, self.head.bias)
        chunks = dict(mask=mask, chunk_size=self.chunk_size)
        self.add_loss(
            P.cross_entropy(labels, logits, **chunks)
            + 0.5 * P.kl_divergence(teacher, logits, from_logits=True, direction="reverse", temperature=2.0, **chunks)
        )
        return hidden


def _lm(chunk_size, jit_compile="auto"):
    keras.utils.set_random_seed(7)
    tokens = keras.Input((T,), dtype="int32")
    labels = keras.Input((T,), dtype="int32")
    teacher = keras.Input((T, V))
    mask = keras.Input((T,))
    hidden = keras.layers.Embedding(V, H)(tokens)
    hidden = keras.layers.Dense(H, activation="tanh")(hidden)
    out = HeadLoss(chunk_size)([hidden, labels, teacher, mask])
    model = keras.Model([tokens, labels, teacher, mask], out)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=None, jit_compile=jit_compile)
    return model


def _lm_data(n=10):
    rng = np.random.default_rng(4)
    return [
        rng.integers(0, V, size=(n, T)),
        rng.integers(0, V, size=(n, T)),
        rng.normal(scale=2.0, size=(n, T, V)).astype("float32"),
        (rng.uniform(size=(n, T)) < 0.7).astype("float32"),
    ]


@pytest.mark.parametrize(
    "jit_compile",
    [
        "auto",  # XLA on JAX; a tf.function without XLA on TF; eager torch
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                BACKEND == "torch",
                reason="jit_compile on torch is torch.compile, not XLA; the chunks there are the same eager loop",
            ),
        ),
    ],
)
def test_fit_with_a_fused_head_equals_fit_with_its_logits(jit_compile):
    # Batches of 4, 4 and 2: under TF's trace the row count is known only at
    # run time. The first call of HeadLoss is symbolic (the functional model).
    data = _lm_data()
    results = {}
    for chunk_size in (None, 3):
        model = _lm(chunk_size, jit_compile)
        history = model.fit(data, epochs=2, batch_size=4, shuffle=False, verbose=0)
        results[chunk_size] = (model.get_weights(), history.history["loss"])
    for a, b in zip(results[None][0], results[3][0]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[3][1], results[None][1], rtol=1e-5)
    assert results[None][1][-1] < results[None][1][0]


class EveryTokenOp(keras.layers.Layer):
    """Every token-level op on lazy and on formed logits, whole and chunked,
    summed: built into a functional model, its first call is symbolic."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(H, V), initializer="glorot_uniform")

    def call(self, inputs):
        hidden, labels, mask = inputs
        lazy = P.linear(hidden, self.kernel)
        formed = ops.matmul(hidden, self.kernel)
        teacher = ops.flip(formed, axis=-1)
        total = 0.0
        for logits in (lazy, formed):
            for chunk_size in (None, 3):
                kw = dict(mask=mask, chunk_size=chunk_size)
                total += P.kl_divergence(teacher, logits, from_logits=True, **kw)
                total += P.js_divergence(teacher, logits, from_logits=True, **kw)
                total += P.entropy(logits, from_logits=True, **kw)
                total += P.cross_entropy(labels, logits, **kw)
        return ops.reshape(total, (1,))


def test_every_token_op_builds_symbolically_and_runs():
    hidden, labels, mask = keras.Input((T, H)), keras.Input((T,), dtype="int32"), keras.Input((T,))
    layer = EveryTokenOp()
    out = layer([hidden, labels, mask])
    assert tuple(out.shape) == (1,) and out.dtype == "float32"
    model = keras.Model([hidden, labels, mask], out)
    got = to_numpy(model([STUDENT_HIDDEN, LABELS, MASK]))
    logits = STUDENT_HIDDEN.astype(np.float64) @ to_numpy(layer.kernel).astype(np.float64)
    teacher = logits[..., ::-1]
    expected = 0.0
    for values in (
        O.np_kl_divergence(teacher, logits, True, reduction="none"),
        O.np_js_divergence(teacher, logits, True, reduction="none"),
        O.np_entropy(logits, True, reduction="none"),
        O.np_cross_entropy(LABELS, logits, reduction="none"),
    ):
        expected += 4 * _reduced(values, "mean", MASK)  # lazy and formed, whole and chunked
    np.testing.assert_allclose(got, [expected], rtol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_fit_under_mixed_precision(policy):
    # Half hidden states, a float32 kernel read outside autocast: the chunks
    # form float32 logits as the unchunked call does, and training matches.
    data = _lm_data()
    losses = {}
    for chunk_size in (None, 3):
        model = _lm(chunk_size)
        losses[chunk_size] = model.fit(data, epochs=1, batch_size=4, shuffle=False, verbose=0).history["loss"]
    assert np.isfinite(losses[3]).all()
    np.testing.assert_allclose(losses[3], losses[None], rtol=1e-4)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="only TensorFlow traces with unknown dimensions (tf.function input_signature)"
)
def test_rows_known_only_at_run_time_on_tensorflow():
    import tensorflow as tf

    kernel, bias = tf.constant(KERNEL), tf.constant(BIAS)

    def value_and_grads(hidden, teacher, labels, mask):
        with tf.GradientTape() as tape:
            tape.watch([hidden, kernel, bias])
            student = P.linear(hidden, kernel, bias)
            value = P.js_divergence(
                teacher, student, from_logits=True, beta=0.3, chunk_size=4, mask=mask
            ) + P.cross_entropy(labels, student, mask=mask, chunk_size=4)
        return value, tape.gradient(value, [hidden, kernel, bias])

    signature = [
        tf.TensorSpec([None, None, H]),
        tf.TensorSpec([None, None, V]),
        tf.TensorSpec([None, None], tf.int32),
        tf.TensorSpec([None, None]),
    ]
    teacher = TEACHER_LOGITS.astype("float32")
    for jit_compile in (False, True):  # InplaceUpdate into one buffer; under XLA a TensorArray
        fused = tf.function(value_and_grads, input_signature=signature, jit_compile=jit_compile)
        for rows in (2, 1, 0):
            args = (STUDENT_HIDDEN[:rows], teacher[:rows], LABELS[:rows].astype("int32"), MASK[:rows])
            value, grads = fused(*args)

            def expected(h, k, b):
                student = _materialised(h, k, b)
                return P.js_divergence(args[1], student, from_logits=True, beta=0.3, mask=args[3]) + P.cross_entropy(
                    args[2], student, mask=args[3]
                )

            np.testing.assert_allclose(float(value), float(expected(args[0], kernel, bias)), rtol=1e-5, atol=1e-7)
            for g, wrt in zip(grads, ("h", "k", "b")):
                replace = {"h": args[0], "k": KERNEL, "b": BIAS}
                want = grad(lambda x: expected(*[x if w == wrt else replace[w] for w in ("h", "k", "b")]), replace[wrt])
                np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-7, err_msg=wrt)


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="jax.jit of value_and_grad with a frozen (stop_gradient) teacher; "
    "the other backends' traced paths are covered by fit above",
)
def test_under_jax_jit_with_a_frozen_teacher():
    import jax

    def loss(hidden, kernel, teacher_hidden):
        teacher = P.linear(jax.lax.stop_gradient(teacher_hidden), EMBEDDING, transpose_kernel=True)
        return P.kl_divergence(teacher, P.linear(hidden, kernel, BIAS), from_logits=True, chunk_size=4, mask=MASK)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(STUDENT_HIDDEN, KERNEL, TEACHER_HIDDEN)
    expected = P.kl_divergence(
        TEACHER_LOGITS.astype("float32"), STUDENT_LOGITS.astype("float32"), from_logits=True, mask=MASK
    )
    np.testing.assert_allclose(float(value), float(to_numpy(expected)), rtol=1e-5)
    assert not np.asarray(grads[2]).any()  # the teacher got no gradient
    expected_k = grad(
        lambda k: P.kl_divergence(
            TEACHER_LOGITS.astype("float32"), _materialised(STUDENT_HIDDEN, k, BIAS), from_logits=True, mask=MASK
        ),
        KERNEL,
    )
    np.testing.assert_allclose(np.asarray(grads[1]), expected_k, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["kl_reverse", "cross_entropy_smoothed"])
def test_auto_chunks_from_hidden_states_take_the_head_budget(name, monkeypatch):
    from keras_penalties import backend
    from keras_penalties.ops import _chunks as chunks

    # The measured budgets from hidden states: about 64 rows of 128256 on JAX
    # and torch, 128 on TensorFlow.
    budget = {"jax": 8 * 2**20, "tensorflow": 16 * 2**20, "torch": 8 * 2**20}[BACKEND]
    assert chunks.chunk_rows("auto", 128256, 2039, heads=True) == budget // 128256  # 2039 is prime
    assert chunks.chunk_rows("auto", 128256, 2048, heads=True) == budget // 128256 // 64 * 64  # 64 or 128: no padding
    # 4 rows of 11 classes: a partial last chunk of the 10 positions.
    monkeypatch.setattr(backend, "HEAD_CHUNK_ELEMENTS", 4 * V)
    auto = grads(lambda *x: _loss(name, True, "auto", MASK, *x), *INPUTS.values())
    expected = grads(lambda *x: _loss(name, False, None, MASK, *x), *INPUTS.values())
    for wrt, g, e in zip(INPUTS, auto, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="retain_graph is torch's (JAX's vjp is a function, TF's persistent tape is tested in test_ops_chunks.py): "
    "the first backward pass scales the gradients formed in the loop in place, a later one forms them again",
)
def test_torch_heads_take_several_backward_passes_over_one_forward_pass():
    import torch

    hidden = torch.tensor(STUDENT_HIDDEN, requires_grad=True)
    kernel = torch.tensor(KERNEL, requires_grad=True)
    value = P.cross_entropy(LABELS, P.linear(hidden, kernel, BIAS), mask=MASK, chunk_size=3)
    expected = grads(lambda h, k: P.cross_entropy(LABELS, _materialised(h, k, BIAS), mask=MASK), STUDENT_HIDDEN, KERNEL)
    for scale in (1.0, 1.0, 3.0):
        got = torch.autograd.grad(scale * value, [hidden, kernel], retain_graph=True)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(to_numpy(g), scale * e, rtol=1e-5, atol=1e-6)


def test_linear_of_a_layer_refuses_what_the_layer_says():
    dense = keras.layers.Dense(11)
    dense.build((None, 16))
    hidden = np.ones((2, 16), "float32")
    np.testing.assert_allclose(
        to_numpy(P.linear(hidden, dense).materialise("float32")), to_numpy(dense(hidden)), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match=r"which says its bias, orientation and soft cap: leave `soft_cap`"):
        P.linear(hidden, dense, soft_cap=30.0)
    with pytest.raises(ValueError, match=r"leave `bias`, `transpose_kernel`"):
        P.linear(hidden, dense, np.zeros(11), transpose_kernel=True)
    activated = keras.layers.Dense(11, activation="softmax", name="probs")
    activated.build((None, 16))
    with pytest.raises(ValueError, match=r"`kernel`: probs has an activation"):
        P.linear(hidden, activated)
    with pytest.raises(TypeError, match=r"`kernel` must be a tensor, a keras.layers.Dense or a reversible embedding"):
        P.linear(hidden, keras.layers.LayerNormalization())
