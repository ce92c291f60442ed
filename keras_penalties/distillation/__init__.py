"""Distillation the Keras way, without Keras' traps.

`keras.distillation` (Keras >= 3.12), as of Keras 3.15.1:
- `LogitsDistillation()`'s default `loss="kl_divergence"` applies the
  probability KL to temperature-scaled logits, without T²;
- a single distillation loss (not a list) silently resets
  `distillation_loss_weights` to `[1.0]`;
- `Distiller.compute_loss` drops the student's own losses (regularizers,
  `add_loss`, a `CompositeObjective`), ignores `sample_weight`, passes the
  distillation losses no mask, and logs only their sum;
- under `tf.distribute` its distillation term is not divided by the number
  of replicas, as Keras' own losses are.

`LogitsDivergence` is a `keras.distillation.DistillationLoss` that is right
alone or in a list; `Distiller` is Keras' with those fixed, and, given the
student's vocabulary projection (`head=`), computes its losses from the
hidden states without forming the [tokens, vocab] logits.
"""

from keras_penalties.distillation.distiller import Distiller
from keras_penalties.distillation.logits_divergence import DIVERGENCES, LogitsDivergence

__all__ = ["Distiller", "LogitsDivergence", "DIVERGENCES"]
