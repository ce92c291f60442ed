"""`Distiller`: Keras' `keras.distillation.Distiller` with its traps fixed
(the student's own losses, sample weights, a mask for the distillation
losses, per-term logs, the replicas' division) and, given the heads, its
losses from the hidden states without the [tokens, vocab] logits."""

from typing import Any

import keras
from keras import ops

from keras_penalties import _keras_internals, _replicas
from keras_penalties import _validation as check
from keras_penalties._types import ChunkSize, Tensor, TensorLike
from keras_penalties.distillation._parts import (
    FeatureExtractors,
    ModelHead,
    check_fusable_student_loss,
    loss_object,
    metric_names,
)
from keras_penalties.distillation.logits_divergence import LogitsDivergence, position_count, token_mask
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops._tokens import fused_columns, weighted_labels
from keras_penalties.ops.heads import _cross_entropy_values

# The student loss of a fused step: Keras' sparse cross-entropy from logits.
_PLAIN_CROSS_ENTROPY = dict(from_logits=True, label_smoothing=0.0, temperature=1.0, axis=-1)


@keras.saving.register_keras_serializable(package="keras_penalties")
class Distiller(keras.distillation.Distiller):
    """`keras.distillation.Distiller`, with what Keras 3.15 gets wrong fixed,
    and fused heads for language models.

    total = w·student_loss + (1 − w)·Σᵢ weightᵢ·distillationᵢ + the
    student's own losses, w = `student_loss_weight`. As Keras' Distiller,
    except that:

    - a single distillation loss keeps its `distillation_loss_weights`;
    - the student's own losses (regularizers, `add_loss`, a
      `CompositeObjective`) are added to the total;
    - `sample_weight` reaches the student loss (Keras' convention) and the
      distillation losses as a token mask: `LogitsDivergence` then averages
      over the kept tokens;
    - each distillation loss's unweighted value is logged as
      `"distillation/<name>"` (its `name`, else its class name in snake case,
      `_2`, `_3`, … on repeats), beside Keras' `student_loss`,
      `distillation_loss` and `total_loss`;
    - under `tf.distribute.MirroredStrategy` the total is what one device
      computes on the global batch (Keras' own Distiller does not divide its
      distillation term by the replicas).

    With `head` (the student's vocabulary projection: a `Dense` layer, or a
    reversed tied embedding such as keras-hub's `ReversibleEmbedding`) the
    training step computes the distillation losses and the student loss
    (sparse categorical cross-entropy from logits, with Keras' sample-weight
    convention: compile with
    `keras.losses.SparseCategoricalCrossentropy(from_logits=True)`) from the
    hidden states that feed the head, through `ops.linear` in chunks of
    `chunk_size` rows: no [tokens, vocab] logits, their gradient, or (with
    `teacher_head`) the teacher's logits are formed, and the numbers equal
    the unfused Distiller's. Then every distillation loss must be a
    `LogitsDivergence`; compiled metrics, which need the logits, are
    computed by `evaluate`, not during `fit`; `predict` and `evaluate` form
    the logits as usual.

    Args:
        teacher, student, distillation_losses, distillation_loss_weights,
        student_loss_weight, name: as `keras.distillation.Distiller`.
        head: None, or the student's vocabulary projection (a layer or its
            name) that produces its output, in a functional (or Sequential)
            student.
        teacher_head: None, or the teacher's.
        chunk_size: rows per chunk, or "auto" (see `kl_divergence`), for the fused losses (and for any
            `LogitsDivergence` without its own); None (the default) forms the heads' logits whole, as
            every op does without `chunk_size`: the unfused numbers, without the memory saved.
    """

    def __init__(
        self,
        teacher: keras.Model,
        student: keras.Model,
        distillation_losses: keras.distillation.DistillationLoss | list[Any] | tuple[Any, ...],
        distillation_loss_weights: float | list[float] | tuple[float, ...] | None = None,
        student_loss_weight: float = 0.5,
        name: str = "distiller",
        *,
        head: keras.layers.Layer | str | None = None,
        teacher_head: keras.layers.Layer | str | None = None,
        chunk_size: ChunkSize = None,
        **kwargs: Any,
    ) -> None:
        losses = list(distillation_losses) if isinstance(distillation_losses, (list, tuple)) else [distillation_losses]
        if distillation_loss_weights is not None and not isinstance(distillation_loss_weights, (list, tuple)):
            distillation_loss_weights = [distillation_loss_weights]
        super().__init__(teacher, student, losses, distillation_loss_weights, student_loss_weight, name=name, **kwargs)
        self.chunk_size = check.chunk_size("chunk_size", chunk_size)
        self.head = None if head is None else ModelHead(student, head, "head")
        self.teacher_head = None if teacher_head is None else ModelHead(teacher, teacher_head, "teacher_head")
        if self.head or self.teacher_head:
            others = [type(loss).__name__ for loss in losses if not isinstance(loss, LogitsDivergence)]
            if others:
                raise ValueError(
                    f"`distillation_losses`: with `head`/`teacher_head` the losses receive lazy logits "
                    f"(ops.linear) and must be LogitsDivergence; got {others}."
                )
        self._layer_features = FeatureExtractors(teacher, student, losses)
        self.loss_names = metric_names(losses)
        self.loss_trackers = [keras.metrics.Mean(name=f"distillation/{n}") for n in self.loss_names]
        self.student_losses = None
        self._fused_step = False

    def compile(self, optimizer: Any = "adam", loss: Any = None, metrics: Any = None, **kwargs: Any) -> None:
        """As `keras.distillation.Distiller.compile`; `loss` is the student
        loss. With `head`, it must be
        `keras.losses.SparseCategoricalCrossentropy(from_logits=True)`
        (computed from the hidden states)."""
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
        self.student_loss_config = loss
        self.student_losses = keras.tree.map_structure(loss_object, loss)
        if self.head is not None:
            check_fusable_student_loss(self.student_losses)

    def get_compile_config(self) -> dict[str, Any] | None:
        config = super().get_compile_config()
        if config:
            config["loss"] = keras.saving.serialize_keras_object(self.student_loss_config)
        return config

    def compile_from_config(self, config: dict[str, Any]) -> None:
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def call(self, inputs: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """The student's logits; with `head`, while training, the hidden
        states that feed it (the training step's `y_pred`)."""
        if training and self.head is not None:
            return self.head.hidden_model(inputs, training=training, **kwargs)
        return self.student(inputs, training=training, **kwargs)

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: TensorLike | None = None,
        training: bool = True,
    ) -> Tensor:
        self._fused_step = bool(training) and self.head is not None
        if y_pred is None:
            # Called outside `fit` (a custom loop): the student's forward
            # pass adds the losses read next.
            y_pred = self(x, training=training)
        # The student's own losses, read after its forward pass and before
        # the teacher runs: on TF and torch `self.losses` would then include
        # the teacher's too.
        own: Any = [ops.cast(loss, "float32") for loss in self.losses]
        own = sum(own) if own else 0.0
        student = self.head.logits(y_pred) if self._fused_step else y_pred  # type: ignore[union-attr]  # fused: a head

        teacher, features = None, {}
        if self.student_loss_weight < 1.0:
            teacher = self._teacher_outputs(x)
            features = self._layer_features(x, teacher, student)
        # A fused step sums the student loss and the heads' divergences in
        # one chunk loop: `fused` holds their values (not differentiated),
        # `total` their weighted sum (differentiated).
        fused, total = self._fused_sums(y, teacher, student, sample_weight, features) if self._fused_step else ({}, 0.0)

        student_loss = ops.zeros((), "float32")
        if "student" in fused:
            student_loss = fused["student"]
        elif self.student_loss_weight > 0.0 and y is not None:
            student_loss = self._student_loss_value(y, student, sample_weight)
            total = total + self.student_loss_weight * student_loss

        distillation = ops.zeros((), "float32")
        if teacher is not None:
            for i, (loss, weight, tracker) in enumerate(
                zip(self.distillation_losses, self.distillation_loss_weights, self.loss_trackers)
            ):
                if i in fused:
                    value = fused[i]
                else:
                    t, s = features.get(loss, (teacher, student))
                    loss.validate_outputs(t, s)
                    value = ops.cast(_call_distillation_loss(loss, t, s, sample_weight, self.chunk_size), "float32")
                    if len(value.shape):
                        raise ValueError(
                            f"Distillation loss {type(loss).__name__} returned a non-scalar of shape {value.shape}."
                        )
                    total = total + (1.0 - self.student_loss_weight) * float(weight) * value
                tracker.update_state(value)
                distillation = distillation + float(weight) * value

        total = total + own
        self.student_loss_tracker.update_state(student_loss)
        self.distillation_loss_tracker.update_state(distillation)
        self.total_loss_tracker.update_state(total)
        # The values above are this replica's one-device numbers.
        return _replicas.share(total)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: TensorLike | None = None) -> dict[str, Any]:
        if not self._fused_step:
            return super().compute_metrics(x, y, y_pred, sample_weight)
        # A fused training step never forms the logits that compiled metrics
        # read: they are left out of its logs rather than logged as 0
        # (`evaluate` computes them).
        return self._metric_logs(lambda metric: not _keras_internals.is_compiled_metrics(metric))

    def get_metrics_result(self) -> dict[str, Any]:
        # After fused training steps the compiled metrics may never have
        # been built (TensorFlow builds them on their first update).
        return self._metric_logs(lambda metric: not _keras_internals.is_compiled_metrics(metric) or metric.built)

    def _metric_logs(self, include):
        logs = {}
        for metric in self.metrics:
            if not include(metric):
                continue
            result = metric.result()
            if isinstance(result, dict):
                logs.update(result)
            else:
                logs[metric.name] = result
        return logs

    def _teacher_outputs(self, x):
        if self.teacher_head is not None:
            return self.teacher_head.logits(self.teacher_head.hidden_model(x, training=False))
        return self.teacher(x, training=False)

    def _fused_sums(self, y, teacher, student, sample_weight, features):
        """The student loss (key "student") and each divergence of the
        heads' logits (key: the loss's index) of a fused step, as
        `({key: value}, Σ coefficient·value)`, from one chunk loop over the
        logits (each chunk's formed once for all of them). A loss with
        other inputs (layer features), its own chunk size or weight 0 is
        left out (computed on its own)."""
        keys, columns, weights = [], [], []
        positions = ops.shape(student.hidden)[:-1]
        labels = None
        if self.student_loss_weight > 0.0 and y is not None:
            w = ops.ones(positions) if sample_weight is None else ops.convert_to_tensor(sample_weight)
            if len(w.shape) == len(student.shape) and w.shape[-1] == 1:  # [batch, tokens, 1], as Keras takes it
                w = ops.squeeze(w, -1)
            w = ops.broadcast_to(ops.cast(w, "float32"), positions)
            labels, w = weighted_labels(y, student, w)
            keys.append(("student", self.student_loss_weight))
            columns.append(lambda t, s, labels: _cross_entropy_values(s, labels=labels, **_PLAIN_CROSS_ENTROPY))
            weights.append(w / ops.cast(reductions.at_least_one(position_count(student)), "float32"))
        if teacher is not None:
            mask = token_mask(sample_weight, student)
            kept = ops.ones(positions) if mask is None else ops.cast(mask, "float32")
            # The replicas' values average to the global mean over kept tokens.
            divisor = ops.cast(
                _replicas.global_divisor(position_count(student) if mask is None else ops.sum(kept)), "float32"
            )
            for i, (loss, weight) in enumerate(zip(self.distillation_losses, self.distillation_loss_weights)):
                if loss in features or not weight or loss.chunk_size not in (None, self.chunk_size):
                    continue
                loss.validate_outputs(teacher, student)
                keys.append((i, (1.0 - self.student_loss_weight) * float(weight)))
                columns.append(lambda t, s, labels, loss=loss: loss._position_values(t, s))
                weights.append(loss.scale * kept / divisor)
        if not keys:
            return {}, 0.0
        tensors = [student] if teacher is None else [teacher, student]

        def values(*logits, labels=None):
            t, s = (None, *logits) if teacher is None else logits
            return ops.stack([column(t, s, labels) for column in columns], axis=-1)

        weighted = ops.stack([c * w for (_, c), w in zip(keys, weights)], axis=-1)
        total, sums = fused_columns(values, tensors, labels, weighted, self.chunk_size)
        return {key: sums[j] / c for j, (key, c) in enumerate(keys)}, total

    def _student_loss_value(self, y, student, sample_weight):
        """The student loss of an unfused step on this replica, unscaled (as
        on one device); a fused step's is `_fused_sums`'."""
        if self.student_losses is None:
            raise ValueError("The Distiller must be compiled (its `loss` is the student loss) before computing a loss.")
        values = keras.tree.map_structure(
            lambda loss, target, output: ops.cast(loss(target, output, sample_weight=sample_weight), "float32"),
            self.student_losses,
            y,
            student,
        )
        # Keras' losses divide their means by the replicas; undone here and
        # applied once to the total.
        return _replicas.unshare(sum(ops.mean(v) for v in keras.tree.flatten(values)))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            head=None if self.head is None else self.head.layer.name,
            teacher_head=None if self.teacher_head is None else self.teacher_head.layer.name,
            chunk_size=self.chunk_size,
        )
        return config


def _call_distillation_loss(loss, teacher, student, sample_weight, chunk_size):
    if isinstance(loss, LogitsDivergence):
        return loss.compute_loss(teacher, student, sample_weight=sample_weight, chunk_size=chunk_size)
    return loss.compute_loss(teacher, student)
