"""Decoding K tokens under one ``jax.jit`` on a TPU: does the stacked layout reach the loop's speed
when the token loop is inside the program?

``tpu_decode_hlo.py`` times one jitted decoding step per call. A generate written as one program
(``lax.fori_loop`` over the tokens, the KV cache carried) gives XLA the whole loop: this script
compiles and times such a program for n attention layers (``tpu_decode_hlo.py``'s layer), with
the params and cache in these layouts:

- ``loop``: per-layer params and caches, a Python loop over the layers (what a loop model runs);
- ``Stacked.decode``: stacked params and cache, the layers as a Python loop over static indices
  (``stackwise.stack(...).decode``);
- ``stackwise (scanned)``: stacked params and cache, ``Stacked.apply`` (a ``lax.scan``);
- ``to_serving in the jit``: stacked params and cache given to the program, converted by
  ``stackwise.to_serving`` inside it, before the token loop (one copy of the weights and the
  cache a call), decoded by ``Stacked.apply`` on the serving layout (the loop's program), the
  cache stacked again (``stackwise.from_serving``) at the end.

``--auto-cache`` gives the cache the layout the compiler chooses (``Layout.AUTO``) in and
out of the program: with the default layout XLA:TPU keeps it in another one inside the token
loop and copies it in and out each call, in every layout (``tpu_decode.md``, sixteenth
session). Each row: the compiled program's temp memory, its count of asynchronous slices
(``slice-start``: on a TPU, XLA's prefetch of a weight into VMEM while the layer before
computes), and with ``--time R`` the median over R calls of the time per token, its ratio to the
loop's, tokens per second and the share of the HBM bandwidth (weights and whole cache read once a
token, over 819 GB/s). Without a chip it compiles for a v5e as ``tpu_decode_hlo.py`` says::

    python benchmarks/tpu_generate.py --n 32 --shapes 1536:1536:2 --tokens 32 --time 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time

import tpu_decode_hlo as hlo

VARIANTS = ("loop", "Stacked.decode", "stackwise (scanned)", "to_serving in the jit")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=hlo.positive, default=32, help="layers (default 32)")
    p.add_argument("--shapes", type=hlo.triples("D:T:B"), default="1536:1536:2",
                   help="D:T:B triples (model width, cache positions, batch), comma-separated")
    p.add_argument("--heads", type=hlo.positive, default=8, help="attention heads")
    p.add_argument("--dtypes", type=hlo.dtypes, default="float32,bfloat16",
                   help="params' and cache's dtypes")
    p.add_argument("--tokens", type=hlo.positive, default=32,
                   help="tokens decoded by one call (the program's loop; default 32)")
    p.add_argument("--variants", default="", metavar="TEXT[,TEXT...]",
                   help="only the variants whose name contains one of these "
                   f"({', '.join(VARIANTS)})")
    p.add_argument("--time", type=hlo.nonnegative, default=0, metavar="R",
                   help="also time each program, R calls (needs the chip attached; default 0)")
    p.add_argument("--auto-cache", action="store_true",
                   help="give the cache the layout the compiler chooses (Layout.AUTO) in and "
                   "out, and keep it there between calls (default: the default layout, which "
                   "XLA:TPU copies into another one around the token loop)")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    args = p.parse_args(argv)
    for selector in filter(None, args.variants.split(",")):
        if not any(selector in name for name in VARIANTS):
            p.error(f"argument --variants: {selector!r} matches no variant; the variants are: "
                    f"{', '.join(VARIANTS)}")
    for d, t, _ in args.shapes:
        if d % args.heads:
            p.error(f"argument --heads: {args.heads} heads do not divide D={d} of --shapes")
        if args.tokens * (args.time + 1) >= t:
            p.error(f"argument --tokens: {args.time + 1} calls of {args.tokens} tokens run past "
                    f"the cache's {t} positions of --shapes; fewer tokens or calls")
    return args


def programs(n: int, d: int, heads: int, tokens: int) -> dict:
    """variant -> (generate(params, cache, h, pos) -> (h, cache), layout of its inputs)."""
    import jax

    import stackwise

    steps = hlo.variants(n, d, heads)
    loop = steps["loop (= serving layout)"][0]
    layer = stackwise.stack(None, lambda p, c, h, pos: _layer(steps, p, c, h, pos), n,
                            with_state=True, remat=False)

    def generate(step):
        def run(ps, cache, h, pos):
            def body(i, carry):
                return step(ps, carry[1], carry[0], pos + i)
            return jax.lax.fori_loop(0, tokens, body, (h, cache))
        return run

    def served(ps, cache, h, pos):
        h, cache = generate(layer.apply)(stackwise.to_serving(ps), stackwise.to_serving(cache),
                                         h, pos)
        return h, stackwise.from_serving(cache)

    return {
        "loop": (generate(loop), "layers"),
        "Stacked.decode": (generate(layer.decode), "stacked"),
        "stackwise (scanned)": (generate(layer.apply), "stacked"),
        "to_serving in the jit": (served, "stacked"),
    }


def _layer(steps: dict, p, cache, h, pos):
    """tpu_decode_hlo.py's layer: one layer of its loop."""
    h, (cache,) = steps["loop (= serving layout)"][0]([p], [cache], h, pos)
    return h, cache


def measure(n: int, d: int, t: int, b: int, heads: int, dtype: str, tokens: int, dev, *,
            rounds: int, only: tuple[str, ...], auto_cache: bool = False) -> list[dict]:
    """One row per variant: the compiled program's facts and, with ``rounds``, its time.
    ``auto_cache``: the cache in the layout the compiler chooses (``Layout.AUTO``), in and out."""
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.SingleDeviceSharding(dev)
    dt = jnp.dtype(dtype)
    layer_cache_bytes = b * t * d * dt.itemsize  # (one layer's K or V: B, T, heads, D/heads)
    rows = []
    for name, (run, kind) in programs(n, d, heads, tokens).items():
        if only and not any(o in name for o in only):
            continue
        ps, cache, h, pos = hlo.inputs(n, d, t, b, heads, dtype, sharding, kind == "layers")
        row = {"variant": name, "dtype": dtype, "D": d, "T": t, "B": b,
               "cache layout": "AUTO" if auto_cache else "default"}
        placed = hlo.placement(sharding, cache, auto=True) if auto_cache else {}
        begin = time.perf_counter()
        compiled = hlo.compiled_or_why(jax.jit(run, donate_argnums=1, **placed), ps, cache, h,
                                       pos)
        if isinstance(compiled, str):
            rows.append({**row, "slice-start": compiled})
            print(json.dumps(rows[-1]), flush=True)
            continue
        text, memory = compiled.as_text(), compiled.memory_analysis()
        row = {**row, "compile s": time.perf_counter() - begin,
               "slice-start": text.count("slice-start"),
               "temp MiB": memory.temp_size_in_bytes / 2**20}
        if rounds:
            token_s = time_calls(compiled, (ps, cache, h, pos), rounds, tokens)
            row.update({"ms/token": token_s * 1e3, "tokens/s": b / token_s,
                        "HBM share": hlo.touched_bytes(n, d, dt.itemsize, layer_cache_bytes)
                        / hlo.HBM_BYTES_PER_S / token_s})
        rows.append(row)
        print(json.dumps(row), flush=True)
    loop = next((r for r in rows if r["variant"] == "loop" and "ms/token" in r), None)
    for r in rows:
        if loop and "ms/token" in r:
            r["/loop"] = r["ms/token"] / loop["ms/token"]
    return rows


def time_calls(compiled, shapes: tuple, rounds: int, tokens: int) -> float:
    """The median over ``rounds`` calls of the seconds per token, after one warm-up call; each
    call decodes ``tokens`` tokens from the cache the last one returned (donated)."""
    import jax
    import numpy as np

    keys = (jax.random.fold_in(jax.random.key(0), i) for i in itertools.count())
    ps, cache, h, _ = shapes
    ps, h = jax.tree.map(  # (made on the device: a host's random numbers take seconds here)
        lambda s: jax.random.normal(next(keys), s.shape, s.dtype) / math.sqrt(s.shape[-1]),
        (ps, h))
    ps, cache, h = jax.device_put(
        (ps, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), cache), h),
        compiled.input_formats[0][:3])
    times = []
    for call in range(rounds + 1):
        start = time.perf_counter()
        out, cache = compiled(ps, cache, h, np.int32(call * tokens))
        jax.block_until_ready((out, cache))
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # (before JAX is imported: --help answers at once)
    dev = hlo.device_for(args.time)
    only = tuple(v for v in args.variants.split(",") if v)
    rows = []
    for d, t, b in args.shapes:
        for dtype in args.dtypes:
            rows += measure(args.n, d, t, b, args.heads, dtype, args.tokens, dev,
                            rounds=args.time, only=only, auto_cache=args.auto_cache)
    timed = (f"; timed: median of {args.time} calls, HBM share = (weights + cache bytes) / "
             f"{hlo.HBM_BYTES_PER_S / 1e9:.0f} GB/s / time per token" if args.time else "")
    hlo.report(rows, f"{hlo.compiled_for(dev)}; n={args.n}, {args.heads} heads, "
               f"{args.tokens} tokens a call{timed}", args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
