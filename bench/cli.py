"""The ``stackwise-bench`` command (also ``python -m stackwise.bench``)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import jax

from stackwise.bench import workloads
from stackwise.bench.config import BenchConfig
from stackwise.bench.measure import run_benchmark
from stackwise.bench.plot import write_plot
from stackwise.bench.report import machine, print_report, write_csv, write_markdown

__all__ = ["main", "parser"]

_DESCRIPTION = """\
Compile time, step time and memory of n stacked layers under jit(grad(loss)) (training) and
of decoding steps with a donated KV cache (inference), measured side by side in one process:
Python loops, a hand-written lax.scan, stackwise.stack and its adapters, and the frameworks'
own tools (hk.layer_stack, nn.scan, nnx.scan; Equinox's hand-written eqx.filter_vmap +
lax.scan). Frameworks that are not installed are skipped with a note."""

_EPILOG = """\
outputs: a table per block and framework on stdout (columns explained in the project's
benchmarks/README.md), progress on stderr, and in the current directory
stackwise-bench.csv (every measurement and the raw timings, one row per variant and n) and
stackwise-bench.png (compile time, step time and memory against n); --csv/--plot move them.
The project's pass/fail targets are checked from the CSV by benchmarks/targets.py.

examples:
  stackwise-bench --quick                 smoke run: tiny sizes, every variant (minutes)
  stackwise-bench --blocks mlp            the core comparison at n=8,24,48,96
  stackwise-bench --variants haiku        every Haiku row (transformer, decode, prefill)
  stackwise-bench --blocks transformer --transformer-n 48 --compile-repeats 7 --rounds 21
  stackwise-bench --blocks decode,prefill --decode-n 24,48 --prefill-n 24,48 --rounds 21
  stackwise-bench --blocks pattern --compile-repeats 3   the pattern [a, a, b] at n=6,26,60"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Wraps option help at spaces only (not inside ``stackwise-bench.png``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _positive(text: str) -> int:
    value = _ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive int, got {text!r}")
    return value[0]


def _depth_flag(block: str) -> str:
    """``--n`` for the mlp block (the first), ``--<block>-n`` for the others."""
    return "--n" if block == "mlp" else f"--{block}-n"


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    p = argparse.ArgumentParser(
        prog="stackwise-bench", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    what = p.add_argument_group("what to run")
    what.add_argument("--quick", action="store_true",
                      help="smoke run: tiny sizes, n=2,4 (transformer, decode, prefill n=2; "
                      "pattern n=3,5), 2 rounds")
    what.add_argument("--blocks", type=_names, default=None, metavar="B[,B]",
                      help=f"blocks to run: {', '.join(workloads.BLOCKS)} (default: all)")
    defaults = BenchConfig()
    for block in workloads.BLOCKS:
        what.add_argument(
            _depth_flag(block), type=_ints, default=None, metavar="N[,N...]",
            dest=f"depths_{block}", help=f"depths of the {block} block (default "
            f"{','.join(map(str, workloads.depths(block, defaults)))})",
        )
    what.add_argument("--variants", type=_names, default=(), metavar="TEXT[,TEXT...]",
                      help="run only the variants whose name contains one of these, or whose "
                      f"framework ({', '.join(workloads.frameworks())}) is one: e.g. 'haiku' or "
                      "'stackwise remat,lax.scan'")
    how = p.add_argument_group("how to measure")
    how.add_argument("--rounds", type=_positive, default=None, metavar="R",
                     help="timed rounds per depth; the step time is their median (default 7)")
    how.add_argument("--compile-repeats", type=_positive, default=None, metavar="K",
                     help="cold compiles per variant and depth; the fastest is shown (default 1)")
    how.add_argument("--seed", type=int, default=0, help="seed of params, inputs and orders")
    out = p.add_argument_group("outputs")
    out.add_argument("--csv", default="stackwise-bench.csv", metavar="PATH",
                     help="the CSV (default: ./stackwise-bench.csv; '' for none)")
    out.add_argument("--plot", default="stackwise-bench.png", metavar="PATH",
                     help="the PNG, needs matplotlib (default: ./stackwise-bench.png; '' for none)")
    out.add_argument("--markdown", default="", metavar="PATH",
                     help="also write the tables, every column, as Markdown")
    out.add_argument("--wide", action="store_true",
                     help="every column in the terminal too (trace time, program size)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``stackwise-bench`` command; ``argv`` defaults to ``sys.argv[1:]``.

    Returns the exit status: 0 when something was measured, 1 when every selected
    variant failed; a bad command line (or one that selects nothing) exits with 2.
    """
    p = parser()
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {"seed": args.seed, "variants": args.variants}
    if args.blocks:
        unknown = [b for b in args.blocks if b not in workloads.BLOCKS]
        if unknown:
            p.error(f"--blocks: unknown {', '.join(unknown)}; choose from "
                    f"{', '.join(workloads.BLOCKS)}")
        overrides["blocks"] = args.blocks
    for block, entry in workloads.BLOCKS.items():
        if getattr(args, f"depths_{block}") is not None:
            overrides[entry.depths] = getattr(args, f"depths_{block}")
    for field in ("rounds", "compile_repeats"):
        if getattr(args, field) is not None:
            overrides[field] = getattr(args, field)
    cfg = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)
    log = functools.partial(print, file=sys.stderr)
    log(f"stackwise-bench: jax {jax.__version__} on {machine()}")
    start = time.perf_counter()
    try:
        results, notes = run_benchmark(cfg, progress=not args.no_progress, log=log)
    except ValueError as e:
        p.error("\n".join(textwrap.fill(line, 100, subsequent_indent="    ")
                          for line in str(e).splitlines()))
    print_report(results, notes, cfg, wide=args.wide)
    if not results:
        log("stackwise-bench: every selected variant failed (see the notes above); "
            "nothing written.")
        return 1
    if args.csv:
        write_csv(results, args.csv)
        print(f"wrote {os.path.abspath(args.csv)}")
    if args.plot:
        note = write_plot(results, args.plot)
        print(f"note: {note}" if note else f"wrote {os.path.abspath(args.plot)}")
    if args.markdown:
        write_markdown(results, cfg, args.markdown)
        print(f"wrote {os.path.abspath(args.markdown)}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 0
