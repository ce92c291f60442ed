"""`PreferenceModel` (DPO, KTO) and `PolicyModel` (GRPO with a KL and an
entropy bonus) on two devices give the one-device numbers on the global
batch: every History and `evaluate` entry and the trained weights, to 1e-5
relative or 1e-6 absolute (KTO's baseline z₀ and the rewards are small
differences of sequence log-probabilities near −10, which float32 rounds
to about 1e-6; measured 1.2e-7 on a z₀ of 0.008), with token masks that keep fewer tokens on one replica than on
the other (tests/post_training_run.py, in a subprocess: JAX's
`DataParallel` on 2 virtual CPU devices, TensorFlow's `MirroredStrategy`
on 2 logical CPUs). Two torch processes: tests/test_multiprocess.py.
"""

import pytest

from tests.testing import BACKEND
from tests.two_devices import report_of

pytest.importorskip(
    "keras_hub", reason="keras-hub needs Python 3.11+; make test installs it there (--no-deps, see the Makefile)"
)

MODES = {"jax": "data_parallel", "tensorflow": "mirrored"}


@pytest.mark.skipif(BACKEND == "torch", reason="Keras has no distribution for the torch backend")
def test_two_devices_match_one():
    report = report_of("tests.post_training_run", MODES[BACKEND])
    assert report.pop("missing") == []
    for key in (
        "dpo/history/loss",
        "dpo/history/rewards/margins",
        "dpo/history/rewards/accuracies",
        "dpo/history/logps/chosen",
        "dpo/evaluate/loss",
        "dpo/weights",
        "kto/history/loss",
        "kto/history/kl",
        "kto/weights",
        "grpo/history/loss",
        "grpo/history/policy_loss",
        "grpo/history/kl",
        "grpo/history/entropy",
        "grpo/history/reward",
        "grpo/evaluate/loss",
        "grpo/weights",
    ):
        assert key in report, (key, sorted(report))
    bad = {k: v for k, v in report.items() if not (v["rel"] <= 1e-5 or v["abs"] <= 1e-6)}
    assert not bad, bad
