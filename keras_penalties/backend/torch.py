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
