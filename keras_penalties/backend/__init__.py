"""The one place with backend-specific code.

One module per Keras backend (`jax`, `tensorflow`, `torch`), each defining
the same functions, chosen once when keras_penalties is imported, as Keras
organises `keras/src/backend/`:

- `gradients(fn, tensors)`: gradients of the scalar `fn(*tensors)` w.r.t.
  each tensor, kept differentiable (double backprop).
- `parameter_probe(trainable, others, outputs, num_outputs, grad_norms)`:
  compiles, once, values and per-output gradient norms w.r.t. `trainable`.
- `softmax_pair(logits, axis, log_softmax=None)`: `(p, log p)` of logits,
  the cheaper way on that backend (shared exp under XLA; exp(log_softmax)
  on TF, and on torch below 16 classes), reusing `log_softmax` if given.
- `js_rows(p, logp, q, logq, beta, axis, reuse=(False, False))`: the
  generalized Jensen-Shannon divergence of each row from its distributions
  and their logs (on torch, where nothing is differentiated, in place in
  whichever of the caller's `logp` and `logq` `reuse` marks as its own).
- `pick_labels(values, labels, axis)`: each position's entry of `values`
  at its integer label along `axis` (a gather; on JAX one whose gradient
  is a select that XLA fuses, not a scatter into a zeroed buffer).
- `label_cross_entropy(logits, labels, axis)`: −log softmax(logits) at
  each position's label by a cheaper way than a log-softmax and a pick, or
  None where there is none (TF inside a chunk loop: the fused
  `sparse_softmax_cross_entropy_with_logits`, which has no second
  derivative, and a chunk's gradient is first order anyway).
- `smallest_normal(dtype)`: the smallest normal number of a float dtype, a
  Python float (the floor of the package's logs).
- `map_chunks(fn, chunks, dtype)`: `fn` over the leading axis of a tuple
  of tensors, stacked, one chunk at a time, each row's gradient formed
  with its value so that the backward pass recomputes nothing (a
  `custom_vjp` scan on JAX, a custom gradient's loop on TF, an
  `autograd.Function`'s loop on torch).
- `chunked_sum(fn, rows, shared, weights, chunk_size, dtype)`: the scalar
  Σᵣ weights[r]·fn(chunk of `rows`, `shared`)[r] over chunks of
  `chunk_size` rows, whose gradient w.r.t. the rows and `shared` (e.g.
  hidden states and a vocabulary projection) is formed in the forward pass
  for the inputs that need one (a `custom_vjp`, a `custom_gradient`, an
  `autograd.Function`), so nothing is recomputed and no chunk's temporaries
  outlive it.
- `SHARES_SOFTMAX`: whether an objective's terms share the (log-)softmax
  of its inputs (`ops._numerics.sharing`; torch only: XLA and TF's graph
  optimizer merge repeated ones).
- `CHUNK_ELEMENTS`, `HEAD_CHUNK_ELEMENTS`: elements per chunk for
  `chunk_size="auto"` (rows = elements // classes), of formed logits
  (`map_chunks`) and of logits formed from hidden states (`chunked_sum`):
  the fastest measured on the benchmark machine (bench/results/README.md).
- `project(rows, kernel, transpose_kernel)`: `rows @ kernel`, or
  `rows @ kernelᵀ` without a transposed copy of the kernel.
- `sum_of_squares(x)`: Σx² in one pass over x, exact to float32 rounding
  at any size (dots of x with itself, in rows, on torch).
- `sum_abs(x)`: Σ|x| in one pass over x, exact to float32 rounding at any
  size (a 1-norm; abs-then-sum a block at a time on torch).
- `as_tensor(x)`: `ops.convert_to_tensor(x)`; on torch a tensor already
  on Keras' device as it is, without Keras' call.
- `stack(tensors)`: `ops.stack` along a new first axis (`torch.stack` on
  torch: without Keras' conversion of each tensor).
- `add_to_row(variable, row, values)`: variable[row] += values, for the
  running values of a composite (in place on torch).
- `increment(variable)`: variable += 1, for a composite's step count (in
  place on torch).
- `reduce_sum(x, axis=None)`: `ops.sum` of a float tensor (`torch.sum`
  itself on torch).
- `divide_by_count(total, n)`: total / n for a count, as a tensor of
  total's dtype.
- `proximal_step(variables, threshold, shrink, center)`: the L1 / L2 /
  elastic-net proximal step of `ProximalDecay`, in place on each variable
  (`torch._foreach_*` calls on torch).
- `unit_clip(grads, weights, clip_factor, eps)`: adaptive gradient
  clipping of each gradient by its variable's unit norms (plain torch ops
  on torch).
- `keep_for_metrics(variables)`, `kept_for_metrics(kept, variables)`: a
  composite's running state as its forward pass left it, for the same
  step's metrics where they cannot read the variables (JAX's `fit` reads
  metrics in a scope of their own: the forward pass's tracers, kept with
  their gradient stopped); None on TF and torch, whose metrics read the
  variables.
- `row_shards()`: how many devices a chunked op's rows are split over
  inside one computation (JAX's `DataParallel`, where `map_chunks` and
  `chunked_sum` run each device's own chunks); 1 elsewhere.
- `replicas_in_sync()`: how many replicas share the current step (a
  `tf.distribute` replica context); 1 everywhere else.
- `sum_over_replicas(tensors, keep_losses_of=None)`: each tensor summed
  over the replicas of a `tf.distribute` replica context (None stays
  None), keeping the add_loss lists of the layer `keep_losses_of` (the
  model whose forward pass the sum runs in) as they were; the tensors
  themselves everywhere else.
- `loss_replicas()`: what Keras' own losses divide a mean by for
  distribution (`scale_loss_for_distribution`).
- `outside_distribution(fn)`: runs `fn()` as on one device, where Keras
  would otherwise scale losses for a distribution strategy.
"""

import importlib

import keras

_BACKEND = keras.backend.backend()
if _BACKEND not in ("jax", "tensorflow", "torch"):
    raise ImportError(
        f"keras_penalties supports the jax, tensorflow and torch backends; "
        f"the current Keras backend is {_BACKEND!r}."
    )
_module = importlib.import_module(f"keras_penalties.backend.{_BACKEND}")

gradients = _module.gradients
parameter_probe = _module.parameter_probe
replicas_in_sync = _module.replicas_in_sync
row_shards = _module.row_shards
keep_for_metrics = _module.keep_for_metrics
kept_for_metrics = _module.kept_for_metrics
softmax_pair = _module.softmax_pair
js_rows = _module.js_rows
smallest_normal = _module.smallest_normal
pick_labels = _module.pick_labels
label_cross_entropy = _module.label_cross_entropy
sum_of_squares = _module.sum_of_squares
sum_abs = _module.sum_abs
stack = _module.stack
as_tensor = _module.as_tensor
proximal_step = _module.proximal_step
add_to_row = _module.add_to_row
increment = _module.increment
reduce_sum = _module.reduce_sum
divide_by_count = _module.divide_by_count
unit_clip = _module.unit_clip
map_chunks = _module.map_chunks
chunked_sum = _module.chunked_sum
project = _module.project
sum_over_replicas = _module.sum_over_replicas
loss_replicas = _module.loss_replicas
outside_distribution = _module.outside_distribution
CHUNK_ELEMENTS = _module.CHUNK_ELEMENTS
SHARES_SOFTMAX = _module.SHARES_SOFTMAX
HEAD_CHUNK_ELEMENTS = _module.HEAD_CHUNK_ELEMENTS

__all__ = [
    "CHUNK_ELEMENTS",
    "HEAD_CHUNK_ELEMENTS",
    "SHARES_SOFTMAX",
    "add_to_row",
    "as_tensor",
    "chunked_sum",
    "divide_by_count",
    "gradients",
    "increment",
    "js_rows",
    "keep_for_metrics",
    "kept_for_metrics",
    "label_cross_entropy",
    "loss_replicas",
    "map_chunks",
    "outside_distribution",
    "parameter_probe",
    "pick_labels",
    "project",
    "proximal_step",
    "reduce_sum",
    "replicas_in_sync",
    "row_shards",
    "smallest_normal",
    "softmax_pair",
    "stack",
    "sum_abs",
    "sum_of_squares",
    "sum_over_replicas",
    "unit_clip",
]
