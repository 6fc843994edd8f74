"""Draw docs/benchmarks_objectstore.png from a bench_objectstore.py result (medians, ranges).

.venv/bin/python bench/plot_objectstore.py [bench/results/objectstore.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
BARS = [
    ("cairn_save", "cairn save"),
    ("ts_save", "TensorStore PUTs"),
    ("cairn_restore", "cairn restore"),
    ("ts_restore", "TensorStore GETs"),
]


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "objectstore.json"
    result = json.loads(source.read_text())
    runs = list(result["runs"].values())
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(BARS)
    for i, (key, label) in enumerate(BARS):
        stats = [run["summary"]["stats"][key] for run in runs]
        medians = [s["median_s"] for s in stats]
        low = [s["median_s"] - s["min_s"] for s in stats]
        high = [s["max_s"] - s["median_s"] for s in stats]
        xs = [j + (i - (len(BARS) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, medians, width, yerr=[low, high], capsize=3, label=label)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([f"{run['store']} ({run['config']['threads']} threads)" for run in runs])
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(f"{result['size']} train state to a local emulator, n={result['repeats']}")
    ax.legend()
    fig.tight_layout()
    out = HERE.parent / "docs" / "benchmarks_objectstore.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
