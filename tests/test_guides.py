"""Every guide runs top to bottom on the current backend, at a small size."""

import pathlib
import re
import runpy

import pytest

GUIDES = sorted((pathlib.Path(__file__).parent.parent / "guides").glob("*.py"))


@pytest.mark.parametrize("path", GUIDES, ids=[p.name for p in GUIDES])
def test_guide_runs(path, monkeypatch, capsys):
    monkeypatch.setenv("GUIDE_ROUNDS", "2")
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out.strip()
    assert out
    rewards = re.search(r"mean reward: ([0-9.]+) at the first step -> ([0-9.]+) at the last", out)
    if path.name == "rl_fine_tuning.py" and "needs keras-hub" not in out:
        # 20 GRPO steps: the reward rises from about ¼ (the seeds fix the samples).
        first, last = map(float, rewards.groups())
        assert last > first + 0.3, out
        # Then 10 off-policy steps from a sampler at temperature 1.5: the reward climbs back.
        off = re.search(r"off-policy mean reward: ([0-9.]+) at the first step -> ([0-9.]+) at the last", out)
        first, last = map(float, off.groups())
        assert last > first, out
    margin = re.search(r"reward margin: ([-+0-9.]+) at the first step -> ([-+0-9.]+) at the last", out)
    accuracy = re.search(r"accuracy: ([0-9.]+) at the first step -> ([0-9.]+) at the last", out)
    if path.name == "preference_optimisation.py" and "needs keras-hub" not in out:
        # 12 DPO steps on pairs a rule decides: the reward margin and the accuracy rise.
        assert float(margin.group(2)) > float(margin.group(1)) + 0.05, out
        assert float(accuracy.group(2)) > 0.75, out
    largest = re.search(r"largest expert share: ([0-9.]+) at the first step -> ([0-9.]+) at the last", out)
    if path.name == "moe_router_losses.py" and "needs keras-hub" not in out:
        # Two favoured experts at first: the load-balancing loss evens the shares out.
        first, last = map(float, largest.groups())
        assert last < first - 0.03, out
        # keras-hub's per-layer value (padding counted) is ours per layer without a mask.
        theirs = float(re.search(r"keras-hub, per layer \(padding counted\): +([0-9.]+)", out).group(1))
        ours = float(re.search(r"ours, pool='layer', no mask: +([0-9.]+)", out).group(1))
        assert abs(theirs - ours) < 1e-3, out
    kl = re.search(r"reverse KL: ([0-9.]+) at the first step -> ([0-9.]+) at the last", out)
    if path.name == "on_policy_distillation.py" and "needs keras-hub" not in out:
        # 16 steps on the student's own samples: the per-token reverse KL to the teacher falls.
        first, last = map(float, kl.groups())
        assert last < 0.6 * first, out
        # Then Tinker's per-token advantages in a PolicyModel: the exact reverse KL of a held-out batch falls.
        tinker = re.search(
            r"tinker: reverse KL \(nats a token, held out\) ([0-9.]+) before \d+ steps -> ([0-9.]+)", out
        )
        before, after = map(float, tinker.groups())
        assert after < before, out
