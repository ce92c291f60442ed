"""Custom training loops in one TensorFlow process and in two
`MultiWorkerMirroredStrategy` workers on localhost, on the same global
batches. Run by tests/test_multiprocess.py:

    KERAS_BACKEND=tensorflow python -m tests.multiworker_run one
    KERAS_BACKEND=tensorflow python -m tests.multiworker_run worker PORT0 PORT1 INDEX

(Keras' own `fit` fails under this strategy in Keras 3.15, on a
`PerReplica` reduction: keras-team/keras#20585. A custom loop works.)

Each worker runs its own rows of every global batch through `strategy.run`:
a model with a `CompositeObjective` inside (its add_loss, scaled by the
replicas as `tf.nn.scale_regularization_loss` does), `compute` of a second
objective on the predictions (a masked token mean, which is the global
batch's), `ProximalDecay` around `AdaptiveGradientClipping`, and the fused
`Distiller.compute_loss` with uneven token masks. It prints one JSON line:
each step's global loss and term values, and the final weights.
"""

import json
import os
import sys

if __name__ == "__main__" and sys.argv[1] == "worker":
    port0, port1, index = sys.argv[2:5]
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port0}", f"localhost:{port1}"]},
            "task": {"type": "worker", "index": int(index)},
        }
    )

try:
    import torch  # noqa: F401  -- before TensorFlow, which crashes here otherwise
except ImportError:
    pass

import numpy as np  # noqa: E402

from tests import process_models  # noqa: E402
from tests.process_models import BATCH, LM_LABELS, LM_TOKENS, LM_WEIGHTS, MASK, X, Y, local_rows  # noqa: E402


def strategy_for(role):
    import tensorflow as tf

    if role == "worker":
        # Created before any other TF op, as the strategy requires.
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def regression(strategy, process, processes):
    import tensorflow as tf

    with strategy.scope():
        model, optimizer, head = process_models.regression()
    replicas = strategy.num_replicas_in_sync

    def replica_step(x, y, mask):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            base = tf.nn.compute_average_loss(tf.reduce_mean(tf.square(pred - y), axis=-1), global_batch_size=BATCH)
            added = tf.add_n(model.losses) / replicas
            total, values = head.compute({"pred": pred, "mask": mask})
            loss = base + added + total / replicas
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss, values["ent"] / replicas

    x, y, mask = (local_rows(a, process, processes) for a in (X, Y, MASK))
    per = BATCH // processes
    step = tf.function(lambda *batch: strategy.run(replica_step, args=batch))
    losses, entropies = [], []
    for epoch in range(2):
        for start in range(0, len(x), per):
            loss, entropy = step(*(tf.constant(a[start : start + per]) for a in (x, y, mask)))
            losses.append(float(strategy.reduce("SUM", loss, axis=None)))
            entropies.append(float(strategy.reduce("SUM", entropy, axis=None)))
    weights = {f"weights/{i}": np.asarray(v.numpy()).tolist() for i, v in enumerate(model.trainable_variables)}
    return {"losses": losses, "head/ent": entropies, **weights}


def distiller(strategy, process, processes, prefix):
    import tensorflow as tf

    with strategy.scope():
        model = process_models.distiller(process_models.DISTILLER_CHUNKS[prefix])
        model.optimizer.build(model.student.trainable_variables)

    def replica_step(tokens, labels, weights):
        with tf.GradientTape() as tape:
            # This replica's share of the one-process loss (Keras' convention: the replicas' gradients add up).
            loss = model.compute_loss(x=tokens, y=labels, sample_weight=weights)
        variables = model.student.trainable_variables
        model.optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    rows = [local_rows(a, process, processes) for a in (LM_TOKENS, LM_LABELS, LM_WEIGHTS)]
    per = BATCH // processes
    step = tf.function(lambda *batch: strategy.run(replica_step, args=batch))
    losses = []
    for epoch in range(2):
        for start in range(0, len(rows[0]), per):
            loss = step(*(tf.constant(a[start : start + per]) for a in rows))
            losses.append(float(strategy.reduce("SUM", loss, axis=None)))
    weights = {
        f"{prefix}/weights/{i}": np.asarray(v.numpy()).tolist() for i, v in enumerate(model.student.trainable_variables)
    }
    return {f"{prefix}/losses": losses, **weights}


def main(role, *args):
    strategy = strategy_for(role)
    process, processes = (int(args[2]), 2) if role == "worker" else (0, 1)
    results = regression(strategy, process, processes)
    for prefix in process_models.DISTILLER_CHUNKS:
        results.update(distiller(strategy, process, processes, prefix))
    results["replicas"] = strategy.num_replicas_in_sync
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
