"""NumPy oracles for `keras_penalties.optimizers`, written from the documented formulas and
the papers, and from Keras' documented SGD and Adam update rules (float64).

An inner optimizer is a class with `step(w, g, t)` → new w, t the number of
steps taken before this one; `lr` may be a function of t (a schedule).
"""

import numpy as np


class SGD:
    def __init__(self, lr):
        self.lr = lr

    def rate(self, t):
        return self.lr(t) if callable(self.lr) else self.lr

    def step(self, w, g, t):
        return w - self.rate(t) * g


class Adam:
    """Keras' Adam: bias correction folded into the step size, ε outside the sqrt."""

    def __init__(self, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.lr, self.b1, self.b2, self.eps = lr, beta_1, beta_2, epsilon
        self.m, self.v = {}, {}

    def rate(self, t):
        return self.lr(t) if callable(self.lr) else self.lr

    def step(self, w, g, t, key=0):
        m = self.m.get(key, np.zeros_like(w))
        v = self.v.get(key, np.zeros_like(w))
        m = m + (g - m) * (1 - self.b1)
        v = v + (g * g - v) * (1 - self.b2)
        self.m[key], self.v[key] = m, v
        alpha = self.rate(t) * np.sqrt(1 - self.b2 ** (t + 1)) / (1 - self.b1 ** (t + 1))
        return w - alpha * m / (np.sqrt(v) + self.eps)


def soft_threshold(w, threshold):
    return np.sign(w) * np.maximum(np.abs(w) - threshold, 0.0)


def l2_prox(w, step, center=None):
    c = 0.0 if center is None else (np.mean(w) if center == "mean" else center)
    return c + (w - c) / (1.0 + 2.0 * step)


def prox(kind, w, eta, factor, center=None, l1_ratio=0.5):
    """prox_{η·R}(w) for R = factor × (L1 | L2 | elastic net)."""
    if kind == "l1":
        return soft_threshold(w, eta * factor)
    if kind == "l2":
        return l2_prox(w, eta * factor, center)
    return l2_prox(soft_threshold(w, eta * factor * l1_ratio), eta * factor * (1 - l1_ratio))


def _unit_axes(g):
    return tuple(range(g.ndim - 1)) if g.ndim > 1 else None


def agc(g, w, clip_factor, eps):
    """Brock et al. (2021), unit-wise: norms over every axis but the last."""
    axes = _unit_axes(g)
    w_norm = np.sqrt(np.sum(w * w, axis=axes, keepdims=True))
    g_norm = np.sqrt(np.sum(g * g, axis=axes, keepdims=True))
    limit = clip_factor * np.maximum(w_norm, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(g_norm > limit, limit / g_norm, 1.0)
    return g * scale


def centralize(g):
    """Yong et al. (2020): subtract the mean over every axis but the last (rank ≥ 2)."""
    if g.ndim < 2:
        return g
    return g - g.mean(axis=_unit_axes(g), keepdims=True)


def noise_stddev(stddev, decay, t):
    """Neelakantan et al. (2015): σ_t = stddev·(1 + t)^(−decay/2)."""
    return stddev * (1.0 + t) ** (-decay / 2.0)
