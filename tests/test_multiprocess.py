"""Several processes on this machine, through tests/processes.py,
each setup equal to one process on the same global batches:

- JAX, 2 processes × 2 virtual CPU devices joined by
  `keras.distribution.initialize` (tests/multiprocess_run.py): `fit` and
  `evaluate` of composites with per-term logs (an off-policy GSPO term among them), uncertainty and FAMO
  weighting, `PenaltyMonitor`, `GradNorm`, `ProximalDecay` around
  `AdaptiveGradientClipping`, the fused `Distiller` with uneven token masks
  (in chunks, and at its default chunk_size: the logits formed whole);
- TensorFlow, 2 `MultiWorkerMirroredStrategy` workers in a custom loop
  (tests/multiworker_run.py; Keras' `fit` fails there, keras#20585):
  an objective's add_loss, `compute` with a masked token mean over uneven
  masks (an entropy, and an off-policy GSPO term with importance weights),
  the optimizer wrappers, `Distiller.compute_loss`;
- torch, 2 processes with `DistributedDataParallel` (gloo) in a custom loop
  (tests/ddp_run.py): the same calls, and `compute_loss` of
  `PreferenceModel` (DPO, KTO) and `PolicyModel` (GRPO) on keras-hub
  GPT-2s with uneven token masks.

A process that dies makes the launch fail at once, leaving none behind.
Each setup runs in its backend's suite: the processes are that backend's.
"""

import importlib.util
import json
import os
import time

import numpy as np
import pytest

from tests import processes
from tests.process_models import MASK
from tests.testing import BACKEND

JAX_ONLY = pytest.mark.skipif(
    BACKEND != "jax", reason="JAX processes (keras.distribution.initialize); the launcher is every backend's"
)
TF_ONLY = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow workers (MultiWorkerMirroredStrategy)")
TORCH_ONLY = pytest.mark.skipif(BACKEND != "torch", reason="torch processes (torch.distributed, DDP)")
ENV = {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
WORKER_ENV = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def _reports(results):
    """Each process's JSON report. On a failure, every failed process's exit
    status and the tail of its stderr: the launcher kills the others when
    one fails (status -9), so the cause is the one with a status > 0."""
    failed = [f"process {i}: exit status {code}\n{err[-2000:]}" for i, (code, _, err) in enumerate(results) if code]
    assert not failed, "\n\n".join(failed)
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]


def _assert_equal_to_one_process(one, first, second):
    """Every number of the processes' reports within 1e-5 of one process's
    (relative to the quantity's largest), the processes' bit for bit."""
    assert set(first) == set(one) == set(second)
    bad = {}
    for key, value in one.items():
        a, b, c = (np.asarray(v, np.float64) for v in (value, first[key], second[key]))
        if not (
            np.array_equal(b, c)
            and np.max(np.abs(a - b), initial=0.0) <= 1e-5 * max(np.max(np.abs(a), initial=0.0), 1e-6)
        ):
            bad[key] = (value, first[key], second[key])
    assert not bad, bad


@JAX_ONLY
def test_two_processes_of_two_devices_equal_one_process():
    (port,) = processes.free_ports()
    workers = processes.run(
        [["tests.multiprocess_run", "worker", str(port), str(i), "2"] for i in range(2)], env=WORKER_ENV
    )
    first, second = _reports(workers)
    (one,) = _reports(processes.run([["tests.multiprocess_run", "one"]], env=ENV))
    assert (one.pop("devices"), first.pop("devices"), second.pop("devices")) == (1, 4, 4)
    for key in (
        "history/obj/l1",
        "history/obj/off_policy",
        "history/uobj/ent/weight",
        "history/closs/mse/weight",
        "evaluate/obj/l1_sum",
        "probe3/total/grad_norm",
        "gradnorm3/weights",
        "distiller/history/distillation/kd",
        "distiller/evaluate/total_loss",
        "weights/0",
        "distiller/weights/0",
        "distiller_whole/history/distillation/kd",
        "distiller_whole/weights/0",
    ):
        assert key in one, key
    _assert_equal_to_one_process(one, first, second)


@TF_ONLY
def test_two_multiworker_mirrored_workers_in_a_custom_loop_equal_one_process():
    env = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
    ports = [str(p) for p in processes.free_ports(2)]
    workers = processes.run([["tests.multiworker_run", "worker", *ports, str(i)] for i in range(2)], env=env)
    first, second = _reports(workers)
    (one,) = _reports(processes.run([["tests.multiworker_run", "one"]], env=env))
    assert (one.pop("replicas"), first.pop("replicas"), second.pop("replicas")) == (1, 2, 2)
    _assert_equal_to_one_process(one, first, second)


@TORCH_ONLY
def test_two_ddp_processes_in_a_custom_loop_equal_one_process():
    port = str(processes.free_ports()[0])
    workers = processes.run(
        [["tests.ddp_run", "worker", port, str(i)] for i in range(2)], env={"KERAS_BACKEND": "torch"}
    )
    first, second = _reports(workers)
    (one,) = _reports(processes.run([["tests.ddp_run", "one"]], env={"KERAS_BACKEND": "torch"}))
    # A raw op's masked mean stays each process's: weighted by the rows each
    # keeps, the two make one process's; alone, neither does.
    raw = [np.asarray(r.pop("raw")) for r in (one, first, second)]
    kept = [
        np.array([MASK[b + p * 4 : b + p * 4 + 4].sum() for _ in range(2) for b in range(0, 32, 8)]) for p in (0, 1)
    ]
    np.testing.assert_allclose((kept[0] * raw[1] + kept[1] * raw[2]) / (kept[0] + kept[1]), raw[0], rtol=1e-5)
    assert not np.allclose(raw[1], raw[0], rtol=1e-3)
    if importlib.util.find_spec("keras_hub") is not None:  # PreferenceModel and PolicyModel on keras-hub GPT-2s
        assert {"dpo/losses", "kto/losses", "grpo/losses", "dpo/weights", "kto/weights", "grpo/weights"} <= set(one)
    _assert_equal_to_one_process(one, first, second)


@JAX_ONLY
def test_a_dead_process_fails_the_launch_at_once_and_leaves_none():
    # The worker waits for its peer in keras.distribution.initialize (JAX's
    # own timeout is minutes); the peer dies at once.
    (port,) = processes.free_ports()
    start = time.monotonic()
    results = processes.run(
        [["tests.multiprocess_run", "worker", str(port), "0", "2"], ["tests.multiprocess_run", "die"]],
        env=WORKER_ENV,
        timeout=120,
    )
    assert time.monotonic() - start < 60
    (waiting, _, _), (died, _, err) = results
    assert died == 1 and "dies at once" in err
    assert waiting < 0  # killed
    leftovers = [
        line for line in os.popen("ps -eo args").read().splitlines() if f"multiprocess_run worker {port}" in line
    ]
    assert leftovers == []
