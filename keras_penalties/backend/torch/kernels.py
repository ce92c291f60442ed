"""Torch's row kernels: in place where nothing is differentiated, sums exact
to float32 rounding at any size, the proximal step and unit clip as
`torch._foreach_*` and plain torch calls, and, inside a chunk loop,
`autograd.Function`s whose first-order gradient takes fewer passes than
autograd's (`soft_cap`, `label_logprobs`); and torch's own calls on a
composite's few-element state at every training step, in place, where
Keras' dispatch and checks cost more than the math
(bench/results/README.md)."""

import types

import keras
import torch

from keras_penalties import _keras_internals
from keras_penalties.backend import common
from keras_penalties.backend.common import TINY, smallest_normal
from keras_penalties.backend.torch.chunks import in_chunk


# Eager torch forms each log-softmax it is asked for: an objective's terms
# share those of its inputs (num.sharing). A term's own autograd.grad or
# torch.func transform sees x's graph or wraps x afresh, so it is safe.
SHARES_SOFTMAX = True


def js_rows(p, logp, q, logq, beta, axis, reuse=(False, False)):
    """As `common.js_rows`; where nothing is differentiated, in place: m
    and (1 − β)·q are fresh, and log p − log m and log q − log m are formed
    in the caller's `logp` and `logq` where `reuse` says they are its own
    (one fresh tensor each where not: a log-softmax an objective shares
    with its other terms). On CPU each fresh tensor is a page-faulted
    allocation of the whole input's size. The same operations in the same order, so the same bits
    as the differentiable form. Under a `torch.func` transform (`vmap`:
    `ops.vectorized_map`) the differentiable form: a batched result cannot
    be written into an unbatched tensor."""
    if (torch.is_grad_enabled() and any(t.requires_grad for t in (p, logp, q, logq))) or _transform_active():
        return common.js_rows(p, logp, q, logq, beta, axis)
    logm = p * beta
    logm.add_(q * (1.0 - beta)).add_(smallest_normal(p.dtype)).log_()
    from_p = logp.sub_(logm) if reuse[0] else logp - logm
    from_q = logq.sub_(logm) if reuse[1] else logq - logm
    return beta * from_p.mul_(p).sum(axis) + (1.0 - beta) * from_q.mul_(q).sum(axis)


def kl_rows(p, logp, logq, axis):
    """As `common.kl_rows`; where `p` is not differentiated (a teacher's),
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
    return common.softmax_pair(logits, axis, log_softmax)


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


def proximal_step(variables, threshold, shrink, center):
    """As `common.proximal_step`, as `torch._foreach_*` calls on the
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
    """As `common.unit_clip`, in torch ops on each pair: the same passes
    over the tensors without keras.ops' per-call overhead (ten small ops a
    variable), and column norms as √Σx², faster than `linalg.vector_norm`."""
    out = []
    with torch.no_grad():
        for g, w in zip(grads, weights):
            g32, w32 = g, w
            if common.is_half(g.dtype) or common.is_half(w.dtype):
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
    """As `common.soft_cap`; in a chunk loop, `_SoftCap` (first order)."""
    if not in_chunk.get():
        return common.soft_cap(logits, cap)
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
    """As `common.label_logprobs`; in a chunk loop, `_LabelLogprobs`
    (first order) for float32 and float64 logits."""
    if not in_chunk.get() or logits.dtype not in (torch.float32, torch.float64):
        return None
    return _LabelLogprobs.apply(logits, labels.to(torch.int64), entropy, log_sum_sq, logsumexp)


def as_tensor(x):
    """As `common.as_tensor`, without Keras' call for a torch tensor already
    on Keras' device (`_keras_internals.torch_device`), which Keras'
    conversion returns as it is (it moves a tensor with `x.to(device)`,
    which returns `x` on that device): Keras' call is Python paid several
    times per op call in a fit step."""
    if isinstance(x, torch.Tensor) and x.device == torch.device(_keras_internals.torch_device()):
        return x  # what Keras' `x.to(device)` returns
    return keras.ops.convert_to_tensor(x)


def stack(tensors):
    """As `common.stack`, as `torch.stack`: Keras' `ops.stack` converts each
    tensor first, at every call of an objective."""
    return torch.stack(list(tensors))


def add_to_row(variable, row, values):
    """As `common.add_to_row`, in place: one add of the row instead of
    four eager ops over the whole variable (the running term values, at
    every call of an objective). In a stateless scope (a probe) the
    variable's value is the scope's, which is assigned as Keras does."""
    if _keras_internals.in_stateless_scope():
        return common.add_to_row(variable, row, values)
    with torch.no_grad():
        variable.value[row].add_(values)


def reduce_sum(x, axis=None):
    """As `common.reduce_sum`, as `torch.sum`, which Keras' sum calls after
    a conversion and before a cast that change nothing for a float tensor."""
    return torch.sum(x) if axis is None else torch.sum(x, dim=axis)


def divide_by_count(total, n):
    """As `common.divide_by_count`; an int count made a tensor by torch
    directly, without Keras' cast of a Python number."""
    if isinstance(n, int):
        return total / torch.tensor(n, dtype=total.dtype, device=total.device)
    return common.divide_by_count(total, n)


def increment(variable):
    """As `common.increment`, in place: one add instead of an add and an
    assignment through Keras, at every training call of an objective."""
    if _keras_internals.in_stateless_scope():
        return common.increment(variable)
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
    """As `common.assign_all`, in place: Keras' assignment checks and
    converts each value first, at every training step of FAMO's five. In a
    stateless scope the values are the scope's."""
    if _keras_internals.in_stateless_scope():
        return common.assign_all(pairs)
    with torch.no_grad():
        for variable, value in pairs:
            variable.value.copy_(value)
