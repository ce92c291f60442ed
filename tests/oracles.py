"""Independent oracles for every function in `keras_penalties.ops`, and the case table.

Each oracle is written from the documented formula with NumPy/SciPy
(`scipy.special.rel_entr`, `scipy.stats.entropy`,
`scipy.spatial.distance.jensenshannon`, `numpy.linalg.norm`), in float64,
never from this package's code. Temperature on probabilities is applied as the
spec states it, p^(1/T) renormalised.
"""

import dataclasses
import itertools

import numpy as np
from scipy import special, stats
from scipy.spatial import distance

from keras_penalties import ops as P


def _sum_over_batch_size(values):
    values = np.asarray(values)
    return values.sum() / max(values.shape[0] if values.ndim else 1, 1)


def _reduce(values, reduction):
    return {"sum": np.sum, "mean": np.mean, "none": np.asarray, "sum_over_batch_size": _sum_over_batch_size}[reduction](
        values
    )


def _dist(x, from_logits=False, temperature=1.0, axis=-1):
    """Probabilities along axis, after temperature. At T = 1 given
    probabilities are used as they are (as keras.losses.KLDivergence does)."""
    if from_logits:
        return special.softmax(x / temperature, axis=axis)
    if temperature == 1.0:
        return x
    powered = x ** (1.0 / temperature)
    return powered / powered.sum(axis=axis, keepdims=True)


def np_l1(x, reduction="sum"):
    return _reduce(np.abs(x), reduction)


def np_l2(x, reduction="sum", center=None, clip=None):
    c = x.mean() if center == "mean" else (center or 0.0)
    d = x - c
    if clip is not None:
        d = np.clip(d, -clip, clip)
    return _reduce(d**2, reduction)


def np_elastic_net(x, l1_ratio=0.5, reduction="sum"):
    return _reduce(l1_ratio * np.abs(x) + (1 - l1_ratio) * x**2, reduction)


def _kl(p, q, axis):
    return special.rel_entr(p, q).sum(axis=axis)


def np_kl_divergence(p, q, from_logits=False, direction="forward", temperature=1.0, axis=-1, reduction="mean"):
    p, q = _dist(p, from_logits, temperature, axis), _dist(q, from_logits, temperature, axis)
    values = {
        "forward": lambda: _kl(p, q, axis),
        "reverse": lambda: _kl(q, p, axis),
        "symmetric": lambda: 0.5 * (_kl(p, q, axis) + _kl(q, p, axis)),
    }[direction]()
    return _reduce(values, reduction)


def np_js_divergence(p, q, from_logits=False, temperature=1.0, axis=-1, reduction="mean", beta=0.5):
    p, q = _dist(p, from_logits, temperature, axis), _dist(q, from_logits, temperature, axis)
    if beta == 0.5:
        return _reduce(distance.jensenshannon(p, q, axis=axis) ** 2, reduction)
    m = beta * p + (1 - beta) * q  # the generalized JSD (Agarwal et al., 2024)
    return _reduce(beta * _kl(p, m, axis) + (1 - beta) * _kl(q, m, axis), reduction)


def np_entropy(x, from_logits=False, normalize=False, temperature=1.0, axis=-1, reduction="mean"):
    p = _dist(x, from_logits, temperature, axis)
    values = stats.entropy(p, axis=axis)
    if normalize:
        values = values / np.log(x.shape[axis])
    return _reduce(values, reduction)


def np_cross_entropy(labels, logits, from_logits=True, label_smoothing=0.0, temperature=1.0, axis=-1, reduction="mean"):
    """−(1 − ε)·log p(label) − ε·mean_k log p_k at each position (Keras'
    smoothing: the one-hot target becomes (1 − ε)·onehot + ε/K)."""
    p = _dist(np.moveaxis(logits, axis, -1), from_logits, temperature, -1)
    logp = np.log(p)
    picked = np.take_along_axis(logp, np.asarray(labels, int)[..., None], axis=-1)[..., 0]
    return _reduce(-(1.0 - label_smoothing) * picked - label_smoothing * logp.mean(axis=-1), reduction)


def np_linear(hidden, kernel, bias=None, transpose_kernel=False):
    """The logits hidden @ kernel (+ bias) in float64; kernel [V, H] if transposed."""
    kernel = np.asarray(kernel, np.float64)
    logits = np.asarray(hidden, np.float64) @ (kernel.T if transpose_kernel else kernel)
    return logits if bias is None else logits + np.asarray(bias, np.float64)


def np_consistency(a, b, metric="mse", from_logits=False, axis=-1, reduction="mean"):
    if metric == "kl":
        return np_kl_divergence(a, b, from_logits, "symmetric", axis=axis, reduction=reduction)
    if metric == "js":
        return np_js_divergence(a, b, from_logits, axis=axis, reduction=reduction)
    if from_logits:
        a, b = special.softmax(a, axis=axis), special.softmax(b, axis=axis)
    if metric == "mse":
        values = np.mean((a - b) ** 2, axis=axis)
    elif metric == "l1":
        values = np.mean(np.abs(a - b), axis=axis)
    else:
        flat_a, flat_b = a.reshape(len(a), -1), b.reshape(len(b), -1)
        values = np.array([distance.cosine(u, v) for u, v in zip(flat_a, flat_b)])
    return _reduce(values, reduction)


def np_orthogonality(w, mode="soft", axis="columns", normalize=True):
    v = w.reshape(-1, w.shape[-1])
    if axis == "rows":
        v = v.T
    if normalize:
        v = v / np.linalg.norm(v, axis=0, keepdims=True)
    g = v.T @ v
    eye = np.eye(len(g))
    if mode == "soft":
        return np.linalg.norm(g[~np.eye(len(g), dtype=bool)]) ** 2
    if mode == "hard":
        return np.linalg.norm(g - eye, "fro") ** 2
    return np.linalg.norm(g - eye, 2)


def np_output_magnitude(x, target=1.0, reduction="mean"):
    norms = np.linalg.norm(x.reshape(len(x), -1), axis=1)
    return _reduce((norms - target) ** 2, reduction)


def np_kl_sparsity(x, target=0.05, axis=0):
    rho_hat = x.mean(axis=axis)
    return np.sum(special.rel_entr(target, rho_hat) + special.rel_entr(1 - target, 1 - rho_hat))


# ---------------------------------------------------------------- inputs


def make_inputs(kind, shape, rng):
    """Float32 test inputs of one kind; away from kinks so gradients exist."""
    if kind == "real":
        x = rng.normal(size=shape)
        return (np.where(np.abs(x) < 1e-2, 0.5, x).astype(np.float32),)
    if kind == "logits2":
        return tuple((2.0 * rng.normal(size=shape)).astype(np.float32) for _ in range(2))
    if kind == "probs2":
        return tuple(_random_probs(rng, shape) for _ in range(2))
    if kind == "probs":
        return (_random_probs(rng, shape),)
    if kind == "logits":
        return ((2.0 * rng.normal(size=shape)).astype(np.float32),)
    if kind == "real2":
        return tuple(rng.normal(size=shape).astype(np.float32) for _ in range(2))
    if kind == "unit":
        return (rng.uniform(0.02, 0.98, size=shape).astype(np.float32),)
    raise ValueError(kind)


def _random_probs(rng, shape):
    # Normalised along the last axis; `axis=1` cases renormalise in `Case`.
    x = rng.gamma(1.0, size=shape) + 1e-3
    return (x / x.sum(axis=-1, keepdims=True)).astype(np.float32)


SHAPES = {
    "real": [(7,), (4, 5), (2, 3, 4)],
    "real2": [(4, 5), (2, 3, 4)],
    "probs": [(5,), (4, 6), (2, 3, 5)],
    "probs2": [(5,), (4, 6), (2, 3, 5)],
    # 17 classes as well: torch's CPU softmax kernels change path at 16
    # (below it the package takes the softmax as an exp of the log-softmax).
    "logits": [(5,), (4, 6), (2, 3, 5), (3, 17)],
    "logits2": [(5,), (4, 6), (2, 3, 5), (3, 17)],
    "unit": [(8, 3), (6, 2, 3)],
    "matrix": [(6, 4), (4, 6), (3, 3, 2, 5)],
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: object
    oracle: object
    kind: str
    options: dict

    @property
    def id(self):
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}[{opts}]"

    def inputs(self, shape, rng):
        if self.kind == "matrix":
            return (rng.normal(size=shape).astype(np.float32),)
        xs = make_inputs(self.kind, shape, rng)
        axis = self.options.get("axis", -1)
        if self.kind.startswith("probs") and axis != -1:
            xs = tuple((x / x.sum(axis=axis, keepdims=True)).astype(np.float32) for x in xs)
        return xs

    def shapes(self):
        shapes = SHAPES[self.kind]
        if self.options.get("axis", -1) not in (-1, "columns", "rows") and self.kind != "unit":
            shapes = [s for s in shapes if len(s) == 3]
        if self.options.get("metric") == "cosine":  # needs a batch axis
            shapes = [s for s in shapes if len(s) >= 2]
        return shapes


def _grid(**choices):
    keys = list(choices)
    for values in itertools.product(*choices.values()):
        yield {k: v for k, v in zip(keys, values) if v is not None}


def _cases():
    reductions = ["sum", "mean", "none", "sum_over_batch_size"]
    div_reductions = ["mean", "sum", "none"]
    yield from (Case("l1", P.l1, np_l1, "real", o) for o in _grid(reduction=reductions))
    yield from (
        Case("l2", P.l2, np_l2, "real", o)
        for o in _grid(reduction=reductions, center=[None, 0.3, "mean"], clip=[None, 0.7])
    )
    yield from (
        Case("elastic_net", P.elastic_net, np_elastic_net, "real", o)
        for o in _grid(l1_ratio=[0.0, 0.3, 1.0], reduction=reductions)
    )
    for from_logits in (False, True):
        kind = "logits2" if from_logits else "probs2"
        yield from (
            Case("kl_divergence", P.kl_divergence, np_kl_divergence, kind, dict(from_logits=from_logits, **o))
            for o in _grid(
                direction=["forward", "reverse", "symmetric"], temperature=[1.0, 2.5, 0.5], reduction=div_reductions
            )
        )
        yield from (
            Case("kl_divergence", P.kl_divergence, np_kl_divergence, kind, dict(from_logits=from_logits, axis=1))
            for _ in [0]
        )
        yield from (
            Case("js_divergence", P.js_divergence, np_js_divergence, kind, dict(from_logits=from_logits, **o))
            for o in _grid(temperature=[1.0, 0.5], reduction=div_reductions, axis=[None, 1])
        )
        yield from (
            Case("js_divergence", P.js_divergence, np_js_divergence, kind, dict(from_logits=from_logits, **o))
            for o in _grid(beta=[0.1, 0.9], temperature=[1.0, 0.5], reduction=["mean", "none"])
        )
        kind1 = "logits" if from_logits else "probs"
        yield from (
            Case("entropy", P.entropy, np_entropy, kind1, dict(from_logits=from_logits, **o))
            for o in _grid(normalize=[False, True], temperature=[1.0, 3.0], reduction=div_reductions, axis=[None, 1])
        )
        yield from (
            Case("consistency", P.consistency, np_consistency, kind, dict(from_logits=from_logits, **o))
            for o in _grid(metric=["kl", "js", "mse", "l1", "cosine"], reduction=div_reductions)
        )
    yield from (
        Case("consistency", P.consistency, np_consistency, "real2", o)
        for o in _grid(metric=["mse", "l1", "cosine"], reduction=div_reductions, axis=[None, 1])
    )
    yield from (
        Case("orthogonality", P.orthogonality, np_orthogonality, "matrix", o)
        for o in _grid(mode=["soft", "hard", "spectral"], axis=["columns", "rows"], normalize=[True, False])
    )
    yield from (
        Case("output_magnitude", P.output_magnitude, np_output_magnitude, "real", o)
        for o in _grid(target=[1.0, 0.0, 2.5], reduction=div_reductions)
    )
    yield from (
        Case("kl_sparsity", P.kl_sparsity, np_kl_sparsity, "unit", o) for o in _grid(target=[0.05, 0.3], axis=[None, 1])
    )


CASES = list(_cases())
