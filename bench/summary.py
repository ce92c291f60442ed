"""Combines bench/results/<backend>.json into one markdown table (the
documentation's performance page, docs/performance.md).

    python -m bench.summary          # print it
    python -m bench.summary --page   # also put it in docs/performance.md, and
                                     # draw docs/bench_ratios.png (bench/charts.py)
                                     # docs/bench_roofline.png (bench/charts.py)
                                     # and docs/bench_memory.png, bench_preference_memory.png
                                     # (bench/memory_sweep.py)

The case list comes from bench.cases, which imports Keras: without a
KERAS_BACKEND it runs on the first backend that has results (JAX's results
alone import JAX, never TensorFlow, Keras' default backend).
"""

import json
import os
import pathlib
import sys

RESULTS = pathlib.Path(__file__).parent / "results"
PAGE = pathlib.Path(__file__).parent.parent / "docs" / "performance.md"
CHART = PAGE.parent / "bench_ratios.png"
MEMORY_CHART = PAGE.parent / "bench_memory.png"
PREFERENCE_MEMORY_CHART = PAGE.parent / "bench_preference_memory.png"
ROOFLINE_CHART = PAGE.parent / "bench_roofline.png"
MARKERS = ("<!-- bench-summary -->", "<!-- /bench-summary -->")
BACKENDS = ("jax", "tensorflow", "torch")


def table():
    reports = {b: json.loads((RESULTS / f"{b}.json").read_text()) for b in BACKENDS if (RESULTS / f"{b}.json").exists()}
    if not reports:
        raise SystemExit("No results yet: run `make bench` first.")
    os.environ.setdefault("KERAS_BACKEND", next(iter(reports)))
    from bench.cases import CASES, OUT_OF_REACH, PEER_OUT_OF_MEMORY

    first = next(iter(reports.values()))
    header = " | ".join(f"{b}: time (memory)" for b in reports)
    lines = [f"| case | reference | target | {header} |", "|---|---|---|" + "---|" * len(reports)]
    peers = ("optax / jax.nn", "raw tf ops", "torch.nn.functional")
    notes = []
    for case in CASES:
        cells, reference = [], case.reference
        for backend, report in reports.items():
            r = next((c for c in report["cases"] if c["case"] == case.name), None)
            if r is not None:
                reference = r["reference_name"]
            if r is None or "error" in r:
                measured_out = r is not None and "out of memory" in r["error"]
                mark = "‡" if measured_out and (backend, case.name) in PEER_OUT_OF_MEMORY else ""
                if mark:
                    notes.append(f"- ‡ {backend}, {case.name}: {PEER_OUT_OF_MEMORY[backend, case.name]}.")
                if r is None and case.backends is not None and backend not in case.backends:
                    cells.append("–")  # a peer of another backend's
                else:
                    cells.append("not run yet" if r is None else f"not measured{mark}")
                continue
            memory = "" if r["memory_ratio"] is None else f" ({r['memory_ratio']:.2f})"
            mark = "" if r["met"] is None else (" ✓" if r["met"] else " ✗")
            if r["met"] is False and (backend, case.name) in OUT_OF_REACH:
                mark += "†"
                notes.append(f"- † {backend}, {case.name}: {OUT_OF_REACH[backend, case.name]}.")
            cells.append(f"×{r['time_ratio']:.3f}{memory}{mark}")
        if len(reports) > 1 and reference in peers:
            reference = "native peer"
        lines.append(f"| {case.name} | {reference} | {case.target} | " + " | ".join(cells) + " |")
    machine = first["machine"]
    intro = (
        f"{machine['cpu']}, {machine['cores']} cores; ratio = ours / reference (lower is better), "
        "memory ratio in parentheses; ✓/✗ against the target; ✗†: missed in this run, "
        "and shown by a measurement to be out of reach or at the target by construction; "
        "not measured‡: the native peer alone does not fit in this machine's memory, so there is no ratio "
        "(both listed under the table)."
    )
    return intro + "\n\n" + "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


def main():
    text = table()
    print(text)
    if "--page" in sys.argv[1:]:
        page = PAGE.read_text()
        start, end = page.index(MARKERS[0]) + len(MARKERS[0]), page.index(MARKERS[1])
        PAGE.write_text(page[:start] + "\n" + text + "\n" + page[end:])
        from bench import charts
        from bench.cases import CASES

        reports = {
            b: json.loads((RESULTS / f"{b}.json").read_text()) for b in BACKENDS if (RESULTS / f"{b}.json").exists()
        }
        charts.ratios(reports, CASES, CHART)
        charts.roofline(reports, CASES, ROOFLINE_CHART)
        from bench import memory_sweep

        for prefix, chart in (("memory", MEMORY_CHART), ("memory_dpo", PREFERENCE_MEMORY_CHART)):
            sweeps = {b: RESULTS / f"{prefix}_{b}.json" for b in BACKENDS if (RESULTS / f"{prefix}_{b}.json").exists()}
            if sweeps:
                memory_sweep.chart({b: json.loads(p.read_text()) for b, p in sweeps.items()}, chart)


if __name__ == "__main__":
    main()
