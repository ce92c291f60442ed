"""A masked position may hold anything: every public op that takes a mask
(or labels, whose negative ids mask) gives the same value and the same
gradient of every differentiable input whether its padding holds zeros or
inf, -inf, NaN, -100 or an id past the vocabulary — in every tensor input
(log-probabilities, references, weights, advantages, labels, logits, the
hidden states of padding tokens). Checked eagerly, and in a compiled `fit`,
which must train the garbage-padded batch to the weights of the clean one.

The oracle is the op itself on the clean batch: what is checked is that
padding changes nothing (each op's numbers are checked against NumPy and
its peers in its own test file).
"""

import inspect

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import ops as P
from tests.testing import grads, to_numpy

RNG = np.random.default_rng(65)
B, T, V, H, K = 4, 5, 7, 3, 3
# Kept tokens: one full sequence, one right-padded, one with a hole, one
# kept nowhere (its per-sequence inputs are padding too).
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
CHOSEN_MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
REJECTED_MASK = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
SEQUENCES = MASK.any(axis=1)


def _logprobs(scale=1.0):
    return (-RNG.uniform(0.05, 3.0, size=(B, T)) * scale).astype("float32")


# Each input: its clean values and where it is padding (the positions its
# mask drops; trailing axes broadcast).
INPUTS = {
    "logprobs": (_logprobs(), MASK),
    "ref": (_logprobs(), MASK),
    "old": (_logprobs(), MASK),
    "advantages": (RNG.normal(size=(B, T)).astype("float32"), MASK),
    "sequence_advantages": (RNG.normal(size=(B,)).astype("float32"), SEQUENCES),
    "weights": (RNG.uniform(0.5, 2.0, size=(B, T)).astype("float32"), MASK),
    "sequence_weights": (RNG.uniform(0.5, 2.0, size=(B,)).astype("float32"), SEQUENCES),
    "p": (RNG.normal(scale=2.0, size=(B, T, V)).astype("float32"), MASK),
    "q": (RNG.normal(scale=2.0, size=(B, T, V)).astype("float32"), MASK),
    "probs": (RNG.dirichlet(np.ones(V), size=(B, T)).astype("float32"), MASK),
    "other_probs": (RNG.dirichlet(np.ones(V), size=(B, T)).astype("float32"), MASK),
    "hidden": (RNG.normal(size=(B, T, H)).astype("float32"), MASK),
    "labels": (RNG.integers(0, V, size=(B, T)).astype("int32"), MASK),
    "topk_labels": (RNG.integers(0, V, size=(B, T, K)).astype("int32"), MASK),
    "teacher_topk": (np.log(RNG.dirichlet(np.ones(K + 1), size=(B, T))[..., :K]).astype("float32"), MASK),
    "student_topk": (np.log(RNG.dirichlet(np.ones(K + 1), size=(B, T))[..., :K]).astype("float32"), MASK),
    "values": (RNG.normal(size=(B, T)).astype("float32"), MASK),
    "chosen": (_logprobs(0.3), CHOSEN_MASK),
    "rejected": (_logprobs(0.3), REJECTED_MASK),
    "ref_chosen": (_logprobs(0.3), CHOSEN_MASK),
    "ref_rejected": (_logprobs(0.3), REJECTED_MASK),
}
KERNEL = RNG.normal(scale=0.8, size=(H, V)).astype("float32")
BIAS = RNG.normal(size=(V,)).astype("float32")
# What padding holds: the float inputs' garbage and the labels' (ids past
# the vocabulary, and Hugging Face's -100, which also masks by itself).
GARBAGE = {"inf": (np.inf, V + 3), "-inf": (-np.inf, 10**6), "nan": (np.nan, -100)}


def _padded(name, garbage):
    clean, kept = INPUTS[name]
    kept = kept.reshape(kept.shape + (1,) * (clean.ndim - kept.ndim))
    bad = GARBAGE[garbage][1 if clean.dtype.kind == "i" else 0]
    return np.where(kept, clean, np.asarray(bad, clean.dtype))


def _linear(hidden, kernel):
    return P.linear(hidden, kernel, BIAS)


# name -> (the op on its inputs (tensors by name), the inputs it reads,
# the differentiable ones among them). Masks are given as data: MASK, or
# each preference side's.
M, CM, RM = MASK.astype("float32"), CHOSEN_MASK.astype("float32"), REJECTED_MASK.astype("float32")
CASES = {
    "kl_divergence": (lambda p, q: P.kl_divergence(p, q, from_logits=True, mask=M), ("p", "q"), ("p", "q")),
    "kl_divergence/probs": (
        lambda probs, other_probs: P.kl_divergence(probs, other_probs, direction="symmetric", mask=M),
        ("probs", "other_probs"),
        ("probs", "other_probs"),
    ),
    "js_divergence/probs": (
        lambda probs, other_probs: P.js_divergence(probs, other_probs, temperature=2.0, mask=M),
        ("probs", "other_probs"),
        ("probs", "other_probs"),
    ),
    "kl_divergence/linear": (
        lambda p, hidden, kernel: P.kl_divergence(p, _linear(hidden, kernel), from_logits=True, mask=M, chunk_size=4),
        ("p", "hidden", "kernel"),
        ("hidden", "kernel"),
    ),
    "js_divergence": (lambda p, q: P.js_divergence(p, q, from_logits=True, mask=M), ("p", "q"), ("p", "q")),
    "entropy": (lambda q: P.entropy(q, from_logits=True, mask=M, reduction="sequence_mean"), ("q",), ("q",)),
    "cross_entropy": (lambda labels, q: P.cross_entropy(labels, q, mask=M), ("labels", "q"), ("q",)),
    "cross_entropy/linear": (
        lambda labels, hidden, kernel: P.cross_entropy(labels, _linear(hidden, kernel), mask=M, chunk_size=4),
        ("labels", "hidden", "kernel"),
        ("hidden", "kernel"),
    ),
    "cross_entropy/z_loss_linear": (
        lambda labels, hidden, kernel: P.cross_entropy(
            labels, _linear(hidden, kernel), mask=M, chunk_size=4, z_loss=0.1, temperature=1.5
        ),
        ("labels", "hidden", "kernel"),
        ("hidden", "kernel"),
    ),
    "token_logprobs/logsumexp_top1": (
        lambda labels, hidden, kernel: P.token_logprobs(
            labels, _linear(hidden, kernel), mask=M, chunk_size=4, return_logsumexp=True, return_top1=True
        ),
        ("labels", "hidden", "kernel"),
        ("hidden", "kernel"),
    ),
    "router_load_balancing": (
        lambda p, q: P.router_load_balancing([p, q], top_k=2, mask=M),
        ("p", "q"),
        ("p", "q"),
    ),
    "router_z_loss": (lambda p, q: P.router_z_loss([p, q], mask=M, pool="layer"), ("p", "q"), ("p", "q")),
    "token_logprobs": (
        lambda labels, q: P.token_logprobs(labels, q, mask=M, return_entropy=True),
        ("labels", "q"),
        ("q",),
    ),
    "token_logprobs/linear": (
        lambda labels, hidden, kernel: P.token_logprobs(labels, _linear(hidden, kernel), mask=M, chunk_size=4),
        ("labels", "hidden", "kernel"),
        ("hidden", "kernel"),
    ),
    "token_logprobs/topk_linear": (
        lambda topk_labels, hidden, kernel: P.token_logprobs(
            topk_labels, _linear(hidden, kernel), mask=M, chunk_size=4, return_entropy=True
        ),
        ("topk_labels", "hidden", "kernel"),
        ("hidden", "kernel"),
    ),
    "kl_estimate": (
        lambda logprobs, ref, old: P.kl_estimate(logprobs, ref, estimator="k3+", old_logprobs=old, mask=M),
        ("logprobs", "ref", "old"),
        ("logprobs",),
    ),
    "topk_kl": (
        lambda teacher_topk, student_topk: P.topk_kl(teacher_topk, student_topk, mask=M),
        ("teacher_topk", "student_topk"),
        ("student_topk",),
    ),
    "topk_kl/no_tail": (
        lambda teacher_topk, student_topk: P.topk_kl(teacher_topk, student_topk, tail=False, mask=M),
        ("teacher_topk", "student_topk"),
        ("student_topk",),
    ),
    "importance_weights": (
        lambda logprobs, old: P.importance_weights(logprobs, old, level="geometric", mode="mask", mask=M),
        ("logprobs", "old"),
        (),
    ),
    "off_policy_mask": (
        lambda logprobs, old, advantages: P.off_policy_mask(logprobs, old, advantages, threshold=0.1, mask=M),
        ("logprobs", "old", "advantages"),
        (),
    ),
    "clip_fraction": (
        lambda logprobs, old, sequence_advantages: P.clip_fraction(
            logprobs, old, sequence_advantages, level="sequence", mask=M
        ),
        ("logprobs", "old", "sequence_advantages"),
        (),
    ),
    "discounted_cumsum": (lambda values: P.discounted_cumsum(values, 0.9, mask=M), ("values",), ("values",)),
    "trust_region_mask": (
        lambda logprobs, old, advantages: P.trust_region_mask(
            logprobs, old, advantages, divergence="kl", threshold=0.05, mask=M
        ),
        ("logprobs", "old", "advantages"),
        (),
    ),
    "entropy_mask": (lambda values: P.entropy_mask(values, top=0.4, mask=M), ("values",), ()),
    "unpaired_preference_loss": (
        lambda logprobs, ref, old, sequence_advantages: P.unpaired_preference_loss(
            logprobs, ref, sequence_advantages > 0, kl_logprobs=old, ref_kl_logprobs=ref, mask=M, kl_mask=M
        ),
        ("logprobs", "ref", "old", "sequence_advantages"),
        ("logprobs",),
    ),
    "token_logprobs/log_sum_sq": (
        lambda labels, q: P.token_logprobs(labels, q, mask=M, return_entropy=True, return_log_sum_sq=True),
        ("labels", "q"),
        ("q",),
    ),
    "preference_reward": (
        lambda chosen, rejected, ref_chosen, ref_rejected: P.preference_reward(
            chosen, rejected, ref_chosen, ref_rejected, chosen_mask=CM, rejected_mask=RM
        ),
        ("chosen", "rejected", "ref_chosen", "ref_rejected"),
        (),
    ),
}
for _kind in ("reinforce", "importance_sampling", "ppo", "cispo", "sapo", "gmpo", "vespo"):
    for _level in (
        ("token", "sequence", "sequence_token")
        if _kind in ("importance_sampling", "ppo", "cispo", "sapo")
        else ("token",)
    ):
        for _advantages, _weights in (("advantages", "weights"), ("sequence_advantages", "sequence_weights")):
            if _kind == "gmpo" and _advantages == "advantages":
                continue  # one advantage a sequence
            CASES[f"policy_loss/{_kind}/{_level}/{_advantages}"] = (
                lambda logprobs, old, a, w, kind=_kind, level=_level: P.policy_loss(
                    logprobs,
                    None if kind == "reinforce" else old,
                    a,
                    kind=kind,
                    level=level,
                    weights=w,
                    mask=M,
                    reduction="constant" if kind == "sapo" else "mean",
                ),
                ("logprobs", "old", _advantages, _weights),
                ("logprobs",),
            )
# Each with one of the options that read the sides' tokens: RPO's NLL, WPO's weights, a divergence.
_PREFERENCE_OPTIONS = {
    "sigmoid": {"nll": 0.5},
    "ipo": {"divergence": "forward_kl"},
    "nca_pair": {},
    "simpo": {},
    "orpo": {"nll": 1.0},
    "bco_pair": {},
    "exo_pair": {"label_smoothing": 0.01},
    "discopop": {"divergence": "alpha_divergence"},
    "sigmoid_norm": {
        "chosen_log_sum_sq": np.where(CHOSEN_MASK, -1.5, np.nan).astype("float32"),
        "rejected_log_sum_sq": np.where(REJECTED_MASK, -1.2, np.inf).astype("float32"),
    },
}
for _kind, _options in _PREFERENCE_OPTIONS.items():
    _free = _kind in ("simpo", "orpo")
    CASES[f"preference_loss/{_kind}"] = (
        lambda chosen, rejected, *refs, kind=_kind, options=_options: P.preference_loss(
            chosen, rejected, *refs, kind=kind, chosen_mask=CM, rejected_mask=RM, **options
        ),
        ("chosen", "rejected") + (() if _free else ("ref_chosen", "ref_rejected")),
        ("chosen", "rejected"),
    )


def _inputs(names, garbage=None):
    """The case's inputs as NumPy arrays, padded with `garbage` (or clean)."""
    return [KERNEL if name == "kernel" else (_padded(name, garbage) if garbage else INPUTS[name][0]) for name in names]


def _flat(outputs):
    """An op's outputs (a tensor, a pair, a dict) as a list of float32 arrays."""
    if isinstance(outputs, dict):
        outputs = [outputs[k] for k in sorted(outputs)]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return [to_numpy(ops.cast(o, "float32")) for o in outputs]


def _flat_tensors(outputs):
    """An op's outputs (a tensor, a pair, a dict) as a list of tensors."""
    if isinstance(outputs, dict):
        return [outputs[k] for k in sorted(outputs)]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _scalar(outputs):
    """A differentiable scalar of an op's float outputs (Σ, in float32)."""
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    floats = [o for o in outputs if "float" in keras.backend.standardize_dtype(o.dtype)]
    return sum(ops.sum(ops.cast(o, "float32")) for o in floats)


def _gradients(call, names, differentiable, inputs):
    """The gradient of Σ of the op's float outputs w.r.t. each of its
    `differentiable` inputs, the others held at `inputs`."""
    at = [names.index(n) for n in differentiable]

    def scalar(*xs):
        given = list(inputs)
        for i, x in zip(at, xs):
            given[i] = x
        return _scalar(call(*given))

    return grads(scalar, *[inputs[i] for i in at])


def test_every_public_op_that_takes_a_mask_or_labels_is_checked_here():
    takes = {
        name
        for name in P.__all__
        if callable(getattr(P, name))
        and not inspect.isclass(getattr(P, name))
        and any("mask" in p or p == "labels" for p in inspect.signature(getattr(P, name)).parameters)
    }
    checked = {name.split("/")[0] for name in CASES}
    assert takes <= checked, f"ops with a mask and no padding check here: {sorted(takes - checked)}"


@pytest.mark.parametrize("garbage", sorted(GARBAGE))
@pytest.mark.parametrize("name", sorted(CASES))
def test_padding_changes_neither_value_nor_gradient(name, garbage):
    call, names, differentiable = CASES[name]
    clean, padded = _inputs(names), _inputs(names, garbage)
    for got, expected in zip(_flat(call(*padded)), _flat(call(*clean))):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    if not differentiable:
        return
    got, expected = _gradients(call, names, differentiable, padded), _gradients(call, names, differentiable, clean)
    for n, g, e in zip(differentiable, got, expected):
        assert np.isfinite(g).all(), f"{n}'s gradient is not finite: {g}"
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7, err_msg=n)


# ------------------------------------------------------------------ labels


def test_negative_labels_mask_their_positions_in_every_op_that_takes_labels():
    labels = np.where(MASK, INPUTS["labels"][0], -100)
    topk = np.where(MASK[..., None], INPUTS["topk_labels"][0], -100)
    q, hidden = INPUTS["q"][0], INPUTS["hidden"][0]
    for chunk_size in (None, 4):
        logits = [q, _linear(hidden, KERNEL)] if chunk_size else [q]
        for z in logits:
            for reduction in ("mean", "sum", "none", "sequence_mean"):
                np.testing.assert_allclose(
                    to_numpy(P.cross_entropy(labels, z, reduction=reduction, chunk_size=chunk_size)),
                    to_numpy(
                        P.cross_entropy(INPUTS["labels"][0], z, mask=M, reduction=reduction, chunk_size=chunk_size)
                    ),
                    rtol=1e-6,
                )
            for ids, expected_ids in ((labels, INPUTS["labels"][0]), (topk, INPUTS["topk_labels"][0])):
                got = P.token_logprobs(ids, z, chunk_size=chunk_size, return_entropy=True)
                expected = P.token_logprobs(expected_ids, z, mask=M, chunk_size=chunk_size, return_entropy=True)
                for a, b in zip(_flat(got), _flat(expected)):
                    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_a_kept_label_past_the_vocabulary_is_nan_at_its_position_only(chunk_size):
    labels = INPUTS["labels"][0].copy()
    labels[1, 2] = V  # kept: NaN there
    labels[1, 4] = V + 50  # masked: nothing
    topk = INPUTS["topk_labels"][0].copy()
    topk[0, 3, 1] = 2 * V
    z = _linear(INPUTS["hidden"][0], KERNEL) if chunk_size else INPUTS["q"][0]
    clean = to_numpy(P.token_logprobs(INPUTS["labels"][0], z, mask=M, chunk_size=chunk_size))
    got = to_numpy(P.token_logprobs(labels, z, mask=M, chunk_size=chunk_size))
    assert np.isnan(got[1, 2])
    others = np.ones(got.shape, bool)
    others[1, 2] = False
    np.testing.assert_allclose(got[others], clean[others], rtol=1e-6)
    for reduction in ("mean", "sum"):
        assert np.isnan(to_numpy(P.cross_entropy(labels, z, mask=M, reduction=reduction, chunk_size=chunk_size)))
    got, entropy = P.token_logprobs(topk, z, mask=M, chunk_size=chunk_size, return_entropy=True)
    got, clean = to_numpy(got), to_numpy(P.token_logprobs(INPUTS["topk_labels"][0], z, mask=M, chunk_size=chunk_size))
    assert np.isnan(got[0, 3, 1])
    assert np.isfinite(to_numpy(entropy)).all()  # an entropy reads no label
    others = np.ones(got.shape, bool)
    others[0, 3, 1] = False
    np.testing.assert_allclose(got[others], clean[others], rtol=1e-6)


# ------------------------------------------------------------------ in fit

# One case an op, trained in a compiled `fit`: every op that takes a mask or labels, and the policy and
# preference losses' kinds that read padding most (a sequence ratio, ORPO's odds).
FIT_CASES = sorted(
    {name for name in CASES if "/" not in name}
    | {
        "kl_divergence/linear",
        "cross_entropy/linear",
        "token_logprobs/topk_linear",
        "policy_loss/ppo/sequence/advantages",
        "policy_loss/gmpo/token/sequence_advantages",
        "preference_loss/sigmoid",
        "preference_loss/orpo",
    }
)


class _OpModel(keras.Model):
    """The op as the loss of a model whose weights shift its differentiable
    inputs (a kernel is the model's own), so that `fit` trains through it."""

    def __init__(self, case):
        super().__init__(name="op_model")
        self.call_op, self.names, differentiable = CASES[case]
        # The loss times (1 + scale): an op with no differentiable input trains this weight alone.
        self.scale = self.add_weight(shape=(), initializer="zeros", name="scale")
        self.shifts = {
            name: self.add_weight(shape=INPUTS[name][0].shape[1:], initializer="zeros", name=name)
            for name in differentiable
            if name != "kernel"
        }
        if "kernel" in differentiable:
            self.kernel = self.add_weight(shape=KERNEL.shape, initializer=keras.initializers.Constant(KERNEL))

    def call(self, inputs):
        return inputs

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        inputs = []
        for name in self.names:
            if name == "kernel":
                inputs.append(self.kernel)
            elif name in self.shifts:
                inputs.append(x[name] + self.shifts[name])
            else:
                inputs.append(x[name])
        outputs = _flat_tensors(self.call_op(*inputs))
        # Masks count as 0/1; the 1 keeps the scale's gradient from being 0.
        return (1.0 + sum(ops.sum(ops.cast(o, "float32")) for o in outputs)) * (1.0 + self.scale)


@pytest.fixture
def steps_in_order():
    """On TensorFlow 2.21, grappler's dependency optimizer now and then lets
    a weight's update run before a read of it in the same step when the
    update does not depend on that read (a loss linear in the weight, as
    these ops are in their shifts): the step's logged loss and the scale's
    gradient are then the next step's. Seen in a plain model, without this
    package; the test turns that optimizer off while it runs."""
    if keras.backend.backend() != "tensorflow":
        yield
        return
    import tensorflow as tf

    was = tf.config.optimizer.get_experimental_options().get("dependency_optimization", True)
    tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
    yield
    tf.config.optimizer.set_experimental_options({"dependency_optimization": was})


@pytest.mark.parametrize("name", FIT_CASES)
def test_a_garbage_padded_batch_trains_to_the_weights_of_the_clean_one(name, steps_in_order):
    model = _OpModel(name)
    model.compile(keras.optimizers.SGD(0.1))
    names = [n for n in model.names if n != "kernel"]
    start = model.get_weights()
    trained = {}
    for garbage in (None, "nan", "inf"):  # one compiled step, three batches
        model.set_weights(start)
        data = dict(zip(names, _inputs(names, garbage)))
        history = model.fit(data, epochs=2, batch_size=B, shuffle=False, verbose=0).history
        assert np.isfinite(history["loss"]).all(), (garbage, history)
        trained[garbage] = model.get_weights(), history["loss"]
    for garbage in ("nan", "inf"):
        np.testing.assert_allclose(trained[garbage][1], trained[None][1], rtol=1e-6, err_msg=garbage)
        for got, expected in zip(trained[garbage][0], trained[None][0]):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=garbage)
    assert any(not np.allclose(a, b) for a, b in zip(trained[None][0], start))


# ------------------------------------------------------------------ half precision

HALF_CASES = (
    "cross_entropy/linear",
    "kl_divergence",
    "token_logprobs/topk_linear",
    "topk_kl",
    "policy_loss/ppo/sequence/advantages",
    "preference_loss/orpo",
)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", HALF_CASES)
def test_half_precision_padding_changes_nothing(name, dtype):
    call, names, differentiable = CASES[name]

    def half(arrays):
        return [ops.cast(a, dtype) if a.dtype.kind == "f" else ops.convert_to_tensor(a) for a in arrays]

    clean, padded = half(_inputs(names)), half(_inputs(names, "nan"))
    for got, expected in zip(_flat(call(*padded)), _flat(call(*clean))):
        np.testing.assert_array_equal(got, expected)
    got, expected = _gradients(call, names, differentiable, padded), _gradients(call, names, differentiable, clean)
    for n, g, e in zip(differentiable, got, expected):
        assert np.isfinite(g).all(), n
        np.testing.assert_array_equal(g, e, err_msg=n)
