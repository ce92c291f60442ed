"""Custom torch training loops in one process and in two processes joined by
`torch.distributed` (gloo, localhost), on the same global batches. Run by
tests/test_multiprocess.py:

    KERAS_BACKEND=torch python -m tests.ddp_run one
    KERAS_BACKEND=torch python -m tests.ddp_run worker PORT RANK

Each process runs its own rows of every global batch. The regression model
(a `CompositeObjective` inside, `compute` of a second objective on the
predictions, `ProximalDecay` around `AdaptiveGradientClipping`) is wrapped
in `DistributedDataParallel`, which averages the processes' gradients; the
fused `Distiller.compute_loss` runs on the Distiller itself, its gradients
averaged by hand as DDP does. Keras 3.15 has no torch distribution: each
process's values are its own rows', so the terms here are per-sample and
per-token means over shards that keep equal numbers of rows and tokens,
which DDP's average makes the global ones. It prints one JSON line: each
step's loss averaged over the processes, and the final weights.
"""

import json
import os
import sys

import numpy as np

from tests import process_models
from tests.process_models import BATCH, LM_LABELS, LM_TOKENS, TOKENS, X, Y, local_rows

# Token and row masks that keep the same number in each half of every global
# batch (each process's rows): DDP's average of the processes' means is then
# the global mean.
_RNG = np.random.default_rng(9)
MASK = np.zeros(32, "float32")
LM_WEIGHTS = np.zeros((32, TOKENS), "float32")
for half in range(0, 32, 4):
    MASK[half + _RNG.permutation(4)[:3]] = 1.0
    LM_WEIGHTS[half : half + 4].reshape(-1)[_RNG.permutation(4 * TOKENS)[:10]] = 1.0


def _average(values, processes):
    import torch

    if processes > 1:
        for value in values:
            torch.distributed.all_reduce(value)
            value /= processes
    return values


def regression(process, processes):
    import keras
    import torch

    model, optimizer, head = process_models.regression()
    forward = torch.nn.parallel.DistributedDataParallel(model) if processes > 1 else model
    x, y, mask = (torch.tensor(local_rows(a, process, processes)) for a in (X, Y, MASK))
    per = BATCH // processes
    losses, entropies = [], []
    for epoch in range(2):
        for start in range(0, len(x), per):
            rows = slice(start, start + per)
            pred = forward(x[rows])
            total, values = head.compute({"pred": pred, "mask": mask[rows]})
            loss = torch.mean(torch.square(pred - y[rows])) + sum(model.losses) + total
            loss.backward()
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
            for v in variables:
                v.value.grad = None
            losses.append(float(_average([loss.detach().clone()], processes)[0]))
            entropies.append(float(_average([values["ent"].detach().clone()], processes)[0]))
    weights = {f"weights/{i}": keras.ops.convert_to_numpy(v).tolist() for i, v in enumerate(model.trainable_variables)}
    return {"losses": losses, "head/ent": entropies, **weights}


def distiller(process, processes, prefix):
    import keras
    import torch

    model = process_models.distiller(process_models.DISTILLER_CHUNKS[prefix])
    variables = model.student.trainable_variables
    model.optimizer.build(variables)
    rows = [torch.tensor(local_rows(a, process, processes)) for a in (LM_TOKENS, LM_LABELS, LM_WEIGHTS)]
    per = BATCH // processes
    losses = []
    for epoch in range(2):
        for start in range(0, len(rows[0]), per):
            tokens, labels, weights = (r[start : start + per] for r in rows)
            loss = model.compute_loss(x=tokens, y=labels, sample_weight=weights)
            grads = torch.autograd.grad(loss, [v.value for v in variables])
            model.optimizer.apply(_average(list(grads), processes), variables)
            losses.append(float(_average([loss.detach().clone()], processes)[0]))
    weights = {f"{prefix}/weights/{i}": keras.ops.convert_to_numpy(v).tolist() for i, v in enumerate(variables)}
    return {f"{prefix}/losses": losses, **weights}


def main(role, *args):
    import torch

    process, processes = 0, 1
    if role == "worker":
        process, processes = int(args[1]), 2
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://localhost:{args[0]}", rank=process, world_size=processes
        )
    results = regression(process, processes)
    for prefix in process_models.DISTILLER_CHUNKS:
        results.update(distiller(process, processes, prefix))
    print(json.dumps(results), flush=True)
    if processes > 1:
        torch.distributed.destroy_process_group()
        # Skip the interpreter's finalization: a gloo work thread may still be
        # releasing the tensors of a finished collective, and doing it while
        # Python finalizes aborts the process (torch's, pytorch/pytorch#179291).
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
