"""Output: the terminal tables, Markdown, and the CSV (written and read back).

The terminal shows, per block, one table per framework, with the columns that have a
value there. So that a table fits 100 columns, ``wide=False`` leaves out the trace time
and the program size, in a framework's table the ratios to the pure-JAX scan and loop
(``/scan``, ``/loop``): there, ``/tool`` compares with the framework's own tool, and for
a block without ``grad`` (inference: no remat) the bytes through optimisation barriers.
All of them are in the CSV and the Markdown. Column meanings: ``benchmarks/README.md``.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import math
import os
import platform
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jaxlib import version as jaxlib_version

from stackwise.bench import workloads
from stackwise.bench.config import BenchConfig, Result

__all__ = [
    "FRAMEWORK_NAMES",
    "backend",
    "machine",
    "print_report",
    "print_table",
    "read_csv",
    "write_csv",
    "write_markdown",
]

#: How the tables and the plot name each ``Result.framework``.
FRAMEWORK_NAMES = {
    "jax": "pure JAX", "haiku": "Haiku", "flax": "Flax linen", "nnx": "Flax NNX",
    "equinox": "Equinox",
}

#: The terminal width the tables are made to fit (unless ``wide``).
WIDTH = 100


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(
        value, spec
    )


def _kib(b: int) -> str:
    return "-" if b < 0 else f"{b / 1024:,.0f}"


class _Column(NamedTuple):
    header: str  # in Markdown
    short: str  # in the terminal ("\n": a two-line header)
    cell: Callable[[Result], str]
    wide: bool = False  # terminal: only with wide=True
    jax: bool = False  # terminal: only in the pure-JAX table, unless wide=True
    grad: bool = False  # terminal: only for a block under grad (remat's barriers), or wide


_COLUMNS = [
    _Column("n", "n", lambda r: str(r.n)),
    _Column("variant", "variant", lambda r: r.variant),
    _Column("remat", "remat", lambda r: r.remat),
    _Column("compile s", "compile\ns", lambda r: _fmt(r.compile_s, ".2f")),
    _Column("trace s", "trace\ns", lambda r: _fmt(r.trace_s, ".2f"), wide=True),
    _Column("/scan", "/scan", lambda r: _fmt(r.compile_vs_scan, ".2f"), jax=True),
    _Column("/loop", "/loop", lambda r: _fmt(r.compile_vs_loop, ".2f"), jax=True),
    _Column("/tool", "/tool", lambda r: _fmt(r.compile_vs_tool, ".2f")),
    _Column("step ms", "step\nms", lambda r: _fmt(r.step_s * 1e3, ".1f")),
    _Column("/scan", "/scan", lambda r: _fmt(r.step_vs_scan, ".2f"), jax=True),
    _Column("/loop", "/loop", lambda r: _fmt(r.step_vs_loop, ".2f"), jax=True),
    _Column("/tool", "/tool", lambda r: _fmt(r.step_vs_tool, ".2f")),
    _Column("temp MiB", "temp\nMiB",
            lambda r: _fmt(r.temp_bytes / 2**20, ".1f") if r.temp_bytes >= 0 else "-"),
    _Column("state MiB", "state\nMiB",
            lambda r: _fmt(r.state_bytes / 2**20, ".1f") if r.state_bytes >= 0 else "-"),
    _Column("HLO Kchars", "HLO\nKchars", lambda r: _kib(r.program_chars), wide=True),
    _Column("barrier KiB p / c", "barrier KiB\np / c",
            lambda r: f"{_kib(r.barrier_param_bytes)} / {_kib(r.barrier_const_bytes)}",
            grad=True),
    _Column("ops != tool", "ops !=\ntool",
            lambda r: "-" if r.ops_unlike_tool < 0 else str(r.ops_unlike_tool)),
]


# ==========================================================================
# The terminal.


def print_report(
    results: Sequence[Result],
    notes: Sequence[str],
    cfg: BenchConfig,
    file: Any = None,
    *,
    wide: bool = False,
    where: str | None = None,
) -> None:
    """Prints, per block, its title (with the backend that measured) and one table per
    framework, then the notes.

    Args:
      results: what :func:`~stackwise.bench.run_benchmark` returned (or :func:`read_csv`).
      notes: what was skipped and why, printed after the tables.
      cfg: the run's configuration (for the blocks' sizes in the titles).
      file: where to print (default: stdout).
      wide: every column (adds the trace time and the program size), however wide.
      where: the backend named in each title (default: this process's, :func:`backend`).
    """
    file = file or sys.stdout
    where = where or backend()
    for block in dict.fromkeys(r.block for r in results):
        _say(f"{workloads.title(block, cfg)} [on {where}]", file)
        mine = [r for r in results if r.block == block]
        grad = workloads.BLOCKS[block].grad
        for framework in dict.fromkeys(r.framework for r in mine):
            rows = [r for r in mine if r.framework == framework]
            columns = [c for c in _COLUMNS if wide or not (
                c.wide or c.jax and framework != "jax" or c.grad and not grad)]
            cells = [[c.cell(r) for c in columns] for r in rows]
            keep = [i for i, c in enumerate(columns)
                    if c.header in ("n", "variant") or any(row[i] != "-" for row in cells)]
            print_table(
                FRAMEWORK_NAMES.get(framework, framework),
                [columns[i].short for i in keep],
                [[row[i] for i in keep] for row in cells],
                file=file, wide=wide, sections=True,
            )
    for note in notes:
        _say(f"note: {note}", file)


def print_table(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    file: Any = None,
    wide: bool = False,
    sections: bool = False,
) -> None:
    """Prints a table with rich if installed, else as aligned text.

    The first column's text is left-aligned, and so is every column whose header is not a
    number's (``variant``, ``remat``, ``what``); the rest right-aligned. With ``sections``,
    a change of the first column's value starts a new section. ``"\\n"`` in a header
    breaks it in two lines. Fits :data:`WIDTH` columns (wrapping long cells) unless ``wide``.
    """
    file = file or sys.stdout
    left = [i == 0 or h in ("variant", "remat", "what", "target", "met") for i, h in
            enumerate(headers)]
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(title, headers, rows, left, file, sections)
        return
    table = Table(
        title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
        pad_edge=False, collapse_padding=True, show_edge=False,
    )
    for header, is_left in zip(headers, left):
        table.add_column(header, justify="left" if is_left else "right",
                         overflow="fold", no_wrap=wide)
    last = None
    for row in rows:
        if sections and last is not None and row[0] != last:
            table.add_section()
        last = row[0]
        table.add_row(*row)
    console = Console(file=file, width=WIDTH, soft_wrap=False)
    if wide:
        natural = console.measure(table, options=console.options.update_width(10_000))
        console.width = max(WIDTH, natural.maximum)
    console.print(table)
    console.print()


def _print_plain(title, headers, rows, left, file, sections) -> None:
    lines = [h.split("\n") for h in headers]
    depth = max(len(h) for h in lines)
    head = [[""] * (depth - len(h)) + h for h in lines]  # units on the last line
    widths = [max(*(len(s) for s in h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= WIDTH else " "

    def line(cells):
        return gap.join(c.ljust(w) if is_left else c.rjust(w)
                        for c, w, is_left in zip(cells, widths, left)).rstrip()

    print(title, file=file)
    for k in range(depth):
        print(line([h[k] for h in head]), file=file)
    print("-" * (sum(widths) + len(gap) * (len(widths) - 1)), file=file)
    for i, row in enumerate(rows):
        if sections and i and row[0] != rows[i - 1][0]:
            print(file=file)
        print(line(row), file=file)
    print(file=file)


def _say(text: str, file: Any) -> None:
    print(textwrap.fill(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=file)


# ==========================================================================
# Files.

_FIELDS = [f.name for f in dataclasses.fields(Result)]
_SAMPLES = ("compile_samples", "step_samples")  # written as space-separated seconds


def write_csv(results: Sequence[Result], path: str, cfg: BenchConfig | None = None) -> None:
    """Writes one row per result, with the jax version, the machine and the backend on each,
    and, given the run's ``cfg``, its block's title (the sizes and dtype it ran at, as the
    tables' titles say them)."""
    where, measured_on = machine(), backend()
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*_FIELDS, "jax", "machine", "backend",
                                               "block_title"])
        writer.writeheader()
        for r in results:
            row = dataclasses.asdict(r)
            row.update({k: " ".join(f"{v:.6g}" for v in row[k]) for k in _SAMPLES})
            writer.writerow({**row, "jax": jax.__version__, "machine": where,
                             "backend": measured_on,
                             "block_title": workloads.title(r.block, cfg) if cfg else ""})


def read_csv(path: str) -> list[Result]:
    """Reads back a CSV written by :func:`write_csv` (e.g. to re-plot, re-tabulate, or
    compare with targets: ``benchmarks/targets.py``). Columns it does not know are
    ignored; missing ones get the :class:`~stackwise.bench.Result` default."""
    fields = {f.name: f for f in dataclasses.fields(Result)}
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values: dict[str, Any] = {}
            for name, field in fields.items():
                raw = row.get(name)
                if raw is None:
                    continue
                if name in _SAMPLES:
                    values[name] = tuple(float(v) for v in raw.split())
                elif field.type == "float":
                    values[name] = float(raw)
                elif field.type == "int":
                    values[name] = int(raw)
                else:
                    values[name] = raw
            out.append(Result(**values))
    return out


def write_markdown(results: Sequence[Result], cfg: BenchConfig, path: str,
                   *, where: str | None = None) -> None:
    """Writes every column of every block's table as Markdown (for docs), each titled with
    the backend that measured (``where``; default: this process's, :func:`backend`)."""
    headers = [c.header for c in _COLUMNS]
    where = where or backend()
    lines = []
    for block in dict.fromkeys(r.block for r in results):
        lines += [f"**{workloads.title(block, cfg)}** (on {where})", ""]
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(c.cell(r) for c in _COLUMNS) + " |"
                  for r in results if r.block == block]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def machine() -> str:
    """The CPU model, its core count and jax's devices, e.g. for a plot's title."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return f"{cpu}, {os.cpu_count()} cores, {devices}"


def backend() -> str:
    """The backend that measures, its devices and the versions, for every table's header,
    e.g. ``tpu: 1 x TPU v5 lite; jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.21`` (libtpu where it is
    installed).

    >>> import jax
    >>> from stackwise.bench.report import backend
    >>> backend().startswith(jax.default_backend() + ": ")
    True
    """
    devices = jax.devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    versions = [f"jax {jax.__version__}", f"jaxlib {jaxlib_version.__version__}"]
    for name in ("libtpu", "libtpu-nightly"):
        try:
            versions.append(f"libtpu {importlib.metadata.version(name)}")
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{jax.default_backend()}: {len(devices)} x {kinds}; " + ", ".join(versions)

