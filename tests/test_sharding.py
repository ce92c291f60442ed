"""The chunked ops and fused heads on two devices, read off the
compiled HLO and `memory_analysis()` (tests/sharding_run.py, in a
subprocess: the device count is fixed when JAX starts).

Data-parallel (JAX's `DataParallel`): no collective moves rows (hidden
states, logits, labels, masks), the rows' gradient stays sharded, each
device's temporaries are at most one device's at the same `chunk_size`
(beyond its partial sums of a replicated kernel's gradient, before their
all-reduce). Vocabulary-parallel (a head kernel split on V by
`ModelParallel`, [H, V] and a tied [V, H]): the kernel's gradient stays
split, and only per-row statistics cross devices. Both at once on a (2, 2)
mesh of four devices. Values and gradients equal one device's.
"""

import numpy as np
import pytest

from tests.sharding_run import CHUNK, HIDDEN, VOCAB
from tests.testing import BACKEND
from tests.two_devices import report_of

# A collective on at most this many elements carries per-row statistics'
# totals or a scalar (the kept count, the partial sums), not rows.
SMALL = 64


def _run(devices):
    return report_of("tests.sharding_run", str(devices), backend="jax", timeout=300)


@pytest.fixture(scope="module")
def report():
    return _run(2)


@pytest.fixture(scope="module")
def report_four():
    return _run(4)


JAX_ONLY = pytest.mark.skipif(
    BACKEND != "jax",
    reason="one computation over several devices is JAX's (keras.distribution); TF's MirroredStrategy and torch "
    "DDP run each replica on its own rows and its own copy of the kernel",
)


def _large(found, limit):
    return [(kind, shapes) for kind, shapes in found["collectives"] if any(np.prod(s) > limit for s in shapes)]


@JAX_ONLY
@pytest.mark.parametrize(
    "case",
    ["kl_formed_logits", "entropy_formed_logits", "cross_entropy_head", "cross_entropy_head_bfloat16", "kl_tied_heads"],
)
def test_data_parallel_chunks_stay_on_the_device_that_holds_their_rows(report, case):
    found = report[f"data_parallel/{case}"]
    assert found["rel"] <= 1e-5
    assert found["grad_shardings"][0] == "P('batch',)"
    moved = [(kind, shapes) for kind, shapes in _large(found, SMALL) if kind != "all-reduce"]
    assert moved == [], moved
    # All-reduces: scalars, and for a trained head its kernel's and bias's gradient, once.
    assert len(_large(found, SMALL)) <= 1, found["collectives"]
    assert found["temp_two"] <= found["temp_one"] + found["replicated_grad_bytes"], found


@JAX_ONLY
@pytest.mark.parametrize("case", ["cross_entropy_head", "cross_entropy_head_bfloat16", "kl_tied_heads"])
def test_vocabulary_parallel_heads_keep_the_kernel_gradient_sharded(report, case):
    found = report[f"vocabulary_parallel/{case}"]
    assert found["rel"] <= 1e-5
    # The kernel's gradient (the second gradient) stays split on V: [H, V] on axis 1, a tied [V, H] on axis 0.
    assert found["grad_shardings"][1] in ("P(None, 'model')", "P('model',)", "P('model', None)"), found[
        "grad_shardings"
    ]
    # Inside the loop only per-row statistics cross devices ([chunk] or [chunk, H]): nothing [chunk, V] or kernel-sized.
    assert _large(found, CHUNK * HIDDEN) == [], found["collectives"]


@JAX_ONLY
@pytest.mark.parametrize("case", ["cross_entropy_head", "cross_entropy_head_bfloat16", "kl_tied_heads"])
def test_batch_and_vocabulary_parallel_heads_split_both(report_four, case):
    # A (2, 2) mesh: rows on the batch axis, the kernel on the model axis.
    found = report_four[f"batch_and_vocabulary_parallel/{case}"]
    assert found["rel"] <= 1e-5
    assert found["grad_shardings"][0] == "P('batch',)"
    assert found["grad_shardings"][1] in ("P(None, 'model')", "P('model',)", "P('model', None)"), found[
        "grad_shardings"
    ]
    # Per-row statistics, and the kernel's gradient shard summed over the batch axis once.
    assert len(_large(found, CHUNK * HIDDEN)) <= 1, found["collectives"]
    assert all(np.prod(s) <= HIDDEN * VOCAB // 2 for _, shapes in found["collectives"] for s in shapes), found[
        "collectives"
    ]
    assert found["temp_two"] <= found["temp_one"] + found["replicated_grad_bytes"], found
