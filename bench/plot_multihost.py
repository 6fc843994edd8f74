"""Draw docs/benchmarks_multihost.png from a bench_multihost.py result.

    .venv/bin/python bench/plot_multihost.py [bench/results/multihost.json]

Three panels: (a) fixed requests per save (requests - own files, net of the deletes of the
retired step's files) per process role against N; (b) aggregate save throughput, plain objects
÷ cairn, per round; (c) the commit latency per round in units of its budget (2 barrier rounds + one
manifest write), to the manifest's write (the commit point) and on to the end of
`_KvPrepared.commit` (after the lease's refresh). A result of ``--quick`` is drawn beside its JSON (``*.png.tmp``), not in docs/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "multihost.json"
DOCS_PNG = HERE.parent / "docs" / "benchmarks_multihost.png"
QUICK_PNG = HERE / "results" / "multihost-quick.png.tmp"
LABEL = {"s3": "S3 (moto)", "gs": "GCS (fake-gcs-server)"}
COLOR = {"s3": "tab:orange", "gs": "tab:blue"}


def draw(result: dict[str, Any], *, quick: bool = False) -> Path:
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 5.0))

    # (a) fixed requests per save vs N
    for store, by_n in result["counts"].items():
        ns = sorted(int(n) for n in by_n)
        for save, style in ((1, "-"), (3, "--")):
            for role, marker in (("primary", "o"), ("other", "s")):
                ys = []
                for n in ns:
                    rows = [r for r in by_n[str(n)]["rows"] if r["save"] == save]
                    pick = [r for r in rows if (r["process"] == 0) == (role == "primary")]
                    ys.append(max(r["fixed_net"] for r in pick) if pick else None)
                pairs = [(n, y) for n, y in zip(ns, ys, strict=True) if y is not None]
                if not pairs:
                    continue
                retention = "retention" if save == 3 else "no retention"
                a.plot(
                    [n for n, _ in pairs],
                    [y for _, y in pairs],
                    style,
                    marker=marker,
                    color=COLOR[store],
                    label=f"{store} {role}, {retention}",
                )
    a.set_xlabel("processes N")
    a.set_xticks(sorted({int(n) for by_n in result["counts"].values() for n in by_n}))
    a.set_ylabel("requests per save - own files\n(net of the old step's file deletes)")
    a.set_ylim(0, 22)
    a.set_title("(a) fixed requests per process per save")
    a.legend(fontsize=7, ncol=2, loc="upper center")

    # (b) throughput ratio per round
    width = 0.8 / max(1, len(result["throughput"]))
    for i, (store, entry) in enumerate(result["throughput"].items()):
        ratios = [r["ratio"] for r in entry["rounds"]]
        bx = [
            j + 1.0 + (i - (len(result["throughput"]) - 1) / 2) * width for j in range(len(ratios))
        ]
        med = entry["summary"]["ratio"]["median"]
        b.bar(bx, ratios, width, color=COLOR[store], label=f"{LABEL[store]}, median {med:.2f}")
    high = max(r["ratio"] for e in result["throughput"].values() for r in e["rounds"])
    b.set_ylim(0, max(1.2, high) * 1.45)  # room for the legend
    b.axhline(0.8, color="k", ls=":", lw=1, label="goal on S3 (0.8)")
    b.axhline(1.0, color="grey", lw=0.5)
    rounds = max(len(e["rounds"]) for e in result["throughput"].values())
    b.set_xticks(range(1, rounds + 1))
    b.set_xlabel("round")
    b.set_ylabel("plain-object PUT time ÷ cairn save time")
    mib = result["size_bytes"] / (1 << 20)
    b.set_title(f"(b) aggregate save throughput, N={result['processes']}, {mib:.0f} MiB")
    b.legend(fontsize=8, loc="upper left")

    # (c) latency per round, in budgets (2 barrier rounds + 1 manifest write)
    for i, (store, entry) in enumerate(result["throughput"].items()):
        budget = entry["summary"]["budget_s"]
        point = [r["after_last_upload"]["manifest_write_end"] / budget for r in entry["rounds"]]
        total = [r["phases"]["commit_latency_s"] / budget for r in entry["rounds"]]
        cx = [
            j + 1.0 + (i - (len(result["throughput"]) - 1) / 2) * width for j in range(len(total))
        ]
        c.bar(
            cx,
            point,
            width,
            color=COLOR[store],
            label=f"{store}: to the manifest written; budget {budget * 1e3:.1f} ms",
        )
        c.bar(
            cx,
            [t - p for t, p in zip(total, point, strict=True)],
            width,
            bottom=point,
            color=COLOR[store],
            alpha=0.4,
            label=f"{store}: + the lease's refresh",
        )
    top = max(
        r["phases"]["commit_latency_s"] / e["summary"]["budget_s"]
        for e in result["throughput"].values()
        for r in e["rounds"]
    )
    c.set_ylim(0, max(1.2, top) * 1.75)  # room for the legend
    c.axhline(1.0, color="k", ls=":", lw=1, label="goal (1 budget)")
    c.set_xticks(range(1, rounds + 1))
    c.set_xlabel("round")
    c.set_ylabel("last PUT end -> commit, ÷ (2 barriers + 1 manifest write)")
    c.set_title("(c) commit latency in budgets")
    c.legend(fontsize=7, loc="upper left")

    fig.suptitle(
        f"Multi-process saves on object stores (emulators on the same 2 cores), {result['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    out = QUICK_PNG if quick else DOCS_PNG
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
    return out


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_JSON
    result = json.loads(source.read_text())
    print(draw(result, quick=bool(result.get("quick"))))


if __name__ == "__main__":
    main()
