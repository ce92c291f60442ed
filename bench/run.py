"""Runs the benchmarks on the current backend (KERAS_BACKEND) and writes
bench/results/<backend>.json and .md.

    make bench                 # every backend, one after another
    make bench BACKEND=jax     # one backend
    python -m bench.run --small --output /tmp/x   # the tiny smoke run the tests use

Times: ours and the reference alternate call by call in one process (a fresh
one per case), after warm-up, so both see the same machine state; the ratio
is of the medians. Where both sides do not fit in one process (the run is
killed for memory), each side is timed in two fresh processes of its own,
the processes in turn: one side's calls then do not alternate with the
other's (the row says so).
Memory: each side runs in a fresh subprocess; its peak resident memory above
what the inputs already take (Linux VmHWM, reset after building the inputs
and warming up) is the side's peak memory. On TensorFlow, whose CPU
allocator keeps what a call took, it is the first call's peak (tracing
included). On torch the child maps every buffer of 128 KiB or more on its
own (`MALLOC_MMAP_THRESHOLD_`), so that what glibc kept from earlier frees
does not move the reading. `python -m bench.run --memory-only [--only ...]`
measures the last report's memory again, its times kept.
"""

import argparse
import gc
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import keras
import numpy as np

from bench import native
from bench.cases import CASES

RESULTS = pathlib.Path(__file__).parent / "results"


def _status(field):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_memory(index, side, small):
    """Run in a subprocess: the side's peak memory above its inputs, in bytes."""
    work = CASES[index].build(small)[side]
    if native.BACKEND == "tensorflow":
        # TF's CPU allocator keeps what a call took (the RSS stays at the
        # call's peak): after a warm-up both sides would read ~0. The first
        # call's peak above the inputs is measured instead, its tracing
        # included (tens of MB).
        gc.collect()
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        baseline = _status("VmRSS")
        work()
        return max(_status("VmHWM") - baseline, 0)
    work()  # compile and warm up
    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    work()
    return max(_status("VmHWM") - baseline, 0)


class CaseFailed(RuntimeError):
    pass


def _child(args, tag, env=None):
    """Runs `python -m bench.run ARGS` in a fresh process (with `env` added
    to the environment); returns its TAG line's payload."""
    command = [sys.executable, "-m", "bench.run"] + args
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=pathlib.Path(__file__).parent.parent,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(tag + " ")]
    if result.returncode != 0 or not lines:
        if result.returncode == -9:
            reason = "killed (SIGKILL: out of memory on this machine)"
        else:
            tail = [line for line in result.stderr.strip().splitlines() if line.strip()][-1:]
            reason = f"exit status {result.returncode}" + (f": {tail[0][:200]}" if tail else "")
        raise CaseFailed(f"bench.run {' '.join(args)}: {reason}")
    return lines[-1][len(tag) + 1 :]


# On torch every buffer of 128 KiB or more is mapped and unmapped on its own:
# glibc's default threshold moves with what was freed before, so the same
# side read up to ×1.5 apart in fresh processes (bench/results/README.md).
_MEMORY_ENV = {"torch": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def measure_memory(index, side, small):
    args = ["--memory", str(index), side] + (["--small"] if small else [])
    return int(_child(args, "PEAK", _MEMORY_ENV.get(native.BACKEND, {})))


def timed(index, small, repeats, side=None):
    """Run in a subprocess: the case's alternating times (or, with `side`,
    that side's alone), and bytes processed."""
    work = CASES[index].build(small)
    sides = ("ours", "reference") if side is None else (side,)
    result = {"times": measure_time(work, repeats, sides), "bytes": work.get("bytes")}
    if CASES[index].flops:
        result["peak_flops"] = native.matmul_peak(small)
    return result


def _time_child(index, small, repeats, side=None):
    """`timed(...)` in a fresh process."""
    args = ["--time", str(index), str(repeats)] + (["--side", side] if side else []) + (["--small"] if small else [])
    return json.loads(_child(args, "TIMES"))


def _timed_apart(index, small, repeats):
    """Each side in two fresh processes of its own, the processes in turn
    (for cases whose sides do not fit in memory together)."""
    times = {"ours": [], "reference": []}
    for order in (("ours", "reference"), ("reference", "ours")):
        for side in order:
            result = _time_child(index, small, repeats, side)
            times[side] += result["times"][side]
    return {"times": times, "bytes": result["bytes"]}


def measure_time(work, repeats, sides=("ours", "reference")):
    for _ in range(2):
        for side in sides:
            work[side]()
    times = {side: [] for side in sides}
    for r in range(repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            work[side]()
            times[side].append((time.perf_counter() - start) / work.get("per", 1))
    return times


def machine():
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    versions = {"python": platform.python_version(), "keras": keras.__version__, "numpy": np.__version__}
    backend_module = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}[native.BACKEND]
    versions[backend_module] = __import__(backend_module).__version__
    if native.BACKEND == "jax":
        import optax

        versions["optax"] = optax.__version__
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "versions": versions,
    }


def measure(index, small, repeats, memory=True):
    """One case's report row, or a row saying why it could not be measured."""
    case = CASES[index]
    row = {"case": case.name, "reference_name": case.reference, "target": case.target, "repeats": repeats}
    try:
        # Each case runs in fresh processes, so no case inherits another's
        # allocations (TensorFlow's allocator keeps what it has used).
        try:
            result = _time_child(index, small, repeats)
        except CaseFailed as error:
            if "out of memory" not in str(error):
                raise
            result = _timed_apart(index, small, repeats)
            row["timed_apart"], row["repeats"] = True, 2 * repeats
        times, nbytes = result["times"], result["bytes"]
        for side in ("ours", "reference"):
            row[side] = {
                "median_s": statistics.median(times[side]),
                "min_s": min(times[side]),
                "max_s": max(times[side]),
                "peak_memory_bytes": measure_memory(index, side, small) if memory else None,
            }
    except CaseFailed as error:
        row["error"] = str(error)
        return row
    if nbytes:
        row["ours"]["gb_per_s"] = nbytes / row["ours"]["median_s"] / 1e9
        row["reference"]["gb_per_s"] = nbytes / row["reference"]["median_s"] / 1e9
    if case.flops:
        row["flops"], row["peak_flop_per_s"] = case.flops(small), result["peak_flops"]
        for side in ("ours", "reference"):
            row[side]["fraction_of_peak"] = row["flops"] / row[side]["median_s"] / row["peak_flop_per_s"]
    return _judged(row, case, small)


def remeasure_memory(index, small, row):
    """`row` (a report's row of case `index`) with both sides' peak memory
    measured again, and its ratios and verdict with them."""
    for side in ("ours", "reference"):
        row[side]["peak_memory_bytes"] = measure_memory(index, side, small)
    return _judged(row, CASES[index], small)


def _judged(row, case, small):
    """`row`'s ratios and whether it meets its case's targets."""
    row["time_ratio"] = row["ours"]["median_s"] / row["reference"]["median_s"]
    # The least-disturbed runs' ratio: on a noisy machine a second view.
    row["min_time_ratio"] = row["ours"]["min_s"] / row["reference"]["min_s"]
    ours_memory, ref_memory = row["ours"]["peak_memory_bytes"], row["reference"]["peak_memory_bytes"]
    row["memory_ratio"] = ours_memory / ref_memory if ours_memory is not None and ref_memory else None
    row["met"] = None if case.limit is None else row["time_ratio"] <= case.limit
    if case.memory_limit is not None:
        fits = row["memory_ratio"] is not None and row["memory_ratio"] <= case.memory_limit
        row["met"] = fits if row["met"] is None else row["met"] and fits
    if case.memory_floor and ours_memory is not None:
        row["memory_floor_bytes"] = case.memory_floor(small)
        row["floor_ratio"] = ours_memory / row["memory_floor_bytes"]
        fits = row["floor_ratio"] <= case.floor_limit
        row["met"] = fits if row["met"] is None else row["met"] and fits
    return row


def run(small, repeats, only, output, memory=True):
    """Measures the cases (those whose name contains `only`, if given) and
    rewrites the report after each one, so an interrupted run keeps what it
    measured. With `only`, the rows replace or join those of the last report."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / f"{native.BACKEND}.json"
    rows = []
    if only and path.exists():
        old = json.loads(path.read_text())
        # Rows keep the number of runs they were measured with.
        rows = [{"repeats": old["repeats"], **row} for row in old["cases"]]
    report = {"backend": native.BACKEND, "small": small, "repeats": repeats, "machine": machine(), "cases": rows}
    for index, case in enumerate(CASES):
        if only and not _selected(case.name, only):
            continue
        if case.backends is not None and native.BACKEND not in case.backends:
            continue  # a native peer of another backend
        row = measure(index, small, repeats, memory)
        print(_line(row), flush=True)
        rows[:] = _merge(rows, [row])
        _write(report, output)
    return report


def rerun_memory(only, output):
    """Measures the peak memory of the last report's rows (those whose name
    contains `only`, if given) again, at the report's own sizes, keeping
    their times, and rewrites the report after each one. A row whose memory
    child fails keeps its reading."""
    report = json.loads((output / f"{native.BACKEND}.json").read_text())
    rows = {row["case"]: row for row in report["cases"] if "error" not in row}
    for index, case in enumerate(CASES):
        if case.name not in rows or (only and not _selected(case.name, only)):
            continue
        try:
            remeasure_memory(index, report["small"], rows[case.name])
        except CaseFailed as error:
            print(f"{case.name}: memory not read again, the report's kept: {error}", flush=True)
            continue
        print(_line(rows[case.name]), flush=True)
        _write(report, output)
    return report


def _write(report, output):
    """The report as `<backend>.json` and `.md` in `output`."""
    (output / f"{native.BACKEND}.json").write_text(json.dumps(report, indent=2))
    (output / f"{native.BACKEND}.md").write_text(markdown(report))


def _selected(name, only):
    """`only` matches a name containing it; a trailing "$" makes it match only at the name's end."""
    return name.endswith(only[:-1]) if only.endswith("$") else only in name


def _merge(old_rows, new_rows):
    """The rows of both, new replacing old, in the order of CASES."""
    by_name = {row["case"]: row for row in old_rows + new_rows}
    return [by_name[case.name] for case in CASES if case.name in by_name]


def _mb(n):
    return f"{n / 2**20:.0f} MB" if n is not None else "–"


def _line(row):
    if "error" in row:
        return f"{row['case']:<44} not measured: {row['error']}"
    o, r = row["ours"], row["reference"]
    memory = "–" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"
    roofline = ""
    if "peak_flop_per_s" in row:
        roofline = f"  {o['fraction_of_peak']:.0%} of peak ({r['fraction_of_peak']:.0%})"
    if "floor_ratio" in row:
        roofline += f"  memory ×{row['floor_ratio']:.2f} of its floor"
    return (
        f"{row['case']:<44} ours {o['median_s'] * 1e3:9.2f} ms  ref {r['median_s'] * 1e3:9.2f} ms  "
        f"time ×{row['time_ratio']:.3f} (min ×{row['min_time_ratio']:.3f})  mem ×{memory}{roofline}  ({row['target']})"
    )


def markdown(report):
    m = report["machine"]
    runs_of = [row.get("repeats", report["repeats"]) for row in report["cases"]]
    usual = statistics.mode(runs_of) if runs_of else report["repeats"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [
        f"# Benchmarks: {report['backend']}",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; {versions}.",
        f"Median of {usual} alternating runs after warm-up (other counts are given by the case) "
        "(per step for fit cases); "
        "time ratio = ours / reference of the medians (the targets apply to it), and of the minima; "
        "peak memory is what each side adds above its inputs, in a fresh process.",
        "",
        "| case | reference | ours median (min–max) | reference median (min–max) | time ratio (of minima) "
        "| peak memory ours / ref | memory ratio | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["cases"]:
        if "error" in row:
            lines.append(
                f"| {row['case']} | {row['reference_name']} | not measured: {row['error']} | | | | | {row['target']} |"
            )
            continue
        o, r = row["ours"], row["reference"]
        memory = "–" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"
        met = "" if row["met"] is None else (" ✓" if row["met"] else " ✗")
        runs = row.get("repeats", report["repeats"])
        name = row["case"] if runs == usual else f"{row['case']} ({runs} runs)"
        if row.get("timed_apart"):
            name += (
                " (each side timed in two processes of its own, not alternating: together they do not fit in memory)"
            )
        lines.append(
            f"| {name} | {row['reference_name']} "
            f"| {o['median_s'] * 1e3:.2f} ms ({o['min_s'] * 1e3:.2f}–{o['max_s'] * 1e3:.2f}) "
            f"| {r['median_s'] * 1e3:.2f} ms ({r['min_s'] * 1e3:.2f}–{r['max_s'] * 1e3:.2f}) "
            f"| {row['time_ratio']:.3f} ({row['min_time_ratio']:.3f}) "
            f"| {_mb(o['peak_memory_bytes'])} / {_mb(r['peak_memory_bytes'])} | {memory} | {row['target']}{met} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default=None, help='run the cases whose name contains this ("...$": ends with it)')
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--memory-only", action="store_true", help="measure the last report's memory again")
    parser.add_argument("--memory", nargs=2, metavar=("INDEX", "SIDE"), help=argparse.SUPPRESS)
    parser.add_argument("--time", nargs=2, metavar=("INDEX", "REPEATS"), help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("ours", "reference"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time:
        print("TIMES", json.dumps(timed(int(args.time[0]), args.small, int(args.time[1]), args.side)))
        return
    if args.memory:
        print("PEAK", peak_memory(int(args.memory[0]), args.memory[1], args.small))
        return
    if args.memory_only:
        rerun_memory(args.only, args.output)
        return
    run(args.small, args.repeats, args.only, args.output)


if __name__ == "__main__":
    main()
