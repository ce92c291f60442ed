"""Adaptive weighting's cost (issue 45): a `fit` step of `bench.multitask`'s
model (one shared trunk, three task losses in a `CompositeLoss`) with
`weighting="famo"` against fixed equal weights, and with `GradNorm` probing
every batch against the same fit without it. Both sides of a row train the
same model from the same initial weights on the same batches."""

from bench import multitask
from bench.case import Case
from keras_penalties.callbacks import GradNorm


def _data(small):
    steps = 4 if small else 256
    (x, y), _ = multitask.problem(multitask.BATCH * steps)
    return x, y, steps


def _fit(model, x, y, callbacks=()):
    return lambda: model.fit(
        x, y, batch_size=multitask.BATCH, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks)
    )


def _famo(small):
    x, y, steps = _data(small)
    return {
        "ours": _fit(multitask.build(weighting="famo"), x, y),
        "reference": _fit(multitask.build(), x, y),
        "per": steps,
    }


def _gradnorm(small):
    x, y, steps = _data(small)
    probe = (x[: multitask.BATCH], y[: multitask.BATCH])
    gradnorm = GradNorm("tasks", "trunk_2", probe_data=probe, every_n_batches=1)
    return {
        "ours": _fit(multitask.build(), x, y, [gradnorm]),
        "reference": _fit(multitask.build(), x, y),
        "per": steps,
    }


WEIGHTING_CASES = [
    Case("multi-task fit step, weighting='famo'", "the same fit with fixed equal weights", "time ≤ 1.05", _famo, 1.05),
    Case(
        "multi-task fit step, GradNorm every_n_batches=1",
        "the same fit without GradNorm",
        "time ≤ 2.0",
        _gradnorm,
        2.0,
    ),
]
