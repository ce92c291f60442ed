"""Trains the same models in one JAX process and in several (each with
several virtual CPU devices, joined by `keras.distribution.initialize`),
on the same global batches. Run by tests/test_multiprocess.py:

    KERAS_BACKEND=jax python -m tests.multiprocess_run one
    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python -m tests.multiprocess_run worker PORT PROCESS_ID PROCESSES

Each process feeds its own rows of every global batch (`DataParallel(...,
auto_shard_dataset=False)`: the global batch b is every process's b-th
batch, in process order) and prints one JSON line: the fit logs, the
weights, the monitor's probes and GradNorm's weights. The probe batch is
the same global rows in every process.

    python -m tests.multiprocess_run die     # exits at once with an error
"""

import json
import sys

if __name__ == "__main__" and sys.argv[1] == "die":
    sys.exit("this process dies at once, as a crashed peer would")

import keras  # noqa: E402

from keras_penalties import CompositeObjective, Term  # noqa: E402
from keras_penalties import losses as L  # noqa: E402
from keras_penalties import optimizers as opt  # noqa: E402
from keras_penalties import regularizers as R  # noqa: E402
from keras_penalties.callbacks import GradNorm, PenaltyMonitor  # noqa: E402
from tests import process_models  # noqa: E402
from tests.process_models import BATCH, LM_LABELS, LM_TOKENS, LM_WEIGHTS, X, Y, local_rows  # noqa: E402


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=R.L2(0.01), name="dense_a")(inputs)
    hidden = CompositeObjective(
        {"l2": Term("l2"), "ent": Term("entropy", options={"from_logits": True, "chunk_size": 2})},
        weighting="uncertainty",
        name="uobj",
    )(hidden)
    hidden = keras.layers.Dense(8, name="dense_b")(hidden)
    hidden = CompositeObjective(
        {
            "l1": Term("l1", 0.01),
            "l1_sum": Term("l1", 0.001, options={"reduction": "sum"}),
            "ent": Term("entropy", 0.05, options={"from_logits": True}),
            "off_policy": Term(process_models.off_policy_loss, 0.05),
            "next": Term(process_models.next_kinds_loss, 0.05),
        },
        name="obj",
    )(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden))
    loss = L.CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
        weighting="famo",
        name="closs",
    )
    optimizer = opt.ProximalDecay(
        opt.AdaptiveGradientClipping(keras.optimizers.SGD(0.05), clip_factor=0.05), R.L1(1e-3)
    )
    model.compile(optimizer, loss=loss)
    return model


def train(process, processes):
    model = build()
    probe = (X[:BATCH], Y[:BATCH])
    monitor = PenaltyMonitor(probe_data=probe, every_n_batches=2)
    gradnorm = GradNorm("obj", "dense_b", probe_data=probe, every_n_batches=2)
    x, y = local_rows(X, process, processes), local_rows(Y, process, processes)
    history = model.fit(
        x, y, batch_size=BATCH // processes, epochs=2, shuffle=False, verbose=0, callbacks=[gradnorm, monitor]
    )
    evaluation = model.evaluate(x, y, batch_size=BATCH // processes, verbose=0, return_dict=True)
    results = {f"history/{k}": v for k, v in history.history.items()}
    results.update({f"evaluate/{k}": v for k, v in evaluation.items()})
    results.update({f"weights/{i}": w.tolist() for i, w in enumerate(model.get_weights())})
    for i, entry in enumerate(monitor.history):
        results.update({f"probe{i}/{k}": v for k, v in entry.items()})
    for i, entry in enumerate(gradnorm.history):
        results[f"gradnorm{i}/weights"] = list(entry["weights"].values())
    return results


def train_distiller(process, processes, prefix):
    distiller = process_models.distiller(process_models.DISTILLER_CHUNKS[prefix])
    rows = [local_rows(a, process, processes) for a in (LM_TOKENS, LM_LABELS, LM_WEIGHTS)]
    history = distiller.fit(
        *rows[:2], sample_weight=rows[2], batch_size=BATCH // processes, epochs=2, shuffle=False, verbose=0
    )
    evaluation = distiller.evaluate(
        *rows[:2], sample_weight=rows[2], batch_size=BATCH // processes, verbose=0, return_dict=True
    )
    results = {f"{prefix}/history/{k}": v for k, v in history.history.items()}
    results.update({f"{prefix}/evaluate/{k}": v for k, v in evaluation.items()})
    results.update({f"{prefix}/weights/{i}": w.tolist() for i, w in enumerate(distiller.student.get_weights())})
    return results


def main(role, *args):
    process, processes = 0, 1
    if role == "worker":
        port, process, processes = int(args[0]), int(args[1]), int(args[2])
        keras.distribution.initialize(job_addresses=f"localhost:{port}", num_processes=processes, process_id=process)
        distribution = keras.distribution.DataParallel(
            devices=keras.distribution.list_devices(), auto_shard_dataset=False
        )
        keras.distribution.set_distribution(distribution)
    results = train(process, processes)
    for prefix in process_models.DISTILLER_CHUNKS:
        results.update(train_distiller(process, processes, prefix))
    results["devices"] = len(keras.distribution.list_devices())
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
