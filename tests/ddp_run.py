"""Custom torch training loops in one process and in two processes joined by
`torch.distributed` (gloo, localhost), on the same global batches. Run by
tests/test_multiprocess.py:

    KERAS_BACKEND=torch python -m tests.ddp_run one
    KERAS_BACKEND=torch python -m tests.ddp_run worker PORT RANK

Each process runs its own rows of every global batch. The regression model
(a `CompositeObjective` inside, `compute` of a second objective and of a
`CompositeLoss` on the predictions, `ProximalDecay` around
`AdaptiveGradientClipping`) is wrapped
in `DistributedDataParallel`, which averages the processes' gradients; the
fused `Distiller.compute_loss` runs on the Distiller itself, its gradients
averaged by hand as DDP does. The masks keep fewer rows and tokens in one
process's half of every global batch than in the other's: the composites'
token means, sums over samples and sequence means are the global batch's
only because they sum their counts across the processes inside the
forward pass; a raw op's masked mean on the same rows stays each
process's own (key "raw", not averaged). `PenaltyMonitor` probes the model every other step. It
prints one JSON line: each step's loss and term values averaged over the
processes (each process's share of the global value), the probes, and the
final weights.
"""

import importlib.util
import json
import os
import sys

import numpy as np


from tests import process_models
from tests.process_models import BATCH, LM_LABELS, LM_TOKENS, LM_WEIGHTS, MASK, X, Y, local_rows


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

    from keras_penalties.callbacks import PenaltyMonitor

    model, optimizer, head = process_models.regression()
    closs = process_models.composite_loss()
    forward = torch.nn.parallel.DistributedDataParallel(model) if processes > 1 else model
    # The same probe batch in every process, probed as one device.
    monitor = PenaltyMonitor(probe_data=(X[:BATCH], Y[:BATCH]))
    monitor.set_model(model)
    x, y, mask = (torch.tensor(local_rows(a, process, processes)) for a in (X, Y, MASK))
    per = BATCH // processes
    results = {"losses": [], "raw": [], **{f"{c.name}/{name}": [] for c in (head, closs) for name in c.terms}}
    for epoch in range(2):
        for start in range(0, len(x), per):
            rows = slice(start, start + per)
            pred = forward(x[rows])
            total, values = head.compute({"pred": pred, "mask": mask[rows]})
            loss_total, loss_values = closs.compute(y[rows], pred, sample_weight=mask[rows])
            loss = loss_total + sum(model.losses) + total
            # A raw op outside the composites keeps Keras' rule: this process's own mean.
            results["raw"].append(float(process_models.raw_token_mean(pred, mask[rows]).detach()))
            loss.backward()
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
            for v in variables:
                v.value.grad = None
            results["losses"].append(float(_average([loss.detach().clone()], processes)[0]))
            for prefix, named in (("head", values), ("closs", loss_values)):
                for name, value in named.items():
                    results[f"{prefix}/{name}"].append(float(_average([value.detach().clone()], processes)[0]))
            if start % (2 * per) == 0:
                results.update({f"probe{start // per}_{epoch}/{k}": v for k, v in monitor.probe().items()})
            if process == 0 and start == 0:
                # A report on one process alone, gradients recorded: no
                # collective waits for the others (a hang would time out).
                head.report({"pred": forward(x[rows]), "mask": mask[rows]}, grad_norms=True)
    weights = {f"weights/{i}": keras.ops.convert_to_numpy(v).tolist() for i, v in enumerate(model.trainable_variables)}
    return {**results, **weights}


def _trained_by_hand(loss_of, variables, optimizer, steps, processes):
    """Two epochs over `steps` (this process's rows of each global batch):
    `loss_of(step)`, its gradients averaged over the processes as DDP does,
    applied by `optimizer`; each step's loss, averaged too."""
    import torch

    optimizer.build(variables)
    losses = []
    for epoch in range(2):
        for step in steps:
            loss = loss_of(step)
            grads = torch.autograd.grad(loss, [v.value for v in variables])
            optimizer.apply(_average(list(grads), processes), variables)
            losses.append(float(_average([loss.detach().clone()], processes)[0]))
    return losses


def distiller(process, processes, prefix):
    import keras
    import torch

    model = process_models.distiller(process_models.DISTILLER_CHUNKS[prefix])
    variables = model.student.trainable_variables
    rows = [torch.tensor(local_rows(a, process, processes)) for a in (LM_TOKENS, LM_LABELS, LM_WEIGHTS)]
    per = BATCH // processes
    steps = [[r[start : start + per] for r in rows] for start in range(0, len(rows[0]), per)]
    losses = _trained_by_hand(
        lambda step: model.compute_loss(x=step[0], y=step[1], sample_weight=step[2]),
        variables,
        model.optimizer,
        steps,
        processes,
    )
    weights = {f"{prefix}/weights/{i}": keras.ops.convert_to_numpy(v).tolist() for i, v in enumerate(variables)}
    return {f"{prefix}/losses": losses, **weights}


def post_training(process, processes):
    """DPO, KTO and GRPO (tests/post_training_run.py's models and data, on
    keras-hub GPT-2s built from config): `compute_loss` on this process's
    rows, the gradients averaged by hand as DDP does; the first half of
    every global batch (process 0's rows) keeps fewer tokens."""
    import keras
    import torch

    from tests import post_training_run as run

    results = {}
    for prefix, model, data in run.models_and_data():
        variables = model.policy.trainable_variables
        rows = {k: torch.tensor(local_rows(v, process, processes)) for k, v in data.items()}
        per = BATCH // processes
        steps = [{k: v[start : start + per] for k, v in rows.items()} for start in range(0, run.ROWS // processes, per)]
        losses = _trained_by_hand(
            lambda step: model.compute_loss(x=step), variables, keras.optimizers.SGD(0.1), steps, processes
        )
        weights = np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)) for v in variables])
        results.update({f"{prefix}/losses": losses, f"{prefix}/weights": weights.tolist()})
    return results


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
    if importlib.util.find_spec("keras_hub") is not None:  # Python 3.11+
        results.update(post_training(process, processes))
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
