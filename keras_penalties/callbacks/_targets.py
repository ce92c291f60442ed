"""Finding a model's composites (CompositeObjective layers, compiled
CompositeLoss), resolving a callback's `target` among them, making their
metrics part of the model and logging their weights."""

from typing import TypeAlias

import keras
import numpy as np

from keras_penalties import _keras_internals
from keras_penalties.composite.loss import CompositeLoss
from keras_penalties.composite.layer import CompositeObjective

# What `target` may be: a composite of the model, or its name there.
_Target: TypeAlias = CompositeObjective | CompositeLoss | str


def _layers(model):
    """Every layer inside `model`, depth first, each once."""
    seen, stack, found = set(), list(reversed(model.layers)), []
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        found.append(layer)
        stack.extend(reversed(getattr(layer, "layers", [])))
    return found


def _composite_losses(model):
    losses = getattr(model, "loss", None)
    return [loss for loss in keras.tree.flatten(losses) if isinstance(loss, CompositeLoss)]


def _add_to_model(model, metrics):
    """Makes `metrics` part of the model's metrics, and each CompositeLoss's
    variables part of the model; the next step is traced again if any was new."""
    added = False
    for metric in metrics:
        if not any(m is metric for m in model.metrics):
            _keras_internals.add_model_metric(model, metric)
            added = True
    for loss in _composite_losses(model):
        added = loss.attach(model) or added
    if added:
        # Steps traced before these existed neither update nor carry them:
        # trace again, once. They then stay, so later fits reuse the step.
        model.train_function = model.test_function = None


def _check_target(target):
    if isinstance(target, (CompositeObjective, CompositeLoss)):
        return target
    if isinstance(target, str) and target:
        return target
    raise TypeError(
        f"`target` must be a CompositeObjective, a CompositeLoss, or the name of one in the model; got {target!r}."
    )


def _find_target(model, target):
    """The model's CompositeObjective layer or compiled CompositeLoss that
    `target` is or names; a ValueError naming `target` otherwise."""
    candidates = [layer for layer in _layers(model) if isinstance(layer, CompositeObjective)]
    candidates += _composite_losses(model)
    for candidate in candidates:
        if candidate is target or candidate.name == target:
            return candidate
    shown = target if isinstance(target, str) else f"{type(target).__name__} {target.name!r}"
    raise ValueError(
        f"`target` {shown!r} is not a CompositeObjective layer or compiled CompositeLoss of the model; "
        f"it has {[c.name for c in candidates] or 'none'}."
    )


def _settable_target(model, target, method):
    """`_find_target`, refusing a target whose weights are learned: the
    adaptive `method` sets them."""
    found = _find_target(model, target)
    if found.weighting.learned:
        raise ValueError(
            f"`target` {found.name!r} has weighting={found.weighting!r}, which learns its "
            f"weights; {method} sets them: build it without `weighting`."
        )
    return found


def _log_weights(target, logs, weights=None):
    """`"<target>/<term>/weight"` into `logs`: the weights in use, or
    `weights` (in `terms` order, as the float32 variable holds them) where
    the caller has just set them all."""
    if logs is not None:
        if weights is None:
            in_use = target.weights_in_use()
        else:
            in_use = dict(zip(target.terms, np.asarray(weights, "float32").tolist()))
        logs.update({f"{target.name}/{term}/weight": w for term, w in in_use.items()})
