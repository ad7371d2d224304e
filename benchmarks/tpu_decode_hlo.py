"""Where a scanned decode step's time goes on a TPU, read from the compiled program.

Compiles one decoding step (one token, n attention layers, the KV cache donated: the
``decode`` block of ``stackwise-bench``) for a TPU v5e and reads XLA's optimized HLO: which
buffers the size of one layer's cache the program makes inside its loop over the layers
(a dynamic slice of the stacked cache, a copy into another layout), in which memory (HBM,
or XLA's memory space 1: on a TPU the on-chip VMEM), the bytes they hold per token, the
stacked weights converted to bfloat16 before the loop, and the compiler's temp memory.
Nothing runs, so no chip is needed: on a machine without one, libtpu compiles for a v5e
described by name (compile-only devices). Install the libtpu that JAX's ``tpu`` extra pins
(``pip install 'libtpu==0.0.42.*'`` for jax 0.10.2) and run

    TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost JAX_PLATFORMS=cpu \\
        python benchmarks/tpu_decode_hlo.py --markdown benchmarks/results/tpu_decode_hlo.md

(on a TPU host, leave out the three variables: it compiles for the chip it has). On a host
with the chip, ``--time R`` also runs each program: the median over R rounds of the time per
decoding step (16 tokens a round, the cache donated from step to step), its ratio to the
loop's, tokens per second (B per step) and the share of the HBM bandwidth it reaches: the
bytes every step must read (the weights and the whole cache, unpadded) over 819 GB/s (a
v5e's), divided by the measured time. ``--profile DIR`` writes a
``jax.profiler`` trace of the timed rounds. Rows:

- ``loop``: a Python loop over per-layer params and caches (what a loop model runs, and
  what ``stackwise.to_serving`` gives ``Stacked.apply``: the same program);
- ``unrolled, set back``: a Python loop over static layer indices of the stacked params
  and cache, each layer given its slice of the cache and its new slice set back
  (``cache.at[i].set(...)``);
- ``unrolled, writes into the stacked cache``: the same loop, each layer writing its new keys
  and values into the stacked cache at ``(i, pos)`` and reading its row after (what
  ``stackwise.stack(..., unroll=True)`` does for a layer that keeps its state's layout);
- ``stackwise``: ``stackwise.stack(..., with_state=True)``, the scanned form;
- ``lax.scan, cache in carry``: a hand-written scan slicing layer i's cache out of the carry
  and writing it back;
- ``lax.scan, writes into the carry``: a hand-written scan whose layer writes its new keys
  and values straight into the stacked cache in the carry and reads its slice of it, with
  the default layout of the cache and with ``Layout.AUTO`` (the compiler picks the layout
  the cache is kept in).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shlex
import sys


def positive(value: str) -> int:
    """An argparse type: an integer of 1 or more."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def nonnegative(value: str) -> int:
    """An argparse type: an integer of 0 or more."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer of 0 or more, got {value!r}")
    return int(value)


def triples(names: str):
    """An argparse type: comma-separated ``a:b:c`` triples of positive integers, named by
    ``names`` (e.g. ``"D:T:B"``) in the message."""

    def parse(value: str) -> list[tuple[int, int, int]]:
        out = []
        for item in value.split(","):
            parts = item.split(":")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise argparse.ArgumentTypeError(
                    f"expected {names} triples of positive integers, comma-separated "
                    f"(e.g. 512:1024:8), got {item!r} in {value!r}")
            out.append(tuple(int(p) for p in parts))
        return out

    return parse


def dtypes(value: str) -> list[str]:
    """An argparse type: float32 and/or bfloat16, comma-separated."""
    names = value.split(",")
    for name in names:
        if name not in ("float32", "bfloat16"):
            raise argparse.ArgumentTypeError(
                f"expected float32 and/or bfloat16, comma-separated, got {name!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=positive, default=24, help="layers (default 24)")
    p.add_argument("--shapes", type=triples("D:T:B"),
                   default="256:512:8,512:1024:8,1024:1024:8,512:2048:32,2048:8192:1",
                   help="D:T:B triples (model width, cache positions, batch), comma-separated")
    p.add_argument("--heads", type=positive, default=8, help="attention heads (head size D/heads)")
    p.add_argument("--dtypes", type=dtypes, default="float32,bfloat16",
                   help="params' and cache's dtypes")
    p.add_argument("--variants", default="", metavar="TEXT[,TEXT...]",
                   help="only the variants whose name contains one of these (default: all)")
    p.add_argument("--time", type=nonnegative, default=0, metavar="R",
                   help="also time each program, R rounds (needs the chip attached; default 0)")
    p.add_argument("--profile", default="", metavar="DIR",
                   help="with --time, write a jax.profiler trace of the timed rounds to DIR")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    args = p.parse_args(argv)
    if args.profile and not args.time:
        p.error("argument --profile: traces the timed rounds, so it needs --time R (R >= 1)")
    for d, _, _ in args.shapes:
        if d % args.heads:
            p.error(f"argument --heads: {args.heads} heads do not divide D={d} of --shapes")
    return args


def tpu_device():
    """The attached TPU, or a compile-only v5e (libtpu, no chip)."""
    import jax
    from jax.experimental import topologies

    if jax.default_backend() == "tpu":
        return jax.devices()[0]
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:1x1", chips_per_host_bounds=[1, 1, 1])
    return topology.devices[0]


def device_for(timed: int):
    """:func:`tpu_device`, after refusing ``--time`` (``timed``) on a host without a TPU."""
    import jax

    if timed and jax.default_backend() != "tpu":
        raise SystemExit("--time runs the programs, so it needs a TPU attached; this host "
                         f"has none (JAX's backend is {jax.default_backend()!r}). Leave out "
                         "--time here: the programs are compiled for a v5e without running.")
    return tpu_device()


def compiled_for(dev) -> str:
    """What the programs were compiled for, and with which jax, jaxlib and libtpu."""
    from importlib.metadata import PackageNotFoundError, version

    import jax
    import jaxlib

    try:
        libtpu = version("libtpu")
    except PackageNotFoundError:  # a TPU host whose libtpu came another way
        libtpu = "unknown"
    attached = "attached" if jax.default_backend() == "tpu" else "compile-only"
    return (f"Compiled for {dev.device_kind} ({attached}), jax {jax.__version__}, jaxlib "
            f"{jaxlib.__version__}, libtpu {libtpu}")


def variants(n: int, d: int, heads: int):
    """name -> (step, params kind, cache kind, cache layout AUTO?)."""
    import jax
    import jax.numpy as jnp

    import stackwise

    def linear(p, h):
        return h @ p["w"] + p["b"][None, None, :]

    def attend(q, k_cache, v_cache, pos):
        b, t, h, dh = q.shape
        logits = jnp.einsum("bthd,bshd->bhts", q, k_cache) / math.sqrt(dh)
        positions = jnp.arange(k_cache.shape[1])[None, None, None, :]
        seen = positions <= (pos + jnp.arange(t))[None, None, :, None]
        weights = jax.nn.softmax(jnp.where(seen, logits, jnp.finfo(logits.dtype).min), -1)
        return jnp.einsum("bhts,bshd->bthd", weights, v_cache).reshape(b, t, h * dh)

    def qkv_of(p, h):
        b, t, _ = h.shape
        return (a.reshape(b, t, heads, d // heads) for a in jnp.split(linear(p["qkv"], h), 3, -1))

    def layer(p, cache, h, pos):  # the bench's decode layer
        q, k, v = qkv_of(p, h)
        k_cache, v_cache = (
            jax.lax.dynamic_update_slice_in_dim(cache[c], new.astype(cache[c].dtype), pos, 1)
            for c, new in (("k", k), ("v", v)))
        return h + linear(p["out"], attend(q, k_cache, v_cache, pos)), {"k": k_cache, "v": v_cache}

    def loop(ps, caches, h, pos):
        new = []
        for p, c in zip(ps, caches):
            h, c = layer(p, c, h, pos)
            new.append(c)
        return h, new

    stacked = stackwise.stack(None, layer, n, with_state=True, remat=False)
    unrolled = stackwise.stack(None, layer, n, with_state=True, remat=False, unroll=True)

    def carry(ps, cache, h, pos):
        def body(carry, inputs):
            (h, cache), (p, i) = carry, inputs
            mine = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), cache)
            h, mine = layer(p, mine, h, pos)
            cache = jax.tree.map(lambda a, c: jax.lax.dynamic_update_index_in_dim(a, c, i, 0),
                                 cache, mine)
            return (h, cache), None

        return jax.lax.scan(body, (h, cache), (ps, jnp.arange(n)))[0]

    def writes_into_carry(ps, cache, h, pos):
        def body(carry, inputs):
            (h, k_all, v_all), (p, i) = carry, inputs
            q, k, v = qkv_of(p, h)
            zero = jnp.zeros((), jnp.int32)
            at = (i, zero, pos, zero, zero)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
            y = attend(q, jax.lax.dynamic_index_in_dim(k_all, i, 0, False),
                       jax.lax.dynamic_index_in_dim(v_all, i, 0, False), pos)
            return (h + linear(p["out"], y), k_all, v_all), None

        (h, k_all, v_all), _ = jax.lax.scan(body, (h, cache["k"], cache["v"]), (ps, jnp.arange(n)))
        return h, {"k": k_all, "v": v_all}

    def unrolled_writes(ps, cache, h, pos):
        k_all, v_all = cache["k"], cache["v"]
        zero = jnp.zeros((), jnp.int32)
        for i in range(n):  # (a static layer index: static slices, no loop)
            p = jax.tree.map(lambda a, i=i: a[i], ps)
            q, k, v = qkv_of(p, h)
            at = (jnp.int32(i), zero, pos, zero, zero)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
            h = h + linear(p["out"], attend(q, k_all[i], v_all[i], pos))
        return h, {"k": k_all, "v": v_all}

    def unrolled_set(ps, cache, h, pos):
        for i in range(n):  # (a static layer index)
            p = jax.tree.map(lambda a, i=i: a[i], ps)
            h, mine = layer(p, jax.tree.map(lambda a, i=i: a[i], cache), h, pos)
            cache = jax.tree.map(lambda a, c, i=i: a.at[i].set(c), cache, mine)
        return h, cache

    return {
        "loop (= serving layout)": (loop, "layers", False),
        "unrolled, set back": (unrolled_set, "stacked", False),
        "unrolled, writes into the stacked cache": (unrolled_writes, "stacked", False),
        "stackwise": (stacked.apply, "stacked", False),
        "stackwise, unroll=True": (unrolled.apply, "stacked", False),
        "stackwise, to_serving": (stacked.apply, "served", False),
        "lax.scan, cache in carry": (carry, "stacked", False),
        "lax.scan, writes into the carry": (writes_into_carry, "stacked", False),
        "the same, Layout.AUTO cache": (writes_into_carry, "stacked", True),
    }


def per_layer_buffers(hlo: str, one_layer: str) -> list[str]:
    """The instructions that make a buffer the size of one layer's cache: a fusion holding a
    dynamic slice, or a copy (a change of layout)."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*%(\S+) = (\w+\[[\d,]+\])\{([^}]*)\} (copy|fusion)\(", line)
        if not m:
            continue
        name, shape, layout, op = m.groups()
        minor_to_major, _, tiling = layout.partition(":")
        dims = shape.split("[")[1].rstrip("]").split(",")
        if ",".join(d for d in dims if d != "1") != one_layer:
            continue
        if op == "copy" or "dynamic-slice" in name:
            # S(1): XLA's alternate memory space, the TPU's on-chip VMEM; else HBM
            found.append(f"{op} {{{minor_to_major}}} {'VMEM' if 'S(1)' in tiling else 'HBM'}")
    return found


#: A v5e chip's HBM bandwidth, bytes per second (the share column's denominator).
HBM_BYTES_PER_S = 819e9
#: Decoding steps per timed round.
TOKENS_PER_ROUND = 16


def inputs(n: int, d: int, t: int, b: int, heads: int, dtype: str, sharding, per_layer: bool
           ) -> tuple:
    """A decoding step's inputs as shapes placed by ``sharding``: the params and the K and V
    caches (lists of n per-layer trees if ``per_layer``, else stacked trees of n layers), the
    tokens ``h`` (B, 1, D) and the position."""
    import jax
    import jax.numpy as jnp

    def sds(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)

    def params(lead):
        return {"qkv": {"w": sds((*lead, d, 3 * d)), "b": sds((*lead, 3 * d))},
                "out": {"w": sds((*lead, d, d)), "b": sds((*lead, d))}}

    cache_shape = (b, t, heads, d // heads)
    if per_layer:
        ps = [params(()) for _ in range(n)]
        cache = [{"k": sds(cache_shape), "v": sds(cache_shape)} for _ in range(n)]
    else:
        ps = params((n,))
        cache = {"k": sds((n, *cache_shape)), "v": sds((n, *cache_shape))}
    return ps, cache, sds((b, 1, d)), sds((), jnp.int32)


def placement(sharding, cache, auto: bool) -> dict:
    """``jax.jit``'s ``in_shardings`` and ``out_shardings`` for a step ``(params, cache, h,
    pos) -> (h, cache)`` on one device: the cache in the layout the compiler chooses
    (``Layout.AUTO``) if ``auto``, else in ``sharding``'s default one."""
    import jax
    from jax.experimental.layout import Format, Layout

    fmt = jax.tree.map(lambda _: Format(Layout.AUTO, sharding) if auto else sharding, cache)
    return {"in_shardings": (sharding, fmt, sharding, sharding), "out_shardings": (sharding, fmt)}


def compiled_or_why(jitted, *args):
    """``jitted`` compiled for ``args``, or, where the compiler's plan exceeds the chip's HBM,
    a row's words for it: "does not fit: ..." (any other error is raised)."""
    import jax

    try:
        return jitted.trace(*args).lower().compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return "does not fit: " + str(e).split(": ", 1)[-1][:120]


def measure(n: int, d: int, t: int, b: int, heads: int, dtype: str, dev, *, rounds: int = 0,
            only: tuple[str, ...] = ()) -> list[dict]:
    """One row per variant (those whose name contains one of ``only``, all if empty): the
    compiled program's facts, and with ``rounds`` its time per step on ``dev``."""
    import jax
    import jax.numpy as jnp

    import stackwise

    sharding = jax.sharding.SingleDeviceSharding(dev)
    cache_shape = (b, t, heads, d // heads)
    one_layer = ",".join(str(s) for s in cache_shape if s != 1)
    itemsize = jnp.dtype(dtype).itemsize
    layer_cache_bytes = math.prod(cache_shape) * itemsize
    rows = []
    for name, (step, kind, auto) in variants(n, d, heads).items():
        if only and not any(o in name for o in only):
            continue
        ps, cache, h, pos = inputs(n, d, t, b, heads, dtype, sharding, kind != "stacked")
        if kind in ("layers", "served"):
            if kind == "served":
                ps, cache = stackwise.Serving(ps), stackwise.Serving(cache)
            jitted = jax.jit(step, donate_argnums=1)
        else:
            jitted = jax.jit(step, donate_argnums=1, **placement(sharding, cache, auto))
        row = {"variant": name, "dtype": dtype, "D": d, "T": t, "B": b}
        compiled = compiled_or_why(jitted, ps, cache, h, pos)
        if isinstance(compiled, str):
            rows.append({**row, "made": compiled})
            continue
        hlo, memory = compiled.as_text(), compiled.memory_analysis()
        buffers = per_layer_buffers(hlo, one_layer)
        rows.append({
            **row,
            "per-layer cache buffers in the loop": len(buffers),
            "their MiB/token": n * len(buffers) * layer_cache_bytes / 2**20,
            "cache MiB": 2 * n * layer_cache_bytes / 2**20,
            "args MiB": memory.argument_size_in_bytes / 2**20,
            "temp MiB": memory.temp_size_in_bytes / 2**20,
            "bf16 weights made": len(re.findall(r"= bf16\[\d+,\d+,\d+\]\{[^}]*\} convert\(", hlo)),
            "made": ", ".join(buffers) or "-",
        })
        if rounds:
            step_s = time_steps(compiled, (ps, cache, h, pos), rounds)
            rows[-1].update({
                "ms/step": step_s * 1e3,
                "tokens/s": b / step_s,
                "HBM share": touched_bytes(n, d, itemsize, layer_cache_bytes)
                / HBM_BYTES_PER_S / step_s,
            })
    if rounds:  # each row's time over the loop's (the first variant, when it ran)
        loop = next((r for r in rows if r["variant"].startswith("loop") and "ms/step" in r), None)
        for r in rows:
            if loop and "ms/step" in r:
                r["/loop"] = r["ms/step"] / loop["ms/step"]
    return rows


def touched_bytes(n: int, d: int, itemsize: int, layer_cache_bytes: int) -> int:
    """The bytes a decoding step must read at least: every layer's weights (``qkv`` and
    ``out``: ``4 d^2 + 4 d`` values) and its whole K and V caches (attention reads every
    position; the masked ones too), unpadded."""
    return n * ((4 * d * d + 4 * d) * itemsize + 2 * layer_cache_bytes)


def time_steps(compiled, shapes: tuple, rounds: int) -> float:
    """The median over ``rounds`` of the seconds per call of ``compiled`` (a decoding step
    ``(params, cache, h, pos) -> (h, cache)`` with the cache donated), on inputs of
    ``shapes`` placed as the program wants them (its input formats: a ``Layout.AUTO`` cache
    in the layout the compiler chose). Each round decodes :data:`TOKENS_PER_ROUND` tokens at
    positions 1, 2, ..., feeding each step the cache the last one returned."""
    import statistics
    import time

    import jax
    import numpy as np

    rng = np.random.default_rng(0)

    def value(s):
        if jax.numpy.issubdtype(s.dtype, jax.numpy.integer):
            return np.zeros(s.shape, s.dtype)
        return (rng.standard_normal(s.shape) / math.sqrt(s.shape[-1])).astype(s.dtype)

    ps, cache, h, pos = shapes
    ps, cache, h, pos = jax.device_put(  # (the cache starts empty: zeros)
        (jax.tree.map(value, ps), jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), cache),
         value(h), value(pos)), compiled.input_formats[0])
    positions = [jax.device_put(np.int32(i), pos.sharding) for i in range(TOKENS_PER_ROUND + 1)]
    out, cache = compiled(ps, cache, h, positions[0])  # (one warm-up call)
    jax.block_until_ready(cache)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(1, TOKENS_PER_ROUND + 1):
            out, cache = compiled(ps, cache, h, positions[i])
        jax.block_until_ready((out, cache))
        times.append((time.perf_counter() - start) / TOKENS_PER_ROUND)
    return statistics.median(times)


def number(v: float) -> str:
    """A float with three significant digits or one decimal, whichever is longer."""
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}"


def table(rows: list[dict], header: str) -> str:
    """A Markdown table of ``rows`` under ``header``: the columns of the longest row (a row
    that did not compile has fewer; its missing cells are blank)."""
    cols = list(max(rows, key=len))
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (r.get(c, "") for c in cols)
        lines.append("| " + " | ".join(number(v) if isinstance(v, float) else str(v)
                                       for v in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # (before JAX is imported: --help answers at once)
    import contextlib

    import jax

    dev = device_for(args.time)
    only = tuple(v for v in args.variants.split(",") if v)
    trace = jax.profiler.trace(args.profile) if args.profile else contextlib.nullcontext()
    rows = []
    with trace:
        for d, t, b in args.shapes:
            for dtype in args.dtypes:
                new = measure(args.n, d, t, b, args.heads, dtype, dev, rounds=args.time,
                              only=only)
                for row in new:  # (as they come: a run cut short keeps what it measured)
                    print(json.dumps(row), flush=True)
                rows += new
    timed = (f"; timed: median of {args.time} rounds of {TOKENS_PER_ROUND} steps, HBM share "
             f"= (weights + cache bytes) / {HBM_BYTES_PER_S / 1e9:.0f} GB/s / step time"
             if args.time else "")
    report(rows, f"{compiled_for(dev)}; n={args.n}, {args.heads} heads{timed}", args.markdown)
    return 0


def report(rows: list[dict], machine: str, markdown: str) -> None:
    """Prints the table under ``machine`` and the command that ran (and writes it to
    ``markdown``, a file's path, unless empty)."""
    command = shlex.join(["python", f"benchmarks/{pathlib.Path(sys.argv[0]).name}", *sys.argv[1:]])
    out = table(rows, f"{machine}; `{command}`")
    print(out)
    if markdown:
        with open(markdown, "w") as f:
            f.write(out)


if __name__ == "__main__":
    sys.exit(main())
