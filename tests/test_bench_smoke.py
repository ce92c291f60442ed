"""The benchmark harness runs every case once at tiny size, so it cannot rot.
This is not a benchmark: nothing here is timed against anything."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from bench import run, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("index", range(len(run.CASES)), ids=[case.name for case in run.CASES])
def test_every_case_runs_at_tiny_size(index):
    backends = run.CASES[index].backends
    if backends is not None and run.native.BACKEND not in backends:
        pytest.skip(f"a native peer of {', '.join(backends)} alone")
    result = run.timed(index, small=True, repeats=1)
    assert result["times"]["ours"][0] > 0 and result["times"]["reference"][0] > 0


def test_a_full_run_writes_its_report(tmp_path):
    # The real path: timing and memory each in a fresh subprocess.
    report = run.run(small=True, repeats=1, only="l1 1e+07", output=tmp_path)
    written = json.loads((tmp_path / f"{report['backend']}.json").read_text())
    (row,) = written["cases"]
    assert row["case"] == "l1 1e+07 elements" and row["reference_name"].startswith("one NumPy pass")
    assert row["ours"]["peak_memory_bytes"] >= 0 and row["ours"]["gb_per_s"] > 0
    assert (tmp_path / f"{report['backend']}.md").read_text().startswith("# Benchmarks")


def test_memory_only_measures_the_memory_again_and_keeps_the_times(tmp_path, monkeypatch):
    from bench import native

    run.run(small=True, repeats=1, only="l1 1e+07", output=tmp_path)
    (before,) = json.loads((tmp_path / f"{native.BACKEND}.json").read_text())["cases"]
    calls = []

    def peaks(args, tag, env=None):
        calls.append((tag, "--small" in args, env))
        return "1000" if "ours" in args else "4000"

    monkeypatch.setattr(run, "_child", peaks)
    # At the report's own sizes (small).
    report = run.rerun_memory(only=None, output=tmp_path)
    (row,) = json.loads((tmp_path / f"{native.BACKEND}.json").read_text())["cases"]
    assert row == report["cases"][0] and row["ours"]["median_s"] == before["ours"]["median_s"]
    assert (row["ours"]["peak_memory_bytes"], row["reference"]["peak_memory_bytes"], row["memory_ratio"]) == (
        1000,
        4000,
        0.25,
    )
    # torch's child maps every large buffer on its own (glibc's threshold
    # otherwise moves the reading); the others' children run as they are.
    mapped = {"MALLOC_MMAP_THRESHOLD_": "131072"} if native.BACKEND == "torch" else {}
    assert calls == [("PEAK", True, mapped), ("PEAK", True, mapped)]

    def killed(args, tag, env=None):
        raise run.CaseFailed("killed (SIGKILL: out of memory on this machine)")

    monkeypatch.setattr(run, "_child", killed)
    run.rerun_memory(only=None, output=tmp_path)
    (kept,) = json.loads((tmp_path / f"{native.BACKEND}.json").read_text())["cases"]
    assert kept == row  # a child that fails leaves the row as it was


def test_a_case_that_fails_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    def killed(args, tag, env=None):
        raise run.CaseFailed("killed (SIGKILL: out of memory on this machine)")

    monkeypatch.setattr(run, "_child", killed)
    report = run.run(small=True, repeats=1, only="elements", output=tmp_path)
    assert [row["case"] for row in report["cases"]] == [c.name for c in run.CASES if "elements" in c.name]
    assert all("out of memory" in row["error"] for row in report["cases"])
    assert "not measured: " in (tmp_path / f"{report['backend']}.md").read_text()


def test_sides_that_do_not_fit_together_are_timed_in_processes_of_their_own(tmp_path, monkeypatch):
    real, calls = run._child, []

    def together_out_of_memory(args, tag, env=None):
        calls.append(args)
        if tag == "TIMES" and "--side" not in args:
            raise run.CaseFailed("killed (SIGKILL: out of memory on this machine)")
        return real(args, tag, env)

    monkeypatch.setattr(run, "_child", together_out_of_memory)
    report = run.run(small=True, repeats=1, only="l1 1e+07", output=tmp_path)
    (row,) = report["cases"]
    assert row["timed_apart"] and "error" not in row and row["time_ratio"] > 0 and row["repeats"] == 2
    sides = [args[args.index("--side") + 1] for args in calls if "--side" in args]
    assert sides == ["ours", "reference", "reference", "ours"]
    assert "processes of its own" in (tmp_path / f"{report['backend']}.md").read_text()


def test_a_side_timed_alone_runs_only_that_side():
    index = next(i for i, case in enumerate(run.CASES) if case.name == "l1 1e+07 elements")
    work, calls = run.CASES[index].build(True), {"ours": 0, "reference": 0}

    def counting(side):
        def call():
            calls[side] += 1
            return work[side]()

        return call

    times = run.measure_time({**work, "ours": counting("ours"), "reference": counting("reference")}, 3, ("reference",))
    assert list(times) == ["reference"] and len(times["reference"]) == 3
    assert calls == {"ours": 0, "reference": 5}  # two warm-up calls, three timed


def test_rows_whose_peer_does_not_fit_are_marked_and_explained(tmp_path, monkeypatch):
    from bench import cases

    (backend, name), why = next(iter(cases.PEER_OUT_OF_MEMORY.items()))
    killed = {"case": name, "reference_name": "raw tf ops", "error": "killed (SIGKILL: out of memory on this machine)"}
    other = {**killed, "case": next(c.name for c in run.CASES if (backend, c.name) not in cases.PEER_OUT_OF_MEMORY)}
    report = {"machine": {"cpu": "cpu", "cores": 2}, "cases": [killed, other]}
    (tmp_path / f"{backend}.json").write_text(json.dumps(report))
    monkeypatch.setattr(summary, "RESULTS", tmp_path)
    text = summary.table()
    assert f"| {name} |" in text and "not measured‡" in text.split(f"| {name} |")[1].splitlines()[0]
    assert f"- ‡ {backend}, {name}: {why}." in text
    assert "not measured‡" not in text.split(f"| {other['case']} |")[1].splitlines()[0]


def test_only_with_a_trailing_dollar_matches_the_end_of_a_name():
    # A chunked LLM row's name is also the start of its "vs none" row's.
    names = [c.name for c in run.CASES]
    chunked = next(name for name in names if name + " vs none" in names)
    assert [name for name in names if run._selected(name, chunked)] == [chunked, chunked + " vs none"]
    assert [name for name in names if run._selected(name, chunked + "$")] == [chunked]


def test_the_summary_table_has_a_row_per_committed_case():
    text = summary.table()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert [row.split(" | ")[0][2:] for row in rows] == [case.name for case in run.CASES]


def test_the_ratio_chart_draws_every_measured_row(tmp_path):
    import json

    from bench import charts

    reports = {b: json.loads((summary.RESULTS / f"{b}.json").read_text()) for b in summary.BACKENDS}
    # A row one backend has not measured yet still has its line, from the others.
    dropped = reports["torch"]["cases"].pop(0)["case"]
    shown = charts.ratios(reports, run.CASES, tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = {row["case"] for report in reports.values() for row in report["cases"] if "error" not in row}
    assert shown == [case.name for case in run.CASES if case.name in measured] and dropped in shown


def test_a_roofline_row_reports_its_fraction_of_peak_and_its_memory_floor(tmp_path):
    from bench import charts
    from keras_penalties.ops._chunks import chunk_rows

    report = run.run(small=True, repeats=1, only="roofline: masked cross-entropy", output=tmp_path)
    (row,) = report["cases"]
    assert row["peak_flop_per_s"] > 0 and row["flops"] == 3 * 2.0 * 64 * 16 * 1000
    for side in ("ours", "reference"):
        expected = row["flops"] / row[side]["median_s"] / row["peak_flop_per_s"]
        np.testing.assert_allclose(row[side]["fraction_of_peak"], expected)
    # The returned gradients ([64, 16] and [16, 1000] float32) and one chunk's logits and their gradient.
    rows = chunk_rows("auto", 1000, 64, heads=True)
    assert row["memory_floor_bytes"] == 4 * (64 * 16 + 16 * 1000 + 2 * rows * 1000)
    np.testing.assert_allclose(row["floor_ratio"], row["ours"]["peak_memory_bytes"] / row["memory_floor_bytes"])
    shown = charts.roofline({report["backend"]: report}, run.CASES, tmp_path / "roofline.png")
    assert shown == [row["case"]] and (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_out_of_reach_measurements_run_at_tiny_size():
    # GradNorm's floor runs on every backend; the others are backend-specific
    # by what they measure: JAX's rows (a compiled program, the roofline's
    # parts), TF's (a graph) and torch's (its own products).
    from bench import native, out_of_reach

    assert isinstance(out_of_reach.gradnorm_floor(small=True, repeats=1), bool)
    if native.BACKEND == "jax":
        assert out_of_reach.jax_entropy_program(small=True)  # the same program at any size
        assert isinstance(out_of_reach.jax_roofline_parts(small=True, repeats=1), bool)
    elif native.BACKEND == "tensorflow":
        assert out_of_reach.tf_kl_ops(small=True)
        assert out_of_reach.tf_head_memory()  # from the committed results
    else:
        assert isinstance(out_of_reach.torch_logprob_products(small=True, repeats=1), bool)


def test_the_memory_sweep_runs_and_draws_at_tiny_size(tmp_path):
    from bench import memory_sweep

    points = []
    for path in memory_sweep.PATHS:
        memory_sweep._work(path, 64, hidden=8, vocab=100)()  # each of the three ways runs
        points.append({"tokens": 64, "path": path, "peak_bytes": 2**20})
    points.append({"tokens": 128, "path": memory_sweep.PATHS[2], "error": "out of memory on this machine"})
    report = {"backend": "jax", "hidden": 8, "vocab": 100, "points": points}
    memory_sweep.chart({"jax": report, "torch": report}, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The DPO study: both paths run, and its chart draws.
    points = []
    for path in memory_sweep.DPO_PATHS:
        memory_sweep._dpo_work(path, 64, small=True)()
        points.append({"tokens": 64, "path": path, "peak_bytes": 2**20})
    report = {"backend": "jax", "hidden": 8, "vocab": 100, "study": "dpo", "points": points}
    memory_sweep.chart({"jax": report}, tmp_path / "dpo.png")
    assert (tmp_path / "dpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_shown_out_of_reach_name_a_backend_and_a_case():
    # The summary marks these ✗† (or not measured‡) and explains them; a renamed case must not
    # silently drop its explanation.
    from bench import cases

    names = {case.name for case in run.CASES}
    for backend, name in list(cases.OUT_OF_REACH) + list(cases.PEER_OUT_OF_MEMORY):
        assert backend in summary.BACKENDS and name in names, (backend, name)


def test_sparse_recovery_runs_at_tiny_size():
    from bench import sparse_recovery

    rows = sparse_recovery.run(epochs=1, small=True)
    assert [r["setup"] for r in rows] == [s for s, variants in sparse_recovery.SETUPS.items() for _ in variants]
    for r in rows:
        assert 0.0 <= r["precision"] <= 1.0 and 0.0 <= r["recall"] <= 1.0 and r["steps"] == 7
    assert sparse_recovery.markdown(rows, 1).startswith("# Sparse recovery")


def test_chunking_measure_runs_at_tiny_size():
    from bench import chunking

    seconds, peak = chunking.measure("js β=0.5", 16, (40, 100), repeats=1)
    assert seconds > 0 and peak >= 0


def test_multitask_runs_at_tiny_size():
    from bench import multitask

    report = multitask.run(epochs=1, samples=128)
    assert [r["method"] for r in report["rows"]] == list(multitask.methods(None))
    for row in report["rows"]:
        assert set(row["relative"]) == set(multitask.TASKS) and row["step_seconds"] > 0
        assert all(w >= 0 for w in row["final_weights"].values())
    assert multitask.markdown(report).startswith("# Multi-task weighting")


def test_the_summary_imports_only_the_framework_of_its_results():
    # `make bench BACKEND=jax` then `python -m bench.summary` with no KERAS_BACKEND:
    # Keras' default backend is TensorFlow, which a JAX user may not have.
    script = (
        "import sys\nfrom bench import summary\nsummary.table()\n"
        "print(sorted(m for m in ('jax', 'tensorflow', 'torch') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "['jax']"  # the first backend with results


def test_the_hand_written_transforms_compute_what_the_wrappers_do():
    # The rows "… vs the clipping by hand" / "… centralization by hand"
    # compare speed with a peer's code (optax on JAX, timm's and the
    # paper's on torch): it must be the same math, or the ratio means
    # nothing. Ranks 1, 2 and 4 (optax treats rank 3 as multi-head).
    from bench import native
    from keras import ops

    from keras_penalties import backend
    from keras_penalties.optimizers import GradientCentralization

    rng = np.random.default_rng(0)
    shapes = [(6,), (7, 5), (2, 3, 4, 5), (4,)]
    weights = [rng.normal(size=s).astype("float32") for s in shapes[:-1]] + [np.zeros(4, "float32")]
    # Per-unit gradient scales from 1e-4 to 1: some units clipped, some not;
    # the last weight is 0 (a fresh bias): its limit is clip_factor·eps.
    grads = [rng.normal(size=s).astype("float32") * np.logspace(-4, 0, s[-1], dtype="float32") for s in shapes]

    def tensors(arrays):  # fresh tensors: torch's hand-written code works in place
        return [ops.convert_to_tensor(a.copy()) for a in arrays]

    ours = backend.unit_clip(tensors(grads), tensors(weights), 0.01, 1e-3)
    theirs = native.adaptive_clip(tensors(grads), tensors(weights), 0.01, 1e-3)
    for g, w, a, b in zip(grads, weights, ours, theirs):
        a, b = ops.convert_to_numpy(a), ops.convert_to_numpy(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
        # Which units the clip changed: each rank ≥ 2 tensor has both kinds,
        # and the zero weight's gradient is clipped.
        changed = np.any(~np.isclose(a, g, rtol=1e-6, atol=0), axis=tuple(range(g.ndim - 1)))
        if g.ndim > 1:
            assert changed.any() and not changed.all(), changed
        elif not w.any():
            assert changed.all()

    centralization = GradientCentralization("sgd")
    ours = [centralization._transform(g, None) for g in tensors(grads)]
    for a, b in zip(ours, native.centralize(tensors(grads))):
        np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(
    keras.backend.backend() == "torch", reason="torch traces nothing ahead of a call: the fingerprint is JAX's and TF's"
)
def test_the_graph_fingerprint_is_stable_and_tells_computations_apart():
    from bench import graph_fingerprint

    prints = {case: graph_fingerprint.fingerprint(case) for case in graph_fingerprint.CASES}
    assert prints["kl_on_logits"] == graph_fingerprint.fingerprint("kl_on_logits")  # traced again: the same
    assert len({str(p) for p in prints.values()}) == len(prints)  # three computations, three fingerprints
