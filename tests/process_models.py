"""What the several-process runs train (tests/multiprocess_run.py,
tests/multiworker_run.py, tests/ddp_run.py), each distributed its own way:
the global data, each process's rows of it, and the models. Only NumPy at
import: a TF worker must set TF_CONFIG, and make its strategy, before
TensorFlow starts, so Keras is imported inside the builders."""

import numpy as np

BATCH = 8  # global rows per step
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 6)).astype("float32")
Y = RNG.normal(size=(32, 4)).astype("float32")
VOCAB, TOKENS = 9, 4
LM_TOKENS = RNG.integers(0, VOCAB, size=(32, TOKENS))
LM_LABELS = RNG.integers(0, VOCAB, size=(32, TOKENS))
# The first half of every global batch keeps fewer tokens: uneven per process.
LM_WEIGHTS = (RNG.uniform(size=(32, TOKENS)) < np.tile(np.repeat([0.3, 0.9], 4), 4)[:, None]).astype("float32")
LM_WEIGHTS[:, 0] = 1.0
# Rows a masked mean keeps: fewer in the first half of every global batch
# (one process's rows) than in the second.
MASK = (np.random.default_rng(5).uniform(size=32) < np.tile(np.repeat([0.25, 0.95], 4), 4)).astype("float32")
MASK[::4] = 1.0


def local_rows(array, process, processes):
    """This process's rows of each global batch of BATCH rows."""
    per = BATCH // processes
    return np.concatenate([array[b + process * per : b + (process + 1) * per] for b in range(0, len(array), BATCH)])


# The Distillers the runs train, by the prefix of their results: fused in
# chunks of 4 rows, fused at the default chunk_size (the logits formed
# whole), and unfused (False: no heads named).
DISTILLER_CHUNKS = {"distiller": 4, "distiller_whole": None, "distiller_unfused": False}


def distiller(chunk_size=4):
    """The Distiller the runs train: a teacher and a student whose tied
    embeddings are their heads, one temperature-2 KL (weight 4) beside a
    0.4-weighted cross-entropy, chunks of `chunk_size` rows (False: the
    heads not named, the logits formed by the models); compiled with
    SGD(0.05)."""
    import keras

    from keras_penalties.distillation import Distiller, LogitsDivergence

    def lm(name, seed):
        keras.utils.set_random_seed(seed)
        tokens = keras.Input((TOKENS,), dtype="int32")
        embedding = keras.layers.ReversibleEmbedding(
            VOCAB, 6, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.5), name="embedding"
        )
        hidden = keras.layers.Dense(6, activation="tanh", name="body")(embedding(tokens))
        return keras.Model(tokens, embedding(hidden, reverse=True), name=name)

    model = Distiller(
        lm("teacher", 1),
        lm("student", 2),
        [LogitsDivergence(temperature=2.0, name="kd")],
        [4.0],
        student_loss_weight=0.4,
        **({} if chunk_size is False else {"head": "embedding", "teacher_head": "embedding", "chunk_size": chunk_size}),
    )
    model.compile(keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def off_policy_loss(values, mask=None):
    """Post-training on `values` [batch, tokens] read as per-token
    log-probabilities (−softplus(values)): a sampler's truncated importance
    weights, GSPO over sequences weighted by them, and the
    importance-corrected k3 KL, over the tokens `mask` keeps ([batch]: a
    row's tokens; None: those with values > −0.3, uneven across rows)."""
    from keras import ops

    from keras_penalties import ops as P

    logprobs = -ops.softplus(values)
    if mask is None:
        tokens = ops.stop_gradient(values) > -0.3
    else:
        tokens = ops.broadcast_to(ops.expand_dims(ops.cast(mask, "bool"), -1), ops.shape(values))
    frozen = ops.stop_gradient(logprobs)
    shift = ops.cast(ops.stop_gradient(values) > 0, logprobs.dtype)
    weights, kept = P.importance_weights(logprobs, frozen - 0.2 * shift, mask=tokens, bounds=(None, 1.1))
    advantages = ops.stop_gradient(ops.mean(values, axis=-1))
    loss = P.policy_loss(logprobs, frozen - 0.1 * shift, advantages, level="sequence", weights=weights, mask=kept)
    return loss + 0.5 * P.kl_estimate(logprobs, frozen - 0.3, old_logprobs=frozen - 0.05 * shift, mask=kept)


def next_kinds_loss(values, mask=None):
    """The post-training losses after GRPO on `values` [batch, tokens] read
    as per-token log-probabilities (−softplus(values)): SAPO on the tokens
    of high entropy (`entropy_mask`, whose quantile is the global batch's),
    GMPO, VESPO, DPPO (CISPO on `trust_region_mask`'s tokens) at Dr. GRPO's
    constant normaliser, and KTO with its baseline z₀ from mismatched pairs
    (a global mean), over the tokens `mask` keeps ([batch]: a row's tokens;
    None: those with values > −0.3, uneven across rows); and the router
    penalties of `values` read as one router's logits, a token a row (the
    rows `mask` keeps; every row without it): the load balancing's counts,
    probability sums and |S| and the z-loss's mean are global."""
    from keras import ops

    from keras_penalties import ops as P

    logprobs = -ops.softplus(values)
    if mask is None:
        tokens = ops.stop_gradient(values) > -0.3
    else:
        tokens = ops.broadcast_to(ops.expand_dims(ops.cast(mask, "bool"), -1), ops.shape(values))
    frozen = ops.stop_gradient(logprobs)
    shift = ops.cast(ops.stop_gradient(values) > 0, logprobs.dtype)
    advantages = ops.stop_gradient(ops.mean(values, axis=-1))
    entropy = ops.square(ops.stop_gradient(values))
    top = ops.cast(P.entropy_mask(entropy, top=0.5, mask=tokens), logprobs.dtype)
    region = ops.cast(
        P.trust_region_mask(logprobs, frozen - 0.4 * shift, advantages, threshold=0.1, mask=tokens), "float32"
    )
    old = frozen - 0.1 * shift
    sapo = P.policy_loss(logprobs, old, advantages, kind="sapo", weights=top, mask=tokens, reduction="sequence_mean")
    gmpo = P.policy_loss(logprobs, old, advantages, kind="gmpo", mask=tokens, reduction="sequence_mean")
    vespo = P.policy_loss(logprobs, old, advantages, kind="vespo", mask=tokens)
    dppo = P.policy_loss(
        logprobs,
        frozen - 0.4 * shift,
        advantages,
        kind="cispo",
        clip=(0.0, 2.0),
        weights=region,
        mask=tokens,
        reduction="constant",
    )
    kto = P.unpaired_preference_loss(
        logprobs,
        frozen - 0.2,
        advantages > 0,
        kl_logprobs=frozen + 0.3 * shift,
        ref_kl_logprobs=frozen,
        mask=tokens,
        kl_mask=tokens,
    )
    routers = P.router_load_balancing(values, top_k=2, mask=mask) + 0.1 * P.router_z_loss(values, mask=mask)
    return sapo + gmpo + vespo + dppo + kto + routers


def sequence_kl(values, mask):
    """The k3 KL of `values` read as per-token log-probabilities against
    a shifted reference, averaged over the sequences (rows) that keep a
    token: rows `mask` keeps, tokens with values > −0.3."""
    from keras import ops

    from keras_penalties import ops as P

    logprobs = -ops.softplus(values)
    rows = ops.broadcast_to(ops.expand_dims(ops.cast(mask, "bool"), -1), ops.shape(values))
    tokens = ops.logical_and(rows, ops.stop_gradient(values) > -0.3)
    return P.kl_estimate(logprobs, ops.stop_gradient(logprobs) - 0.3, mask=tokens, reduction="sequence_mean")


def composite_loss():
    """A `CompositeLoss` on (y, predictions) with sample weights: Keras' MSE
    and a masked entropy of the predictions as logits."""
    import keras

    from keras_penalties import Term
    from keras_penalties.losses import CompositeLoss

    terms = {"mse": keras.losses.MeanSquaredError(), "ent": Term("entropy", 0.1, options={"from_logits": True})}
    return CompositeLoss(terms, name="closs")


def raw_token_mean(values, mask):
    """A raw op's masked token mean (the entropy of `values` as logits over
    the rows `mask` keeps), called outside any composite."""
    from keras_penalties import ops as P

    return P.entropy(values, from_logits=True, mask=mask)


def regression():
    """What the custom loops train: `(model, optimizer, head)`, a regression
    model with a `CompositeObjective` inside, `ProximalDecay` around
    `AdaptiveGradientClipping` (built), and an objective on the predictions
    with a masked entropy (a token mean), an off-policy GSPO term, a sum
    over samples, a sequence mean and the losses after GRPO (`head.compute({"pred": ..., "mask":
    ...})`)."""
    import keras

    from keras_penalties import CompositeObjective, Term
    from keras_penalties import optimizers as opt
    from keras_penalties import regularizers as R

    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=R.L2(0.01))(inputs)
    hidden = CompositeObjective(
        {
            "l1": Term("l1", 0.01),
            "l1_sum": Term("l1", 0.001, options={"reduction": "sum"}),
            "ent": Term("entropy", 0.05, options={"from_logits": True}),
        },
        name="obj",
    )(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
    optimizer = opt.ProximalDecay(
        opt.AdaptiveGradientClipping(keras.optimizers.SGD(0.05), clip_factor=0.05), R.L1(1e-3)
    )
    optimizer.build(model.trainable_variables)
    head = CompositeObjective(
        {
            "ent": Term("entropy", 0.1, inputs=("pred",), options={"from_logits": True, "mask": "mask"}),
            "off_policy": Term(off_policy_loss, 0.1, inputs=("pred", "mask")),
            "l1_sum": Term("l1", 0.01, inputs=("pred",), options={"reduction": "sum"}),
            "kl_seq": Term(sequence_kl, 0.1, inputs=("pred", "mask")),
            "next": Term(next_kinds_loss, 0.1, inputs=("pred", "mask")),
        },
        name="head",
    )
    return model, optimizer, head
