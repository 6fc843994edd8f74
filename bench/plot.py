"""Draw docs/benchmarks.png from bench/results/latest.json (written by bench_save_restore.py).

    .venv/bin/python bench/plot.py [results.json] [out.png]

One panel per tree size; in each, three groups of bars (save: caller blocked, save: start to
committed, restore), one bar per system, median height with min-max whiskers, log-scale seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "latest.json"
DEFAULT_PNG = HERE.parent / "docs" / "benchmarks.png"

# series: (legend label, colour, hatch, {group: stats key})
SERIES = [
    (
        "machine limit: memcpy / write+fsync / read",
        "#9e9e9e",
        "//",
        {"blocked": "limit.memcpy", "committed": "limit.write_fsync", "restore": "limit.read"},
    ),
    ("copy into fresh arrays", "#d0d0d0", "..", {"blocked": "limit.fresh_copy"}),
    (
        "cairn (async, NumPy handler)",
        "#1f77b4",
        "",
        {"blocked": "cairn.blocked", "committed": "cairn.committed", "restore": "cairn.restore"},
    ),
    ("cairn (async_save=False)", "#8fbbe0", "", {"committed": "cairn_sync.committed"}),
    (
        "orbax, NumPy leaves",
        "#ff7f0e",
        "",
        {
            "blocked": "orbax_np.blocked",
            "committed": "orbax_np.committed",
            "restore": "orbax_np.restore",
        },
    ),
    (
        "orbax, jax.Array leaves",
        "#c44e1b",
        "xx",
        {
            "blocked": "orbax_jax.blocked",
            "committed": "orbax_jax.committed",
            "restore": "orbax_jax.restore",
        },
    ),
]
GROUPS = [
    ("blocked", "save(): caller blocked"),
    ("committed", "save start → committed"),
    ("restore", "restore (page cache warm)"),
]


def plot(json_path: Path = DEFAULT_JSON, png_path: Path = DEFAULT_PNG) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result: dict[str, Any] = json.loads(Path(json_path).read_text())
    sizes = list(result["sizes"])
    ncols = 1 if len(sizes) > 2 else len(sizes)
    nrows = -(-len(sizes) // ncols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(10.5 if ncols == 1 else 6.4 * ncols, 3.9 * nrows + 1.2),
        squeeze=False,
    )
    panels = [ax for row in axes for ax in row]
    width = 0.8 / len(SERIES)
    lows, highs = [], []
    for ax, size in zip(panels, sizes, strict=True):
        entry = result["sizes"][size]
        stats = entry["stats"]
        labelled: set[int] = set()
        for g, (group, _) in enumerate(GROUPS):
            present = [(s, spec[3][group]) for s, spec in enumerate(SERIES) if group in spec[3]]
            present = [(s, key) for s, key in present if key in stats]
            for j, (s, key) in enumerate(present):
                label, colour, hatch, _ = SERIES[s]
                st = stats[key]
                x = g + (j - (len(present) - 1) / 2) * width
                med = st["median_s"]
                ax.bar(
                    x,
                    med,
                    width * 0.92,
                    color=colour,
                    hatch=hatch,
                    edgecolor="#333333",
                    linewidth=0.6,
                    label=None if s in labelled else label,
                    yerr=[[med - st["min_s"]], [st["max_s"] - med]],
                    capsize=3,
                    error_kw={"elinewidth": 1, "ecolor": "black"},
                )
                labelled.add(s)
                text = f"{med * 1e3:.0f} ms" if med < 1 else f"{med:.2f} s"
                if med < 0.01:
                    text = f"{med * 1e3:.1f} ms"
                ax.text(
                    x, st["max_s"] * 1.12, text, ha="center", va="bottom", fontsize=7.5, rotation=90
                )
                lows.append(st["min_s"])
                highs.append(st["max_s"])
        tree = entry["tree"]
        ax.set_title(
            f"{tree['bytes'] / 2**20:.0f} MiB in {tree['leaves']} float32 leaves", fontsize=11
        )
        ax.set_ylabel("seconds (log)")
        ax.set_ylim(min(lows) / 2, max(highs) * 3.5)
        lows.clear()
        highs.clear()
        ax.set_xticks(range(len(GROUPS)), [name for _, name in GROUPS], fontsize=9)
        ax.set_yscale("log")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_axisbelow(True)
    handles, labels = [], []
    for ax in panels:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    order = [labels.index(spec[0]) for spec in SERIES if spec[0] in labels]
    fig.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        loc="lower center",
        ncol=3,
        fontsize=9,
        frameon=False,
    )
    machine = result.get("machine", {})
    fig.suptitle(
        f"cairn vs orbax-checkpoint {machine.get('orbax-checkpoint', '?')} vs machine limits "
        f"({machine.get('cpus', '?')} CPUs, {machine.get('scratch_fs', 'local disk')}; "
        f"{result.get('date_utc', '')} UTC)\nbar = median of n={result['config']['repeats']}, "
        "whisker = min-max, log scale",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.9 / fig.get_figheight(), 1, 1 - 0.55 / fig.get_figheight()))
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    args = [Path(a) for a in sys.argv[1:3]]
    plot(*args)
