"""What samples from a sampler or a teacher need: several ids a position and
the entropy from `token_logprobs` (one pass over the logits, fused from
hidden states), the top-k KL with its tail bin, discounted returns, and
soft-capped heads (`ops.linear(..., soft_cap=c)`, Gemma 2's).

Oracles: NumPy float64 transcriptions of TRL's and verl's code
(tests/off_policy_oracles.py and tests/rl_oracles.py, citing repository,
path and commit); closed forms (the top-k KL's gradient, the returns'
linear map); the same op on the formed logits. And every option error of the off-policy ops,
before any tensor work.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import CompositeObjective, Term
from keras_penalties import ops as P
from keras_penalties.callbacks import PenaltyMonitor
from tests import off_policy_oracles as OP
from tests import oracles as O
from tests import rl_oracles as RL
from tests.testing import BACKEND, assert_finite, assert_raises_as_listed, compiled, grad, grads, to_numpy

RNG = np.random.default_rng(131)
B, T, H, V, K = 3, 5, 4, 11, 3
HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
KERNEL = RNG.normal(scale=1.2, size=(H, V)).astype("float32")
BIAS = RNG.normal(size=(V,)).astype("float32")
LABELS = RNG.integers(0, V, size=(B, T))
IDS = np.stack([RNG.choice(V, size=K, replace=False) for _ in range(B * T)]).reshape(B, T, K)
MASK = RNG.uniform(size=(B, T)) < 0.75
MASK[:, 0] = True
UPSTREAM = RNG.normal(size=(B, T, K + 1)).astype("float32")


def f32(x):
    return np.asarray(x, "float32")


def _logits(hidden, kernel, fused, soft_cap=None):
    bias = ops.convert_to_tensor(BIAS)
    if fused:
        return P.linear(hidden, kernel, bias, soft_cap=soft_cap)
    logits = ops.matmul(hidden, kernel) + bias
    return logits if soft_cap is None else soft_cap * ops.tanh(logits / soft_cap)


# ------------------------------------------------------------------ several ids, entropy


def test_logprobs_and_entropy_equal_trls():
    logits = RNG.normal(scale=2.0, size=(B, T + 1, V))
    inputs = np.concatenate([RNG.integers(0, V, size=(B, 1)), LABELS], axis=1)
    expected_logps, expected_entropy = OP.trl_logps_and_entropies(logits, inputs, T, temperature=0.7)
    logps, entropy = P.token_logprobs(LABELS, f32(logits[:, :-1]), temperature=0.7, return_entropy=True)
    np.testing.assert_allclose(to_numpy(logps), expected_logps, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(entropy), expected_entropy, rtol=1e-5, atol=1e-6)
    g = grad(lambda x: P.token_logprobs(LABELS, x, temperature=0.7, return_entropy=True)[1], f32(logits[:, :-1]))
    np.testing.assert_allclose(g, OP.trl_entropy_grad(logits, T, temperature=0.7)[:, :-1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 2, "auto"])
@pytest.mark.parametrize("fused", [True, False])
def test_several_ids_and_the_entropy_in_one_pass(fused, chunk_size):
    logits = O.np_linear(HIDDEN, KERNEL, BIAS) / 1.5
    logp = special.log_softmax(logits, axis=-1)
    expected = np.concatenate(
        [RL.trl_selective_log_softmax(logits, IDS), -(np.exp(logp) * logp).sum(-1)[..., None]], -1
    )
    expected = expected * MASK[..., None]

    def both(hidden, kernel):
        logprobs, entropy = P.token_logprobs(
            IDS, _logits(hidden, kernel, fused), temperature=1.5, mask=MASK, chunk_size=chunk_size, return_entropy=True
        )
        return ops.concatenate([logprobs, entropy[..., None]], axis=-1)

    np.testing.assert_allclose(to_numpy(both(HIDDEN, KERNEL)), expected, rtol=1e-5, atol=1e-6)

    def weighted(hidden, kernel):
        return ops.sum(both(hidden, kernel) * ops.convert_to_tensor(UPSTREAM))

    def formed(hidden, kernel):
        logp = ops.log_softmax(_logits(hidden, kernel, False) / 1.5, axis=-1)
        columns = [ops.take_along_axis(logp, ops.convert_to_tensor(IDS), axis=-1)]
        columns.append(-ops.sum(ops.exp(logp) * logp, axis=-1, keepdims=True))
        values = ops.concatenate(columns, axis=-1) * ops.cast(MASK[..., None], "float32")
        return ops.sum(values * ops.convert_to_tensor(UPSTREAM))

    for got, want in zip(grads(compiled(weighted), HIDDEN, KERNEL), grads(formed, HIDDEN, KERNEL)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_samplers_set_replayed_and_one_id_a_position():
    # A top-p set's renormalised log-probability: the label's minus the logsumexp over the set.
    logprobs = to_numpy(P.token_logprobs(IDS, P.linear(HIDDEN, KERNEL, BIAS), chunk_size=4))
    renormalised = logprobs - special.logsumexp(logprobs, axis=-1, keepdims=True)
    logits = O.np_linear(HIDDEN, KERNEL, BIAS)
    within = np.take_along_axis(logits, IDS, axis=-1)
    np.testing.assert_allclose(renormalised, special.log_softmax(within, axis=-1), rtol=1e-5, atol=1e-6)
    # One id a position with the entropy: the labels' shape, as without it.
    logps, entropy = P.token_logprobs(LABELS, P.linear(HIDDEN, KERNEL, BIAS), chunk_size=4, return_entropy=True)
    assert tuple(logps.shape) == tuple(entropy.shape) == (B, T)
    np.testing.assert_allclose(to_numpy(logps), RL.trl_selective_log_softmax(logits, LABELS), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ top-k KL


def _topk(temperature=1.0):
    """Both models' log-probabilities of the teacher's top-K ids, and the
    logits they came from."""
    student, teacher = (RNG.normal(scale=2.0, size=(B, T, V)) for _ in range(2))
    ids = np.argsort(-teacher, axis=-1, kind="stable")[..., :K]
    take = [np.take_along_axis(special.log_softmax(x / temperature, axis=-1), ids, -1) for x in (teacher, student)]
    return (*take, student, teacher)


def test_topk_kl_with_the_tail_equals_trls_and_verls_form():
    t, s, student, teacher = _topk()
    labels = np.where(MASK, 0, -100)
    per_position, loss = OP.trl_iwopd_topk_forward_kl(student, teacher, labels, K, add_tail=True)
    np.testing.assert_allclose(to_numpy(P.topk_kl(f32(t), f32(s), reduction="none")), per_position, rtol=1e-5)
    np.testing.assert_allclose(float(P.topk_kl(f32(t), f32(s), mask=MASK)), loss, rtol=1e-5)
    # Without the tail, the K ids as they are (verl's forward_kl_topk before its clamps, which no value here meets).
    expected = (np.exp(t) * (t - s)).sum(-1)
    np.testing.assert_allclose(to_numpy(P.topk_kl(f32(t), f32(s), tail=False, reduction="none")), expected, rtol=1e-5)


def test_topk_kl_without_the_tail_from_the_students_logits_equals_verls():
    # verl's forward_kl_topk at its clamps' off settings (no tail, no renormalisation; its clamp_min(0) meets
    # no value here), through token_logprobs' K ids: the value and the gradient reaching the student's logits.
    _, _, student, teacher = _topk()
    teacher_logprobs = special.log_softmax(teacher, axis=-1)
    ids = np.argsort(-teacher_logprobs, axis=-1)[..., :K]
    t = np.take_along_axis(teacher_logprobs, ids, -1)
    expected = OP.verl_forward_kl_topk(student, t, ids, log_prob_min_clamp=None, loss_max_clamp=None)
    raw = (np.exp(t) * (t - np.take_along_axis(special.log_softmax(student, axis=-1), ids, -1))).sum(-1)
    assert (raw > 0).all()  # clamp_min(0) acts on none

    def loss(z, reduction="sum"):
        return P.topk_kl(f32(t), P.token_logprobs(ids, z), tail=False, reduction=reduction)

    np.testing.assert_allclose(to_numpy(loss(f32(student), "none")), expected, rtol=1e-5)
    expected_grad = OP.verl_forward_kl_topk_grad(student, t, ids, log_prob_min_clamp=None, loss_max_clamp=None)
    np.testing.assert_allclose(grad(loss, f32(student)), expected_grad, rtol=1e-4, atol=1e-6)


def test_topk_kl_is_finite_where_a_teacher_id_has_probability_zero():
    # 0·log 0 = 0: an id the teacher gives no mass adds nothing, with or without the tail.
    t = f32([[np.log(0.25), -np.inf, np.log(0.75)]])
    s = np.log(f32([[0.2, 0.3, 0.4]]))
    # The tail: p_rest = 0 (to rounding), so 0·log(0 / q_rest) adds nothing either.
    expected = 0.25 * math.log(0.25 / 0.2) + 0.75 * math.log(0.75 / 0.4)
    for tail in (True, False):
        np.testing.assert_allclose(float(P.topk_kl(t, s, tail=tail)), expected, rtol=1e-5)
        g = grads(lambda a, b, tail=tail: P.topk_kl(a, b, tail=tail), t, s)[1]
        assert_finite(g, "student gradient")
        # ∂/∂s_k = −p_k (+ p_rest·q_k / q_rest with the tail, p_rest ≈ 0).
        np.testing.assert_allclose(g, [[-0.25, 0.0, -0.75]], rtol=1e-5, atol=1e-6)


def test_topk_kl_gradient_reaches_the_student_only():
    t, s, _, _ = _topk()
    p, q = np.exp(t), np.exp(s)
    p_rest, q_rest = 1 - p.sum(-1, keepdims=True), 1 - q.sum(-1, keepdims=True)
    # ∂/∂s_k of Σ p(t − s) + p_rest(log p_rest − log q_rest): −p_k + p_rest·q_k / q_rest.
    expected = (-p + p_rest * q / q_rest) / (B * T)
    teacher_grad, student_grad = grads(lambda a, b: P.topk_kl(a, b), f32(t), f32(s))
    np.testing.assert_allclose(student_grad, expected, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(teacher_grad, 0.0)


def test_topk_kl_is_a_term_by_name_with_its_mask_an_input():
    t, s, _, _ = _topk()
    objective = CompositeObjective(
        {"topk": Term("topk_kl", 0.5, inputs=("teacher", "student"), options={"mask": "mask"})}
    )
    inputs = {"teacher": f32(t), "student": f32(s), "mask": MASK.astype("float32")}
    total, values = objective.compute(inputs)
    expected = float(P.topk_kl(f32(t), f32(s), mask=MASK))
    np.testing.assert_allclose(float(to_numpy(values["topk"])), expected, rtol=1e-6)
    np.testing.assert_allclose(float(to_numpy(total)), 0.5 * expected, rtol=1e-6)


def test_topk_kl_is_finite_where_the_ids_hold_all_the_mass():
    # Two classes, both ids: p_rest = 0 exactly, the tail adds nothing; and a student whose ids hold it all.
    t = np.log(f32([[0.25, 0.75]]))
    s = np.log(f32([[0.5, 0.5]]))
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    np.testing.assert_allclose(float(P.topk_kl(t, s)), expected, rtol=1e-5)
    partial = np.log(f32([[0.25, 0.25]]))
    value, g = float(P.topk_kl(partial, s)), grads(lambda a, b: P.topk_kl(a, b), partial, s)[1]
    assert math.isfinite(value) and value > 0
    assert_finite(g, "student gradient")


# ------------------------------------------------------------------ discounted returns


def test_discounted_cumsum_equals_verls_returns_and_its_closed_form():
    rewards = RNG.normal(size=(B, T)).astype("float32")
    tail = np.ones((B, T), "float32")
    tail[0, 3:] = 0.0  # padding at the end: verl carries nothing through it
    np.testing.assert_allclose(
        to_numpy(P.discounted_cumsum(rewards, 0.9, mask=tail)),
        OP.verl_discounted_returns(rewards, tail, 0.9),
        rtol=1e-5,
        atol=1e-6,
    )
    # A position masked inside still counts in the discount's exponent (verl skips it).
    inside = MASK.astype("float32")
    powers = np.triu(0.9 ** (np.arange(T)[None, :] - np.arange(T)[:, None]))  # [t, s] = γ^(s−t), s ≥ t
    expected = (rewards * inside) @ powers.T * inside
    np.testing.assert_allclose(to_numpy(P.discounted_cumsum(rewards, 0.9, mask=inside)), expected, rtol=1e-5)
    # Linear in x: the gradient of Σ w·y is the transpose applied to w, masked.
    w = RNG.normal(size=(B, T)).astype("float32")
    g = grad(lambda x: P.discounted_cumsum(x, 0.9, mask=inside) * ops.convert_to_tensor(w), rewards)
    np.testing.assert_allclose(g, (w * inside) @ powers * inside, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(P.discounted_cumsum(rewards, 0.0)), rewards, rtol=1e-6)
    np.testing.assert_allclose(
        to_numpy(compiled(lambda x: P.discounted_cumsum(x, 1.0))(rewards)),
        np.cumsum(rewards[:, ::-1], 1)[:, ::-1],
        rtol=1e-5,
    )


# ------------------------------------------------------------------ soft-capped heads


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_soft_capped_logits_equal_the_capped_formed_logits(chunk_size):
    cap = 2.0  # the logits reach ±5 uncapped: the cap bends them

    def ops_of(logits, teacher):
        return [
            P.cross_entropy(LABELS, logits, mask=MASK, chunk_size=chunk_size),
            P.kl_divergence(teacher, logits, from_logits=True, mask=MASK, chunk_size=chunk_size),
            P.entropy(logits, from_logits=True, chunk_size=chunk_size),
            ops.sum(P.token_logprobs(LABELS, logits, mask=MASK, chunk_size=chunk_size)),
        ]

    def total(hidden, kernel, fused):
        teacher = _logits(ops.convert_to_tensor(HIDDEN), ops.convert_to_tensor(KERNEL) * 0.5, fused, soft_cap=3.0)
        return ops.stack(ops_of(_logits(hidden, kernel, fused, soft_cap=cap), teacher))

    capped = cap * np.tanh(O.np_linear(HIDDEN, KERNEL, BIAS) / cap)
    assert np.abs(O.np_linear(HIDDEN, KERNEL, BIAS)).max() > 2 * cap
    np.testing.assert_allclose(
        float(total(HIDDEN, KERNEL, True)[0]), O.np_cross_entropy(LABELS[MASK], capped[MASK]), rtol=1e-5
    )
    np.testing.assert_allclose(to_numpy(total(HIDDEN, KERNEL, True)), to_numpy(total(HIDDEN, KERNEL, False)), rtol=1e-5)
    weights = ops.convert_to_tensor(f32([1.0, 0.5, -0.3, 0.1]))
    got = grads(lambda h, k: ops.sum(total(h, k, True) * weights), HIDDEN, KERNEL)
    want = grads(lambda h, k: ops.sum(total(h, k, False) * weights), HIDDEN, KERNEL)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_a_soft_cap_is_exact_in_float64_from_zero_to_saturated_logits(chunk_size):
    # Logits at 1e-4 (where torch's chunk loops' 2σ(2z/c) − 1 cancels), near c, and at ±40c (σ saturates).
    cap = 30.0
    scales = np.array([1e-4, 1e-4, 1.0, 25.0, 25.0, 1200.0], "float32")[:, None]
    hidden = RNG.normal(size=(6, H)).astype("float32")
    kernel = (RNG.normal(size=(H, V)) / np.abs(hidden @ RNG.normal(size=(H, V))).max()).astype("float32")
    hidden = hidden * scales
    ids = RNG.integers(0, V, size=(6,))
    g = RNG.normal(size=(6, 2))

    def weighted(h):
        lp, ent = P.token_logprobs(ids, P.linear(h, kernel, soft_cap=cap), chunk_size=chunk_size, return_entropy=True)
        upstream = ops.convert_to_tensor(f32(g))
        return ops.sum(lp * upstream[:, 0]) + ops.sum(ent * upstream[:, 1])

    z = hidden.astype("float64") @ kernel.astype("float64")
    t = np.tanh(z / cap)
    logp = special.log_softmax(cap * t, axis=-1)
    p = np.exp(logp)
    entropy = -(p * logp).sum(-1)
    expected = (np.take_along_axis(logp, ids[:, None], -1)[:, 0] * g[:, 0]).sum() + (entropy * g[:, 1]).sum()
    # d/dz of g₀·log p(id) + g₁·H, through the cap's (1 − tanh²).
    dcapped = g[:, :1] * (np.eye(V)[ids] - p) - g[:, 1:] * p * (logp + entropy[:, None])
    expected_grad = (dcapped * (1.0 - t**2)) @ kernel.astype("float64").T
    np.testing.assert_allclose(float(compiled(weighted)(ops.convert_to_tensor(hidden))), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad(compiled(weighted), hidden), expected_grad, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ errors


class Untouchable:
    """Fails if converted: option errors come before any tensor work."""

    def __array__(self, *args, **kwargs):
        raise AssertionError("the input was touched before the options were checked")


U = Untouchable()
X = np.zeros((2, 3), "float32")

ERRORS = {
    "level": (lambda: P.importance_weights(U, U, level="batch"), ValueError, r"`level` must be one of 'token'"),
    "mode": (lambda: P.importance_weights(U, U, mode="drop"), ValueError, r"`mode` must be one of 'truncate', 'mask'"),
    "bounds_order": (lambda: P.importance_weights(U, U, bounds=(2.0, 1.0)), ValueError, r"`bounds` must be \(low"),
    "bounds_negative": (lambda: P.importance_weights(U, U, bounds=(-1.0, None)), ValueError, r"`bounds`"),
    "bounds_pair": (lambda: P.importance_weights(U, U, bounds=2.0), ValueError, r"`bounds` must be a pair"),
    "bounds_high_zero": (lambda: P.importance_weights(U, U, bounds=(None, 0.0)), ValueError, r"`bounds`"),
    "reinforce_level": (
        lambda: P.policy_loss(U, None, U, kind="reinforce", level="sequence"),
        ValueError,
        r"kind='reinforce' has none",
    ),
    "old_logprobs_needed": (lambda: P.policy_loss(U, None, U), ValueError, r"`old_logprobs` is needed"),
    "threshold": (lambda: P.off_policy_mask(U, U, U, threshold=-0.1), ValueError, r"`threshold` must be >= 0"),
    "policy_level": (lambda: P.policy_loss(U, U, U, level="seq"), ValueError, r"`level` must be one of 'token'"),
    "clip_fraction_clip": (lambda: P.clip_fraction(U, U, U, clip=(1.5, 0.2)), ValueError, r"`clip` must be"),
    "clip_fraction_level": (lambda: P.clip_fraction(U, U, U, level="x"), ValueError, r"`level`"),
    "gamma": (lambda: P.discounted_cumsum(U, 1.5), ValueError, r"`gamma` must be in \[0, 1\]"),
    "tail": (lambda: P.topk_kl(U, U, tail="yes"), TypeError, r"`tail` must be a bool"),
    "topk_reduction": (lambda: P.topk_kl(U, U, reduction="batch"), ValueError, r"`reduction`"),
    "soft_cap": (lambda: P.linear(U, U, soft_cap=0.0), ValueError, r"`soft_cap` must be > 0"),
    "return_entropy": (lambda: P.token_logprobs(U, U, return_entropy=1), TypeError, r"`return_entropy` must be a bool"),
    # Shapes, after conversion but before any computation.
    "sampler_shape": (lambda: P.importance_weights(X, X[:, :2]), ValueError, r"`logprobs` and `sampler_logprobs`"),
    "sequence_rank": (lambda: P.importance_weights(X[0], X[0], level="sequence"), ValueError, r"`level='sequence'`"),
    "gspo_rank": (lambda: P.policy_loss(X[0], X[0], X[0], level="sequence"), ValueError, r"\[batch, tokens\]"),
    "weights_shape": (lambda: P.policy_loss(X, X, X, weights=np.ones(3)), ValueError, r"`weights` must be"),
    "old_logprobs_shape": (lambda: P.kl_estimate(X, X, old_logprobs=X[:1]), ValueError, r"`old_logprobs`"),
    "topk_shapes": (lambda: P.topk_kl(X, X[:, :2]), ValueError, r"`teacher_logprobs` and `student_logprobs`"),
    "topk_mask": (lambda: P.topk_kl(X, X, mask=np.ones(3)), ValueError, r"`mask`"),
    "advantages": (lambda: P.off_policy_mask(X, X, np.ones(3), threshold=0.1), ValueError, r"`advantages`"),
    "mask_shape": (lambda: P.importance_weights(X, X, mask=np.ones(2)), ValueError, r"`mask`"),
    "several_labels": (
        lambda: P.token_logprobs(np.zeros((2, 3, 2), "int32"), np.zeros((2, 4)), return_entropy=True),
        ValueError,
        r"`labels` must have the logits' shape without the class axis, \(2,\), or that plus K ids a position",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_names_the_argument(name):
    assert_raises_as_listed(ERRORS[name])


# ------------------------------------------------------------------ frozen heads


@pytest.mark.parametrize("chunk_size", [2, "auto"])
def test_a_frozen_head_gives_the_formed_logits_values_and_hidden_gradient(chunk_size):
    # No kernel or bias gradient (a LoRA fine-tune): each row's gradient of its own value is formed with it.
    kernel, bias = ops.convert_to_tensor(KERNEL), ops.convert_to_tensor(BIAS)
    upstream = ops.convert_to_tensor(UPSTREAM[..., 0])

    def fused(hidden):
        logits = P.linear(hidden, kernel, bias, soft_cap=3.0)
        return ops.sum(P.token_logprobs(LABELS, logits, mask=MASK, chunk_size=chunk_size) * upstream)

    def formed(hidden):
        logits = 3.0 * ops.tanh((ops.matmul(hidden, kernel) + bias) / 3.0)
        return ops.sum(P.token_logprobs(LABELS, logits, mask=MASK) * upstream)

    np.testing.assert_allclose(float(compiled(fused)(HIDDEN)), float(formed(ops.convert_to_tensor(HIDDEN))), rtol=1e-5)
    np.testing.assert_allclose(grad(compiled(fused), HIDDEN), grad(formed, HIDDEN), rtol=1e-4, atol=1e-6)


def _lora_like(chunk_size):
    """A model whose head is frozen, trained on −Σ log p(label) from its
    hidden states, the monitor probing each batch (a second backward pass)."""
    keras.utils.set_random_seed(7)
    tokens, labels = keras.Input((T,), dtype="int32"), keras.Input((T,), dtype="int32")
    states = keras.layers.Dense(H, activation="tanh")(keras.layers.Embedding(V, H)(tokens))
    head = keras.layers.Dense(V, trainable=False)
    head.build((None, H))

    def nll(hidden, labels):
        logits = P.linear(hidden, head.kernel, head.bias)
        return -ops.mean(P.token_logprobs(labels, logits, chunk_size=chunk_size))

    out = CompositeObjective({"nll": Term(nll, inputs=("hidden", "labels"))}, name="lm")(
        {"hidden": states, "labels": labels}
    )["hidden"]
    model = keras.Model([tokens, labels], out)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=None)
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"], indirect=True)
def test_a_frozen_head_trains_in_fit_as_the_formed_logits(policy):
    data = [RNG.integers(0, V, size=(8, T)), RNG.integers(0, V, size=(8, T))]
    histories = {}
    for chunk_size in (None, 3):
        model = _lora_like(chunk_size)
        monitor = PenaltyMonitor(probe_data=([d[:4] for d in data], None), every_n_batches=1)
        histories[chunk_size] = model.fit(
            data, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[monitor]
        ).history
    tolerance = 1e-5 if policy == "float32" else 2e-2
    for key in ("loss", "lm/nll", "lm/nll/grad_norm"):
        np.testing.assert_allclose(histories[3][key], histories[None][key], rtol=tolerance, err_msg=key)
    assert histories[3]["loss"][-1] < histories[3]["loss"][0]


@pytest.mark.skipif(
    BACKEND != "jax", reason="counts the products in XLA's compiled program; the bench times every backend"
)
def test_a_frozen_head_costs_the_products_of_the_formed_logits():
    import jax

    hidden, kernel = (ops.convert_to_tensor(x) for x in (HIDDEN, KERNEL))

    def products(fn, argnums):
        program = jax.jit(jax.value_and_grad(fn, argnums=argnums)).lower(hidden, kernel).compile().as_text()
        return program.count(" dot(")

    def fused(h, k):
        return ops.sum(P.token_logprobs(LABELS, P.linear(h, k), chunk_size=4))

    def formed(h, k):
        return ops.sum(P.token_logprobs(LABELS, ops.matmul(h, k)))

    # Frozen: the logits and the hidden gradient, a product each, as formed; a trained kernel adds the
    # backward pass's logits (the per-token log-probabilities row's known cost).
    assert products(fused, 0) == products(formed, 0) == 2
    assert products(fused, (0, 1)) == products(formed, (0, 1)) + 1
