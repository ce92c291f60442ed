"""Trains one model on one device and on two, in one process, and reports
every difference. Run by tests/test_distributed.py in a subprocess, because
the number of devices is fixed when the framework starts:

    KERAS_BACKEND=jax python -m tests.distributed_run data_parallel
    KERAS_BACKEND=jax python -m tests.distributed_run model_parallel
    KERAS_BACKEND=tensorflow python -m tests.distributed_run mirrored

It prints one JSON line: for each compared quantity (predictions, every
History entry, every probe entry) the one-device and two-device values and
their largest relative difference.

A probe's per-term weight, and what is that weight times a number
(`contribution`, `grad_norm_weighted`), is compared relative to the largest
of its layer's terms at that probe: GradNorm renormalises the weights to sum
to the number of terms, so each carries an absolute float32 error of that
scale, and a weight driven near zero (0.00095 beside 3.65) shows it as a
large relative one. Measured: 1.6e-5 relative on such a weight in CI, 4e-9
against its layer's largest.
"""

import json
import sys

from tests.two_devices import BACKEND, BATCH, before_keras, distributed, regression_data, split_tensorflow_cpu

if __name__ == "__main__":
    before_keras()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_penalties import CompositeObjective, RouterLogits, Term  # noqa: E402
from keras_penalties import losses as L  # noqa: E402
from keras_penalties import regularizers as R  # noqa: E402
from keras_penalties.callbacks import DynamicWeightAverage, GradNorm, PenaltyMonitor  # noqa: E402
from keras_penalties.composite.weighting import Weighting  # noqa: E402
from keras_penalties.distillation import Distiller, LogitsDivergence  # noqa: E402

RNG = np.random.default_rng(0)
X, Y = regression_data(RNG, 4)


class Control(keras.callbacks.Callback):
    """Changes the objective from a callback: set_weight, disable, enable."""

    def on_epoch_begin(self, epoch, logs=None):
        objective = self.model.get_layer("obj")
        if epoch == 1:
            objective.set_weight("l1_sum", 0.01)
            objective.disable("l1")
        if epoch == 2:
            objective.enable("l1")


def build():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=R.Orthogonality(0.1), name="dense_a")(inputs)
    # Learned weights: trainable log-variances, summed over replicas' gradients.
    hidden = CompositeObjective(
        # A chunked term: chunks of 3 rows over each replica's 4 (a padded last chunk).
        {"l2": Term("l2"), "ent": Term("entropy", options={"from_logits": True, "chunk_size": 3})},
        weighting="uncertainty",
        name="uobj",
    )(hidden)
    hidden = keras.layers.Dense(8, kernel_regularizer=R.L2(0.01), name="dense_b")(hidden)
    ramp = keras.optimizers.schedules.PolynomialDecay(0.0, 8, 0.2)
    hidden = CompositeObjective(
        {
            "l1": Term("l1", 0.01, metrics={"l2": "l2"}),  # per-sample mean; a custom metric beside it
            "l1_sum": Term("l1", 0.001, options={"reduction": "sum"}),  # sum over samples
            "ent": Term("entropy", ramp, options={"from_logits": True}),
            "mag": R.OutputMagnitude(0.05),  # a Regularizer term
        },
        name="obj",
    )(hidden)
    outputs = keras.layers.Dense(4, name="out")(hidden)
    model = keras.Model(inputs, outputs)
    loss = L.CompositeLoss(
        {
            "mse": keras.losses.MeanSquaredError(),
            "mae_sum": keras.losses.MeanAbsoluteError(reduction="sum"),
            "cons": Term("consistency", options={"metric": "mse"}),
            "bonus": L.Entropy(from_logits=True, mode="bonus"),
        },
        weights={"mse": 1.0, "mae_sum": 0.01, "cons": 0.5, "bonus": 0.01},
        name="closs",
    )
    model.compile(keras.optimizers.SGD(0.05), loss=loss)
    init = np.random.default_rng(1)
    for variable in model.trainable_variables:
        variable.assign(init.normal(size=tuple(variable.shape)).astype("float32") * 0.4)
    return model


def train():
    model = build()
    monitor = PenaltyMonitor(probe_data=(X[:BATCH], Y[:BATCH]), every_n_batches=2)
    # Adaptive weights: DWA on the loss (per epoch), GradNorm on the objective (per probe).
    dwa = DynamicWeightAverage("closs")
    gradnorm = GradNorm("obj", "dense_b", probe_data=(X[:BATCH], Y[:BATCH]), every_n_batches=2)
    history = model.fit(
        X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[Control(), dwa, gradnorm, monitor]
    )
    evaluation = model.evaluate(X, Y, batch_size=BATCH, verbose=0, return_dict=True, callbacks=[PenaltyMonitor()])
    results = {"predictions": np.asarray(model.predict(X, batch_size=BATCH, verbose=0)).tolist()}
    results.update({f"history/{k}": v for k, v in history.history.items()})
    results.update({f"evaluate/{k}": v for k, v in evaluation.items()})
    for i, entry in enumerate(monitor.history):
        results.update({f"probe{i}/{k}": v for k, v in entry.items()})
    for i, entry in enumerate(gradnorm.history):
        results.update(
            {f"gradnorm{i}/{part}": list(entry[part].values()) for part in ("values", "grad_norms", "weights")}
        )
    results["log_variances"] = keras.ops.convert_to_numpy(model.get_layer("uobj").log_variances).tolist()
    results["step"] = int(keras.ops.convert_to_numpy(model.get_layer("obj").step))
    return results


def _famo_model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="famo_a")(inputs)
    hidden = keras.layers.Dense(8, activity_regularizer=R.L2(0.01), name="famo_b")(hidden)
    hidden = CompositeObjective(
        {"l2": Term("l2"), "l1_sum": Term("l1", options={"reduction": "sum"})}, weighting="famo", name="fobj"
    )(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, name="famo_out")(hidden))
    loss = L.CompositeLoss(
        {"mse": keras.losses.MeanSquaredError(), "mae_sum": keras.losses.MeanAbsoluteError(reduction="sum")},
        weighting="famo",
        famo_learning_rate=0.1,
        name="floss",
    )
    model.compile(keras.optimizers.SGD(0.01), loss=loss)
    return model, loss


def train_famo():
    """FAMO on an objective and a loss, in a model with an activity loss: the
    logits move with the whole batch's log-losses, the same on every
    replica (under tf.distribute a cross-replica sum inside the step, which
    must leave each replica's add_loss losses its own)."""
    model, loss = _famo_model()
    history = model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[PenaltyMonitor()])
    results = {f"famo/history/{k}": v for k, v in history.history.items()}
    results["famo/predictions"] = np.asarray(model.predict(X, batch_size=BATCH, verbose=0)).tolist()
    for name, state in (("loss", loss.state), ("objective", model.get_layer("fobj"))):
        for part in ("famo_logits", "famo_moments", "famo_steps"):
            results[f"famo/{name}/{part}"] = keras.ops.convert_to_numpy(getattr(state, part)).tolist()
    return results


class Annealed(Weighting):
    """A user's rule: the terms' own weights times 0.5^t, t the training
    steps taken (a variable of its own, assigned in the step)."""

    steps_in_training = True

    def make_variables(self, owner, count):
        self.add_variable(owner, "annealed_steps", 0.0)

    def weights(self, owner, set_weights):
        return set_weights() * keras.ops.power(0.5, owner.annealed_steps.value)

    def total(self, owner, values, weights, enabled, update, model):
        if update:
            owner.annealed_steps.assign(owner.annealed_steps.value + 1.0)
        return super().total(owner, values, weights, enabled, update, model)


def learned_composites():
    """For each learned weighting, an objective and a loss, made before
    the model (and, for the two-device run, before the distribution)."""
    return {
        weighting: (
            CompositeObjective({"l2": Term("l2"), "l1": Term("l1")}, weighting=weighting, name=f"{weighting}_obj"),
            L.CompositeLoss(
                {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
                weighting=weighting,
                name=f"{weighting}_loss",
                **({"famo_learning_rate": 0.1} if weighting == "famo" else {}),
            ),
        )
        for weighting in ("uncertainty", "famo")
    } | {
        "own_rule": (
            CompositeObjective({"l2": Term("l2"), "l1": Term("l1")}, weighting=Annealed(), name="own_obj"),
            L.CompositeLoss(
                {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
                weighting=Annealed(),
                name="own_loss",
            ),
        ),
        "subclassed": (
            CompositeObjective({"l2": Term("l2"), "l1": Term("l1")}, weighting="famo", name="sub_obj"),
            L.CompositeLoss(
                {"mse": keras.losses.MeanSquaredError(), "mae": keras.losses.MeanAbsoluteError()},
                weighting="uncertainty",
                name="sub_loss",
            ),
        ),
    }


class SubclassedModel(keras.Model):
    """A subclassed model around an objective made before it: Keras builds
    it in `fit`'s symbolic build (a stateless scope), where the objective's
    state is made again."""

    def __init__(self, objective):
        super().__init__(name="subclassed")
        self.body, self.objective, self.out = keras.layers.Dense(8, activation="tanh"), objective, keras.layers.Dense(4)

    def call(self, x):
        return self.out(self.objective(self.body(x)))


def train_made_outside(composites):
    """A model built under the distribution around an objective and a loss
    with learned weights made outside it, as a plain Keras loss may be:
    their state is made again where the model's variables live."""
    results = {}
    for weighting, (objective, loss) in composites.items():
        keras.utils.set_random_seed(3)
        if weighting == "subclassed":
            model = SubclassedModel(objective)
        else:
            inputs = keras.Input((6,))
            hidden = objective(keras.layers.Dense(8, activation="tanh")(inputs))
            model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        model.compile(keras.optimizers.SGD(0.05), loss=loss)
        history = model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        results[f"outside/{weighting}/loss"] = history.history["loss"]
        results[f"outside/{weighting}/weights"] = [
            keras.ops.convert_to_numpy(v).tolist() for v in (objective.current_weights(), loss.current_weights())
        ]
    return results


VOCAB, TOKENS = 9, 4
LM_TOKENS = RNG.integers(0, VOCAB, size=(32, TOKENS))
LM_LABELS = RNG.integers(0, VOCAB, size=(32, TOKENS))
# Token masks: samples of each batch's first half (one replica's) keep fewer
# tokens than the second half's, so per-replica means would not average to
# the global one.
LM_WEIGHTS = (RNG.uniform(size=(32, TOKENS)) < np.tile(np.repeat([0.3, 0.9], 4), 4)[:, None]).astype("float32")
LM_WEIGHTS[:, 0] = 1.0


def train_distiller(chunk_size=4 if BACKEND == "jax" else 3, prefix="distiller"):
    """A fused Distiller: tied-embedding heads read from the hidden states in
    chunks (on JAX 4 rows: each device runs the 4 chunks of its own 16
    rows; on TF 3 rows: partial chunks on every replica; None: the logits
    formed whole), two LogitsDivergence losses with weights, a regularized
    student. Results under `prefix`."""

    def lm(name, seed):
        keras.utils.set_random_seed(seed)
        tokens = keras.Input((TOKENS,), dtype="int32")
        embedding = keras.layers.ReversibleEmbedding(
            VOCAB, 6, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.5), name="embedding"
        )
        hidden = keras.layers.Dense(6, activation="tanh", kernel_regularizer=R.L2(0.01), name="dense_a")(
            embedding(tokens)
        )
        return keras.Model(tokens, embedding(hidden, reverse=True), name=name)

    distiller = Distiller(
        lm("teacher", 1),
        lm("student", 2),
        [LogitsDivergence(temperature=2.0, name="kd"), LogitsDivergence("js", beta=0.3, name="js")],
        [4.0, 1.0],
        student_loss_weight=0.4,
        head="embedding",
        teacher_head="embedding",
        chunk_size=chunk_size,
    )
    distiller.compile(keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = distiller.fit(
        LM_TOKENS, LM_LABELS, sample_weight=LM_WEIGHTS, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    )
    evaluation = distiller.evaluate(
        LM_TOKENS, LM_LABELS, sample_weight=LM_WEIGHTS, batch_size=BATCH, verbose=0, return_dict=True
    )
    predictions = distiller.student.predict(LM_TOKENS, batch_size=BATCH, verbose=0)
    results = {f"{prefix}/predictions": np.asarray(predictions).tolist()}
    results.update({f"{prefix}/history/{k}": v for k, v in history.history.items()})
    results.update({f"{prefix}/evaluate/{k}": v for k, v in evaluation.items()})
    return results


def train_distiller_whole():
    """The fused Distiller at the default chunk_size: the logits formed whole."""
    return train_distiller(None, "distiller_whole")


def train_token_objective():
    """A CompositeObjective's token means, under masks that keep fewer tokens
    on one replica than on the other: an entropy over the kept positions
    (whole, and in chunks of 2 rows), and a cross-entropy from the hidden
    states through the head (fused, chunks of 4; masked, and over every
    position), and a GRPO loss from the hidden states over sequences and
    tokens, an off-policy GSPO step (importance weights, the corrected KL,
    a top-k KL, the entropy) and a DPO loss over pairs some of which do not
    count. Each is the mean over the global batch,
    not the replicas' means' mean; a layer before the objective adds an activity
    loss, which the objective's cross-replica sums must leave its
    replica's."""
    from keras_penalties import ops as P

    keras.utils.set_random_seed(3)
    tokens = keras.Input((TOKENS,), dtype="int32", name="tokens")
    labels = keras.Input((TOKENS,), dtype="int32", name="labels")
    mask = keras.Input((TOKENS,), name="mask")
    hidden = keras.layers.Embedding(
        VOCAB, 6, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.5), name="tok_embedding"
    )(tokens)
    hidden = keras.layers.Dense(6, activation="tanh", activity_regularizer=R.L2(0.01), name="tok_body")(hidden)
    head = keras.layers.Dense(VOCAB, name="tok_head")
    logits = head(hidden)

    def fused(masked):
        def cross_entropy(hidden, labels, mask):
            return P.cross_entropy(
                labels, P.linear(hidden, head.kernel, head.bias), mask=mask if masked else None, chunk_size=4
            )

        return Term(cross_entropy, 0.1, inputs=("hidden", "labels", "mask"))

    def grpo(hidden, labels, mask):
        # RL fine-tuning from hidden states: per-token log-probabilities in chunks,
        # a PPO loss over sequences and a k3 KL to a reference over tokens.
        logprobs = P.token_logprobs(labels, P.linear(hidden, head.kernel, head.bias), mask=mask, chunk_size=4)
        frozen = keras.ops.stop_gradient(logprobs)
        advantages = keras.ops.cast(labels[:, 0] % 3, "float32") - 1.0
        reference = frozen - 0.3 * keras.ops.cast(labels % 2, "float32")
        loss = P.policy_loss(logprobs, frozen - 0.1, advantages, mask=mask, reduction="sequence_mean")
        return loss + 0.5 * P.kl_estimate(logprobs, reference, mask=mask)

    def off_policy(hidden, labels, mask):
        # Off-policy correction from hidden states: a sampler's truncated importance
        # weights and kept tokens, GSPO over sequences, the importance-
        # corrected KL, a teacher's top-3 ids and the entropy from the same
        # chunks: every mean over the global batch's kept tokens.
        logits = P.linear(hidden, head.kernel, head.bias)
        logprobs, entropy = P.token_logprobs(labels, logits, mask=mask, chunk_size=4, return_entropy=True)
        frozen = keras.ops.stop_gradient(logprobs)
        shift = keras.ops.cast(labels % 3, "float32")
        weights, kept = P.importance_weights(logprobs, frozen - 0.2 * shift, mask=mask, bounds=(0.5, 1.3), mode="mask")
        advantages = keras.ops.cast(labels[:, 0] % 3, "float32") - 1.0
        loss = P.policy_loss(logprobs, frozen - 0.1 * shift, advantages, level="sequence", weights=weights, mask=kept)
        kl = P.kl_estimate(logprobs, frozen - 0.3, old_logprobs=frozen - 0.05 * shift, mask=kept)
        ids = (labels[..., None] + keras.ops.arange(3, dtype="int32")) % VOCAB
        student = P.token_logprobs(ids, logits, mask=mask, chunk_size=4)
        topk = P.topk_kl(keras.ops.stop_gradient(student) - 0.1, student, mask=mask)
        # −(the entropy's mean over kept tokens), through an op whose mean is global ("reinforce" with A = 1).
        bonus = P.policy_loss(entropy, None, keras.ops.ones_like(advantages), kind="reinforce", mask=mask)
        return loss + 0.5 * kl + topk + 0.01 * bonus

    def preference(hidden, labels, mask):
        # DPO from hidden states: the labels chosen, the next ids rejected (a
        # rejected side empty where the first label is odd: those pairs do not
        # count), against a frozen shifted reference; a mean over the global
        # batch's counted pairs.
        logits = P.linear(hidden, head.kernel, head.bias)
        chosen = P.token_logprobs(labels, logits, mask=mask, chunk_size=4)
        rejected_mask = keras.ops.logical_and(
            keras.ops.cast(mask, "bool"), keras.ops.expand_dims(labels[:, 0] % 2 == 0, -1)
        )
        rejected = P.token_logprobs((labels + 1) % VOCAB, logits, mask=rejected_mask, chunk_size=4)
        refs = [keras.ops.stop_gradient(x) - 0.2 for x in (chosen, rejected)]
        return P.preference_loss(chosen, rejected, *refs, beta=0.5, chosen_mask=mask, rejected_mask=rejected_mask)

    def next_kinds(hidden, labels, mask):
        # The losses after GRPO from hidden states: SAPO on the high-entropy tokens (a global quantile), GMPO,
        # VESPO, DPPO at Dr. GRPO's constant normaliser (every sequence of the global batch), KTO with its z₀ from
        # mismatched pairs (a global mean), and DiscoPOP and sigmoid_norm with RPO's NLL and WPO's weights.
        logits = P.linear(hidden, head.kernel, head.bias)
        logprobs, entropy, log_sum_sq = P.token_logprobs(
            labels, logits, mask=mask, chunk_size=4, return_entropy=True, return_log_sum_sq=True
        )
        frozen = keras.ops.stop_gradient(logprobs)
        shift = keras.ops.cast(labels % 3, "float32")
        advantages = keras.ops.cast(labels[:, 0] % 3, "float32") - 1.0
        top = keras.ops.cast(P.entropy_mask(entropy, top=0.5, mask=mask), "float32")
        region = keras.ops.cast(
            P.trust_region_mask(logprobs, frozen - 0.3 * shift, advantages, divergence="kl", threshold=0.02, mask=mask),
            "float32",
        )
        old = frozen - 0.1 * shift
        loss = P.policy_loss(logprobs, old, advantages, kind="sapo", weights=top, mask=mask, reduction="sequence_mean")
        loss += P.policy_loss(logprobs, old, advantages, kind="gmpo", mask=mask, reduction="sequence_mean")
        loss += P.policy_loss(logprobs, old, advantages, kind="vespo", mask=mask)
        loss += P.policy_loss(
            logprobs,
            frozen - 0.3 * shift,
            advantages,
            kind="cispo",
            clip=(0.0, 2.0),
            weights=region,
            mask=mask,
            reduction="constant",
            max_length=TOKENS + 2,
        )
        loss += P.unpaired_preference_loss(
            logprobs,
            frozen - 0.2,
            advantages > 0,
            kl_logprobs=frozen + 0.3 * shift,
            ref_kl_logprobs=frozen,
            mask=mask,
            kl_mask=mask,
        )
        rejected = P.token_logprobs((labels + 1) % VOCAB, logits, mask=mask, chunk_size=4)
        refs = [keras.ops.stop_gradient(x) - 0.2 * shift for x in (logprobs, rejected)]
        loss += P.preference_loss(logprobs, rejected, *refs, kind="discopop", chosen_mask=mask, rejected_mask=mask)
        return loss + P.preference_loss(
            logprobs,
            rejected,
            *refs,
            kind="sigmoid_norm",
            nll=0.3,
            chosen_mask=mask,
            rejected_mask=mask,
            chosen_log_sum_sq=log_sum_sq,
            rejected_log_sum_sq=log_sum_sq,
        )

    objective = CompositeObjective(
        {
            "grpo": Term(grpo, 0.1, inputs=("hidden", "labels", "mask")),
            "next": Term(next_kinds, 0.1, inputs=("hidden", "labels", "mask")),
            "off_policy": Term(off_policy, 0.1, inputs=("hidden", "labels", "mask")),
            "preference": Term(preference, 0.1, inputs=("hidden", "labels", "mask")),
            "ent": Term("entropy", 0.1, inputs=("logits",), options={"from_logits": True, "mask": "mask"}),
            "ent_chunked": Term(
                "entropy", 0.1, inputs=("logits",), options={"from_logits": True, "mask": "mask", "chunk_size": 2}
            ),
            "ce_fused": fused(True),
            "ce_fused_all": fused(False),
            "ce_z": Term(
                "cross_entropy",
                0.1,
                inputs=("labels", "logits"),
                options={"mask": "mask", "z_loss": 1e-2, "chunk_size": 4},
            ),
            # Two routers' logits (4 experts): counts, probability sums and
            # kept tokens summed over the replicas.
            "router_lb": Term("router_load_balancing", 0.5, inputs=("routers",), options={"top_k": 2, "mask": "mask"}),
            "router_lb_layer": Term(
                "router_load_balancing", 0.5, inputs=("routers",), options={"top_k": 1, "mask": "mask", "pool": "layer"}
            ),
            "router_z": Term("router_z_loss", 0.1, inputs=("routers",), options={"mask": "mask"}),
        },
        name="tok",
    )
    # The routers' logits as RouterLogits hands them out, each replica its own
    # (read after both routers: their sum orders the call).
    router_layers = [keras.layers.Dense(4, name=f"tok_router_{i}") for i in range(2)]
    router_outputs = [layer(hidden) for layer in router_layers]
    routers = RouterLogits(router_layers[0], layers=router_layers)(router_outputs[0] + router_outputs[1])
    outputs = objective({"logits": logits, "hidden": hidden, "labels": labels, "mask": mask, "routers": routers})[
        "logits"
    ]
    model = keras.Model([tokens, labels, mask], outputs)
    model.compile(keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(
        [LM_TOKENS, LM_LABELS, LM_WEIGHTS],
        LM_LABELS,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[PenaltyMonitor()],
    )
    results = {f"tokens/history/{k}": v for k, v in history.history.items()}
    results["tokens/kernel"] = keras.ops.convert_to_numpy(head.kernel).tolist()
    return results


# Tokens where LM_WEIGHTS drops them are 0, which Embedding(mask_zero=True)
# masks: the Keras mask on the predictions keeps fewer positions on one
# replica than on the other. The sample weights (per token) differ between the
# halves too.
MASKED_TOKENS = np.where(LM_WEIGHTS > 0, np.maximum(LM_TOKENS, 1), 0)
SAMPLE_WEIGHTS = np.repeat(np.tile(np.repeat([0.25, 1.0], 4), 4)[:, None], TOKENS, axis=1).astype("float32")


def train_token_loss():
    """A CompositeLoss whose terms reduce with Keras' mask and sample
    weights: a Keras loss over the kept positions ("sum_over_batch_size"),
    one divided by the kept sample weights ("mean_with_sample_weight"), one
    that masks positions of its own (`ignore_class`), the
    package's Entropy, and an ops term with per-position values. Each is the
    global batch's mean, not the replicas' means' mean."""
    keras.utils.set_random_seed(4)
    tokens = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.Embedding(
        VOCAB, 6, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.5), name="m_emb"
    )(tokens)
    logits = keras.layers.Dense(VOCAB, name="m_head")(keras.layers.Dense(6, activation="tanh", name="m_body")(hidden))
    model = keras.Model(tokens, logits)
    loss = L.CompositeLoss(
        {
            "ce": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "ce_sw": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
            # Its own mask (labels of class 0 ignored), ANDed with the input's.
            "ce_ignore": keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
            "ent": L.Entropy(from_logits=True),
            "ent_op": Term("entropy", options={"from_logits": True}),
        },
        weights={"ce": 1.0, "ce_sw": 0.5, "ce_ignore": 0.25, "ent": 0.1, "ent_op": 0.05},
        name="mloss",
    )
    model.compile(keras.optimizers.SGD(0.1), loss=loss)
    history = model.fit(
        MASKED_TOKENS,
        LM_LABELS,
        sample_weight=SAMPLE_WEIGHTS,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[PenaltyMonitor()],
    )
    results = {f"masked/history/{k}": v for k, v in history.history.items()}
    results["masked/kernel"] = keras.ops.convert_to_numpy(model.get_layer("m_head").kernel).tolist()
    return results


WEIGHTED = ("weight", "contribution", "grad_norm_weighted")


def _weight_scale(numbers, key):
    """The largest |number| of the same kind among a probe layer's terms,
    for the weight-scaled kinds of WEIGHTED; 0 for any other key."""
    parts = key.split("/")
    if not (len(parts) == 4 and parts[0].startswith("probe") and parts[3] in WEIGHTED):
        return 0.0
    probe, layer, _, kind = parts
    siblings = [v for k, v in numbers.items() if _same_kind(k, probe, layer, kind)]
    return max(abs(float(v)) for v in siblings)


def _same_kind(key, probe, layer, kind):
    parts = key.split("/")
    return len(parts) == 4 and (parts[0], parts[1], parts[3]) == (probe, layer, kind)


def main(mode):
    if BACKEND == "tensorflow":
        split_tensorflow_cpu()
    runs = (train, train_distiller, train_distiller_whole, train_famo, train_token_objective, train_token_loss)
    one = {k: v for run in runs for k, v in run().items()}
    one.update(train_made_outside(learned_composites()))
    outside = learned_composites()
    with distributed(mode):
        two = {k: v for run in runs for k, v in run().items()}
        two.update(train_made_outside(outside))
    report = {}
    for key, value in one.items():
        a, b = np.asarray(value, np.float64), np.asarray(two.get(key, np.nan), np.float64)
        scale = max(float(np.max(np.abs(a))), 1e-6) if a.size else 1.0
        scale = max(scale, _weight_scale(one, key))
        report[key] = {
            "one": value,
            "two": two.get(key),
            "rel": float(np.max(np.abs(a - b), initial=0.0) / scale) if a.shape == b.shape else float("inf"),
        }
    report["missing"] = sorted(set(two) - set(one))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
