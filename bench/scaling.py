"""Per-device memory of a fused cross-entropy head (value + gradient, from
hidden states, `chunk_size`) on 1, 2 and 4 devices, beside the obvious path
(the logits formed, then a log-softmax and a pick, as optax or TRL write
it), read off the compiled program: `memory_analysis()` of
`jax.jit(value_and_grad)` on JAX virtual CPU devices, one fresh process per
device count (the count is fixed when JAX starts). Data-parallel: Keras'
`DataParallel`, the kernel replicated. Vocabulary-parallel: `ModelParallel`
on a (1, n) mesh with the [H, V] kernel sharded on V, or a tied [V, H]
embedding (`transpose_kernel=True`, keras-hub's layout) sharded on V.

    KERAS_BACKEND=jax python -m bench.scaling [--tokens 512] [--hidden 64] [--vocab 4096] [--chunk 16]

Writes bench/results/scaling_jax.{json,md} and the chart the docs show,
docs/scaling_jax.png. Per device: temporaries + outputs (the gradients) in
MB, and the largest operand any collective moves, in elements.
"""

import argparse
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

from bench.run import RESULTS

DOCS = pathlib.Path(__file__).parent.parent / "docs"
DEVICES = (1, 2, 4)
SETUPS = ("data-parallel", "vocabulary-parallel", "vocabulary-parallel, tied")
PATHS = ("fused", "obvious")
_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?)\s(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\("
)
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def child(devices, tokens, hidden, vocab, chunk):
    """In a process with `devices` virtual devices: {setup: {path: numbers}}."""
    import jax
    import keras
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Spec

    from keras_penalties import ops as P

    batch = 8
    rng = np.random.default_rng(0)
    h = rng.normal(size=(batch, tokens // batch, hidden)).astype("float32")
    kernel = (rng.normal(size=(hidden, vocab)) / np.sqrt(hidden)).astype("float32")
    labels = rng.integers(0, vocab, size=(batch, tokens // batch)).astype("int32")
    mask = (rng.uniform(size=labels.shape) < 0.8).astype("float32")

    def fused(h, kernel, labels, mask, tied=False):
        return P.cross_entropy(labels, P.linear(h, kernel, transpose_kernel=tied), mask=mask, chunk_size=chunk)

    def obvious(h, kernel, labels, mask, tied=False):
        jnp = jax.numpy
        logp = jax.nn.log_softmax(h @ (kernel.T if tied else kernel), axis=-1)
        picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    all_devices = keras.distribution.list_devices()
    report = {}
    for setup in SETUPS:
        tied = setup.endswith("tied")
        if setup == "data-parallel":
            distribution = keras.distribution.DataParallel(devices=all_devices)
            mesh = distribution.device_mesh.backend_mesh
            kernel_spec = Spec()
        else:
            device_mesh = keras.distribution.DeviceMesh((1, devices), ["batch", "model"], all_devices)
            layout_map = keras.distribution.LayoutMap(device_mesh)
            distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
            mesh = device_mesh.backend_mesh
            kernel_spec = Spec("model", None) if tied else Spec(None, "model")
        rows = NamedSharding(mesh, Spec("batch"))
        placed = [
            jax.device_put(h, rows),
            jax.device_put(kernel.T.copy() if tied else kernel, NamedSharding(mesh, kernel_spec)),
            jax.device_put(labels, rows),
            jax.device_put(mask, rows),
        ]
        report[setup] = {}
        for name, fn in (("fused", fused), ("obvious", obvious)):
            with distribution.scope():
                step = jax.value_and_grad(functools.partial(fn, tied=tied), argnums=(0, 1))
                compiled = jax.jit(step).lower(*placed).compile()
            memory = compiled.memory_analysis()
            moved = [
                int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                for result_type, kind in _COLLECTIVE.findall(compiled.as_text())
                for dims in _SHAPE.findall(result_type)
            ]
            report[setup][name] = {
                "temp_mb": memory.temp_size_in_bytes / 2**20,
                "output_mb": memory.output_size_in_bytes / 2**20,
                "largest_collective_elements": max(moved, default=0),
            }
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    sizes = (args.tokens, args.hidden, args.vocab, args.chunk)
    if args.devices:
        print(json.dumps(child(args.devices, *sizes)))
        return
    results = {}
    for devices in DEVICES:
        env = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        command = [sys.executable, "-m", "bench.scaling", "--devices", str(devices)] + [
            f"--{k}={v}" for k, v in zip(("tokens", "hidden", "vocab", "chunk"), sizes)
        ]
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).parent.parent
        )
        results[devices] = json.loads(done.stdout.strip().splitlines()[-1])
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "scaling_jax.json").write_text(
        json.dumps({"sizes": dict(zip(("tokens", "hidden", "vocab", "chunk"), sizes)), "results": results}, indent=1)
    )
    lines = [
        f"Per-device memory of cross-entropy value + gradient from hidden states, {args.tokens} tokens, "
        f"H = {args.hidden}, V = {args.vocab}, chunk_size={args.chunk} (fused), JAX virtual CPU devices "
        "(`python -m bench.scaling`).",
        "",
        "| devices | setup | path | temporaries MB | outputs MB | largest collective (elements) |",
        "|---|---|---|---|---|---|",
    ]
    for devices, report in results.items():
        for setup in SETUPS:
            for path in PATHS:
                r = report[setup][path]
                lines.append(
                    f"| {devices} | {setup} | {path} | {r['temp_mb']:.2f} | {r['output_mb']:.2f} "
                    f"| {r['largest_collective_elements']} |"
                )
    (args.output / "scaling_jax.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, DOCS / "scaling_jax.png", sizes)


def plot(results, path, sizes):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, len(SETUPS), figsize=(13, 3.8), sharey=True)
    devices = list(results)
    for ax, setup in zip(axes, SETUPS):
        for path_name, style in zip(PATHS, ("o-", "s--")):
            ax.plot(
                devices,
                [results[d][setup][path_name]["temp_mb"] + results[d][setup][path_name]["output_mb"] for d in devices],
                style,
                label=path_name,
            )
        ax.set_title(setup)
        ax.set_xlabel("devices")
        ax.set_xticks(devices)
        ax.legend()
    axes[0].set_ylabel("MB per device\n(temporaries + gradients)")
    tokens, hidden, vocab, chunk = sizes
    figure.suptitle(
        f"Cross-entropy from hidden states, value + gradient: {tokens} tokens, H={hidden}, V={vocab}, chunk {chunk}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
