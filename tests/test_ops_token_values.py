"""Per-position values from hidden states in chunks:
`reduction="none"` and the sequence reductions of the token-level ops on
`ops.linear(...)` logits with `chunk_size`, and `ops.token_logprobs`.

Values against NumPy float64 on the logits formed in float64 (and against
Liger-Kernel's dense reference for `token_logprobs`); gradients of an
arbitrary upstream weighting (what a policy loss puts on each position)
w.r.t. hidden states, kernel and bias against autodiff through the logits
formed with `ops.matmul`, and in float64 against central differences; a
second backward pass on torch; run-time shapes under each backend's
compiler; empty and fully masked inputs.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from keras_penalties.callbacks import PenaltyMonitor
from tests import oracles as O
from tests import rl_oracles as RL
from tests.testing import BACKEND, assert_finite, central_difference, compiled, float64_scope, grads, to_numpy

RNG = np.random.default_rng(44)
B, T, H, V = 2, 5, 6, 11  # 10 positions: chunks of 4 leave a partial last chunk
HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
TEACHER_HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
KERNEL = RNG.normal(size=(H, V)).astype("float32")
EMBEDDING = RNG.normal(size=(V, H)).astype("float32")  # a tied [V, H] embedding
BIAS = RNG.normal(size=(V,)).astype("float32")
LABELS = RNG.integers(0, V, size=(B, T))
MASK = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], "float32")
UPSTREAM = RNG.normal(size=(B, T)).astype("float32")  # each position's weight downstream
LOGITS = O.np_linear(HIDDEN, KERNEL, BIAS)
TEACHER_LOGITS = O.np_linear(TEACHER_HIDDEN, EMBEDDING, transpose_kernel=True)


def _labels(logits):
    return LABELS[: logits.shape[0], : logits.shape[1]]


# name -> (ours(student, teacher, **kw), oracle per-position values(student logits, teacher logits))
FUNCTIONS = {
    "token_logprobs_t": (
        lambda s, t, **kw: P.token_logprobs(_labels(s), s, temperature=0.7, **kw),
        lambda s, t: -O.np_cross_entropy(LABELS, s, temperature=0.7, reduction="none"),
    ),
    "cross_entropy": (
        lambda s, t, **kw: P.cross_entropy(_labels(s), s, reduction="none", **kw),
        lambda s, t: O.np_cross_entropy(LABELS, s, reduction="none"),
    ),
    "entropy": (
        lambda s, t, **kw: P.entropy(s, from_logits=True, reduction="none", **kw),
        lambda s, t: O.np_entropy(s, True, reduction="none"),
    ),
    "kl_reverse": (
        lambda s, t, **kw: P.kl_divergence(t, s, from_logits=True, direction="reverse", reduction="none", **kw),
        lambda s, t: O.np_kl_divergence(t, s, True, direction="reverse", reduction="none"),
    ),
    "js": (
        lambda s, t, **kw: P.js_divergence(t, s, from_logits=True, beta=0.3, reduction="none", **kw),
        lambda s, t: O.np_js_divergence(t, s, True, beta=0.3, reduction="none"),
    ),
}


def _student(hidden=HIDDEN, kernel=KERNEL, bias=BIAS):
    return P.linear(hidden, kernel, bias)


def _teacher(hidden=TEACHER_HIDDEN, embedding=EMBEDDING):
    return P.linear(hidden, embedding, transpose_kernel=True)


@pytest.mark.parametrize("chunk_size", [1, 4, 64, "auto"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_per_position_values_from_hidden_states_in_chunks(name, chunk_size):
    ours, oracle = FUNCTIONS[name]
    expected = np.where(MASK != 0, oracle(LOGITS, TEACHER_LOGITS), 0.0)
    got = to_numpy(ours(_student(), _teacher(), chunk_size=chunk_size, mask=MASK))
    assert got.shape == (B, T)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_token_logprobs_equal_ligers_dense_reference():
    # Liger-Kernel's GRPO test: logits = hidden @ weightᵀ + bias (weight [V, H]),
    # a float32 log-softmax, a gather of the sampled tokens.
    expected = RL.liger_token_logprobs(HIDDEN, KERNEL.T, BIAS, LABELS)
    for chunk_size in (None, 3):
        got = to_numpy(
            P.token_logprobs(LABELS, P.linear(HIDDEN, KERNEL.T, BIAS, transpose_kernel=True), chunk_size=chunk_size)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=str(chunk_size))
    np.testing.assert_allclose(
        to_numpy(P.token_logprobs(LABELS, LOGITS.astype("float32"))),
        RL.trl_selective_log_softmax(LOGITS, LABELS),
        rtol=1e-5,
        atol=1e-6,
    )


def _materialised(hidden, kernel, bias=None, transpose_kernel=False):
    kernel = ops.transpose(kernel) if transpose_kernel else kernel
    logits = ops.matmul(hidden, kernel)
    return logits if bias is None else ops.add(logits, bias)


def _weighted(name, fused, chunk_size, hidden, kernel, bias, teacher_hidden, embedding, upstream=UPSTREAM, mask=MASK):
    """Σ upstream·values: the per-position values under an arbitrary
    weighting, so that each position's gradient is scaled by its own number."""
    if fused:
        student, teacher = P.linear(hidden, kernel, bias), P.linear(teacher_hidden, embedding, transpose_kernel=True)
    else:
        student = _materialised(hidden, kernel, bias)
        teacher = _materialised(teacher_hidden, embedding, transpose_kernel=True)
    values = FUNCTIONS[name][0](student, teacher, chunk_size=chunk_size, mask=mask)
    return ops.sum(values * ops.convert_to_tensor(upstream, values.dtype))


INPUTS = (HIDDEN, KERNEL, BIAS, TEACHER_HIDDEN, EMBEDDING)
WRT = ("hidden", "kernel", "bias", "teacher_hidden", "embedding")


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_per_position_gradients_reach_hidden_kernel_and_bias(name, chunk_size):
    fused = grads(lambda *x: _weighted(name, True, chunk_size, *x), *INPUTS)
    expected = grads(lambda *x: _weighted(name, False, None, *x), *INPUTS)
    for wrt, g, e in zip(WRT, fused, expected):
        assert_finite(g, f"{name} d/d{wrt}")
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)
    # Masked positions carry no gradient to their hidden states.
    assert not fused[0][MASK == 0].any()


@pytest.mark.parametrize("name", ["token_logprobs_t", "js", "kl_reverse"])
def test_per_position_gradients_match_finite_differences(name):
    small = [x[:1, :3] if x.ndim == 3 else x for x in INPUTS]
    small = [x.astype(np.float64) for x in small]
    upstream, mask = np.array([[0.5, -2.0, 1.5]]), np.array([[1.0, 1.0, 0.0]])
    with float64_scope():
        weighted = compiled(lambda *x: _weighted(name, True, 2, *x, upstream=upstream, mask=mask))
        actual = grads(weighted, *small)
        for i, wrt in enumerate(WRT):

            def one(x, i=i):
                return to_numpy(weighted(*small[:i], x, *small[i + 1 :]))

            np.testing.assert_allclose(actual[i], central_difference(one, small[i]), rtol=1e-6, atol=1e-8, err_msg=wrt)


@pytest.mark.parametrize("reduction", ["sequence_mean", "sequence_sum"])
@pytest.mark.parametrize("name", ["cross_entropy", "entropy"])
def test_sequence_reductions_from_hidden_states_in_chunks(name, reduction):
    # verl's seq-mean-token-mean / seq-mean-token-sum over the kept tokens;
    # the second sequence keeps none in `mask`.
    mask = MASK.copy()
    mask[1] = 0.0
    values = FUNCTIONS[name][1](LOGITS, TEACHER_LOGITS)
    # The sequence that keeps no token does not count: verl's on the other alone.
    mode = {"sequence_mean": "seq-mean-token-mean", "sequence_sum": "seq-mean-token-sum"}[reduction]
    expected = RL.verl_agg_loss(values[:1], mask[:1], mode)
    ours = {"cross_entropy": P.cross_entropy, "entropy": P.entropy}[name]
    args = (LABELS, _student()) if name == "cross_entropy" else (_student(),)
    options = {} if name == "cross_entropy" else {"from_logits": True}
    for chunk_size in (None, 4):
        got = ours(*args, reduction=reduction, mask=mask, chunk_size=chunk_size, **options)
        np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, err_msg=str(chunk_size))


def test_all_masked_and_empty_give_zero_with_finite_gradients():
    nothing = np.zeros((B, T), "float32")
    for reduction in ("none", "sequence_mean", "sequence_sum"):

        def fn(k, reduction=reduction):
            values = P.cross_entropy(LABELS, _student(kernel=k), mask=nothing, chunk_size=4, reduction=reduction)
            return ops.sum(values)

        assert float(to_numpy(fn(KERNEL))) == 0.0
        (g,) = grads(fn, KERNEL)
        assert_finite(g, reduction)
        assert not g.any()
    empty = np.zeros((0, T, H), "float32")
    values = P.token_logprobs(np.zeros((0, T), "int32"), _student(empty), chunk_size=3)
    assert to_numpy(values).shape == (0, T)
    (g,) = grads(lambda h: ops.sum(P.token_logprobs(np.zeros((0, T), "int32"), _student(h), chunk_size=3)), empty)
    assert g.shape == empty.shape


def test_compiled_with_rows_known_only_at_run_time():
    expected = grads(lambda *x: _weighted("token_logprobs_t", False, None, *x), *INPUTS)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        specs = [tf.TensorSpec((None, None, H)), tf.TensorSpec((H, V)), tf.TensorSpec((V,))]
        specs += [tf.TensorSpec((None, None, H)), tf.TensorSpec((V, H))]

        @tf.function(input_signature=specs, jit_compile=True)
        def fused(*x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                total = _weighted("token_logprobs_t", True, 4, *x)
            return tape.gradient(total, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)

        got = [to_numpy(g) for g in fused(*INPUTS)]
    else:
        got = grads(compiled(lambda *x: _weighted("token_logprobs_t", True, 4, *x)), *INPUTS)
    for wrt, g, e in zip(WRT, got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="retain_graph is torch's: JAX's vjp is a function and TF's tape is tested in tests/test_ops_chunks.py; "
    "per-position values keep their inputs and form each chunk again in every backward pass",
)
def test_torch_takes_several_backward_passes_over_one_forward_pass():
    import torch

    hidden = torch.tensor(HIDDEN, requires_grad=True)
    values = P.token_logprobs(LABELS, P.linear(hidden, KERNEL, BIAS), chunk_size=4, mask=MASK)
    total = (values * torch.tensor(UPSTREAM)).sum()
    first = torch.autograd.grad(total, hidden, retain_graph=True)[0]
    second = torch.autograd.grad(3.0 * total, hidden)[0]
    fresh = grads(
        lambda h: ops.sum(
            P.token_logprobs(LABELS, _materialised(h, KERNEL, BIAS), mask=MASK) * ops.convert_to_tensor(UPSTREAM)
        ),
        HIDDEN,
    )[0]
    np.testing.assert_allclose(to_numpy(first), fresh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(second), 3.0 * fresh, rtol=1e-5, atol=1e-6)


class _TokenLogprobs(keras.layers.Layer):
    """The sampled tokens' log-probabilities from hidden states through the
    model's head, in chunks (`chunk_size`) or from formed logits (None)."""

    def __init__(self, head, chunk_size, **kwargs):
        super().__init__(**kwargs)
        self.head, self.chunk_size = head, chunk_size

    def call(self, hidden, labels, mask):
        return P.token_logprobs(labels, P.linear(hidden, self.head.kernel), mask=mask, chunk_size=self.chunk_size)


def _grpo_model(chunk_size):
    """A GRPO step in fit: the policy loss over sequences, β·k3 to a
    reference over tokens and an entropy bonus from the hidden states, as
    terms of an objective; the model's loss is the objective's alone."""
    keras.utils.set_random_seed(11)
    tokens, labels = keras.Input((T,), dtype="int32"), keras.Input((T,), dtype="int32")
    mask, advantages, reference = keras.Input((T,)), keras.Input(()), keras.Input((T,))
    hidden = keras.layers.Dense(H, activation="tanh")(keras.layers.Embedding(V, H)(tokens))
    head = keras.layers.Dense(V, use_bias=False)
    head.build((None, H))
    logprobs = _TokenLogprobs(head, chunk_size)(hidden, labels, mask)

    def bonus(hidden, mask):  # −H: minimising it raises the entropy
        return -P.entropy(P.linear(hidden, head.kernel), from_logits=True, mask=mask, chunk_size=chunk_size)

    objective = CompositeObjective(
        {
            "pg": Term(
                "policy_loss",
                inputs=("logprobs", "old", "advantages"),
                options={"mask": "mask", "reduction": "sequence_mean"},
            ),
            "kl": Term("kl_estimate", 0.1, inputs=("logprobs", "reference"), options={"mask": "mask"}),
            "bonus": Term(bonus, 0.01, inputs=("hidden", "mask")),
        },
        name="grpo",
    )
    old = keras.ops.stop_gradient(logprobs)
    inputs = {"logprobs": logprobs, "old": old, "advantages": advantages, "reference": reference}
    out = objective({**inputs, "hidden": hidden, "mask": mask})["logprobs"]
    model = keras.Model([tokens, labels, mask, advantages, reference], out)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=None)
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"], indirect=True)
def test_a_grpo_step_in_fit_from_hidden_states(policy):
    # Batches of 4, 4 and 2 (rows known only at run time under TF's trace):
    # chunked as formed whole, each term logged.
    rng = np.random.default_rng(5)
    n = 10
    data = [
        rng.integers(0, V, size=(n, T)),
        rng.integers(0, V, size=(n, T)),
        (rng.uniform(size=(n, T)) < 0.7).astype("float32"),
        rng.normal(size=(n,)).astype("float32"),
        -rng.uniform(1.0, 4.0, size=(n, T)).astype("float32"),
    ]
    histories = {}
    for chunk_size in (None, 3):
        model = _grpo_model(chunk_size)
        monitor = PenaltyMonitor(probe_data=[d[:4] for d in data], every_n_batches=1)
        histories[chunk_size] = model.fit(
            data, epochs=2, batch_size=4, shuffle=False, verbose=0, callbacks=[monitor]
        ).history
    tolerance = 1e-4 if policy == "float32" else 2e-2
    for key in ("loss", "grpo/pg", "grpo/kl", "grpo/bonus", "grpo/kl/grad_norm"):
        assert np.isfinite(histories[3][key]).all(), key
        np.testing.assert_allclose(histories[3][key], histories[None][key], rtol=tolerance, err_msg=key)


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="XLA's memory_analysis of the compiled program is JAX's; the bench rows measure the peak on every backend",
)
def test_no_tokens_by_vocabulary_array_forward_or_backward():
    import jax

    tokens, hidden, vocab, chunk = 1024, 32, 8192, 64
    rng = np.random.default_rng(0)
    h = rng.normal(size=(tokens, hidden)).astype("float32")
    k = rng.normal(size=(hidden, vocab)).astype("float32")
    labels, weights = rng.integers(0, vocab, size=tokens), rng.normal(size=tokens).astype("float32")

    def weighted(h, k, chunk_size):
        return ops.sum(P.token_logprobs(labels, P.linear(h, k), chunk_size=chunk_size) * weights)

    def temporaries(chunk_size):
        step = jax.jit(jax.value_and_grad(lambda h, k: weighted(h, k, chunk_size), argnums=(0, 1)))
        return step.lower(h, k).compile().memory_analysis().temp_size_in_bytes

    whole = tokens * vocab * 4  # one [tokens, vocab] float32 array: 32 MB
    assert temporaries(None) >= whole  # the check can fail: formed logits are such an array
    assert temporaries(chunk) < whole / 4


def test_two_calls_that_differentiate_different_inputs():
    # One call differentiates the hidden states (its kernel a constant), the
    # other the kernel (its hidden states a constant), in one compiled
    # gradient: each backward pass takes its own call's inputs.
    def total(hidden, kernel, fused):
        def logits(h, k):
            return P.linear(h, k) if fused else ops.matmul(h, k)

        chunk = 4 if fused else None
        first = P.token_logprobs(LABELS, logits(hidden, KERNEL), chunk_size=chunk, mask=MASK)
        second = P.token_logprobs(LABELS, logits(TEACHER_HIDDEN, kernel), chunk_size=chunk)
        return ops.sum(first * ops.convert_to_tensor(UPSTREAM)) + ops.sum(second)

    got = grads(compiled(lambda h, k: total(h, k, True)), HIDDEN, KERNEL)
    expected = grads(lambda h, k: total(h, k, False), HIDDEN, KERNEL)
    for wrt, g, e in zip(("hidden", "kernel"), got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=wrt)
