"""`PreferenceModel`: preference optimisation (DPO and its family, KTO) of a
causal LM as a `keras.Model` that `compile` and `fit` train, as
`keras.distillation.Distiller` trains a student."""

from typing import Any

import keras
from keras import ops

from keras_penalties import _replicas
from keras_penalties import _validation as check
from keras_penalties import ops as penalties
from keras_penalties._types import ChunkSize, PreferenceKind, Tensor, UnpairedKind
from keras_penalties.ops import _preference_kinds as kinds
from keras_penalties.ops import _reductions as reductions
from keras_penalties.ops import unpaired
from keras_penalties.post_training._lm import (
    LanguageModel,
    aligned,
    frozen_copy,
    head_name,
    models_config,
    models_from_config,
    side_by_side,
)

UNPAIRED = ("kto", "apo_zero_unpaired")
KINDS = (*kinds.KINDS, *UNPAIRED)
# What each kind reads from the data: required, then optional.
PAIRED_KEYS = ("chosen_ids", "rejected_ids", "chosen_mask", "rejected_mask")
UNPAIRED_KEYS = ("completion_ids", "completion_mask", "label")
# TRL 1.16's log names, a Keras metric each.
PAIRED_LOGS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
UNPAIRED_LOGS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def _reference_free(kind):
    return kind in kinds.KINDS and kinds.KINDS[kind].reference_free


@keras.saving.register_keras_serializable(package="keras_penalties")
class PreferenceModel(keras.Model):
    """A causal LM trained on preferences: DPO and its family on pairs of
    completions, KTO on completions labelled desirable or not.

    `fit` and `evaluate` take the data as a dict (`y` None). Pairs:
    `chosen_ids`, `rejected_ids` (int [batch, length]: the prompt and the
    completion, each side its own length), `chosen_mask`, `rejected_mask`
    (1 on the completion's tokens, 0 on the prompt and the padding);
    optional `chosen_padding_mask`, `rejected_padding_mask` (the backbone's
    `padding_mask`; default all ones) and `ref_chosen_logprobs`,
    `ref_rejected_logprobs` (per sequence [batch], or per token aligned with
    the ids: TRL's precomputed reference, which spares the reference's
    pass). Unpaired (`kind="kto"`, `"apo_zero_unpaired"`): `completion_ids`,
    `completion_mask`, `label` ([batch], 1 desirable); optional
    `completion_padding_mask`, `ref_logprobs`; KTO's baseline from
    `kl_ids`, `kl_mask` (optional `kl_padding_mask`): each prompt with
    another example's completion, as TRL builds them; or
    `loss_options={"kl_baseline": z0}`. Per-token arrays align with the ids:
    entry t is token t's, read from the hidden state at t − 1.

    Both sides go through the policy in one call, concatenated along the
    batch (each padded to the longer), as TRL's concatenated forward; each
    token's log-probability comes from the hidden states through the head
    by `ops.token_logprobs`, `chunk_size` rows at a time (None: whole), the
    reference's under stop-gradient. The loss is `ops.preference_loss`
    (`ops.unpaired_preference_loss` for the unpaired kinds) plus the
    policy's own losses (regularizers, `add_loss`, a keras-hub MoE block's
    router loss). Logs (TRL 1.16's names; global means under several
    devices): `loss`, `rewards/chosen`, `rewards/rejected` (β × each side's
    log-ratio to the reference), `rewards/margins`, `rewards/accuracies`,
    `logps/chosen`, `logps/rejected` (the policy's sequence values as the
    kind reduces them: sums, or means for the mean kinds), `nll` (with
    `nll_weight`), KTO's `kl` (its baseline z₀; its rewards and logps over
    the desirable and the undesirable examples).

    Args:
        policy: a keras-hub `CausalLM` (its backbone's hidden states, its
            token embedding reversed as the head), or a Keras model whose
            output is logits, with `head`.
        reference: `"auto"` (`"copy"` for the kinds with a reference, None
            for simpo and orpo), `"copy"` (a frozen copy of the policy's
            weights now), a model (frozen here; its head found the same
            way), or None (the data carries the reference's
            log-probabilities).
        kind: `ops.preference_loss`'s kinds, or `"kto"`,
            `"apo_zero_unpaired"`.
        beta: β > 0.
        nll_weight: α ≥ 0, the chosen completions' NLL (RPO; ORPO is
            `kind="orpo", nll_weight=1.0`): `preference_loss`'s `nll`.
        head: with a model that is not keras-hub's, its vocabulary
            projection (a layer or its name).
        chunk_size: rows per chunk of the log-probabilities, or None.
        loss_options: a dict of the loss op's other options
            (`label_smoothing`, `divergence`, `gamma`, `desirable_weight`,
            `kl_baseline`, ...).
        name: the model's name.

    Example:

    ```python
    model = PreferenceModel(causal_lm, kind="sigmoid", beta=0.1, chunk_size=256)
    model.compile(optimizer=keras.optimizers.Adam(1e-5))
    model.fit(pairs, epochs=1)  # dict of chosen_ids, rejected_ids, chosen_mask, rejected_mask
    ```
    """

    def __init__(
        self,
        policy: keras.Model,
        reference: Any = "auto",
        *,
        kind: PreferenceKind | UnpairedKind = "sigmoid",
        beta: float = 0.1,
        nll_weight: float = 0.0,
        head: Any = None,
        chunk_size: ChunkSize = None,
        loss_options: dict[str, Any] | None = None,
        name: str = "preference_model",
        **kwargs: Any,
    ) -> None:
        kind = check.choice(*KINDS)("kind", kind)
        beta = check.positive("beta", beta)
        nll_weight = check.non_negative("nll_weight", nll_weight)
        chunk_size = check.chunk_size("chunk_size", chunk_size)
        loss_options = dict(loss_options or {})
        op = penalties.unpaired_preference_loss if kind in UNPAIRED else penalties.preference_loss
        taken = {"kind", "beta", "nll", "reduction", "chosen_mask", "rejected_mask", "mask", "kl_mask"}
        reserved = sorted(set(loss_options) & taken)
        if reserved:
            raise ValueError(f"`loss_options` holds {reserved}: the model says those; give them as its arguments.")
        if nll_weight and kind in UNPAIRED:
            raise ValueError(f"`nll_weight` applies to the paired kinds; kind={kind!r} has none.")
        op.check_options(**loss_options)
        if kind not in UNPAIRED:
            kinds.check_options(
                kind, loss_options.get("divergence", "reverse_kl"), loss_options.get("label_smoothing", 0.0)
            )
        if isinstance(reference, str):
            reference = check.choice("auto", "copy")("reference", reference)
        if _reference_free(kind) and reference not in ("auto", None):
            raise ValueError(f"kind={kind!r} is reference free: leave `reference` 'auto' or None.")
        super().__init__(name=name, **kwargs)
        self.policy = policy
        self.lm = LanguageModel(policy, head, "policy")
        if reference == "auto":
            reference = None if _reference_free(kind) else "copy"
        if reference == "copy":
            reference = frozen_copy(policy)
        elif reference is not None:
            reference.trainable = False
        self.reference = reference
        self.reference_lm = None if reference is None else LanguageModel(reference, head_name(head), "reference")
        self.kind, self.beta, self.nll_weight, self.chunk_size = kind, beta, nll_weight, chunk_size
        self.head_name = head_name(head)
        self.loss_options = loss_options
        logs = UNPAIRED_LOGS if kind in UNPAIRED else PAIRED_LOGS + (("nll",) if nll_weight else ())
        # Keras' own tracker logs `loss` (compute_loss's value).
        self.log_trackers = {log: keras.metrics.Mean(name=log) for log in logs}

    # ---------------------------------------------------------------- data

    def required_keys(self) -> tuple[str, ...]:
        """The data keys this model's kind reads."""
        keys: tuple[str, ...] = UNPAIRED_KEYS if self.kind in UNPAIRED else PAIRED_KEYS
        kl = self._kl_pairs
        if kl:
            keys += ("kl_ids", "kl_mask")
        if self.reference is None and not _reference_free(self.kind):
            if self.kind in UNPAIRED:
                keys += ("ref_logprobs", "ref_kl_logprobs") if kl else ("ref_logprobs",)
            else:
                keys += ("ref_chosen_logprobs", "ref_rejected_logprobs")
        return keys

    def check_data(self, x: Any) -> None:
        """A ValueError naming the keys `x` lacks (a dict), before any
        tensor work."""
        if not isinstance(x, dict):
            return
        missing = [key for key in self.required_keys() if key not in x]
        if missing:
            raise ValueError(
                f"The data lacks {missing}: kind={self.kind!r} reads {list(self.required_keys())}"
                + (
                    " (KTO's baseline: kl_ids and kl_mask, or loss_options={'kl_baseline': z0})"
                    if "kl_ids" in missing
                    else ""
                )
                + "."
            )

    def fit(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.check_data(x)
        return super().fit(x, *args, **kwargs)

    def evaluate(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.check_data(x)
        return super().evaluate(x, *args, **kwargs)

    def _sides(self, x):
        """The names of the sides the policy reads in one call."""
        if self.kind in UNPAIRED:
            return ("completion", "kl") if self._kl_pairs else ("completion",)
        return ("chosen", "rejected")

    @property
    def _kl_pairs(self) -> bool:
        """Whether KTO's baseline comes from mismatched pairs in the data."""
        return self.kind == "kto" and "kl_baseline" not in self.loss_options

    # ---------------------------------------------------------------- forward

    def call(self, inputs: Any, training: Any = None) -> Any:
        """The hidden states of every side, concatenated along the batch (a
        data dict: what `compute_loss` reads), or the policy's output (its
        own inputs)."""
        if not isinstance(inputs, dict) or not any(f"{side}_ids" in inputs for side in ("chosen", "completion")):
            return self.policy(inputs, training=training)
        ids, padding = self._concatenated(inputs, self._sides(inputs))
        return self.lm.hidden(ids, padding, training=training)

    def _concatenated(self, x, sides):
        ids = side_by_side(*(ops.cast(x[f"{side}_ids"], "int32") for side in sides))
        padding = side_by_side(
            *(ops.cast(x.get(f"{side}_padding_mask", ops.ones_like(x[f"{side}_ids"])), "int32") for side in sides)
        )
        return ids, padding

    def _logprobs(self, lm, hidden, x, sides):
        """Each side's per-token log-probabilities [batch, length − 1] from
        the concatenated hidden states."""
        ids, _ = self._concatenated(x, sides)
        mask = side_by_side(*(ops.cast(x[f"{side}_mask"], "float32") for side in sides))
        logprobs = lm.token_logprobs(hidden, ids, mask, self.chunk_size)
        out, start = {}, 0
        for side in sides:
            rows = ops.shape(x[f"{side}_ids"])[0]
            length = x[f"{side}_ids"].shape[1]
            out[side] = logprobs[start : start + rows, : length - 1 if length is not None else None]
            start = start + rows
        return out

    def _reference_logprobs(self, x, sides):
        ids, padding = self._concatenated(x, sides)
        hidden = self.reference_lm.hidden(ids, padding, training=False)
        return {side: ops.stop_gradient(v) for side, v in self._logprobs(self.reference_lm, hidden, x, sides).items()}

    # ---------------------------------------------------------------- loss

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None, training: bool = True
    ) -> Tensor:
        if y_pred is None:
            y_pred = self(x, training=training)
        own = [ops.cast(loss, "float32") for loss in self.losses]  # the policy's, before the reference runs
        sides = self._sides(x)
        with reductions.global_token_means(self):
            logprobs = self._logprobs(self.lm, y_pred, x, sides)
            if self.kind in UNPAIRED:
                total, logs = self._unpaired(x, logprobs, sides)
            else:
                total, logs = self._paired(x, logprobs)
        total = ops.cast(total, "float32") + (sum(own) if own else 0.0)
        for name, value in logs.items():
            self.log_trackers[name].update_state(value)
        # The values above are this replica's one-device numbers.
        return _replicas.share(total)

    def _references(self, x, names, sides):
        """The reference's log-probabilities of `sides` (`names` in the
        data): from the data (per sequence, or per token aligned with the
        ids), or the reference model's, in one call."""
        if all(name in x for name in names):
            return [aligned(x[name]) for name in names]
        refs = self._reference_logprobs(x, sides)
        return [refs[side] for side in sides]

    def _paired(self, x, logprobs):
        masks = {f"{side}_mask": ops.cast(x[f"{side}_mask"], "float32")[:, 1:] for side in ("chosen", "rejected")}
        refs = []
        if not _reference_free(self.kind):
            refs = self._references(x, ("ref_chosen_logprobs", "ref_rejected_logprobs"), ("chosen", "rejected"))
        chosen, rejected = logprobs["chosen"], logprobs["rejected"]
        options = {"kind": self.kind, "beta": self.beta, **masks}
        total = penalties.preference_loss(chosen, rejected, *refs, nll=self.nll_weight, **options, **self.loss_options)
        logs = {}
        for statistic, log in (
            ("chosen", "chosen"),
            ("rejected", "rejected"),
            ("margin", "margins"),
            ("accuracy", "accuracies"),
        ):
            logs[f"rewards/{log}"] = penalties.preference_reward(
                chosen, rejected, *refs, statistic=statistic, kind=self.kind, beta=self.beta, **masks
            )
        for side in ("chosen", "rejected"):  # β = 1, no reference: the policy's own sequence values
            logs[f"logps/{side}"] = penalties.preference_reward(
                chosen, rejected, statistic=side, kind=self.kind, beta=1.0, **masks
            )
        if self.nll_weight:
            ones = ops.ones_like(chosen[:, 0])
            logs["nll"] = penalties.policy_loss(chosen, None, ones, kind="reinforce", mask=masks["chosen_mask"])
        return total, logs

    def _unpaired(self, x, logprobs, sides):
        mask = ops.cast(x["completion_mask"], "float32")[:, 1:]
        names = ("ref_logprobs", "ref_kl_logprobs")[: len(sides)]
        ref, *ref_kl = self._references(x, names, sides)
        refs = {}
        if "kl" in sides:
            refs = {
                "kl_logprobs": ops.stop_gradient(logprobs["kl"]),
                "ref_kl_logprobs": ref_kl[0],
                "kl_mask": ops.cast(x["kl_mask"], "float32")[:, 1:],
            }
        label = ops.cast(x["label"], "float32")
        completion = logprobs["completion"]
        total = penalties.unpaired_preference_loss(
            completion, ref, label, kind=self.kind, beta=self.beta, mask=mask, **refs, **self.loss_options
        )
        return total, self._unpaired_logs(completion, ref, label, mask, refs)

    def _unpaired_logs(self, completion, ref, label, mask, refs):
        """TRL's KTO logs: the rewards and log-probabilities of the
        desirable (`chosen`) and the undesirable (`rejected`) examples, and
        the baseline z₀ (`kl`)."""
        value = ops.sum(reductions.fill_masked(completion, mask > 0), axis=1)
        reference = ref if len(ref.shape) == 1 else ops.sum(reductions.fill_masked(ref, mask > 0), axis=1)
        reward = ops.stop_gradient(self.beta * (value - reference))
        desirable = label > 0
        logs = {}
        for name, rows in (("chosen", desirable), ("rejected", ops.logical_not(desirable))):
            weights = ops.cast(rows, "float32")
            logs[f"rewards/{name}"] = reductions.whole_batch_mean(ops.sum(reward * weights), ops.sum(weights))
            logs[f"logps/{name}"] = reductions.whole_batch_mean(
                ops.sum(ops.stop_gradient(value) * weights), ops.sum(weights)
            )
        logs["rewards/margins"] = logs["rewards/chosen"] - logs["rewards/rejected"]
        if refs:
            logs["kl"] = unpaired.baseline(refs["kl_logprobs"], refs["ref_kl_logprobs"], refs["kl_mask"])
        else:
            logs["kl"] = ops.cast(self.loss_options.get("kl_baseline", 0.0), "float32")
        return logs

    # ---------------------------------------------------------------- Keras

    def get_config(self) -> dict[str, Any]:
        return models_config(
            self.policy,
            self.reference,
            {
                "name": self.name,
                "kind": self.kind,
                "beta": self.beta,
                "nll_weight": self.nll_weight,
                "head": self.head_name,
                "chunk_size": self.chunk_size,
                "loss_options": self.loss_options,
            },
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PreferenceModel":
        policy, reference, options = models_from_config(config)
        return cls(policy, reference, **options)
