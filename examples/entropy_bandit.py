"""An entropy-regularized policy on a toy multi-armed bandit.

A policy over 5 arms (its logits are the weights of one Dense layer fed a
constant input) maximises expected reward plus an entropy bonus τ·H(π), the
objective of soft RL. Without the bonus the policy collapses onto the best
arm; with it, the optimum has a closed form, π* = softmax(r / τ), which the
script compares with the policy it learned.

    KERAS_BACKEND=torch python examples/entropy_bandit.py
"""

import os

import keras
import numpy as np
from keras import ops

from keras_penalties import losses as L

EPOCHS = int(os.environ.get("EXAMPLE_EPOCHS", 300))
REWARDS = np.array([1.0, 0.8, 0.5, 0.2, 0.0], "float32")


class NegativeExpectedReward(keras.losses.Loss):
    """−Σₐ π(a) r(a), with π = softmax(logits) and r given as y_true."""

    def call(self, y_true, y_pred):
        return -ops.sum(ops.softmax(y_pred, axis=-1) * y_true, axis=-1)


def train(tau):
    keras.utils.set_random_seed(0)
    policy = keras.Sequential([keras.Input((1,)), keras.layers.Dense(len(REWARDS), use_bias=False)])
    policy.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=L.CompositeLoss(
            {"reward": NegativeExpectedReward(), "bonus": L.Entropy(from_logits=True, mode="bonus")},
            weights={"reward": 1.0, "bonus": tau},
        ),
    )
    ones, rewards = np.ones((32, 1), "float32"), np.tile(REWARDS, (32, 1))
    policy.fit(ones, rewards, batch_size=32, epochs=EPOCHS, verbose=0)
    return ops.convert_to_numpy(ops.softmax(policy(ones[:1])))[0]


def main():
    np.set_printoptions(precision=3, suppress=True)
    greedy = train(tau=0.0)
    print(f"no bonus:   π = {greedy}  H = {-(greedy * np.log(greedy + 1e-12)).sum():.3f}")
    for tau in (0.1, 0.3):
        learned = train(tau)
        optimum = np.exp(REWARDS / tau) / np.exp(REWARDS / tau).sum()
        print(f"τ = {tau}:    π = {learned}  softmax(r/τ) = {optimum}  max gap {np.abs(learned - optimum).max():.4f}")


if __name__ == "__main__":
    main()
