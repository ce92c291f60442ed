"""Bad arguments to the classes and helpers fail before any tensor work, with
an error naming the argument (ops options are in test_ops_errors.py)."""

import keras
import numpy as np
import pytest

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties import ops as P
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor
from keras_penalties.gradients import gradient_norms, gradient_penalty, interpolated_gradient_penalty
from tests.testing import assert_raises_as_listed

X = np.ones((2, 3), np.float32)


class NegativeAtZero(keras.optimizers.schedules.LearningRateSchedule):
    def __call__(self, step):
        return keras.ops.cast(step, "float32") - 1.0

    def get_config(self):
        return {}


ERRORS = {
    "term_inputs_float": (lambda: Term("l1", inputs=1.5), TypeError, r"`inputs` must be None, a name"),
    "term_inputs_empty": (lambda: Term("l1", inputs=()), ValueError, r"`inputs`"),
    "term_class": (lambda: Term(R.L1), TypeError, r"`penalty` must be an instance, not the class L1"),
    "term_weight_class": (
        lambda: Term("l1", keras.optimizers.schedules.PolynomialDecay),
        TypeError,
        r"`weight`.*class",
    ),
    "term_negative_schedule": (
        lambda: Term("l1", NegativeAtZero()),
        ValueError,
        r"`weight` is a schedule whose value at step 0 is -1",
    ),
    "term_weight_huge": (lambda: Term("l1", 10**400), ValueError, r"`weight` must be finite"),
    "composite_loss_weights_list": (
        lambda: L.CompositeLoss({"a": L.Entropy()}, weights=[1.0]),
        TypeError,
        r"`weights` must be a dict",
    ),
    "objective_weights_list": (
        lambda: CompositeObjective({"a": "l1"}, weights=[1.0]),
        TypeError,
        r"`weights` must be a dict",
    ),
    "report_base_loss": (lambda: CompositeObjective({"a": "l1"}).report(X, base_loss="abc"), TypeError, r"`base_loss`"),
    "report_grad_norms": (
        lambda: CompositeObjective({"a": "l1"}).report(X, grad_norms="yes"),
        TypeError,
        r"`grad_norms` must be a bool",
    ),
    "gradient_penalty_fn": (lambda: gradient_penalty(3, X), TypeError, r"`fn` must be a callable"),
    "interpolated_fn": (lambda: interpolated_gradient_penalty(None, X, X), TypeError, r"`fn` must be a callable"),
    "interpolated_int": (
        lambda: interpolated_gradient_penalty(lambda t: t, np.ones((2, 3), "int32"), X),
        TypeError,
        r"`real` must be a floating-point",
    ),
    "gradient_norms_objective": (
        lambda: gradient_norms("l1", X),
        TypeError,
        r"`objective` must be a CompositeObjective",
    ),
    "temperature_huge": (lambda: P.entropy(X, temperature=10**400), ValueError, r"`temperature` must be finite"),
    "factor_huge": (lambda: R.L1(10**400), ValueError, r"`factor` must be finite"),
    "monitor_probe_string": (lambda: PenaltyMonitor(probe_data="abc"), TypeError, r"`probe_data`"),
    "monitor_probe_scalar": (lambda: PenaltyMonitor(probe_data=3.0), TypeError, r"`probe_data`"),
    "monitor_probe_empty": (
        lambda: PenaltyMonitor(probe_data=(np.zeros((0, 3)), np.zeros((0,)))),
        ValueError,
        r"`probe_data` has no samples",
    ),
    "entropy_rank0": (lambda: P.entropy(1.0), ValueError, r"`x` must have rank >= 1"),
    "kl_rank0": (lambda: P.kl_divergence(0.5, 0.5), ValueError, r"`p` must have rank >= 1"),
    "js_rank0": (lambda: P.js_divergence(0.5, 0.5), ValueError, r"`p` must have rank >= 1"),
    "kl_sparsity_rank0": (lambda: P.kl_sparsity(0.5), ValueError, r"`x` must have rank >= 1"),
    "orthogonality_empty": (lambda: P.orthogonality(np.ones((3, 0))), ValueError, r"`w` reshaped to \[-1, last\]"),
    "orthogonality_no_rows": (lambda: P.orthogonality(np.ones((0, 3))), ValueError, r"`w` reshaped"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_names_the_argument(name):
    assert_raises_as_listed(ERRORS[name])


def test_probe_data_as_a_two_list_is_x_and_y():
    monitor = PenaltyMonitor(probe_data=[X, np.zeros((2,))])
    assert monitor.probe_data[1] is not None and tuple(monitor.probe_data[0].shape) == (2, 3)


@pytest.mark.parametrize(
    "inputs, term",
    [({"a": "teacher"}, Term("kl_divergence", inputs=("teacher", "student"))), ([0], Term("l1", inputs=(1,)))],
    ids=["missing_key", "missing_position"],
)
def test_unfed_term_inputs_fail_when_the_model_is_built(inputs, term):
    if isinstance(inputs, dict):
        fed = {"teacher": keras.Input((3,))}
    else:
        fed = [keras.Input((3,))]
    with pytest.raises(ValueError, match=r"Term 'bad'"):
        CompositeObjective({"bad": term})(fed)
