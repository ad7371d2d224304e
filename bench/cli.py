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

from stackwise.bench import workloads
from stackwise.bench.config import DEC_DTYPES, BenchConfig

__all__ = ["main", "parser"]

_DESCRIPTION = """\
Compile time, step time and memory of n stacked layers under jit(grad(loss)) (training) and
of decoding steps with a donated KV cache (inference), measured side by side in one process:
Python loops, a hand-written lax.scan, stackwise.stack and its adapters, and the frameworks'
own tools (hk.layer_stack, nn.scan, nnx.scan; Equinox's hand-written eqx.filter_vmap +
lax.scan). Frameworks that are not installed are skipped with a note."""

_EPILOG = """\
outputs: a table per block and framework on stdout (columns explained in the project's
benchmarks/README.md), progress on stderr (a bar on a terminal; elsewhere, as in a log file,
lines saying how long the warm-up and each depth's building, compiling and timing took, each
variant's with --one-at-a-time), and in the current directory
stackwise-bench.csv (every measurement and the raw timings, one row per variant and n) and
stackwise-bench.png (compile time, step time and memory against n); --csv/--plot move them
(the repository's .gitignore covers both names). Every output is checked writable before the
run starts. The project's pass/fail targets are checked from the CSV by benchmarks/targets.py.
The exit status is 0 when every selected variant was measured, 1 when one failed (the notes
say which; what was measured is still written), 130 when an interrupt (Ctrl-C, timeout -s INT)
stopped it (the depths measured before it are still written; with --one-at-a-time also the
variants measured at the depth it stopped), 2 for a bad command line.

examples:
  stackwise-bench --quick                 smoke run: the mlp and pattern blocks, every variant,
                                          tiny sizes, fast compiles (about 44 compiles: a
                                          minute or two, more on a busy machine)
  stackwise-bench --quick --blocks transformer,decode   the framework rows, tiny (minutes)
  stackwise-bench --blocks mlp            the core comparison at n=8,24,48,96
  stackwise-bench --variants haiku        every Haiku row (transformer, decode, prefill)
  stackwise-bench --blocks transformer --transformer-n 48 --compile-repeats 7 --rounds 21
  stackwise-bench --blocks decode,prefill --decode-n 24,48 --prefill-n 24,48 --rounds 21
  stackwise-bench --blocks decode --decode-shape 1024:2048:8 --decode-heads 8
  stackwise-bench --blocks decode --decode-dtype bfloat16
  stackwise-bench --blocks decode --decode-shape 2048:8192:1 --decode-heads 16 --one-at-a-time
  stackwise-bench --blocks pattern --compile-repeats 3   the pattern [a, a, b] at n=6,26,60"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Wraps option help at spaces only (not inside ``stackwise-bench.png``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


#: The largest --seed (a 32-bit PRNG seed).
MAX_SEED = 2**32 - 1


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated positive ints, each once, in increasing order."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return tuple(sorted(set(values)))


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _positive(text: str) -> int:
    value = _ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive int, got {text!r}")
    return value[0]


def _shape(text: str) -> tuple[int, int, int]:
    """``D:T:B``: the decode blocks' model width, cache positions and batch."""
    parts = text.split(":")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected D:T:B, three positive ints (model width, cache positions, batch), e.g. "
            f"1024:2048:8, got {text!r}")
    return values


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
                      help="smoke run, a minute or two (it compiles, so longer on a busy "
                      "machine): the mlp and pattern blocks (others with --blocks), every "
                      "variant, tiny sizes, n=2,4 (pattern n=3,5; transformer, decode, prefill "
                      "n=2), 2 rounds, fast warm compiles; the numbers mean little")
    what.add_argument("--blocks", type=_names, default=None, metavar="B[,B]",
                      help=f"blocks to run: {', '.join(workloads.BLOCKS)} (default: all)")
    defaults = BenchConfig()
    for block in workloads.BLOCKS:
        what.add_argument(
            _depth_flag(block), type=_ints, default=None, metavar="N[,N...]",
            dest=f"depths_{block}", help=f"depths of the {block} block (default "
            f"{','.join(map(str, workloads.depths(block, defaults)))})",
        )
    what.add_argument("--decode-shape", type=_shape, default=None, metavar="D:T:B",
                      help=f"the decode and prefill blocks' attention layer: model width D, "
                      f"cache positions T, batch B (default {defaults.dec_d}:"
                      f"{defaults.dec_cache}:{defaults.dec_batch})")
    what.add_argument("--decode-heads", type=_positive, default=None, metavar="H",
                      help=f"its heads, dividing D (default {defaults.dec_heads})")
    what.add_argument("--decode-dtype", choices=DEC_DTYPES, default=None,
                      help="the dtype of its params, cache and tokens, in which it computes "
                      f"(default {defaults.dec_dtype})")
    what.add_argument("--variants", type=_names, default=(), metavar="TEXT[,TEXT...]",
                      help="run only the variants whose name contains one of these, or whose "
                      f"framework ({', '.join(workloads.frameworks())}) is one: e.g. 'haiku' or "
                      "'stackwise remat,lax.scan'")
    how = p.add_argument_group("how to measure")
    how.add_argument("--rounds", type=_positive, default=None, metavar="R",
                     help="timed rounds per depth; the step time is their median (default 7)")
    how.add_argument("--compile-repeats", type=_positive, default=None, metavar="K",
                     help="cold compiles per variant and depth; the fastest is shown (default 1)")
    how.add_argument("--one-at-a-time", action="store_true",
                     help="measure each variant alone, built, compiled, timed and freed before "
                     "the next, so the device holds one variant's params and state at a time "
                     "(for sizes where all of a depth's variants do not fit together; their "
                     "rounds are then not interleaved)")
    how.add_argument("--seed", type=int, default=0,
                     help=f"seed of params, inputs and orders, 0 to {MAX_SEED} (default 0)")
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
    variant failed, 130 when an interrupt (SIGINT) stopped the run (what was measured is
    still reported and written); a bad command line (or one that selects nothing) exits
    with 2.
    """
    p = parser()
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {"seed": args.seed, "variants": args.variants,
                                 "one_at_a_time": args.one_at_a_time}
    if args.blocks is not None:
        overrides["blocks"] = tuple(dict.fromkeys(args.blocks))
    for block, entry in workloads.BLOCKS.items():
        if getattr(args, f"depths_{block}") is not None:
            overrides[entry.depths] = getattr(args, f"depths_{block}")
    for field in ("rounds", "compile_repeats"):
        if getattr(args, field) is not None:
            overrides[field] = getattr(args, field)
    if args.decode_shape is not None:
        overrides.update(zip(("dec_d", "dec_cache", "dec_batch"), args.decode_shape))
    if args.decode_heads is not None:
        overrides["dec_heads"] = args.decode_heads
    if args.decode_dtype is not None:
        overrides["dec_dtype"] = args.decode_dtype
    _check(p, args)
    cfg = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)
    _check_blocks(p, args, cfg)
    # (imported after the command line is read: --help and its errors need no JAX)
    from stackwise.bench.measure import FAILED, INTERRUPTED, run_benchmark
    from stackwise.bench.plot import write_plot
    from stackwise.bench.report import backend, machine, print_report, write_csv, write_markdown

    log = functools.partial(print, file=sys.stderr)
    log(f"stackwise-bench: {backend()}; {machine()}")
    start = time.perf_counter()
    try:
        results, notes = run_benchmark(cfg, progress=not args.no_progress, log=log)
    except ValueError as e:
        flag = "--variants" if cfg.variants else "--blocks"
        p.error(f"{flag}: " + "\n".join(textwrap.fill(line, 100, subsequent_indent="    ")
                                        for line in str(e).splitlines()))
    print_report(results, notes, cfg, wide=args.wide)
    interrupted = any(note.startswith(INTERRUPTED) for note in notes)
    if not results and interrupted:
        what = "a variant" if cfg.one_at_a_time else "a depth"
        log(f"stackwise-bench: stopped by an interrupt before {what} was measured; nothing "
            "written; exit status 130.")
        return 130
    if not results:
        log("stackwise-bench: every selected variant failed (see the notes above); "
            "nothing written.")
        return 1
    failed = [note for note in notes if FAILED in note]
    if args.csv:
        write_csv(results, args.csv, cfg)
        print(f"wrote {os.path.abspath(args.csv)}")
    if args.plot:
        note = write_plot(results, args.plot)
        print(f"note: {note}" if note else f"wrote {os.path.abspath(args.plot)}")
    if args.markdown:
        write_markdown(results, cfg, args.markdown)
        print(f"wrote {os.path.abspath(args.markdown)}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    if interrupted:
        log("stackwise-bench: stopped by an interrupt; what was measured is written above; "
            "exit status 130.")
        return 130
    if failed:
        log(f"stackwise-bench: {len(failed)} variant(s) failed and were left out (the notes "
            "above say which and why); exit status 1.")
        return 1
    return 0


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, before any work, what the run could not use: ``p.error`` (one line naming
    the flag, exit status 2)."""
    if args.blocks is not None:
        unknown = [b for b in args.blocks if b not in workloads.BLOCKS]
        if unknown or not args.blocks:
            what = f"unknown {', '.join(unknown)}" if unknown else "no block named"
            p.error(f"--blocks {','.join(args.blocks)!r}: {what}; choose from "
                    f"{', '.join(workloads.BLOCKS)}")
    if not 0 <= args.seed <= MAX_SEED:
        p.error(f"--seed {args.seed}: expected an integer from 0 to {MAX_SEED}")
    outputs = {}
    for flag, path, default in (("--csv", args.csv, "stackwise-bench.csv"),
                                ("--plot", args.plot, "stackwise-bench.png"),
                                ("--markdown", args.markdown, "stackwise-bench.md")):
        if not path:
            continue
        where = os.path.realpath(path)
        if where in outputs:
            p.error(f"{flag} {path}: also given to {outputs[where]}; give each output its own "
                    "file")
        outputs[where] = flag
        _check_writable(p, flag, path, default)
    if args.plot:
        _check_plot_format(p, args.plot)


def _check_writable(p: argparse.ArgumentParser, flag: str, path: str, default: str) -> None:
    if os.path.isdir(path):
        p.error(f"{flag} {path}: a folder; give a file path, e.g. "
                f"{flag} {os.path.join(path, default)}")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        p.error(f"{flag} {path}: there is no folder {folder}; create it (mkdir -p {folder}) or "
                "give another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        os.path.exists(path) and not os.access(path, os.W_OK)
    ):
        p.error(f"{flag} {path}: not writable; give a path in a folder you can write")


def _check_plot_format(p: argparse.ArgumentParser, path: str) -> None:
    """The figure's format, from the extension as matplotlib reads it (none: PNG)."""
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # the run notes that no plot is written
        return
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        p.error(f"--plot {path}: matplotlib cannot write .{suffix} files; use .png (or one of "
                f"{', '.join('.' + f for f in sorted(formats))})")


def _check_blocks(p: argparse.ArgumentParser, args: argparse.Namespace, cfg: BenchConfig):
    """Each depth flag given belongs to a block that runs, at depths its rows accept; the
    decode blocks' sizes, given, fit them."""
    for flag, given in (("--decode-shape", args.decode_shape),
                        ("--decode-heads", args.decode_heads),
                        ("--decode-dtype", args.decode_dtype)):
        if given is not None and not {"decode", "prefill"} & set(cfg.blocks):
            shown = ":".join(map(str, given)) if flag == "--decode-shape" else given
            p.error(f"{flag} {shown}: neither the decode nor the prefill block is run "
                    f"(--blocks {','.join(cfg.blocks)}); add one to --blocks, or leave {flag} "
                    "out")
    if args.decode_shape is not None or args.decode_heads is not None:
        flag = "--decode-heads" if args.decode_heads is not None else "--decode-shape"
        if cfg.dec_d % cfg.dec_heads:
            p.error(f"{flag}: {cfg.dec_heads} heads do not divide D={cfg.dec_d}; give heads "
                    "that divide the model width")
        if cfg.dec_cache <= cfg.dec_prompt:
            p.error(f"--decode-shape: a cache of {cfg.dec_cache} positions holds no token after "
                    f"the {cfg.dec_prompt}-token prompt (decode writes position "
                    f"{cfg.dec_prompt}); give T > {cfg.dec_prompt}")
    for block, entry in workloads.BLOCKS.items():
        given = getattr(args, f"depths_{block}")
        if given is None:
            continue
        flag = _depth_flag(block)
        if block not in cfg.blocks:
            p.error(f"{flag} {','.join(map(str, given))}: the {block} block is not run "
                    f"(--blocks {','.join(cfg.blocks)}); add it to --blocks, or leave {flag} out")
        if min(given) < entry.min_n:
            p.error(f"{flag} {','.join(map(str, given))}: the {block} block's rows need n >= "
                    f"{entry.min_n} (its pattern has {entry.min_n} layers); give depths of at "
                    f"least {entry.min_n}")
