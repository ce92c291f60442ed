"""Every public entry called as a user first calls it: required arguments
only, in the place it plugs into — a regularizer as `kernel_regularizer=` or
`activity_regularizer=`, a loss in `compile`, a composite with penalty names
only, a callback in `fit`, an optimizer wrapper around `"adam"`, the
`Distiller` unfused and fused with only its heads named, every op on NumPy
arrays and on `ops.linear(...)` logits without `chunk_size` — each with a
`fit`, an `evaluate`, finite logs, and the value against NumPy where it is
cheap. A default that no test exercised (the fused Distiller's
`chunk_size=None`) crashed once; `test_every_public_entry_is_called_here`
makes a new public name join this file.
"""

import inspect

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

import keras_penalties
from keras_penalties import CompositeObjective, Term, callbacks, gradients, losses, optimizers, regularizers
from keras_penalties import ops as P
from keras_penalties import terms as legacy_terms
from keras_penalties.composite import weighting as rules
from keras_penalties.distillation import Distiller, LogitsDivergence
from tests import oracles as O
from tests import rl_oracles, router_oracles
from tests.testing import grads, to_numpy

RNG = np.random.default_rng(56)
N, D, U, K = 16, 6, 4, 3
X = RNG.normal(size=(N, D)).astype("float32")
Y = RNG.normal(size=(N, K)).astype("float32")
# Probability rows for the divergence losses' targets.
Y_PROBS = special.softmax(RNG.normal(size=(N, K)), axis=-1).astype("float32")

COVERED = set()  # the public names this file calls, filled by `_covers`


def _covers(*names):
    COVERED.update(names)
    return names


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


ACTIVATIONS = {
    None: lambda x: x,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "softmax": lambda x: special.softmax(x, axis=-1),
}


def _model(layer_activation=None, output_activation=None, **layer_options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((D,))
    hidden = keras.layers.Dense(U, activation=layer_activation, name="layer", **layer_options)(inputs)
    outputs = keras.layers.Dense(K, activation=output_activation, name="out")(hidden)
    return keras.Model(inputs, outputs)


def _weights(model, name):
    return [w.astype(np.float64) for w in model.get_layer(name).get_weights()]


def _numpy_forward(model, layer_activation=None, output_activation=None):
    """The hidden activations and outputs of `_model`, in float64 NumPy."""
    kernel, bias = _weights(model, "layer")
    hidden = ACTIVATIONS[layer_activation](X.astype(np.float64) @ kernel + bias)
    out_kernel, out_bias = _weights(model, "out")
    return hidden, ACTIVATIONS[output_activation](hidden @ out_kernel + out_bias)


def _fit_and_evaluate(model, x=X, y=Y, epochs=1, callbacks=None, batch_size=8, **fit_options):
    """One epoch (or `epochs`) of `fit`, then `evaluate` in one batch: both
    logs finite; History and the evaluation's logs returned."""
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=callbacks, **fit_options
    ).history
    for key, values in history.items():
        assert np.isfinite(values).all(), (key, values)
    logs = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    for key, value in logs.items():
        assert np.isfinite(value), (key, value)
    return history, logs


# ------------------------------------------------------------------ regularizers

# What each regularizer returns on a tensor, from its formula (factor f).
REGULARIZER_ORACLES = {
    "L1": lambda f, x: f * O.np_l1(x),
    "L2": lambda f, x: f * O.np_l2(x),
    "ElasticNet": lambda f, x: f * O.np_elastic_net(x),
    "Orthogonality": lambda f, x: f * O.np_orthogonality(x),
    "Entropy": lambda f, x: f * O.np_entropy(x, reduction="sum"),
    "KLSparsity": lambda f, x: f * O.np_kl_sparsity(x) * len(x),
    "OutputMagnitude": lambda f, x: f * O.np_output_magnitude(x, reduction="sum"),
    # Batch statistics of router logits, times the batch (Keras divides by it).
    "RouterLoadBalancing": lambda f, x: f * router_oracles.keras_hub_load_balancing_loss(x, U, 2) * len(x),
    "RouterZLoss": lambda f, x: f * router_oracles.st_moe_z_loss(x) * len(x),
}
# The regularizers' required arguments beside the factor.
REGULARIZER_REQUIRED = {"RouterLoadBalancing": {"top_k": 2}}
# (regularizer, where, the layer's activation: the input the penalty expects).
REGULARIZER_PLACES = [
    ("L1", "kernel", None),
    ("L2", "kernel", None),
    ("ElasticNet", "kernel", None),
    ("Orthogonality", "kernel", None),
    ("L1", "activity", "tanh"),
    ("L2", "activity", "tanh"),
    ("ElasticNet", "activity", "tanh"),
    ("Entropy", "activity", "softmax"),
    ("KLSparsity", "activity", "sigmoid"),
    ("OutputMagnitude", "activity", "tanh"),
    ("RouterLoadBalancing", "activity", None),
    ("RouterZLoss", "activity", None),
]
_covers(*(f"regularizers.{name}" for name in REGULARIZER_ORACLES))


@pytest.mark.parametrize("name, where, activation", REGULARIZER_PLACES)
def test_regularizer_with_its_factor_only(name, where, activation):
    factor = 0.01
    regularizer = getattr(regularizers, name)(factor, **REGULARIZER_REQUIRED.get(name, {}))
    model = _model(activation, **{f"{where}_regularizer": regularizer})
    model.compile("adam", "mse")
    _, logs = _fit_and_evaluate(model)
    hidden, outputs = _numpy_forward(model, activation)
    if where == "kernel":
        penalty = REGULARIZER_ORACLES[name](factor, _weights(model, "layer")[0])
    else:  # Keras divides an activity regularizer by the batch size.
        penalty = REGULARIZER_ORACLES[name](factor, hidden) / len(hidden)
    np.testing.assert_allclose(logs["loss"], np.mean((outputs - Y) ** 2) + penalty, rtol=2e-5)


# ------------------------------------------------------------------ losses

LOSS_ORACLES = {
    "KLDivergence": lambda y, p: O.np_kl_divergence(y, p),
    "JSDivergence": lambda y, p: O.np_js_divergence(y, p),
    "Entropy": lambda y, p: O.np_entropy(p),
    "Consistency": lambda y, p: O.np_consistency(y, p),
}
_covers(*(f"losses.{name}" for name in LOSS_ORACLES))


@pytest.mark.parametrize("name", sorted(LOSS_ORACLES))
def test_loss_with_no_arguments_in_compile(name):
    model = _model("tanh", "softmax")
    model.compile("adam", getattr(losses, name)())
    _, logs = _fit_and_evaluate(model, y=Y_PROBS)
    _, probs = _numpy_forward(model, "tanh", "softmax")
    np.testing.assert_allclose(logs["loss"], LOSS_ORACLES[name](Y_PROBS.astype(np.float64), probs), rtol=2e-5)


# ------------------------------------------------------------------ composites

# By name, and as the rule objects at their defaults (a fresh one a model).
WEIGHTINGS = [None, "fixed", "uncertainty", "famo", "Weighting()", "Fixed()", "Uncertainty()", "FAMO()", "get('famo')"]


def _weighting_options(weighting):
    if weighting is None:
        return {}
    if weighting == "get('famo')":
        return {"weighting": rules.get("famo")}
    if weighting.endswith("()"):
        return {"weighting": getattr(rules, weighting[:-2])()}
    return {"weighting": weighting}


_covers(
    "composite.weighting.Weighting",
    "composite.weighting.Fixed",
    "composite.weighting.Uncertainty",
    "composite.weighting.FAMO",
    "composite.weighting.get",
)
# Penalty names a CompositeLoss applies to (y_true, y_pred) and a
# CompositeObjective to one activation, each with its default options.
LOSS_TERMS = {
    "kl_divergence": lambda y, p: O.np_kl_divergence(y, p),
    "js_divergence": lambda y, p: O.np_js_divergence(y, p),
    "consistency": lambda y, p: O.np_consistency(y, p),
}
OBJECTIVE_TERMS = {  # on tanh activations; l1, l2, elastic_net per-sample sums averaged
    "l1": lambda h: O.np_l1(h, "sum_over_batch_size"),
    "l2": lambda h: O.np_l2(h, "sum_over_batch_size"),
    "elastic_net": lambda h: O.np_elastic_net(h, reduction="sum_over_batch_size"),
    "output_magnitude": lambda h: O.np_output_magnitude(h),
    "orthogonality": lambda h: O.np_orthogonality(h),
}
_covers("losses.CompositeLoss", "CompositeObjective", "Term")


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_composite_loss_with_penalty_names_only(weighting):
    model = _model("tanh", "softmax")
    loss = losses.CompositeLoss({name: name for name in LOSS_TERMS}, **_weighting_options(weighting))
    model.compile("adam", loss)
    _, logs = _fit_and_evaluate(model, y=Y_PROBS)
    _, probs = _numpy_forward(model, "tanh", "softmax")
    expected = {name: oracle(Y_PROBS.astype(np.float64), probs) for name, oracle in LOSS_TERMS.items()}
    # Each term's value as a custom loop reads it.
    _, values = loss.compute(Y_PROBS, probs.astype("float32"))
    for name in LOSS_TERMS:
        np.testing.assert_allclose(to_numpy(values[name]), expected[name], rtol=2e-5, atol=1e-7, err_msg=name)
    if weighting in (None, "fixed", "Weighting()", "Fixed()"):
        np.testing.assert_allclose(logs["loss"], sum(expected.values()), rtol=2e-5)


def _objective_model(**options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((D,))
    hidden = keras.layers.Dense(U, activation="tanh", name="layer")(inputs)
    hidden = CompositeObjective({name: name for name in OBJECTIVE_TERMS}, name="objective", **options)(hidden)
    return keras.Model(inputs, keras.layers.Dense(K, name="out")(hidden))


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_composite_objective_with_penalty_names_only(weighting):
    model = _objective_model(**_weighting_options(weighting))
    model.compile("adam", "mse")
    _, logs = _fit_and_evaluate(model)
    hidden, outputs = _numpy_forward(model, "tanh")
    expected = {name: oracle(hidden) for name, oracle in OBJECTIVE_TERMS.items()}
    values = model.get_layer("objective").running_values(training=False)
    for name in OBJECTIVE_TERMS:
        np.testing.assert_allclose(values[name], expected[name], rtol=2e-5, atol=1e-7, err_msg=name)
    if weighting in (None, "fixed", "Weighting()", "Fixed()"):
        np.testing.assert_allclose(logs["loss"], np.mean((outputs - Y) ** 2) + sum(expected.values()), rtol=2e-5)


def test_a_term_with_its_penalty_only():
    term = Term("l2")
    objective = CompositeObjective({"l2": term})
    total, values = objective.compute(X)
    np.testing.assert_allclose(to_numpy(values["l2"]), O.np_l2(X.astype(np.float64), "sum_over_batch_size"), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(total), to_numpy(values["l2"]), rtol=1e-6)


# ------------------------------------------------------------------ callbacks

_covers(
    "callbacks.PenaltyMonitor",
    "callbacks.DynamicWeightAverage",
    "callbacks.GradNorm",
    "callbacks.gradnorm_gradient",
    "callbacks.clip_and_renormalise",
)


@pytest.mark.parametrize("probe", [False, True], ids=["no_probe_data", "probe_data"])
def test_penalty_monitor_with_and_without_probe_data(probe):
    model = _objective_model()
    model.compile("adam", "mse")
    monitor = callbacks.PenaltyMonitor(probe_data=(X, Y)) if probe else callbacks.PenaltyMonitor()
    # One batch: the probe after it sees the weights the evaluation reads.
    history, _ = _fit_and_evaluate(model, callbacks=[monitor], batch_size=N)
    hidden, _ = _numpy_forward(model, "tanh")
    assert {f"objective/{name}" for name in OBJECTIVE_TERMS} <= set(history)
    if probe:
        (entry,) = monitor.history
        np.testing.assert_allclose(entry["objective/l2"], OBJECTIVE_TERMS["l2"](hidden), rtol=2e-5)
        norms = [entry[f"objective/{name}/grad_norm"] for name in OBJECTIVE_TERMS] + [entry["total/grad_norm"]]
        assert np.isfinite(norms).all() and min(norms) > 0, entry
    else:
        assert monitor.history == []


def test_dynamic_weight_average_with_its_target_only():
    model = _objective_model()
    model.compile("adam", "mse")
    history, _ = _fit_and_evaluate(model, epochs=3, callbacks=[callbacks.DynamicWeightAverage("objective")])
    weights = np.array([history[f"objective/{name}/weight"] for name in OBJECTIVE_TERMS])  # [terms, epochs]
    np.testing.assert_allclose(weights[:, :2], 1.0)
    np.testing.assert_allclose(weights[:, 2].sum(), len(OBJECTIVE_TERMS), rtol=1e-5)


def test_grad_norm_with_its_target_layer_and_probe_data_only():
    model = _objective_model()
    model.compile("adam", "mse")
    gradnorm = callbacks.GradNorm("objective", "layer", probe_data=(X, Y))
    history, _ = _fit_and_evaluate(model, callbacks=[gradnorm])
    weights = np.array([history[f"objective/{name}/weight"][-1] for name in OBJECTIVE_TERMS])
    np.testing.assert_allclose(weights.sum(), len(OBJECTIVE_TERMS), rtol=1e-5)
    assert len(gradnorm.history) == N // 8


def test_the_gradnorm_functions_with_their_arguments():
    # G = (1, 3), Ḡ = 2, ratios equal: sign(G − Ḡ)·g.
    np.testing.assert_allclose(
        to_numpy(callbacks.gradnorm_gradient([1.0, 1.0], [2.0, 2.0], [1.0, 3.0], [1.0, 1.0], 1.5)), [-1.0, 3.0]
    )
    np.testing.assert_allclose(to_numpy(callbacks.clip_and_renormalise([3.0, -1.0, 1.0])), [2.25, 0.0, 0.75])


# ------------------------------------------------------------------ optimizers

OPTIMIZERS = {
    "ProximalDecay": lambda: optimizers.ProximalDecay("adam", regularizers.L1(0.01)),
    "GradientNoise": lambda: optimizers.GradientNoise("adam"),
    "AdaptiveGradientClipping": lambda: optimizers.AdaptiveGradientClipping("adam"),
    "GradientCentralization": lambda: optimizers.GradientCentralization("adam"),
}
_covers(*(f"optimizers.{name}" for name in OPTIMIZERS))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_wrapper_around_adam(name):
    model = _model("tanh")
    before = [w.copy() for w in model.get_weights()]
    model.compile(OPTIMIZERS[name](), "mse")
    _, logs = _fit_and_evaluate(model)
    assert all(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))
    _, outputs = _numpy_forward(model, "tanh")
    np.testing.assert_allclose(logs["loss"], np.mean((outputs - Y) ** 2), rtol=2e-5)


# ------------------------------------------------------------------ distillation

V, T, H = 11, 5, 6
TOKENS = RNG.integers(0, V, size=(8, T))
LABELS = RNG.integers(0, V, size=(8, T))
_covers("distillation.Distiller", "distillation.LogitsDivergence")


def _lm(name, seed):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Embedding(V, H, name="embedding")(tokens)
    hidden = keras.layers.Dense(H, activation="tanh", name="body")(hidden)
    return keras.Model(tokens, keras.layers.Dense(V, name="head")(hidden), name=name)


def _distiller(**heads):
    distiller = Distiller(_lm("teacher", 1), _lm("student", 2), LogitsDivergence(), **heads)
    distiller.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return distiller


def _distillation_oracle(distiller):
    """½·cross-entropy + ½·KL(teacher ‖ student), means over every token."""
    teacher = to_numpy(distiller.teacher(TOKENS)).astype(np.float64)
    student = to_numpy(distiller.student(TOKENS)).astype(np.float64)
    return 0.5 * O.np_cross_entropy(LABELS, student) + 0.5 * O.np_kl_divergence(teacher, student, from_logits=True)


# Unfused; the student's head fused alone (the teacher's logits formed); both heads fused.
HEADS = {"unfused": {}, "head": {"head": "head"}, "both": {"head": "head", "teacher_head": "head"}}


def test_distiller_unfused_and_fused_with_only_its_heads_named():
    results = {}
    for fused, heads in HEADS.items():
        distiller = _distiller(**heads)
        total = to_numpy(distiller.compute_loss(x=TOKENS, y=LABELS))
        np.testing.assert_allclose(total, _distillation_oracle(distiller), rtol=2e-5)
        history, logs = _fit_and_evaluate(distiller, TOKENS, LABELS, epochs=2, shuffle=False)
        np.testing.assert_allclose(logs["total_loss"], _distillation_oracle(distiller), rtol=2e-5)
        results[fused] = history, distiller.student.get_weights()
    # The logits formed whole (no chunk_size): the unfused numbers.
    for fused in ("head", "both"):
        assert set(results[fused][0]) == set(results["unfused"][0])
        for key, values in results[fused][0].items():
            np.testing.assert_allclose(values, results["unfused"][0][key], rtol=1e-5, err_msg=f"{fused}: {key}")
        for a, b in zip(results[fused][1], results["unfused"][1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=fused)


# ------------------------------------------------------------------ ops

B, C = 4, 5
PROBS = [special.softmax(RNG.normal(size=(B, C)), axis=-1).astype("float32") for _ in range(2)]
LOGITS = RNG.normal(size=(B, C)).astype("float32")
CLASS_LABELS = RNG.integers(0, C, size=(B,))
LOGPROBS = -RNG.uniform(0.1, 3.0, size=(B, 7)).astype("float32")
REF = (LOGPROBS + RNG.normal(scale=0.3, size=(B, 7))).astype("float32")
OLD = (LOGPROBS + RNG.normal(scale=0.1, size=(B, 7))).astype("float32")
ADVANTAGES = RNG.normal(size=(B,)).astype("float32")
DESIRABLE = np.array([1, 0, 1, 0])
MEAN, LOG_VAR = RNG.normal(size=(B, 3)).astype("float32"), RNG.normal(scale=0.5, size=(B, 3)).astype("float32")


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


# Each op with its required arguments on NumPy arrays, and its value from NumPy.
OPS_ON_ARRAYS = {
    "l1": (lambda: P.l1(X), lambda: O.np_l1(*_f64(X))),
    "l2": (lambda: P.l2(X), lambda: O.np_l2(*_f64(X))),
    "elastic_net": (lambda: P.elastic_net(X), lambda: O.np_elastic_net(*_f64(X))),
    "orthogonality": (lambda: P.orthogonality(X), lambda: O.np_orthogonality(*_f64(X))),
    "output_magnitude": (lambda: P.output_magnitude(X), lambda: O.np_output_magnitude(*_f64(X))),
    "kl_sparsity": (lambda: P.kl_sparsity(PROBS[0]), lambda: O.np_kl_sparsity(*_f64(PROBS[0]))),
    "entropy": (lambda: P.entropy(PROBS[0]), lambda: O.np_entropy(*_f64(PROBS[0]))),
    "kl_divergence": (lambda: P.kl_divergence(*PROBS), lambda: O.np_kl_divergence(*_f64(*PROBS))),
    "js_divergence": (lambda: P.js_divergence(*PROBS), lambda: O.np_js_divergence(*_f64(*PROBS))),
    "consistency": (lambda: P.consistency(*PROBS), lambda: O.np_consistency(*_f64(*PROBS))),
    "gaussian_kl": (
        lambda: P.gaussian_kl(MEAN, LOG_VAR),
        lambda: np.mean(0.5 * np.sum(np.exp(LOG_VAR) + MEAN.astype(np.float64) ** 2 - 1.0 - LOG_VAR, axis=-1)),
    ),
    "cross_entropy": (
        lambda: P.cross_entropy(CLASS_LABELS, LOGITS),
        lambda: O.np_cross_entropy(CLASS_LABELS, *_f64(LOGITS)),
    ),
    "token_logprobs": (
        lambda: P.token_logprobs(CLASS_LABELS, LOGITS),
        lambda: rl_oracles.trl_selective_log_softmax(LOGITS, CLASS_LABELS),
    ),
    "kl_estimate": (
        lambda: P.kl_estimate(LOGPROBS, REF),
        lambda: np.mean(rl_oracles.trl_per_token_kl(LOGPROBS, REF)),
    ),
    "policy_loss": (
        lambda: P.policy_loss(LOGPROBS, OLD, ADVANTAGES),
        lambda: rl_oracles.trl_grpo_loss(
            LOGPROBS, OLD, None, ADVANTAGES, np.ones(LOGPROBS.shape), 0.0, 0.2, 0.2, "bnpo"
        ),
    ),
    "importance_weights": (
        lambda: P.importance_weights(LOGPROBS, OLD)[0],
        lambda: np.minimum(np.exp(LOGPROBS.astype(np.float64) - OLD), 2.0),
    ),
    "off_policy_mask": (
        lambda: P.off_policy_mask(LOGPROBS, OLD, ADVANTAGES, threshold=0.05),
        lambda: np.broadcast_to(
            ~((ADVANTAGES[:, None] < 0) & (np.mean(OLD - LOGPROBS.astype(np.float64), 1, keepdims=True) > 0.05)),
            LOGPROBS.shape,
        ),
    ),
    "clip_fraction": (
        lambda: P.clip_fraction(LOGPROBS, OLD, ADVANTAGES)["region"],
        lambda: rl_fraction(LOGPROBS, OLD, ADVANTAGES),
    ),
    "topk_kl": (
        lambda: P.topk_kl(np.log(PROBS[0][:, :2]), np.log(PROBS[1][:, :2])),
        lambda: np.mean(_two_ids_and_rest()),
    ),
    "preference_loss": (
        lambda: P.preference_loss(LOGPROBS, OLD),
        lambda: np.mean(np.logaddexp(0.0, -0.1 * (LOGPROBS.sum(1).astype(np.float64) - OLD.sum(1)))),
    ),
    "preference_reward": (
        lambda: P.preference_reward(LOGPROBS, OLD),
        lambda: np.mean(0.1 * (LOGPROBS.sum(1).astype(np.float64) - OLD.sum(1))),
    ),
    "trust_region_mask": (
        lambda: P.trust_region_mask(LOGPROBS, OLD, ADVANTAGES, threshold=0.05),
        lambda: np.where(
            ADVANTAGES[:, None] > 0,
            np.exp(LOGPROBS.astype(np.float64)) - np.exp(OLD) <= 0.05,
            np.exp(LOGPROBS.astype(np.float64)) - np.exp(OLD) >= -0.05,
        ),
    ),
    "entropy_mask": (
        lambda: P.entropy_mask(-LOGPROBS),
        lambda: -LOGPROBS >= np.quantile(-LOGPROBS.astype(np.float64), 0.8),
    ),
    "unpaired_preference_loss": (
        lambda: P.unpaired_preference_loss(LOGPROBS, REF, DESIRABLE, kl_logprobs=OLD, ref_kl_logprobs=REF),
        lambda: np.mean(_kto_losses()),
    ),
    "router_load_balancing": (
        lambda: P.router_load_balancing(LOGITS, top_k=1),
        lambda: router_oracles.keras_hub_load_balancing_loss(LOGITS, C, 1),
    ),
    "router_z_loss": (lambda: P.router_z_loss(LOGITS), lambda: router_oracles.st_moe_z_loss(LOGITS)),
    "discounted_cumsum": (
        lambda: P.discounted_cumsum(LOGPROBS, 0.5),
        lambda: np.stack([sum(0.5**k * LOGPROBS[:, t + k] for k in range(7 - t)) for t in range(7)], -1),
    ),
}
_covers(*(f"ops.{name}" for name in OPS_ON_ARRAYS))


def rl_fraction(logprobs, old, advantages):
    """PPO's clip region at (0.2, 0.2): the fraction of tokens clipped."""
    ratio = np.exp(logprobs.astype(np.float64) - old)
    a = advantages[:, None]
    return np.mean(((ratio < 0.8) & (a < 0)) | ((ratio > 1.2) & (a > 0)))


def _kto_losses():
    """KTO at β = 0.1, z₀ = max(0, mean of the mismatched pairs' log-ratio sums)."""
    delta = LOGPROBS.sum(1).astype(np.float64) - REF.sum(1)
    z0 = max(0.0, np.mean(OLD.sum(1).astype(np.float64) - REF.sum(1)))
    return np.where(DESIRABLE > 0, 1 - _sigmoid(0.1 * (delta - z0)), 1 - _sigmoid(0.1 * (z0 - delta)))


def _two_ids_and_rest():
    """KL over the first two classes and the rest merged into one bin."""
    p, q = (np.concatenate([x[:, :2], x[:, 2:].sum(-1, keepdims=True)], -1).astype(np.float64) for x in PROBS)
    return np.sum(p * np.log(p / q), -1)


@pytest.mark.parametrize("name", sorted(OPS_ON_ARRAYS))
def test_op_on_numpy_arrays_with_required_arguments(name):
    call, oracle = OPS_ON_ARRAYS[name]
    np.testing.assert_allclose(to_numpy(call()), oracle(), rtol=2e-5, atol=1e-6)


class _StepModel(keras.Model):
    """A model whose loss is an op's value (summed): the op traced and
    compiled inside `fit`'s training step, as a user's `compute_loss` calls it."""

    def __init__(self, call):
        super().__init__(name="step")
        self.call_op = call
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        value = ops.sum(ops.cast(self.call_op(), "float32"))
        return value * self.scale


@pytest.mark.parametrize("name", sorted(OPS_ON_ARRAYS))
def test_op_with_required_arguments_in_a_compiled_fit_step(name):
    call, oracle = OPS_ON_ARRAYS[name]
    model = _StepModel(call)
    model.compile(keras.optimizers.SGD(1e-3))
    history = model.fit(np.zeros((2, 1), "float32"), batch_size=2, epochs=1, verbose=0).history
    # The loss before the step: the op's value, the scale still 1.
    np.testing.assert_allclose(history["loss"][0], np.sum(np.asarray(oracle(), np.float64)), rtol=2e-5, atol=1e-6)


HIDDEN = RNG.normal(size=(B, T, H)).astype("float32")
KERNEL = RNG.normal(scale=0.7, size=(H, V)).astype("float32")
TEACHER_KERNEL = RNG.normal(scale=0.7, size=(H, V)).astype("float32")
TOKEN_LABELS = RNG.integers(0, V, size=(B, T))
# Each op that takes logits, on ops.linear(...) logits without chunk_size
# (from_logits=True, which lazy logits need), and its value from NumPy.
OPS_ON_LINEAR = {
    "kl_divergence": (
        lambda h, k: P.kl_divergence(P.linear(HIDDEN, TEACHER_KERNEL), P.linear(h, k), from_logits=True),
        lambda s: O.np_kl_divergence(O.np_linear(HIDDEN, TEACHER_KERNEL), s, from_logits=True),
    ),
    "js_divergence": (
        lambda h, k: P.js_divergence(P.linear(HIDDEN, TEACHER_KERNEL), P.linear(h, k), from_logits=True),
        lambda s: O.np_js_divergence(O.np_linear(HIDDEN, TEACHER_KERNEL), s, from_logits=True),
    ),
    "entropy": (
        lambda h, k: P.entropy(P.linear(h, k), from_logits=True),
        lambda s: O.np_entropy(s, from_logits=True),
    ),
    "cross_entropy": (
        lambda h, k: P.cross_entropy(TOKEN_LABELS, P.linear(h, k)),
        lambda s: O.np_cross_entropy(TOKEN_LABELS, s),
    ),
    "token_logprobs": (
        lambda h, k: ops.sum(P.token_logprobs(TOKEN_LABELS, P.linear(h, k))),
        lambda s: rl_oracles.trl_selective_log_softmax(s, TOKEN_LABELS).sum(),
    ),
}
_covers("ops.linear", "ops.LinearLogits")


@pytest.mark.parametrize("name", sorted(OPS_ON_LINEAR))
def test_op_on_linear_logits_without_chunk_size(name):
    call, oracle = OPS_ON_LINEAR[name]
    logits = O.np_linear(HIDDEN, KERNEL)
    np.testing.assert_allclose(to_numpy(call(HIDDEN, KERNEL)), oracle(logits), rtol=2e-5, atol=1e-6)
    # Gradients reach the hidden states and the kernel, as on the formed logits.
    lazy = grads(call, HIDDEN, KERNEL)
    formed = grads(lambda h, k: call_on_formed(name, h, k), HIDDEN, KERNEL)
    for a, b in zip(lazy, formed):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def call_on_formed(name, hidden, kernel):
    """The op of OPS_ON_LINEAR on logits formed first (hidden @ kernel)."""
    logits = ops.matmul(hidden, kernel)
    teacher = ops.matmul(ops.convert_to_tensor(HIDDEN), ops.convert_to_tensor(TEACHER_KERNEL))
    return {
        "kl_divergence": lambda: P.kl_divergence(teacher, logits, from_logits=True),
        "js_divergence": lambda: P.js_divergence(teacher, logits, from_logits=True),
        "entropy": lambda: P.entropy(logits, from_logits=True),
        "cross_entropy": lambda: P.cross_entropy(TOKEN_LABELS, logits),
        "token_logprobs": lambda: ops.sum(P.token_logprobs(TOKEN_LABELS, logits)),
    }[name]()


# ------------------------------------------------------------------ gradients

_covers(
    "gradients.input_gradient",
    "gradients.gradient_norms",
    "gradients.function_norms",
    "gradients.gradient_penalty",
    "gradients.interpolated_gradient_penalty",
    "gradients.parameter_probe",
)
WEIGHT = np.array([3.0, 4.0], "float32")  # ‖∇ critic‖ = 5 everywhere


def _critic(x):
    return ops.sum(ops.multiply(x, WEIGHT), axis=-1)


def test_gradient_functions_with_their_required_arguments():
    pairs = RNG.normal(size=(5, 2)).astype("float32")
    np.testing.assert_allclose(to_numpy(gradients.input_gradient(ops.square, pairs)), 2 * pairs, rtol=1e-6)
    np.testing.assert_allclose(float(gradients.gradient_penalty(_critic, pairs)), 16.0, rtol=1e-6)
    np.testing.assert_allclose(float(gradients.interpolated_gradient_penalty(_critic, pairs, -pairs)), 16.0, rtol=1e-5)
    norms = gradients.function_norms({"sq": lambda x: ops.sum(ops.square(x))}, pairs)
    np.testing.assert_allclose(norms["sq"], np.linalg.norm(2 * pairs), rtol=1e-6)
    norms = gradients.gradient_norms(CompositeObjective({"l2": "l2"}), pairs)
    # l2 per-sample sums averaged over the batch: ∂/∂x = 2x / batch.
    np.testing.assert_allclose(norms["l2"], np.linalg.norm(2 * pairs / len(pairs)), rtol=1e-6)


def test_parameter_probe_with_its_required_arguments():
    model = _model()
    model.compile("adam", "mse")

    def outputs(x, y):
        return [ops.mean(ops.square(model(x) - y))]

    probe = gradients.parameter_probe(model, outputs, 1)
    values, norms = probe(X, Y)
    # The mean squared error of two linear layers and its gradient, by hand.
    (kernel, bias), (out_kernel, out_bias) = _weights(model, "layer"), _weights(model, "out")
    hidden = X @ kernel + bias
    error = 2 * (hidden @ out_kernel + out_bias - Y) / Y.size
    back = error @ out_kernel.T
    parts = [X.T @ back, back.sum(0), hidden.T @ error, error.sum(0)]
    np.testing.assert_allclose(values[0], np.sum(error**2) * Y.size / 4, rtol=2e-5)
    np.testing.assert_allclose(norms[0], np.sqrt(sum(np.sum(p**2) for p in parts)), rtol=2e-5)


# ------------------------------------------------------------------ post-training models

_covers(
    "post_training.PreferenceModel", "post_training.PolicyModel", "post_training.Rollouts", "callbacks.ReferenceSync"
)


def _causal_lm():
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub needs Python 3.11+ (make test installs it there)")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=H, intermediate_dim=2 * H, max_sequence_length=T + 4
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def test_the_post_training_models_with_their_required_arguments():
    # Each with the policy alone, in fit and evaluate: finite logs; the sync in fit's callbacks.
    from keras_penalties.post_training import PolicyModel, PreferenceModel, Rollouts

    completion = np.tile((np.arange(T) >= 2).astype("float32"), (B, 1))
    pairs = {
        "chosen_ids": TOKENS[:B],
        "rejected_ids": TOKENS[B : 2 * B],
        "chosen_mask": completion,
        "rejected_mask": completion,
    }
    preference = PreferenceModel(_causal_lm())
    preference.compile("adam")
    _fit_and_evaluate(preference, pairs, None, batch_size=B, callbacks=[callbacks.ReferenceSync()])
    policy = PolicyModel(_causal_lm())
    policy.compile("adam")
    rollout = {"token_ids": TOKENS[:B], "completion_mask": completion, "advantages": ADVANTAGES}
    _fit_and_evaluate(policy, rollout, None, batch_size=B)
    rollouts = Rollouts(policy, TOKENS[:, :2], lambda ids, mask: mask.sum(1))  # 8 prompts × 8 completions
    batch = rollouts[0]
    assert batch["token_ids"].shape == (64, T + 4) and np.isfinite(batch["advantages"]).all()


# ------------------------------------------------------------------ coverage


def test_the_release_old_terms_module_with_names_only():
    # keras_penalties.terms stays for a release: its helpers, called as 0.1.0 code calls them.
    built = legacy_terms.build_terms({"l1": "l1", "l2": "l2"})
    restored = legacy_terms.deserialize_terms(legacy_terms.serialize_terms(built))
    total, values = CompositeObjective(restored).compute(X)
    expected = {"l1": O.np_l1(X, "sum_over_batch_size"), "l2": O.np_l2(X, "sum_over_batch_size")}
    for name, value in expected.items():
        np.testing.assert_allclose(float(values[name]), value, rtol=2e-5, err_msg=name)
    np.testing.assert_allclose(float(total), sum(expected.values()), rtol=2e-5)


_covers("terms.Term", "terms.build_terms", "terms.serialize_terms", "terms.deserialize_terms")


class _RouterLoss(keras.Model):
    """A model whose loss adds the z-loss of its router, read by RouterLogits."""

    def __init__(self, model):
        super().__init__(name="router_loss")
        self.inner = model
        self.routers = keras_penalties.RouterLogits(model)

    def call(self, x):
        return self.inner(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + P.router_z_loss(self.routers(y_pred))


def test_router_logits_with_its_model_only():
    # A router named as keras-hub names its routers: found without `layers`.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((D,))
    router = keras.layers.Dense(U, name="router_gate")
    model = keras.Model(inputs, keras.layers.Dense(K)(router(inputs)))
    trained = _RouterLoss(model)
    trained.compile("adam", "mse")
    _, logs = _fit_and_evaluate(trained)
    kernel, bias = _weights(model, "router_gate")
    z = X.astype(np.float64) @ kernel + bias
    mse = np.mean((to_numpy(model(X)) - Y) ** 2)
    np.testing.assert_allclose(logs["loss"], mse + router_oracles.st_moe_z_loss(z), rtol=2e-5)


_covers("RouterLogits")


def _public_names():
    names = {name for name in keras_penalties.__all__ if name[0].isupper()}
    names.update(f"terms.{name}" for name in legacy_terms.__all__)
    names.update(f"composite.weighting.{name}" for name in ("Weighting", "Fixed", "Uncertainty", "FAMO", "get"))
    for module in (callbacks, losses, optimizers, regularizers):
        names.update(f"{module.__name__.split('.')[-1]}.{name}" for name in module.__all__)
    names.update(f"ops.{name}" for name in P.__all__)
    from keras_penalties import post_training

    names.update(f"post_training.{name}" for name in post_training.__all__)
    for module in (gradients, keras_penalties.distillation):
        short = module.__name__.split(".")[-1]
        names.update(
            f"{short}.{name}"
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module.__name__
            and not getattr(obj, "_is_protocol", False)  # a type to annotate with, not an entry
        )
    return names


def test_every_public_entry_is_called_here():
    missing = _public_names() - COVERED
    assert not missing, f"public entries with no first-call test in this file: {sorted(missing)}"
