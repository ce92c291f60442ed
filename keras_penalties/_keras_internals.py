"""Every private Keras (and TensorFlow) API keras-penalties relies on, each
behind a function that says what it reads and since when.

Keras has no public way to ask these questions; each answer below is read
from Keras' own internals. "Keras 3.0 on" was read in the wheels of 3.0.5,
3.3.3, 3.5.0, 3.7.0, 3.9.2, 3.11.3 and 3.13.2; the package's tests run on
3.14.1 and 3.15.1 (`make test`). A Keras upgrade is this one file to read.
Nothing else in the package imports `keras.src` or a private TF module, or
touches a `_`-attribute of a Keras object.
"""

import contextlib
import sys

import keras


def head_call(model, head, argument):
    """The call of layer `head` that produces `model`'s (single) output, in a
    functional or Sequential model: `(input_tensor, call_kwargs)`, the
    symbolic tensor it was called on (e.g. the hidden states a vocabulary
    projection reads) and its keyword arguments (`reverse=True` for a tied
    embedding read backwards).

    Relies on: `KerasTensor._keras_history` (the operation and node index
    that made a symbolic tensor) and `Operation._inbound_nodes[i]`, a
    `keras.src.ops.node.Node` with `input_tensors` and `arguments.kwargs`:
    the graph Keras' own `Functional` walks (Keras 3.0 on).

    Raises ValueError (naming `argument`) when `model` has no symbolic
    output, several outputs, or an output that `head` does not produce.
    """
    outputs = getattr(model, "outputs", None)
    if not outputs:
        raise ValueError(
            f"`{argument}`: {model.name} has no symbolic graph (a subclassed model?); a functional or "
            "Sequential model is needed to compute the hidden states that feed its head."
        )
    if len(outputs) != 1:
        raise ValueError(
            f"`{argument}`: {model.name} has {len(outputs)} outputs; a fused head needs a model with one (the logits)."
        )
    history = getattr(outputs[0], "_keras_history", None)
    if history is None or history.operation is not head:
        producer = getattr(getattr(history, "operation", None), "name", None)
        raise ValueError(
            f"`{argument}`: layer {head.name!r} does not produce {model.name}'s output (the layer that does "
            f"is {producer!r}); pass the layer that projects the hidden states onto the vocabulary."
        )
    node = head._inbound_nodes[history.node_index]
    return node.input_tensors[0], dict(node.arguments.kwargs)


def is_compiled_metrics(metric):
    """Whether `metric` (an entry of `model.metrics`) is the container of the
    metrics given to `compile(metrics=...)`, not a metric of its own.

    Relies on: Keras naming that container (`keras.src.trainers.
    compile_utils.CompileMetrics`) "compile_metrics" (Keras 3.0 on).
    """
    return metric.name == "compile_metrics"


# --- Layers, calls and the forward pass --------------------------------------


def stateless_scope():
    """The `keras.StatelessScope` the code runs in (JAX's `fit` step runs the
    model in one), or None.

    Relies on: `keras.src.backend.common.stateless_scope.get_stateless_scope`
    (Keras 3.0 on); Keras exports the scope class but not this question.
    """
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def in_stateless_scope():
    """Whether the code runs inside a `keras.StatelessScope`.

    Relies on: `keras.src.backend.common.stateless_scope.in_stateless_scope`
    (Keras 3.0 on).
    """
    from keras.src.backend.common.stateless_scope import in_stateless_scope as in_scope

    return in_scope()


def current_call_context():
    """The context of the outermost layer call in progress (one object per
    forward pass of a model), or None outside any call.

    Relies on: Keras' global attribute `"current_call_ctx"`, which
    `Layer.__call__` sets on entering the outermost call and clears on
    leaving it (`keras.src.backend.common.global_state`, Keras 3.0 on).
    """
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("current_call_ctx")


def loss_values_and_mask(loss, y_true, y_pred):
    """What `keras.losses.Loss.__call__` of `loss` reduces: `loss.call` on
    `y_true` and `y_pred` converted to the loss's dtype, and the mask it
    reduces them with (the Keras mask of `y_pred`, that of the values, or
    both ANDed; None for neither). For a Loss whose `__call__` is Keras' own.

    Relies on: `Loss.__call__`'s steps and `get_keras_mask` (Keras 3.0 on;
    read in 3.14 and 3.15).
    """
    from keras.src.backend.common.masking import get_keras_mask

    in_mask = get_keras_mask(y_pred)
    with keras.name_scope(loss.name):
        y_pred = keras.tree.map_structure(lambda x: keras.ops.convert_to_tensor(x, dtype=loss.dtype), y_pred)
        y_true = keras.tree.map_structure(lambda x: keras.ops.convert_to_tensor(x, dtype=loss.dtype), y_true)
        values = loss.call(y_true, y_pred)
    out_mask = get_keras_mask(values)
    if in_mask is not None and out_mask is not None:
        return values, in_mask & out_mask
    return values, in_mask if in_mask is not None else out_mask


def reduce_loss_values(values, sample_weight, mask, reduction, dtype):
    """Keras' reduction of a Loss's values with `sample_weight` and `mask`,
    as `Loss.__call__` ends (the division by the replicas included).

    Relies on: `keras.src.losses.loss.reduce_weighted_values` (Keras 3.0
    on; read in 3.14 and 3.15).
    """
    from keras.src.losses.loss import reduce_weighted_values

    return reduce_weighted_values(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)


def loss_sample_weight(sample_weight, mask, reduction):
    """The weights Keras' Loss multiplies values by, and with
    "mean_with_sample_weight" sums for its divisor: `sample_weight` merged
    with `mask` (float32).

    Relies on: `keras.src.losses.loss.apply_mask` (Keras 3.0 on; read in
    3.14 and 3.15).
    """
    from keras.src.losses.loss import apply_mask

    if sample_weight is not None:
        sample_weight = keras.ops.convert_to_tensor(sample_weight, dtype="float32")
    return apply_mask(sample_weight, mask, dtype="float32", reduction=reduction)


def keras_mask(x):
    """The Keras mask `x` carries (set by `Embedding(mask_zero=True)`,
    `Masking`, …), or None; what `keras.losses.Loss.__call__` reads of its
    `y_pred`.

    Relies on: `keras.src.backend.common.masking.get_keras_mask`, the
    `_keras_mask` tensor attribute (Keras 3.14 on, the package's range).
    """
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(x)


def torch_device():
    """The device Keras' torch backend puts tensors on (what its
    `convert_to_tensor` compares a tensor's device with); torch only.

    Relies on: `keras.src.backend.torch.core.get_device` (Keras 3.0 on),
    the `torch_device` global attribute a `keras.device` scope sets, else
    the backend's default device.
    """
    from keras.src.backend.torch.core import get_device

    return get_device()


def own_losses(layer):
    """The losses `layer` itself added (`add_loss`, its activity
    regularizer) in its latest call, without its sublayers'.

    Relies on: `Layer._get_own_losses()` (Keras 3.0 on), what `Layer.losses`
    adds its sublayers' losses to.
    """
    return layer._get_own_losses()


# --- Models -------------------------------------------------------------------


def added_losses(model):
    """The losses `model` and its sublayers added in the latest call
    (`add_loss`, activity regularizers), not its weight regularizers'.

    Relies on: `Layer._flatten_layers()` and `Layer._get_own_losses()`
    (Keras 3.0 on).
    """
    return [loss for layer in model._flatten_layers(include_self=True) for loss in layer._get_own_losses()]


@contextlib.contextmanager
def added_losses_kept(layer):
    """Within the block, whatever other threads do, `layer`'s and its
    sublayers' lists of added losses are, at its end, what they were at its
    start (`layer` None: nothing is kept).

    `tf.distribute.MirroredStrategy` runs (and traces) each replica's step
    in a thread of its own, one at a time, switching at every cross-replica
    sum; Keras keeps one list of `add_loss` losses per layer for all of
    them, and a replica's forward pass clears and refills it. A sum inside
    one replica's forward pass would let the next replica's pass replace
    its losses: the block around the sum restores them.

    Relies on: `Layer._flatten_layers()`, and each layer's `_losses` list and
    `_loss_ids` set, which `add_loss` fills and `_clear_losses` empties
    (Keras 3.0 on; `_loss_ids` read in 3.14.1 and 3.15.1, and kept only
    where it exists).
    """
    if layer is None:
        yield
        return
    saved = [
        (each, list(each._losses), set(getattr(each, "_loss_ids", ())))
        for each in layer._flatten_layers(include_self=True)
    ]
    try:
        yield
    finally:
        for each, losses, ids in saved:
            each._losses[:] = losses
            if hasattr(each, "_loss_ids"):
                each._loss_ids.clear()
                each._loss_ids.update(ids)


def calling_layer():
    """The layer whose call is outermost now (the model a forward pass runs),
    or None outside any call.

    Relies on: the call context's `entry_layer` (Keras 3.0 on), see
    `current_call_context`.
    """
    context = current_call_context()
    return None if context is None else getattr(context, "entry_layer", None)


def add_model_metric(model, metric):
    """Makes `metric` one of `model.metrics` after the model was built (its
    tracking is locked then), so that `fit`'s logs and JAX's metrics state
    carry it.

    Relies on: `Model.metrics` reading the model's own list `_metrics`
    (Keras 3.0 on).
    """
    model._metrics.append(metric)


def compiled_loss(model):
    """The loss `model.compile(loss=...)` built (called as
    `loss(y_true, y_pred)`, summing every output's loss with its
    `loss_weights`), or None if the model has none.

    Relies on: `Trainer._compile_loss`, a `CompileLoss` (Keras 3.0 on).
    """
    return getattr(model, "_compile_loss", None)


def add_sublayer(model, layer):
    """Adds `layer` (a layer holding variables only, never called) to
    `model`'s layers after the model was built, so that `model.weights`,
    its training state and `.keras` files hold its variables.

    Relies on: a model's layer list `_layers`, from which `Model.weights`
    and the trainers' state collect variables; a Sequential's list is its
    forward pass and its config, so the layer goes to the Sequential's
    `InputLayer` (Keras 3.0 on).
    """
    host = model
    layers = model._layers
    if isinstance(model, keras.Sequential) and layers and isinstance(layers[0], keras.layers.InputLayer):
        host = layers[0]
    host._layers.append(layer)


def _model_among_callers(holds):
    """The model among the frames above the public function calling this
    one (`self` of a Keras Model method) for which `holds(model,
    function_name)` is true, or None: the one frame walk of the package.

    Relies on: CPython's `sys._getframe`, and Keras calling what the
    functions below name from methods of its model within 64 frames
    (Keras 3.0 on).
    """
    frame = sys._getframe(3)
    for _ in range(64):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, keras.Model) and holds(candidate, frame.f_code.co_name):
            return candidate
        frame = frame.f_back
    return None


def model_computing(loss):
    """The model whose compiled loss `loss` is, computing it now, or None.

    Why a frame walk: Keras hands a loss no model, and calls a compiled loss
    from its model's `Trainer.compute_loss` only, outside the model's call
    (no call context), so the model is the `self` of a calling frame.
    """
    return _model_among_callers(
        lambda model, _: any(item is loss for item in keras.tree.flatten(getattr(model, "loss", None)))
    )


def model_training():
    """The model with an optimizer whose method (`fit`'s step, a user's
    `compute_loss`) is running now, or None: the model training a layer.

    Why a frame walk: Keras hands a layer no model, and JAX's trainer runs
    the model's `call` inside `stateless_call` without entering the
    model's call context, so the outermost layer of the call
    (`calling_layer`) is not the model there.
    """
    return _model_among_callers(lambda model, _: getattr(model, "optimizer", None) is not None)


def model_compiling_from_file():
    """The model whose compile config a `.keras` file is being loaded into
    (the loss being made now belongs to it), or None.

    Why a frame walk: `Model.compile_from_config` deserializes the loss and
    builds the optimizer right after compiling, with no hook between, and
    the loss's variables must be the model's by then.
    """
    return _model_among_callers(lambda model, function: function == "compile_from_config")


def in_train_step():
    """Whether a model's `train_step` is among the calling frames: a loss
    computed there is a training step's (`evaluate` computes it in
    `test_step`).

    Why a frame walk: Keras tells a loss nothing of training, and FAMO's
    state must advance at training steps only. Keras' trainers compute the
    loss from `Trainer.train_step` (or a model's override of that name),
    traced once (JAX, TF) or run each step (torch) in Python.
    """
    return _model_among_callers(lambda model, function: function == "train_step") is not None


# --- Optimizers ---------------------------------------------------------------


def exclude_from_weight_decay(optimizer, variables):
    """Makes `optimizer` (and every optimizer it wraps, through
    `inner_optimizer`) apply no weight decay to `variables`, also after it
    was built, keeping what the user excluded.

    Relies on: `BaseOptimizer._use_weight_decay` consulting the set of
    variable keys `_exclude_from_weight_decay` (filled by the public
    `exclude_from_weight_decay`, which refuses a built optimizer and
    replaces the set) and memoising its answer per key in
    `_exclude_from_weight_decay_cache`; keys from `_var_key` (Keras 3.0 on).
    Weight decay is decided when a step is traced (JAX, TF) or run (torch),
    so this takes effect from the next trace or step.
    """
    while optimizer is not None:
        keys = {optimizer._var_key(v) for v in variables}
        excluded = set(getattr(optimizer, "_exclude_from_weight_decay", None) or ())
        if not keys <= excluded:
            optimizer._exclude_from_weight_decay = excluded | keys
            cache = getattr(optimizer, "_exclude_from_weight_decay_cache", None)
            if cache is not None:
                cache.update(dict.fromkeys(keys, False))
        optimizer = getattr(optimizer, "inner_optimizer", None)


def optimizer_own_variables(optimizer):
    """The variables `optimizer` itself created (its iteration count, learning
    rate and slots), not those of an optimizer it wraps.

    Relies on: `BaseOptimizer._variables` (Keras 3.0 on), what its
    `variables` property returns.
    """
    return optimizer._variables


def optimizer_trainable_variables(optimizer):
    """The variables a built `optimizer` was built for.

    Relies on: `BaseOptimizer._trainable_variables` (Keras 3.0 on).
    """
    return optimizer._trainable_variables


def track_optimizer_variable(optimizer, variable):
    """Makes `variable` part of `optimizer.variables` (saved with it, carried
    in JAX's optimizer state).

    Relies on: `BaseOptimizer._track_variable` (Keras 3.0 on).
    """
    optimizer._track_variable(variable)


# --- TensorFlow ---------------------------------------------------------------


def tf_graph_in_xla(graph):
    """Whether TensorFlow `graph` will be compiled by XLA (`jit_compile`); True
    when TF lacks the helper (the XLA-safe path works everywhere).

    Relies on: `tensorflow.python.ops.control_flow_util.
    GraphOrParentsInXlaContext` (TF 2.x; checked on 2.21).
    """
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a TF without the helper
        return True
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def tf_records_backprop(tensors):
    """Whether a TensorFlow gradient tape records any of `tensors` (someone
    may ask for a gradient through them); True when TF lacks the helper.

    Relies on: `tensorflow.python.eager.record.should_record_backprop`, what
    TF's own `custom_gradient` asks (TF 2.x; checked on 2.21).
    """
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - a TF without the helper
        return True
    return record.should_record_backprop(tensors)


# --- Nested layers ------------------------------------------------------------


def nested_layers(layer):
    """Every layer nested in `layer` (not itself), depth first in the order
    each layer tracks its sublayers (a backbone's embedding, then its
    layer 0 and everything inside it, then layer 1, …), each once.

    Keras has no public traversal of nested layers. Relies on: each layer's
    `_layers` list, the sublayers it tracks in assignment order (Keras 3.0
    on; `_flatten_layers` walks it too, reversing siblings).
    """
    found, seen = [], {id(layer)}
    stack = list(reversed(layer._layers))
    while stack:
        each = stack.pop()
        if id(each) in seen:
            continue
        seen.add(id(each))
        found.append(each)
        stack.extend(reversed(each._layers))
    return found
