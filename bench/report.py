"""Results: markdown tables, CSV files and PNG plots, written as each section finishes."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


@dataclasses.dataclass
class Table:
    """One results table: formatted cells for markdown, raw values for CSV."""

    name: str  # file stem of the CSV
    title: str
    columns: list[str]
    rows: list[list[str]] = dataclasses.field(default_factory=list)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, cells: list[Any], record: dict[str, Any] | None = None) -> None:
        self.rows.append([str(c) for c in cells])
        if record is not None:
            self.records.append(record)

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            lines.append("")
            lines += self.notes
        return "\n".join(lines)


@dataclasses.dataclass
class SectionResult:
    key: str
    title: str
    intro: str = ""
    tables: list[Table] = dataclasses.field(default_factory=list)
    figures: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file name, caption)
    plots: list[tuple[str, str, Callable[[Any], None]]] = dataclasses.field(default_factory=list)  # to draw
    texts: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file name, content)
    problems: list[str] = dataclasses.field(default_factory=list)  # a check failed (exit status 1)
    findings: list[str] = dataclasses.field(default_factory=list)  # worth reading first
    seconds: float = 0.0


def machine_line(settings: Any) -> str:
    cpu = platform.processor() or platform.machine()
    dev = settings.device
    if dev == "cuda" and torch.cuda.is_available():
        dev = f"cuda ({torch.cuda.get_device_name(0)})"
    threads = torch.get_num_threads()
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, {cpu}, {os.cpu_count()} CPUs, "
        f"{threads} torch thread(s), device {dev}, backend {settings.backend}, mode {settings.mode}"
    )


class Writer:
    """Writes each section's markdown, CSVs, figures and texts under ``out``; then a summary."""

    def __init__(self, out: Path, settings: Any, plots: bool) -> None:
        self.out = out
        self.settings = settings
        self.plots = plots
        self.suffix = settings.suffix
        self.sections: list[SectionResult] = []
        self.started = datetime.datetime.now()
        out.mkdir(parents=True, exist_ok=True)

    def path(self, stem: str, ext: str) -> Path:
        return self.out / f"{stem}_{self.suffix}.{ext}"

    def figure(self, section: SectionResult, stem: str, caption: str, draw: Callable[[Any], None]) -> None:
        """Draw with ``draw(plt)`` and save as PNG, if plotting is on."""
        if not self.plots:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = self.path(stem, "png")
        try:
            draw(plt)
            plt.gcf().savefig(path, dpi=110)
        finally:
            plt.close("all")
        section.figures.append((path.name, caption))

    def write_section(self, section: SectionResult) -> str:
        self.sections.append(section)
        for stem, caption, draw in section.plots:
            try:
                self.figure(section, stem, caption, draw)
            except Exception as e:  # a plot must not lose the tables
                section.problems.append(f"plot {stem} failed: {type(e).__name__}: {e}")
        for t in section.tables:
            if t.records:
                with open(self.path(t.name, "csv"), "w", newline="") as f:
                    keys: list[str] = []
                    for r in t.records:
                        keys += [k for k in r if k not in keys]
                    w = csv.DictWriter(f, fieldnames=keys)
                    w.writeheader()
                    w.writerows(t.records)
        for name, content in section.texts:
            (self.out / name).write_text(content)
        md = self.section_markdown(section)
        self.path(section.key, "md").write_text(md + "\n")
        self.write_summary()
        return md

    def section_markdown(self, section: SectionResult, level: int = 2) -> str:
        lines = [f"{'#' * level} {section.title}", ""]
        lines.append(machine_line(self.settings) + f"; section took {section.seconds:.0f} s.")
        lines.append("")
        if section.intro:
            lines += [section.intro, ""]
        for t in section.tables:
            lines += [t.markdown(), ""]
            if t.records:
                lines += [f"CSV: `{self.path(t.name, 'csv').name}`", ""]
        for name, caption in section.figures:
            lines += [f"![{caption}]({name})", ""]
        for name, _ in section.texts:
            lines += [f"Details: `{name}`", ""]
        if section.findings:
            lines += ["Findings:", ""] + [f"- {f}" for f in section.findings] + [""]
        if section.problems:
            lines += ["**Checks that failed:**", ""] + [f"- {p}" for p in section.problems] + [""]
        return "\n".join(lines).rstrip()

    def write_summary(self) -> None:
        total = sum(s.seconds for s in self.sections)
        lines = [
            f"# Benchmark suite ({self.settings.mode}, backend {self.settings.backend}, device {self.settings.device})",
            "",
            machine_line(self.settings),
            f"Started {self.started:%Y-%m-%d %H:%M}; sections so far took {total:.0f} s in all.",
            "",
            "| section | seconds | tables | failed checks |",
            "|---|---|---|---|",
        ]
        for s in self.sections:
            lines.append(
                f"| [{s.title}]({self.path(s.key, 'md').name}) | {s.seconds:.0f} | {len(s.tables)} | {len(s.problems)} |"
            )
        findings = [(s.title, f) for s in self.sections for f in s.findings]
        if findings:
            lines += ["", "Findings:", ""] + [f"- {t}: {f}" for t, f in findings]
        self.path("summary", "md").write_text("\n".join(lines) + "\n")


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
