"""`Rollouts`: the data of on-policy fine-tuning, sampled by the policy being
trained (keras-hub's `generate`), scored by reward functions, with group
advantages: a `keras.utils.PyDataset` for `PolicyModel.fit`."""

from typing import Any, Callable, Sequence

import keras
import numpy as np

from keras_penalties import _validation as check

SCALES = ("group", "batch", "none")
# GRPO's advantages divide by the standard deviation plus this (TRL's 1e-4).
_STD_EPSILON = 1e-4


class Rollouts(keras.utils.PyDataset):
    """Rollout batches for `PolicyModel.fit`, on every backend.

    Each batch takes `batch_size` prompts, samples `num_generations`
    completions of each with `model.policy.generate` (keras-hub's; its
    `sampler`, up to `max_length` tokens in all, stopping at the stop
    tokens), scores them with `reward_fn(token_ids, completion_mask)` → [n]
    (NumPy in and out; a list of such functions is summed), and gives
    `token_ids`, `padding_mask`, `completion_mask` (1 on the generated
    tokens up to and including the first stop token), `rewards` and
    `advantages` = r − the mean of its group, divided by the group's sample
    standard deviation + 1e-4 (`"group"`: GRPO, TRL's), by the batch's
    (`"batch"`), or not (`"none"`: Dr. GRPO). A prompt's completions are
    `num_generations` rows of its batch. With `num_iterations` μ > 1 the
    same rollouts are given μ times; when an epoch holds more than one
    step, `old_logprobs` are scored at generation (TRL's
    `steps_per_generation` > 1).

    Inside `fit` an epoch's rollouts are all generated at its start, from
    the policy's weights at that moment, alike on every backend (Keras'
    JAX trainer holds the weights outside the model during an epoch): so
    `fit(Rollouts(..., batches_per_epoch=1), epochs=N)` is N on-policy
    rounds. Indexed outside `fit`, a batch is generated when asked, and
    the next epoch starts with it (Keras' TF adapter reads two batches for
    their shapes before the first epoch).

    Args:
        model: a `PolicyModel` (its `policy` samples and, for `old_logprobs`,
            scores), or a keras-hub causal LM.
        prompts: int [n, prompt_length] (every token a prompt's), or
            keras-hub's generate dict `{"token_ids", "padding_mask"}`.
        reward_fn: a function, or a list of them, of (token_ids,
            completion_mask) → rewards [n].
        num_generations: completions a prompt (≥ 2 with `"group"`).
        batch_size: prompts a batch.
        batches_per_epoch: None (len(prompts) // batch_size), or an int;
            the prompts are cycled across epochs.
        max_length: tokens in all, prompt and completion (None: the
            backbone's `max_sequence_length`).
        sampler: a keras-hub sampler or its name, for this generation only.
        stop_token_ids: "auto" (the preprocessor's end token; none without
            a preprocessor), None, or a tuple of ids.
        scale_rewards: `"group"`, `"batch"` or `"none"`.
        num_iterations: μ ≥ 1.
        seed: None, or an int: the same rollouts on a rerun.
        **kwargs: `keras.utils.PyDataset`'s (`max_queue_size`; one worker,
            no multiprocessing: the policy generates in the training process).
    """

    def __init__(
        self,
        model: Any,
        prompts: Any,
        reward_fn: Callable[..., Any] | Sequence[Callable[..., Any]],
        *,
        num_generations: int = 8,
        batch_size: int = 8,
        batches_per_epoch: int | None = None,
        max_length: int | None = None,
        sampler: Any = "random",
        stop_token_ids: Any = "auto",
        scale_rewards: str = "group",
        num_iterations: int = 1,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("workers", 1) > 1 or kwargs.get("use_multiprocessing"):
            raise ValueError(
                "`Rollouts` generates with the policy in the training process, one batch at a time: leave "
                "`workers` at 1 and `use_multiprocessing` False."
            )
        super().__init__(**kwargs)
        self.num_generations = check.positive_integer("num_generations", num_generations)
        self.batch_size = check.positive_integer("batch_size", batch_size)
        self.scale_rewards = check.choice(*SCALES)("scale_rewards", scale_rewards)
        if self.scale_rewards == "group" and self.num_generations < 2:
            raise ValueError(
                "`num_generations` must be >= 2 with scale_rewards='group': a group of one has no standard deviation."
            )
        self.num_iterations = check.positive_integer("num_iterations", num_iterations)
        self.reward_fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
        if not self.reward_fns or not all(callable(f) for f in self.reward_fns):
            raise TypeError(f"`reward_fn` must be a function, or a list of them; got {reward_fn!r}.")
        self.model = model
        self.policy = getattr(model, "policy", model)
        if not hasattr(self.policy, "generate"):
            raise TypeError("`model` must be a PolicyModel (or a keras-hub causal LM) whose policy has `generate`.")
        self.prompts = _prompts(prompts)
        n = len(self.prompts["token_ids"])
        if batches_per_epoch is None:
            batches_per_epoch = n // self.batch_size
            if batches_per_epoch < 1:
                raise ValueError(f"`batch_size` ({batch_size}) exceeds the {n} prompts given.")
        self.batches_per_epoch = check.positive_integer("batches_per_epoch", batches_per_epoch)
        max_length = max_length or getattr(self.policy.backbone, "max_sequence_length", None)
        if max_length is None:
            raise ValueError(
                f"`max_length`: {type(self.policy.backbone).__name__} has no `max_sequence_length`; give "
                "max_length=, the tokens of a prompt and its completion in all."
            )
        self.max_length = check.positive_integer("max_length", max_length)
        width = self.prompts["token_ids"].shape[1]
        if width >= self.max_length:
            raise ValueError(f"`max_length` ({self.max_length}) leaves no room after prompts of {width} tokens.")
        self.stop_token_ids = _stop_tokens(self.policy, stop_token_ids)
        self.sampler = _sampler(sampler, seed)
        self.seed = seed
        # Batches generated outside an epoch (Keras' TF adapter reads the
        # first two for their shapes before the first epoch begins): the
        # next epoch starts with them, from the same weights.
        self._epoch, self._generate_function = 0, None
        self._cache: dict[int, dict[str, np.ndarray]] | None = None
        self._early: dict[int, dict[str, np.ndarray]] = {}

    @property
    def num_batches(self) -> int:
        return self.batches_per_epoch * self.num_iterations

    def __len__(self) -> int:
        return self.num_batches

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of a batch."""
        keys = ("token_ids", "padding_mask", "completion_mask", "rewards", "advantages")
        return keys + (("old_logprobs",) if self._scores else ())

    @property
    def _scores(self) -> bool:
        return self.num_batches > 1 and hasattr(self.model, "score")

    def on_epoch_begin(self) -> None:
        self._cache, self._early = self._early, {}
        for index in range(self.batches_per_epoch):
            if index not in self._cache:
                self._cache[index] = self._rollout(index)

    def on_epoch_end(self) -> None:
        self._epoch += 1
        self._cache = None

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = index % self.batches_per_epoch
        cache = self._early if self._cache is None else self._cache
        if index not in cache:
            cache[index] = self._rollout(index)
        return cache[index]

    # ---------------------------------------------------------------- a batch

    def _rollout(self, index: int) -> dict[str, np.ndarray]:
        n = len(self.prompts["token_ids"])
        start = ((self._epoch * self.batches_per_epoch + index) * self.batch_size) % n
        rows = np.arange(start, start + self.batch_size) % n
        token_ids = np.repeat(self.prompts["token_ids"][rows], self.num_generations, axis=0)
        prompt_mask = np.repeat(self.prompts["padding_mask"][rows], self.num_generations, axis=0)
        padded = np.zeros((len(token_ids), self.max_length), token_ids.dtype)
        padded[:, : token_ids.shape[1]] = token_ids
        padding = np.zeros(padded.shape, bool)
        padding[:, : token_ids.shape[1]] = prompt_mask
        out = self._generate({"token_ids": padded, "padding_mask": padding})
        ids = np.asarray(keras.ops.convert_to_numpy(out["token_ids"])).astype("int32")
        mask = np.asarray(keras.ops.convert_to_numpy(out["padding_mask"])).astype(bool)
        completion = (mask & ~padding).astype("float32")
        rewards = self._rewards(ids, completion)
        data = {
            "token_ids": ids,
            "padding_mask": mask.astype("int32"),
            "completion_mask": completion,
            "rewards": rewards,
            "advantages": self._advantages(rewards),
        }
        if self._scores:
            data["old_logprobs"] = self.model.score(data)
        return data

    def _generate(self, inputs):
        # This generation's sampler, and its compiled function kept for the
        # next batch, on token ids (no preprocessor: it would tokenize);
        # the policy's own left as they were.
        policy = self.policy
        saved = (policy.sampler, policy.generate_function, policy.preprocessor)
        policy.sampler, policy.generate_function, policy.preprocessor = self.sampler, self._generate_function, None
        try:
            out = policy.generate(inputs, stop_token_ids=self.stop_token_ids)
            self._generate_function = policy.generate_function
            return out
        finally:
            policy.sampler, policy.generate_function, policy.preprocessor = saved

    def _rewards(self, ids, completion):
        total = np.zeros(len(ids), "float32")
        for fn in self.reward_fns:
            rewards = np.asarray(fn(ids, completion), "float32")
            if rewards.shape != (len(ids),):
                raise ValueError(
                    f"`reward_fn` {getattr(fn, '__name__', fn)!r} must return one reward a completion, shape "
                    f"({len(ids)},); got {rewards.shape}."
                )
            total = total + rewards
        return total

    def _advantages(self, rewards):
        groups = rewards.reshape(-1, self.num_generations)
        centred = groups - groups.mean(axis=1, keepdims=True)
        if self.scale_rewards == "group":
            centred = centred / (groups.std(axis=1, ddof=1, keepdims=True) + _STD_EPSILON)
        elif self.scale_rewards == "batch":
            centred = centred / (rewards.std(ddof=1) + _STD_EPSILON)
        return centred.reshape(-1).astype("float32")


def _prompts(prompts):
    """Prompts as `{"token_ids", "padding_mask"}` NumPy arrays."""
    if isinstance(prompts, dict):
        token_ids = np.asarray(prompts["token_ids"])
        padding = np.asarray(prompts.get("padding_mask", np.ones(token_ids.shape, bool))).astype(bool)
    else:
        token_ids = np.asarray(prompts)
        padding = np.ones(token_ids.shape, bool)
    if token_ids.ndim != 2 or not np.issubdtype(token_ids.dtype, np.integer):
        raise ValueError(
            f"`prompts` must be int [n, prompt_length] token ids; got {token_ids.dtype} {token_ids.shape}."
        )
    return {"token_ids": token_ids, "padding_mask": padding}


def _stop_tokens(policy, stop_token_ids):
    if stop_token_ids != "auto":
        return stop_token_ids
    preprocessor = getattr(policy, "preprocessor", None)
    tokenizer = getattr(preprocessor, "tokenizer", None)
    ends = [getattr(tokenizer, name, None) for name in ("end_token_id", "end_token2_id")]
    ends = tuple(end for end in ends if end is not None)
    return ends or None


def _sampler(sampler, seed):
    """A keras-hub sampler: the one given, or made from its name (seeded)."""
    if not isinstance(sampler, str):
        return sampler
    import keras_hub  # type: ignore[import-untyped]

    made = keras_hub.samplers.get(sampler)
    return made if seed is None else type(made).from_config({**made.get_config(), "seed": seed})
