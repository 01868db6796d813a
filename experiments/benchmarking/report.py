"""Benchmark output: CSV and JSON files, and log-log PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import csv
import json
import math
import pathlib


def write_csv(path, rows: list[dict]) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path, *, machine: dict, options: dict, rows: list[dict], **extra) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    path.write_text(
        json.dumps({"machine": machine, "options": options, "rows": clean, **extra}, indent=1, default=str)
    )
    return path


def markdown_table(rows: list[dict], columns: list[str], *, floats: str = ".3g") -> str:
    """A GitHub markdown table of the given columns (NaN shown as '-')."""

    def cell(v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else format(v, floats)
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_series(
    path, panels: list[dict], *, title: str, log_x: bool = True, marker: str | None = "o"
) -> pathlib.Path:
    """Line plots side by side, log y; log-2 x unless `log_x=False`.

    Each panel: {"ylabel": str, "xlabel": str, "series": {label: [(x, y), ...]}}; points with a
    NaN y (skipped cases) are left out, so a line stops where its kind stopped fitting.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, points in panel["series"].items():
            pts = [(x, y) for x, y in points if y is not None and not math.isnan(y) and y > 0]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=marker, label=label)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
