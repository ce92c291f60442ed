"""`PolicyModel`: policy-gradient fine-tuning (GRPO, DAPO, GSPO, CISPO,
SAPO, …) of a causal LM as a `keras.Model` that `compile` and `fit` train
on rollouts (`Rollouts`, or any data with the same keys)."""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_penalties import _replicas
from keras_penalties import _validation as check
from keras_penalties import ops as penalties
from keras_penalties._types import ChunkSize, Estimator, PolicyLevel, PolicyLoss, PolicyReduction, Tensor
from keras_penalties.ops import _policy_kinds as kinds
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops.policy import ESTIMATORS, POLICY_LEVELS, POLICY_LOSSES
from keras_penalties.post_training._lm import (
    LanguageModel,
    aligned,
    frozen_copy,
    head_name,
    models_config,
    models_from_config,
)

REQUIRED = ("token_ids", "completion_mask", "advantages")
# TRL's GRPO log names; the clip fractions for the kinds with a ratio.
CLIP_LOGS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# The kinds whose ratio a clip bounds (GMPO's bounds are on its own log-ratio).
CLIPPED = ("importance_sampling", "ppo", "cispo", "sapo", "vespo")
IMPORTANCE_OPTIONS = ("level", "mode", "bounds")


@keras.saving.register_keras_serializable(package="keras_penalties")
class PolicyModel(keras.Model):
    """A causal LM trained by a policy gradient on sampled completions.

    `fit` and `evaluate` take the data as a dict (`y` None): `token_ids`
    (int [batch, length]: prompt and completion), `completion_mask` (1 on
    the sampled tokens), `advantages` ([batch], or per token aligned with
    the ids); optional `padding_mask`, `old_logprobs` (absent: the policy's
    own, under stop-gradient — one update per rollout, r = 1 with its
    gradient), `sampler_logprobs`, `ref_logprobs`, `rewards` ([batch],
    logged only). Per-token arrays align with the ids: entry t is token
    t's, read from the hidden state at t − 1. `Rollouts` makes such data
    with the policy's own `generate`.

    The loss: `ops.policy_loss` (`kind`, `clip`, `level`, `reduction`, and
    `loss_options`: `dual_clip`, `sapo_tau`, `max_length`, …), plus
    `kl_weight` × `ops.kl_estimate` to the reference (`kl_estimator`, the
    same reduction; with `bias_corrected_kl` corrected by `old_logprobs`,
    TRL's `use_bias_correction_kl`), minus `entropy_weight` × the token mean
    of the entropy (from the same pass), plus the policy's own losses.
    `importance_sampling` (a dict of `ops.importance_weights`' `level`,
    `mode`, `bounds`) weighs the policy loss (not the KL) by π_old / q of
    the sampler's log-probabilities and, in mask mode, drops the rejected
    tokens from the policy loss's mask only. Logs (TRL's GRPO names, global
    token means under several devices): `loss`, `policy_loss` (the
    surrogate alone), `kl`, `entropy`, `clip_ratio/low_mean`,
    `clip_ratio/high_mean`, `clip_ratio/region_mean` (kinds with a ratio),
    `sampling/importance_sampling_ratio/mean` (with `importance_sampling`),
    `reward` and `reward_std` (with `rewards`).

    Args:
        policy: a keras-hub `CausalLM`, or a Keras model whose output is
            logits, with `head`.
        reference: None, `"copy"` (a frozen copy of the policy now), or a
            model (frozen here); needed for `kl_weight` > 0 unless the data
            carries `ref_logprobs`.
        kind, clip, level, reduction: `ops.policy_loss`'s.
        kl_weight: β ≥ 0.
        kl_estimator: `ops.kl_estimate`'s `estimator`.
        bias_corrected_kl: correct the KL by the ratio to `old_logprobs`.
        entropy_weight: ≥ 0, the entropy bonus.
        importance_sampling: None, or a dict of `level`, `mode`, `bounds`.
        head: with a model that is not keras-hub's, its vocabulary
            projection (a layer or its name).
        chunk_size: rows per chunk of the log-probabilities, or None.
        loss_options: `ops.policy_loss`'s other options.
        name: the model's name.

    Example:

    ```python
    model = PolicyModel(causal_lm, "copy", kind="ppo", reduction="sequence_mean", kl_weight=0.04)
    model.compile(optimizer=keras.optimizers.Adam(1e-6))
    model.fit(Rollouts(model, prompts, reward_fn, batches_per_epoch=1), epochs=100)
    ```
    """

    def __init__(
        self,
        policy: keras.Model,
        reference: Any = None,
        *,
        kind: PolicyLoss = "ppo",
        clip: tuple[float, float] | None = None,
        level: PolicyLevel = "token",
        reduction: PolicyReduction = "mean",
        kl_weight: float = 0.0,
        kl_estimator: Estimator = "k3",
        bias_corrected_kl: bool = False,
        entropy_weight: float = 0.0,
        importance_sampling: dict[str, Any] | None = None,
        head: Any = None,
        chunk_size: ChunkSize = None,
        loss_options: dict[str, Any] | None = None,
        name: str = "policy_model",
        **kwargs: Any,
    ) -> None:
        loss_options = dict(loss_options or {})
        reserved = sorted(set(loss_options) & {"kind", "clip", "level", "reduction", "mask", "weights"})
        if reserved:
            raise ValueError(f"`loss_options` holds {reserved}: the model says those; give them as its arguments.")
        options = penalties.policy_loss.check_options(
            kind=check.choice(*POLICY_LOSSES)("kind", kind),
            clip=clip,
            level=check.choice(*POLICY_LEVELS)("level", level),
            reduction=reduction,
            **loss_options,
        )
        kinds.kind_clip(kind, options["clip"])
        kinds.check_level(kind, level)
        if reduction == "none":
            raise ValueError("`reduction='none'`: a model's loss is a scalar; use 'mean', 'sequence_mean', … .")
        self.kl_weight = check.non_negative("kl_weight", kl_weight)
        self.kl_estimator = check.choice(*ESTIMATORS)("kl_estimator", kl_estimator)
        self.bias_corrected_kl = check.boolean("bias_corrected_kl", bias_corrected_kl)
        self.entropy_weight = check.non_negative("entropy_weight", entropy_weight)
        if importance_sampling is not None:
            unknown = sorted(set(importance_sampling) - set(IMPORTANCE_OPTIONS))
            if unknown:
                raise ValueError(f"`importance_sampling` takes {list(IMPORTANCE_OPTIONS)}; got {unknown}.")
            importance_sampling = penalties.importance_weights.check_options(**importance_sampling)
        if isinstance(reference, str):
            reference = check.choice("copy")("reference", reference)
        super().__init__(name=name, **kwargs)
        self.policy = policy
        self.lm = LanguageModel(policy, head, "policy")
        if reference == "copy":
            reference = frozen_copy(policy)
        elif reference is not None:
            reference.trainable = False
        self.reference = reference
        self.head_name = head_name(head)
        self.reference_lm = None if reference is None else LanguageModel(reference, self.head_name, "reference")
        self.kind, self.clip, self.level, self.reduction = kind, options["clip"], level, reduction
        self.importance_sampling = importance_sampling
        self.chunk_size = check.chunk_size("chunk_size", chunk_size)
        self.loss_options = loss_options
        # A log a term: `kl` and `entropy` with their weights; `reward` and `reward_std` read `rewards`.
        logs = ["policy_loss"] + ["kl"] * (self.kl_weight > 0) + ["entropy"] * (self.entropy_weight > 0)
        if kind in CLIPPED:
            logs += CLIP_LOGS
        if importance_sampling is not None:
            logs.append("sampling/importance_sampling_ratio/mean")
        self.log_trackers = {log: keras.metrics.Mean(name=log) for log in (*logs, "reward", "reward_std")}

    # ---------------------------------------------------------------- data

    def required_keys(self) -> tuple[str, ...]:
        """The data keys this model reads."""
        keys: tuple[str, ...] = REQUIRED
        if self.kl_weight > 0 and self.reference is None:
            keys += ("ref_logprobs",)
        if self.importance_sampling is not None:
            keys += ("sampler_logprobs",)
        return keys

    def check_data(self, x: Any) -> None:
        """A ValueError naming the keys `x` lacks (a dict), before any
        tensor work."""
        given = self._keys_given(x)
        if given is None:
            return
        missing = [key for key in self.required_keys() if key not in given]
        if missing:
            why = []
            if "ref_logprobs" in missing:
                why.append("kl_weight > 0 with no reference model needs ref_logprobs")
            if "sampler_logprobs" in missing:
                why.append("importance_sampling needs sampler_logprobs")
            raise ValueError(
                f"The data lacks {missing}: the model reads {list(self.required_keys())}"
                + (f" ({'; '.join(why)})" if why else "")
                + "."
            )

    def fit(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.check_data(x)
        return super().fit(x, *args, **kwargs)

    def _keys_given(self, x):
        """The keys `x` gives: a dict's, a `Rollouts`' (None: unknown)."""
        if isinstance(x, dict):
            return set(x)
        keys = getattr(x, "keys", None)
        return set(keys) if isinstance(keys, tuple) else None

    def evaluate(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.check_data(x)
        return super().evaluate(x, *args, **kwargs)

    # ---------------------------------------------------------------- forward

    def call(self, inputs: Any, training: Any = None) -> Any:
        """The hidden states of a data dict's sequences (what `compute_loss`
        reads), or the policy's output (its own inputs)."""
        if not isinstance(inputs, dict) or "completion_mask" not in inputs:
            return self.policy(inputs, training=training)
        return self.lm.hidden(inputs["token_ids"], _padding(inputs), training=training)

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None, training: bool = True
    ) -> Tensor:
        if y_pred is None:
            y_pred = self(x, training=training)
        own = [ops.cast(loss, "float32") for loss in self.losses]  # the policy's, before the reference runs
        ids = ops.cast(x["token_ids"], "int32")
        completion = ops.cast(x["completion_mask"], "float32")
        mask = completion[:, 1:]
        with reductions.global_token_means(self):
            scored = self.lm.token_logprobs(
                y_pred, ids, completion, self.chunk_size, return_entropy=self.entropy_weight > 0
            )
            logprobs, entropy = scored if self.entropy_weight > 0 else (scored, None)
            old = ops.stop_gradient(logprobs) if "old_logprobs" not in x else aligned(x["old_logprobs"])
            advantages = aligned(x["advantages"])
            total, logs = self._policy_terms(x, logprobs, old, advantages, mask)
            if self.kl_weight > 0:
                ref = self._reference(x, ids, completion)
                corrected = {"old_logprobs": old} if self.bias_corrected_kl else {}
                logs["kl"] = penalties.kl_estimate(
                    logprobs,
                    ref,
                    estimator=self.kl_estimator,
                    mask=mask,
                    reduction=self.reduction,
                    **corrected,
                    **self._max_length(),
                )
                total = total + self.kl_weight * logs["kl"]
            if entropy is not None:
                logs["entropy"] = reductions.masked_reduce(entropy, mask > 0, "mean")
                total = total - self.entropy_weight * logs["entropy"]
            if "rewards" in x:
                logs["reward"], logs["reward_std"] = _mean_and_std(ops.cast(x["rewards"], "float32"))
        total = ops.cast(total, "float32") + (sum(own) if own else 0.0)
        for name, value in logs.items():
            self.log_trackers[name].update_state(ops.stop_gradient(ops.cast(value, "float32")))
        return _replicas.share(total)

    def _policy_terms(self, x, logprobs, old, advantages, mask):
        options = {"kind": self.kind, "clip": self.clip, "level": self.level, "reduction": self.reduction}
        weights, policy_mask, logs = None, mask, {}
        if self.importance_sampling is not None:
            sampler = aligned(x["sampler_logprobs"])
            weights, kept = penalties.importance_weights(old, sampler, mask=mask, **self.importance_sampling)
            logs["sampling/importance_sampling_ratio/mean"] = reductions.whole_batch_mean(
                ops.sum(weights), ops.sum(ops.cast(kept, weights.dtype))
            )
            policy_mask = kept
        logs["policy_loss"] = penalties.policy_loss(
            logprobs,
            old if self.kind != "reinforce" else None,
            advantages,
            mask=policy_mask,
            weights=weights,
            **options,
            **self.loss_options,
        )
        if self.kind in CLIPPED:
            fractions = penalties.clip_fraction(
                ops.stop_gradient(logprobs),
                old,
                advantages,
                clip=kinds.kind_clip(self.kind, self.clip),
                level=self.level,
                mask=mask,
            )
            for key in ("low", "high", "region"):
                logs[f"clip_ratio/{key}_mean"] = fractions[key]
        return logs["policy_loss"], logs

    def score(self, data: dict[str, Any]) -> np.ndarray:
        """The policy's log-probabilities of `data`'s tokens now, aligned
        with the ids (column 0, never scored, is 0), as NumPy: the
        `old_logprobs` of a rollout trained on in several steps."""
        ids = ops.cast(ops.convert_to_tensor(data["token_ids"]), "int32")
        completion = ops.cast(ops.convert_to_tensor(data["completion_mask"]), "float32")
        hidden = self.lm.hidden(ids, _padding({**data, "token_ids": ids}), training=False)
        logprobs = np.asarray(ops.convert_to_numpy(self.lm.token_logprobs(hidden, ids, completion, self.chunk_size)))
        return np.concatenate([np.zeros((len(logprobs), 1), logprobs.dtype), logprobs], axis=1)

    def _reference(self, x, ids, completion):
        if "ref_logprobs" in x:
            return aligned(x["ref_logprobs"])
        hidden = self.reference_lm.hidden(ids, _padding(x), training=False)
        return ops.stop_gradient(self.reference_lm.token_logprobs(hidden, ids, completion, self.chunk_size))

    def _max_length(self):
        return {"max_length": self.loss_options["max_length"]} if "max_length" in self.loss_options else {}

    # ---------------------------------------------------------------- Keras

    def get_config(self) -> dict[str, Any]:
        return models_config(
            self.policy,
            self.reference,
            {
                "name": self.name,
                "kind": self.kind,
                "clip": self.clip,
                "level": self.level,
                "reduction": self.reduction,
                "kl_weight": self.kl_weight,
                "kl_estimator": self.kl_estimator,
                "bias_corrected_kl": self.bias_corrected_kl,
                "entropy_weight": self.entropy_weight,
                "importance_sampling": self.importance_sampling,
                "head": self.head_name,
                "chunk_size": self.chunk_size,
                "loss_options": self.loss_options,
            },
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PolicyModel":
        policy, reference, options = models_from_config(config)
        return cls(policy, reference, **options)


def _padding(x):
    return ops.cast(x.get("padding_mask", ops.ones_like(x["token_ids"])), "int32")


def _mean_and_std(values):
    """The whole batch's mean and sample (Bessel-corrected) standard
    deviation of per-sequence values."""
    total, squares, n = reductions.whole_batch_sums(
        [ops.sum(values), ops.sum(ops.square(values)), ops.cast(ops.shape(values)[0], "float32")]
    )
    mean = total / ops.maximum(n, 1.0)
    variance = (squares - n * ops.square(mean)) / ops.maximum(n - 1.0, 1.0)
    return mean, ops.sqrt(ops.maximum(variance, 0.0))
