"""
# CompositeObjective in custom training loops, and on tensors from elsewhere

`fit` is not the only way to train. `CompositeObjective.compute(inputs)`
returns `(total, values)` as plain tensors, so an objective drops into a
hand-written loop on any backend; `report(...)` returns a JSON-ready
breakdown of the objective, with gradient norms, for logging or for a
training service. This guide shows

1. a training loop written natively for the current backend (JAX,
   TensorFlow or PyTorch; each branch below is what a user of that backend
   would write), with the objective's terms added to the task loss;
2. the remote-trainer view: per-token log-probabilities received from
   elsewhere (say, an RL fine-tuning service), regularized by a KL to a
   reference policy and an entropy bonus, reported as JSON with each term's
   contribution and gradient norm.

    KERAS_BACKEND=torch python guides/custom_training_loops.py
"""

import json
import os

import keras
import numpy as np
from keras import ops

from keras_penalties import CompositeObjective, Term
from keras_penalties import losses as L

STEPS = int(os.environ.get("GUIDE_ROUNDS", 200))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = keras.utils.to_categorical((x[:, 0] + x[:, 1] > 0).astype(int), 2)

"""
## 1. A native loop per backend

The objective acts on the logits: a confidence penalty (entropy bonus) and a
small L2 pull on the logits. `compute` is pure: it adds no loss anywhere and
changes no state.
"""

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
objective = CompositeObjective(
    {"bonus": Term(L.Entropy(from_logits=True, mode="bonus"), 0.05), "logit_l2": Term("l2", 1e-3)}, name="objective"
)
task = keras.losses.CategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(1e-2)
optimizer.build(model.trainable_variables)
batch = 64
backend = keras.backend.backend()

if backend == "jax":
    import jax

    def loss_fn(trainable, non_trainable, xb, yb):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, xb, training=True)
        penalty, _ = objective.compute(logits)
        return task(yb, logits) + penalty, non_trainable

    @jax.jit
    def train_step(state, xb, yb):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable, xb, yb)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    for step in range(STEPS):
        i = (step * batch) % len(x)
        loss, state = train_step(state, x[i:i + batch], y[i:i + batch])
    for variable, value in zip(model.trainable_variables, state[0]):
        variable.assign(value)

elif backend == "tensorflow":
    import tensorflow as tf

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            penalty, _ = objective.compute(logits)
            loss = task(yb, logits) + penalty
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    for step in range(STEPS):
        i = (step * batch) % len(x)
        loss = train_step(x[i:i + batch], y[i:i + batch])

else:  # torch
    for step in range(STEPS):
        i = (step * batch) % len(x)
        logits = model(x[i:i + batch], training=True)
        penalty, _ = objective.compute(logits)
        loss = task(y[i:i + batch], logits) + penalty
        model.zero_grad()
        loss.backward()
        optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)

logits = model(x)
print(f"{backend}: final loss {float(ops.convert_to_numpy(loss)):.4f}")

"""
`report` breaks the objective down on any batch: each term's value, weight,
contribution = weight × value and, with `grad_norms=True`, gradient norms
with respect to the tensors it was given (here the logits). A callable
`base_loss` counts in those norms too.
"""

report = objective.report(logits, base_loss=lambda t: task(y, t), grad_norms=True)
print(json.dumps(report, indent=1)[:400], "...")

"""
## 2. The remote-trainer view: regularizing logprobs from elsewhere

A training service hands over per-token log-probabilities of a policy and of
a frozen reference model, [batch, tokens, vocab]. Log-probabilities are valid
logits, so they go in with `from_logits=True`. The objective adds a KL to the
reference and an entropy bonus; `report` returns what the service logs each
step: loss_total, regularizer_total, and per term its contribution and
gradient norm with respect to the logprobs.
"""

vocab, tokens = 50, 6
policy = rng.normal(size=(4, tokens, vocab)).astype("float32")
reference = policy + 0.3 * rng.normal(size=policy.shape).astype("float32")
policy_logprobs = policy - np.log(np.exp(policy).sum(-1, keepdims=True))
reference_logprobs = reference - np.log(np.exp(reference).sum(-1, keepdims=True))

regularizer = CompositeObjective(
    {
        "kl_to_reference": Term("kl_divergence", 0.1, inputs=("policy", "reference"), options={"from_logits": True}),
        "entropy_bonus": Term(L.Entropy(from_logits=True, mode="bonus"), 0.01, inputs="policy"),
    },
    name="rl_regularizer",
)
advantages = rng.normal(size=(4, tokens)).astype("float32")
chosen = rng.integers(0, vocab, size=(4, tokens))


def policy_gradient_loss(inputs):
    """−E[A · log π(a)], the task loss the service computes."""
    picked = ops.take_along_axis(inputs["policy"], ops.convert_to_tensor(chosen[..., None]), axis=-1)[..., 0]
    return -ops.mean(ops.convert_to_tensor(advantages) * picked)


report = regularizer.report(
    {"policy": policy_logprobs, "reference": reference_logprobs}, base_loss=policy_gradient_loss, grad_norms=True
)
print(json.dumps(report, indent=1))
