"""Data-parallel locality of the chunked ops and fused heads (SPEC §11) under
JAX's `DataParallel` on two virtual CPU devices, read off the compiled HLO
and `memory_analysis()` (tests/sharding_run.py, in a subprocess: the device
count is fixed when JAX starts): no collective moves rows (hidden states,
logits, labels, masks), the rows' gradient stays sharded, each device's
temporaries are at most one device's at the same `chunk_size` (beyond its
partial sums of a replicated kernel's gradient, before their all-reduce),
and values and gradients equal one device's.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.testing import BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A collective on at most this many elements carries per-row statistics'
# totals or a scalar (the kept count, the partial sums), not rows.
SMALL = 64


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.sharding_run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="a sharded batch inside one computation is JAX's (DataParallel); TF's MirroredStrategy and torch DDP "
    "run each replica on its own rows by construction",
)
@pytest.mark.parametrize(
    "case", ["kl_formed_logits", "entropy_formed_logits", "cross_entropy_head", "cross_entropy_head_bfloat16", "kl_tied_heads"]
)
def test_chunks_stay_on_the_device_that_holds_their_rows(report, case):
    found = report[case]
    assert found["rel"] <= 1e-5
    assert found["rows_grad_sharding"] == "P('batch',)"
    moved = [(kind, shapes) for kind, shapes in found["collectives"] if kind != "all-reduce" and any(np.prod(s) > SMALL for s in shapes)]
    assert moved == [], moved
    # All-reduces: scalars, and for a trained head its kernel's and bias's gradient, once.
    reduced = [shapes for kind, shapes in found["collectives"] if kind == "all-reduce" and any(np.prod(s) > SMALL for s in shapes)]
    assert len(reduced) <= 1, reduced
    assert found["temp_two"] <= found["temp_one"] + found["replicated_grad_bytes"], found
