"""A benchmark case: its name, its reference, its target and how to build it."""

import dataclasses


@dataclasses.dataclass
class Case:
    name: str
    reference: str
    target: str  # on ratio = ours / reference (time or memory)
    build: object  # build(small) -> dict(ours=, reference=, per=steps per call, bytes=)
    limit: float = None  # the ratio target, None when only reported
    memory_limit: float = None  # a peak-memory ratio target, if any
