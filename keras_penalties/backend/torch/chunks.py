"""Torch's chunk loops: `map_chunks` over formed logits, and `chunked_sum`
and `chunked_values` over logits formed from hidden states, each an
`autograd.Function`: the first two form a chunk's gradient with its
values; `chunked_values` forms none (but frozen heads' row Jacobians), and
its backward pass runs `chunked_sum`'s loop with the upstream gradient as
the weights."""

import contextvars

import keras
import torch

from keras_penalties._types import Head
from keras_penalties.backend import common


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
            # A row's value depends on that row alone: the gradient of the
            # chunk's sum is each row's gradient of its own value.
            chunk_values = _chunk_grads_into(slopes, i, fn, chunk, wanted)
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


def _chunk_grads_into(buffers, i, fn, chunk, wanted, upstream=None):
    """`fn(chunk)`, with its gradient w.r.t. the `wanted` tensors of the
    chunk (that of its sum, or with `upstream` the chunk's upstream
    gradient) written into row `i` of their `buffers` (zeros where a
    tensor is not connected)."""
    watched = [chunk[j].requires_grad_(True) for j in wanted]
    with torch.enable_grad():
        chunk_values = fn(tuple(chunk))
        grads = [None] * len(watched)
        if watched and chunk_values.requires_grad:
            if upstream is None:
                grads = torch.autograd.grad(chunk_values.sum(), watched, allow_unused=True)
            else:
                grads = torch.autograd.grad(chunk_values, watched, upstream.to(chunk_values.dtype), allow_unused=True)
    for j, g in zip(wanted, grads):
        if g is None:
            buffers[j][i].zero_()
        else:
            buffers[j][i] = g
    return chunk_values


def _recomputed_grads(fn, chunks, wanted, dtype, upstream):
    """The gradients of Σ upstream·fn(chunk) w.r.t. the `wanted` inputs,
    each chunk computed again (its forward-made rows went to an earlier
    backward pass)."""
    grads = {j: torch.empty(chunks[j].shape, dtype=dtype, device=chunks[j].device) for j in wanted}
    for i, chunk in enumerate(_chunk_rows(chunks, dtype)):
        _chunk_grads_into(grads, i, fn, chunk, wanted, upstream[i])
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


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` through a transposed view (no
    copy: the BLAS call reads it transposed)."""
    return rows @ (kernel.T if transpose_kernel else kernel)


# Whether the code running is a chunk loop's function of a chunk's logits,
# whose gradient is taken once (first order): where `soft_cap` and
# `label_logprobs` fuse.
in_chunk = contextvars.ContextVar("keras_penalties_torch_in_chunk", default=False)


def chunk_body():
    return common.flag_set(in_chunk)


class _ChunkedSum(torch.autograd.Function):
    """See `chunked_sum`. Inputs: fn, chunk_size, dtype, `layout` (the number
    of rows, then each head's (transpose_kernel, has_bias)), the weights,
    then the rows and each head's hidden, kernel and bias tensors."""

    @staticmethod
    def forward(ctx, fn, chunk_size, dtype, layout, weights, *tensors):
        needs = ctx.needs_input_grad[5:]
        columns, kept = _sum_loop(fn, chunk_size, dtype, layout, weights, tensors, needs)
        ctx.fn, ctx.chunk_size, ctx.layout, ctx.needs = fn, chunk_size, layout, needs
        ctx.kept = [k for k, _ in kept]
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.compute = dtype
        # Not save_for_backward: the first backward pass scales the gradients
        # in place (a second [H, V] kernel gradient would be the peak); the
        # inputs, kept as any autograd op keeps them, let a later backward
        # pass (retain_graph=True) form them again.
        ctx.grads = [g for _, g in kept]
        ctx.save_for_backward(weights, *tensors)
        # The columns are not differentiated: only the total's gradient counts.
        ctx.mark_non_differentiable(columns)
        return columns.sum(), columns

    @staticmethod
    def backward(ctx, upstream, _):
        kept, ctx.grads = ctx.grads, None
        if kept is None:
            weights, *tensors = ctx.saved_tensors
            loop = _sum_loop(ctx.fn, ctx.chunk_size, ctx.compute, ctx.layout, weights, tensors, ctx.needs)
            kept = [g for _, g in loop[1]]
        grads = [None] * len(ctx.dtypes)
        for k, g in zip(ctx.kept, kept):
            if g.dtype == ctx.compute:
                grads[k] = g.mul_(upstream.to(g.dtype)).to(ctx.dtypes[k])
            else:
                grads[k] = (g.to(ctx.compute) * upstream).to(ctx.dtypes[k])
        return (None, None, None, None, None, *grads)


def _sum_loop(fn, chunk_size, dtype, layout, weights, tensors, needs):
    """`_ChunkedSum`'s loop: `(columns, [(input index, gradient)])`, the
    gradients of the inputs `needs` marks formed chunk by chunk, unscaled."""
    n_rows, head_layout = layout
    rows = tensors[:n_rows]
    heads, position = [], n_rows
    for transpose, has_bias in head_layout:
        count = 3 if has_bias else 2
        heads.append((list(tensors[position : position + count]) + [None] * (3 - count), position))
        position += count

    def cast(x):
        return x.detach().to(dtype) if x.is_floating_point() else x.detach()

    row_wanted = [i for i in range(n_rows) if needs[i] and rows[i].is_floating_point()]
    wanted = [[p is not None and needs[at + k] for k, p in enumerate(head)] for head, at in heads]
    params = [(cast(head[1]), None if head[2] is None else cast(head[2])) for head, _ in heads]
    row_grads = {i: torch.empty_like(rows[i]) for i in row_wanted}
    hidden_grads = {j: torch.empty_like(heads[j][0][0]) for j in range(len(heads)) if wanted[j][0]}
    # The kernel's gradient is summed in place (addmm_): no [H, V]
    # product per chunk, unlike autograd's own accumulation.
    kernel_grads = {j: torch.zeros_like(params[j][0]) for j in range(len(heads)) if wanted[j][1]}
    bias_grads = {j: torch.zeros_like(params[j][1]) for j in range(len(heads)) if wanted[j][2]}
    columns = torch.zeros(weights.shape[1:], dtype=dtype, device=weights.device)
    for start in range(0, weights.shape[0], chunk_size):
        stop = start + chunk_size
        chunk_rows = [cast(r[start:stop]) for r in rows]
        hidden = [cast(head[0][start:stop]) for head, _ in heads]
        with torch.no_grad():
            logits = [
                project(h, k, t) if b is None else torch.addmm(b, h, k.T if t else k)
                for h, (k, b), (t, _) in zip(hidden, params, head_layout)
            ]
        watched = [logits[j].requires_grad_(True) for j in range(len(heads)) if any(wanted[j])]
        watched += [chunk_rows[i].requires_grad_(True) for i in row_wanted]
        with torch.enable_grad(), chunk_body():
            chunk_columns = torch.sum(weights[start:stop] * fn(logits, chunk_rows), dim=0)
            value = torch.sum(chunk_columns)
            connected = watched and value.requires_grad
            grads = torch.autograd.grad(value, watched, allow_unused=True) if connected else [None] * len(watched)
        grads = iter(torch.zeros_like(w) if g is None else g for w, g in zip(watched, grads))
        dlogits = [next(grads) if any(wanted[j]) else None for j in range(len(heads))]
        for i in row_wanted:
            row_grads[i][start:stop] = next(grads)
        for j, buffer in hidden_grads.items():
            buffer[start:stop] = project(dlogits[j], params[j][0], not head_layout[j][0])
        for j, acc in kernel_grads.items():
            if head_layout[j][0]:
                acc.addmm_(dlogits[j].T, hidden[j])
            else:
                acc.addmm_(hidden[j].T, dlogits[j])
        for j, acc in bias_grads.items():
            acc.add_(dlogits[j].sum(0))
        columns += chunk_columns.detach()
        # Freed now, not when the next chunk's rebind them: else the next
        # chunk's logits are formed beside this one's and their gradient.
        del logits, watched, grads, dlogits, chunk_columns, value
    kept = [(i, g) for i, g in row_grads.items()]
    for j, (head, at) in enumerate(heads):
        for k, grads_of in enumerate((hidden_grads, kernel_grads, bias_grads)):
            if j in grads_of:
                kept.append((at + k, grads_of[j]))
    return columns, kept


def chunked_sum(fn, rows, heads, weights, chunk_size, dtype):
    """(Σᵣ weights[r]·fn(logits, rows)[r], its columns: see backend/__init__),
    `chunk_size` rows at a time, with
    the gradient formed in the forward pass: an `autograd.Function` whose
    loop forms each chunk's logits, takes the gradient of its weighted sum
    w.r.t. them and the float rows, and turns the logits' gradient into
    the hidden rows' (into one buffer) and the kernel's and bias's (summed
    in place), for the inputs autograd needs (`needs_input_grad`: a frozen
    teacher costs one forward product per chunk); the backward pass only
    scales them by the upstream scalar. Nothing is recomputed. First order
    only."""
    rows = list(rows)
    layout = (len(rows), tuple((bool(head.transpose), head.bias is not None) for head in heads))
    flat = rows + [p for head in heads for p in (head.rows, head.kernel, head.bias) if p is not None]
    dtype = getattr(torch, keras.backend.standardize_dtype(dtype))
    return _ChunkedSum.apply(fn, chunk_size, dtype, layout, weights, *flat)


def _unflattened(layout, tensors):
    """`(rows, heads)` of a flat input list: `layout` is the number of rows,
    then each head's (transpose_kernel, has_bias); each head a `Head`."""
    n_rows, head_layout = layout
    heads, position = [], n_rows
    for transpose, has_bias in head_layout:
        count = 3 if has_bias else 2
        heads.append(Head(*tensors[position : position + count], *[None] * (3 - count), transpose))
        position += count
    return list(tensors[:n_rows]), heads


def _hidden_positions(layout):
    """Where each head's hidden rows lie in a flat input list (`layout` as
    `_unflattened`'s)."""
    n_rows, head_layout = layout
    positions, at = [], n_rows
    for _, has_bias in head_layout:
        positions.append(at)
        at += 3 if has_bias else 2
    return positions


class _ChunkedValues(torch.autograd.Function):
    """See `chunked_values`. Inputs: fn, chunk_size, dtype, `layout` (as
    `_ChunkedSum`'s), then the rows and each head's tensors."""

    @staticmethod
    def forward(ctx, fn, chunk_size, dtype, layout, *tensors):
        rows, heads = _unflattened(layout, tensors)

        def cast(x):
            return x.detach().to(dtype) if x is not None and x.is_floating_point() else x

        params = [(cast(k), cast(b), t) for _, k, b, t in heads]
        n = (heads[0][0] if heads else rows[0]).shape[0]
        # Frozen heads (no kernel, bias or float row needs a gradient: a LoRA
        # fine-tune): each row's gradient of its own value, formed with it,
        # costs one product a chunk, where forming the chunk again in the
        # backward pass costs two. For one value a row only.
        needs = ctx.needs_input_grad[4:]
        hidden_at = _hidden_positions(layout)
        others = [need for i, need in enumerate(needs) if i not in hidden_at and tensors[i].is_floating_point()]
        hidden = [needs[i] for i in hidden_at]
        jacobians = [
            torch.empty(h[0].shape, dtype=dtype, device=h[0].device) if want else None for h, want in zip(heads, hidden)
        ]
        jacobians = jacobians if any(hidden) and not any(others) else None
        values = None
        for start in range(0, n, chunk_size):
            stop = start + chunk_size
            with torch.no_grad():
                logits = [
                    project(cast(h[0][start:stop]), k, t)
                    if b is None
                    else torch.addmm(b, cast(h[0][start:stop]), k.T if t else k)
                    for h, (k, b, t) in zip(heads, params)
                ]
            chunk_rows = [cast(r[start:stop]) for r in rows]
            if jacobians is None:
                with torch.no_grad(), chunk_body():
                    chunk = fn(logits, chunk_rows)
            else:
                watched = [x.requires_grad_(True) for x, j in zip(logits, jacobians) if j is not None]
                with torch.enable_grad(), chunk_body():
                    chunk = fn(logits, chunk_rows)
                    if chunk.dim() == 1:
                        # A row's value depends on its own row alone: the
                        # gradient of the chunk's sum is each row's own.
                        dlogits = iter(torch.autograd.grad(chunk.sum(), watched))
                chunk = chunk.detach()
                if chunk.dim() != 1:
                    jacobians = None  # several values a row: formed again in the backward pass
                else:
                    for j, ((k, _, t), buffer) in enumerate(zip(params, jacobians)):
                        if buffer is not None:
                            buffer[start:stop] = project(next(dlogits), k, not t)
                del watched
            if values is None:  # [n] or [n, k]: the first chunk's values say which
                values = torch.empty((n, *chunk.shape[1:]), dtype=dtype, device=tensors[0].device)
            values[start:stop] = chunk
        ctx.fn, ctx.chunk_size, ctx.dtype, ctx.layout = fn, chunk_size, dtype, layout
        ctx.jacobians = jacobians is not None
        if ctx.jacobians:
            ctx.hidden_at = [i for i, j in zip(hidden_at, jacobians) if j is not None]
            ctx.dtypes = [t.dtype for t in tensors]
            ctx.save_for_backward(*[j for j in jacobians if j is not None])
        else:
            ctx.save_for_backward(*tensors)
        return values

    @staticmethod
    def backward(ctx, upstream):
        if ctx.jacobians:
            grads = [None] * len(ctx.dtypes)
            for i, jacobian in zip(ctx.hidden_at, ctx.saved_tensors):
                grads[i] = (upstream.to(jacobian.dtype)[:, None] * jacobian).to(ctx.dtypes[i])
            return (None, None, None, None, *grads)
        needs = ctx.needs_input_grad[4:]
        inputs = [
            t.detach().requires_grad_(need and t.is_floating_point()) for t, need in zip(ctx.saved_tensors, needs)
        ]
        wanted = [t for t in inputs if t.requires_grad]
        grads = [None] * len(inputs)
        if wanted:
            with torch.enable_grad():
                weights = upstream.detach().to(ctx.dtype)
                total, _ = _ChunkedSum.apply(ctx.fn, ctx.chunk_size, ctx.dtype, ctx.layout, weights, *inputs)
                found = iter(torch.autograd.grad(total, wanted))
            grads = [next(found) if t.requires_grad else None for t in inputs]
        return (None, None, None, None, *grads)


def chunked_values(fn, rows, heads, chunk_size, dtype):
    """fn(logits, rows) for every row ([rows] or [rows, k]), `chunk_size`
    rows at a time, with no gradient formed in the forward pass: the
    upstream gradient, of the values' shape, is known only in the backward
    pass, which forms each chunk's
    logits again through `_ChunkedSum` with it as the weights (an
    `autograd.Function` that keeps its inputs, not their chunks: a second
    backward pass computes the chunks again)."""
    rows = list(rows)
    layout = (len(rows), tuple((bool(head.transpose), head.bias is not None) for head in heads))
    flat = rows + [p for head in heads for p in (head.rows, head.kernel, head.bias) if p is not None]
    dtype = getattr(torch, keras.backend.standardize_dtype(dtype))
    return _ChunkedValues.apply(fn, chunk_size, dtype, layout, *flat)
