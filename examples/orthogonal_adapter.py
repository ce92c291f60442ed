"""A LoRA-style low-rank adapter kept orthogonal by a regularizer.

A frozen "pretrained" Dense layer gets a trainable low-rank update
W + A·B (A: d×r down-projection, B: r×k up-projection), as in LoRA (Hu et al.,
2021). An `Orthogonality` regularizer on A keeps its r directions decorrelated
(soft mode) so the rank of the update does not collapse onto fewer
directions. The script adapts the layer to a shifted task and prints the
adapter's orthogonality penalty and the effective rank of A with and without
the regularizer.

    KERAS_BACKEND=tensorflow python examples/orthogonal_adapter.py
"""

import os

import keras
import numpy as np
from keras import ops

from keras_penalties import ops as P
from keras_penalties import regularizers as R

EPOCHS = int(os.environ.get("EXAMPLE_EPOCHS", 30))
D, K, RANK = 32, 16, 4


class LowRankAdapter(keras.layers.Layer):
    """y = frozen(x) + x·A·B, with A regularized."""

    def __init__(self, frozen, rank, a_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.frozen, self.rank, self.a_regularizer = frozen, rank, a_regularizer

    def build(self, input_shape):
        d, k = input_shape[-1], self.frozen.units
        self.a = self.add_weight(
            shape=(d, self.rank), initializer="glorot_normal", regularizer=self.a_regularizer, name="a"
        )
        self.b = self.add_weight(shape=(self.rank, k), initializer="zeros", name="b")

    def call(self, x):
        return self.frozen(x) + ops.matmul(ops.matmul(x, self.a), self.b)


def effective_rank(matrix):
    """exp of the entropy of the normalised singular values."""
    s = np.linalg.svd(matrix, compute_uv=False)
    p = s / s.sum()
    return float(np.exp(-(p * np.log(p + 1e-12)).sum()))


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, D)).astype("float32")
    pretrained = rng.normal(size=(D, K)) / np.sqrt(D)
    shift = rng.normal(size=(D, RANK)) @ rng.normal(size=(RANK, K)) / np.sqrt(D)
    y = (x @ (pretrained + shift)).astype("float32")
    for name, regularizer in (("no regularizer", None), ("Orthogonality(0.1)", R.Orthogonality(0.1))):
        keras.utils.set_random_seed(0)
        frozen = keras.layers.Dense(K, use_bias=False, trainable=False)
        frozen.build((None, D))
        frozen.kernel.assign(pretrained.astype("float32"))
        adapter = LowRankAdapter(frozen, RANK, a_regularizer=regularizer)
        model = keras.Sequential([keras.Input((D,)), adapter])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        history = model.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0)
        a = ops.convert_to_numpy(adapter.a)
        print(
            f"{name:<20} mse {history.history['loss'][-1]:.4f}  "
            f"orthogonality(A) {float(P.orthogonality(a)):.4f}  effective rank of A {effective_rank(a):.2f} / {RANK}"
        )


if __name__ == "__main__":
    main()
