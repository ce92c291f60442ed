"""`PreferenceModel` (DPO, KTO) and `PolicyModel` (GRPO with a KL and an
entropy bonus) on keras-hub GPT-2 models built from config, trained on one
device and on two in one process; prints one JSON line of every History
entry, every `evaluate` entry and the trained weights, on one device and
on two, with their largest relative difference. Run by
tests/test_post_training_distributed.py in a subprocess (device counts are
fixed when the framework starts):

    KERAS_BACKEND=jax python -m tests.post_training_run data_parallel
    KERAS_BACKEND=tensorflow python -m tests.post_training_run mirrored

The rows of each global batch that go to the first replica keep fewer
tokens than the second's, so per-replica token means would not average to
the global ones.
"""

import json
import sys

from tests.two_devices import BACKEND, BATCH, before_keras, distributed, split_tensorflow_cpu

if __name__ == "__main__":
    before_keras()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_penalties.post_training import PolicyModel, PreferenceModel  # noqa: E402

VOCAB, PROMPT, ROWS = 17, 2, 2 * BATCH
RNG = np.random.default_rng(0)
# The first half of each global batch (the first replica's rows) is short.
SHORT = np.tile(np.repeat([True, False], BATCH // 2), ROWS // BATCH)


def _side(length):
    """ids, their padding mask and the completion mask: short rows end after 1-2 completion tokens."""
    ids = RNG.integers(1, VOCAB, size=(ROWS, length)).astype("int32")
    ends = np.where(SHORT, RNG.integers(PROMPT + 1, PROMPT + 3, size=ROWS), length)
    padding = (np.arange(length)[None, :] < ends[:, None]).astype("int32")
    completion = (padding * (np.arange(length)[None, :] >= PROMPT)).astype("float32")
    return ids * padding, padding, completion


(CHOSEN, CHOSEN_PADDING, CHOSEN_MASK), (REJECTED, REJECTED_PADDING, REJECTED_MASK) = _side(8), _side(6)
PAIRS = {
    "chosen_ids": CHOSEN,
    "rejected_ids": REJECTED,
    "chosen_mask": CHOSEN_MASK,
    "rejected_mask": REJECTED_MASK,
    "chosen_padding_mask": CHOSEN_PADDING,
    "rejected_padding_mask": REJECTED_PADDING,
}
UNPAIRED = {
    "completion_ids": CHOSEN,
    "completion_mask": CHOSEN_MASK,
    "completion_padding_mask": CHOSEN_PADDING,
    "label": (RNG.uniform(size=ROWS) < 0.5).astype("float32"),
    # Each prompt with the next row's completion: KTO's mismatched pairs (full length, all kept).
    "kl_ids": np.concatenate([CHOSEN[:, :PROMPT], np.roll(RNG.integers(1, VOCAB, size=(ROWS, 6)), 1, axis=0)], 1),
    "kl_mask": (np.arange(8)[None, :] >= PROMPT).repeat(ROWS, 0).astype("float32"),
}
ROLLOUT = {
    "token_ids": CHOSEN,
    "padding_mask": CHOSEN_PADDING,
    "completion_mask": CHOSEN_MASK,
    "advantages": RNG.normal(size=ROWS).astype("float32"),
    "rewards": RNG.uniform(size=ROWS).astype("float32"),
}


def _gpt2(seed):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
        dropout=0.0,
    )
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(embeddings * 10.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _trained(prefix, model, data):
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    history = model.fit(data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    evaluation = model.evaluate(data, batch_size=BATCH, verbose=0, return_dict=True)
    results = {f"{prefix}/history/{k}": v for k, v in history.items()}
    results.update({f"{prefix}/evaluate/{k}": v for k, v in evaluation.items()})
    weights = model.policy.get_weights()
    results[f"{prefix}/weights"] = np.concatenate([np.ravel(w) for w in weights]).tolist()
    return results


def models_and_data():
    """(name, model, its data) of each model the runs train (tests/ddp_run.py too)."""
    policy = PolicyModel(_gpt2(3), "copy", kl_weight=0.1, entropy_weight=0.01, chunk_size=3)
    return [
        ("dpo", PreferenceModel(_gpt2(1), chunk_size=3), PAIRS),
        ("kto", PreferenceModel(_gpt2(2), kind="kto", chunk_size=3), UNPAIRED),
        ("grpo", policy, ROLLOUT),
    ]


def run():
    results = {}
    for prefix, model, data in models_and_data():
        results.update(_trained(prefix, model, data))
    return results


def main(mode):
    if BACKEND == "tensorflow":
        split_tensorflow_cpu()
    one = run()
    with distributed(mode):
        two = run()
    report = {}
    for key, value in one.items():
        a, b = np.asarray(value, np.float64), np.asarray(two.get(key, np.nan), np.float64)
        scale = max(float(np.max(np.abs(a))), 1e-6) if a.size else 1.0
        same_shape = a.shape == b.shape
        report[key] = {
            "one": value if a.size < 8 else None,
            "two": two.get(key) if a.size < 8 else None,
            "abs": float(np.max(np.abs(a - b), initial=0.0)) if same_shape else float("inf"),
            "rel": float(np.max(np.abs(a - b), initial=0.0) / scale) if same_shape else float("inf"),
        }
    report["missing"] = sorted(set(two) - set(one))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
