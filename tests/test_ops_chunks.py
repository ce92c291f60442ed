"""`chunk_size=` on kl_divergence, js_divergence and entropy: values
against the NumPy oracles, and value, gradient and training equal to the
unchunked call — with masks, temperature, every direction, another axis,
probabilities, half precision, empty inputs and row counts known only at run
time."""

import numpy as np
import pytest
from keras import ops
from scipy import special

import keras
from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from tests import oracles as O
from tests.testing import BACKEND, assert_finite, grad, to_numpy

RNG = np.random.default_rng(11)
SHAPE = (3, 4, 7)  # 12 rows of a 7-class vocabulary
P_LOGITS = RNG.normal(scale=3.0, size=SHAPE).astype("float32")
Q_LOGITS = RNG.normal(scale=3.0, size=SHAPE).astype("float32")
MASK = (RNG.uniform(size=SHAPE[:2]) < 0.6).astype("float32")
MASK[0, 0], MASK[0, 1] = 1.0, 0.0
# One row per chunk, a size that leaves a partial last chunk, all rows in one
# chunk, and a chunk larger than the input.
CHUNKS = (1, 5, 12, 64)

# name -> (ours(p, q, **kw), oracle per-sample values(p, q))
FUNCTIONS = {
    "kl_forward": (
        lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, **kw),
        lambda p, q: O.np_kl_divergence(p, q, True, reduction="none"),
    ),
    "kl_reverse_t": (
        lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, direction="reverse", temperature=0.5, **kw),
        lambda p, q: O.np_kl_divergence(p, q, True, direction="reverse", temperature=0.5, reduction="none"),
    ),
    "kl_symmetric": (
        lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, direction="symmetric", **kw),
        lambda p, q: O.np_kl_divergence(p, q, True, direction="symmetric", reduction="none"),
    ),
    "js": (
        lambda p, q, **kw: P.js_divergence(p, q, from_logits=True, **kw),
        lambda p, q: O.np_js_divergence(p, q, True, reduction="none"),
    ),
    "js_beta_t": (
        lambda p, q, **kw: P.js_divergence(p, q, from_logits=True, beta=0.1, temperature=2.0, **kw),
        lambda p, q: O.np_js_divergence(p, q, True, reduction="none", beta=0.1, temperature=2.0),
    ),
    "entropy": (
        lambda p, q, **kw: P.entropy(q, from_logits=True, **kw),
        lambda p, q: O.np_entropy(q, True, reduction="none"),
    ),
    "entropy_normalized": (
        lambda p, q, **kw: P.entropy(q, from_logits=True, normalize=True, **kw),
        lambda p, q: O.np_entropy(q, True, normalize=True, reduction="none"),
    ),
}


def _expected(values, reduction, mask=None):
    kept = np.ones(values.shape, bool) if mask is None else mask != 0
    return {
        "mean": values[kept].sum() / max(kept.sum(), 1),
        "sum": values[kept].sum(),
        "none": np.where(kept, values, 0.0),
    }[reduction]


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_chunked_value_matches_oracle(name, chunk_size):
    ours, oracle = FUNCTIONS[name]
    values = oracle(P_LOGITS, Q_LOGITS)
    # "sum" is "mean" without the division, tested with masks elsewhere; each
    # eager JAX call compiles its map, so the grid is kept small.
    for reduction in ("mean", "none"):
        for mask in (None, MASK):
            got = to_numpy(ours(P_LOGITS, Q_LOGITS, chunk_size=chunk_size, mask=mask, reduction=reduction))
            np.testing.assert_allclose(got, _expected(values, reduction, mask), rtol=1e-5, atol=1e-6)


# A partial last chunk, and one padded chunk (fewer sizes than for values:
# each eager JAX call compiles its map).
@pytest.mark.parametrize("chunk_size", (5, 64))
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_chunked_gradients_equal_unchunked(name, chunk_size):
    ours, _ = FUNCTIONS[name]
    p, q = ops.convert_to_tensor(P_LOGITS), ops.convert_to_tensor(Q_LOGITS)
    for mask in (None, MASK):
        for wrt in ("p", "q"):

            def loss(x, chunk_size):
                return (
                    ours(x, q, chunk_size=chunk_size, mask=mask)
                    if wrt == "p"
                    else ours(p, x, chunk_size=chunk_size, mask=mask)
                )

            x = P_LOGITS if wrt == "p" else Q_LOGITS
            chunked = grad(lambda t: loss(t, chunk_size), x)
            assert_finite(chunked, name)
            np.testing.assert_allclose(chunked, grad(lambda t: loss(t, None), x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fn", ["kl", "js", "entropy"])
def test_chunks_of_probabilities_along_another_axis(fn):
    # Distribution along axis 1 of probabilities with exact zeros, at T != 1.
    probs = np.array(to_numpy(ops.softmax(ops.convert_to_tensor(P_LOGITS), axis=-1)))
    probs[0, 0, :3] = 0.0
    probs /= probs.sum(-1, keepdims=True)
    other = to_numpy(ops.softmax(ops.convert_to_tensor(Q_LOGITS), axis=-1))
    p, q = np.moveaxis(probs, -1, 1), np.moveaxis(other, -1, 1)
    for chunk_size in CHUNKS:
        if fn == "kl":
            # Forward: the zeros are in p, so KL(p‖q) is finite.
            got = P.kl_divergence(p, q, axis=1, temperature=0.7, chunk_size=chunk_size, reduction="none")
            expected = O.np_kl_divergence(p, q, axis=1, temperature=0.7, reduction="none")
        elif fn == "js":
            got = P.js_divergence(p, q, axis=1, temperature=0.7, beta=0.3, chunk_size=chunk_size, reduction="none")
            expected = O.np_js_divergence(p, q, axis=1, temperature=0.7, beta=0.3, reduction="none")
        else:
            got = P.entropy(p, axis=1, temperature=0.7, chunk_size=chunk_size, reduction="none")
            expected = O.np_entropy(p, axis=1, temperature=0.7, reduction="none")
        np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chunked_half_precision_equals_unchunked(dtype):
    # Each chunk is cast to float32 inside the map; the result is the dtype of
    # the inputs, as unchunked.
    p, q = ops.cast(P_LOGITS, dtype), ops.cast(Q_LOGITS, dtype)
    for fn in (P.kl_divergence, P.js_divergence):
        chunked = fn(p, q, from_logits=True, chunk_size=5, mask=MASK)
        assert keras.backend.standardize_dtype(chunked.dtype) == dtype
        np.testing.assert_array_equal(
            to_numpy(ops.cast(chunked, "float32")), to_numpy(ops.cast(fn(p, q, from_logits=True, mask=MASK), "float32"))
        )


def test_no_rows_give_zero_with_a_finite_gradient():
    empty = np.zeros((0, 4, 7), "float32")
    for reduction in ("mean", "sum"):
        assert (
            float(to_numpy(P.kl_divergence(empty, empty, from_logits=True, chunk_size=3, reduction=reduction))) == 0.0
        )
        assert float(to_numpy(P.entropy(empty, from_logits=True, chunk_size=3, reduction=reduction))) == 0.0
    assert to_numpy(P.js_divergence(empty, empty, from_logits=True, chunk_size=3, reduction="none")).shape == (0, 4)
    g = grad(lambda x: P.js_divergence(x, x * 2.0, from_logits=True, chunk_size=3), empty)
    assert g.shape == empty.shape


def _distill_model(chunk_size, jit_compile="auto"):
    """Student logits trained towards fixed teacher logits by a chunked,
    masked KL plus an entropy bonus: rows per batch vary (a partial last
    batch), so the row count is known only at run time under TF's trace."""
    keras.utils.set_random_seed(5)
    vocab = SHAPE[-1]
    tokens, teacher, mask = keras.Input((4, vocab)), keras.Input((4, vocab)), keras.Input((4,))
    student = keras.layers.Dense(vocab)(tokens)
    options = {"from_logits": True, "chunk_size": chunk_size}
    objective = CompositeObjective(
        {
            "kl": Term(
                "kl_divergence", inputs=("teacher", "student"), options=dict(options, temperature=2.0, mask="mask")
            ),
            "entropy": Term("entropy", 0.1, inputs=("student",), options=options),
        },
        name="distill",
    )
    out = objective({"teacher": teacher, "student": student, "mask": mask})
    model = keras.Model([tokens, teacher, mask], out)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=None, jit_compile=jit_compile)
    return model


@pytest.mark.parametrize(
    "jit_compile",
    [
        "auto",  # XLA on JAX; a tf.function without XLA on TF (Keras' default on CPU); eager torch
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                BACKEND == "torch",
                reason="jit_compile on torch is torch.compile, not XLA; the chunks there are the same eager loop",
            ),
        ),
    ],
)
def test_fit_with_chunks_equals_fit_without(jit_compile):
    n = 10  # batches of 4, 4 and 2
    tokens = RNG.normal(size=(n,) + SHAPE[1:]).astype("float32")
    teacher = RNG.normal(scale=2.0, size=(n,) + SHAPE[1:]).astype("float32")
    mask = (RNG.uniform(size=(n, 4)) < 0.7).astype("float32")
    weights = {}
    for chunk_size in (None, 3):
        model = _distill_model(chunk_size, jit_compile)
        history = model.fit([tokens, teacher, mask], epochs=2, batch_size=4, shuffle=False, verbose=0)
        weights[chunk_size] = (model.get_weights(), history.history["loss"])
    for a, b in zip(weights[None][0], weights[3][0]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights[3][1], weights[None][1], rtol=1e-5)
    assert weights[None][1][-1] < weights[None][1][0]


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_monitor_probe_takes_each_chunked_terms_gradient_norm(chunk_size):
    # The probe takes one backward pass per term (and the total) over one
    # forward pass: each chunked term's gradient is taken twice (its own,
    # and the total's). On torch the rows' gradients formed in the forward
    # pass were used up by the first (issue 41).
    from keras_penalties.callbacks import PenaltyMonitor

    tokens = RNG.normal(size=(6,) + SHAPE[1:]).astype("float32")
    teacher = RNG.normal(scale=2.0, size=(6,) + SHAPE[1:]).astype("float32")
    mask = (RNG.uniform(size=(6, 4)) < 0.7).astype("float32")
    mask[0, 0] = 1.0
    entries = {}
    for size in (None, chunk_size):
        model = _distill_model(size)
        monitor = PenaltyMonitor(probe_data=([tokens, teacher, mask], None))
        monitor.set_model(model)
        entries[size] = monitor.probe()
    for key in ("distill/kl", "distill/entropy", "total"):
        np.testing.assert_allclose(
            entries[chunk_size][f"{key}/grad_norm"], entries[None][f"{key}/grad_norm"], rtol=1e-5, err_msg=key
        )
    # The KL term's against NumPy: masked mean over positions of
    # KL(softmax(t/T) ‖ softmax(z/T)), z = tokens·W + b; ∂/∂z = (q − p)/(T·kept).
    kernel, bias = (to_numpy(w).astype(np.float64) for w in model.trainable_weights)
    x = tokens.astype(np.float64)
    z = x @ kernel + bias
    p, q = special.softmax(teacher / 2.0, axis=-1), special.softmax(z / 2.0, axis=-1)
    dz = (q - p) / 2.0 * mask[..., None] / mask.sum()
    norm = np.sqrt(np.sum(np.einsum("npi,npj->ij", x, dz) ** 2) + np.sum(dz.sum((0, 1)) ** 2))
    np.testing.assert_allclose(entries[chunk_size]["distill/kl/grad_norm"], norm, rtol=1e-5)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="only TensorFlow traces with unknown dimensions (tf.function input_signature)"
)
def test_rows_known_only_at_run_time_on_tensorflow():
    import tensorflow as tf

    spec = tf.TensorSpec([None, None, SHAPE[-1]], tf.float32)

    def value_and_grads(p, q, mask):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([p, q])
            value = P.js_divergence(p, q, from_logits=True, beta=0.3, chunk_size=5, mask=mask)
        # The rows' gradients are kept for every recorded input; a persistent
        # tape uses them twice: for one input, then for both.
        return value, tape.gradient(value, q), tape.gradient(value, [p, q])

    signature = [spec, spec, tf.TensorSpec([None, None], tf.float32)]
    for jit_compile in (False, True):  # InplaceUpdate into one buffer; under XLA a TensorArray
        chunked = tf.function(value_and_grads, input_signature=signature, jit_compile=jit_compile)
        for rows in (3, 1, 0):
            p, q, mask = P_LOGITS[:rows], Q_LOGITS[:rows], MASK[:rows]
            value, g, (gp, gq) = chunked(p, q, mask)
            np.testing.assert_allclose(
                float(value), float(P.js_divergence(p, q, from_logits=True, beta=0.3, mask=mask)), rtol=1e-5, atol=1e-7
            )
            expected_p = grad(lambda t: P.js_divergence(t, q, from_logits=True, beta=0.3, mask=mask), p)
            expected_q = grad(lambda t: P.js_divergence(p, t, from_logits=True, beta=0.3, mask=mask), q)
            np.testing.assert_allclose(g.numpy(), expected_q, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(gq.numpy(), expected_q, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(gp.numpy(), expected_p, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(
    BACKEND != "jax", reason="jax.jit of value_and_grad; the other backends' traced paths are covered by fit above"
)
def test_under_jax_jit():
    import jax

    def loss(p, q):
        return P.kl_divergence(p, q, from_logits=True, direction="reverse", chunk_size=5, mask=MASK)

    value, (gp, gq) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(P_LOGITS, Q_LOGITS)
    np.testing.assert_allclose(
        float(value),
        float(P.kl_divergence(P_LOGITS, Q_LOGITS, from_logits=True, direction="reverse", mask=MASK)),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        gq,
        grad(lambda t: P.kl_divergence(P_LOGITS, t, from_logits=True, direction="reverse", mask=MASK), Q_LOGITS),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize("name", ["kl_reverse_t", "js", "entropy"])
def test_auto_chunks_take_the_backends_element_budget_over_the_classes(name, monkeypatch):
    from keras_penalties import backend
    from keras_penalties.ops import _chunks as chunks

    # The measured budgets: 16 M elements on JAX, 1 M on TF, 4 M on torch.
    expected = {"jax": 16 * 2**20, "tensorflow": 2**20, "torch": 4 * 2**20}[BACKEND]
    rows = expected // 32000  # 524 on JAX, 32 on TF, 131 on torch
    assert chunks.chunk_rows("auto", 32000, 8191 * 3) == rows  # no divisor of 8191·3 in [rows/2, rows]
    # 8192 rows: the largest power of two within the budget, so no padded copy.
    assert chunks.chunk_rows("auto", 32000, 8192) == {"jax": 512, "tensorflow": 32}.get(BACKEND, 128)
    assert chunks.chunk_rows("auto", 128256, 4096) == {"jax": 128, "tensorflow": 8}.get(BACKEND, 32)
    assert chunks.chunk_rows("auto", 10**9, 8) == 1 and chunks.chunk_rows("auto", 7, 12) == 12
    assert chunks.chunk_rows(64, 7, 12) == 64
    # 5 rows of 7 classes: a partial last chunk of the 12 rows; the values
    # and gradients are those of the oracle and of the unchunked call.
    monkeypatch.setattr(backend, "CHUNK_ELEMENTS", 35)
    ours, oracle = FUNCTIONS[name]
    got = to_numpy(ours(P_LOGITS, Q_LOGITS, chunk_size="auto", mask=MASK))
    np.testing.assert_allclose(got, _expected(oracle(P_LOGITS, Q_LOGITS), "mean", MASK), rtol=1e-5, atol=1e-6)
    p = ops.convert_to_tensor(P_LOGITS)
    auto = grad(lambda q: ours(p, q, chunk_size="auto", mask=MASK), Q_LOGITS)
    whole = grad(lambda q: ours(p, q, mask=MASK), Q_LOGITS)
    np.testing.assert_allclose(auto, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="retain_graph is torch's (JAX's vjp is a function, TF's persistent tape is tested above): "
    "the first backward pass scales the rows formed in the forward pass in place, a later one recomputes them",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_chunks_take_several_backward_passes_over_one_forward_pass(dtype):
    import torch

    p = torch.tensor(P_LOGITS).to(getattr(torch, dtype))
    q = torch.tensor(Q_LOGITS).to(getattr(torch, dtype)).requires_grad_(True)
    value = P.kl_divergence(p, q, from_logits=True, chunk_size=5, mask=MASK)
    expected = grad(lambda x: P.kl_divergence(to_numpy(p), x, from_logits=True, mask=MASK), to_numpy(q))
    passes = [torch.autograd.grad(scale * value, q, retain_graph=True)[0] for scale in (1.0, 1.0, 3.0)]
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == "float32" else {"rtol": 2e-2, "atol": 1e-3}
    for scale, g in zip((1.0, 1.0, 3.0), passes):
        assert g.dtype == q.dtype
        np.testing.assert_allclose(to_numpy(g), scale * expected, **tolerance)
