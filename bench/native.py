"""Hand-written native references, one set per backend: what a user would write
without keras-penalties (optax on JAX, torch.nn.functional on torch, raw tf ops)."""

import math
import time

import keras
import numpy as np

BACKEND = keras.backend.backend()
LOG2 = math.log(2.0)


def block(x):
    """Waits for a result (JAX dispatches asynchronously)."""
    if BACKEND == "jax":
        import jax

        return jax.block_until_ready(x)
    return x


def compile_fn(fn):
    """The backend's compiler, applied alike to ours and the reference."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def value_and_grads(fn, count):
    """fn(*args) -> (value, [∂value/∂arg for the last `count` args]), compiled:
    a student's hidden states and vocabulary kernel, say."""
    if BACKEND == "jax":
        import jax

        def run(*args):
            fixed, wrt = args[:-count], args[-count:]
            return jax.value_and_grad(lambda *w: fn(*fixed, *w), argnums=tuple(range(count)))(*wrt)

        return jax.jit(run)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def run(*args):
            wrt = list(args[-count:])
            with tf.GradientTape() as tape:
                tape.watch(wrt)
                value = fn(*args[:-count], *wrt)
            return value, tape.gradient(value, wrt)

        return run
    import torch

    def run(*args):
        wrt = [a.detach().requires_grad_(True) for a in args[-count:]]
        value = fn(*args[:-count], *wrt)
        return value.detach(), torch.autograd.grad(value, wrt)

    return run


def value_and_grad(fn):
    """fn(*args) -> (value, ∂value/∂last arg), compiled."""
    if BACKEND == "jax":
        import jax

        return jax.jit(lambda *a: jax.value_and_grad(lambda last: fn(*a[:-1], last))(a[-1]))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def run(*args):
            last = args[-1]
            with tf.GradientTape() as tape:
                tape.watch(last)
                value = fn(*args[:-1], last)
            return value, tape.gradient(value, last)

        return run
    import torch

    def run(*args):
        last = args[-1].detach().requires_grad_(True)
        value = fn(*args[:-1], last)
        (grad,) = torch.autograd.grad(value, last)
        return value.detach(), grad

    return run


def matmul_peak(small=False, size=4096, repeats=3):
    """The backend's float32 matmul rate in FLOP/s: the best of `repeats`
    compiled [size, size] × [size, size] products (2·size³ operations),
    the roofline rows' measured peak."""
    size = 256 if small else size
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    a, b = keras.ops.convert_to_tensor(a), keras.ops.convert_to_tensor(b)
    product = compile_fn(matmul)
    block(product(a, b))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        block(product(a, b))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


# ---------------------------------------------------------------- divergences from logits


def kl(teacher, student):
    """mean over rows of KL(softmax(teacher) ‖ softmax(student))."""
    if BACKEND == "jax":
        import jax
        import optax

        return optax.losses.kl_divergence_with_log_targets(
            jax.nn.log_softmax(student), jax.nn.log_softmax(teacher)
        ).mean()
    if BACKEND == "torch":
        import torch.nn.functional as F

        return F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
    import tensorflow as tf

    lp, lq = tf.nn.log_softmax(teacher), tf.nn.log_softmax(student)
    return tf.reduce_mean(tf.reduce_sum(tf.exp(lp) * (lp - lq), -1))


def js(a, b):
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp
        import optax

        la, lb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
        lm = jnp.logaddexp(la, lb) - LOG2
        kl_log = optax.losses.kl_divergence_with_log_targets
        return 0.5 * (kl_log(lm, la) + kl_log(lm, lb)).mean()
    if BACKEND == "torch":
        import torch
        import torch.nn.functional as F

        la, lb = F.log_softmax(a, -1), F.log_softmax(b, -1)
        lm = torch.logaddexp(la, lb) - LOG2
        return 0.5 * (
            F.kl_div(lm, la, log_target=True, reduction="batchmean")
            + F.kl_div(lm, lb, log_target=True, reduction="batchmean")
        )
    import tensorflow as tf

    la, lb = tf.nn.log_softmax(a), tf.nn.log_softmax(b)
    lm = _tf_logaddexp(la, lb) - LOG2
    return 0.5 * tf.reduce_mean(tf.reduce_sum(tf.exp(la) * (la - lm) + tf.exp(lb) * (lb - lm), -1))


def _tf_logaddexp(x, y):
    """log(eˣ + eʸ) for finite x, y, written the standard stable way (TF has
    no logaddexp op): max + log1p(e^−|x − y|), the value the JAX and torch
    peers' logaddexp gives. Its gradient differs only where x == y
    (`tf.maximum` sends it all to x), which random logits never meet. A
    `reduce_logsumexp` over `tf.stack([x, y])` was killed for memory on this
    24 GB machine for JS value+grad at [8192, 32000]; this form fits there
    (bench/results/README.md, ninth round)."""
    import tensorflow as tf

    return tf.maximum(x, y) + tf.math.log1p(tf.exp(-tf.abs(x - y)))


def entropy(logits):
    if BACKEND == "jax":
        import jax
        import optax

        return optax.losses.softmax_cross_entropy(logits, jax.nn.softmax(logits)).mean()
    if BACKEND == "torch":
        import torch

        return torch.distributions.Categorical(logits=logits, validate_args=False).entropy().mean()
    import tensorflow as tf

    lp = tf.nn.log_softmax(logits)
    return -tf.reduce_mean(tf.reduce_sum(tf.exp(lp) * lp, -1))


# ---------------------------------------------------------------- token-level, with a mask
# Per-token values written the obvious way, then the mean over kept tokens:
# Σ(v·mask) / max(Σmask, 1). The logits the gradient is taken for come last.


def _masked_mean(values, mask):
    if BACKEND == "jax":
        import jax.numpy as jnp

        return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    if BACKEND == "torch":
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    import tensorflow as tf

    return tf.reduce_sum(values * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)


def _log_softmax(x):
    if BACKEND == "jax":
        import jax

        return jax.nn.log_softmax(x)
    if BACKEND == "torch":
        import torch.nn.functional as F

        return F.log_softmax(x, -1)
    import tensorflow as tf

    return tf.nn.log_softmax(x)


def _token_kl(log_p, log_q):
    """Per token KL(p‖q) from log-probabilities."""
    if BACKEND == "jax":
        import optax

        return optax.losses.kl_divergence_with_log_targets(log_q, log_p)
    if BACKEND == "torch":
        import torch.nn.functional as F

        return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    import tensorflow as tf

    return tf.reduce_sum(tf.exp(log_p) * (log_p - log_q), -1)


def masked_kl(mask, teacher, student, reverse=False):
    lt, ls = _log_softmax(teacher), _log_softmax(student)
    return _masked_mean(_token_kl(ls, lt) if reverse else _token_kl(lt, ls), mask)


def masked_js(mask, teacher, student, beta=0.5):
    """β·KL(p‖m) + (1 − β)·KL(q‖m), log m = logsumexp(log β + log p, log(1 − β) + log q)."""
    lp, lq = _log_softmax(teacher), _log_softmax(student)
    a, b = math.log(beta), math.log(1.0 - beta)
    if BACKEND == "jax":
        import jax.numpy as jnp

        lm = jnp.logaddexp(a + lp, b + lq)
    elif BACKEND == "torch":
        import torch

        lm = torch.logaddexp(a + lp, b + lq)
    else:
        lm = _tf_logaddexp(a + lp, b + lq)
    return _masked_mean(beta * _token_kl(lp, lm) + (1.0 - beta) * _token_kl(lq, lm), mask)


def matmul(a, b):
    if BACKEND == "jax":
        return a @ b
    if BACKEND == "torch":
        return a @ b
    import tensorflow as tf

    return tf.matmul(a, b)


def masked_cross_entropy(mask, labels, logits):
    """−log softmax(logits)[label], averaged over the kept tokens."""
    if BACKEND == "jax":
        import optax

        values = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)
    elif BACKEND == "torch":
        import torch.nn.functional as F

        values = F.cross_entropy(logits, labels.long(), reduction="none")
    else:
        import tensorflow as tf

        values = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return _masked_mean(values, mask)


def masked_entropy(mask, logits):
    if BACKEND == "torch":
        import torch

        values = torch.distributions.Categorical(logits=logits, validate_args=False).entropy()
    else:
        lp = _log_softmax(logits)
        if BACKEND == "jax":
            import jax.numpy as jnp

            values = -jnp.sum(jnp.exp(lp) * lp, -1)
        else:
            import tensorflow as tf

            values = -tf.reduce_sum(tf.exp(lp) * lp, -1)
    return _masked_mean(values, mask)


# ---------------------------------------------------------------- a WGAN-GP critic step


def wgan_gp_step(dims, hidden, batch, gp_weight, lr, seed=0):
    """A hand-written native WGAN-GP critic step for an MLP critic; returns
    step(real, fake) -> loss, updating the critic's parameters in place.
    With gp_weight=0 the gradient penalty is left out entirely."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = [dims] + hidden + [1]
    init = [
        (rng.normal(scale=math.sqrt(2.0 / a), size=(a, b)).astype("float32"), np.zeros(b, "float32"))
        for a, b in zip(sizes[:-1], sizes[1:])
    ]
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in init]

        def critic(params, x):
            for w, b in params[:-1]:
                x = jax.nn.relu(x @ w + b)
            w, b = params[-1]
            return (x @ w + b)[:, 0]

        def loss_fn(params, real, fake, key):
            wasserstein = critic(params, fake).mean() - critic(params, real).mean()
            if not gp_weight:
                return wasserstein
            eps = jax.random.uniform(key, (real.shape[0], 1))
            mixed = eps * real + (1 - eps) * fake
            grads = jax.grad(lambda x: critic(params, x).sum())(mixed)
            gp = jnp.mean((jnp.sqrt(jnp.sum(grads**2, axis=1)) - 1.0) ** 2)
            return wasserstein + gp_weight * gp

        @jax.jit
        def update(params, real, fake, key):
            loss, grads = jax.value_and_grad(loss_fn)(params, real, fake, key)
            return loss, jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

        state = {"params": params, "key": jax.random.PRNGKey(seed)}

        def step(real, fake):
            state["key"], key = jax.random.split(state["key"])
            loss, state["params"] = update(state["params"], real, fake, key)
            return loss

        return step
    if BACKEND == "torch":
        import torch

        params = [torch.tensor(a, requires_grad=True) for pair in init for a in pair]
        optimizer = torch.optim.SGD(params, lr=lr)

        def critic(x):
            for i in range(0, len(params) - 2, 2):
                x = torch.relu(x @ params[i] + params[i + 1])
            return (x @ params[-2] + params[-1])[:, 0]

        def step(real, fake):
            loss = critic(fake).mean() - critic(real).mean()
            if gp_weight:
                eps = torch.rand(real.shape[0], 1)
                mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
                (grads,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
                gp = ((grads.square().sum(1).sqrt() - 1.0) ** 2).mean()
                loss = loss + gp_weight * gp
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return step
    import tensorflow as tf

    params = [tf.Variable(a) for pair in init for a in pair]

    def critic(x):
        for i in range(0, len(params) - 2, 2):
            x = tf.nn.relu(x @ params[i] + params[i + 1])
        return (x @ params[-2] + params[-1])[:, 0]

    @tf.function
    def step(real, fake):
        with tf.GradientTape() as outer:
            loss = tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real))
            if gp_weight:
                eps = tf.random.uniform((tf.shape(real)[0], 1))
                mixed = eps * real + (1 - eps) * fake
                with tf.GradientTape() as inner:
                    inner.watch(mixed)
                    score = tf.reduce_sum(critic(mixed))
                grads = inner.gradient(score, mixed)
                gp = tf.reduce_mean((tf.sqrt(tf.reduce_sum(grads**2, 1)) - 1.0) ** 2)
                loss = loss + gp_weight * gp
        for p, g in zip(params, outer.gradient(loss, params)):
            p.assign_sub(lr * g)
        return loss

    return step


def input_gradient(fn, x):
    """∂Σfn(x)/∂x, kept differentiable: what a Keras user writes by hand for a
    gradient penalty inside `compute_loss` (jax.grad, a GradientTape,
    torch.autograd.grad with create_graph)."""
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        return jax.grad(lambda x: jnp.sum(fn(x)))(x)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(x))
        return tape.gradient(y, x)
    import torch

    x = x.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    return g


def add_noise(grads, sigma, step):
    """g + σ·N(0, 1) for each gradient, drawn the backend's own way: on JAX a
    key folded from the step and split per tensor (optax's add_noise), on TF
    a stateless draw seeded by (tensor, step), on torch `randn_like`."""
    if BACKEND == "jax":
        import jax

        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(0), step), len(grads))
        return [g + sigma * jax.random.normal(k, g.shape, g.dtype) for k, g in zip(keys, grads)]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.cast(step, tf.int64)
        return [
            g
            + tf.cast(sigma, g.dtype)
            * tf.random.stateless_normal(tf.shape(g), tf.stack([tf.constant(i, tf.int64), step]), dtype=g.dtype)
            for i, g in enumerate(grads)
        ]
    import torch

    return [g + sigma * torch.randn_like(g) for g in grads]


def adaptive_clip(grads, weights, clip_factor=0.01, eps=1e-3):
    """Unit-wise adaptive gradient clipping (Brock et al., 2021) the way each
    backend's users write it, for Keras' layout (units on the last axis):
    on JAX optax's `adaptive_grad_clip` (the same norms for ranks 1, 2 and
    4, the bench MLP's; optax takes rank 3 as multi-head, axis 0 only, and
    a tensor that squeezes to a vector, such as a [1, N] kernel, as one
    unit); on torch timm's `adaptive_clip_grad` (norms from `Tensor.norm`,
    `torch.where`, the result copied into the gradient) over every axis but
    the last; on TF the same in tf ops."""
    if BACKEND == "jax":
        import optax

        clipped, _ = optax.adaptive_grad_clip(clip_factor, eps).update(list(grads), None, list(weights))
        return clipped
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def unit_norm(x):  # tf.norm takes one axis or two: √Σx² over the others
            return tf.sqrt(tf.reduce_sum(tf.square(x), axis=list(range(len(x.shape) - 1)) or None, keepdims=True))

        out = []
        for g, w in zip(grads, weights):
            max_norm = clip_factor * tf.maximum(unit_norm(w), eps)
            g_norm = unit_norm(g)
            out.append(tf.where(g_norm < max_norm, g, g * (max_norm / tf.maximum(g_norm, 1e-6))))
        return out
    import torch

    def unit_norm(x):
        return x.norm(2) if x.ndim <= 1 else x.norm(2, dim=tuple(range(x.ndim - 1)), keepdim=True)

    out = []
    with torch.no_grad():
        for g, w in zip(grads, weights):
            max_norm = unit_norm(w).clamp_(min=eps).mul_(clip_factor)
            g_norm = unit_norm(g)
            # timm writes the result into p.grad in place.
            out.append(g.copy_(torch.where(g_norm < max_norm, g, g * (max_norm / g_norm.clamp(min=1e-6)))))
    return out


def centralize(grads):
    """Gradient centralization (Yong et al., 2020), g − mean of g over every
    axis but the last for rank ≥ 2, the way each backend's users write it:
    on JAX optax's `centralize` formula in jnp (optax's own takes the mean
    over every axis but the first, PyTorch's layout, so it is not called
    on Keras' [in, out] kernels), the paper's
    `grad.add_(-grad.mean(...))` on torch (in place: Keras' torch trainer
    hands the optimizer each variable's `.grad`), tf ops on TF."""
    if BACKEND == "jax":
        return [g - g.mean(tuple(range(g.ndim - 1)), keepdims=True) if g.ndim > 1 else g for g in grads]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return [
            g - tf.reduce_mean(g, axis=list(range(len(g.shape) - 1)), keepdims=True) if len(g.shape) > 1 else g
            for g in grads
        ]
    import torch

    with torch.no_grad():  # in place, as the paper's code does
        return [g.sub_(g.mean(dim=tuple(range(g.ndim - 1)), keepdim=True)) if g.ndim > 1 else g for g in grads]
