"""The measurements behind `bench.cases.OUT_OF_REACH`'s rows (those that
rest on a count of products say so there), rerunnable (issue 45): each
prints what it compares and exits 1 if the claim no longer holds.

    KERAS_BACKEND=jax python -m bench.out_of_reach          # entropy's programs; roofline parts; GradNorm's floor
    KERAS_BACKEND=tensorflow python -m bench.out_of_reach   # KL value+grad ops; cross-entropy head memory
    KERAS_BACKEND=torch python -m bench.out_of_reach        # token_logprobs' products

- JAX, entropy value [8192, 32000]: XLA's optimized HLO of ours and of the
  peer (`bench.native.entropy`), with every name, id and metadata removed,
  compared instruction by instruction. The same program runs the same
  machine code: a time ratio off 1 is noise.
- JAX, the roofline rows (≤ 1.25 × the products whole): the fused
  cross-entropy beside its three products whole, the same products a chunk
  of rows at a time as the fused head forms them, and each chunk's softmax
  and gradient alone. Where the chunked products and the softmax work
  alone already exceed 1.25 × the whole products, no chunked head reaches
  the target on this machine (larger chunks were measured slower: 64, 128
  and 256 rows took 3.7, 4.0 and 4.4 s).
- JAX, GradNorm at every batch (≤ 2× the step without it): a callback
  that only assigns one variable per batch, and the probe's forward pass
  and loss with one gradient (GradNorm takes one a term), each against the
  plain step of the row's model. Their sum is what GradNorm cannot go
  below: it does both (and one step of its weights' optimizer, which
  rides in the probe's compiled call). On torch, whose row is missed but
  not out of reach, it also times GradNorm in a fit beside a callback
  that does its measurement and optimizer step alone: what its weights'
  math costs (`KERAS_BACKEND=torch python -c "from bench import
  out_of_reach; out_of_reach.gradnorm_floor()"`).
- torch, token_logprobs from hidden states against the logits formed
  first (≤ 1.10): the 4 products the fused call forms a chunk of rows at a
  time (its backward forms each chunk's logits again: per-position values
  get their upstream gradient only there) against the row's reference,
  whole (and its 3 products whole, for scale). Where those 4 alone exceed
  1.10 × the reference, no call chunked so reaches the target (JAX's and
  TF's rows rest on the count, 4/3, alone).
- TF, kl_divergence value+grad [8192, 32000]: the ops of both traced
  graphs (value and gradient) whose output is a [rows, classes] tensor,
  counted by type. Where the counts are the same, the two sides make the
  same passes over the 1 GB tensors and differ only on per-row vectors.
- TF, masked cross-entropy from hidden states (memory ≤ 0.10 of raw TF's
  fused op): the target in bytes, from the peer's measured peak in
  `bench/results/tensorflow.json`, against the kernel's gradient that both
  sides return (V·H float32 values): no implementation can use less memory
  than its output.
"""

import collections
import json
import pathlib
import re
import sys

import numpy as np

from bench import native
from bench.cases import _HEAD_NAME, HEAD_SHAPE, _logits, _ours_entropy, _ours_kl

RESULTS = pathlib.Path(__file__).parent / "results"


def _canonical_hlo(text):
    """HLO instructions with names, ids and metadata removed: what runs."""
    lines = []
    # The source tables (file and function names, stack frames) say where
    # each op was written, not what runs.
    tables = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    blocks = [b for b in text.split("\n\n") if not b.strip().startswith(tables)]
    for line in "\n".join(blocks).splitlines():
        line = re.sub(r", metadata=\{[^}]*\}", "", line.strip())
        line = re.sub(r"%[\w.\-]+", "%", line)
        line = re.sub(r"\b(fused_computation|region|wrapped|fusion|ENTRY|HloModule)[\w.\-]*", r"\1", line)
        line = re.sub(r"HloModule [\w.\-]+", "HloModule", line)
        line = re.sub(r"\b[A-Za-z_][\w\-]*\.\d+\b", "#", line)  # numbered names (parameters, reductions)
        if line and not line.startswith("//"):
            lines.append(line)
    return lines


def jax_entropy_program(small=False):
    import jax

    args = _logits(small, 1)
    texts = [jax.jit(fn).lower(*args).compile().as_text() for fn in (_ours_entropy, native.entropy)]
    ours, peer = (_canonical_hlo(t) for t in texts)
    same = ours == peer
    print(
        f"entropy value {tuple(args[0].shape)}: optimized HLO, {len(ours)} vs {len(peer)} instructions; "
        f"the same but for names: {same}"
    )
    if not same:
        for a, b in zip(ours, peer):
            if a != b:
                print("  first difference:\n   ours:", a, "\n   peer:", b)
                break
    return same


def jax_roofline_parts(small=False, repeats=5):
    """JAX's fused cross-entropy from hidden states beside its three
    products whole, the same products a chunk of rows at a time (a scan, as
    the fused head runs them, at the rows "auto" picks), and each chunk's
    softmax and its gradient on logits already formed; alternating, medians.
    Holds if the chunked products and the softmax work alone already take
    more than 1.25 × the whole products."""
    import statistics

    import jax
    import jax.numpy as jnp

    from bench.roofline_cases import SHAPE
    from bench.run import measure_time
    from keras_penalties import ops as P
    from keras_penalties.ops._chunks import chunk_rows

    tokens, hidden, vocab = (64, 16, 1000) if small else SHAPE
    rows = chunk_rows("auto", vocab, tokens, heads=True)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((tokens, hidden), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((hidden, vocab), dtype=np.float32) * hidden**-0.5)
    y = jnp.asarray(rng.integers(0, vocab, tokens).astype("int32"))
    m = jnp.asarray((rng.uniform(size=tokens) >= 0.25).astype("float32"))
    c = jnp.asarray(rng.standard_normal((tokens, vocab), dtype=np.float32) * 1e-3)
    chunks = tokens // rows

    def fused(h, k):
        return P.cross_entropy(y, P.linear(h, k), mask=m, chunk_size="auto")

    def chunk_products(dk, xs):
        hc, gc = xs
        return dk + hc.T @ gc, (gc @ k.T, jnp.sum((hc @ k)[:, :1]))

    def chunk_softmax(total, xs):
        z, labels, w = xs

        def value(z):
            logp = jax.nn.log_softmax(z)
            return jnp.sum(w * -jnp.take_along_axis(logp, labels[:, None], 1)[:, 0])

        v, g = jax.value_and_grad(value)(z)
        return total + v + jnp.sum(g[:, :1]), None

    logits = jnp.asarray(rng.standard_normal((chunks, rows, vocab), dtype=np.float32))
    sides = {
        "fused head": (jax.jit(jax.value_and_grad(fused, argnums=(0, 1))), (h, k)),
        "its 3 products, whole": (jax.jit(jax.value_and_grad(lambda h, k: jnp.sum((h @ k) * c), (0, 1))), (h, k)),
        f"the 3 products, {chunks} chunks of {rows} rows": (
            jax.jit(
                lambda h: jax.lax.scan(
                    chunk_products, jnp.zeros_like(k), (h.reshape(chunks, rows, -1), c.reshape(chunks, rows, -1))
                )
            ),
            (h,),
        ),
        f"softmax + its gradient, {chunks} chunks": (
            jax.jit(
                lambda z: jax.lax.scan(chunk_softmax, 0.0, (z, y.reshape(chunks, rows), m.reshape(chunks, rows)))[0]
            ),
            (logits,),
        ),
    }

    def blocked(fn, args):
        return lambda: jax.block_until_ready(fn(*args))

    work = {name: blocked(fn, args) for name, (fn, args) in sides.items()}
    medians = {name: statistics.median(t) for name, t in measure_time(work, repeats, tuple(work)).items()}
    whole = medians["its 3 products, whole"]
    for name, t in medians.items():
        print(f"  {name:42s} {t * 1e3:8.0f} ms  ×{t / whole:.3f} of the whole products")
    floor = sum(t for name, t in medians.items() if "chunks" in name) / whole
    print(
        f"roofline cross-entropy [{tokens}×{hidden} → {vocab}]: chunked products + softmax work = ×{floor:.3f} "
        "of the whole products (target 1.25)"
    )
    return floor > 1.25


def gradnorm_floor(small=False, repeats=5):
    """What a step with `GradNorm(every_n_batches=1)` cannot go below on
    this backend, on the GradNorm row's model (`bench.multitask`), each part
    against the plain step: a callback that only assigns one variable per
    batch (on JAX, Keras syncs the whole training state out and back in for
    it; everywhere it makes Keras dispatch batch ends synchronously); and
    the probe's forward pass and loss on the fixed batch with one gradient,
    of the terms' sum, over the layer's weights (GradNorm takes one per
    term: at least one backward pass). Holds if the parts together exceed
    the row's target (×2). GradNorm's own probe, with the weights' step in
    its call, is timed beside them; and on torch, in fits beside the plain
    one, GradNorm and a callback that does its measurement and one step of
    an optimizer of its own on the norms but none of GradNorm's weights'
    math (the formula, the guard, the clipping, reading and setting the
    target's weights): what that math costs inside a fit."""
    import statistics

    import keras

    from bench import multitask
    from bench.run import measure_time
    from keras_penalties import gradients
    from keras_penalties.callbacks import GradNorm

    class AssignOne(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            weights = self.model.loss.term_weights  # reading .model syncs the state
            weights.assign(weights.value)

    class MeasureAndStep(keras.callbacks.Callback):
        """GradNorm's probe without its update, then Adam on the norms."""

        def on_train_batch_end(self, batch, logs=None):
            model = self.model  # reading .model syncs the state
            if not hasattr(self, "probe"):
                gradnorm = GradNorm("tasks", "trunk_2", probe_data=probe_data)
                gradnorm.set_model(model)
                self.probe = gradnorm._measurement(model)
                self.data = gradnorm.probe_data
                self.weights = keras.Variable(np.ones(len(multitask.TASKS), "float32"))
                self.optimizer = keras.optimizers.Adam(0.025)
                self.optimizer.build([self.weights])
            _, norms = self.probe(*self.data)
            self.optimizer.apply([keras.ops.convert_to_tensor(norms)], [self.weights])

    steps = 4 if small else 256
    (x, y), _ = multitask.problem(multitask.BATCH * steps)
    probe_data = (x[: multitask.BATCH], y[: multitask.BATCH])

    def fit(callbacks):
        model = multitask.build()
        return lambda: model.fit(
            x, y, batch_size=multitask.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
        )

    callbacks = {"plain": [], "one assignment a batch": [AssignOne()]}
    if native.BACKEND == "torch":
        # Eager torch makes the same calls but for the weights' math. On JAX
        # and TF the weights' step rides in the probe's compiled call: a call
        # of its own costs more than the math.
        callbacks["GradNorm"] = [GradNorm("tasks", "trunk_2", probe_data=probe_data)]
        callbacks["its measurement and step alone"] = [MeasureAndStep()]
    fits = {name: fit(c) for name, c in callbacks.items()}
    step = {
        name: statistics.median(t) for name, t in measure_time({**fits, "per": steps}, repeats, tuple(fits)).items()
    }
    gradnorm = GradNorm("tasks", "trunk_2", probe_data=probe_data)
    model = multitask.build()
    model.fit(*probe_data, epochs=1, verbose=0, callbacks=[gradnorm])
    probe = gradnorm._probe()
    summed = gradients.parameter_probe(
        model,
        lambda x, y: [sum(probe._outputs(x, y))],
        1,
        variables=list(gradnorm.layer.trainable_weights),
    )
    parts = {
        "GradNorm's probe and step": lambda: probe(*gradnorm.probe_data),
        "forward, loss, one gradient": lambda: summed(*gradnorm.probe_data),
    }
    seconds = {
        name: statistics.median(t) for name, t in measure_time(parts, 10 if small else 200, tuple(parts)).items()
    }
    plain = step["plain"]
    sync = step["one assignment a batch"] / plain
    floor = sync + seconds["forward, loss, one gradient"] / plain
    print(
        f"GradNorm's row, {native.BACKEND}: plain step {plain * 1e3:.3f} ms; with one assignment a batch ×{sync:.2f}; "
        + "; ".join(f"{name} ×{t / plain:.2f}" for name, t in seconds.items())
        + f" of a step: at least ×{floor:.2f} (target 2)"
        + "".join(f"; in a fit, {name} ×{step[name] / plain:.2f}" for name in tuple(callbacks)[2:])
    )
    return floor > 2.0


def torch_logprob_products(small=False, repeats=3):
    """torch's per-position log-probabilities from hidden states against
    the logits formed first (time ≤ 1.10): the row's reference itself (our
    chunked call on the formed logits, value and gradients), its 3 products
    whole (the logits, then the hidden states' and the kernel's gradients)
    and the 4 products the fused call cannot avoid, formed a chunk of rows
    at a time at the rows "auto" picks (its forward loop forms each chunk's
    logits, its backward loop forms them again, then both gradients);
    alternating, medians. Holds if those 4 chunked products alone take more
    than 1.10 × the whole reference (4/3 of its products by count, before
    what chunks cost)."""
    import statistics

    import torch

    from bench import rl_cases
    from bench.run import measure_time
    from keras_penalties.ops._chunks import chunk_rows

    args = rl_cases._inputs(small)
    *_, h, k = args
    tokens, vocab = h.shape[0], k.shape[1]
    rows = chunk_rows("auto", vocab, tokens, heads=True)
    g = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(0)) * 1e-3

    def whole():
        return h @ k, g @ k.T, h.T @ g

    def chunked():
        kernel_gradient = torch.zeros_like(k)
        for start in range(0, tokens, rows):
            hc, gc = h[start : start + rows], g[start : start + rows]
            hc @ k  # the forward loop's logits
            hc @ k  # formed again in the backward loop
            gc @ k.T
            kernel_gradient.addmm_(hc.T, gc)
        return kernel_gradient

    formed = native.value_and_grads(rl_cases._LOGPROBS["formed"], 2)
    reference = "the reference (formed logits, our call)"
    fused = f"the fused call's 4 products, {tokens // rows} chunks"
    sides = {reference: lambda: native.block(formed(*args)), "its 3 products, whole": whole, fused: chunked}
    medians = {name: statistics.median(t) for name, t in measure_time(sides, repeats, tuple(sides)).items()}
    for name, t in medians.items():
        print(f"  {name:52s} {t * 1e3:8.0f} ms  ×{t / medians[reference]:.3f} of the reference")
    ratio = medians[fused] / medians[reference]
    print(
        f"token_logprobs value+grad from hidden states [{tokens}×{h.shape[1]} → {vocab}] vs logits formed first, "
        f"torch ({rows}-row chunks): the fused call's products alone ×{ratio:.3f} of the reference (target 1.10)"
    )
    return ratio > 1.10


def _big_ops(fn, args, shape):
    import tensorflow as tf

    @tf.function
    def run(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs[-1])
            value = fn(*xs)
        return value, tape.gradient(value, xs[-1])

    graph = run.get_concrete_function(*args).graph
    counts = collections.Counter()
    for op in graph.get_operations():
        if any(tuple(out.shape) == shape for out in op.outputs) and op.type not in ("Placeholder", "Identity"):
            counts[op.type] += 1
    return counts


def tf_kl_ops(small=False):
    args = _logits(small, 2)
    shape = tuple(args[0].shape)
    ours, peer = _big_ops(_ours_kl, args, shape), _big_ops(native.kl, args, shape)
    same = ours == peer
    print(f"kl_divergence value+grad {shape}: ops with a {list(shape)} output")
    print(f"  ours: {dict(sorted(ours.items()))}")
    print(f"  peer: {dict(sorted(peer.items()))}")
    print(f"  the same: {same}")
    return same


def tf_head_memory(results=RESULTS / "tensorflow.json"):
    name = _HEAD_NAME.format("cross-entropy")
    rows = {row["case"]: row for row in json.loads(pathlib.Path(results).read_text())["cases"]}
    peer = rows[name]["reference"]["peak_memory_bytes"]
    _, hidden, vocab = HEAD_SHAPE
    kernel_gradient = hidden * vocab * np.dtype("float32").itemsize
    target = 0.10 * peer
    print(
        f"{name}: target 0.10 × the peer's {peer / 2**20:.0f} MiB = {target / 2**20:.0f} MiB; "
        f"the kernel's gradient alone, returned by both sides: {kernel_gradient / 2**20:.0f} MiB"
    )
    return target < kernel_gradient


def main():
    checks = {
        "jax": [jax_entropy_program, jax_roofline_parts, gradnorm_floor],
        "tensorflow": [tf_kl_ops, tf_head_memory],
        "torch": [torch_logprob_products],
    }.get(native.BACKEND, [])
    if not checks:
        print(f"No out-of-reach rows on {native.BACKEND}.")
    held = [check() for check in checks]
    sys.exit(0 if all(held) else 1)


if __name__ == "__main__":
    main()
