"""Bad arguments fail eagerly, with a message naming the argument."""

import math

import numpy as np
import pytest

from keras_penalties import ops as P
from tests.testing import assert_raises_as_listed

X = np.ones((2, 3), np.float32)


class Untouchable:
    """An input that fails if anything tries to convert it: option errors
    must be raised before any tensor work."""

    def __array__(self, *args, **kwargs):
        raise AssertionError("the input was touched before the options were checked")


U = Untouchable()

ERRORS = {
    "reduction": (
        lambda: P.l1(U, reduction="avg"),
        ValueError,
        r"`reduction` must be one of 'sum', 'mean', 'none', 'sum_over_batch_size'; got 'avg'",
    ),
    "reduction_divergence": (
        lambda: P.entropy(U, reduction="sum_over_batch_size"),
        ValueError,
        r"`reduction` must be one of 'sum', 'mean', 'none', 'sequence_mean', 'sequence_sum'; got",
    ),
    "reduction_kl": (lambda: P.kl_divergence(U, U, reduction="batch"), ValueError, r"`reduction`"),
    "reduction_type": (lambda: P.entropy(U, reduction=None), ValueError, r"`reduction`"),
    "direction": (
        lambda: P.kl_divergence(U, U, direction="backward"),
        ValueError,
        r"`direction` must be one of 'forward', 'reverse', 'symmetric'",
    ),
    "metric": (
        lambda: P.consistency(U, U, metric="cos"),
        ValueError,
        r"`metric` must be one of 'mse', 'l1', 'cosine', 'kl', 'js'",
    ),
    "mode": (
        lambda: P.orthogonality(U, mode="strict"),
        ValueError,
        r"`mode` must be one of 'soft', 'hard', 'spectral'",
    ),
    "orthogonality_axis": (lambda: P.orthogonality(U, axis=0), ValueError, r"`axis` must be one of 'columns', 'rows'"),
    "l1_ratio_high": (lambda: P.elastic_net(U, l1_ratio=1.5), ValueError, r"`l1_ratio` must be in \[0, 1\]; got 1.5"),
    "l1_ratio_low": (lambda: P.elastic_net(U, l1_ratio=-0.1), ValueError, r"`l1_ratio`"),
    "l1_ratio_nan": (lambda: P.elastic_net(U, l1_ratio=math.nan), ValueError, r"`l1_ratio` must be finite"),
    "temperature_zero": (lambda: P.kl_divergence(U, U, temperature=0.0), ValueError, r"`temperature` must be > 0"),
    "temperature_negative": (lambda: P.entropy(U, temperature=-1.0), ValueError, r"`temperature` must be > 0"),
    "temperature_inf": (
        lambda: P.js_divergence(U, U, temperature=math.inf),
        ValueError,
        r"`temperature` must be finite",
    ),
    "temperature_nan": (lambda: P.entropy(U, temperature=math.nan), ValueError, r"`temperature` must be finite"),
    "temperature_type": (lambda: P.entropy(U, temperature="hot"), TypeError, r"`temperature` must be a number"),
    "beta_zero": (
        lambda: P.js_divergence(U, U, beta=0.0),
        ValueError,
        r"`beta` must lie strictly between 0 and 1.*kl_divergence",
    ),
    "beta_one": (
        lambda: P.js_divergence(U, U, beta=1),
        ValueError,
        r"`beta` must lie strictly between 0 and 1.*kl_divergence",
    ),
    "beta_outside": (
        lambda: P.js_divergence(U, U, beta=1.5),
        ValueError,
        r"`beta` must lie strictly between 0 and 1; got 1.5",
    ),
    "beta_nan": (lambda: P.js_divergence(U, U, beta=math.nan), ValueError, r"`beta` must be finite"),
    "chunk_size_zero": (
        lambda: P.kl_divergence(U, U, chunk_size=0),
        ValueError,
        r"`chunk_size` must be an int >= 1; got 0",
    ),
    "chunk_size_negative": (lambda: P.entropy(U, chunk_size=-4), ValueError, r"`chunk_size` must be an int >= 1"),
    "chunk_size_float": (lambda: P.js_divergence(U, U, chunk_size=512.0), TypeError, r"`chunk_size` must be an int"),
    "chunk_size_string": (
        lambda: P.kl_divergence(U, U, chunk_size="fast"),
        ValueError,
        r"`chunk_size` must be None, 'auto' or an int >= 1; got 'fast'",
    ),
    "chunk_size_bool": (lambda: P.entropy(U, chunk_size=True), TypeError, r"`chunk_size` must be an int"),
    "target_zero": (
        lambda: P.kl_sparsity(U, target=0.0),
        ValueError,
        r"`target` must be in the open interval \(0, 1\)",
    ),
    "target_one": (lambda: P.kl_sparsity(U, target=1.0), ValueError, r"`target`"),
    "target_negative_magnitude": (lambda: P.output_magnitude(U, target=-1.0), ValueError, r"`target` must be >= 0"),
    "center": (lambda: P.l2(U, center="median"), ValueError, r"`center` must be None, a number or 'mean'"),
    "clip": (lambda: P.l2(U, clip=0.0), ValueError, r"`clip` must be > 0"),
    "from_logits": (lambda: P.kl_divergence(U, U, from_logits="yes"), TypeError, r"`from_logits` must be a bool"),
    "normalize": (lambda: P.entropy(U, normalize=1), TypeError, r"`normalize` must be a bool"),
    "shapes": (
        lambda: P.kl_divergence(X, np.ones((2, 4))),
        ValueError,
        r"`p` and `q` must have the same shape; got \(2, 3\) and \(2, 4\)",
    ),
    "shapes_js": (lambda: P.js_divergence(X, np.ones((3,))), ValueError, r"`p` and `q` must have the same shape"),
    "shapes_consistency": (
        lambda: P.consistency(X, np.ones((3, 2))),
        ValueError,
        r"`a` and `b` must have the same shape",
    ),
    "rank": (lambda: P.orthogonality(np.ones(3)), ValueError, r"`w` must have rank >= 2"),
    "axis_range": (lambda: P.entropy(X, axis=2), ValueError, r"`axis`=2 is out of range for an input of rank 2"),
    "axis_type": (lambda: P.kl_divergence(X, X, axis="last"), TypeError, r"`axis` must be an int"),
    "cosine_rank": (
        lambda: P.consistency(np.ones(3), np.ones(3), metric="cosine"),
        ValueError,
        r"`metric='cosine'`.*rank >= 2",
    ),
    # ops.linear and ops.cross_entropy
    "linear_features": (
        lambda: P.linear(X, np.ones((4, 5))),
        ValueError,
        r"`kernel`'s first axis \(4\) must equal `hidden`'s last axis \(3\).*transpose_kernel=True",
    ),
    "linear_features_tied": (
        lambda: P.linear(X, np.ones((5, 4)), transpose_kernel=True),
        ValueError,
        r"`kernel`'s second axis \(4\) must equal `hidden`'s last axis \(3\)",
    ),
    "linear_kernel_rank": (lambda: P.linear(X, np.ones(3)), ValueError, r"`kernel` must have rank 2"),
    "linear_bias": (
        lambda: P.linear(X, np.ones((3, 5)), np.ones(4)),
        ValueError,
        r"`bias` must have shape \(5,\), one per class; got \(4,\)",
    ),
    "linear_hidden_rank": (
        lambda: P.linear(np.float32(1.0), np.ones((1, 3))),
        ValueError,
        r"`hidden` must have rank >= 1",
    ),
    "linear_transpose_type": (
        lambda: P.linear(U, U, transpose_kernel="yes"),
        TypeError,
        r"`transpose_kernel` must be a bool",
    ),
    "linear_from_logits": (
        lambda: P.kl_divergence(P.linear(X, np.ones((3, 5))), np.ones((2, 5))),
        ValueError,
        r"`p` is ops.linear\(...\) logits: pass `from_logits=True`",
    ),
    "linear_shapes": (
        lambda: P.js_divergence(P.linear(X, np.ones((3, 5))), np.ones((2, 4)), from_logits=True),
        ValueError,
        r"`p` and `q` must have the same shape; got \(2, 5\) and \(2, 4\)",
    ),
    "linear_axis": (
        lambda: P.entropy(P.linear(np.ones((2, 4, 3)), np.ones((3, 5))), from_logits=True, axis=1),
        ValueError,
        r"`axis` must be the last axis",
    ),
    "labels_shape": (
        lambda: P.cross_entropy(np.zeros(3), P.linear(np.ones((2, 4, 3)), np.ones((3, 5)))),
        ValueError,
        r"`labels` must have the logits' shape without the class axis, \(2, 4\)",
    ),
    "labels_rank": (
        lambda: P.cross_entropy(np.zeros((2, 1)), X),
        ValueError,
        r"`labels` must have the logits' shape without the class axis, \(2,\)",
    ),
    "label_smoothing": (
        lambda: P.cross_entropy(U, U, label_smoothing=1.5),
        ValueError,
        r"`label_smoothing` must be in \[0, 1\]",
    ),
    "cross_entropy_rank": (
        lambda: P.cross_entropy(np.zeros(()), np.float32(1.0)),
        ValueError,
        r"`logits` must have rank >= 1",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_names_the_argument(name):
    assert_raises_as_listed(ERRORS[name])


def test_check_options_validates_without_calling():
    assert P.kl_divergence.check_options(direction="reverse", temperature=2) == {
        "direction": "reverse",
        "temperature": 2.0,
    }
    with pytest.raises(ValueError, match="`direction`"):
        P.kl_divergence.check_options(direction="sideways")
    with pytest.raises(TypeError, match=r"kl_divergence\(\) got unknown option\(s\) \['temprature'\]"):
        P.kl_divergence.check_options(temprature=2.0)
    with pytest.raises(TypeError, match=r"unknown option"):
        P.l1(X, center=1.0)
