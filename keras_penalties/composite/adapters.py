"""How each kind of penalty a `Term` holds is evaluated: one small adapter
per kind (a `keras_penalties.ops` function, a Keras Regularizer, a Keras
Loss, any other callable) says how it is called on the tensors a
`CompositeObjective` feeds it and on `(y_true, y_pred, sample_weight)` in a
`CompositeLoss`, whether its value is a sum over samples, and how it is
saved; and the bridge to Keras' Loss reduction."""

import inspect

import keras
from keras import ops

from keras_penalties import _keras_internals, _replicas
from keras_penalties import _validation as check
from keras_penalties import ops as penalties
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops._dtypes import as_float32

OPS = {name: getattr(penalties, name) for name in penalties.PENALTIES}
# A Keras Loss with one of these reductions divides by the batch size (and,
# under a tf.distribute strategy, by the number of replicas).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def scalar(name, value):
    """A term's value as a float32 scalar; anything else is an error naming it."""
    if not ops.is_tensor(value):
        value = ops.convert_to_tensor(value)
    if len(value.shape) == 1 and value.shape[0] == 0:
        # A Keras Loss hands an empty batch's per-sample values back unreduced.
        value = ops.sum(value)
    if len(value.shape) != 0:
        raise ValueError(
            f"Term {name!r} must return a scalar; it returned shape {tuple(value.shape)}. "
            "Use a reduction such as reduction='mean'."
        )
    return value if keras.backend.standardize_dtype(value.dtype) == "float32" else ops.cast(value, "float32")


def loss_result(loss, value):
    """`value`, what Keras' `Loss.__call__` returned, as a scalar: Keras hands
    an empty batch's per-sample values back unreduced."""
    if loss.reduction not in (None, "none") and tuple(value.shape) == (0,):
        return ops.sum(value)
    return value


# Keras' Loss reductions that an ops function's own reduction equals when
# nothing is weighted: "sum_over_batch_size" divides the sum of the
# per-sample values by their number, as the ops' "mean" does.
_OPS_REDUCTION = {"sum_over_batch_size": "mean", "sum": "sum"}


def ops_reduction(loss, y_true, y_pred, sample_weight):
    """The ops `reduction` that gives what Keras' `Loss.__call__` would for
    this call of `loss` when all it would do is reduce the per-sample
    values: no `sample_weight`, no Keras mask on `y_pred`, the tensors
    already of the loss's dtype, float32 or float64 (`y_true` None where the
    loss does not read it), and no tf.distribute replicas to divide a mean
    by; else None, and Keras' own `__call__` is the way (its per-call work
    costs as much as a small term on eager torch: bench/results/README.md)."""
    reduction = _OPS_REDUCTION.get(loss.reduction)
    if reduction is None or sample_weight is not None or loss.dtype not in ("float32", "float64"):
        # (A half-precision loss would round each sample's value before
        # Keras sums them; the ops sum in float32.)
        return None
    if _replicas.keras_divisor() != 1:
        return None
    for t in (y_pred, y_true):
        if t is not None and not (ops.is_tensor(t) and keras.backend.standardize_dtype(t.dtype) == loss.dtype):
            return None
    return reduction if _keras_internals.keras_mask(y_pred) is None else None


def op_named(argument, name):
    """The ops function `name` names; a ValueError naming `argument` otherwise."""
    if name not in OPS:
        raise ValueError(f"`{argument}` must name a keras_penalties.ops function, one of {sorted(OPS)}; got {name!r}.")
    return OPS[name]


def is_op(fn):
    return any(fn is op for op in OPS.values())


class _Penalty:
    """How one kind of penalty is called. The defaults are a plain callable's:
    `fn(*tensors, **options)`; in a CompositeLoss, `fn(y_pred, **options)` on
    float32 copies, which must be a scalar."""

    option_inputs: dict = {}  # tensor option -> the name or position of the input holding it
    sums_over_samples = False  # whether the value grows with the batch
    takes_labels = False  # whether a CompositeLoss feeds (y_true, y_pred)

    def __init__(self, fn, options):
        self.fn = fn
        self.options = options

    def __call__(self, *tensors):
        """The unweighted value on `tensors`."""
        return self.fn(*tensors, **self.options)

    def loss_tensors(self, y_true, y_pred):
        """What the penalty reads of a CompositeLoss's (y_true, y_pred)."""
        return (y_true, y_pred) if self.takes_labels else (y_pred,)

    def loss_value(self, name, y_true, y_pred, sample_weight):
        """The unweighted float32 value in a CompositeLoss on this replica's
        batch, as one device would compute it on that batch."""
        return scalar(name, self(*self.loss_tensors(as_float32(y_true), as_float32(y_pred))))

    def config(self):
        return keras.saving.serialize_keras_object(self.fn)

    @property
    def label(self):
        return type(self.fn).__name__


def _weighed_like_a_loss(name, loss, y_true, y_pred, sample_weight):
    """A Keras Loss's value with `sample_weight` and the Keras mask `y_pred`
    carries (read before any cast: a float32 copy of a half `y_pred` has
    none), as one device would compute it on this replica's batch; where
    masked means are the global batch's (`reductions.global_means_active`),
    what makes the replicas' mean the global batch's value
    (`_global_share`)."""
    if not reductions.global_means_active():
        value = scalar(name, loss(y_true, y_pred, sample_weight=sample_weight))
        if getattr(loss, "reduction", None) in _MEAN_REDUCTIONS:
            value = _replicas.unshare(value)
        return value
    if type(loss).__call__ is keras.losses.Loss.__call__:
        # Keras' own steps, to see the mask it reduces with (a loss may add
        # its own, as `ignore_class` does) and whether it reduced at all.
        values, mask = _keras_internals.loss_values_and_mask(loss, y_true, y_pred)
        reduction = loss.reduction
        value = scalar(name, _keras_internals.reduce_loss_values(values, sample_weight, mask, reduction, loss.dtype))
        reduced = tuple(values.shape) not in ((), (0,))
    else:
        # The package's Losses, whose values carry no mask of their own.
        value = scalar(name, loss(y_true, y_pred, sample_weight=sample_weight))
        mask, reduction, reduced = _keras_internals.keras_mask(y_pred), loss.reduction, True
    if reduced and reduction in _MEAN_REDUCTIONS:
        value = _replicas.unshare(value)
        value = _global_share(value, reduction, sample_weight, mask)
    return value


def _global_share(value, reduction, sample_weight, mask):
    """A replica's mean `value` rescaled so that the replicas' values average
    to the global batch's mean where Keras' divisor depends on the data
    (each replica divides by its own): the positions the Keras mask keeps
    ("sum_over_batch_size", "mean"), the sample weights merged with the
    mask ("mean_with_sample_weight"). value·d / (Σ_replicas d / replicas)."""
    if reduction == "mean_with_sample_weight" and (sample_weight is not None or mask is not None):
        weights = _keras_internals.loss_sample_weight(sample_weight, mask, reduction)
    elif mask is not None and reduction != "mean_with_sample_weight":
        weights = mask
    else:
        return value  # the number of values: the same on every replica
    divisor = ops.sum(ops.cast(weights, "float32"))
    return ops.divide_no_nan(value * divisor, reductions.kept_divisor(divisor, floor=0.0))


class _OpPenalty(_Penalty):
    """A `keras_penalties.ops` function: options checked now; its tensor
    options (`mask`, `weights`, `old_logprobs`: the op's `tensor_options`)
    name the inputs holding them; in a CompositeLoss, fed (y_true, y_pred)
    when its signature takes two tensors, and reduced as a Loss term is
    when it has per-sample values."""

    def __init__(self, fn, options):
        if fn.per_element:  # Keras' activity-regularizer scale: not the batch size's
            options.setdefault("reduction", "sum_over_batch_size")
        options = fn.check_options(complete=True, **options)
        inputs = {name: options[name] for name in fn.tensor_options if options.get(name) is not None}
        for name, key in inputs.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(
                    f"A Term's `options[{name!r}]` names the input that holds it (a dict key "
                    f"or a list position, like `inputs`); got {type(key).__name__}. Feed the "
                    "tensor to the objective beside the others and name it here."
                )
        super().__init__(fn, options)
        self.option_inputs = inputs
        self.sums_over_samples = options.get("reduction") == "sum"
        required = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is inspect.Parameter.empty
        ]
        self.takes_labels = len(required) == 2
        self._tensors_needed = len(required)
        # Per-sample values to weigh: a Loss of them. A batch statistic
        # (`kl_sparsity`, `orthogonality`, …) has no sample to weigh,
        # reduction="none" is no scalar (an error where it is computed), and
        # a sequence reduction is the op's own.
        has_samples = "reduction" in inspect.signature(fn).parameters and options.get("reduction") in (
            None,
            "mean",
            "sum",
            "sum_over_batch_size",
        )
        self._loss = _OpLoss(self) if has_samples else None

    def __call__(self, *tensors):
        if self.option_inputs:
            given = len(tensors) - len(self.option_inputs)
            options = dict(zip(self.option_inputs, tensors[given:]))
            return self.fn(*tensors[:given], **{**self.options, **options})
        return self.fn(*tensors, **self.options)

    def loss_tensors(self, y_true, y_pred):
        if self.option_inputs:
            raise ValueError(
                f"{self.fn.__name__}: options {sorted(self.option_inputs)} name inputs, and a CompositeLoss "
                "term gets only (y_true, y_pred). Use a CompositeObjective with `inputs=(...)`."
            )
        if self._tensors_needed > 2:
            raise ValueError(
                f"{self.fn.__name__} takes {self._tensors_needed} tensors; a CompositeLoss term gets "
                "(y_true, y_pred). Use it in a CompositeObjective with `inputs=(...)`, or in a "
                "model's `compute_loss`."
            )
        if self.fn.prediction_first:
            return (y_pred, y_true)
        return super().loss_tensors(y_true, y_pred)

    def loss_value(self, name, y_true, y_pred, sample_weight):
        if self.options.get("reduction") in (*check.SEQUENCE_REDUCTIONS, "constant"):
            return self._sequence_value(name, y_true, y_pred, sample_weight)
        if self._loss is None:
            return super().loss_value(name, y_true, y_pred, sample_weight)
        return _weighed_like_a_loss(name, self._loss, y_true, y_pred, sample_weight)

    def _sequence_value(self, name, y_true, y_pred, sample_weight):
        """A sequence reduction in a CompositeLoss: the op reduces with the
        Keras mask `y_pred` carries (read before any cast); sample weights
        have no place in a mean over sequences."""
        if sample_weight is not None:
            raise ValueError(
                f"Term {name!r}: reduction={self.options['reduction']!r} averages over sequences with the "
                "mask alone; a CompositeLoss's sample_weight does not apply. Give the mask as the "
                "predictions' Keras mask, or use reduction='mean' with sample weights."
            )
        mask = _keras_internals.keras_mask(y_pred)
        tensors = self.loss_tensors(as_float32(y_true), as_float32(y_pred))
        options = self.options if mask is None else {**self.options, "mask": mask}
        return scalar(name, self.fn(*tensors, **options))

    def per_sample(self, *tensors):
        """One value per sample (per position for the divergences)."""
        values = self.fn(*tensors, **{**self.options, "reduction": "none"})
        if self.fn.per_element and len(values.shape) > 1:
            # One value per sample: its sum ("sum", "sum_over_batch_size") or
            # its mean ("mean") over every axis but the batch.
            axes = tuple(range(1, len(values.shape)))
            mean = self.options.get("reduction") == "mean"
            values = ops.mean(values, axis=axes) if mean else ops.sum(values, axis=axes)
        return values

    def config(self):
        return self.fn.__name__

    @property
    def label(self):
        return self.fn.__name__


class _OpLoss(keras.losses.Loss):
    """An ops-function term of a `CompositeLoss` as a Keras Loss, so that it
    meets sample weights and masks exactly as a Loss term does: `call` gives
    the per-sample values, and Keras' own `Loss.__call__` applies
    `sample_weight`, the Keras mask `y_pred` carries and the reduction —
    `"sum"` for a term with `options={"reduction": "sum"}`, else
    `"sum_over_batch_size"` (Keras' default, which the ops' `"mean"` equals
    when nothing is weighted)."""

    def __init__(self, penalty):
        reduction = "sum" if penalty.options.get("reduction") == "sum" else "sum_over_batch_size"
        super().__init__(name=penalty.fn.__name__, reduction=reduction, dtype="float32")
        self.penalty = penalty

    def __call__(self, y_true, y_pred, sample_weight=None):
        if not self.penalty.takes_labels:
            y_true = y_pred  # not read; Loss.__call__ converts it
        return loss_result(self, super().__call__(y_true, y_pred, sample_weight))

    def call(self, y_true, y_pred):
        return self.penalty.per_sample(*self.penalty.loss_tensors(y_true, y_pred))


class _RegularizerPenalty(_Penalty):
    """A `keras.regularizers.Regularizer` on one tensor, divided by the batch
    size as Keras divides an activity regularizer (0 for no samples); in a
    CompositeLoss, on y_pred."""

    def __call__(self, *tensors):
        if len(tensors) != 1:
            raise ValueError(f"a Regularizer takes one tensor; got {len(tensors)}.")
        (x,) = tensors
        value = self.fn(x)
        if len(x.shape) > 0:
            value = value / ops.cast(reductions.batch_size(x), value.dtype)
        return value


class _LossPenalty(_Penalty):
    """A `keras.losses.Loss` on (y_true, y_pred), or on y_pred alone when it
    says it needs no y_true; in a CompositeLoss, with the sample weights and
    the mask, exactly as if it were compiled alone."""

    takes_labels = True

    def __init__(self, fn, options):
        super().__init__(fn, options)
        self.sums_over_samples = getattr(fn, "reduction", None) == "sum"

    def __call__(self, *tensors):
        if len(tensors) == 2:
            return self.fn(*tensors)
        if len(tensors) == 1 and not getattr(self.fn, "needs_y_true", True):
            return self.fn(None, tensors[0])
        raise ValueError(
            f"a Loss takes two tensors (y_true, y_pred); got {len(tensors)}. "
            "Give the term `inputs=(reference, prediction)`."
        )

    def loss_value(self, name, y_true, y_pred, sample_weight):
        return _weighed_like_a_loss(name, self.fn, y_true, y_pred, sample_weight)


def penalty_of(penalty, options):
    """The adapter for `penalty` (anything `Term` accepts) with `options`."""
    if isinstance(penalty, type):
        raise TypeError(
            f"`penalty` must be an instance, not the class {penalty.__name__}: write e.g. {penalty.__name__}(...)."
        )
    if isinstance(penalty, str):
        penalty = op_named("penalty", penalty)
    if is_op(penalty):
        return _OpPenalty(penalty, options)
    if isinstance(penalty, (keras.regularizers.Regularizer, keras.losses.Loss)):
        if options:
            raise ValueError(
                f"`options` apply to ops functions and plain callables; "
                f"configure a {type(penalty).__name__} through its constructor."
            )
        kind = _RegularizerPenalty if isinstance(penalty, keras.regularizers.Regularizer) else _LossPenalty
        return kind(penalty, options)
    if callable(penalty):
        return _Penalty(penalty, options)
    raise TypeError(
        "`penalty` must be an ops function name, an ops function, a "
        f"Regularizer, a Loss or a callable; got {penalty!r}."
    )
