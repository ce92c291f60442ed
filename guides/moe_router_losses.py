"""
# Router losses for a keras-hub mixture of experts

A mixture-of-experts layer sends each token to the k best of E experts by
a router's logits. Left alone, a router sends most tokens to a few experts;
two penalties keep it healthy: the load-balancing loss (Switch
Transformer, Mixtral), E·Σᵢ fᵢ·Pᵢ with fᵢ the fraction of routings to
expert i and Pᵢ its mean probability, which is 1 when both are uniform; and
the router z-loss (ST-MoE), the mean of logsumexp(z)², which keeps the
logits small.

keras-hub's MoE models add the first themselves, once per layer, and count
right-padded tokens as routed. Here they train with
`keras_penalties.ops.router_load_balancing` and `router_z_loss` instead:
masked, pooled over the layers, global across replicas, each term's value
in the logs. On JAX, TensorFlow and PyTorch alike:

1. a Qwen3-MoE built from config (nothing is downloaded), keras-hub's own
   loss off, two experts favoured at the start;
2. right-padded batches;
3. keras-hub's per-layer value beside ours, and what the padding changes;
4. training with per-term logs, and each expert's share of the routings
   evening out (a plot);
5. the same penalties from a `compute_loss`, as a subclass of keras-hub's
   model.

The ops, regularizers and `RouterLogits` are on the
[Routers and logits](../docs/routers.md) page. keras-hub is an optional
dependency (Python 3.11+): `pip install --no-deps keras-hub regex
tokenizers`.

    KERAS_BACKEND=jax python guides/moe_router_losses.py
"""

import os
import pathlib
import tempfile

import keras
import numpy as np

import keras_penalties as kp
from keras_penalties import ops as P
from keras_penalties.callbacks import PenaltyMonitor

try:
    import keras_hub
except ImportError:  # Python 3.10, or keras-hub not installed
    keras_hub = None
    print("This guide needs keras-hub: pip install --no-deps keras-hub regex tokenizers (Python 3.11+).")

STEPS = 10 * int(os.environ.get("GUIDE_ROUNDS", 4))
VOCAB, LENGTH, BATCH, EXPERTS, TOP_K = 64, 16, 16, 8, 2
LOAD_BALANCING, Z_LOSS = 0.1, 1e-3

"""
## 1. A Qwen3-MoE built from config, its own loss off

`router_aux_loss_coefficient=0.0` turns keras-hub's loss into a zero (it
still adds 0 per layer). Two experts' router columns are scaled up: their
logits vary most, so they win most routings, the imbalance a router drifts
into on its own.
"""


def qwen3_moe(coefficient=0.0):
    return keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=64, moe_intermediate_dim=16, head_dim=8,
        num_experts=EXPERTS, top_k=TOP_K, router_aux_loss_coefficient=coefficient,
    )


def favour_two_experts(routers):
    for router in routers:
        kernel = keras.ops.convert_to_numpy(router.kernel)
        kernel[:, :2] *= 4.0
        router.kernel.assign(kernel)


"""
## 2. Right-padded batches

Each sequence counts up from a random start (the next token is the last
plus one), 4 to 16 tokens long, then padding: id 0 with `padding_mask` 0.
"""


def batch(rng):
    starts = rng.integers(1, VOCAB, size=(BATCH, 1))
    ids = (starts + np.arange(LENGTH)) % (VOCAB - 1) + 1
    lengths = rng.integers(4, LENGTH + 1, size=(BATCH, 1))
    mask = (np.arange(LENGTH) < lengths).astype("int32")
    return {"token_ids": (ids * mask).astype("int32"), "padding_mask": mask}


def number(tensor):
    return float(keras.ops.convert_to_numpy(tensor))


def shares(logits, mask):
    """Each expert's share of the kept tokens' routings, over the layers."""
    kept = np.asarray(mask).reshape(-1) > 0
    counts = np.zeros(EXPERTS)
    for z in logits:
        top = np.argsort(-keras.ops.convert_to_numpy(z)[kept], axis=-1)[:, :TOP_K]
        counts += np.bincount(top.reshape(-1), minlength=EXPERTS)
    return counts / counts.sum()


if keras_hub is not None:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    probe = batch(rng)
    backbone = qwen3_moe()
    routers = kp.RouterLogits(backbone)  # each layer's router, found by name
    favour_two_experts(routers.routers)

"""
## 3. keras-hub's value beside ours

A copy with keras-hub's coefficient 1.0 adds its own loss (in training):
the sum over layers of each layer's value over the tokens its mask keeps,
right padding included. `pool="layer"` without a mask is that number; with
the padding mask it leaves the padding out; `pool="all"` pools the layers'
tokens first (Hugging Face's form, divided by k).
"""

if keras_hub is not None:
    theirs = qwen3_moe(coefficient=1.0)
    theirs.set_weights(backbone.get_weights())
    theirs(probe, training=True)
    keras_hub_value = sum(number(loss) for loss in theirs.losses)

    logits = routers(backbone(probe, training=True))
    mask = probe["padding_mask"]
    per_layer = number(P.router_load_balancing(logits, top_k=TOP_K, pool="layer"))
    per_layer_masked = number(P.router_load_balancing(logits, top_k=TOP_K, mask=mask, pool="layer"))
    pooled = number(P.router_load_balancing(logits, top_k=TOP_K, mask=mask))
    print(f"keras-hub, per layer (padding counted):   {keras_hub_value:.4f}")
    print(f"ours, pool='layer', no mask:               {per_layer:.4f}")
    print(f"ours, pool='layer', padding masked:        {per_layer_masked:.4f}")
    print(f"ours, pooled over layers, padding masked:  {pooled:.4f} (1 is balanced)")
    print(f"padding: {1 - mask.mean():.0%} of the tokens; it moves the value by "
          f"{abs(per_layer - per_layer_masked) / per_layer_masked:.1%}")

"""
## 4. Training with per-term logs

The backbone in a functional model: `routers(hidden)` hands out the router
logits of the same forward pass, and a `CompositeObjective` adds the two
terms, masked by the padding. `PenaltyMonitor` puts each term's value in
the logs (`moe/load_balancing`, `moe/router_z`); a callback records each
expert's share of the probe batch's routings after every step.
"""


class ExpertShares(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.history = []

    def on_train_batch_end(self, batch, logs=None):
        if hasattr(self.model, "jax_state_sync"):  # JAX: the variables are the step's state until synced
            self.model.jax_state_sync()
        self.history.append(shares(routers(backbone(probe)), probe["padding_mask"]))


if keras_hub is not None:
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
    }
    hidden = backbone(inputs)
    hidden = kp.CompositeObjective(
        {
            "load_balancing": kp.Term(
                "router_load_balancing", LOAD_BALANCING, inputs=("router_logits",),
                options={"top_k": TOP_K, "mask": "padding_mask"},
            ),
            "router_z": kp.Term(
                "router_z_loss", Z_LOSS, inputs=("router_logits",), options={"mask": "padding_mask"}
            ),
        },
        name="moe",
    )({"hidden": hidden, "router_logits": routers(hidden), "padding_mask": inputs["padding_mask"]})["hidden"]
    model = keras.Model(inputs, backbone.token_embedding(hidden, reverse=True))

    data = [batch(rng) for _ in range(STEPS)]
    x = {key: np.concatenate([b[key] for b in data]) for key in data[0]}
    # The next token is the label; padding weighs 0.
    labels = np.roll(x["token_ids"], -1, axis=1)
    weights = (x["padding_mask"] * np.roll(x["padding_mask"], -1, axis=1)).astype("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    expert_shares = ExpertShares()
    start = shares(routers(backbone(probe)), probe["padding_mask"])
    history = model.fit(
        x, labels, sample_weight=weights, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[PenaltyMonitor(), expert_shares],
    ).history
    for key in ("loss", "moe/load_balancing", "moe/router_z"):
        print(f"{key}: {history[key][0]:.4f} (the epoch's mean)")
    end = expert_shares.history[-1]
    print(f"largest expert share: {start.max():.3f} at the first step -> {end.max():.3f} at the last "
          f"(uniform: {1 / EXPERTS:.3f})")

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(np.array([start] + expert_shares.history))
    axis.axhline(1 / EXPERTS, color="gray", linestyle=":")
    axis.set(xlabel="step", ylabel="share of the routings", title="Each expert's share (probe batch)")
    figure.tight_layout()
    figure.savefig(pathlib.Path(tempfile.mkdtemp()) / "expert_shares.png")

"""
## 5. The same from `compute_loss`

Without per-term logs, a subclass of keras-hub's model adds the penalties
to its own loss; keras-hub's coefficient must be 0, else both losses count
(`RouterLogits` warns).
"""


if keras_hub is not None:

    class MoECausalLM(keras_hub.models.Qwen3MoeCausalLM):
        def __init__(self, backbone, preprocessor=None, **kwargs):
            super().__init__(backbone=backbone, preprocessor=preprocessor, **kwargs)
            self.routers = kp.RouterLogits(backbone)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            logits, mask = self.routers(y_pred), x["padding_mask"]
            return (
                loss
                + LOAD_BALANCING * P.router_load_balancing(logits, top_k=self.backbone.top_k, mask=mask)
                + Z_LOSS * P.router_z_loss(logits, mask=mask)
            )

    causal_lm = MoECausalLM(qwen3_moe())
    causal_lm.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    losses = causal_lm.fit(
        x, labels, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    ).history["loss"]
    print(f"compute_loss form: loss {losses[0]:.4f} in the first epoch -> {losses[-1]:.4f} in the second")
