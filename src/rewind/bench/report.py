"""Results on disk: one JSON (everything measured), one Markdown page (tables a person reads) and
PNG plots (matplotlib, headless), all under one stem in the output folder."""

from __future__ import annotations

import importlib.util
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rewind.bench.machine import machine_info


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """Median and min-max; None fields when nothing was measured."""
    clean = [float(v) for v in values if v is not None]
    if not clean:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(clean), "min": min(clean), "max": max(clean),
            "n": len(clean)}


def fmt_spread(stats: dict[str, float | None], digits: int = 2, unit: str = "") -> str:
    """'1.23 s (1.10-1.40)' or 'n/a'."""
    if stats.get("median") is None:
        return "n/a"
    median, low, high = stats["median"], stats["min"], stats["max"]
    if stats.get("n", 1) == 1 or low == high:
        return f"{median:.{digits}f}{unit}"
    return f"{median:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]]
    note: str = ""

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join(" --- " for _ in self.headers) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
        return "\n".join(lines) + "\n"


@dataclass
class Plot:
    """Lines, one per series: {label: (xs, ys)}. Saved as `<report stem>-<filename>`."""

    filename: str
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float]]]
    logy: bool = False

    def save(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")  # no display here or in CI
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
        for label, (xs, ys) in self.series.items():
            axes.plot(xs, ys, marker="o" if len(xs) <= 40 else None, markersize=3, label=label)
        axes.set_title(self.title)
        axes.set_xlabel(self.xlabel)
        axes.set_ylabel(self.ylabel)
        if self.logy:
            axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return path


@dataclass
class Report:
    workload: str
    command: str
    params: dict[str, Any]
    servers: dict[str, str]  # name -> what ran, on which weights
    fairness: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # label -> the command that started it, as a user would type it (server_commands).
    commands: dict[str, str] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine_info)

    def write(self, folder: Path, stem: str) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        plots = self.plots
        if importlib.util.find_spec("matplotlib") is None:
            # A lent GPU machine's python may lack it, and a bench there must still leave its
            # tables and records (this is called after every server, not just at the end).
            plots = []
            if self.plots and "plots not drawn: matplotlib is not installed" not in self.notes:
                self.notes.append("plots not drawn: matplotlib is not installed")
        for plot in plots:
            if any(xs for xs, _ in plot.series.values()):
                written.append(plot.save(folder / f"{stem}-{plot.filename}"))
        payload = {
            "workload": self.workload, "command": self.command, "machine": self.machine,
            "params": self.params, "servers": self.servers, "commands": self.commands,
            "fairness": self.fairness,
            "summary": self.summary, "notes": self.notes, "records": self.records,
            "plots": [p.name for p in written],
        }
        json_path = folder / f"{stem}.json"
        json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        md_path = folder / f"{stem}.md"
        md_path.write_text(self.markdown([p.name for p in written]))
        return [json_path, md_path, *written]

    def markdown(self, plot_names: list[str]) -> str:
        machine = ", ".join(f"{k}: {v}" for k, v in self.machine.items())
        lines = [f"## `{self.workload}`", "", f"Command: `{self.command}`", "",
                 f"Machine: {machine}", "", "Servers:", ""]
        lines += [f"- **{name}**: {what}" for name, what in self.servers.items()]
        if self.commands:
            lines += ["", "Server commands (as started by the bench; the port is a free one):", ""]
            lines += [f"- **{name}**: `{command}`" for name, command in self.commands.items()]
        lines += ["", "Fairness:", ""] + [f"- {item}" for item in self.fairness]
        lines += ["", "Parameters: " + ", ".join(f"{k}={v}" for k, v in self.params.items()), ""]
        for table in self.tables:
            lines.append(table.markdown())
        for name in plot_names:
            lines += [f"![{name}]({name})", ""]
        if self.notes:
            lines += ["Notes:", ""] + [f"- {note}" for note in self.notes] + [""]
        return "\n".join(lines)
