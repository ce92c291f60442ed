"""Torch's gradients: `torch.autograd.grad`, kept differentiable, and the
probe's backward passes (batched over its outputs where vmap can)."""

import torch

from keras_penalties.backend.torch import kernels
from keras_penalties.backend.torch import distribution


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


def _norm(grads):
    """`common.norm` in torch's own calls (Keras' ops make four per tensor),
    each Σg² exact to float32 rounding (`sum_of_squares`)."""
    return torch.sqrt(torch.sum(torch.stack([kernels.sum_of_squares(g.float()) for g in grads])))


def parameter_probe(trainable, others, outputs, num_outputs, grad_norms, batched=False, update=None):
    together = [batched]
    fn, _ = update or (None, [])

    def probe(x, y):
        values, norms = measure(x, y)
        if fn is None:
            return values, norms, None
        with torch.no_grad():
            return values, norms, fn(values, norms)

    def measure(x, y):
        params = [v.value for v in trainable]
        # The probe batch is whole in every process: no sums across them.
        with torch.enable_grad(), distribution.one_process():
            # Every other variable's tensor is its own: mapping it in the
            # stateless scope would change nothing and cost Keras a
            # conversion and a lookup per variable.
            entries = outputs(params, None, x, y)
            values = torch.stack([e.detach() for e in entries])
            if not grad_norms:
                return values, None
            norms = torch.zeros(len(entries), device=values.device)
            live = [i for i, entry in enumerate(entries) if entry.requires_grad]
            if together[0] and live:
                try:
                    # One backward pass, batched over the entries: each
                    # node dispatched once, not once an entry.
                    grads = torch.autograd.grad(
                        torch.stack([entries[i] for i in live]),
                        params,
                        grad_outputs=torch.eye(len(live), device=values.device),
                        retain_graph=True,
                        is_grads_batched=True,
                        allow_unused=True,
                    )
                except RuntimeError:
                    # A backward that vmap cannot batch (the chunk loops'
                    # in-place writes): a pass an entry, from now on.
                    together[0] = False
                else:
                    rows = [
                        torch.sum(torch.square(g.float()).reshape(len(live), -1), 1) for g in grads if g is not None
                    ]
                    if rows:
                        norms[live] = torch.sqrt(torch.sum(torch.stack(rows), 0))
                    return values, norms
            for i in live:
                # Each entry's backward traverses only its own graph, and
                # autograd.grad leaves no .grad on the parameters.
                grads = torch.autograd.grad(entries[i], params, retain_graph=True, allow_unused=True)
                grads = [g for g in grads if g is not None]
                if grads:
                    norms[i] = _norm(grads)
        return values, norms

    return probe
