"""Where chunking starts to pay: value + gradient of a masked KL / JS /
entropy from logits, unchunked and at several `chunk_size`s, on the current
backend. Writes bench/results/chunking_<backend>.{json,md}.

    KERAS_BACKEND=jax python -m bench.chunking [--shape 8192 32000] [--repeats 3] [--functions 'kl forward' ...]

Each chunk size runs in a fresh process (bench.run's memory probe: peak
resident memory above the inputs after warm-up); times are the median of
`repeats` calls after warm-up.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

from bench import native
from bench.cases import _LLM_FUNCTIONS, _tokens
from bench.run import RESULTS, _status, machine

CHUNKS = (None, 8192, 2048, 512, 128, 32)
FUNCTIONS = ("kl forward", "js β=0.5", "entropy")


def measure(name, chunk, shape, repeats):
    """In a fresh process: (median seconds, peak bytes above the inputs)."""
    import gc

    ours, _, count = _LLM_FUNCTIONS[name]
    args = _tokens(False, shape, count)
    fn = native.value_and_grad(ours(chunk))
    native.block(fn(*args))
    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        native.block(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(_status("VmHWM") - baseline, 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=(8192, 32000))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--functions", nargs="+", default=list(FUNCTIONS), choices=list(_LLM_FUNCTIONS))
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # name, chunk: the child process
    args = parser.parse_args()
    shape = tuple(args.shape)
    if args.one:
        chunk = None if args.one[1] == "none" else int(args.one[1])
        print("RESULT", json.dumps(measure(args.one[0], chunk, shape, args.repeats)))
        return
    rows = []
    for name in args.functions:
        for chunk in CHUNKS:
            command = [
                sys.executable,
                "-m",
                "bench.chunking",
                "--shape",
                *map(str, shape),
                "--repeats",
                str(args.repeats),
                "--one",
                name,
                str(chunk).lower(),
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
            row = {"function": name, "chunk_size": chunk}
            if lines:
                row["seconds"], row["peak_bytes"] = json.loads(lines[-1][7:])
            else:
                row["error"] = (
                    "killed (out of memory)" if result.returncode == -9 else f"exit status {result.returncode}"
                )
            print(row, flush=True)
            rows.append(row)
    report = {
        "backend": native.BACKEND,
        "shape": list(shape),
        "repeats": args.repeats,
        "machine": machine(),
        "rows": rows,
    }
    stem = RESULTS / f"chunking_{native.BACKEND}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# Chunk size against time and memory: {native.BACKEND}, {list(shape)} logits, 25 % of tokens masked",
        "",
        "Value + gradient; median of %d calls after warm-up; "
        "peak resident memory above the inputs, one fresh process per row." % args.repeats,
        "",
        "| function | chunk_size | time | × unchunked | peak memory above inputs | × unchunked |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.functions:
        base = next((r for r in rows if r["function"] == name and r["chunk_size"] is None and "error" not in r), None)
        for r in (r for r in rows if r["function"] == name):
            if "error" in r:
                lines.append(f"| {name} | {r['chunk_size'] or 'none'} | not measured: {r['error']} | | | |")
                continue
            t = f"{r['seconds'] / base['seconds']:.2f}" if base else "–"
            m = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base and base["peak_bytes"] else "–"
            lines.append(
                f"| {name} | {r['chunk_size'] or 'none'} | {r['seconds'] * 1e3:.0f} ms | {t} "
                f"| {r['peak_bytes'] / 2**20:.0f} MB | {m} |"
            )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
