"""The benchmark cases: each builds `ours` and `reference`, zero-argument callables
doing one unit of work (and waiting for it), on the current backend."""

import functools

import keras
import numpy as np
from keras import ops

from bench import native
from bench.case import Case, gradient_sides
from bench.head_inputs import HEAD_CHUNK, HEAD_SHAPE
from bench.head_inputs import head_inputs as _head_inputs
from bench.post_training_cases import POST_TRAINING_CASES
from bench.router_cases import ROUTER_CASES
from bench.preference_cases import PREFERENCE_CASES
from bench.rl_cases import NAME as _RL_NAME
from bench.rl_cases import RL_CASES
from bench.roofline_cases import _NAME as _ROOFLINE_NAME
from bench.roofline_cases import ROOFLINE_CASES
from bench.weighting_cases import WEIGHTING_CASES
from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L
from keras_penalties import ops as P
from keras_penalties import optimizers as O
from keras_penalties import regularizers as R
from keras_penalties.callbacks import PenaltyMonitor
from keras_penalties.gradients import interpolated_gradient_penalty


# ---------------------------------------------------------------- divergences on an LLM vocabulary


def _logits(small, count):
    rows, vocab = (256, 32000) if small else (8192, 32000)
    rng = np.random.default_rng(0)
    return [ops.convert_to_tensor(rng.normal(size=(rows, vocab)).astype("float32")) for _ in range(count)]


def _divergence(ours_fn, ref_fn, count, grad):
    def build(small):
        args = _logits(small, count)
        wrap = native.value_and_grad if grad else native.compile_fn
        ours, reference = wrap(ours_fn), wrap(ref_fn)
        return {
            "ours": lambda: native.block(ours(*args)),
            "reference": lambda: native.block(reference(*args)),
        }

    return build


def _ours_kl(t, s):
    return P.kl_divergence(t, s, from_logits=True)


def _ours_js(a, b):
    return P.js_divergence(a, b, from_logits=True)


def _ours_entropy(x):
    return P.entropy(x, from_logits=True)


_PEER = {"jax": "optax / jax.nn", "torch": "torch.nn.functional", "tensorflow": "raw tf ops"}[native.BACKEND]

DIVERGENCE_CASES = [
    Case(
        f"{name} {'value+grad' if grad else 'value'} [8192, 32000]",
        _PEER,
        "time ≤ 1.00",
        _divergence(ours, ref, count, grad),
        1.0,
    )
    for name, ours, ref, count in (
        ("kl_divergence", _ours_kl, native.kl, 2),
        ("js_divergence", _ours_js, native.js, 2),
        ("entropy", _ours_entropy, native.entropy, 1),
    )
    for grad in (False, True)
]


# ---------------------------------------------------------------- LLM scale: masked, chunked, value + gradient

LLM_SHAPES = ((8192, 32000), (4096, 128256))
LLM_CHUNK = 512  # rows per chunk; bench/chunking.py shows where chunking starts to pay


def _tokens(small, shape, count):
    rows, vocab = (64, 1000) if small else shape
    rng = np.random.default_rng(0)
    mask = (rng.uniform(size=rows) >= 0.25).astype("float32")  # 25 % of tokens masked
    return [ops.convert_to_tensor(mask)] + [
        ops.convert_to_tensor(2.0 * rng.standard_normal(size=(rows, vocab), dtype=np.float32)) for _ in range(count)
    ]


def _llm(ours_fn, ref_fn, shape, count):
    def build(small):
        args = _tokens(small, shape, count)
        ours, reference = native.value_and_grad(ours_fn), native.value_and_grad(ref_fn)
        return {"ours": lambda: native.block(ours(*args)), "reference": lambda: native.block(reference(*args))}

    return build


_LLM_FUNCTIONS = {
    # name -> (ours(mask, *logits, chunk_size), the peer's, number of logits)
    "kl forward": (
        lambda c: lambda m, t, s: P.kl_divergence(t, s, from_logits=True, mask=m, chunk_size=c),
        native.masked_kl,
        2,
    ),
    "kl reverse": (
        lambda c: lambda m, t, s: P.kl_divergence(t, s, from_logits=True, direction="reverse", mask=m, chunk_size=c),
        functools.partial(native.masked_kl, reverse=True),
        2,
    ),
    "js β=0.5": (
        lambda c: lambda m, t, s: P.js_divergence(t, s, from_logits=True, mask=m, chunk_size=c),
        native.masked_js,
        2,
    ),
    "js β=0.1": (
        lambda c: lambda m, t, s: P.js_divergence(t, s, from_logits=True, beta=0.1, mask=m, chunk_size=c),
        functools.partial(native.masked_js, beta=0.1),
        2,
    ),
    "entropy": (lambda c: lambda m, x: P.entropy(x, from_logits=True, mask=m, chunk_size=c), native.masked_entropy, 1),
}

LLM_CASES = [
    # chunk_size="auto": the backend's element budget over the vocabulary
    # (8192 rows of 32000 and 4096 of 128256: JAX 512 and 128 rows, TF 32
    # and 8, torch 128 and 32).
    Case(
        f"masked {name} value+grad {list(shape)}, chunk_size={chunk}",
        _PEER,
        "time ≤ 1.10, memory ≤ 0.50",
        _llm(ours(chunk), peer, shape, count),
        1.10,
        0.50,
    )
    for chunk in (LLM_CHUNK, "auto")
    for shape in LLM_SHAPES
    for name, (ours, peer, count) in _LLM_FUNCTIONS.items()
] + [
    Case(
        f"masked {name} value+grad {list(LLM_SHAPES[0])}, chunk_size={LLM_CHUNK} vs none",
        "our unchunked call",
        "reported",
        _llm(ours(LLM_CHUNK), ours(None), LLM_SHAPES[0], count),
    )
    for name, (ours, _, count) in _LLM_FUNCTIONS.items()
    if name in ("kl forward", "js β=0.5", "entropy")
]


# ---------------------------------------------------------------- LLM heads: losses from hidden states

# The heads' inputs and chunk size: bench/head_inputs.py.

_HEAD_FUNCTIONS = {
    # name -> (fused: from hidden states, ours on logits formed first, the peer on them)
    "kl forward": (
        lambda m, y, ht, kt, h, k: P.kl_divergence(
            P.linear(ht, kt), P.linear(h, k), from_logits=True, mask=m, chunk_size=HEAD_CHUNK
        ),
        lambda m, y, ht, kt, h, k: P.kl_divergence(
            native.matmul(ht, kt), native.matmul(h, k), from_logits=True, mask=m, chunk_size=HEAD_CHUNK
        ),
        lambda m, y, ht, kt, h, k: native.masked_kl(m, native.matmul(ht, kt), native.matmul(h, k)),
    ),
    "cross-entropy": (
        lambda m, y, ht, kt, h, k: P.cross_entropy(y, P.linear(h, k), mask=m, chunk_size=HEAD_CHUNK),
        lambda m, y, ht, kt, h, k: P.cross_entropy(y, native.matmul(h, k), mask=m, chunk_size=HEAD_CHUNK),
        lambda m, y, ht, kt, h, k: native.masked_cross_entropy(m, y, native.matmul(h, k)),
    ),
}
# The chunk size is per backend (HEAD_CHUNK): the name leaves it out so that the
# backends' rows line up in the summary; the README gives it.
_HEAD_NAME = "masked {} value+grad from hidden states [2048×256 → 128256], chunked"

HEAD_CASES = [
    case
    for name, (fused, materialised, peer) in _HEAD_FUNCTIONS.items()
    for case in (
        Case(
            _HEAD_NAME.format(name) + " vs logits formed first",
            "our chunked call on the logits",
            "time ≤ 1.10, memory ≤ 0.20",
            gradient_sides(_head_inputs, fused, materialised),
            1.10,
            0.20,
        ),
        Case(_HEAD_NAME.format(name), _PEER, "memory ≤ 0.10", gradient_sides(_head_inputs, fused, peer), None, 0.10),
    )
]


def _distiller_step(small):
    """One fused and one unfused Distiller training step on a batch of 2048
    tokens (8 × 256), hidden size 256, vocabulary 128256: tiny bodies, so
    the step is the heads and the losses."""
    from keras_penalties.distillation import Distiller, LogitsDivergence

    tokens, hidden, vocab = (64, 16, 1000) if small else HEAD_SHAPE
    length = 8 if small else 256
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(tokens // length, length))
    y = rng.integers(0, vocab, size=(tokens // length, length))
    weights = (rng.uniform(size=y.shape) >= 0.25).astype("float32")

    def lm(name, seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((length,), dtype="int32")
        body = keras.layers.Embedding(vocab, hidden)(inputs)
        return keras.Model(inputs, keras.layers.Dense(vocab, name="head")(body), name=name)

    def step(fused):
        fuse = dict(head="head", teacher_head="head", chunk_size=HEAD_CHUNK) if fused else {}
        distiller = Distiller(
            lm("teacher", 1), lm("student", 2), LogitsDivergence(temperature=2.0), student_loss_weight=0.5, **fuse
        )
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        return lambda: distiller.train_on_batch(x, y, sample_weight=weights)

    return {"ours": step(True), "reference": step(False)}


DISTILLER_CASES = [
    Case(
        "Distiller train step, fused heads (2048 tokens, 256 → 128256), chunked",
        "the unfused Distiller",
        "time ≤ 1.00",
        _distiller_step,
        1.0,
    )
]


# ---------------------------------------------------------------- norms at the memory-bandwidth floor


def _norm(fn, size):
    def build(small):
        n = size // 100 if small else size
        x_np = np.random.default_rng(0).normal(size=n).astype("float32")
        x = ops.convert_to_tensor(x_np)
        ours = native.compile_fn(fn)
        return {
            "ours": lambda: native.block(ours(x)),
            "reference": lambda: np.add.reduce(x_np),
            "bytes": x_np.nbytes,
        }

    return build


NORM_CASES = [
    Case(f"{name} {size:.0e} elements", "one NumPy pass (np.add.reduce)", "reported", _norm(fn, int(size)))
    for size in (1e7, 1e8)
    for name, fn in (("l1", P.l1), ("l2", P.l2), ("elastic_net", P.elastic_net))
]


# ---------------------------------------------------------------- fit with a composed objective

REFERENCE = np.linspace(1.0, 2.0, 10).astype("float32")


def kl_to_reference(logits):
    reference = ops.broadcast_to(ops.convert_to_tensor(REFERENCE), ops.shape(logits))
    return P.kl_divergence(reference, logits, from_logits=True)


class HandL1(keras.layers.Layer):
    """The same activity L1 (each sample's Σ|h|, averaged over the batch), hand-written."""

    def call(self, x):
        self.add_loss(1e-5 * ops.sum(ops.abs(x)) / ops.cast(ops.shape(x)[0], x.dtype))
        return x


class HandHead(keras.layers.Layer):
    """The same entropy bonus and KL to the reference, hand-written in keras.ops."""

    def call(self, logits):
        logp = ops.log_softmax(logits, axis=-1)
        entropy = -ops.mean(ops.sum(ops.exp(logp) * logp, axis=-1))
        log_ref = ops.log_softmax(ops.convert_to_tensor(REFERENCE))
        kl = ops.mean(ops.sum(ops.exp(log_ref) * (log_ref - logp), axis=-1))
        self.add_loss(-0.01 * entropy + 0.1 * kl)
        return logits


def mlp(composed, seed=0):
    """784-512-512-10 with L1 activity, entropy bonus, L2 kernels and KL to a fixed reference."""
    keras.utils.set_random_seed(seed)
    l2 = (lambda: R.L2(1e-4)) if composed else (lambda: keras.regularizers.L2(1e-4))
    inputs = keras.Input((784,))
    h = keras.layers.Dense(512, activation="relu", kernel_regularizer=l2())(inputs)
    h = CompositeObjective({"l1": Term("l1", 1e-5)}, name="activity")(h) if composed else HandL1()(h)
    h = keras.layers.Dense(512, activation="relu", kernel_regularizer=l2())(h)
    logits = keras.layers.Dense(10, kernel_regularizer=l2())(h)
    if composed:
        logits = CompositeObjective(
            {"bonus": Term(L.Entropy(from_logits=True, mode="bonus"), 0.01), "kl": Term(kl_to_reference, 0.1)},
            name="head",
        )(logits)
    else:
        logits = HandHead()(logits)
    model = keras.Model(inputs, logits)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(small, steps):
    batch = 64 if small else 256
    rng = np.random.default_rng(0)
    return rng.normal(size=(batch * steps, 784)).astype("float32"), rng.integers(0, 10, batch * steps), batch


def _fit(model, x, y, batch, callbacks=()):
    return lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))


def build_fit(small):
    steps = 5 if small else 100
    x, y, batch = _data(small, steps)
    return {"ours": _fit(mlp(True), x, y, batch), "reference": _fit(mlp(False), x, y, batch), "per": steps}


def _monitor(every):
    def build(small):
        steps = 5 if small else 100
        x, y, batch = _data(small, steps)
        model = mlp(True)
        monitor = PenaltyMonitor(probe_data=(x[:batch], y[:batch]), every_n_batches=every)
        return {"ours": _fit(model, x, y, batch, [monitor]), "reference": _fit(model, x, y, batch), "per": steps}

    return build


FIT_CASES = [
    Case("fit step, MLP + 4-term objective", "same math hand-written in keras.ops", "time ≤ 1.03", build_fit, 1.03)
] + [
    Case(
        f"PenaltyMonitor every_n_batches={n}",
        "fit without the monitor",
        "time ≤ 1.05" if n == 50 else "reported",
        _monitor(n),
        1.05 if n == 50 else None,
    )
    for n in (1, 10, 50)
]


# ---------------------------------------------------------------- WGAN-GP critic step

GP_DIMS, GP_HIDDEN, GP_BATCH, GP_WEIGHT, GP_LR = 128, [512, 512], 512, 10.0, 1e-3


class Critic(keras.Model):
    def __init__(self, hidden, gp_weight=GP_WEIGHT):
        super().__init__()
        self.net = keras.Sequential(
            [keras.layers.Dense(h, activation="relu") for h in hidden] + [keras.layers.Dense(1)]
        )
        self.seed_generator = keras.random.SeedGenerator(0)
        self.gp_weight = gp_weight

    def call(self, x):
        return self.net(x)[:, 0]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        real, fake = x, y
        loss = ops.mean(self(fake)) - ops.mean(self(real))
        if not self.gp_weight:
            return loss
        return loss + self.gp_weight * interpolated_gradient_penalty(self, real, fake, seed=self.seed_generator)


def build_gp(small, gp_weight=GP_WEIGHT):
    """Keras fit of the critic against the same step hand-written natively.
    gp_weight=0 leaves the penalty out on both sides: what Keras' fit loop
    itself costs over a native loop."""
    steps = 3 if small else 30
    dims, hidden, batch = (16, [32, 32], 32) if small else (GP_DIMS, GP_HIDDEN, GP_BATCH)
    rng = np.random.default_rng(0)
    real = rng.normal(size=(batch * steps, dims)).astype("float32") + 1.0
    fake = rng.normal(size=(batch * steps, dims)).astype("float32")
    keras.utils.set_random_seed(0)
    critic = Critic(hidden, gp_weight)
    critic.compile(optimizer=keras.optimizers.SGD(GP_LR))
    native_step = native.wgan_gp_step(dims, hidden, batch, gp_weight, GP_LR)
    batches = [
        (
            ops.convert_to_tensor(real[i * batch : (i + 1) * batch]),
            ops.convert_to_tensor(fake[i * batch : (i + 1) * batch]),
        )
        for i in range(steps)
    ]

    def hand_written():
        for r, f in batches:
            loss = native_step(r, f)
        native.block(loss)

    return {
        "ours": lambda: critic.fit(real, fake, batch_size=batch, epochs=1, verbose=0, shuffle=False),
        "reference": hand_written,
        "per": steps,
    }


class HandCritic(Critic):
    """The same critic with the penalty written by hand, as a Keras user
    would without the package: the same interpolation, the input gradient
    taken with the backend's own autodiff (`native.input_gradient`)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        real, fake = x, y
        loss = ops.mean(self(fake)) - ops.mean(self(real))
        eps = keras.random.uniform((ops.shape(real)[0], 1), seed=self.seed_generator)
        mixed = eps * real + (1.0 - eps) * fake
        grads = native.input_gradient(self, mixed)
        return loss + self.gp_weight * ops.mean(ops.square(ops.sqrt(ops.sum(ops.square(grads), axis=1)) - 1.0))


def build_gp_keras(small):
    """Keras fit of the critic with our penalty against the same fit with the
    penalty hand-written (HandCritic): the reference a Keras user has."""
    steps = 3 if small else 30
    dims, hidden, batch = (16, [32, 32], 32) if small else (GP_DIMS, GP_HIDDEN, GP_BATCH)
    rng = np.random.default_rng(0)
    real = rng.normal(size=(batch * steps, dims)).astype("float32") + 1.0
    fake = rng.normal(size=(batch * steps, dims)).astype("float32")
    critics = []
    for kind in (Critic, HandCritic):
        keras.utils.set_random_seed(0)
        critic = kind(hidden)
        critic.compile(optimizer=keras.optimizers.SGD(GP_LR))
        critics.append(critic)

    def fit(critic):
        return lambda: critic.fit(real, fake, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    return {"ours": fit(critics[0]), "reference": fit(critics[1]), "per": steps}


GP_CASES = [
    Case(
        "WGAN-GP critic train step",
        "the same penalty hand-written in the Keras step",
        "time ≤ 1.05",
        build_gp_keras,
        1.05,
    ),
    Case("WGAN-GP critic train step vs a native loop", "hand-written native step", "reported", build_gp),
    Case(
        "same critic step without GP (fit overhead)",
        "hand-written native step",
        "reported",
        functools.partial(build_gp, gp_weight=0.0),
    ),
]

# ---------------------------------------------------------------- optimizer wrappers


def plain_mlp(optimizer, seed=0):
    """784-512-512-10 with no penalties: the step is the optimizer's and the layers'."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((784,))
    h = keras.layers.Dense(512, activation="relu")(inputs)
    h = keras.layers.Dense(512, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


WRAPPERS = {
    "ProximalDecay(L1)": lambda inner: O.ProximalDecay(inner, R.L1(0.1)),
    "ProximalDecay(ElasticNet)": lambda inner: O.ProximalDecay(inner, R.ElasticNet(0.1)),
    "GradientNoise": lambda inner: O.GradientNoise(inner, seed=0),
    "AdaptiveGradientClipping": lambda inner: O.AdaptiveGradientClipping(inner),
    "GradientCentralization": lambda inner: O.GradientCentralization(inner),
}


class HandNoisyAdam(keras.optimizers.Adam):
    """Adam with GradientNoise's annealed noise written by hand: σ_t =
    0.01·(1 + t)^(−0.275), drawn the backend's own way (`native.add_noise`)."""

    def apply(self, grads, trainable_variables=None):
        t = ops.convert_to_tensor(self.iterations)
        sigma = 0.01 * ops.power(1.0 + ops.cast(t, "float32"), -0.275)
        return super().apply(native.add_noise(list(grads), sigma, t), trainable_variables)


class HandClippedAdam(keras.optimizers.Adam):
    """Adam after adaptive gradient clipping written by hand
    (`native.adaptive_clip`: optax's `adaptive_grad_clip` on JAX, timm's
    `adaptive_clip_grad` on torch), AdaptiveGradientClipping's defaults."""

    def apply(self, grads, trainable_variables=None):
        variables = trainable_variables or self._trainable_variables
        return super().apply(native.adaptive_clip(list(grads), [v.value for v in variables]), trainable_variables)


class HandCentralizedAdam(keras.optimizers.Adam):
    """Adam after gradient centralization written by hand (`native.centralize`)."""

    def apply(self, grads, trainable_variables=None):
        return super().apply(native.centralize(list(grads)), trainable_variables)


def _wrapped_fit(wrap, reference=lambda: keras.optimizers.Adam(1e-3)):
    def build(small):
        steps = 5 if small else 100
        x, y, batch = _data(small, steps)
        ours = plain_mlp(wrap(keras.optimizers.Adam(1e-3)))
        return {"ours": _fit(ours, x, y, batch), "reference": _fit(plain_mlp(reference()), x, y, batch), "per": steps}

    return build


# Against bare Adam, a gradient transform's row measures the transform
# itself (the draw, the norms, the means), which bare Adam does not do:
# those rows are reported, and the target applies against the same
# transform written by hand the backend's own way.
HAND_WRITTEN = {
    "GradientNoise": ("noise", HandNoisyAdam),
    "AdaptiveGradientClipping": ("clipping", HandClippedAdam),
    "GradientCentralization": ("centralization", HandCentralizedAdam),
}

OPTIMIZER_CASES = [
    Case(
        f"fit step, MLP + Adam in {name}",
        "the same fit with bare Adam",
        "reported" if name in HAND_WRITTEN else "time ≤ 1.05",
        _wrapped_fit(wrap),
        None if name in HAND_WRITTEN else 1.05,
    )
    for name, wrap in WRAPPERS.items()
] + [
    Case(
        f"fit step, MLP + Adam in {name} vs the {what} by hand",
        f"Adam with the same {what} hand-written",
        "time ≤ 1.05",
        _wrapped_fit(WRAPPERS[name], reference),
        1.05,
    )
    for name, (what, reference) in HAND_WRITTEN.items()
]

CASES = (
    FIT_CASES
    + WEIGHTING_CASES
    + OPTIMIZER_CASES
    + GP_CASES
    + DIVERGENCE_CASES
    + LLM_CASES
    + HEAD_CASES
    + ROOFLINE_CASES
    + RL_CASES
    + PREFERENCE_CASES
    + DISTILLER_CASES
    + NORM_CASES
    + POST_TRAINING_CASES
    + ROUTER_CASES
)

# Misses that a measurement shows out of reach (bench/results/README.md,
# "Missed, and why"): (backend, case name) -> why. The summary marks them ✗†
# and prints the reason under the table.
OUT_OF_REACH = {
    (
        "jax",
        "entropy value [8192, 32000]",
    ): (
        "the same compiled program as the peer's (XLA's optimized HLO is the same but for names), "
        "at the target by construction: the ratio is 1 but for noise "
        "(rerun: KERAS_BACKEND=jax python -m bench.out_of_reach)"
    ),
    (
        "tensorflow",
        "kl_divergence value+grad [8192, 32000]",
    ): (
        "the same TF ops as the peer's on every [rows, classes] tensor "
        "(they differ only on per-row vectors and scalars), "
        "at the target by construction: the ratio is 1 but for noise "
        "(rerun: KERAS_BACKEND=tensorflow python -m bench.out_of_reach)"
    ),
    (
        "tensorflow",
        _HEAD_NAME.format("cross-entropy"),
    ): (
        "memory: the target (0.10 of raw TF's 1208 MB, 121 MB) "
        "is less than the kernel's gradient both sides return (125 MB) "
        "(rerun: KERAS_BACKEND=tensorflow python -m bench.out_of_reach)"
    ),
    ("jax", "multi-task fit step, GradNorm every_n_batches=1"): (
        "time: on this 0.3 ms step, a callback that only assigns one variable per batch already makes the step "
        "×1.65–2.0 (Keras writes the whole training state back and reads it again), and the probe's forward "
        "pass, loss and one gradient on the fixed batch ×0.47–0.56 of a step more (bench/results/README.md, issue 45; "
        "rerun: KERAS_BACKEND=jax python -m bench.out_of_reach)"
    ),
    **{
        ("jax", _ROOFLINE_NAME.format(what)): (
            "time: the products a 64-row chunk at a time (as the head forms them, so that no [tokens, vocab] "
            "logits exist) take ×1.23 of the same products whole on XLA:CPU, and each chunk's softmax and its "
            "gradient ×0.15 more; 128- and 256-row chunks are slower still (bench/results/README.md, issue 45; "
            "rerun: KERAS_BACKEND=jax python -m bench.out_of_reach)"
        )
        for what in ("cross-entropy", "kl forward")
    },
    **{
        (backend, _RL_NAME + " vs logits formed first"): (
            "time: per-position values get one upstream number per position only in the backward pass, "
            "which forms each chunk's logits again: 4 products of [2048, 256] × [256, 128256] against the "
            "formed path's 3, a floor of ×1.33 (bench/results/README.md, issue 44)"
        )
        for backend in ("jax", "tensorflow")
    },
    ("torch", _RL_NAME + " vs logits formed first"): (
        "time: the same 4 products against the reference's 3; formed 64 rows at a time, as the auto chunk size "
        "forms them (128-row chunks read memory 0.13 of the peer's, over that row's 0.10), they alone take "
        "×1.30–1.51 of the whole reference, ×1.73–1.83 of its 3 products (bench/results/README.md, issue 45; "
        "rerun: KERAS_BACKEND=torch python -m bench.out_of_reach)"
    ),
}

# Rows with no ratio because the native peer alone does not fit in this
# machine's memory (bench/results/README.md, "ninth round"): (backend, case
# name) -> the measurement. The summary marks them "not measured‡".
PEER_OUT_OF_MEMORY = {
    **{
        ("tensorflow", f"masked js β={beta} value+grad [8192, 32000], chunk_size={chunk}"): (
            "alone in its process, the peer's first call takes 16.5 GB above the inputs, TF's allocator keeps "
            "18 GB of it, and the second call is killed on this 24 GB machine; ours, alone, takes 1.5 GB"
        )
        for beta in ("0.5", "0.1")
        for chunk in ("512", "auto")
    },
    **{
        ("tensorflow", f"masked js β={beta} value+grad [4096, 128256], chunk_size={chunk}"): (
            "alone in its process, the peer's first call is killed at 24.4 GB resident (measured at β=0.5; "
            "the four rows share the peer); ours, alone, takes 3.6 GB above the inputs"
        )
        for beta in ("0.5", "0.1")
        for chunk in ("512", "auto")
    },
}
