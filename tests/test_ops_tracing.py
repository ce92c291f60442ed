"""The tensor ops traced as Keras and TensorFlow trace them: in a
functional model with a token axis known or not (keras-hub backbones take
`(None,)` sequences), in a compiled `fit`, in a `tf.data` map, and keeping
the static shapes of their outputs. The numbers against NumPy (verl's
returns, TRL's selective log-softmax).
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_penalties import ops as P
from tests import off_policy_oracles as OP
from tests import rl_oracles as RL
from tests.testing import BACKEND

RNG = np.random.default_rng(651)
B, T, V, K = 4, 6, 9, 3
REWARDS = RNG.normal(size=(B, T)).astype("float32")
MASK = np.ones((B, T), "float32")
MASK[1, 4:] = 0.0  # right-padded: verl carries a hole's return undiscounted, ours discounts it
MASK[2, 3:] = 0.0
GAMMA = 0.9


class Returns(keras.layers.Layer):
    """Per-token returns of the rewards, as a layer of a functional model."""

    def call(self, rewards, mask):
        return P.discounted_cumsum(rewards, GAMMA, mask=mask)


class ReinforceLoss(keras.layers.Layer):
    """log π of each token from a trainable logit a token, and the REINFORCE
    loss of the returns through `add_loss` (the issue's model)."""

    def build(self, input_shape):
        self.logit = self.add_weight(shape=(), initializer="zeros", name="logit")

    def call(self, returns, mask):
        logprobs = ops.log_sigmoid(self.logit + ops.zeros_like(returns))
        self.add_loss(P.policy_loss(logprobs, None, ops.stop_gradient(returns), kind="reinforce", mask=mask))
        return returns


@pytest.mark.parametrize("tokens", [T, None], ids=["static_tokens", "unknown_tokens"])
def test_discounted_cumsum_in_a_functional_model_and_a_compiled_fit(tokens):
    rewards, mask = keras.Input((tokens,)), keras.Input((tokens,))
    returns = Returns()(rewards, mask)
    assert tuple(returns.shape) == (None, tokens)
    model = keras.Model([rewards, mask], ReinforceLoss()(returns, mask))
    model.compile(keras.optimizers.SGD(0.1))
    expected = OP.verl_discounted_returns(REWARDS, MASK, GAMMA)
    np.testing.assert_allclose(model.predict([REWARDS, MASK], verbose=0), expected, rtol=1e-5, atol=1e-6)
    history = model.fit([REWARDS, MASK], epochs=2, batch_size=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    if tokens is None:  # another length through the same model
        shorter = OP.verl_discounted_returns(REWARDS[:, :4], MASK[:, :4], GAMMA)
        got = model.predict([REWARDS[:, :4], MASK[:, :4]], verbose=0)
        np.testing.assert_allclose(got, shorter, rtol=1e-5, atol=1e-6)


def test_discounted_cumsum_in_a_tf_data_map():
    import tensorflow as tf

    if BACKEND == "tensorflow":

        def returns(rewards, mask):
            return P.discounted_cumsum(rewards, GAMMA, mask=mask)

    else:
        # On JAX and torch, Keras' ops are that backend's: a tf.data map runs
        # them through tf.numpy_function, on NumPy arrays.
        def returns(rewards, mask):
            def on_arrays(r, m):
                return ops.convert_to_numpy(P.discounted_cumsum(r, GAMMA, mask=m)).astype("float32")

            out = tf.numpy_function(on_arrays, [rewards, mask], tf.float32)
            out.set_shape(rewards.shape)
            return out

    # Batches padded to their longest sequence: the token axis is unknown while tracing.
    lengths = [6, 4, 5, 6]
    rows = tf.data.Dataset.from_generator(
        lambda: ((REWARDS[i, :n], MASK[i, :n]) for i, n in enumerate(lengths)),
        output_signature=(tf.TensorSpec((None,), tf.float32), tf.TensorSpec((None,), tf.float32)),
    )
    batches = rows.padded_batch(2).map(returns)
    assert batches.element_spec.shape.as_list() == [None, None]
    got = [b.numpy() for b in batches]
    for i, n in enumerate(lengths):
        expected = OP.verl_discounted_returns(REWARDS[i : i + 1, :n], MASK[i : i + 1, :n], GAMMA)[0]
        np.testing.assert_allclose(got[i // 2][i % 2, :n], expected, rtol=1e-5, atol=1e-6)


class _Outputs(keras.layers.Layer):
    """The ops of `_static_shapes` inside a layer, as a model would call them."""

    def call(self, logits, labels, topk, logprobs, old, advantages):
        return {
            "token_logprobs": P.token_logprobs(labels, logits),
            "token_logprobs_topk": P.token_logprobs(topk, logits, return_entropy=True)[0],
            "importance_weights": P.importance_weights(logprobs, old, level="sequence")[0],
            "off_policy_mask": ops.cast(P.off_policy_mask(logprobs, old, advantages, threshold=0.1), "float32"),
            "discounted_cumsum": P.discounted_cumsum(logprobs, GAMMA),
        }


def test_tensor_ops_keep_their_static_shapes_when_traced():
    inputs = [
        keras.Input((T, V), batch_size=B),
        keras.Input((T,), B, "int32"),
        keras.Input((T, K), B, "int32"),
        keras.Input((T,), batch_size=B),
        keras.Input((T,), batch_size=B),
        keras.Input((), batch_size=B),
    ]
    outputs = _Outputs()(*inputs)
    expected = {"token_logprobs": (B, T), "token_logprobs_topk": (B, T, K)}
    expected.update({name: (B, T) for name in ("importance_weights", "off_policy_mask", "discounted_cumsum")})
    for name, shape in expected.items():
        assert tuple(outputs[name].shape) == shape, (name, outputs[name].shape)
    if BACKEND == "tensorflow":  # and inside tf.function, the graph's own shapes
        import tensorflow as tf

        signature = [tf.TensorSpec(x.shape, x.dtype) for x in inputs]
        traced = tf.function(_Outputs().call, input_signature=signature).get_concrete_function()
        for name, shape in expected.items():
            assert tuple(traced.structured_outputs[name].shape) == shape, (name, traced.structured_outputs[name].shape)


def test_token_logprobs_in_a_compiled_step_equal_trls():
    logits = RNG.normal(size=(B, T, V)).astype("float32")
    labels = RNG.integers(0, V, size=(B, T))
    model = keras.Sequential([keras.layers.Identity()])
    model.compile(loss=lambda y, z: ops.sum(P.token_logprobs(ops.cast(y, "int32"), z)))
    expected = RL.trl_selective_log_softmax(logits, labels).sum()
    got = model.evaluate(logits, labels, batch_size=B, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
