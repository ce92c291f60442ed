"""`PreferenceModel` on keras-hub causal LMs built from config (no download)
and on a plain Keras model with its head named: its loss, logs and
training step equal the ops applied by hand to log-probabilities formed
the obvious way (the model's own logits, a log-softmax, a gather), with
the same heads and references, in `compute_loss`, `evaluate` and `fit`,
chunked and not; errors before any tensor work; saving and loading.
"""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import special

from keras_penalties import ops as P
from keras_penalties.callbacks import ReferenceSync
from keras_penalties.post_training import PolicyModel, PreferenceModel, Rollouts
from tests.testing import to_numpy

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub needs Python 3.11+; make test installs it there (--no-deps, see the Makefile)"
)

VOCAB, PROMPT, BATCH = 23, 3, 4
RNG = np.random.default_rng(67)


def _gpt2(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=12,
        dropout=0.0,
    )
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(embeddings * 30.0)  # logits of a few units
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _side(length):
    """A side of each pair: the prompt then the completion, right-padded."""
    ids = RNG.integers(1, VOCAB, size=(BATCH, length)).astype("int32")
    ends = RNG.integers(PROMPT + 2, length + 1, size=BATCH)
    padding = (np.arange(length)[None, :] < ends[:, None]).astype("int32")
    mask = (padding * (np.arange(length)[None, :] >= PROMPT)).astype("float32")
    return ids * padding, padding, mask


def _pairs():
    (chosen, cp, cm), (rejected, rp, rm) = _side(9), _side(7)
    return {
        "chosen_ids": chosen,
        "rejected_ids": rejected,
        "chosen_mask": cm,
        "rejected_mask": rm,
        "chosen_padding_mask": cp,
        "rejected_padding_mask": rp,
    }


PAIRS = _pairs()


def _formed_logprobs(model, ids, padding):
    """log p of tokens 1.. from the model's own logits (float64): the obvious way."""
    logits = to_numpy(model({"token_ids": ids, "padding_mask": padding})).astype(np.float64)
    logp = special.log_softmax(logits[:, :-1], axis=-1)
    return np.take_along_axis(logp, ids[:, 1:, None].astype(int), -1)[..., 0]


def _by_hand(policy, reference, data, kind="sigmoid", beta=0.1, nll=0.0, **options):
    """The loss and TRL's logs, by the ops on the formed log-probabilities."""
    sides = {s: _formed_logprobs(policy, data[f"{s}_ids"], data[f"{s}_padding_mask"]) for s in ("chosen", "rejected")}
    masks = {f"{s}_mask": data[f"{s}_mask"][:, 1:] for s in ("chosen", "rejected")}
    refs = []
    if reference is not None:
        refs = [
            _formed_logprobs(reference, data[f"{s}_ids"], data[f"{s}_padding_mask"]) for s in ("chosen", "rejected")
        ]
    c, r = sides["chosen"], sides["rejected"]
    loss = float(P.preference_loss(c, r, *refs, kind=kind, beta=beta, nll=nll, **masks, **options))
    logs = {"loss": loss}
    for statistic, log in (
        ("chosen", "chosen"),
        ("rejected", "rejected"),
        ("margin", "margins"),
        ("accuracy", "accuracies"),
    ):
        logs[f"rewards/{log}"] = float(
            P.preference_reward(c, r, *refs, statistic=statistic, kind=kind, beta=beta, **masks)
        )
    for side in ("chosen", "rejected"):
        logs[f"logps/{side}"] = float(P.preference_reward(c, r, statistic=side, kind=kind, beta=1.0, **masks))
    return logs


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "orpo"])
def test_loss_and_logs_equal_the_ops_on_the_formed_logits(kind, chunk_size):
    policy = _gpt2()
    model = PreferenceModel(policy, kind=kind, nll_weight=1.0 if kind == "orpo" else 0.0, chunk_size=chunk_size)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    # The reference is a copy: the same numbers as the policy's before training.
    expected = _by_hand(policy, model.reference, PAIRS, kind=kind, nll=1.0 if kind == "orpo" else 0.0)
    np.testing.assert_allclose(float(model.compute_loss(PAIRS)), expected["loss"], rtol=1e-5, atol=1e-6)
    logs = model.evaluate(PAIRS, batch_size=BATCH, verbose=0, return_dict=True)
    for key, value in expected.items():
        np.testing.assert_allclose(logs[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert (model.reference is None) == (kind == "orpo")


class _ByHand(keras.Model):
    """The DPO step wired by hand, as the guides wired it: both sides
    through the policy, the logits formed, a log-softmax and a gather."""

    def __init__(self, policy, reference):
        super().__init__(name="by_hand")
        self.policy, self.reference = policy, reference

    def call(self, x):
        return x

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        def logprobs(model, side):
            logits = model({"token_ids": x[f"{side}_ids"], "padding_mask": x[f"{side}_padding_mask"]})[:, :-1]
            logp = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
            return ops.take_along_axis(logp, ops.expand_dims(x[f"{side}_ids"][:, 1:], -1), axis=-1)[..., 0]

        sides = [logprobs(self.policy, s) for s in ("chosen", "rejected")]
        refs = [ops.stop_gradient(logprobs(self.reference, s)) for s in ("chosen", "rejected")]
        masks = {f"{s}_mask": x[f"{s}_mask"][:, 1:] for s in ("chosen", "rejected")}
        return P.preference_loss(*sides, *refs, **masks)


def test_a_training_step_changes_the_weights_as_the_step_by_hand():
    trained = {}
    for way in ("model", "hand"):
        policy = _gpt2()
        reference = _gpt2()
        if way == "model":
            model = PreferenceModel(policy, reference, chunk_size=4)
        else:
            reference.trainable = False
            model = _ByHand(policy, reference)
        model.compile(optimizer=keras.optimizers.SGD(0.5))
        model.fit(PAIRS, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        trained[way] = policy.get_weights(), reference.get_weights()
    for a, b in zip(trained["model"][0], trained["hand"][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The reference never moves.
    for a, b in zip(trained["model"][1], _gpt2().get_weights()):
        np.testing.assert_array_equal(a, b)


def _unpaired():
    ids, padding, mask = _side(8)
    kl_ids = np.concatenate([ids[:, :PROMPT], np.roll(ids[:, PROMPT:], 1, axis=0)], axis=1)
    kl_padding = np.concatenate([padding[:, :PROMPT], np.roll(padding[:, PROMPT:], 1, axis=0)], axis=1)
    kl_mask = np.concatenate([mask[:, :PROMPT], np.roll(mask[:, PROMPT:], 1, axis=0)], axis=1)
    return {
        "completion_ids": ids,
        "completion_padding_mask": padding,
        "completion_mask": mask,
        "label": np.array([1, 0, 1, 1], "float32"),
        "kl_ids": kl_ids,
        "kl_padding_mask": kl_padding,
        "kl_mask": kl_mask,
    }


UNPAIRED = _unpaired()


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_kto_equals_the_ops_on_the_formed_logits(chunk_size):
    policy = _gpt2(1)
    reference = _gpt2(2)  # another model: z₀ and the rewards are not 0
    model = PreferenceModel(policy, reference, kind="kto", beta=0.5, chunk_size=chunk_size)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    formed = {
        (m, s): _formed_logprobs(mdl, UNPAIRED[f"{s}_ids"], UNPAIRED[f"{s}_padding_mask"])
        for m, mdl in (("policy", policy), ("reference", reference))
        for s in ("completion", "kl")
    }
    mask, kl_mask = UNPAIRED["completion_mask"][:, 1:], UNPAIRED["kl_mask"][:, 1:]
    expected = P.unpaired_preference_loss(
        formed["policy", "completion"],
        formed["reference", "completion"],
        UNPAIRED["label"],
        beta=0.5,
        mask=mask,
        kl_logprobs=formed["policy", "kl"],
        ref_kl_logprobs=formed["reference", "kl"],
        kl_mask=kl_mask,
    )
    np.testing.assert_allclose(float(model.compute_loss(UNPAIRED)), float(expected), rtol=1e-5, atol=1e-6)
    logs = model.evaluate(UNPAIRED, batch_size=BATCH, verbose=0, return_dict=True)
    gap = ((formed["policy", "kl"] - formed["reference", "kl"]) * kl_mask).sum(1)
    np.testing.assert_allclose(logs["kl"], max(0.0, gap.mean()), rtol=1e-4, atol=1e-6)
    delta = ((formed["policy", "completion"] - formed["reference", "completion"]) * mask).sum(1)
    desirable = UNPAIRED["label"] > 0
    np.testing.assert_allclose(logs["rewards/chosen"], 0.5 * delta[desirable].mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(logs["rewards/rejected"], 0.5 * delta[~desirable].mean(), rtol=1e-4, atol=1e-6)
    history = model.fit(UNPAIRED, batch_size=BATCH, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()


def _plain_lm():
    keras.utils.set_random_seed(3)
    tokens = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 6)(tokens)
    hidden = keras.layers.Dense(6, activation="tanh")(hidden)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="lm_head")(hidden))


def test_a_plain_keras_model_with_its_head_named():
    policy = _plain_lm()
    model = PreferenceModel(policy, head="lm_head", chunk_size=3)
    model.compile(optimizer=keras.optimizers.SGD(0.1))

    def formed(mdl, side):
        logits = to_numpy(mdl(PAIRS[f"{side}_ids"])).astype(np.float64)[:, :-1]
        return np.take_along_axis(special.log_softmax(logits, -1), PAIRS[f"{side}_ids"][:, 1:, None].astype(int), -1)[
            ..., 0
        ]

    sides = [formed(policy, s) for s in ("chosen", "rejected")]
    refs = [formed(model.reference, s) for s in ("chosen", "rejected")]
    masks = {f"{s}_mask": PAIRS[f"{s}_mask"][:, 1:] for s in ("chosen", "rejected")}
    np.testing.assert_allclose(
        float(model.compute_loss(PAIRS)), float(P.preference_loss(*sides, *refs, **masks)), rtol=1e-5
    )
    assert np.isfinite(model.fit(PAIRS, batch_size=BATCH, verbose=0).history["loss"]).all()


def test_precomputed_references_spare_the_reference_model():
    policy = _gpt2()
    refs = {
        f"ref_{s}_logprobs": _formed_logprobs(policy, PAIRS[f"{s}_ids"], PAIRS[f"{s}_padding_mask"])
        for s in ("chosen", "rejected")
    }
    # Per token, aligned with the ids: column 0 is never read.
    aligned = {
        k: np.concatenate([np.full((BATCH, 1), np.nan), v * PAIRS[k[4:-9] + "_mask"][:, 1:]], 1)
        for k, v in refs.items()
    }
    model = PreferenceModel(policy, reference=None)
    with_copy = PreferenceModel(policy)
    np.testing.assert_allclose(
        float(model.compute_loss({**PAIRS, **aligned})), float(with_copy.compute_loss(PAIRS)), rtol=1e-5, atol=1e-6
    )


def test_errors_name_what_to_pass():
    policy = _gpt2()
    with pytest.raises(ValueError, match=r"kind='simpo' is reference free"):
        PreferenceModel(policy, "copy", kind="simpo")
    with pytest.raises(ValueError, match=r"`head`: .* is not a keras-hub causal LM"):
        PreferenceModel(_plain_lm())
    with pytest.raises(ValueError, match=r"`loss_options` holds \['beta'\]"):
        PreferenceModel(policy, loss_options={"beta": 0.2})
    with pytest.raises(ValueError, match=r"`kind` must be one of"):
        PreferenceModel(policy, kind="dpo")
    model = PreferenceModel(policy, kind="kto")
    model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"The data lacks \['kl_ids', 'kl_mask'\]: kind='kto' reads"):
        model.fit({k: v for k, v in UNPAIRED.items() if not k.startswith("kl")}, verbose=0)
    paired = PreferenceModel(policy, reference=None)
    paired.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"lacks \['ref_chosen_logprobs', 'ref_rejected_logprobs'\]"):
        paired.evaluate(PAIRS, verbose=0)


def test_saves_and_loads(tmp_path):
    model = PreferenceModel(_gpt2(), kind="sigmoid", beta=0.2, chunk_size=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model.fit(PAIRS, batch_size=BATCH, verbose=0)
    before = float(model.compute_loss(PAIRS))
    path = str(tmp_path / "dpo.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, PreferenceModel) and loaded.beta == 0.2 and loaded.chunk_size == 4
    np.testing.assert_allclose(float(loaded.compute_loss(PAIRS)), before, rtol=1e-5)
    for a, b in zip(loaded.reference.get_weights(), model.reference.get_weights()):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ PolicyModel


def _rollout_data(length=10):
    ids = RNG.integers(1, VOCAB, size=(BATCH, length)).astype("int32")
    ends = RNG.integers(PROMPT + 3, length + 1, size=BATCH)
    padding = (np.arange(length)[None, :] < ends[:, None]).astype("int32")
    completion = (padding * (np.arange(length)[None, :] >= PROMPT)).astype("float32")
    return {
        "token_ids": ids * padding,
        "padding_mask": padding,
        "completion_mask": completion,
        "advantages": RNG.normal(size=BATCH).astype("float32"),
        "rewards": RNG.uniform(size=BATCH).astype("float32"),
    }


ROLLOUT = _rollout_data()


def _entropy(model, ids, padding):
    logits = to_numpy(model({"token_ids": ids, "padding_mask": padding})).astype(np.float64)[:, :-1]
    logp = special.log_softmax(logits, -1)
    return -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("kind, level, reduction", [("ppo", "token", "sequence_mean"), ("sapo", "sequence", "mean")])
def test_policy_loss_and_logs_equal_the_ops_on_the_formed_logits(kind, level, reduction, chunk_size):
    policy, reference = _gpt2(1), _gpt2(2)
    model = PolicyModel(
        policy,
        reference,
        kind=kind,
        level=level,
        reduction=reduction,
        kl_weight=0.05,
        entropy_weight=0.01,
        chunk_size=chunk_size,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    ids, padding = ROLLOUT["token_ids"], ROLLOUT["padding_mask"]
    logprobs = _formed_logprobs(policy, ids, padding)
    old = logprobs - 0.1 * RNG.uniform(size=logprobs.shape)
    data = {**ROLLOUT, "old_logprobs": np.concatenate([np.zeros((BATCH, 1)), old], 1).astype("float32")}
    mask = ROLLOUT["completion_mask"][:, 1:]
    ref = _formed_logprobs(reference, ids, padding)
    a = ROLLOUT["advantages"]
    policy_term = float(P.policy_loss(logprobs, old, a, kind=kind, level=level, reduction=reduction, mask=mask))
    kl = float(P.kl_estimate(logprobs, ref, mask=mask, reduction=reduction))
    entropy = float((_entropy(policy, ids, padding) * mask).sum() / mask.sum())
    expected = policy_term + 0.05 * kl - 0.01 * entropy
    np.testing.assert_allclose(float(model.compute_loss(data)), expected, rtol=1e-5, atol=1e-6)
    logs = model.evaluate(data, batch_size=BATCH, verbose=0, return_dict=True)
    fractions = P.clip_fraction(logprobs, old, a, level=level, mask=mask)
    checks = {
        "loss": expected,
        "policy_loss": policy_term,
        "kl": kl,
        "entropy": entropy,
        "clip_ratio/region_mean": float(fractions["region"]),
        "reward": ROLLOUT["rewards"].mean(),
        "reward_std": ROLLOUT["rewards"].std(ddof=1),
    }
    for key, value in checks.items():
        np.testing.assert_allclose(logs[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_importance_sampling_weighs_the_policy_loss_only():
    policy = _gpt2(1)
    options = {"level": "token", "mode": "mask", "bounds": (0.8, 1.25)}
    model = PolicyModel(policy, "copy", kl_weight=0.1, importance_sampling=options)
    ids, padding = ROLLOUT["token_ids"], ROLLOUT["padding_mask"]
    logprobs = _formed_logprobs(policy, ids, padding)
    sampler = logprobs + RNG.normal(scale=0.3, size=logprobs.shape)
    data = {**ROLLOUT, "sampler_logprobs": np.concatenate([np.zeros((BATCH, 1)), sampler], 1).astype("float32")}
    mask = ROLLOUT["completion_mask"][:, 1:]
    weights, kept = P.importance_weights(logprobs, sampler, mask=mask, **options)
    assert 0 < float(np.sum(to_numpy(kept))) < mask.sum()
    policy_term = P.policy_loss(logprobs, logprobs, ROLLOUT["advantages"], weights=weights, mask=kept)
    # The reference is a copy: the KL is 0, with the completion mask.
    np.testing.assert_allclose(float(model.compute_loss(data)), float(policy_term), rtol=1e-5, atol=1e-6)


class _GRPOByHand(keras.Model):
    """A GRPO step wired by hand: the logits formed, a log-softmax, a gather,
    the ops on them."""

    def __init__(self, policy):
        super().__init__(name="grpo_by_hand")
        self.policy = policy

    def call(self, x):
        return x

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        logits = self.policy({"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]})[:, :-1]
        logp = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        logprobs = ops.take_along_axis(logp, ops.expand_dims(x["token_ids"][:, 1:], -1), axis=-1)[..., 0]
        mask = x["completion_mask"][:, 1:]
        return P.policy_loss(
            logprobs, ops.stop_gradient(logprobs), x["advantages"], mask=mask, reduction="sequence_mean"
        )


def test_a_policy_step_changes_the_weights_as_the_step_by_hand():
    trained = []
    for by_hand in (False, True):
        policy = _gpt2(4)
        model = _GRPOByHand(policy) if by_hand else PolicyModel(policy, reduction="sequence_mean", chunk_size=3)
        model.compile(optimizer=keras.optimizers.SGD(0.5))
        model.fit(ROLLOUT, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        trained.append(policy.get_weights())
    for a, b in zip(*trained):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_policy_errors_name_what_to_pass():
    policy = _gpt2()
    model = PolicyModel(policy, kl_weight=0.1)
    model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"lacks \['ref_logprobs'\].*kl_weight > 0 with no reference model"):
        model.fit(ROLLOUT, verbose=0)
    sampled = PolicyModel(policy, importance_sampling={"mode": "mask"})
    sampled.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"lacks \['sampler_logprobs'\].*importance_sampling needs"):
        sampled.evaluate(ROLLOUT, verbose=0)
    with pytest.raises(ValueError, match=r"`importance_sampling` takes"):
        PolicyModel(policy, importance_sampling={"cap": 2.0})
    with pytest.raises(ValueError, match=r"`loss_options` holds \['clip'\]"):
        PolicyModel(policy, loss_options={"clip": (0.2, 0.2)})
    with pytest.raises(ValueError, match=r"`kind` must be one of"):
        PolicyModel(policy, kind="grpo")


# ------------------------------------------------------------------ Rollouts, ReferenceSync

PROMPTS = RNG.integers(1, VOCAB, size=(6, PROMPT)).astype("int32")


def _low_tokens(token_ids, completion_mask):
    """A programmatic reward: the fraction of completion tokens below 8."""
    return ((token_ids < 8) * completion_mask).sum(1) / np.maximum(completion_mask.sum(1), 1)


def test_rollouts_sample_score_and_form_group_advantages():
    model = PolicyModel(_gpt2(5), chunk_size=4)
    rollouts = Rollouts(model, PROMPTS, _low_tokens, num_generations=4, batch_size=2, max_length=9, seed=3)
    assert len(rollouts) == 3
    batch = rollouts[0]
    assert batch["token_ids"].shape == (8, 9) and batch["completion_mask"].shape == (8, 9)
    np.testing.assert_array_equal(batch["token_ids"][:, :PROMPT], np.repeat(PROMPTS[:2], 4, axis=0))
    assert (batch["completion_mask"][:, :PROMPT] == 0).all() and (batch["completion_mask"][:, PROMPT:] == 1).all()
    np.testing.assert_allclose(batch["rewards"], _low_tokens(batch["token_ids"], batch["completion_mask"]), rtol=1e-6)
    groups = batch["rewards"].reshape(2, 4)
    expected = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(batch["advantages"], expected.reshape(-1), rtol=1e-5, atol=1e-6)
    # Seeded: the same rollouts on a rerun.
    again = Rollouts(model, PROMPTS, _low_tokens, num_generations=4, batch_size=2, max_length=9, seed=3)[0]
    np.testing.assert_array_equal(again["token_ids"], batch["token_ids"])


def test_rollouts_train_a_policy_in_fit_one_round_an_epoch():
    model = PolicyModel(_gpt2(6), reduction="sequence_mean", chunk_size=4)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    before = [w.copy() for w in model.policy.get_weights()]
    rollouts = Rollouts(
        model, PROMPTS, _low_tokens, num_generations=4, batch_size=2, batches_per_epoch=1, max_length=9, seed=4
    )
    history = model.fit(rollouts, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all() and len(history["reward"]) == 2
    assert any(not np.allclose(a, b) for a, b in zip(before, model.policy.get_weights()))


def test_rollouts_errors():
    model = PolicyModel(_gpt2())
    with pytest.raises(ValueError, match=r"`num_generations` must be >= 2 with scale_rewards='group'"):
        Rollouts(model, PROMPTS, _low_tokens, num_generations=1)
    with pytest.raises(ValueError, match=r"must return one reward a completion"):
        Rollouts(model, PROMPTS, lambda ids, mask: np.zeros(3), num_generations=2, batch_size=2, max_length=9)[0]


def test_reference_sync_mixes_the_reference_toward_the_policy():
    policy, reference = _gpt2(7), _gpt2(8)
    model = PreferenceModel(policy, reference, chunk_size=4)
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    start = [w.copy() for w in reference.get_weights()]
    model.fit(PAIRS, batch_size=BATCH, epochs=1, verbose=0, callbacks=[ReferenceSync(alpha=0.25, every=1)])
    for r, p, s in zip(reference.get_weights(), policy.get_weights(), start):
        np.testing.assert_allclose(r, 0.25 * p + 0.75 * s, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"has no reference model to sync"):
        orpo = PreferenceModel(policy, kind="orpo")
        orpo.compile(optimizer="sgd")
        orpo.fit(PAIRS, verbose=0, callbacks=[ReferenceSync()])


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_under_mixed_bfloat16_finite_and_close(policy):
    # The policy computes in bfloat16; the log-probabilities and the losses in float32.
    exact = {}
    for name in ("float32", policy):
        keras.config.set_dtype_policy(name)
        preference = PreferenceModel(_gpt2(9), chunk_size=4)
        policy_model = PolicyModel(_gpt2(9), "copy", kl_weight=0.1, entropy_weight=0.01, chunk_size=4)
        values = []
        for model, data in ((preference, PAIRS), (policy_model, ROLLOUT)):
            model.compile(optimizer=keras.optimizers.SGD(0.1))
            values.append(float(model.compute_loss(data)))
            history = model.fit(data, batch_size=BATCH, epochs=1, verbose=0).history
            assert np.isfinite(history["loss"]).all(), (name, history)
        exact[name] = values
    np.testing.assert_allclose(exact[policy], exact["float32"], rtol=5e-2, atol=5e-3)
