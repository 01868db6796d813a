"""Metrics as JSON lines (always) and TensorBoard scalars (when tensorboardX is installed)."""

from __future__ import annotations

import json
import pathlib

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Append `{"step": s, **scalars}` lines to `workdir/metrics.jsonl`."""

    def __init__(self, workdir):
        self.path = pathlib.Path(workdir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tensorboard = None
        try:
            from tensorboardX import SummaryWriter  # optional
        except ImportError:
            pass
        else:
            self._tensorboard = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))

    def write(self, step: int, scalars: dict) -> None:
        """Record float scalars for `step`."""
        record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, float(value), int(step))

    def close(self) -> None:
        """Flush TensorBoard if open."""
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(workdir) -> list[dict]:
    """All records of `workdir/metrics.jsonl`, in order."""
    path = pathlib.Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
