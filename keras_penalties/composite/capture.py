"""Lets PenaltyMonitor's probe read the per-term values that objectives and
composite losses compute during a forward pass, without changing their outputs."""

import contextlib
from typing import Any

_active: dict[int, list[Any]] = {}


@contextlib.contextmanager
def capturing(owners):
    """Within the block, each owner's `record(...)` calls are kept in a list;
    yields a dict id(owner) -> list."""
    captured = {id(owner): [] for owner in owners}
    _active.update(captured)
    try:
        yield captured
    finally:
        for key in captured:
            _active.pop(key, None)


def active(owner):
    """Whether a probe is capturing `owner`'s values now."""
    return id(owner) in _active


def record(owner, values):
    if id(owner) in _active:
        _active[id(owner)].append(values)
