"""Several devices give the one-device numbers: training, History,
evaluate, every per-term value and every probe, to 1e-5 relative (a probe's
weights, and numbers scaled by them, relative to their layer's largest: see
tests/distributed_run.py).

Each mode runs tests/distributed_run.py in a subprocess, since the number of
devices is fixed when the framework starts: JAX with 2 virtual CPU devices
(`DataParallel`, and `ModelParallel` sharding two Dense kernels that carry
Orthogonality and L2 regularizers), TensorFlow with 2 logical CPUs
(`MirroredStrategy`). The run holds mean and sum terms, a schedule, a
Regularizer term, a CompositeLoss with mean, sum and ops terms, a callback
that calls set_weight/disable/enable, and adaptive weights (an
uncertainty-weighted objective with a chunked entropy term, a per-term custom metric, DynamicWeightAverage
on the loss, GradNorm on the objective), a fused Distiller (in chunks, and at its
default chunk_size) whose token masks keep more tokens on one replica than
on the other, and an objective
whose token means (whole, chunked, and a fused cross-entropy from hidden
states, masked and not) see such masks too, after a layer's activity loss,
and a CompositeLoss whose terms Keras reduces with such a mask and with
per-sample weights that differ between the replicas; and an objective and
a loss with learned weights (uncertainty, FAMO) made before the
distribution, in a model built under it.
"""

import pytest

from tests.testing import BACKEND
from tests.two_devices import report_of

MODES = {"jax": ["data_parallel", "model_parallel"], "tensorflow": ["mirrored"], "torch": []}


def _run(mode):
    return report_of("tests.distributed_run", mode)


@pytest.mark.skipif(BACKEND == "torch", reason="Keras has no distribution for the torch backend")
@pytest.mark.parametrize("mode", MODES[BACKEND] or ["none"])
def test_two_devices_match_one(mode):
    report = _run(mode)
    assert report.pop("missing") == []
    assert report.pop("step")["two"] == 12  # 3 epochs of 4 steps, on every replica
    keys = set(report)
    # Every kind of number is compared, not only some.
    for key in (
        "predictions",
        "history/loss",
        "history/obj/l1_sum",
        "history/closs/mae_sum",
        "history/dense_a/kernel_regularizer",
        "evaluate/obj/ent",
        "probe0/total/grad_norm",
        "probe0/closs/cons/grad_norm",
        "probe5/base_loss",
        "probe5/obj/mag/grad_norm",
        "history/closs/mse/weight",
        "history/uobj/ent/weight",
        "history/uobj/ent",
        "history/obj/l1/l2",
        "gradnorm5/grad_norms",
        "gradnorm5/weights",
        "log_variances",
        "distiller/predictions",
        "distiller/history/loss",
        "distiller/history/distillation/kd",
        "distiller/history/distillation/js",
        "distiller/history/student_loss",
        "distiller/evaluate/total_loss",
        "distiller_whole/history/distillation/kd",
        "distiller_whole/history/student_loss",
        "distiller_whole/evaluate/total_loss",
        "famo/loss/famo_logits",
        "famo/history/floss/mae_sum/weight",
        "famo/predictions",
        "tokens/history/tok/ent",
        "tokens/history/tok/ent_chunked",
        "tokens/kernel",
        "tokens/history/tok/ce_fused",
        "tokens/history/tok/ce_fused_all",
        "tokens/history/tok/off_policy",
        "tokens/history/tok/preference",
        "tokens/history/tok/next",
        "tokens/history/tok/ce_z",
        "tokens/history/tok/router_lb",
        "tokens/history/tok/router_lb_layer",
        "tokens/history/tok/router_z",
        "tokens/history/loss",
        "famo/objective/famo_logits",
        "famo/history/fobj/l1_sum/weight",
        "masked/history/loss",
        "outside/uncertainty/loss",
        "outside/uncertainty/weights",
        "outside/famo/loss",
        "outside/famo/weights",
        "outside/own_rule/loss",
        "outside/own_rule/weights",
        "outside/subclassed/loss",
        "outside/subclassed/weights",
        "masked/history/mloss/ce",
        "masked/history/mloss/ce_sw",
        "masked/history/mloss/ce_ignore",
        "masked/history/mloss/ent",
        "masked/history/mloss/ent_op",
        "masked/kernel",
    ):
        assert key in keys, key
    bad = {k: v for k, v in report.items() if not v["rel"] <= 1e-5}
    assert not bad, {k: (v["rel"], v["one"], v["two"]) for k, v in bad.items()}
