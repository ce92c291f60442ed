"""Combines bench/results/<backend>.json into one markdown table (the README's).

    python -m bench.summary
"""

import json
import pathlib

RESULTS = pathlib.Path(__file__).parent / "results"
BACKENDS = ("jax", "tensorflow", "torch")


def main():
    reports = {b: json.loads((RESULTS / f"{b}.json").read_text()) for b in BACKENDS if (RESULTS / f"{b}.json").exists()}
    if not reports:
        raise SystemExit("No results yet: run `make bench` first.")
    first = next(iter(reports.values()))
    header = " | ".join(f"{b}: time (memory)" for b in reports)
    lines = [f"| case | reference | target | {header} |", "|---|---|---|" + "---|" * len(reports)]
    for row in first["cases"]:
        cells = []
        for report in reports.values():
            r = next((c for c in report["cases"] if c["case"] == row["case"]), None)
            if r is None or "error" in r:
                cells.append("–" if r is None else "not measured")
                continue
            memory = "" if r["memory_ratio"] is None else f" ({r['memory_ratio']:.2f})"
            mark = "" if r["met"] is None else (" ✓" if r["met"] else " ✗")
            cells.append(f"×{r['time_ratio']:.3f}{memory}{mark}")
        reference = row["reference_name"] if len(reports) == 1 else row["reference_name"].replace("optax / jax.nn", "native peer")
        lines.append(f"| {row['case']} | {reference} | {row['target']} | " + " | ".join(cells) + " |")
    machine = first["machine"]
    print(f"{machine['cpu']}, {machine['cores']} cores; ratio = ours / reference (lower is better), "
          f"memory ratio in parentheses; ✓/✗ against the target.\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
