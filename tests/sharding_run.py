"""Chunked ops and fused heads under JAX's `DataParallel` on two virtual CPU
devices, compiled as `jax.jit(value_and_grad)`: run by tests/test_sharding.py
in a subprocess (the device count is fixed when JAX starts).

Two setups: data-parallel (`DataParallel`, the batch split) and, for the
heads, vocabulary-parallel (`ModelParallel` on a (1, 2) mesh, the kernel
split on its vocabulary axis). Prints one JSON line: per setup and case,
the largest relative difference of the value and gradients from the
one-device run, the collectives of the compiled HLO (kind and operand
shapes), the sharding of each gradient, and the
temporaries of one device (`memory_analysis()`) beside those of the
one-device compilation at the same `chunk_size`, and the size of the
replicated arguments' gradients (each device's partial sums of them are
temporaries before their all-reduce).
"""

import json
import re
import sys

from tests.two_devices import before_keras

if __name__ == "__main__":
    before_keras(devices=int(sys.argv[1]) if len(sys.argv) > 1 else 2)

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from keras_penalties import ops as P  # noqa: E402

# 128 rows: 8 chunks, 4 per device. HIDDEN > CHUNK: a tied kernel's gradient is then
# summed in blocks of its rows on one device (backend/jax/blocks.py's add_kernel_grad).
BATCH, TOKENS, HIDDEN, VOCAB, CHUNK = 8, 16, 24, 64, 16
RNG = np.random.default_rng(0)
MASK = (RNG.uniform(size=(BATCH, TOKENS)) < np.linspace(0.3, 0.9, BATCH)[:, None]).astype("float32")
LABELS = RNG.integers(0, VOCAB, size=(BATCH, TOKENS)).astype("int32")


jnp_bfloat16 = ml_dtypes.bfloat16


def _normal(*shape, scale=1.0):
    return (scale * RNG.normal(size=shape)).astype("float32")


# name -> (loss of the differentiated arguments and the constants, differentiated args, constants)
CASES = {
    "kl_formed_logits": (
        lambda student, teacher, mask: P.kl_divergence(teacher, student, from_logits=True, mask=mask, chunk_size=CHUNK),
        [_normal(BATCH, TOKENS, VOCAB, scale=2.0)],
        [_normal(BATCH, TOKENS, VOCAB, scale=2.0), MASK],
    ),
    "entropy_formed_logits": (
        lambda logits, mask: P.entropy(logits, from_logits=True, mask=mask, chunk_size=CHUNK),
        [_normal(BATCH, TOKENS, VOCAB, scale=2.0)],
        [MASK],
    ),
    "cross_entropy_head": (
        lambda hidden, kernel, bias, labels, mask: P.cross_entropy(
            labels, P.linear(hidden, kernel, bias), mask=mask, chunk_size=CHUNK
        ),
        [_normal(BATCH, TOKENS, HIDDEN), _normal(HIDDEN, VOCAB), _normal(VOCAB, scale=0.1)],
        [LABELS, MASK],
    ),
    # Mixed precision: half-precision hidden states and kernel, each chunk's
    # logits in float32.
    "cross_entropy_head_bfloat16": (
        lambda hidden, kernel, labels, mask: P.cross_entropy(
            labels, P.linear(hidden, kernel), mask=mask, chunk_size=CHUNK
        ),
        [_normal(BATCH, TOKENS, HIDDEN).astype(jnp_bfloat16), _normal(HIDDEN, VOCAB).astype(jnp_bfloat16)],
        [LABELS, MASK],
    ),
    "kl_tied_heads": (
        lambda hidden, embedding, teacher_hidden, teacher_embedding, mask: P.kl_divergence(
            P.linear(teacher_hidden, teacher_embedding, transpose_kernel=True),
            P.linear(hidden, embedding, transpose_kernel=True),
            from_logits=True,
            temperature=2.0,
            mask=mask,
            chunk_size=CHUNK,
        ),
        [_normal(BATCH, TOKENS, HIDDEN), _normal(VOCAB, HIDDEN)],
        [_normal(BATCH, TOKENS, HIDDEN), _normal(VOCAB, HIDDEN), MASK],
    ),
}

_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?)\s(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\("
)
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def collectives(hlo):
    """Each collective of the compiled HLO as (kind, [operand shapes])."""
    found = []
    for result_type, kind in _COLLECTIVE.findall(hlo):
        shapes = [[int(d) for d in dims.split(",") if d] for dims in _SHAPE.findall(result_type)]
        found.append((kind, shapes))
    return found


def relative(a, b):
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _distribution(setup):
    """Keras' distribution, and where each argument goes: data-parallel,
    rows on the batch axis and kernels replicated; vocabulary-parallel (a
    (1, 2) mesh), kernels split on their vocabulary axis ([H, V] on axis
    1, a tied [V, H] and a bias on axis 0); both (a (2, 2) mesh of four
    devices), rows on the batch axis and kernels on the model axis."""
    from jax.sharding import PartitionSpec as Spec

    devices = keras.distribution.list_devices()
    if setup == "data_parallel":
        distribution = keras.distribution.DataParallel(devices=devices)
        return distribution, lambda a: Spec("batch") if a.shape[0] == BATCH else Spec()
    shape = (2, 2) if setup == "batch_and_vocabulary_parallel" else (1, 2)
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    distribution = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    )

    def spec(a):
        if a.shape[0] == BATCH:
            return Spec("batch")
        return Spec(None, "model") if a.shape[-1] == VOCAB and a.ndim == 2 else Spec("model")

    return distribution, spec


def run_case(setup, fn, args, constants):
    import jax
    from jax.sharding import NamedSharding

    differentiated = tuple(range(len(args)))
    step = jax.jit(jax.value_and_grad(fn, argnums=differentiated))
    one_compiled = step.lower(*args, *constants).compile()
    value, grads = one_compiled(*args, *constants)

    distribution, spec = _distribution(setup)
    mesh = distribution.device_mesh.backend_mesh
    placed = [jax.device_put(a, NamedSharding(mesh, spec(a))) for a in list(args) + list(constants)]
    with distribution.scope():
        compiled = jax.jit(jax.value_and_grad(fn, argnums=differentiated)).lower(*placed).compile()
    two_value, two_grads = compiled(*placed)
    return {
        "rel": max([relative(two_value, value)] + [relative(g2, g) for g2, g in zip(two_grads, grads)]),
        "collectives": collectives(compiled.as_text()),
        "grad_shardings": [str(g.sharding.spec) for g in two_grads],
        "temp_two": compiled.memory_analysis().temp_size_in_bytes,
        "temp_one": one_compiled.memory_analysis().temp_size_in_bytes,
        # The gradients of replicated arguments (a kernel, a bias), which
        # each device sums, in float32, before their all-reduce.
        "replicated_grad_bytes": sum(4 * a.size for a in args if a.shape[0] != BATCH),
    }


HEADS = ("cross_entropy_head", "cross_entropy_head_bfloat16", "kl_tied_heads")


def main(devices="2"):
    import jax

    assert len(jax.devices()) == int(devices), jax.devices()
    if devices == "4":
        report = {
            f"batch_and_vocabulary_parallel/{name}": run_case("batch_and_vocabulary_parallel", *CASES[name])
            for name in HEADS
        }
    else:
        report = {f"data_parallel/{name}": run_case("data_parallel", *case) for name, case in CASES.items()}
        report.update({f"vocabulary_parallel/{name}": run_case("vocabulary_parallel", *CASES[name]) for name in HEADS})
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
