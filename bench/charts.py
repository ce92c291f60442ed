"""Charts of the benchmark results for the performance page, drawn by
`python -m bench.summary --page` (so `make bench` redraws them).

`ratios(reports, cases, path)`: every row's time ratio (ours / reference) on
each backend against its target, one panel a backend, on a log scale;
memory ratios beside them where a row has a memory target. Green: met, red:
missed, grey: reported only.

`roofline(reports, cases, path)`: the roofline rows as a fraction of the
backend's measured matmul peak, and their memory against its floor.
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


def roofline(reports, cases, path):
    """Draws the roofline rows of `reports` into `path`: for each backend
    and row, the fused head's and its unavoidable products' rate as a
    fraction of the backend's measured matmul peak (left), and the fused
    head's peak memory over its floor (right, with the target). Returns
    the names of the rows drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roofline_cases = [case for case in cases if case.flops]
    measured = {backend: _measured(report) for backend, report in reports.items()}
    shown = [
        case
        for case in roofline_cases
        if any("peak_flop_per_s" in rows.get(case.name, {}) for rows in measured.values())
    ]
    figure, (rate, memory) = plt.subplots(1, 2, figsize=(12, 0.9 * len(shown) * len(reports) + 1.8))
    labels, y = [], 0
    for backend, rows in measured.items():
        for case in shown:
            row = rows.get(case.name)
            if row is None or "peak_flop_per_s" not in row:
                continue
            what = case.name.split(": ", 1)[1].split(" value+grad")[0]
            labels.append(f"{backend}: {what}\n(peak {row['peak_flop_per_s'] / 1e9:.0f} GFLOP/s)")
            ours, products = row["ours"]["fraction_of_peak"], row["reference"]["fraction_of_peak"]
            colour = TARGET["met" if row["time_ratio"] <= case.limit else "missed"]
            rate.barh(y - 0.2, ours, height=0.38, color=colour)
            rate.barh(y + 0.2, products, height=0.38, color="#90a4ae")
            rate.text(ours + 0.01, y - 0.2, f"{ours:.0%}", va="center", fontsize=7)
            rate.text(products + 0.01, y + 0.2, f"{products:.0%} products alone", va="center", fontsize=7)
            if "floor_ratio" in row:
                fits = row["floor_ratio"] <= case.floor_limit
                memory.barh(y, row["floor_ratio"], height=0.5, color=TARGET["met" if fits else "missed"])
                memory.text(row["floor_ratio"] + 0.02, y, f"×{row['floor_ratio']:.2f}", va="center", fontsize=7)
                memory.axvline(case.floor_limit, color="black", linewidth=0.8)
            y += 1
    rate.set_yticks(range(len(labels)), labels, fontsize=7)
    rate.set_ylim(len(labels) - 0.5, -0.5)
    rate.set_xlim(0, 1.1)
    rate.set_xlabel("FLOP/s of the unavoidable products / the matmul peak")
    rate.set_title("time: fused head (coloured) vs its products alone (grey)")
    memory.set_yticks(range(len(labels)), [""] * len(labels))
    memory.set_ylim(len(labels) - 0.5, -0.5)
    memory.set_xlabel("peak memory / its floor; | target")
    memory.set_title("memory")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [case.name for case in shown]
