"""Divergences at LLM settings (issue 13, item 4): bfloat16 logits, T = 0.05
and logits of ±1e4, for every direction and several β. Values must match the
float64 log-space oracle (SciPy's log_softmax) on the same (bf16-rounded)
inputs, and values and gradients
must be finite (a peer returns NaN gradients for reverse KL and JS at T = 0.05)."""

import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import ops as P
from keras_penalties.gradients import input_gradient
from tests.testing import assert_finite, to_numpy

RNG = np.random.default_rng(11)
A = (20 * RNG.normal(size=(4, 64))).astype("float32")
B = (20 * RNG.normal(size=(4, 64))).astype("float32")
A[0, :3], B[1, :3] = [1e4, -1e4, 0.0], [-1e4, 1e4, 5.0]
T = 0.05


def _log_probs(x):
    return special.log_softmax(x / T, axis=-1)


def np_kl(p, q, direction):
    """In log space: at T = 0.05 the probabilities underflow in float64 too."""
    lp, lq = _log_probs(p), _log_probs(q)
    forward = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    reverse = np.sum(np.exp(lq) * (lq - lp), axis=-1)
    return {"forward": forward, "reverse": reverse, "symmetric": 0.5 * (forward + reverse)}[direction]


def np_js(p, q, beta):
    lp, lq = _log_probs(p), _log_probs(q)
    lm = np.logaddexp(np.log(beta) + lp, np.log(1 - beta) + lq)
    return beta * np.sum(np.exp(lp) * (lp - lm), axis=-1) + (1 - beta) * np.sum(np.exp(lq) * (lq - lm), axis=-1)


def np_entropy(q):
    lq = _log_probs(q)
    return -np.sum(np.exp(lq) * lq, axis=-1)


CASES = {
    **{
        f"kl_{d}": (
            lambda p, q, d=d, **kw: P.kl_divergence(
                p, q, from_logits=True, direction=d, temperature=T, reduction="none", **kw
            ),
            lambda p, q, d=d: np_kl(p, q, d),
        )
        for d in ("forward", "reverse", "symmetric")
    },
    **{
        f"js_beta_{b}": (
            lambda p, q, b=b, **kw: P.js_divergence(
                p, q, from_logits=True, beta=b, temperature=T, reduction="none", **kw
            ),
            lambda p, q, b=b: np_js(p, q, b),
        )
        for b in (0.1, 0.5, 0.9)
    },
    "entropy": (
        lambda p, q, **kw: P.entropy(q, from_logits=True, temperature=T, reduction="none", **kw),
        lambda p, q: np_entropy(q),
    ),
}


@pytest.mark.parametrize(
    "dtype, chunk_size",
    # Chunks of 3 rows (of 4: a partial last chunk), cast to float32 one by one.
    [("bfloat16", None), ("float32", None), ("bfloat16", 3)],
)
@pytest.mark.parametrize("name", sorted(CASES))
def test_values_and_gradients_at_llm_settings(name, dtype, chunk_size):
    case, oracle = CASES[name]

    def ours(p, q):
        return case(p, q, chunk_size=chunk_size)

    p, q = ops.cast(ops.convert_to_tensor(A), dtype), ops.cast(ops.convert_to_tensor(B), dtype)
    rounded_p = to_numpy(ops.cast(p, "float32")).astype("float64")
    rounded_q = to_numpy(ops.cast(q, "float32")).astype("float64")
    values = to_numpy(ops.cast(ours(p, q), "float32"))
    expected = oracle(rounded_p, rounded_q)
    # bf16 output rounding (8 bits) and float32 logits of size 2e5 after T.
    rtol = 1e-2 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(values, expected, rtol=rtol, atol=0.05)
    for wrt, g in (
        ("q", input_gradient(lambda x: ours(p, x), q)),
        ("p", input_gradient(lambda x: ours(x, q), p)),
    ):
        assert_finite(to_numpy(ops.cast(g, "float32")), f"{name} gradient w.r.t. {wrt} ({dtype})")
