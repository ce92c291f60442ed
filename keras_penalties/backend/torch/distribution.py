"""Torch's distribution: the processes of `torch.distributed`'s
default group, each holding its own rows of the global batch, whose
gradients `DistributedDataParallel` averages after the backward pass.

Their forward passes are in sync only while gradients are recorded (a
training step: every process runs it, as DDP's own forward pass requires)
and outside a probe (which runs on the whole probe batch in each process,
as one device). Elsewhere (evaluation under `torch.no_grad()`, a process
that computes alone) each process's values are its own, as
`SyncBatchNorm`'s statistics are outside training.
"""

import contextvars

import torch

from keras_penalties.backend import common


_ONE_PROCESS = contextvars.ContextVar("keras_penalties_one_process", default=False)


def one_process():
    """Within the block, each process computes as if it were alone."""
    return common.flag_set(_ONE_PROCESS)


def replicas_in_sync():
    if _ONE_PROCESS.get() or not torch.is_grad_enabled():
        return 1
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1
    return distributed.get_world_size()


def gather_over_replicas(tensors, keep_losses_of=None):
    """Each tensor's values on every process, concatenated along axis 0 in
    rank order, without a gradient (each process's rows may differ in
    number: padded to the most for the collective, then cut).
    Torch keeps one list of added losses per process: nothing to keep."""
    world = torch.distributed.get_world_size()
    gathered = []
    for t in tensors:
        t = t.detach().contiguous()
        rows = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
        torch.distributed.all_gather(rows, torch.tensor(t.shape[0], dtype=torch.int64))
        most = int(max(rows))
        padded = torch.cat([t, t.new_zeros((most - t.shape[0],) + tuple(t.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(parts, padded)
        gathered.append(torch.cat([part[: int(n)] for part, n in zip(parts, rows)]))
    return gathered


def sum_over_replicas(tensors, keep_losses_of=None):
    """Each tensor (None stays None) summed over the processes in one
    all-reduce, without a gradient: the package sums counts and frozen
    values, where `replicas_in_sync()` is more than 1. Torch keeps one list
    of added losses per process: nothing to keep."""
    tensors = list(tensors)
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return tensors
    parts = [tensors[i].detach().to(torch.float32).reshape(-1) for i in present]
    flat = torch.cat(parts)
    torch.distributed.all_reduce(flat)
    start = 0
    for i, part in zip(present, parts):
        tensors[i] = flat[start : start + part.numel()].reshape(tensors[i].shape).to(tensors[i].dtype)
        start += part.numel()
    return tensors
