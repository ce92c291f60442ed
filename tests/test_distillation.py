"""`keras_penalties.distillation`: `LogitsDivergence` and `Distiller`.

Numbers against NumPy float64 (the divergences), Keras' own
`SparseCategoricalCrossentropy` (the student loss with sample weights) and
Keras' own `LogitsDistillation(loss=KLDivergence())` (T²·KL); the fused
Distiller against the unfused one, in `fit`, with masks, partial chunks, a
tied embedding, mixed precision, and a `.keras` round trip.
"""

import keras
import numpy as np
import pytest

from keras_penalties import regularizers as R
from keras_penalties.distillation import Distiller, LogitsDivergence
from tests import oracles as O
from tests.testing import BACKEND, assert_config_round_trip, save_and_load, to_numpy

V, T, H = 11, 5, 6
RNG = np.random.default_rng(31)
TOKENS = RNG.integers(0, V, size=(8, T))
LABELS = RNG.integers(0, V, size=(8, T))
# 0/1 token weights, kept counts uneven across samples (and across the two
# halves of the batch: replicas in the two-device runs).
WEIGHTS = (RNG.uniform(size=(8, T)) < np.linspace(0.2, 0.9, 8)[:, None]).astype("float32")
WEIGHTS[:, 0] = 1.0
TEMPERATURE = 2.0


@keras.saving.register_keras_serializable(package="keras_penalties_tests")
class _AddsMeanSquare(keras.layers.Layer):
    """Adds 0.05·mean(h²) of its input to the model's losses (an add_loss
    term that only a forward pass produces)."""

    def call(self, h):
        self.add_loss(0.05 * keras.ops.mean(keras.ops.square(h)))
        return h


def _lm(name, head="dense", regularized=False, seed=0):
    """A tiny causal-LM-shaped model: tokens -> hidden states -> vocabulary
    projection (`head`: a Dense "head", or the tied input embedding read
    backwards, as keras-hub's models do)."""
    keras.utils.set_random_seed(seed)
    # Weights large enough for logits of a few units: teacher and student
    # then differ by a KL of order 1, not 1e-4 (where float32 cancellation
    # in any implementation is 1e-3 of the value).
    wide = keras.initializers.RandomNormal(stddev=1.5)
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    tied = (
        keras.layers.ReversibleEmbedding(
            V, H, embeddings_initializer=wide, tie_weights=head == "tied", name="embedding"
        )
        if head in ("tied", "untied")
        else None
    )
    hidden = (
        tied(tokens) if tied else keras.layers.Embedding(V, H, embeddings_initializer=wide, name="embedding")(tokens)
    )
    hidden = keras.layers.Dense(
        H, activation="tanh", name="body", kernel_regularizer=R.L2(0.05) if regularized else None
    )(hidden)
    if regularized:
        hidden = _AddsMeanSquare(name="activity")(hidden)
    logits = tied(hidden, reverse=True) if tied else keras.layers.Dense(V, kernel_initializer=wide, name="head")(hidden)
    return keras.Model(tokens, logits, name=name)


def _np(model):
    return to_numpy(model(TOKENS)).astype(np.float64)


def _masked_mean(values, weights=WEIGHTS):
    kept = weights != 0
    return values[kept].sum() / kept.sum()


def _kd(teacher_logits, student_logits, weights=WEIGHTS):
    per_token = O.np_kl_divergence(teacher_logits, student_logits, True, temperature=TEMPERATURE, reduction="none")
    return TEMPERATURE**2 * _masked_mean(per_token, weights)


# --------------------------------------------------------------- LogitsDivergence


@pytest.mark.parametrize(
    "options, oracle",
    [
        ({}, lambda t, s: O.np_kl_divergence(t, s, True, reduction="none")),
        (
            {"direction": "reverse", "temperature": 3.0},
            lambda t, s: 9.0 * O.np_kl_divergence(t, s, True, direction="reverse", temperature=3.0, reduction="none"),
        ),
        (
            {"divergence": "js", "beta": 0.3, "temperature": 0.5},
            lambda t, s: 0.25 * O.np_js_divergence(t, s, True, beta=0.3, temperature=0.5, reduction="none"),
        ),
        (
            {"temperature": 2.0, "scale_by_temperature_squared": False},
            lambda t, s: O.np_kl_divergence(t, s, True, temperature=2.0, reduction="none"),
        ),
        (
            {"direction": "symmetric", "chunk_size": 3},
            lambda t, s: O.np_kl_divergence(t, s, True, direction="symmetric", reduction="none"),
        ),
    ],
)
def test_logits_divergence_matches_numpy_per_kept_token(options, oracle):
    teacher, student = (RNG.normal(scale=2.0, size=(8, T, V)).astype("float32") for _ in range(2))
    loss = LogitsDivergence(**options)
    values = oracle(teacher.astype(np.float64), student.astype(np.float64))
    np.testing.assert_allclose(to_numpy(loss.compute_loss(teacher, student)), values.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        to_numpy(loss.compute_loss(teacher, student, sample_weight=WEIGHTS)), _masked_mean(values), rtol=1e-5
    )
    # One weight per sample spreads over its tokens; a trailing axis of 1 is squeezed.
    per_sample = np.array([1, 0, 1, 1, 0, 1, 1, 1], "float32")
    expected = _masked_mean(values, np.broadcast_to(per_sample[:, None], (8, T)))
    np.testing.assert_allclose(
        to_numpy(loss.compute_loss(teacher, student, sample_weight=per_sample)), expected, rtol=1e-5
    )
    np.testing.assert_allclose(
        to_numpy(loss.compute_loss(teacher, student, sample_weight=WEIGHTS[..., None])), _masked_mean(values), rtol=1e-5
    )


def test_logits_divergence_is_right_alone_or_in_a_list_in_keras_own_distiller():
    # Keras resets the weights of a single loss to [1.0]: a loss that carries
    # its own T² is right either way, and equals Keras' own T²·KL path
    # (LogitsDistillation with a keras.losses.KLDivergence instance).
    teacher, student = _lm("teacher", seed=1), _lm("student", seed=2)
    expected = _kd(_np(teacher), _np(student), np.ones((8, T)))
    keras_own = keras.distillation.LogitsDistillation(temperature=TEMPERATURE, loss=keras.losses.KLDivergence())
    for losses, weights in (
        (LogitsDivergence(temperature=TEMPERATURE), None),
        ([LogitsDivergence(temperature=TEMPERATURE)], None),
        ([LogitsDivergence(temperature=TEMPERATURE)], [1.0]),
        (keras_own, None),
    ):
        distiller = keras.distillation.Distiller(teacher, student, losses, weights, student_loss_weight=0.0)
        distiller.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        logs = distiller.evaluate(TOKENS, LABELS, batch_size=8, verbose=0, return_dict=True)
        np.testing.assert_allclose(logs["distillation_loss"], expected, rtol=1e-5, err_msg=repr(losses))


def test_logits_divergence_accepts_lazy_logits():
    from keras_penalties import ops as P

    hidden_t, hidden_s = (RNG.normal(size=(8, T, H)).astype("float32") for _ in range(2))
    kernel = RNG.normal(size=(H, V)).astype("float32")
    loss = LogitsDivergence("js", beta=0.2, temperature=TEMPERATURE, chunk_size=7)
    lazy = loss.compute_loss(P.linear(hidden_t, kernel), P.linear(hidden_s, kernel), sample_weight=WEIGHTS)
    formed = loss.compute_loss(hidden_t @ kernel, hidden_s @ kernel, sample_weight=WEIGHTS)
    np.testing.assert_allclose(to_numpy(lazy), to_numpy(formed), rtol=1e-5)


def test_logits_divergence_config_round_trip():
    loss = LogitsDivergence(
        "kl",
        direction="reverse",
        beta=0.25,
        temperature=3.0,
        scale_by_temperature_squared=False,
        chunk_size=64,
        name="rkl",
    )
    rebuilt = assert_config_round_trip(loss, keras.saving.deserialize_keras_object, "keras_penalties")
    assert (rebuilt.direction, rebuilt.temperature, rebuilt.chunk_size, rebuilt.name) == ("reverse", 3.0, 64, "rkl")
    auto = assert_config_round_trip(
        LogitsDivergence(chunk_size="auto"), keras.saving.deserialize_keras_object, "keras_penalties"
    )
    assert auto.chunk_size == "auto"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"divergence": "mse"}, ValueError, r"`divergence` must be one of 'kl', 'js'"),
        ({"direction": "up"}, ValueError, r"`direction` must be one of"),
        ({"divergence": "js", "beta": 1.0}, ValueError, r"`beta` must lie strictly between 0 and 1"),
        ({"temperature": 0.0}, ValueError, r"`temperature` must be > 0"),
        ({"chunk_size": 1.5}, TypeError, r"`chunk_size` must be an int"),
        ({"scale_by_temperature_squared": 1}, TypeError, r"`scale_by_temperature_squared` must be a bool"),
        ({"name": 3}, TypeError, r"`name` must be a string or None"),
    ],
)
def test_logits_divergence_errors_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        LogitsDivergence(**kwargs)


# --------------------------------------------------------------- Distiller


def _distiller(fused=False, head="dense", teacher_head=True, weights=(4.0, 1.0), chunk_size=7, **kwargs):
    teacher = _lm("teacher", head=head, seed=1)
    student = _lm("student", head=head, regularized=True, seed=2)
    name = "head" if head == "dense" else "embedding"
    fuse = dict(head=name, teacher_head=name if teacher_head else None, chunk_size=chunk_size) if fused else {}
    losses = [LogitsDivergence(temperature=TEMPERATURE, name="kd"), LogitsDivergence("js", beta=0.3)]
    distiller = Distiller(teacher, student, losses, list(weights), student_loss_weight=0.4, **fuse, **kwargs)
    distiller.compile(
        optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return distiller


def _expected_total(distiller):
    """w·student + (1 − w)·(4·kd + js) + the student's L2, from NumPy and Keras."""
    teacher, student = _np(distiller.teacher), _np(distiller.student)
    student_loss = float(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)(LABELS, student, sample_weight=WEIGHTS)
    )
    kd = _kd(teacher, student)
    js = _masked_mean(O.np_js_divergence(teacher, student, True, beta=0.3, reduction="none"))
    student_model = distiller.student
    body = to_numpy(keras.Model(student_model.inputs, student_model.get_layer("body").output)(TOKENS)).astype(
        np.float64
    )
    own = 0.05 * np.sum(to_numpy(student_model.get_layer("body").kernel).astype(np.float64) ** 2) + 0.05 * np.mean(
        body**2
    )
    return {
        "student_loss": student_loss,
        "distillation/kd": kd,
        "distillation/logits_divergence": js,
        "distillation_loss": 4.0 * kd + js,
        "total_loss": 0.4 * student_loss + 0.6 * (4.0 * kd + js) + own,
    }


@pytest.mark.parametrize("head", ["dense", "tied"])
def test_total_is_student_loss_distillation_and_the_students_own_losses(head):
    unfused, fused = _distiller(head=head), _distiller(fused=True, head=head)
    expected = _expected_total(unfused)
    # evaluate: the unfused numbers, from the student's logits.
    for distiller in (unfused, fused):
        logs = distiller.evaluate(TOKENS, LABELS, sample_weight=WEIGHTS, batch_size=8, verbose=0, return_dict=True)
        for key, value in expected.items():
            np.testing.assert_allclose(logs[key], value, rtol=2e-5, err_msg=key)
        np.testing.assert_allclose(logs["loss"], expected["total_loss"], rtol=2e-5)
    # A fused training step: the same numbers from the hidden states.
    hidden = fused(TOKENS, training=True)
    assert tuple(hidden.shape) == (8, T, H)
    total = fused.compute_loss(TOKENS, LABELS, hidden, WEIGHTS, training=True)
    np.testing.assert_allclose(to_numpy(total), expected["total_loss"], rtol=2e-5)


def test_a_fused_step_takes_token_weights_with_a_trailing_axis():
    # [batch, tokens, 1], as Keras' own losses take them.
    fused = _distiller(fused=True)
    total = fused.compute_loss(TOKENS, LABELS, fused(TOKENS, training=True), WEIGHTS[..., None], training=True)
    np.testing.assert_allclose(to_numpy(total), _expected_total(_distiller())["total_loss"], rtol=2e-5)


def test_a_fused_step_reads_no_label_where_the_weight_is_zero():
    # Padding labels such as -100 under a zero sample weight are never
    # indexed (TF's fused op in a head chunk raises on them).
    fused = _distiller(fused=True)
    padded = np.where(WEIGHTS != 0, LABELS, -100)
    total = fused.compute_loss(TOKENS, padded, fused(TOKENS, training=True), WEIGHTS, training=True)
    np.testing.assert_allclose(to_numpy(total), _expected_total(_distiller())["total_loss"], rtol=2e-5)


@pytest.mark.parametrize("fused, chunk_size", [(False, 7), (True, 7), (True, None)])
def test_compute_loss_outside_fit_includes_the_students_own_losses(fused, chunk_size):
    # A custom loop calls compute_loss(x, y) with no y_pred: the student's
    # add_loss terms come from the forward pass it runs (issue 41: they
    # were read before it, and lost).
    distiller = _distiller(fused=fused, chunk_size=chunk_size)
    total = to_numpy(distiller.compute_loss(x=TOKENS, y=LABELS, sample_weight=WEIGHTS))
    np.testing.assert_allclose(total, _expected_total(distiller)["total_loss"], rtol=2e-5)


def test_a_single_distillation_loss_keeps_its_weight():
    teacher, student = _lm("teacher", seed=1), _lm("student", seed=2)
    distiller = Distiller(
        teacher,
        student,
        LogitsDivergence(temperature=TEMPERATURE),
        distillation_loss_weights=[3.0],
        student_loss_weight=0.0,
    )
    distiller.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logs = distiller.evaluate(TOKENS, LABELS, batch_size=8, verbose=0, return_dict=True)
    kd = _kd(_np(teacher), _np(student), np.ones((8, T)))
    np.testing.assert_allclose(logs["distillation_loss"], 3.0 * kd, rtol=1e-5)
    np.testing.assert_allclose(logs["distillation/logits_divergence"], kd, rtol=1e-5)
    assert distiller.distillation_loss_weights == [3.0]


def test_each_loss_is_logged_by_name_and_feature_losses_still_work():
    # Unnamed losses by class name in snake case, repeats numbered; a
    # FeatureDistillation between named layers equals Keras' own Distiller's.
    teacher, student = _lm("teacher", seed=1), _lm("student", seed=2)
    features = keras.distillation.FeatureDistillation(loss="mse", teacher_layer_name="body", student_layer_name="body")
    losses = [LogitsDivergence(), LogitsDivergence("js"), features, LogitsDivergence(name="kd")]
    distiller = Distiller(teacher, student, losses, student_loss_weight=0.5)
    assert distiller.loss_names == ["logits_divergence", "logits_divergence_2", "feature_distillation", "kd"]
    distiller.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = distiller.fit(TOKENS, LABELS, batch_size=8, epochs=1, verbose=0).history
    for name in distiller.loss_names:
        assert f"distillation/{name}" in history
    keras_own = keras.distillation.Distiller(teacher, student, [features], student_loss_weight=0.0)
    keras_own.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ours = distiller.evaluate(TOKENS, LABELS, batch_size=8, verbose=0, return_dict=True)
    theirs = keras_own.evaluate(TOKENS, LABELS, batch_size=8, verbose=0, return_dict=True)
    np.testing.assert_allclose(ours["distillation/feature_distillation"], theirs["distillation_loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "head, teacher_head, jit_compile, chunk_size",
    [
        ("dense", True, "auto", 7),
        ("tied", True, "auto", 7),
        ("dense", False, "auto", 7),  # the teacher forms its logits, the student does not
        ("tied", True, "auto", None),  # the default: the logits formed whole
        ("untied", True, "auto", 7),  # a reversible embedding's own [H, V] output kernel
        pytest.param(
            "tied",
            True,
            True,
            7,
            marks=pytest.mark.skipif(BACKEND == "torch", reason="jit_compile on torch is torch.compile, not XLA"),
        ),
    ],
)
def test_fused_training_equals_unfused(head, teacher_head, jit_compile, chunk_size):
    results = {}
    for fused in (False, True):
        distiller = _distiller(fused=fused, head=head, teacher_head=teacher_head, chunk_size=chunk_size)
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=jit_compile,
        )
        # Batches of 3, 3 and 2: a partial last batch, rows known at run time on TF.
        history = distiller.fit(
            TOKENS,
            LABELS,
            sample_weight=WEIGHTS,
            batch_size=3,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(TOKENS, LABELS, WEIGHTS),
        ).history
        results[fused] = (history, distiller.student.get_weights())
    unfused, fused = results[False][0], results[True][0]
    # A fused step logs no compiled metric (it never forms the logits they
    # read); validation computes them.
    assert "accuracy" in unfused and "accuracy" not in fused
    assert set(fused) == set(unfused) - {"accuracy"}
    for key in fused:
        np.testing.assert_allclose(fused[key], unfused[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # Six SGD steps apart, two float32 summation orders drift by a few 1e-6.
    for a, b in zip(results[True][1], results[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    assert unfused["loss"][-1] < unfused["loss"][0]


def test_losses_outside_the_fused_loop_count_as_unfused():
    # A fused step sums the student loss and the divergences in one chunk
    # loop; a divergence with its own chunk size runs its own, and one of
    # weight 0 is only logged. Every number is still the unfused one.
    results = {}
    for fused in (False, True):
        teacher, student = _lm("teacher", seed=1), _lm("student", regularized=True, seed=2)
        losses = [
            LogitsDivergence(temperature=TEMPERATURE, name="kd"),
            LogitsDivergence("js", beta=0.3, chunk_size=3),
            LogitsDivergence(direction="reverse", name="reverse"),
        ]
        fuse = dict(head="head", teacher_head="head", chunk_size=7) if fused else {}
        distiller = Distiller(teacher, student, losses, [4.0, 1.0, 0.0], student_loss_weight=0.4, **fuse)
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        history = distiller.fit(
            TOKENS, LABELS, sample_weight=WEIGHTS, batch_size=3, epochs=2, shuffle=False, verbose=0
        ).history
        results[fused] = (history, student.get_weights())
    unfused, fused = results[False][0], results[True][0]
    assert set(fused) == set(unfused)
    assert min(fused["distillation/reverse"]) > 0
    for key in fused:
        np.testing.assert_allclose(fused[key], unfused[key], rtol=1e-5, atol=1e-7, err_msg=key)
    for a, b in zip(results[True][1], results[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("chunk_size", [7, None])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_fused_training_under_mixed_precision(policy, chunk_size):
    # Half hidden states, float32 kernels: the fused losses form float32
    # logits per chunk (or whole, without chunk_size); the unfused ones read
    # the half logits the head makes. Both train, to the half-precision
    # rounding of the logits.
    histories = {}
    for fused in (False, True):
        distiller = _distiller(fused=fused, head="tied", chunk_size=chunk_size)
        histories[fused] = distiller.fit(
            TOKENS, LABELS, sample_weight=WEIGHTS, batch_size=4, epochs=2, shuffle=False, verbose=0
        ).history
    for key in ("loss", "student_loss", "distillation/kd"):
        assert np.isfinite(histories[True][key]).all(), key
        np.testing.assert_allclose(histories[True][key], histories[False][key], rtol=2e-2, err_msg=key)


def test_save_and_load(tmp_path):
    distiller = _distiller(fused=True, head="tied")
    distiller.fit(TOKENS, LABELS, sample_weight=WEIGHTS, batch_size=4, epochs=1, shuffle=False, verbose=0)
    loaded = save_and_load(distiller, tmp_path)  # safe_mode=True
    assert type(loaded) is Distiller
    config = loaded.get_config()
    assert (config["head"], config["teacher_head"], config["chunk_size"]) == ("embedding", "embedding", 7)
    assert loaded.distillation_loss_weights == [4.0, 1.0] and loaded.loss_names == ["kd", "logits_divergence"]
    assert loaded.compiled and isinstance(loaded.student_losses, keras.losses.SparseCategoricalCrossentropy)
    for model in (distiller, loaded):
        model.fit(TOKENS, LABELS, sample_weight=WEIGHTS, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # The optimizer state came back too: one more epoch lands on the same weights.
    for a, b in zip(distiller.student.get_weights(), loaded.student.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(V, H)
        self.head = keras.layers.Dense(V, name="head")

    def call(self, tokens):
        return self.head(self.embedding(tokens))


def test_errors_name_the_argument():
    teacher, student = _lm("teacher", seed=1), _lm("student", seed=2)
    kd = LogitsDivergence()
    with pytest.raises(ValueError, match=r"`head`: layer 'body' does not produce student's output"):
        Distiller(teacher, student, kd, head="body")
    with pytest.raises(TypeError, match=r"`head` must be a layer of student or its name"):
        Distiller(teacher, student, kd, head=3)
    with pytest.raises(
        ValueError, match=r"`distillation_losses`: .* must be LogitsDivergence; got \['FeatureDistillation'\]"
    ):
        Distiller(teacher, student, [kd, keras.distillation.FeatureDistillation()], head="head")
    with pytest.raises(ValueError, match=r"`chunk_size` must be an int >= 1"):
        Distiller(teacher, student, kd, head="head", chunk_size=0)
    softmax = keras.Model(
        student.input, keras.layers.Dense(V, activation="softmax", name="probs")(student.get_layer("body").output)
    )
    with pytest.raises(ValueError, match=r"`head`: probs has an activation"):
        Distiller(teacher, softmax, kd, head="probs")
    subclassed = _Subclassed()
    subclassed(TOKENS)
    with pytest.raises(ValueError, match=r"`head`: .* has no symbolic graph"):
        Distiller(teacher, subclassed, kd, head=subclassed.head)
    fused = Distiller(teacher, student, kd, head="head")
    with pytest.raises(ValueError, match=r"`loss`: with `head`, the student loss is computed from the hidden states"):
        fused.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"`sample_weight` of shape \(8, 5, 2\) does not fit"):
        kd.compute_loss(_np(teacher), _np(student), sample_weight=np.ones((8, T, 2)))
