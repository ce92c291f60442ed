"""A benchmark case: its name, its reference, its target and how to build it."""

import dataclasses

from bench import native


@dataclasses.dataclass
class Case:
    name: str
    reference: str
    target: str  # on ratio = ours / reference (time or memory)
    build: object  # build(small) -> dict(ours=, reference=, per=steps per call, bytes=)
    limit: float = None  # the ratio target, None when only reported
    memory_limit: float = None  # a peak-memory ratio target, if any
    # Roofline rows: the floating-point operations a call cannot avoid (its
    # time is also shown as a fraction of the backend's measured matmul
    # peak), and the bytes no implementation can do without (ours' peak
    # memory over them must stay ≤ floor_limit).
    flops: float = None
    memory_floor: float = None
    floor_limit: float = None
    # The backends that have the row (a native peer of one backend), None: all.
    backends: tuple = None


def gradient_sides(inputs, ours_fn, reference_fn, count=2):
    """A case's `build` whose two sides are the compiled value and gradients
    w.r.t. the last `count` of `inputs(small)` of `ours_fn` and
    `reference_fn`."""

    def build(small):
        args = inputs(small)
        ours, reference = native.value_and_grads(ours_fn, count), native.value_and_grads(reference_fn, count)
        return {"ours": lambda: native.block(ours(*args)), "reference": lambda: native.block(reference(*args))}

    return build
