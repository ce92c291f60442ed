"""PyTorch: `torch.autograd.grad`; Keras has no torch distribution."""

import keras
import torch

from keras_penalties.backend._common import (  # noqa: F401
    loss_replicas,
    norm,
    outside_distribution,
    replicas_in_sync,
    softmax_pair,
    sum_over_replicas,
)


def map_chunks(fn, chunks, dtype):
    """`fn` over the leading axis of `chunks`, stacked, each chunk
    recomputed in the backward pass (`keras.remat`). Keras' torch scan
    indexes `x[i]`, whose backward pass writes a zero-filled copy of the
    whole input per chunk (16 chunks of [8192, 32000]: 3.4x the peer's
    time); `unbind` hands each chunk's gradient back in one stack."""
    fn = keras.remat(fn)
    return torch.stack([fn(chunk) for chunk in zip(*(c.unbind(0) for c in chunks))])


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` through a transposed view (no
    copy: the BLAS call reads it transposed)."""
    return rows @ (kernel.T if transpose_kernel else kernel)


class _ChunkedSum(torch.autograd.Function):
    """See `chunked_sum`. Inputs: fn, chunk_size, dtype, the number of row
    tensors, the weights, then the row tensors and the shared ones."""

    @staticmethod
    def forward(ctx, fn, chunk_size, dtype, n_rows, weights, *tensors):
        rows = tensors[:n_rows]
        wanted = [k for k, t in enumerate(tensors) if ctx.needs_input_grad[5 + k] and t.is_floating_point()]
        row_wanted = [k for k in wanted if k < n_rows]
        shared_wanted = [k for k in wanted if k >= n_rows]

        def cast(x):
            return x.detach().to(dtype) if x.is_floating_point() else x.detach()

        shared = [cast(s) for s in tensors[n_rows:]]
        for k in shared_wanted:
            shared[k - n_rows] = shared[k - n_rows].requires_grad_(True)
        row_grads = [torch.empty_like(tensors[k]) for k in row_wanted]
        shared_grads = [torch.zeros_like(shared[k - n_rows]) for k in shared_wanted]
        total = torch.zeros((), dtype=dtype, device=weights.device)
        with torch.enable_grad():
            for start in range(0, weights.shape[0], chunk_size):
                stop = start + chunk_size
                chunk = [cast(r[start:stop]) for r in rows]
                for k in row_wanted:
                    chunk[k].requires_grad_(True)
                value = torch.sum(weights[start:stop] * fn(chunk, shared))
                watched = [chunk[k] for k in row_wanted] + [shared[k - n_rows] for k in shared_wanted]
                if watched and value.requires_grad:
                    grads = torch.autograd.grad(value, watched, allow_unused=True)
                    for buffer, g in zip(row_grads, grads):
                        buffer[start:stop] = 0 if g is None else g
                    for acc, g in zip(shared_grads, grads[len(row_wanted) :]):
                        if g is not None:
                            acc.add_(g)
                elif watched:
                    for buffer in row_grads:
                        buffer[start:stop] = 0
                total = total + value.detach()
        ctx.wanted = wanted
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.compute = dtype
        ctx.save_for_backward(*row_grads, *shared_grads)
        return total

    @staticmethod
    def backward(ctx, upstream):
        grads = [None] * len(ctx.dtypes)
        for k, g in zip(ctx.wanted, ctx.saved_tensors):
            grads[k] = (g.to(ctx.compute) * upstream).to(ctx.dtypes[k])
        return (None, None, None, None, None, *grads)


def chunked_sum(fn, rows, shared, weights, chunk_size, dtype):
    """Σᵣ weights[r]·fn(rows chunk, shared)[r], `chunk_size` rows at a time,
    with the gradient formed in the forward pass: an `autograd.Function`
    whose forward loop also takes each chunk's gradient w.r.t. its rows
    (into one buffer) and w.r.t. `shared` (summed), for the inputs autograd
    needs (`needs_input_grad`: a frozen teacher costs one forward product per
    chunk); the backward pass only scales them by the upstream scalar.
    Nothing is recomputed. First order only."""
    rows, shared = list(rows), list(shared)
    dtype = keras.backend.standardize_dtype(dtype)
    return _ChunkedSum.apply(fn, chunk_size, getattr(torch, dtype), len(rows), weights, *rows, *shared)


def sum_of_squares(x):
    """Σx² as one BLAS dot of x with itself: eager square-then-sum writes and
    reads a full copy of x (5-10x one NumPy pass over 10^7 elements)."""
    flat = x.reshape(-1)
    return torch.dot(flat, flat)


def gradients(fn, tensors):
    with torch.enable_grad():
        # A tensor outside the graph gets a leaf of its own; one inside it
        # is used as is, so the gradient stays connected to what made it.
        tensors = [t if t.requires_grad else t.detach().requires_grad_(True) for t in tensors]
        y = fn(*tensors)
        if not y.requires_grad:
            return [torch.zeros_like(t) for t in tensors]
        grads = torch.autograd.grad(y, tensors, create_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]


def parameter_probe(trainable, others, outputs, num_outputs, grad_norms):
    def probe(x, y):
        params = [v.value for v in trainable]
        with torch.enable_grad():
            entries = outputs(params, [v.value for v in others], x, y)
            values = torch.stack([e.detach() for e in entries])
            if not grad_norms:
                return values, None
            norms = []
            for entry in entries:
                # Each entry's backward traverses only its own graph, and
                # autograd.grad leaves no .grad on the parameters.
                if not entry.requires_grad:
                    norms.append(torch.zeros((), device=values.device))
                    continue
                grads = [g for g in torch.autograd.grad(entry, params, retain_graph=True, allow_unused=True) if g is not None]
                norms.append(norm(grads) if grads else torch.zeros((), device=values.device))
        return values, torch.stack(norms).detach()

    return probe
