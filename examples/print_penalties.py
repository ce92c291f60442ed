"""Prints every penalty in keras_penalties.ops on one example batch (`linear`
appears as the logits of a cross-entropy).

Run on any backend:  KERAS_BACKEND=torch python examples/print_penalties.py
"""

import keras
import numpy as np

from keras_penalties import ops as P


def main():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 5)).astype("float32")
    teacher = rng.normal(size=(4, 5)).astype("float32")
    weights = rng.normal(size=(6, 3)).astype("float32")
    labels = rng.integers(0, 5, size=(4,))
    hidden = rng.normal(size=(4, 3)).astype("float32")
    head = rng.normal(size=(3, 5)).astype("float32")  # a vocabulary projection [H, V]
    activations = keras.ops.convert_to_numpy(keras.ops.sigmoid(logits))
    # Each sampled label's log-probability under the policy (logits) and a reference (teacher).
    logprobs, ref_logprobs = P.token_logprobs(labels, logits), P.token_logprobs(labels, teacher)
    advantages = rng.normal(size=(4,)).astype("float32")
    top_ids = np.argsort(-teacher, axis=-1)[..., :2]
    values = {
        "l1(logits)": P.l1(logits),
        "l2(logits)": P.l2(logits),
        "l2(logits, center='mean', clip=1)": P.l2(logits, center="mean", clip=1.0),
        "elastic_net(logits, l1_ratio=0.5)": P.elastic_net(logits),
        "kl_divergence(teacher, logits)": P.kl_divergence(teacher, logits, from_logits=True),
        "kl_divergence(..., reverse, T=2)": P.kl_divergence(
            teacher, logits, from_logits=True, direction="reverse", temperature=2.0
        ),
        "kl_divergence(..., symmetric)": P.kl_divergence(teacher, logits, from_logits=True, direction="symmetric"),
        "js_divergence(teacher, logits)": P.js_divergence(teacher, logits, from_logits=True),
        "entropy(logits)": P.entropy(logits, from_logits=True),
        "entropy(logits, normalize)": P.entropy(logits, from_logits=True, normalize=True),
        "consistency(teacher, logits, mse)": P.consistency(teacher, logits, from_logits=True),
        "consistency(teacher, logits, cosine)": P.consistency(teacher, logits, metric="cosine"),
        "consistency(teacher, logits, js)": P.consistency(teacher, logits, metric="js", from_logits=True),
        "orthogonality(weights, soft)": P.orthogonality(weights),
        "orthogonality(weights, spectral)": P.orthogonality(weights, mode="spectral"),
        "output_magnitude(logits)": P.output_magnitude(logits),
        "kl_sparsity(sigmoid(logits), 0.05)": P.kl_sparsity(activations),
        "gaussian_kl(logits, teacher)": P.gaussian_kl(logits, teacher),
        "cross_entropy(labels, logits)": P.cross_entropy(labels, logits),
        "kl_estimate(logprobs, ref_logprobs, k3)": P.kl_estimate(logprobs, ref_logprobs),
        "policy_loss(logprobs, ref_logprobs, advantages, ppo)": P.policy_loss(logprobs, ref_logprobs, advantages),
        # Pairs: the chosen completion's log-probabilities the labels', the rejected one's the teacher's.
        "preference_loss(chosen, rejected, DPO, reference free)": P.preference_loss(logprobs, ref_logprobs),
        "preference_reward(chosen, rejected, margin)": P.preference_reward(logprobs, ref_logprobs),
        # One completion each, desirable or not (KTO), the baseline given.
        "unpaired_preference_loss(logprobs, ref, desirable, KTO)": P.unpaired_preference_loss(
            logprobs, ref_logprobs, advantages > 0, kl_baseline=0.1
        ),
        # A teacher's top-2 ids a position, both models' log-probabilities of them, and the rest of the vocabulary.
        "topk_kl(teacher top-2, student, tail)": P.topk_kl(
            P.token_logprobs(top_ids, teacher), P.token_logprobs(top_ids, logits)
        ),
        # The logits as one mixture-of-experts router's (5 experts, each row a token), top 2.
        "router_load_balancing(logits, top_k=2)": P.router_load_balancing(logits, top_k=2),
        "router_z_loss(logits)": P.router_z_loss(logits),
        "cross_entropy(labels, logits, z_loss=1e-4)": P.cross_entropy(labels, logits, z_loss=1e-4),
        # Logits never formed: hidden states and the head, two rows per chunk.
        "cross_entropy(labels, linear(hidden, head), chunks)": P.cross_entropy(
            labels, P.linear(hidden, head), chunk_size=2
        ),
    }
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    width = max(map(len, values))
    for name, value in values.items():
        print(f"  {name:<{width}}  {float(value):10.6f}")


if __name__ == "__main__":
    main()
