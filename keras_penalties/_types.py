"""Type aliases for the public signatures, shared so each option reads the
same everywhere (and an IDE lists a `Literal`'s values).

Tensors are `Any`: a Keras tensor is a `jax.Array`, a `tf.Tensor`, a
`torch.Tensor`, a `keras.KerasTensor` or a `keras.Variable` depending on the
backend and the call, and Keras ships no types for them. `Tensor` marks what
the package returns, `TensorLike` what it converts (`keras.ops.convert_to_tensor`:
tensors, NumPy arrays, nested lists, numbers).

The `Literal` aliases are the one place each string option's values are
written: the runtime checks (`_validation.choice`) take them with
`typing.get_args`, and reject other values, naming the option, for untyped
callers.
"""

from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, Optional, Sequence, TypeAlias, Union

if TYPE_CHECKING:
    from keras_penalties.composite.weighting import Weighting as _WeightingRule

Tensor: TypeAlias = Any
TensorLike: TypeAlias = Any
# A Keras dtype: a name such as "float32", a `keras.DTypePolicy`, or None
# (Keras' default).
DType: TypeAlias = Any

Reduction: TypeAlias = Literal["sum", "mean", "none"]
# The token-level ops of fine-tuning (cross_entropy, entropy, kl_estimate,
# policy_loss) also average over sequences of [batch, tokens] values.
TokenReduction: TypeAlias = Literal["sum", "mean", "none", "sequence_mean", "sequence_sum"]
# The fine-tuning losses (kl_estimate, policy_loss) also take Dr. GRPO's
# constant normaliser: Σ L·M over (sequences × max_length).
PolicyReduction: TypeAlias = Literal["sum", "mean", "none", "sequence_mean", "sequence_sum", "constant"]
# l1, l2 and elastic_net also take Keras' activity-regularizer scale.
MagnitudeReduction: TypeAlias = Literal["sum", "mean", "none", "sum_over_batch_size"]
# What `keras.losses.Loss(reduction=...)` accepts.
LossReduction: TypeAlias = Optional[Literal["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", "none"]]
Direction: TypeAlias = Literal["forward", "reverse", "symmetric"]
Metric: TypeAlias = Literal["mse", "l1", "cosine", "kl", "js"]
OrthogonalityMode: TypeAlias = Literal["soft", "hard", "spectral"]
OrthogonalityAxis: TypeAlias = Literal["columns", "rows"]
EntropyMode: TypeAlias = Literal["penalty", "bonus"]
Divergence: TypeAlias = Literal["kl", "js"]
Estimator: TypeAlias = Literal["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"]
PolicyLoss: TypeAlias = Literal["reinforce", "importance_sampling", "ppo", "cispo", "sapo", "gmpo", "vespo"]
# Whose ratio a policy loss reads: each token's, GSPO's sequence ratio, or
# GSPO-token's (the sequence ratio's value with a per-token gradient).
PolicyLevel: TypeAlias = Literal["token", "sequence", "sequence_token"]
# Importance weights per token, per sequence (the product of its tokens'
# ratios) or its geometric mean.
ImportanceLevel: TypeAlias = Literal["token", "sequence", "geometric"]
ImportanceMode: TypeAlias = Literal["truncate", "mask"]
# DPPO's trust region in probability space: total variation or binary KL.
TrustRegion: TypeAlias = Literal["tv", "kl"]
# Preference losses (TRL's `loss_type` names) and the reward statistics TRL logs.
PreferenceKind: TypeAlias = Literal[
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "nca_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "simpo",
    "orpo",
    "bco_pair",
    "exo_pair",
    "discopop",
    "sigmoid_norm",
]
# TRL's `f_divergence_type`: the score of a log-ratio the kinds built on h take.
PreferenceDivergence: TypeAlias = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
# Unpaired preference losses: KTO, and TRL's unpaired APO-zero.
UnpairedKind: TypeAlias = Literal["kto", "apo_zero_unpaired"]
PreferenceStatistic: TypeAlias = Literal["chosen", "rejected", "margin", "accuracy"]
# An optional bound on each side: (low, high), either None.
Bounds: TypeAlias = tuple[Optional[float], Optional[float]]
# A composite's weighting rule: its name, its config dict or the rule itself
# (`composite.weighting.Weighting`); None is "fixed".
WeightingName: TypeAlias = Literal["fixed", "uncertainty", "famo"]
Weighting: TypeAlias = Union[None, WeightingName, dict[str, Any], "_WeightingRule"]
Center: TypeAlias = Union[float, Literal["mean"], None]
ChunkSize: TypeAlias = Union[int, Literal["auto"], None]

# The `keras_penalties.ops` functions a `Term` (or a term's metric) may name.
PenaltyName: TypeAlias = Literal[
    "consistency",
    "cross_entropy",
    "elastic_net",
    "entropy",
    "gaussian_kl",
    "js_divergence",
    "kl_divergence",
    "kl_estimate",
    "kl_sparsity",
    "l1",
    "l2",
    "orthogonality",
    "output_magnitude",
    "policy_loss",
    "preference_loss",
    "preference_reward",
    "router_load_balancing",
    "router_z_loss",
    "topk_kl",
    "unpaired_preference_loss",
]
# A term's penalty: an ops function's name, or a callable of tensors (an ops
# function, a Regularizer, a Loss, any function returning a scalar).
Penalty: TypeAlias = Union[PenaltyName, Callable[..., Any]]
# A term's weight: a number, or a schedule of the training step (a
# `keras.optimizers.schedules.LearningRateSchedule` or any callable of it).
Weight: TypeAlias = Union[float, Callable[[Any], Any]]
# The inputs a term reads: a dict key or list position, or a sequence of them.
InputKeys: TypeAlias = Union[str, int, Sequence[Union[str, int]], None]
# Keras callbacks' `logs`.
Logs: TypeAlias = Optional[dict[str, Any]]


class Head(NamedTuple):
    """A linear head as it crosses the backend contract (`chunked_sum`,
    `chunked_values`): hidden states as rows [positions, H], the kernel
    ([H, V], or [V, H] with `transpose`: a tied embedding), the bias [V] or
    None; its logits are formed a chunk of rows at a time."""

    rows: Any
    kernel: Any
    bias: Any
    transpose: bool
