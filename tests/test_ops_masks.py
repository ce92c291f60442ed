"""`mask=` on kl_divergence, js_divergence and entropy, against the
NumPy oracles' per-sample values reduced over the kept positions only."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties import ops as P
from tests import oracles as O
from tests.testing import assert_config_round_trip, assert_finite, grad, to_numpy

RNG = np.random.default_rng(3)
SHAPE = (3, 4, 7)  # [batch, tokens, vocab]
P_LOGITS = RNG.normal(scale=3.0, size=SHAPE).astype("float32")
Q_LOGITS = RNG.normal(scale=3.0, size=SHAPE).astype("float32")
MASK = (RNG.uniform(size=SHAPE[:2]) < 0.6).astype("float32")
MASK[0, 0], MASK[0, 1] = 1.0, 0.0  # at least one kept and one masked

# name -> (ours(p, q, **kw), oracle per-sample values(p, q))
FUNCTIONS = {
    "kl_forward": (
        lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, **kw),
        lambda p, q: O.np_kl_divergence(p, q, True, reduction="none"),
    ),
    "kl_reverse": (
        lambda p, q, **kw: P.kl_divergence(p, q, from_logits=True, direction="reverse", temperature=0.5, **kw),
        lambda p, q: O.np_kl_divergence(p, q, True, direction="reverse", temperature=0.5, reduction="none"),
    ),
    "js": (
        lambda p, q, **kw: P.js_divergence(p, q, from_logits=True, **kw),
        lambda p, q: O.np_js_divergence(p, q, True, reduction="none"),
    ),
    "js_beta": (
        lambda p, q, **kw: P.js_divergence(p, q, from_logits=True, beta=0.2, **kw),
        lambda p, q: O.np_js_divergence(p, q, True, reduction="none", beta=0.2),
    ),
    "entropy": (
        lambda p, q, **kw: P.entropy(q, from_logits=True, **kw),
        lambda p, q: O.np_entropy(q, True, reduction="none"),
    ),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_masked_value_matches_oracle(name, reduction):
    ours, oracle = FUNCTIONS[name]
    values = oracle(P_LOGITS, Q_LOGITS)
    kept = MASK != 0
    expected = {
        "mean": values[kept].sum() / kept.sum(),
        "sum": values[kept].sum(),
        "none": np.where(kept, values, 0.0),
    }[reduction]
    for mask in (MASK, MASK.astype(bool), 2.0 * MASK):  # float, bool, any nonzero keeps
        np.testing.assert_allclose(
            to_numpy(ours(P_LOGITS, Q_LOGITS, mask=mask, reduction=reduction)), expected, rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_masked_positions_add_nothing_to_value_or_gradient(name):
    ours, _ = FUNCTIONS[name]
    kept = (MASK != 0)[..., None]
    # Extreme logits where the mask is 0 must not change anything.
    wild = np.where(kept, Q_LOGITS, 1e4 * np.sign(Q_LOGITS)).astype("float32")
    base = to_numpy(ours(P_LOGITS, Q_LOGITS, mask=MASK))
    np.testing.assert_allclose(to_numpy(ours(P_LOGITS, wild, mask=MASK)), base, rtol=1e-6)
    g = to_numpy(grad(lambda q: ours(ops.convert_to_tensor(P_LOGITS), q, mask=MASK), wild))
    assert_finite(g, name)
    np.testing.assert_array_equal(g[~np.broadcast_to(kept, SHAPE)], 0.0)
    assert np.any(g[np.broadcast_to(kept, SHAPE)] != 0.0)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_all_kept_is_unmasked_and_none_kept_is_zero(name):
    ours, _ = FUNCTIONS[name]
    np.testing.assert_allclose(
        to_numpy(ours(P_LOGITS, Q_LOGITS, mask=np.ones(SHAPE[:2]))), to_numpy(ours(P_LOGITS, Q_LOGITS)), rtol=1e-6
    )
    none = np.zeros(SHAPE[:2], "float32")
    for reduction in ("mean", "sum"):
        assert float(to_numpy(ours(P_LOGITS, Q_LOGITS, mask=none, reduction=reduction))) == 0.0
    g = to_numpy(grad(lambda q: ours(ops.convert_to_tensor(P_LOGITS), q, mask=none), Q_LOGITS))
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_mask_of_the_wrong_shape_is_an_error(name):
    ours, _ = FUNCTIONS[name]
    for bad in (np.ones(SHAPE), np.ones(SHAPE[:1]), np.ones((3, 5))):
        with pytest.raises(ValueError, match=r"`mask` must have the per-sample shape \(3, 4\)"):
            ours(P_LOGITS, Q_LOGITS, mask=bad)


def test_mask_on_another_axis():
    # Distribution along axis 1: the per-sample shape is [batch, vocab-less rest].
    p, q = np.moveaxis(P_LOGITS, -1, 1), np.moveaxis(Q_LOGITS, -1, 1)
    masked = P.kl_divergence(p, q, from_logits=True, axis=1, mask=MASK)
    np.testing.assert_allclose(
        to_numpy(masked), to_numpy(P.kl_divergence(P_LOGITS, Q_LOGITS, from_logits=True, mask=MASK)), rtol=1e-6
    )


# ---------------------------------------------------------------- Term options
# A Term's mask is an input of the objective, named in its options.


def test_term_mask_names_a_dict_input():
    objective = CompositeObjective(
        {
            "kl": Term("kl_divergence", inputs=("teacher", "student"), options={"from_logits": True, "mask": "mask"}),
            "h": Term(
                "entropy", 0.5, inputs=("student",), options={"from_logits": True, "mask": "mask", "chunk_size": 5}
            ),
        }
    )
    total, values = objective.compute({"teacher": P_LOGITS, "student": Q_LOGITS, "mask": MASK})
    kept = MASK != 0
    kl = O.np_kl_divergence(P_LOGITS, Q_LOGITS, True, reduction="none")[kept].mean()
    h = O.np_entropy(Q_LOGITS, True, reduction="none")[kept].mean()
    np.testing.assert_allclose(float(to_numpy(values["kl"])), kl, rtol=1e-5)
    np.testing.assert_allclose(float(to_numpy(values["h"])), h, rtol=1e-5)
    np.testing.assert_allclose(float(to_numpy(total)), kl + 0.5 * h, rtol=1e-5)


def test_term_mask_by_list_position_and_round_trip():
    term = Term("js_divergence", inputs=(0, 1), options={"from_logits": True, "beta": 0.3, "mask": 2})
    objective = CompositeObjective({"js": term})
    _, values = objective.compute([P_LOGITS, Q_LOGITS, MASK])
    expected = O.np_js_divergence(P_LOGITS, Q_LOGITS, True, reduction="none", beta=0.3)[MASK != 0].mean()
    np.testing.assert_allclose(float(to_numpy(values["js"])), expected, rtol=1e-5)
    loaded = Term.from_config(term.get_config())
    assert loaded.options["mask"] == 2 and loaded.reads == (0, 1, 2)
    assert_config_round_trip(objective, keras.saving.deserialize_keras_object, "keras_penalties")


def test_term_mask_errors_name_the_option():
    with pytest.raises(TypeError, match=r"`options\['mask'\]` names the input"):
        Term("entropy", inputs=("x",), options={"mask": MASK})
    with pytest.raises(ValueError, match=r"`options\['mask'\]`='mask' names an input, so the term needs `inputs"):
        Term("entropy", options={"mask": "mask"})
    objective = CompositeObjective({"kl": Term("kl_divergence", inputs=("p", "q"), options={"mask": "tokens"})})
    with pytest.raises(
        ValueError, match=r"Term 'kl' takes inputs \['p', 'q', 'tokens'\], but \['tokens'\] is not among"
    ):
        objective.compute({"p": P_LOGITS, "q": Q_LOGITS})


# ---------------------------------------------------------------- losses
# Keras' own token mask (from Embedding(mask_zero=True)) reaches the losses
# through Loss.__call__: "sum_over_batch_size" is the mean over kept tokens.


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("name", ["kl", "js", "entropy"])
def test_losses_honour_the_keras_mask(name, chunk_size):
    keras.utils.set_random_seed(2)
    tokens = RNG.integers(1, 9, size=SHAPE[:2])
    tokens[MASK == 0] = 0  # padding
    loss = {
        "kl": L.KLDivergence(from_logits=True, direction="reverse", chunk_size=chunk_size),
        "js": L.JSDivergence(from_logits=True, beta=0.3, chunk_size=chunk_size),
        "entropy": L.Entropy(from_logits=True, chunk_size=chunk_size),
    }[name]
    inputs = keras.Input(SHAPE[1:2], dtype="int32")
    logits = keras.layers.Dense(SHAPE[-1])(keras.layers.Embedding(9, 4, mask_zero=True)(inputs))
    model = keras.Model(inputs, logits)
    model.compile(loss=loss)
    student = to_numpy(model.predict(tokens, verbose=0))
    values = {
        "kl": lambda: O.np_kl_divergence(P_LOGITS, student, True, direction="reverse", reduction="none"),
        "js": lambda: O.np_js_divergence(P_LOGITS, student, True, reduction="none", beta=0.3),
        "entropy": lambda: O.np_entropy(student, True, reduction="none"),
    }[name]()
    expected = values[MASK != 0].mean()
    np.testing.assert_allclose(model.evaluate(tokens, P_LOGITS, batch_size=8, verbose=0), expected, rtol=1e-5)
