"""Benchmark output: CSV and JSON files, and log-log PNG plots (matplotlib, Agg backend), and
`run_and_report`, the flow every benchmark module shares (see there).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Sequence

import numpy as np


def _new_file(path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(path, rows: list[dict]) -> pathlib.Path:
    path = _new_file(path)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path, *, machine: dict, options: dict, rows: list[dict], **extra) -> pathlib.Path:
    path = _new_file(path)
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


LINE_STYLES = ("-", "--", ":", "-.")


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
        for i, (label, points) in enumerate(panel["series"].items()):
            pts = [(x, y) for x, y in points if y is not None and not math.isnan(y) and y > 0]
            if pts:
                xs, ys = zip(*pts)
                # The default cycle has 10 colours: past them a new line style tells series apart.
                ax.plot(xs, ys, marker=marker, label=label, linestyle=LINE_STYLES[i // 10 % len(LINE_STYLES)])
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = _new_file(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def paired(rows: list[dict], keys: Sequence[str], field: str, baseline: str, value: str) -> list[tuple]:
    """(row, base) for every row that ran (status "ok" or none, a finite `value`) whose `field`
    is not `baseline`, with the row that ran of `baseline` with the same `keys`."""
    ran = [r for r in rows if r.get("status", "ok") == "ok" and math.isfinite(r[value])]
    base = {tuple(r[k] for k in keys): r for r in ran if r[field] == baseline}
    pairs = [(r, base.get(tuple(r[k] for k in keys))) for r in ran if r[field] != baseline]
    return [(r, b) for r, b in pairs if b and b[value]]


def log_log_slopes(rows: list[dict], x: str, y: str, group: str = "kind") -> dict[str, float]:
    """Per `group`, the slope of log `y` against log `x` over the rows with a finite positive y
    (where they hold two x values or more)."""
    slopes = {}
    for name in dict.fromkeys(r[group] for r in rows):
        pts = [(r[x], r[y]) for r in rows if r[group] == name and math.isfinite(r[y]) and r[y] > 0]
        if len({p for p, _ in pts}) >= 2:
            xs, ys = np.log(np.array(pts, dtype=float)).T
            slopes[name] = float(np.polyfit(xs, ys, 1)[0])
    return slopes


def series(rows: list[dict], x: str, y: str, label: Callable[[dict], str]) -> dict[str, list[tuple]]:
    """A panel's lines for `plot_series`: {label(row): [(row[x], row[y]), ...]}, in row order."""
    lines = {}
    for r in rows:
        lines.setdefault(label(r), []).append((r[x], r[y]))
    return lines


def panels(xlabel: str, series_by_ylabel: dict[str, dict]) -> list[dict]:
    """`plot_series` panels on one x axis: {ylabel: the panel's series}."""
    return [{"xlabel": xlabel, "ylabel": y, "series": lines} for y, lines in series_by_ylabel.items()]


@dataclasses.dataclass
class Table:
    """A printed table (`heading:` above it, those of `columns` some row has; None: every key),
    also written to <name>_<csv>.csv when `csv` is given; neither happens without rows."""

    rows: list[dict]
    heading: str = ""
    columns: Sequence[str] | None = None
    csv: str | None = None

    def markdown(self) -> str:
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        return markdown_table(self.rows, [c for c in self.columns or keys if c in keys])


@dataclasses.dataclass
class Report:
    """What a benchmark found, for `run_and_report`: `rows` (<name>.csv, the JSON's rows, the
    first table, with `columns`), further `tables`, `extra` JSON fields (also returned), the PNG's
    `panels` (`plot_series`; none: no PNG) and `title`, and `notes` printed after the tables."""

    rows: list[dict]
    columns: Sequence[str]
    tables: list[Table] = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)
    panels: list[dict] = dataclasses.field(default_factory=list)
    title: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)


def run_and_report(
    name: str, opts, out_dir, run: Callable, summarize: Callable[..., Report], *, log=print
) -> dict:
    """Print the machine, `run(opts, log=log)` the cases, `summarize(opts, ran, machine)` them
    (ratios, tables, plot), write <name>.csv/.json/.png (and each table's CSV) under `out_dir`,
    print the tables and notes; returns {"rows", **extra, "files"}."""
    from experiments.benchmarking import measure

    out_dir = pathlib.Path(out_dir)
    machine = measure.machine_description()
    log(f"machine: {machine}")
    found = summarize(opts, run(opts, log=log), machine)
    tables = [Table(found.rows, columns=found.columns), *found.tables]
    files = {"csv": write_csv(out_dir / f"{name}.csv", found.rows)}
    for table in tables[1:]:
        if table.csv and table.rows:
            files[f"{table.csv}_csv"] = write_csv(out_dir / f"{name}_{table.csv}.csv", table.rows)
    options = dataclasses.asdict(opts)
    files["json"] = write_json(
        out_dir / f"{name}.json", machine=machine, options=options, rows=found.rows, **found.extra
    )
    if found.panels:
        files["png"] = plot_series(out_dir / f"{name}.png", found.panels, title=found.title)
    for table in tables:
        if table.rows:
            log("\n" + (f"{table.heading}:\n" if table.heading else "") + table.markdown())
    for note in found.notes:
        log(note)
    log("wrote " + ", ".join(str(p) for p in files.values()))
    return {"rows": found.rows, **found.extra, "files": files}
