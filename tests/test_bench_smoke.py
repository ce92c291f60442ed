"""The benchmark harness runs every case once at tiny size, so it cannot rot.
This is not a benchmark: nothing here is timed against anything."""

import json

from bench import run


def test_every_case_runs_at_tiny_size(tmp_path):
    report = run.run(small=True, repeats=1, only=None, output=tmp_path, memory=False)
    written = json.loads((tmp_path / f"{report['backend']}.json").read_text())
    assert [row["case"] for row in written["cases"]] == [case.name for case in run.CASES]
    for row in written["cases"]:
        assert row["ours"]["median_s"] > 0 and row["reference"]["median_s"] > 0
    assert (tmp_path / f"{report['backend']}.md").read_text().startswith("# Benchmarks")


def test_memory_is_measured_in_a_subprocess():
    index = next(i for i, case in enumerate(run.CASES) if case.name.startswith("l1 "))
    assert run.measure_memory(index, "ours", small=True) >= 0
