"""Charts of the benchmark results for the performance page, drawn by
`python -m bench.summary --page` (so `make bench` redraws them).

`ratios(reports, cases, path)`: every row's time ratio (ours / reference) on
each backend against its target, one panel a backend, on a log scale;
memory ratios beside them where a row has a memory target. Green: met, red:
missed, grey: reported only.
"""

import math

TARGET = {"met": "#2e7d32", "missed": "#c62828", None: "#9e9e9e"}


def _short(name, limit=58):
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _measured(report):
    return {row["case"]: row for row in report["cases"] if "error" not in row}


def ratios(reports, cases, path):
    """Draws the ratio chart of `reports` (backend → report) into `path`;
    returns the names of the rows drawn, top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {backend: _measured(report) for backend, report in reports.items()}
    shown = [case for case in cases if any(case.name in rows for rows in measured.values())]
    figure, axes = plt.subplots(
        1, len(reports), figsize=(4.2 * len(reports) + 4.8, 0.24 * len(shown) + 1.4), sharey=True, squeeze=False
    )
    for axis, (backend, rows) in zip(axes[0], measured.items()):
        values = []
        for i, case in enumerate(shown):
            row = rows.get(case.name)
            if row is None:
                continue
            met = row["met"]
            colour = TARGET[None if met is None else "met" if met else "missed"]
            axis.plot([row["time_ratio"]], [i], "o", color=colour, markersize=4.5)
            values.append(row["time_ratio"])
            if case.limit is not None:
                axis.plot([case.limit], [i], "|", color="black", markersize=8)
            if case.memory_limit is not None and row["memory_ratio"]:
                axis.plot([row["memory_ratio"]], [i], "s", color=colour, markersize=4, fillstyle="none")
                axis.plot([case.memory_limit], [i], "|", color="#6d4c41", markersize=8)
                values.append(row["memory_ratio"])
        axis.axvline(1.0, color="#bdbdbd", linewidth=0.8, zorder=0)
        axis.set_xscale("log")
        low, high = min(values + [1.0]), max(values + [1.0])
        axis.set_xlim(10 ** math.floor(math.log10(max(low, 1e-3))), 10 ** math.ceil(math.log10(high)))
        axis.set_title(backend)
        axis.set_xlabel("ours / reference: ● time, □ memory, | target")
        axis.grid(axis="x", color="#eeeeee")
    axes[0][0].set_yticks(range(len(shown)), [_short(case.name) for case in shown], fontsize=7)
    axes[0][0].set_ylim(len(shown) - 0.5, -0.5)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [case.name for case in shown]
