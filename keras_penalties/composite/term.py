"""`Term`: one named penalty of a composite with its weight (a number or a
schedule of the training step), the inputs it reads, its options and its
custom metrics; and `build_terms`, which checks a composite's terms."""

import functools
import re
from typing import Any, Callable

import keras

from keras_penalties import _validation as check
from keras_penalties.composite.adapters import is_op, op_named, penalty_of, scalar
from keras_penalties._types import InputKeys, Penalty, PenaltyName, Tensor, TensorLike, Weight
from keras_penalties.composite.weighting import check_weight, is_schedule

METRIC_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")


# ---------------------------------------------------------------- metrics


def _metric_op(argument, name):
    """An ops function named as a metric (by `argument`), with the default
    reduction a term by that name gets."""
    fn = op_named(argument, name)
    if fn.per_element:
        return functools.partial(fn, reduction="sum_over_batch_size")
    return fn


def _check_metrics(metrics):
    """`metrics`: None or a dict name → ops function name or callable."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"`metrics` must be a dict of name -> function or ops function name; got {metrics!r}.")
    checked = {}
    for name, fn in metrics.items():
        if not isinstance(name, str) or not METRIC_NAME_PATTERN.match(name):
            raise ValueError(
                f"`metrics` names must be non-empty strings usable as metric names "
                f"(letters, digits, '_', '.', '-'); got {name!r}."
            )
        if isinstance(fn, str):
            fn = _metric_op(f"metrics[{name!r}]", fn)
        elif not callable(fn) or isinstance(fn, type):
            raise TypeError(f"`metrics[{name!r}]` must be a callable or an ops function name; got {fn!r}.")
        checked[name] = fn
    return checked


def _serialize_metric(fn):
    if isinstance(fn, functools.partial) and is_op(fn.func):
        return fn.func.__name__
    if is_op(fn):
        return fn.__name__
    return keras.saving.serialize_keras_object(fn)


def _loadable(name, obj):
    """What `Term.from_config` may rebuild: Keras objects, schedules, ops
    functions and objects registered with Keras; a `.keras` file naming any
    other importable function (`keras.config.set_floatx`) is refused."""
    if isinstance(
        obj, (keras.regularizers.Regularizer, keras.losses.Loss, keras.optimizers.schedules.LearningRateSchedule)
    ):
        return obj
    if is_op(obj):
        return obj
    registered = keras.saving.get_registered_name(obj)
    if ">" in registered and keras.saving.get_registered_object(registered) is obj:
        return obj
    raise ValueError(
        f"Term `{name}` {obj!r} is neither a keras_penalties.ops function, a Loss, a "
        "Regularizer, a schedule, nor a function registered with "
        "keras.saving.register_keras_serializable; refusing to load it."
    )


# ---------------------------------------------------------------- Term


# The package name where 0.1.0 registered it: saved files name it so.
@keras.saving.register_keras_serializable(package="keras_penalties")
class Term:
    """One named entry of a `CompositeObjective` or `CompositeLoss`.

    Args:
        penalty: the name of a `keras_penalties.ops` function (`"l1"`,
            `"entropy"`, `"kl_divergence"`, …, called with `**options`), such
            a function itself, a `keras.regularizers.Regularizer`, a
            `keras.losses.Loss`, or any callable returning a scalar.
        weight: a number ≥ 0, or a `keras.optimizers.schedules.LearningRateSchedule`
            (or any serializable callable of the step): its value at training
            step t (0-based, as for learning rates) weights step t.
        inputs: names (for dict inputs) or positions (for list inputs) of the
            tensors the penalty takes, in order; a Loss gets them as
            (y_true, y_pred). `None`: the single tensor (or all list entries).
        enabled: whether the term counts in the total.
        options: keyword options for the penalty; checked now for ops
            functions. An ops function's tensor options — `mask` (of the
            divergences, `entropy`, `cross_entropy`, `kl_estimate`,
            `policy_loss`, `topk_kl`), `weights` (`policy_loss`),
            `old_logprobs` (`kl_estimate`) — name an input (a dict key or a
            list position, like `inputs`): the tensor fed beside the
            others, e.g. `options={"from_logits": True, "mask": "mask"}`.
        metrics: dict name → callable of the same tensors (or the name of an
            ops function, with the default reduction a term of that name
            gets), returning a scalar: extra numbers reported beside the term
            as `"<objective>/<term>/<metric>"` (with `PenaltyMonitor`) and
            under `"custom"` in `report`, never added to the loss.

    A Regularizer term contributes what it would as an `activity_regularizer=`
    (Keras divides it by the batch size).

    Saving: a term, weight or metric that is your own function is saved by
    name and loads only if it is registered with
    `@keras.saving.register_keras_serializable(package=...)`; otherwise
    `load_model` fails with "Could not locate function '<name>'". Ops
    function names, Losses, Regularizers and schedules need nothing.

    Example:

    >>> from keras_penalties import Term
    >>> Term("entropy", 0.1, options={"from_logits": True}).get_config()["penalty"]
    'entropy'
    """

    def __init__(
        self,
        penalty: Penalty,
        weight: Weight = 1.0,
        inputs: InputKeys = None,
        enabled: bool = True,
        options: dict[str, Any] | None = None,
        metrics: dict[str, PenaltyName | Callable[..., Any]] | None = None,
    ) -> None:
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"`options` must be a dict or None; got {options!r}.")
        self._penalty = penalty_of(penalty, dict(options or {}))
        self.penalty = self._penalty.fn
        self.options = self._penalty.options
        self.weight = check_weight("weight", weight)
        if isinstance(inputs, (str, int)) and not isinstance(inputs, bool):
            inputs = (inputs,)
        if inputs is not None:
            if not isinstance(inputs, (list, tuple)):
                raise TypeError(f"`inputs` must be None, a name, a position, or a sequence of them; got {inputs!r}.")
            inputs = tuple(inputs)
            if not inputs or not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in inputs):
                raise ValueError(
                    f"`inputs` must be None or a non-empty sequence of names or positions; got {inputs!r}."
                )
        self.inputs = inputs
        if self.option_inputs and inputs is None:
            name, key = next(iter(self.option_inputs.items()))
            raise ValueError(
                f"`options[{name!r}]`={key!r} names an input, so the term needs "
                "`inputs=(...)` naming the tensors it takes from the same dict or list."
            )
        self.enabled = check.boolean("enabled", enabled)
        self.metrics = _check_metrics(metrics)

    @property
    def option_inputs(self) -> dict[str, str | int]:
        """Each tensor option (`mask`, `weights`, …) the term feeds from its
        inputs, with the name or position of the input holding it."""
        return dict(self._penalty.option_inputs)

    @property
    def reads(self):
        """Every input the term reads: its `inputs`, then its tensor options'."""
        return self.inputs + tuple(self._penalty.option_inputs.values()) if self.inputs else self.inputs

    @property
    def scheduled(self) -> bool:
        return is_schedule(self.weight)

    @property
    def sums_over_samples(self) -> bool:
        """Whether the value is a sum over samples (it then grows with the
        batch, and a distributed step adds the replicas' values) rather than
        a per-sample mean or a statistic of the batch."""
        return self._penalty.sums_over_samples

    def copy(self) -> "Term":
        return Term(self.penalty, self.weight, self.inputs, self.enabled, self.options, self.metrics)

    # -------------------------------------------- in a CompositeObjective

    def arguments(self, name: str, inputs: Any) -> tuple[Any, ...]:
        """The tensors of `inputs` (a tensor, list or dict, as fed to the
        objective) that the term `name` reads, in order."""
        if self.inputs is None:
            if isinstance(inputs, dict):
                raise ValueError(
                    f"Term {name!r} has no `inputs`, but the objective was fed a dict with keys "
                    f"{sorted(inputs)}; give the term inputs=(...) naming the entries it takes."
                )
            return tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        if isinstance(inputs, dict):
            missing = [k for k in self.reads if k not in inputs]
            if missing:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(self.reads)}, but {missing} "
                    f"{'is' if len(missing) == 1 else 'are'} not among the fed inputs {sorted(inputs)}."
                )
            return tuple(inputs[k] for k in self.reads)
        if isinstance(inputs, (list, tuple)):
            bad = [k for k in self.reads if not isinstance(k, int) or not -len(inputs) <= k < len(inputs)]
            if bad:
                raise ValueError(
                    f"Term {name!r} takes inputs {list(self.reads)}, but the objective was fed a "
                    f"list of {len(inputs)} tensors; list inputs are chosen by position."
                )
            return tuple(inputs[k] for k in self.reads)
        raise ValueError(
            f"Term {name!r} takes inputs {list(self.inputs)}, but the objective was fed a single "
            "tensor; feed a dict (or list) holding them."
        )

    def value(self, name: str, inputs: Any) -> Tensor:
        """The term's unweighted float32 scalar on what an objective was fed."""
        return scalar(name, self(*self.arguments(name, inputs)))

    def metric_values(self, name: str, inputs: Any) -> list[Tensor]:
        """Each of the term's `metrics` on what an objective was fed (the
        tensors the term reads, its tensor options excluded), as float32
        scalars."""
        tensors = self.arguments(name, inputs)
        options = len(self._penalty.option_inputs)
        return self._metrics_on(tensors[: len(tensors) - options])

    def __call__(self, *tensors: TensorLike) -> Tensor:
        """The unweighted value of the penalty on `tensors` (those `reads`
        names: the tensor options, if the term has any, come last)."""
        return self._penalty(*tensors)

    # -------------------------------------------- in a CompositeLoss

    def loss_value(
        self, name: str, y_true: TensorLike, y_pred: TensorLike, sample_weight: TensorLike | None = None
    ) -> Tensor:
        """The term's unweighted float32 value in a CompositeLoss, on this
        replica's batch as one device would compute it on that batch;
        `y_true` and `y_pred` as Keras passed them (a Loss reads the mask
        `y_pred` carries before any cast)."""
        return self._penalty.loss_value(name, y_true, y_pred, sample_weight)

    def loss_metric_values(self, y_true: TensorLike, y_pred: TensorLike) -> list[Tensor]:
        """Each of the term's `metrics` on what it reads of (y_true, y_pred)."""
        return self._metrics_on(self._penalty.loss_tensors(y_true, y_pred))

    def _metrics_on(self, tensors):
        return [scalar(name, fn(*tensors)) for name, fn in self.metrics.items()]

    # -------------------------------------------- saving

    def get_config(self) -> dict[str, Any]:
        weight = keras.saving.serialize_keras_object(self.weight) if self.scheduled else self.weight
        return {
            "penalty": self._penalty.config(),
            "weight": weight,
            "inputs": None if self.inputs is None else list(self.inputs),
            "enabled": self.enabled,
            "options": dict(self.options),
            "metrics": {name: _serialize_metric(fn) for name, fn in self.metrics.items()},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Term":
        config = dict(config)
        for key in ("penalty", "weight"):
            if isinstance(config[key], dict):
                config[key] = _loadable(key, keras.saving.deserialize_keras_object(config[key]))
        config["metrics"] = {
            name: _loadable(f"metrics[{name!r}]", keras.saving.deserialize_keras_object(fn))
            if isinstance(fn, dict)
            else fn
            for name, fn in (config.get("metrics") or {}).items()
        }
        return cls(**config)

    def __repr__(self) -> str:
        return f"Term({self._penalty.label!r}, weight={self.weight!r}, inputs={self.inputs!r}, enabled={self.enabled})"


def build_terms(terms, weights=None):
    """Validates `terms` (dict name → Term or penalty) and `weights`; returns
    a dict name → Term, each error naming the offending term."""
    if weights is not None and not isinstance(weights, dict):
        raise TypeError(f"`weights` must be a dict of term name -> weight, or None; got {weights!r}.")
    if isinstance(terms, dict):
        items = list(terms.items())
    elif isinstance(terms, (list, tuple)) and all(isinstance(t, tuple) and len(t) == 2 for t in terms):
        items = list(terms)
    else:
        raise TypeError(f"`terms` must be a dict of name -> Term or penalty; got {terms!r}.")
    if not items:
        raise ValueError("`terms` must hold at least one term.")
    built = {}
    for name, term in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Term names must be non-empty strings; got {name!r}.")
        if not METRIC_NAME_PATTERN.match(name):
            raise ValueError(f"Term name {name!r} cannot be a metric name: use letters, digits, '_', '.' or '-'.")
        if name in built:
            raise ValueError(f"Duplicate term name {name!r}.")
        try:
            built[name] = term.copy() if isinstance(term, Term) else Term(term)
        except (ValueError, TypeError) as error:
            raise type(error)(f"Term {name!r}: {error}") from error
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(built))
    if unknown:
        raise ValueError(f"`weights` names unknown term(s) {unknown}; terms are {list(built)}.")
    for name, weight in weights.items():
        try:
            weight = check_weight("weight", weight)
        except (ValueError, TypeError) as error:
            raise type(error)(f"Term {name!r}: {error}") from error
        built[name].weight = weight
    return built


def serialize_terms(terms):
    return {name: keras.saving.serialize_keras_object(term) for name, term in terms.items()}


def deserialize_terms(config):
    return {name: keras.saving.deserialize_keras_object(term) for name, term in config.items()}
