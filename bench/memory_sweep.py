"""Peak memory against tokens, on the current backend, of two studies:

- `cross_entropy` (1 k–16 k tokens): masked cross-entropy value + gradient
  from hidden states [tokens, 256] through a [256, 128256] head, three
  ways: the fused head (`ops.linear` with `chunk_size="auto"`), our chunked
  call on the logits formed first, and the obvious peer (the logits formed,
  the backend's own cross-entropy on them): the chart Liger-Kernel's README
  leads with;
- `dpo` (1 k–8 k tokens a side): a DPO step from both sides' hidden states
  (bench/preference_cases.py), fused against the obvious path as TRL
  writes it.

    KERAS_BACKEND=torch python -m bench.memory_sweep [--study dpo] [--tokens 1024 2048 ...]

Each point is one fresh process (bench.run's peak memory above the inputs;
on TF the first call's peak, see bench/results/README.md); a point that
does not fit in this machine's memory is recorded as such. Writes
bench/results/memory_<backend>.json (memory_dpo_<backend>.json);
`python -m bench.summary --page` draws docs/bench_memory.png (and
docs/bench_preference_memory.png) from every backend's.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

from bench.run import RESULTS

TOKENS = (1024, 2048, 4096, 8192, 16384)
HIDDEN, VOCAB = 256, 128256
PATHS = ("fused head", "our chunked call on formed logits", "obvious peer")
DPO_PATHS = ("fused DPO step", "obvious DPO step (as TRL writes it)")
# study -> (tokens, paths, the result file's prefix)
STUDIES = {
    "cross_entropy": (TOKENS, PATHS, "memory"),
    "dpo": ((1024, 2048, 4096, 8192), DPO_PATHS, "memory_dpo"),
}


def _dpo_work(path, tokens, small=False):
    from bench import native, preference_cases

    args = preference_cases.inputs(small, tokens)
    fn = preference_cases.fused if path == DPO_PATHS[0] else preference_cases.obvious
    step = native.value_and_grads(fn, 3)
    return lambda: native.block(step(*args))


def _work(path, tokens, hidden=HIDDEN, vocab=VOCAB):
    if path in DPO_PATHS:
        return _dpo_work(path, tokens)
    import numpy as np
    from keras import ops

    from bench import native
    from keras_penalties import ops as P

    rng = np.random.default_rng(0)
    mask = ops.convert_to_tensor((rng.uniform(size=tokens) >= 0.25).astype("float32"))
    labels = ops.convert_to_tensor(rng.integers(0, vocab, size=tokens).astype("int32"))
    kernel = ops.convert_to_tensor((hidden**-0.5 * rng.standard_normal((hidden, vocab))).astype("float32"))
    hidden = ops.convert_to_tensor(rng.standard_normal((tokens, hidden), dtype=np.float32))
    losses = {
        PATHS[0]: lambda m, y, h, k: P.cross_entropy(y, P.linear(h, k), mask=m, chunk_size="auto"),
        PATHS[1]: lambda m, y, h, k: P.cross_entropy(y, native.matmul(h, k), mask=m, chunk_size="auto"),
        PATHS[2]: lambda m, y, h, k: native.masked_cross_entropy(m, y, native.matmul(h, k)),
    }
    step = native.value_and_grads(losses[path], 2)
    return lambda: native.block(step(mask, labels, hidden, kernel))


def child(path, tokens):
    """In a fresh process: the peak memory above the inputs, in bytes."""
    import gc

    from bench import native
    from bench.run import _status

    work = _work(path, tokens)
    if native.BACKEND != "tensorflow":
        work()  # compile and warm up; TF's allocator would keep this call's memory
    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    work()
    return max(_status("VmHWM") - baseline, 0)


def _point(path, tokens):
    command = [sys.executable, "-m", "bench.memory_sweep", "--child", path, str(tokens)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=pathlib.Path(__file__).parent.parent)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PEAK ")]
    if result.returncode == -9:
        return {"error": "out of memory on this machine"}
    if result.returncode != 0 or not lines:
        return {"error": f"exit status {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"}
    return {"peak_bytes": int(lines[-1].split()[1])}


def sweep(tokens, study="cross_entropy"):
    import keras

    backend = keras.backend.backend()
    _, paths, prefix = STUDIES[study]
    report = {"backend": backend, "hidden": HIDDEN, "vocab": VOCAB, "study": study, "points": []}
    for count in tokens:
        for path in paths:
            point = {"tokens": count, "path": path, **_point(path, count)}
            report["points"].append(point)
            shown = f"{point['peak_bytes'] / 2**20:.0f} MB" if "peak_bytes" in point else point["error"]
            print(f"{backend} {count:6d} tokens, {path}: {shown}", flush=True)
            (RESULTS / f"{prefix}_{backend}.json").write_text(json.dumps(report, indent=2))
    return report


def chart(reports, path):
    """Peak memory against tokens (a side's, for DPO), a panel per backend
    (`reports`: backend → report), into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 3.6), sharey=True, squeeze=False)
    for axis, (backend, report) in zip(axes[0], reports.items()):
        _, paths, _ = STUDIES[report.get("study", "cross_entropy")]
        for style, name in zip(("o-", "s--", "^:"), paths):
            points = [p for p in report["points"] if p["path"] == name and "peak_bytes" in p]
            axis.plot([p["tokens"] for p in points], [p["peak_bytes"] / 2**30 for p in points], style, label=name)
            failed = [p["tokens"] for p in report["points"] if p["path"] == name and "peak_bytes" not in p]
            if failed:
                axis.plot(failed, [0.0] * len(failed), "x", color="#c62828")
        axis.set_xscale("log", base=2)
        axis.set_title(backend)
        side = " a side" if report.get("study") == "dpo" else ""
        axis.set_xlabel(f"tokens{side} (H = {report['hidden']}, V = {report['vocab']})")
        axis.grid(color="#eeeeee")
    axes[0][0].set_ylabel("peak memory, value + gradient (GiB)")
    axes[0][-1].legend(fontsize=8, title="✕ out of memory", title_fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=sorted(STUDIES), default="cross_entropy")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--child", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("PEAK", child(args.child[0], int(args.child[1])))
        return
    os.environ.setdefault("KERAS_BACKEND", "jax")
    sweep(args.tokens or STUDIES[args.study][0], args.study)


if __name__ == "__main__":
    main()
