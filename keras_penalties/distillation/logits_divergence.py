"""`LogitsDivergence`: a `keras.distillation.DistillationLoss` between a
teacher's and a student's logits (KL in either direction or symmetric, JS),
with T², a token mask from the sample weights, and chunks; right alone or
in a list (Keras' own resets a single loss's weight)."""

from typing import Any, get_args

import keras
from keras import ops

from keras_penalties import _replicas
from keras_penalties import _validation as check
from keras_penalties import ops as penalties
from keras_penalties._saving import with_hint, without_hint
from keras_penalties._types import ChunkSize, Direction, Divergence, Tensor, TensorLike
from keras_penalties.ops.divergences import _js_values, _kl_values

DIVERGENCES = get_args(Divergence)


def token_mask(sample_weight, logits):
    """A Keras `sample_weight` as the token mask of `logits` (nonzero kept):
    per token ([batch, tokens]), per sample ([batch], spread over its
    tokens), or with a trailing axis of 1."""
    if sample_weight is None:
        return None
    weights = ops.convert_to_tensor(sample_weight)
    rank = len(logits.shape) - 1
    if len(weights.shape) == rank + 1 and weights.shape[-1] == 1:
        weights = ops.squeeze(weights, -1)
    if len(weights.shape) > rank:
        raise ValueError(
            f"`sample_weight` of shape {tuple(weights.shape)} does not fit logits of shape "
            f"{tuple(logits.shape)}: give one weight per token or per sample."
        )
    while len(weights.shape) < rank:
        weights = ops.expand_dims(weights, -1)
    positions = logits.hidden if isinstance(logits, penalties.LinearLogits) else logits
    return ops.not_equal(ops.broadcast_to(weights, ops.shape(positions)[:-1]), 0)


def position_count(logits):
    """How many positions `logits` has (every axis but the classes)."""
    tensor = logits.hidden if isinstance(logits, penalties.LinearLogits) else logits
    shape = ops.shape(tensor)
    n = 1
    for d in shape[:-1]:
        n = n * d
    return n


@keras.saving.register_keras_serializable(package="keras_penalties")
class LogitsDivergence(keras.distillation.DistillationLoss):
    """T²·divergence(teacher ‖ student) of logits at temperature T, per kept token.

    A `keras.distillation.DistillationLoss` for Keras' `Distiller` and this
    package's: Hinton et al.'s softened KL with its T² (so gradients keep
    their scale as T changes), or the generalized JS divergence of on-policy
    distillation. Unlike `keras.distillation.LogitsDistillation`, it is the
    same number alone or in a list, applies softmax itself (log-softmax of
    the logits / T), and in this package's `Distiller` honours the token mask
    (`sample_weight`) and accepts `ops.linear(...)` logits from hidden
    states.

    Args:
        divergence: `"kl"`: `kl_divergence(teacher, student, direction=...)`
            (forward is KL(teacher‖student), the usual distillation loss;
            reverse is KL(student‖teacher), mode-seeking); `"js"`:
            `js_divergence(teacher, student, beta=...)`, β weighting the
            teacher.
        direction: `"forward"`, `"reverse"` or `"symmetric"` (for `"kl"`).
        beta: β in (0, 1) (for `"js"`).
        temperature: T > 0 dividing both logits.
        scale_by_temperature_squared: multiply by T² (the default).
        chunk_size: None, "auto", or rows per chunk (see `kl_divergence`); in a
            fused `Distiller` the Distiller's `chunk_size` is used when this
            is None.
        name: the name logged as `"distillation/<name>"` by `Distiller`.

    Example:

    >>> import math
    >>> from keras_penalties.distillation import LogitsDivergence
    >>> kd = LogitsDivergence(temperature=2.0)
    >>> teacher, student = [[0.0, 0.0]], [[2 * math.log(3.0), 0.0]]  # at T = 2: [½, ½] and [¾, ¼]
    >>> round(float(kd.compute_loss(teacher, student)), 6)  # 4 · ½ln(4/3)
    0.575364
    """

    def __init__(
        self,
        divergence: Divergence = "kl",
        *,
        direction: Direction = "forward",
        beta: float = 0.5,
        temperature: float = 1.0,
        scale_by_temperature_squared: bool = True,
        chunk_size: ChunkSize = None,
        name: str | None = None,
    ) -> None:
        self.divergence = check.choice(*DIVERGENCES)("divergence", divergence)
        kl = penalties.kl_divergence.check_options(direction=direction, temperature=temperature, chunk_size=chunk_size)
        self.direction, self.temperature, self.chunk_size = kl["direction"], kl["temperature"], kl["chunk_size"]
        self.beta = penalties.js_divergence.check_options(beta=beta)["beta"]
        self.scale_by_temperature_squared = check.boolean("scale_by_temperature_squared", scale_by_temperature_squared)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a string or None; got {name!r}.")
        self.name = name

    def divergence_sum(
        self,
        teacher_logits: TensorLike | penalties.LinearLogits,
        student_logits: TensorLike | penalties.LinearLogits,
        mask: TensorLike | None = None,
        chunk_size: ChunkSize = None,
    ) -> Tensor:
        """Σ over the kept tokens of the unscaled divergence (float32)."""
        options = dict(from_logits=True, temperature=self.temperature, mask=mask, reduction="sum")
        options["chunk_size"] = self.chunk_size if self.chunk_size is not None else chunk_size
        if self.divergence == "kl":
            value = penalties.kl_divergence(teacher_logits, student_logits, direction=self.direction, **options)
        else:
            value = penalties.js_divergence(teacher_logits, student_logits, beta=self.beta, **options)
        return ops.cast(value, "float32")

    def _position_values(self, teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
        """The unscaled divergence at each position (a chunk of formed
        logits, in a fused Distiller's one loop)."""
        options = dict(from_logits=True, temperature=self.temperature, axis=-1)
        if self.divergence == "kl":
            return _kl_values(teacher_logits, student_logits, direction=self.direction, **options)
        return _js_values(teacher_logits, student_logits, beta=self.beta, **options)

    @property
    def scale(self) -> float:
        return self.temperature**2 if self.scale_by_temperature_squared else 1.0

    def compute_loss(
        self,
        teacher_outputs: TensorLike | penalties.LinearLogits,
        student_outputs: TensorLike | penalties.LinearLogits,
        sample_weight: TensorLike | None = None,
        chunk_size: ChunkSize = None,
        **kwargs: Any,
    ) -> Tensor:
        """The mean over kept tokens, × T²: a float32 scalar.

        Args:
            teacher_outputs, student_outputs: logits (or `ops.linear(...)`).
            sample_weight: None, or per-token (or per-sample) weights read as
                a mask: tokens of weight 0 (padding, prompt) do not count.
            chunk_size: used when the loss has none of its own.
        """
        teacher_outputs, student_outputs = (
            t if isinstance(t, penalties.LinearLogits) else ops.convert_to_tensor(t)
            for t in (teacher_outputs, student_outputs)
        )
        mask = token_mask(sample_weight, student_outputs)
        total = self.divergence_sum(teacher_outputs, student_outputs, mask, chunk_size)
        kept = position_count(student_outputs) if mask is None else ops.sum(ops.cast(mask, "float32"))
        # The replicas' values average to the global mean over kept tokens.
        return self.scale * total / _replicas.global_divisor(kept)

    def get_config(self) -> dict[str, Any]:
        return with_hint(
            {
                "divergence": self.divergence,
                "direction": self.direction,
                "beta": self.beta,
                "temperature": self.temperature,
                "scale_by_temperature_squared": self.scale_by_temperature_squared,
                "chunk_size": self.chunk_size,
                "name": self.name,
            }
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LogitsDivergence":
        return cls(**without_hint(config))
