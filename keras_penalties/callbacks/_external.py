"""`PenaltyMonitor`'s external scores: functions of the probe batch and the
model's output, each run in a daemon thread of its own and waited for up to a
timeout, their results (or NaN) logged under `"external/<name>"`."""

import math
import threading
import time
import warnings

import keras
import numpy as np
from keras import ops

from keras_penalties import _validation as check
from keras_penalties.composite.term import METRIC_NAME_PATTERN


def _check_external(external, timeout):
    """`external` (dict name → callable) and `external_timeout`, checked."""
    if external is None:
        external = {}
    if not isinstance(external, dict):
        raise TypeError(f"`external` must be a dict of name -> function, or None; got {external!r}.")
    for name, fn in external.items():
        if not isinstance(name, str) or not METRIC_NAME_PATTERN.match(name):
            raise ValueError(
                f"`external` names must be non-empty strings of letters, digits, '_', '.' or '-'; got {name!r}."
            )
        if not callable(fn):
            raise TypeError(f"`external[{name!r}]` must be a function f(x, y, y_pred); got {fn!r}.")
    return dict(external), check.positive("external_timeout", timeout)


class _Score:
    """One external score's call, in a daemon thread of its own: a call that
    hangs holds only its own thread (and does not hold up the interpreter's
    exit), so it never starves the other scores."""

    def __init__(self, fn, args):
        self.result, self.error, self.seconds = None, None, None
        self.start = time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self.result = fn(*args)
        except Exception as error:  # noqa: BLE001 -- reported by name, training goes on
            self.error = error
        self.seconds = time.perf_counter() - self.start


def _as_score(name, result):
    """A score's result as {log key: float}; a TypeError if it is neither a
    number nor a dict of numbers."""

    def number(key, value):
        value = np.asarray(value)
        if value.size != 1 or not np.issubdtype(value.dtype, np.number):
            raise TypeError(f"returned {result!r}, not a number or a dict of numbers")
        return float(value)

    if isinstance(result, dict):
        return {f"external/{name}/{key}": number(key, value) for key, value in result.items()}
    return {f"external/{name}": number(name, result)}


class _ExternalScores:
    """The external scores' calls across probes: a call that outlives its
    probe is kept, and not started again, until it ends."""

    def __init__(self) -> None:
        self._running: dict[str, _Score] = {}  # name -> its call, while one runs past its probe
        self._warned: set[str] = set()
        self._score_keys: dict[str, list[str]] = {}  # name -> the log keys its results gave

    def start(self, external, model, probe_data):
        """Starts every score of `external` on the probe batch and the model's
        output on it; returns name → call (None for one still running from an
        earlier probe, which is not started twice)."""
        if not external:
            return {}
        x, y = probe_data
        to_numpy = lambda t: keras.tree.map_structure(lambda a: np.asarray(ops.convert_to_numpy(a)), t)  # noqa: E731
        args = (to_numpy(x), None if y is None else to_numpy(y), to_numpy(model(x, training=False)))
        calls = {}
        for name, fn in external.items():
            running = self._running.get(name)
            calls[name] = None if running is not None and running.thread.is_alive() else _Score(fn, args)
        return calls

    def finish(self, calls, timeout):
        """Waits for the scores, each until `timeout` seconds after it
        started; returns their log entries (NaN for a failure)."""
        results = {}
        for name, call in calls.items():
            if call is None:
                error, seconds = "still running from an earlier probe", 0.0
            else:
                call.thread.join(max(0.0, call.start + timeout - time.perf_counter()))
                if call.thread.is_alive():
                    self._running[name] = call
                    error, seconds = f"timed out after {timeout} s", timeout
                else:
                    self._running.pop(name, None)
                    error, seconds = call.error, call.seconds
                    if error is None:
                        try:
                            scores = _as_score(name, call.result)
                        except TypeError as bad:
                            error = bad
                        else:
                            self._score_keys[name] = list(scores)
                            results.update(scores)
            if error is not None:
                results.update({key: math.nan for key in self._score_keys.get(name, [f"external/{name}"])})
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"PenaltyMonitor: external score {name!r} failed ({error}); it logs NaN "
                        "where it fails, and training goes on. (Warned once.)",
                        stacklevel=2,
                    )
            results[f"external/{name}/seconds"] = float(seconds)
        return results
