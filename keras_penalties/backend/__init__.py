"""The one place with backend-specific code.

One package per Keras backend (`jax/`, `tensorflow/`, `torch/`), chosen
once when keras_penalties is imported, each with the same modules, one a
concern of the contract below, as Keras gives every backend the same file
names (`keras/src/backend/{jax,tensorflow,torch}/{core,nn,numpy,...}.py`):
who found `chunked_sum` on JAX finds it on torch in the same file. A
backend's concern module defines the names it does its own way; `common.py`
holds the one-device defaults of the others, what Keras' own ops already do
well. `CONTRACT` maps each concern to its names (documented below, by
concern); importing fails if a name is defined by neither the concern's
module nor `common`, and a test fails if a backend defines a contract name
outside its concern's module or lacks a concern's module. What one backend
alone needs has a named module of its own (`blocks.py` on JAX and TF,
`tracing.py` on TF) and defines no contract name. Callers import only
`keras_penalties.backend`.

`autodiff`: gradients, the parameter probe, what a trace allows.
- `gradients(fn, tensors)`: gradients of the scalar `fn(*tensors)` w.r.t.
  each tensor, kept differentiable (double backprop).
- `parameter_probe(trainable, others, outputs, num_outputs, grad_norms, batched=False, update=None)`:
  compiles, once, values and per-output gradient norms w.r.t. `trainable`
  (`outputs(trainable_values, other_values, x, y)`; torch passes None for
  the others' values, which are their variables' own tensors); `probe(x,
  y)` gives `(values, norms, result)`. `batched`: the outputs all reach
  `trainable` through the same layers, and eager torch takes their
  gradients in one backward pass batched over them, or a pass an output
  where vmap cannot batch a backward (the chunk loops); JAX and TF compile
  the probe and keep a pass an output. `update`: `(fn, state)`;
  `result = fn(values, norms)` runs after the measurement, in the same
  compiled call, outside its stateless scope, and what it assigns to the
  model's variables other than `trainable`, or to `state` (variables of the
  caller's), stays assigned (JAX reads every variable through a scope and
  assigns, after the call, those `fn` assigned; a variable `fn` reads that
  is neither the model's nor in `state` would be a constant of the jitted
  call there); result None without it.
- `traced_outside_scope(x)`: whether `x` is a value of a trace that no
  variable may hold (a user's `jax.jit` with no stateless scope): the
  composites then leave their running sums alone. False on TF and torch.
- `keep_for_metrics(variables)`, `kept_for_metrics(kept, variables)`: a
  composite's running state as its forward pass left it, for the same
  step's metrics where they cannot read the variables (JAX's `fit` reads
  metrics in a scope of their own: the forward pass's tracers, kept with
  their gradient stopped); None on TF and torch, whose metrics read the
  variables.

`kernels`: the row kernels, the sums, the proximal step, dtype facts, and
the calls on a composite's few-element state at every training step.
- `softmax_pair(logits, axis, log_softmax=None)`: `(p, log p)` of logits,
  the cheaper way on that backend (shared exp under XLA; exp(log_softmax)
  on TF, and on torch below 16 classes), reusing `log_softmax` if given.
- `js_rows(p, logp, q, logq, beta, axis, reuse=(False, False))`: the
  generalized Jensen-Shannon divergence of each row from its distributions
  and their logs (on torch, where nothing is differentiated, in place in
  whichever of the caller's `logp` and `logq` `reuse` marks as its own).
- `kl_rows(p, logp, logq, axis)`: Σ p (log p − log q) along `axis`, all
  three of one shape and dtype (on torch, where p is not differentiated,
  the product formed in place in the difference).
- `pick_labels(values, labels, axis)`: each position's entry of `values`
  at its integer label along `axis` (a gather; on JAX one whose gradient
  is a select that XLA fuses, not a scatter into a zeroed buffer).
- `label_cross_entropy(logits, labels, axis)`: −log softmax(logits) at
  each position's label by a cheaper way than a log-softmax and a pick, or
  None where there is none (TF inside a chunk loop: the fused
  `sparse_softmax_cross_entropy_with_logits`, which has no second
  derivative, and a chunk's gradient is first order anyway).
- `label_logprobs(logits, labels, entropy, log_sum_sq=False, logsumexp=False)`:
  [rows, K (+ 1) (+ 1) (+ 1)], log softmax(logits) [rows, V] at each row's
  K labels and, with `entropy`, the row's entropy, with `log_sum_sq` its
  log Σp² (a constant), with `logsumexp` its lse (differentiable), last,
  by a cheaper way than a log-softmax, a pick and an
  entropy, or None where there is none (torch inside a chunk loop: an
  `autograd.Function` whose gradient is two passes over the chunk, first
  order).
- `soft_cap(logits, cap)`: cap·tanh(logits / cap) (torch inside a chunk
  loop: an `autograd.Function` whose gradient is one pass, first order).
- `sum_of_squares(x)`: Σx² in one pass over x, exact to float32 rounding
  at any size (dots of x with itself, in rows, on torch).
- `sum_abs(x)`: Σ|x| in one pass over x, exact to float32 rounding at any
  size (a 1-norm; abs-then-sum a block at a time on torch).
- `proximal_step(variables, threshold, shrink, center)`: the L1 / L2 /
  elastic-net proximal step of `ProximalDecay`, in place on each variable
  (`torch._foreach_*` calls on torch).
- `unit_clip(grads, weights, clip_factor, eps)`: adaptive gradient
  clipping of each gradient by its variable's unit norms (plain torch ops
  on torch).
- `smallest_normal(dtype)`: the smallest normal number of a float dtype, a
  Python float (the floor of the package's logs).
- `is_half(dtype)`: whether a dtype is float16 or bfloat16 (the package
  computes those in float32).
- `SHARES_SOFTMAX`: whether an objective's terms share the (log-)softmax
  of its inputs (`ops._numerics.sharing`; torch only: XLA and TF's graph
  optimizer merge repeated ones).
- `as_tensor(x)`: `ops.convert_to_tensor(x)`; on torch a tensor already
  on Keras' device as it is, without Keras' call.
- `stack(tensors)`: `ops.stack` along a new first axis (`torch.stack` on
  torch: without Keras' conversion of each tensor).
- `add_to_row(variable, row, values)`: variable[row] += values, for the
  running values of a composite (in place on torch).
- `increment(variable)`: variable += 1, for a composite's step count (in
  place on torch).
- `SMALL_OPS`: the calls a composite's update makes on its few-element
  tensors at every training step (FAMO's): stop_gradient, log, exp, relu,
  softmax (last axis), sum, power, sqrt and stack; `keras.ops` itself,
  torch's own calls on torch.
- `assign_all(pairs)`: each `(variable, value)` pair's variable set to its
  value (a composite's state after a step; in place on torch, in one
  `no_grad` block).
- `reduce_sum(x, axis=None)`: `ops.sum` of a float tensor (`torch.sum`
  itself on torch).
- `divide_by_count(total, n)`: total / n for a count, as a tensor of
  total's dtype.

`chunks`: the chunk loops and their budgets.
- `map_chunks(fn, chunks, dtype)`: `fn` over the leading axis of a tuple
  of tensors, stacked, one chunk at a time, each row's gradient formed
  with its value so that the backward pass recomputes nothing (a
  `custom_vjp` scan on JAX, a custom gradient's loop on TF, an
  `autograd.Function`'s loop on torch).
- `chunked_sum(fn, rows, heads, weights, chunk_size, dtype)`: `(total,
  columns)`: the scalar total Σᵣ weights[r]·fn(chunk logits of `heads`,
  chunk of `rows`)[r] over chunks of `chunk_size` rows (`heads`: a list of
  `_types.Head(rows, kernel, bias, transpose)`, each head's logits formed
  a chunk at a time), whose gradient w.r.t. the
  rows and the heads (hidden states and a vocabulary projection) is
  formed in the forward pass for the inputs that need one (a `custom_vjp`,
  a `custom_gradient`, an `autograd.Function`), so nothing is recomputed
  and no chunk's temporaries outlive it. With weights [n, k] and fn giving
  [rows, k] (several sums over the same logits, e.g. a Distiller's losses),
  `columns` are the k sums Σᵣ weights[r, j]·fn(…)[r, j], not differentiated
  (the total is theirs); with weights [n], `columns` is the total.
- `chunked_values(fn, rows, heads, chunk_size, dtype)`: the per-row
  values fn(logits, rows)[r] ([n], or [n, k] for k values a row) over
  chunks of `chunk_size` rows (the heads' logits formed a chunk at a time,
  as in `chunked_sum`), with no gradient formed in the forward pass: the
  upstream gradient (the values' shape) is known only in the backward
  pass, which forms each chunk again as `chunked_sum` with it as the
  weights.
- `project(rows, kernel, transpose_kernel)`: `rows @ kernel`, or
  `rows @ kernelᵀ` without a transposed copy of the kernel.
- `CHUNK_ELEMENTS`, `HEAD_CHUNK_ELEMENTS`: elements per chunk for
  `chunk_size="auto"` (rows = elements // classes), of formed logits
  (`map_chunks`) and of logits formed from hidden states (`chunked_sum`):
  the fastest measured on the benchmark machine (bench/results/README.md).


`distribution`: row shards, replicas, the sums and homes of SPEC §11, processes.
- `row_shards()`: how many devices a chunked op's rows are split over
  inside one computation (JAX's `DataParallel`, where `map_chunks` and
  `chunked_sum` run each device's own chunks); 1 elsewhere.
- `replicas_in_sync()`: how many replicas' forward passes make up the
  current step, each on its own rows: a `tf.distribute` replica context's;
  on torch, the processes of `torch.distributed`'s default group while
  gradients are recorded (a training step, whose gradients DDP averages)
  outside a probe; 1 everywhere else.
- `gradients_in_sync()`: how many replicas hold a part of the gradients an
  optimizer is handed, summed after it (a `tf.distribute` replica
  context); 1 everywhere else (DDP averages them before the optimizer).
- `sum_over_replicas(tensors, keep_losses_of=None)`: each tensor summed
  over those replicas (None stays None), keeping the add_loss lists of the
  layer `keep_losses_of` (the model whose forward pass the sum runs in) as
  they were; the tensors themselves where there is one. On torch no
  gradient flows through the sum (the package sums counts and frozen
  values).
- `gather_over_replicas(tensors, keep_losses_of=None)`: each tensor's
  values on every replica in sync, concatenated along axis 0 in replica
  order, with no gradient (a quantile over the global batch:
  `ops.entropy_mask`), keeping add_loss lists as `sum_over_replicas`
  does; the tensors themselves where there is one (a JAX batch sharded
  over devices is one array already).
- `variable_home(model=None)`: where a variable made now (or `model`'s
  variables) lives: the `tf.distribute` strategy, the Keras distribution
  on JAX; None outside any (and always on torch).
- `made_at(home)`: a context in which variables are made at `home`.
- `one_process()`: a context in which each process computes alone, as on
  one device (torch processes under DDP; nothing elsewhere).
- `loss_replicas()`: what Keras' own losses divide a mean by for
  distribution (`scale_loss_for_distribution`).
- `outside_distribution(fn)`: `fn()` run where no `tf.distribute`
  strategy, Keras distribution or dtype policy set in the caller's thread
  is in effect (its result returned, its exception raised): on the
  package's one host thread if one is, else here: values are whole, as on
  one device, and losses unscaled (the probe on TF; GradNorm's weights
  and their optimizer are made there on every backend).
"""

import importlib
from typing import TYPE_CHECKING, Any

import keras

from keras_penalties.backend import common

# The contract: each concern's names, documented above, in that order.
CONTRACT = {
    "autodiff": (
        "gradients",
        "parameter_probe",
        "traced_outside_scope",
        "keep_for_metrics",
        "kept_for_metrics",
    ),
    "kernels": (
        "softmax_pair",
        "js_rows",
        "kl_rows",
        "pick_labels",
        "label_cross_entropy",
        "label_logprobs",
        "soft_cap",
        "sum_of_squares",
        "sum_abs",
        "proximal_step",
        "unit_clip",
        "smallest_normal",
        "is_half",
        "SHARES_SOFTMAX",
        "as_tensor",
        "stack",
        "add_to_row",
        "increment",
        "SMALL_OPS",
        "assign_all",
        "reduce_sum",
        "divide_by_count",
    ),
    "chunks": (
        "map_chunks",
        "chunked_sum",
        "chunked_values",
        "project",
        "CHUNK_ELEMENTS",
        "HEAD_CHUNK_ELEMENTS",
    ),
    "distribution": (
        "row_shards",
        "replicas_in_sync",
        "gradients_in_sync",
        "sum_over_replicas",
        "gather_over_replicas",
        "variable_home",
        "made_at",
        "one_process",
        "loss_replicas",
        "outside_distribution",
    ),
}

_BACKEND = keras.backend.backend()
if _BACKEND not in ("jax", "tensorflow", "torch"):
    raise ImportError(
        f"keras_penalties supports the jax, tensorflow and torch backends; the current Keras backend is {_BACKEND!r}."
    )
for _concern, _names in CONTRACT.items():
    _module = importlib.import_module(f"keras_penalties.backend.{_BACKEND}.{_concern}")
    _missing = [name for name in _names if not hasattr(_module, name) and not hasattr(common, name)]
    if _missing:
        raise ImportError(
            f"neither keras_penalties.backend.{_BACKEND}.{_concern} nor backend.common defines {', '.join(_missing)}"
        )
    globals().update({name: getattr(_module if hasattr(_module, name) else common, name) for name in _names})
__all__ = [name for names in CONTRACT.values() for name in names]

if TYPE_CHECKING:
    # For type checkers, which cannot see the names set above: each is Any.
    def __getattr__(name: str) -> Any: ...
