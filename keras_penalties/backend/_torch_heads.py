"""Torch's heads: logits formed from hidden states a chunk at a time
(`chunked_sum`, `chunked_values`), the product they are made of, and the
first-order functions of a chunk's logits that save eager torch passes over
them (`soft_cap`, `label_logprobs`). Used by `backend/torch.py` only."""

import contextvars

import keras
import torch

from keras_penalties._types import Head
from keras_penalties.backend import _common


def project(rows, kernel, transpose_kernel):
    """`rows @ kernel`, or `rows @ kernelᵀ` through a transposed view (no
    copy: the BLAS call reads it transposed)."""
    return rows @ (kernel.T if transpose_kernel else kernel)


# Whether the code running is a chunk loop's function of a chunk's logits,
# whose gradient is taken once (first order): where `soft_cap` and
# `label_logprobs` fuse.
_in_chunk = contextvars.ContextVar("keras_penalties_torch_in_chunk", default=False)


def _chunk_body():
    return _common.flag_set(_in_chunk)


class _SoftCap(torch.autograd.Function):
    """c·tanh(z / c) as 2c·σ(2z / c) − c: torch's CPU `tanh` is five times
    its `sigmoid` (bench/results/README.md); within 4 float32 ulps of c of
    the exact cap (2σ − 1 cancels near 0). Its gradient 4σ(1 − σ) is two
    passes over the saved σ, where autograd's takes three."""

    @staticmethod
    def forward(ctx, logits, cap):
        s = torch.mul(logits, 2.0 / cap).sigmoid_()
        ctx.save_for_backward(s)
        return torch.add(torch.tensor(-cap, dtype=s.dtype), s, alpha=2.0 * cap)

    @staticmethod
    def backward(ctx, upstream):
        (s,) = ctx.saved_tensors
        return torch.ops.aten.sigmoid_backward(upstream, s).mul_(4.0), None


def soft_cap(logits, cap):
    """As `_common.soft_cap`; in a chunk loop, `_SoftCap` (first order)."""
    if not _in_chunk.get():
        return _common.soft_cap(logits, cap)
    return _SoftCap.apply(logits, float(cap))


class _LabelLogprobs(torch.autograd.Function):
    """[rows, K (+ 1) (+ 1) (+ 1)]: log softmax(z) at each row's K labels
    and, with `entropy`, H = −Σ p log p, with `log_sum_sq`, log Σ p² (a
    constant), with `logsumexp`, lse = logsumexp(z), last. The gradient, for
    upstream g (the K labels'), h (H's) and s (lse's): Σₖ gₖ·onehotₖ −
    p·(Σₖ gₖ − s + h·(log p + H)), in two passes over the saved log p and p
    (autograd's takes about six; lse's s rides in the same pass)."""

    @staticmethod
    def forward(ctx, logits, labels, entropy, log_sum_sq, logsumexp):
        logp = torch.log_softmax(logits, dim=-1)
        columns = [logp.gather(-1, labels)]
        p = logp.exp() if entropy or log_sum_sq else None
        if entropy:
            columns.append(-torch.linalg.vecdot(p, logp)[:, None])
        if log_sum_sq:
            columns.append(torch.linalg.vecdot(p, p)[:, None].log_())
        if logsumexp:  # lse = z − log p at the first label (finite where the label's logit is)
            columns.append(logits.gather(-1, labels[:, :1]) - columns[0][:, :1])
        ctx.entropy, ctx.logsumexp = entropy, logsumexp
        # p, formed for the entropy or log Σp², is kept: the backward pass needs it too.
        ctx.save_for_backward(logp, labels, *([] if p is None else [p]), *([columns[1]] if entropy else []))
        return torch.cat(columns, dim=-1) if len(columns) > 1 else columns[0]

    @staticmethod
    def backward(ctx, upstream):
        logp, labels, *rest = ctx.saved_tensors
        k = labels.shape[-1]
        picked = upstream[:, :k]
        total = picked.sum(-1, keepdim=True)
        if ctx.logsumexp:  # ∂lse/∂z = p: s joins the −p·Σg term
            total = total - upstream[:, -1:]
        if ctx.entropy:
            p, h = rest
            slope = upstream[:, k : k + 1]
            grad = torch.addcmul(-(total + slope * h), slope, logp, value=-1).mul_(p)
        elif rest:
            grad = rest[0] * -total
        else:
            grad = logp.exp().mul_(-total)
        return grad.scatter_add_(-1, labels, picked), None, None, None, None


def label_logprobs(logits, labels, entropy, log_sum_sq=False, logsumexp=False):
    """As `_common.label_logprobs`; in a chunk loop, `_LabelLogprobs`
    (first order) for float32 and float64 logits."""
    if not _in_chunk.get() or logits.dtype not in (torch.float32, torch.float64):
        return None
    return _LabelLogprobs.apply(logits, labels.to(torch.int64), entropy, log_sum_sq, logsumexp)


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
        with torch.enable_grad(), _chunk_body():
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
                with torch.no_grad(), _chunk_body():
                    chunk = fn(logits, chunk_rows)
            else:
                watched = [x.requires_grad_(True) for x, j in zip(logits, jacobians) if j is not None]
                with torch.enable_grad(), _chunk_body():
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
