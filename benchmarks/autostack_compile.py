"""Compile time of a loop model run by ``stackwise.autostack``, against a hand-written
``stackwise.stack`` of the same block and the loop itself, at one depth (n=48): issue 40's
"within 1.2x a hand-written Stack", made for a TPU (``benchmarks/on_tpu.sh``'s ``autostack``
part) and run on any backend.

The rows are ``stackwise-bench``'s pure-JAX rows of a block (``bench/workloads/core.py``, the
same builders): ``loop (separate params)``, a Python loop over per-layer params;
``stackwise``, ``stackwise.stack`` of the block, remat off; ``stackwise.autostack``, the same
loop, unmodified, through ``stackwise.autostack`` (remat off). A compile is
``jax.jit(jax.grad(loss)).lower(params, x).compile()``, cold (JAX's caches cleared, garbage
collected), tracing and lowering included, as the bench's compile column.

After one warm-up compile each, ``--pairs`` rounds compile ``stackwise`` and
``stackwise.autostack`` once each, alternating which goes first; **compile s** is the median
of a row's compiles and **/ stackwise** the median of the rounds' ratios (the loop's: of its
median). The loop compiles first, ``--loop-compiles`` times, in a child process given
``--loop-seconds`` in all (one process holds a TPU: the child runs before this one starts
JAX's backend); a loop slower than that is stopped and its row says so. **build s** is the
time to make a row's params and function: for ``stackwise.autostack``, tracing the loop,
finding its run and stacking the params (the ``autostack(...)`` call), not in the compile.
**HLO Kchars**: the lowered program's size. Run from the repository root:

    python benchmarks/autostack_compile.py --markdown autostack_tpu.md

(the transformer block, then the MLP block; ``--blocks mlp --n 4 --pairs 1`` to check it
runs, in seconds.)
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import subprocess
import sys
import time

from tpu_decode_hlo import nonnegative, positive, table  # benchmarks/tpu_decode_hlo.py

LOOP, STACK, AUTO = "loop (separate params)", "stackwise", "stackwise.autostack"
BLOCKS = ("transformer", "mlp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=blocks, default=list(BLOCKS),
                   help="stackwise-bench's blocks, comma-separated (default transformer,mlp)")
    p.add_argument("--n", type=positive, default=48, help="the depth (default 48)")
    p.add_argument("--pairs", type=positive, default=5,
                   help="rounds compiling stackwise and autostack once each (default 5)")
    p.add_argument("--loop-compiles", type=nonnegative, default=1,
                   help="cold compiles of the loop (default 1; 0: no loop row)")
    p.add_argument("--loop-seconds", type=positive, default=60,
                   help="a block's loop child process stops after this long (default 60)")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    p.add_argument("--loop-only", action="store_true", help=argparse.SUPPRESS)  # the child
    return p.parse_args(argv)


def blocks(value: str) -> list[str]:
    """An argparse type: comma-separated names of :data:`BLOCKS`."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in BLOCKS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected blocks among {', '.join(BLOCKS)}, got {value!r}")
    return names


def cases(block: str) -> dict:
    from stackwise.bench import BenchConfig
    from stackwise.bench.workloads import cases as block_cases

    return {c.name: c for c in block_cases(block, BenchConfig(), []) if c.name in (LOOP, STACK,
                                                                                   AUTO)}


def built(case, n: int) -> tuple[tuple, float]:
    """``((params, x, loss), seconds to build)``."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(case.build(n))
    return out, time.perf_counter() - start


def cold_compile(build: tuple) -> tuple[float, int]:
    """Seconds of one cold compile of ``jit(grad(loss))``, and the lowered program's chars."""
    import jax

    params, x, loss = build
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss), keep_unused=True).lower(params, x)
    lowered.compile()
    return time.perf_counter() - start, len(lowered.as_text())


def loop_child(args: argparse.Namespace) -> None:
    """The child: the loop's compiles, a JSON line each (read as they come: a stopped child
    leaves the lines it wrote)."""
    build, seconds = built(cases(args.blocks[0])[LOOP], args.n)
    print(json.dumps({"build": seconds}), flush=True)
    for _ in range(args.loop_compiles):
        seconds, chars = cold_compile(build)
        print(json.dumps({"seconds": seconds, "chars": chars}), flush=True)


def loop_row(args: argparse.Namespace, block: str) -> dict:
    """The loop's compiles, from a child process given ``--loop-seconds``."""
    command = [sys.executable, __file__, "--loop-only", "--blocks", block, "--n",
               str(args.n), "--loop-compiles", str(args.loop_compiles)]
    stopped = False
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=args.loop_seconds)
        out = done.stdout
        if done.returncode:
            raise RuntimeError(f"the loop's child process failed:\n{done.stderr[-3000:]}")
    except subprocess.TimeoutExpired as e:
        out, stopped = e.stdout or "", True
        out = out.decode() if isinstance(out, bytes) else out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    compiles = [line["seconds"] for line in lines if "seconds" in line]
    return {"build": next((line["build"] for line in lines if "build" in line), None),
            "compiles": compiles, "chars": next((line["chars"] for line in lines
                                                 if "chars" in line), None),
            "stopped": stopped}


def measure_scans(args: argparse.Namespace, block: str) -> dict[str, dict]:
    """``stackwise`` and ``stackwise.autostack``: a warm-up compile each, then ``--pairs``
    rounds of one cold compile each, alternating which goes first."""
    found = cases(block)
    rows = {}
    for name in (STACK, AUTO):
        build, seconds = built(found[name], args.n)
        _, chars = cold_compile(build)  # (warm-up)
        rows[name] = {"build": seconds, "compiles": [], "chars": chars, "built": build}
    for r in range(args.pairs):
        for name in (STACK, AUTO) if r % 2 == 0 else (AUTO, STACK):
            rows[name]["compiles"].append(cold_compile(rows[name]["built"])[0])
    return rows


def table_rows(loop: dict | None, scans: dict[str, dict], args: argparse.Namespace) -> list:
    stack = scans[STACK]["compiles"]
    out = []
    if loop is not None:
        seconds = loop["compiles"]
        if seconds:
            compile_s = f"{statistics.median(seconds):.2f}"
            ratio = f"{statistics.median(seconds) / statistics.median(stack):.2f}"
        else:
            compile_s, ratio = f"> {args.loop_seconds} (stopped)", "-"
        out.append(_row(LOOP, compile_s, seconds, ratio, loop["build"], loop["chars"]))
    for name in (STACK, AUTO):
        seconds = scans[name]["compiles"]
        ratio = statistics.median(a / s for a, s in zip(seconds, stack))
        out.append(_row(name, f"{statistics.median(seconds):.2f}", seconds, f"{ratio:.2f}",
                        scans[name]["build"], scans[name]["chars"]))
    return out


def _row(name: str, compile_s: str, seconds: list, ratio: str, build, chars) -> dict:
    return {"variant": name, "remat": "off", "compile s": compile_s,
            "compiles s": " ".join(f"{s:.2f}" for s in seconds) or "-",
            "/ stackwise": ratio, "build s": "-" if build is None else f"{build:.2f}",
            "HLO Kchars": "-" if chars is None else f"{chars / 1000:.0f}"}


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """Measures each block; returns its table's rows by block."""
    args = parse_args(argv)
    if args.loop_only:
        loop_child(args)
        return {}
    # Every loop first, each in a child, before this process's JAX starts (it holds a TPU).
    loops = {block: loop_row(args, block) if args.loop_compiles else None
             for block in args.blocks}
    from _devices import header

    command = shlex.join(["python", "benchmarks/autostack_compile.py", *sys.argv[1:]])
    out = {}
    for i, block in enumerate(args.blocks):
        scans = measure_scans(args, block)
        out[block] = table_rows(loops[block], scans, args)
        ratios = sorted(a / s for a, s in zip(scans[AUTO]["compiles"],
                                              scans[STACK]["compiles"]))
        title = header(f"autostack: compile time at n={args.n} ({block} block)")
        text = (table(out[block], f"{title}; `{command}`") + f"\nautostack / stackwise, "
                f"{len(ratios)} interleaved pairs: median {statistics.median(ratios):.2f}, "
                f"range {ratios[0]:.2f}-{ratios[-1]:.2f}\n")
        print(text, flush=True)
        if args.markdown:  # (each block as it ends: a run cut short keeps the blocks done)
            with open(args.markdown, "w" if i == 0 else "a") as f:
                f.write(text if i == 0 else "\n" + text)
    return out


if __name__ == "__main__":
    main()
