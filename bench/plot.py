"""The benchmark plots: docs/benchmarks.png and docs/benchmarks_train_state.png.

    .venv/bin/python bench/plot.py [results.json] [out.png]                 # bench_save_restore
    .venv/bin/python bench/plot.py --train-state [results.json] [out.png]   # bench_train_state

`plot` (bench/results/latest.json): one panel per tree size; in each, three groups of bars (save:
caller blocked, save: start to committed, restore), one bar per system, median height with
min-max whiskers, log-scale seconds. `plot_train_state` (bench/results/train_state.json): one row
per size: those times, the memory beyond the live state, and the training time lost per save.
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


def fmt_seconds(value: float) -> str:
    if value < 0.01:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def draw_bar(
    ax: Any,
    x: float,
    med: float,
    lo: float,
    hi: float,
    width: float,
    colour: str,
    hatch: str,
    label: str | None,
    *,
    seconds: bool,
    log: bool = True,
) -> None:
    """One bar at the median, a min-max whisker, and the median written above it."""
    ax.bar(
        x,
        med,
        width * 0.92,
        color=colour,
        hatch=hatch,
        edgecolor="#333333",
        linewidth=0.6,
        label=label,
        yerr=[[med - lo], [hi - med]],
        capsize=3,
        error_kw={"elinewidth": 1, "ecolor": "black"},
    )
    text = fmt_seconds(med) if seconds else f"{med:.2f}"
    if log:
        ax.text(x, hi * 1.12, text, ha="center", va="bottom", fontsize=7.5, rotation=90)
    else:
        ax.annotate(
            text,
            (x, hi),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7.5,
            rotation=90,
        )


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
                draw_bar(
                    ax,
                    x,
                    st["median_s"],
                    st["min_s"],
                    st["max_s"],
                    width,
                    colour,
                    hatch,
                    None if s in labelled else label,
                    seconds=True,
                )
                labelled.add(s)
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


# ----------------------------------------------------------------------------- train state

TS_JSON = HERE / "results" / "train_state.json"
TS_PNG = HERE.parent / "docs" / "benchmarks_train_state.png"
TS_SERIES = [
    (
        "plain memcpy / write+fsync / read of the same bytes",
        "#9e9e9e",
        "//",
        {"blocked": "limit.memcpy", "committed": "limit.write_fsync", "restore": "limit.read"},
    ),
    (
        "cairn (TrainStateHandler)",
        "#1f77b4",
        "",
        {"blocked": "cairn.blocked", "committed": "cairn.committed", "restore": "cairn.restore"},
    ),
    (
        "orbax-checkpoint (async, StandardSave)",
        "#ff7f0e",
        "",
        {"blocked": "orbax.blocked", "committed": "orbax.committed", "restore": "orbax.restore"},
    ),
]
TS_SYSTEMS = [("cairn", "#1f77b4"), ("orbax", "#ff7f0e")]


def plot_train_state(json_path: Path = TS_JSON, png_path: Path = TS_PNG) -> None:
    """Per size: times (log), memory beyond the live state, training time lost per save."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result: dict[str, Any] = json.loads(Path(json_path).read_text())
    sizes = list(result["sizes"])
    fig, axes = plt.subplots(
        len(sizes),
        3,
        figsize=(15, 4.1 * len(sizes) + 1.3),
        squeeze=False,
        gridspec_kw={"width_ratios": [2.2, 1.3, 1]},
    )
    for row, size in zip(axes, sizes, strict=True):
        entry = result["sizes"][size]
        stats = entry["stats"]
        tree = entry["tree"]
        name = f"{tree['bytes'] / 2**20:.0f} MiB, {tree['leaves']} leaves"
        # (a) times
        ax = row[0]
        width = 0.8 / 3
        highs, lows = [], []
        for g, (group, _) in enumerate(GROUPS):
            present = [spec for spec in TS_SERIES if spec[3].get(group) in stats]
            for j, (label, colour, hatch, keys) in enumerate(present):
                st = stats[keys[group]]
                x = g + (j - (len(present) - 1) / 2) * width
                draw_bar(
                    ax,
                    x,
                    st["median_s"],
                    st["min_s"],
                    st["max_s"],
                    width,
                    colour,
                    hatch,
                    label if g == 0 else None,
                    seconds=True,
                )
                highs.append(st["max_s"])
                lows.append(st["min_s"])
        ax.set_yscale("log")
        ax.set_ylim(min(lows) / 2, max(highs) * 4)
        ax.set_xticks(range(len(GROUPS)), [g for _, g in GROUPS], fontsize=9)
        if size == sizes[0]:
            handles, labels = ax.get_legend_handles_labels()
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{name}: save and restore", fontsize=10.5)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_axisbelow(True)
        # (b) memory beyond the live state
        ax = row[1]
        width = 0.35
        groups = [
            ("mem_save", "during save\n(start → committed)"),
            ("mem_restore", "during restore"),
        ]
        top = 0.3
        for g, (key, _) in enumerate(groups):
            for j, (system, colour) in enumerate(TS_SYSTEMS):
                st = stats[f"{system}.{key}"]
                x = g + (j - 0.5) * width
                draw_bar(
                    ax,
                    x,
                    st["median"],
                    st["min"],
                    st["max"],
                    width,
                    colour,
                    "",
                    system if g == 0 else None,
                    seconds=False,
                    log=False,
                )
                top = max(top, st["max"])
        ax.axhline(
            0.25,
            color="#2ca02c",
            linestyle="--",
            linewidth=1,
            label="target \u2264 0.25\u00d7 state",
        )
        ax.set_ylim(min(0.0, ax.get_ylim()[0]), top * 1.3)
        ax.set_xticks(range(len(groups)), [g for _, g in groups], fontsize=9)
        ax.set_ylabel("peak RSS beyond live state (\u00d7 state)")
        ax.set_title("memory", fontsize=10.5)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, loc="upper left", frameon=False)
        # (c) training time lost per background save
        ax = row[2]
        inter = entry["interference"]["systems"]
        top = 0.0
        for j, (system, colour) in enumerate(TS_SYSTEMS):
            st = inter[system]["lost_s"]
            draw_bar(
                ax,
                j,
                st["median"],
                st["min"],
                st["max"],
                0.6,
                colour,
                "",
                None,
                seconds=True,
                log=False,
            )
            ratio = inter[system]["steps_per_s_ratio"]["median"]
            ax.text(j, -0.02, f"steps/s \u00d7{ratio:.2f}", ha="center", va="top", fontsize=8)
            top = max(top, st["max"])
        ax.set_ylim(-0.12 * max(top, 0.1), max(top, 0.1) * 1.45)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(TS_SYSTEMS)), [s for s, _ in TS_SYSTEMS], fontsize=9)
        ax.set_ylabel("seconds of training lost per save")
        ax.set_title("jitted train step during a save", fontsize=10.5)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    machine = result.get("machine", {})
    cfg = result["config"]
    fig.suptitle(
        f"cairn vs orbax-checkpoint {machine.get('orbax-checkpoint', '?')} on a T5X-like jax state "
        f"({machine.get('cpus', '?')} CPUs, {machine.get('scratch_fs', 'local disk')}; "
        f"{result.get('date_utc', '')} UTC)\nbar = median of n={cfg['repeats']} rounds "
        f"(training: {cfg['interference_reps']} saves), whisker = min-max",
        fontsize=11,
    )
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=9, frameon=False)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1 - 0.55 / height))
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train-state"]:
        plot_train_state(*[Path(a) for a in sys.argv[2:4]])
    else:
        plot(*[Path(a) for a in sys.argv[1:3]])


OVERHEAD_PARTS = [
    ("blocked_s", "save() blocked", "#1f4e79"),
    ("first_step_extra_s", "first step after save(): extra", "#e07b39"),
    ("later_steps_extra_s", "later steps while committing: extra", "#f4c27a"),
    ("between_steps_extra_s", "the loop between steps: extra", "#b5b5b5"),
]


def plot_overhead(after_json: Path, before_json: Path, png_path: Path) -> None:
    """docs/benchmarks_overhead.png: per size (rows) and train step (columns), the training time
    a save costs, split into its parts (medians, stacked), with the median of the whole loss and
    its min-max as a whisker; cairn before issue 21 (from `before_json`, if there is one), and
    from `after_json`'s run the systems it has: cairn now, with zero_copy=True, with
    writer="process", and Orbax."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    after = json.loads(Path(after_json).read_text())
    before = json.loads(Path(before_json).read_text()) if Path(before_json).exists() else None
    sizes = list(after["sizes"])
    kinds = ["decoder", "elementwise"]
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.6 * len(sizes) + 0.8), squeeze=False)
    for row, label in enumerate(sizes):
        for col, kind in enumerate(kinds):
            ax = axes[row][col]
            bars = []
            if before is not None and label in before["sizes"]:
                bars.append(("cairn before", before["sizes"][label]["windows"][kind]["cairn"]))
            for name, text in (
                ("cairn", "cairn (pool)"),
                ("cairn-views", "cairn zero_copy"),
                ("cairn-process", "cairn writer=process"),
                ("cairn-packed", "cairn packed"),
                ("cairn-zarr", "cairn zarr"),
                ("cairn-orbax", "Orbax calls on\ncairn.manager.orbax"),
                ("orbax", "Orbax"),
            ):
                win = after["sizes"][label]["windows"][kind].get(name)
                if win is not None:
                    bars.append((text, win))
            for i, (_text, win) in enumerate(bars):
                bottom = 0.0
                for key, part, colour in OVERHEAD_PARTS:
                    value = max(0.0, win[key]["median"])
                    ax.bar(
                        i,
                        value,
                        0.6,
                        bottom=bottom,
                        color=colour,
                        edgecolor="#333333",
                        linewidth=0.5,
                        label=part if (row, col, i) == (0, 0, 0) else None,
                    )
                    bottom += value
                lost = win["lost_s"]
                ax.errorbar(
                    i + 0.33,
                    lost["median"],
                    yerr=[[lost["median"] - lost["min"]], [lost["max"] - lost["median"]]],
                    fmt="o",
                    color="black",
                    markersize=3,
                    capsize=3,
                    label="training time lost (median, min-max)"
                    if (row, col, i) == (0, 0, 0)
                    else None,
                )
                ax.annotate(
                    fmt_seconds(lost["median"]),
                    (i, max(bottom, lost["max"])),
                    xytext=(0, 4),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                )
            ax.set_xticks(range(len(bars)), [t for t, _ in bars], fontsize=8)
            ax.set_ylabel("seconds per save")
            ax.set_title(f"{label} state, {kind} train step", fontsize=10)
            ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
            ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("What one background save costs the training loop (bench/bench_overhead.py)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def plot_commit_ratio(runs: list[tuple[str, Path]], png_path: Path) -> None:
    """docs/benchmarks_overlap.png: commit throughput ÷ one O_DIRECT file of the same bytes
    (paired within each round: median and min-max), counted from the start of save() and from
    its return, per size, for each bench_overhead run in `runs` (label, JSON), with the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [(label, json.loads(path.read_text())) for label, path in runs if path.exists()]
    sizes = list(loaded[-1][1]["sizes"])
    panels = (
        ("commit_vs_odirect", "from the start of save()"),
        ("after_save_vs_odirect", "from save()'s return"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    width = 0.8 / len(loaded)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, (label, result) in enumerate(loaded):
            for j, size in enumerate(sizes):
                ratio = _commit_ratio(result["sizes"].get(size, {}), key)
                if ratio is None:
                    continue
                x = j + (i - (len(loaded) - 1) / 2) * width
                ax.bar(
                    x,
                    ratio["median"],
                    width * 0.9,
                    color=f"C{i}",
                    edgecolor="#333333",
                    linewidth=0.5,
                    label=label if (key, j) == (panels[0][0], 0) else None,
                )
                ax.errorbar(
                    x,
                    ratio["median"],
                    yerr=[[ratio["median"] - ratio["min"]], [ratio["max"] - ratio["median"]]],
                    fmt="none",
                    color="black",
                    capsize=3,
                )
                ax.annotate(
                    f"{ratio['median']:.2f}x",
                    (x, ratio["max"]),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                )
        ax.axhline(0.95, color="#b22222", linestyle="--", linewidth=1, label=None)
        ax.text(0.5, 0.96, "goal 0.95x", color="#b22222", fontsize=8, ha="center")
        ax.set_xticks(range(len(sizes)), [f"{s} state" for s in sizes])
        ax.set_title(f"commit throughput ÷ one O_DIRECT file, {title}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("ratio (higher is faster)")
    fig.legend(loc="lower center", ncol=len(loaded), fontsize=8, frameon=False)
    fig.suptitle("Writing while save() copies (bench/bench_overhead.py, cairn, no training)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _commit_ratio(entry: dict[str, Any], key: str) -> dict[str, float] | None:
    """A paired ratio of bench_overhead's entry for one size; runs from before it reported
    ``after_save_vs_odirect`` get it from their rounds (save start -> committed, less save()
    blocked, in the same round as the O_DIRECT file)."""
    ratio = entry.get("paired", {}).get(f"cairn.{key}")
    rounds = entry.get("rounds", {})
    if ratio is not None or key != "after_save_vs_odirect" or "cairn.commit" not in rounds:
        return ratio
    samples = [
        odirect / (commit - blocked)
        for odirect, commit, blocked in zip(
            rounds["limit.odirect"]["samples"],
            rounds["cairn.commit"]["samples"],
            rounds["cairn.blocked"]["samples"],
            strict=True,
        )
    ]
    samples.sort()
    return {"median": samples[len(samples) // 2], "min": samples[0], "max": samples[-1]}
