"""Every private Keras API keras-penalties relies on, each behind a function
that says what it reads and since when.

Keras has no public way to ask these questions; each answer below is read
from Keras' own internals, checked on Keras 3.14 and 3.15. A Keras upgrade is
this one file to read.
"""


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
        raise ValueError(f"`{argument}`: {model.name} has {len(outputs)} outputs; a fused head needs a model with one (the logits).")
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
