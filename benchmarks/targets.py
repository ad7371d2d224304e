"""The project's pass/fail targets, checked against a CSV written by ``stackwise-bench``.

``stackwise-bench`` measures and reports; what counts as good enough is the project's
call, and lives here. Each target is a ratio measured within one run (a paired median
with its ~95% interval, see ``stackwise.bench.stats``) and a limit::

    stackwise-bench --blocks mlp --csv mlp.csv
    python benchmarks/targets.py mlp.csv                  # at n=48, else the deepest n
    python benchmarks/targets.py mlp.csv --n 96 --markdown targets.md

A target is met ("yes") when the median is within the limit, "within noise" when the
median misses but the interval reaches the limit (the miss is not significant), else
"NO". Rows marked "reference" have no limit: they show the run's noise floor.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # (stackwise.bench imports JAX: after the command line is parsed)
    from stackwise.bench import Result

#: (adapter, its framework's tool, its framework's Python loop) in the transformer block.
FRAMEWORKS = (
    ("stackwise.haiku.Stack", "hk.layer_stack", "hk loop"),
    ("stackwise.flax.Stack", "nn.scan", "nn loop"),
    ("stackwise.nnx.Stack", "nnx.scan", "nnx loop"),
    ("stackwise.equinox.Stack", "filter_vmap+scan", "eqx loop"),
)


class Target(NamedTuple):
    what: str
    measured: float
    limit: float | None  # None: shown for reference (a noise floor), no target
    low: float = math.nan  # ~95% interval of `measured`, when it is a paired median
    high: float = math.nan


def verdict(t: Target, no: str = "NO") -> str:
    """"yes", "within noise" (the median misses, the interval reaches the limit), ``no``,
    or "-" (nothing measured, or no limit)."""
    if t.limit is None or math.isnan(t.measured):
        return "-"
    if t.measured <= t.limit:
        return "yes"
    return "within noise" if t.low <= t.limit else no


def cells(t: Target, no: str = "NO") -> list[str]:
    """The table row of a target: what, measured (interval), target, met."""
    measured = "-" if math.isnan(t.measured) else f"{t.measured:.3f}"
    if not math.isnan(t.low):
        measured += f" ({t.low:.2f}-{t.high:.2f})"
    limit = "reference" if t.limit is None else f"<= {t.limit:g}"
    return [t.what, measured, limit, verdict(t, no)]


def targets(results: Sequence[Result], target_n: int = 48) -> list[Target]:
    """The targets that ``results`` have the rows for, at depth ``target_n`` (or the
    deepest measured one)."""
    by_key = {(r.block, r.n, r.variant): r for r in results}

    def get(block, n, variant):
        return by_key.get((block, n, variant))

    def ratio(what, row, ref, timing, limit):
        return Target(what, *_interval(row, ref, timing, limit))

    def at(block):
        ns = sorted({r.n for r in results if r.block == block})
        return ns, (target_n if target_n in ns else ns[-1]) if ns else None

    out: list[Target] = []
    mlp_ns, n = at("mlp")
    if mlp_ns:
        sw = get("mlp", n, "stackwise")
        scan, loop = get("mlp", n, "lax.scan (hand)"), get("mlp", n, "loop (separate params)")
        if sw and scan:
            out += [
                ratio(f"mlp n={n}: stackwise compile / hand scan", sw, scan, "compile", 1.05),
                ratio(f"mlp n={n}: stackwise step / hand scan", sw, scan, "step", 1.03),
            ]
        if sw and loop:
            out.append(ratio(f"mlp n={n}: stackwise compile / loop", sw, loop, "compile", 0.25))
        default = get("mlp", n, "stackwise default")
        if default and loop:
            out.append(ratio(f"mlp n={n}: stackwise default (dots remat) step / loop",
                             default, loop, "step", 1.3))
        first, last = get("mlp", mlp_ns[0], "stackwise"), get("mlp", mlp_ns[-1], "stackwise")
        if first and last and first is not last:
            out.append(Target(f"mlp: stackwise compile n={mlp_ns[-1]} / n={mlp_ns[0]}",
                              last.compile_s / first.compile_s, 1.2))
        remat = get("mlp", mlp_ns[-1], "stackwise remat")
        nested = get("mlp", mlp_ns[-1], "stackwise nested")
        if remat and nested and remat.temp_bytes > 0:
            out.append(Target(f"mlp n={mlp_ns[-1]}: temp nested / per-layer remat",
                              nested.temp_bytes / remat.temp_bytes, 1.0))
    pattern_ns, _ = at("pattern")
    for variant in ("stackwise", "stackwise default", "stackwise remat"):
        # Issue 12: a pattern's compile time does not grow with the depth.
        first = get("pattern", pattern_ns[0], variant) if pattern_ns else None
        last = get("pattern", pattern_ns[-1], variant) if pattern_ns else None
        if first and last and first is not last:
            out.append(Target(f"pattern: {variant} compile n={last.n} / n={first.n}",
                              last.compile_s / first.compile_s, 1.3))
    tf_ns, n = at("transformer")
    for adapter, tool, loop in FRAMEWORKS if tf_ns else ():
        # Like for like: the adapter and its framework's tool with the same remat.
        for suffix in ("", " default", " remat"):
            row = get("transformer", n, adapter + suffix)
            ref = get("transformer", n, row.tool) if row and row.tool else None
            if not ref:
                continue
            unlike = row.ops_unlike_tool
            same = ("" if unlike < 0 else " (same program)" if unlike == 0
                    else f" ({unlike} instructions differ)")
            out += [ratio(f"tf n={n}: {row.variant} {w} / {row.tool}{same}", row, ref, w, limit)
                    for w, limit in (("compile", 1.0), ("step", 1.03))]
        # As written: `Stack(Block, n)` (default remat) against the tool's default (none).
        default, plain = get("transformer", n, adapter + " default"), get("transformer", n, tool)
        if default and plain:
            out += [ratio(f"tf n={n}: {adapter} default {w} / {tool} (both as written)",
                          default, plain, w, limit)
                    for w, limit in (("compile", 1.0), ("step", 1.03))]
        # The noise floor: the tool against a second, separately compiled copy of itself.
        control = get("transformer", n, f"{tool} (control)")
        if control and plain:
            out += [ratio(f"tf n={n}: noise: {tool} (control) {w} / {tool}", control, plain,
                          w, None)
                    for w in ("compile", "step")]
        loop_row = get("transformer", n, loop)
        for variant in (adapter, adapter + " default"):
            row = get("transformer", n, variant)
            if row and loop_row:
                out.append(ratio(f"tf n={n}: {variant} compile / {loop}", row, loop_row,
                                 "compile", 0.25))
    return out


def _interval(row: Result, ref: Result, timing: str, limit: float | None):
    from stackwise.bench import paired_interval

    median, low, high = paired_interval(row, ref, timing)
    return median, limit, low, high


def measured_on(path: str) -> str:
    """Where the CSV at ``path`` was measured: its ``backend`` column (stackwise-bench writes
    the backend, its devices and the versions on every row), else, in CSVs written before it
    had one, its ``machine`` column."""
    with open(path, newline="") as f:
        row = next(csv.DictReader(f), None) or {}
    return row.get("backend") or row.get("machine") or "a machine the CSV does not name"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="a CSV written by stackwise-bench (--csv)")
    p.add_argument("--n", type=int, default=48,
                   help="the depth to check (default 48; else the deepest measured)")
    p.add_argument("--markdown", default="", metavar="PATH",
                   help="also write the table as Markdown")
    args = p.parse_args(argv)  # (--help and argument errors: before JAX is imported)
    from stackwise.bench import read_csv
    from stackwise.bench.report import print_table

    found = targets(read_csv(args.csv), args.n)
    if not found:
        print(f"{args.csv}: no rows that a target compares (see FRAMEWORKS and targets()).")
        return 1
    where = measured_on(args.csv)
    print_table(f"Targets ({args.csv}, on {where}; ratios measured within that run)",
                ["what", "measured", "target", "met"], [cells(t) for t in found])
    if args.markdown:
        lines = [f"Targets, on {where}:", "", "| what | measured | target | met |",
                 "|---|---|---|---|"]
        lines += ["| " + " | ".join(cells(t, no="**no**")) + " |" for t in found]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
