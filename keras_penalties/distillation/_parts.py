"""The parts a `keras_penalties.distillation.Distiller` is built from: a
model's vocabulary projection read as a fused head (`ModelHead`), student losses
as Keras `Loss` objects and their metric names, and the intermediate
outputs of distillation losses that name layers (`FeatureExtractors`)."""

import re

import keras

from keras_penalties import _keras_internals
from keras_penalties import ops as penalties
from keras_penalties.ops.heads import layer_head


class ModelHead:
    """A model's vocabulary projection: the model that computes the hidden
    states it reads, and its kernel and bias, read when the logits are
    described (inside the training step, where JAX's stateless scope holds
    the values)."""

    def __init__(self, model, head, argument):
        if isinstance(head, str):
            head = model.get_layer(head)
        if not isinstance(head, keras.layers.Layer):
            raise TypeError(f"`{argument}` must be a layer of {model.name} or its name; got {head!r}.")
        hidden, kwargs = _keras_internals.head_call(model, head, argument)
        self.layer = head
        layer_head(head, argument)  # a Dense or a reversible embedding, linear and not quantized
        if not isinstance(head, keras.layers.Dense) and not kwargs.get("reverse"):
            raise ValueError(f"`{argument}`: {head.name} produces {model.name}'s output without `reverse=True`.")
        inputs = model.input
        self.hidden_model = keras.Model(inputs, hidden, name=f"{model.name}_hidden_states")

    def logits(self, hidden):
        """`ops.linear` of `hidden` through the head layer, which says its
        kernel, bias, orientation and soft cap (Gemma 2's heads)."""
        return penalties.linear(hidden, self.layer)


def _snake(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def metric_names(losses):
    """Each loss's `name`, else its class name in snake case; `_2`, `_3`, …
    on repeats."""
    names, seen = [], {}
    for loss in losses:
        base = getattr(loss, "name", None) or _snake(type(loss).__name__)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


class _FunctionLoss(keras.losses.Loss):
    """A loss function as a `Loss` (sample weights, Keras' reduction), as
    `compile` wraps one."""

    def __init__(self, fn):
        super().__init__(name=getattr(fn, "__name__", None))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def loss_object(loss):
    """A student loss as a Keras `Loss` that takes `sample_weight`."""
    if loss is None:
        return None
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    return loss if isinstance(loss, keras.losses.Loss) else _FunctionLoss(loss)


def check_fusable_student_loss(loss):
    config = loss.get_config() if isinstance(loss, keras.losses.SparseCategoricalCrossentropy) else None
    if (
        not config
        or not config.get("from_logits")
        or config.get("ignore_class") is not None
        or loss.reduction != "sum_over_batch_size"
    ):
        raise ValueError(
            "`loss`: with `head`, the student loss is computed from the hidden states as sparse categorical "
            "cross-entropy from logits; compile with loss=keras.losses.SparseCategoricalCrossentropy("
            f"from_logits=True) (no ignore_class: give a sample_weight); got {loss!r}."
        )


class FeatureExtractors:
    """Intermediate outputs for distillation losses that name layers
    (`FeatureDistillation(teacher_layer_name=..., student_layer_name=...)`),
    from models built with public Keras (`layer.output`); not tracked by the
    Distiller, whose teacher and student own the layers."""

    def __init__(self, teacher, student, losses):
        self.losses = [
            loss
            for loss in losses
            if getattr(loss, "teacher_layer_name", None) or getattr(loss, "student_layer_name", None)
        ]
        self.models = {}
        for side, model in (("teacher", teacher), ("student", student)):
            names = sorted({getattr(loss, f"{side}_layer_name") for loss in self.losses} - {None})
            if names:
                outputs = {n: model.get_layer(n).output for n in names}
                outputs["final_output"] = model.output
                self.models[side] = keras.Model(model.input, outputs, name=f"{model.name}_features")

    def __call__(self, x, teacher_output, student_output):
        """loss -> (teacher features, student features) for the losses that
        name layers; a side that names none gets the model's output."""
        if not self.losses:
            return {}
        outputs = {side: model(x, training=side == "student") for side, model in self.models.items()}
        finals = {"teacher": teacher_output, "student": student_output}
        pairs = {}
        for loss in self.losses:
            pair = []
            for side in ("teacher", "student"):
                name = getattr(loss, f"{side}_layer_name")
                pair.append(outputs[side][name] if name else finals[side])
            pairs[loss] = tuple(pair)
        return pairs
