"""PyTorch: `torch.autograd.grad`, eager torch's own calls where a Keras
call costs Python time, the chunk kernels (`_torch_heads.py`) and the
processes of `torch.distributed` as replicas under DDP
(`_torch_processes.py`; Keras itself has no torch distribution)."""

import types

import keras
import torch

from keras_penalties import _keras_internals
from keras_penalties.backend import _common
from keras_penalties.backend._common import TINY, smallest_normal
from keras_penalties.backend._torch_heads import (  # noqa: F401  (the backend's contract)
    chunked_sum,
    chunked_values,
    label_logprobs,
    project,
    soft_cap,
)
from keras_penalties.backend._torch_processes import (  # noqa: F401
    gather_over_replicas,
    one_process,
    replicas_in_sync,
    sum_over_replicas,
)

# Eager torch forms each log-softmax it is asked for: an objective's terms
# share those of its inputs (num.sharing). A term's own autograd.grad or
# torch.func transform sees x's graph or wraps x afresh, so it is safe.
SHARES_SOFTMAX = True

# chunk_size="auto": chunks of logits that stay in cache (128 rows of a 32000
# vocabulary), and 64 rows of 128256 from hidden states, were the fastest on
# the benchmark machine (bench/results/README.md).
CHUNK_ELEMENTS = 4 * 2**20
HEAD_CHUNK_ELEMENTS = 8 * 2**20


class _MapChunks(torch.autograd.Function):
    """See `map_chunks`. Inputs: fn, dtype, then the chunked tensors."""

    @staticmethod
    def forward(ctx, fn, dtype, *chunks):
        wanted = [j for j, c in enumerate(chunks) if ctx.needs_input_grad[2 + j] and c.is_floating_point()]
        slopes = {j: torch.empty(chunks[j].shape, dtype=dtype, device=chunks[j].device) for j in wanted}
        values = []
        for i, chunk in enumerate(_chunk_rows(chunks, dtype)):
            watched = [chunk[j].requires_grad_(True) for j in wanted]
            with torch.enable_grad():
                chunk_values = fn(tuple(chunk))
                connected = watched and chunk_values.requires_grad
                # A row's value depends on that row alone: the gradient of
                # the chunk's sum is each row's gradient of its own value.
                grads = (
                    torch.autograd.grad(chunk_values.sum(), watched, allow_unused=True)
                    if connected
                    else [None] * len(watched)
                )
            for j, g in zip(wanted, grads):
                if g is None:
                    slopes[j][i].zero_()
                else:
                    slopes[j][i] = g
            values.append(chunk_values.detach())
        ctx.fn, ctx.compute, ctx.wanted = fn, dtype, wanted
        ctx.dtypes = [c.dtype for c in chunks]
        # The inputs, as any autograd op keeps them, for a second backward
        # pass (retain_graph=True: the monitor's per-term probe), which
        # recomputes the chunks.
        ctx.save_for_backward(*chunks)
        # Not save_for_backward: the first backward pass scales the rows in
        # place (a second buffer the size of the input would be the peak).
        ctx.slopes = slopes
        return torch.stack(values)

    @staticmethod
    def backward(ctx, upstream):
        slopes, ctx.slopes = ctx.slopes, None
        if slopes is None:
            slopes = _recomputed_grads(ctx.fn, ctx.saved_tensors, ctx.wanted, ctx.compute, upstream)
        else:
            for s in slopes.values():
                s.mul_(upstream[..., None].to(s.dtype))
        grads = [None] * len(ctx.dtypes)
        for j, g in slopes.items():
            grads[j] = g.to(ctx.dtypes[j])
        return (None, None, *grads)


def _chunk_rows(chunks, dtype):
    """Each chunk's tensors, detached, floats in `dtype`."""
    for chunk in zip(*(c.detach().unbind(0) for c in chunks)):
        yield [x.to(dtype) if x.is_floating_point() else x for x in chunk]


def _recomputed_grads(fn, chunks, wanted, dtype, upstream):
    """The gradients of Σ upstream·fn(chunk) w.r.t. the `wanted` inputs,
    each chunk computed again (its forward-made rows went to an earlier
    backward pass)."""
    grads = {j: torch.empty(chunks[j].shape, dtype=dtype, device=chunks[j].device) for j in wanted}
    for i, chunk in enumerate(_chunk_rows(chunks, dtype)):
        watched = [chunk[j].requires_grad_(True) for j in wanted]
        with torch.enable_grad():
            chunk_values = fn(tuple(chunk))
            connected = watched and chunk_values.requires_grad
            chunk_grads = (
                torch.autograd.grad(chunk_values, watched, upstream[i].to(chunk_values.dtype), allow_unused=True)
                if connected
                else [None] * len(watched)
            )
        for j, g in zip(wanted, chunk_grads):
            if g is None:
                grads[j][i].zero_()
            else:
                grads[j][i] = g
    return grads


def map_chunks(fn, chunks, dtype):
    """`fn` over the leading axis of the tuple `chunks`, stacked (values of
    `dtype`), without recomputing any chunk in a training step's backward
    pass: an `autograd.Function` whose loop forms, with each chunk's
    values, each row's gradient of its own value (a row's value depends on
    that row alone) into one buffer, for the inputs autograd needs; the
    first backward pass only scales those rows by the upstream gradient,
    in place, as on TF. A later backward pass over the same forward pass
    (`retain_graph=True`) computes each chunk again. First order only."""
    dtype = getattr(torch, keras.backend.standardize_dtype(dtype))
    return _MapChunks.apply(fn, dtype, *chunks)


def variable_home(model=None):
    # Keras has no torch distribution: every variable lives where it is made.
    return None


def as_tensor(x):
    """As `_common.as_tensor`, without Keras' call for a torch tensor already
    on Keras' device (`_keras_internals.torch_device`), which Keras'
    conversion returns as it is (it moves a tensor with `x.to(device)`,
    which returns `x` on that device): Keras' call is Python paid several
    times per op call in a fit step."""
    if isinstance(x, torch.Tensor) and x.device == torch.device(_keras_internals.torch_device()):
        return x  # what Keras' `x.to(device)` returns
    return keras.ops.convert_to_tensor(x)


def stack(tensors):
    """As `_common.stack`, as `torch.stack`: Keras' `ops.stack` converts each
    tensor first, at every call of an objective."""
    return torch.stack(list(tensors))


def add_to_row(variable, row, values):
    """As `_common.add_to_row`, in place: one add of the row instead of
    four eager ops over the whole variable (the running term values, at
    every call of an objective). In a stateless scope (a probe) the
    variable's value is the scope's, which is assigned as Keras does."""
    if _keras_internals.in_stateless_scope():
        return _common.add_to_row(variable, row, values)
    with torch.no_grad():
        variable.value[row].add_(values)


def reduce_sum(x, axis=None):
    """As `_common.reduce_sum`, as `torch.sum`, which Keras' sum calls after
    a conversion and before a cast that change nothing for a float tensor."""
    return torch.sum(x) if axis is None else torch.sum(x, dim=axis)


def divide_by_count(total, n):
    """As `_common.divide_by_count`; an int count made a tensor by torch
    directly, without Keras' cast of a Python number."""
    if isinstance(n, int):
        return total / torch.tensor(n, dtype=total.dtype, device=total.device)
    return _common.divide_by_count(total, n)


def increment(variable):
    """As `_common.increment`, in place: one add instead of an add and an
    assignment through Keras, at every training call of an objective."""
    if _keras_internals.in_stateless_scope():
        return _common.increment(variable)
    with torch.no_grad():
        variable.value.add_(1)


# On eager torch Keras' dispatch of an op on a few-element tensor costs more
# than its math (bench/results/README.md).
SMALL_OPS = types.SimpleNamespace(
    stop_gradient=torch.Tensor.detach,
    log=torch.log,
    exp=torch.exp,
    relu=torch.relu,
    softmax=lambda x: torch.softmax(x, dim=-1),
    sum=torch.sum,
    power=torch.pow,
    sqrt=torch.sqrt,
    stack=torch.stack,
)


def assign_all(pairs):
    """As `_common.assign_all`, in place: Keras' assignment checks and
    converts each value first, at every training step of FAMO's five. In a
    stateless scope the values are the scope's."""
    if _keras_internals.in_stateless_scope():
        return _common.assign_all(pairs)
    with torch.no_grad():
        for variable, value in pairs:
            variable.value.copy_(value)


def proximal_step(variables, threshold, shrink, center):
    """As `_common.proximal_step`, as `torch._foreach_*` calls on the
    variables' tensors in place, as Keras' torch Adam updates them. The
    clip is a maximum and a minimum against tensor lists, faster than
    `torch.clamp` with tensor bounds and, unlike Python-number bounds, with
    no device sync on a GPU."""
    by_dtype = {}
    for v in variables:
        by_dtype.setdefault(v.value.dtype, []).append(v.value)
    with torch.no_grad():
        for dtype, values in by_dtype.items():
            n = len(values)
            if center == "mean":
                c = [x.mean() for x in values]
                torch._foreach_sub_(values, c)
            elif center is not None:
                c = [torch.tensor(float(center), dtype=dtype, device=values[0].device)] * n
                torch._foreach_sub_(values, c)
            if threshold is not None:
                t = threshold.to(dtype)
                clipped = torch._foreach_maximum(values, [-t] * n)
                torch._foreach_minimum_(clipped, [t] * n)
                torch._foreach_sub_(values, clipped)
            if shrink is not None:
                torch._foreach_mul_(values, shrink.to(dtype))
            if center is not None:
                torch._foreach_add_(values, c)


def unit_clip(grads, weights, clip_factor, eps):
    """As `_common.unit_clip`, in torch ops on each pair: the same passes
    over the tensors without keras.ops' per-call overhead (ten small ops a
    variable), and column norms as √Σx², faster than `linalg.vector_norm`."""
    out = []
    with torch.no_grad():
        for g, w in zip(grads, weights):
            g32, w32 = g, w
            if _common.is_half(g.dtype) or _common.is_half(w.dtype):
                g32, w32 = g.float(), w.float()
            if g.ndim > 1:
                units = g.shape[-1]
                w_norm = w32.reshape(-1, units).square().sum(0).sqrt_()
                g_norm = g32.reshape(-1, units).square().sum(0).sqrt_()
            else:
                w_norm, g_norm = torch.sqrt(sum_of_squares(w32)), torch.sqrt(sum_of_squares(g32))
            scale = w_norm.clamp_(min=eps).mul_(clip_factor).div_(g_norm.clamp_(min=TINY)).clamp_(max=1.0)
            out.append((g32 * scale).to(g.dtype))
    return out


def js_rows(p, logp, q, logq, beta, axis, reuse=(False, False)):
    """As `_common.js_rows`; where nothing is differentiated, in place: m
    and (1 − β)·q are fresh, and log p − log m and log q − log m are formed
    in the caller's `logp` and `logq` where `reuse` says they are its own
    (one fresh tensor each where not: a log-softmax an objective shares
    with its other terms). On CPU each fresh tensor is a page-faulted
    allocation of the whole input's size. The same operations in the same order, so the same bits
    as the differentiable form. Under a `torch.func` transform (`vmap`:
    `ops.vectorized_map`) the differentiable form: a batched result cannot
    be written into an unbatched tensor."""
    if (torch.is_grad_enabled() and any(t.requires_grad for t in (p, logp, q, logq))) or _transform_active():
        return _common.js_rows(p, logp, q, logq, beta, axis)
    logm = p * beta
    logm.add_(q * (1.0 - beta)).add_(smallest_normal(p.dtype)).log_()
    from_p = logp.sub_(logm) if reuse[0] else logp - logm
    from_q = logq.sub_(logm) if reuse[1] else logq - logm
    return beta * from_p.mul_(p).sum(axis) + (1.0 - beta) * from_q.mul_(q).sum(axis)


def kl_rows(p, logp, logq, axis):
    """As `_common.kl_rows`; where `p` is not differentiated (a teacher's),
    the product is formed in place in the fresh log p − log q (whose own
    gradient needs only p), one tensor of the rows' size fewer: a KL
    chunk's peak (bench/results/README.md). The same bits: p·d = d·p."""
    difference = logp - logq
    if (torch.is_grad_enabled() and p.requires_grad) or _transform_active():
        return torch.sum(p * difference, dim=axis)
    return torch.sum(difference.mul_(p), dim=axis)


def _transform_active():
    """Whether a `torch.func` transform (`vmap`, which Keras'
    `ops.vectorized_map` uses on torch, `grad`, `jvp`, ...) is running
    around the caller: its tensors are wrappers that in-place ops cannot
    always write into. True when torch has no answer, so that callers fall
    back to out-of-place ops. Reads torch's private
    `torch._C._functorch.peek_interpreter_stack()`, None outside every
    transform (torch 2.0 on; read in 2.13)."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return True if peek is None else peek() is not None


# Below this many classes torch's CPU softmax and log_softmax leave their
# vectorised kernel for a per-element one; an exp of the log-softmax already
# at hand is then the cheaper softmax.
_SOFTMAX_KERNEL_CLASSES = 16


def softmax_pair(logits, axis, log_softmax=None):
    """`(softmax, log_softmax)` of logits along `axis`: the two kernels, or
    below `_SOFTMAX_KERNEL_CLASSES` classes an exp of the log-softmax
    (`log_softmax`, if given, is that of these logits, already formed)."""
    if logits.shape[axis] < _SOFTMAX_KERNEL_CLASSES:
        logp = torch.log_softmax(logits, dim=axis) if log_softmax is None else log_softmax
        return torch.exp(logp), logp
    return _common.softmax_pair(logits, axis, log_softmax)


# Σ|x| and Σx² exact to float32 rounding at every size, as torch.sum's cascade
# and NumPy's pairwise sum are, without a full copy of a large x: torch's own
# 1- and 2-norm reductions and the BLAS dot accumulate in a few float32 lanes,
# so their error grows with the size (bench/results/README.md).
_ABS_BLOCK = 2**20  # abs-then-sum this many elements at a time (4 MB in float32)
_DOT_ELEMENTS = 2**18  # one dot up to here, within float32 rounding
_DOT_ROW = 2**14  # beyond: one batched product of 16 k-element rows, each its own dot


def sum_abs(x):
    """Σ|x|: abs-then-sum, of up to `_ABS_BLOCK` elements at once (faster
    than torch's 1-norm)."""
    flat = x.reshape(-1)
    if flat.numel() <= _ABS_BLOCK or _transform_active():
        return torch.sum(torch.abs(flat))
    return _BlockReduction.apply(flat, "abs")


def sum_of_squares(x):
    """Σx²: one dot of x with itself up to `_DOT_ELEMENTS` (it writes no
    copy of x), else dots of its `_DOT_ROW`-element rows."""
    flat = x.reshape(-1)
    if flat.numel() <= _DOT_ELEMENTS:
        return torch.dot(flat, flat)
    if _transform_active():
        return torch.sum(flat * flat)
    return _BlockReduction.apply(flat, "square")


def _abs_in_blocks(flat):
    # Each block's |x| written into one scratch block: fresh blocks would each
    # be page-faulted in.
    scratch = torch.empty(_ABS_BLOCK, dtype=flat.dtype, device=flat.device)
    partial = [torch.sum(torch.abs(block, out=scratch[: block.numel()])) for block in flat.split(_ABS_BLOCK)]
    return torch.sum(torch.stack(partial))


def _squares_in_rows(flat):
    # One batched product: as fast as one dot from 4 M elements on.
    rows = flat.numel() // _DOT_ROW
    head = flat[: rows * _DOT_ROW].view(rows, 1, _DOT_ROW)
    total = torch.sum(torch.bmm(head, head.transpose(1, 2)))
    tail = flat[rows * _DOT_ROW :]
    return total + torch.dot(tail, tail) if tail.numel() else total


class _BlockReduction(torch.autograd.Function):
    """Σ|x| or Σx² of a flat x, formed a block at a time, with the gradient
    sign(x)·g or 2x·g in one pass (autograd through the blocks costs
    several times the forward pass). The backward pass is itself differentiable (double backprop).
    Not under a `torch.func` transform (`vmap`: `ops.vectorized_map`),
    which needs a rule of its own; the callers sum plainly there."""

    @staticmethod
    def forward(ctx, flat, kind):
        ctx.save_for_backward(flat)
        ctx.kind = kind
        # Not in half precision under torch.autocast, which runs bmm so.
        with torch.autocast(flat.device.type, enabled=False):
            return _abs_in_blocks(flat) if kind == "abs" else _squares_in_rows(flat)

    @staticmethod
    def backward(ctx, upstream):
        (flat,) = ctx.saved_tensors
        if ctx.kind == "abs":
            return torch.sign(flat) * upstream, None
        return flat * (2.0 * upstream), None


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
    """`_common.norm` in torch's own calls (Keras' ops make four per tensor),
    each Σg² exact to float32 rounding (`sum_of_squares`)."""
    return torch.sqrt(torch.sum(torch.stack([sum_of_squares(g.float()) for g in grads])))


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
        with torch.enable_grad(), one_process():
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
