"""Per-token decode time of a multi-LoRA batch against the base alone.

One decode step (one token per row, a KV cache per row, donated) of n transformer-like layers
(q, k, v, o and an MLP's up and down weights, all adapted), ``Stacked.decode`` under
``jax.jit``, for these variants on one base:

- **base alone**: the base params, no adapter;
- **one adapter**: one adapter attached, every row using it (``attach(base, adapters)``);
- **multi-LoRA**: a batch of g adapters, each row picking one by index, or -1 for the base
  (``attach(base, stack_adapters([...]), rows=idx)``): the rows cycle through the adapters,
  the last row on the base alone. With g <= rows the adapters run side by side (two plain
  products for the batch);
- **multi-LoRA, gathered**: twice as many adapters as rows, so each row's own factors are
  gathered (a batched product per row).

Rounds visit the variants in a new shuffled order; each variant is timed on the second of two
back-to-back calls (each call given the cache the previous one returned), and the ratios are
medians of the per-round ratios to the base alone (a drift of the machine's speed cancels).
Cold compile: ``jax.clear_caches()``, then lower + compile.

    python benchmarks/multi_lora_decode.py --rounds 21 \\
        --markdown benchmarks/results/multi_lora_decode.md
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

from tpu_decode_hlo import positive  # benchmarks/tpu_decode_hlo.py, a sibling


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=positive, default=8, help="layers (default 8)")
    p.add_argument("--d", type=positive, default=256, help="model width D (default 256)")
    p.add_argument("--batch", type=positive, default=8, help="rows (default 8)")
    p.add_argument("--adapters", type=positive, default=4, help="adapters g (default 4)")
    p.add_argument("--rank", type=positive, default=8, help="adapter rank (default 8)")
    p.add_argument("--cache", type=positive, default=256, help="cache positions (default 256)")
    p.add_argument("--rounds", type=positive, default=15, help="timed rounds (default 15)")
    p.add_argument("--markdown", help="write the table here")
    return p.parse_args(argv)


# The command line above needs only the standard library: --help and argument errors answer
# before JAX is imported.
if __name__ == "__main__":
    parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import stackwise  # noqa: E402
from stackwise.bench.report import backend  # noqa: E402


def layer(p, cache, x, pos):
    """One decoding layer: x (b, 1, D), cache {"k", "v"}: (b, S, D) each."""
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    cache = {"k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k, pos, 1),
             "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v, pos, 1)}
    scores = jnp.einsum("btd,bsd->bts", q, cache["k"]) / q.shape[-1] ** 0.5
    scores = jnp.where(jnp.arange(cache["k"].shape[1]) <= pos, scores, -1e9)
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), cache["v"]) @ p["o"]
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"], cache


def variants(args) -> dict:
    n, d = args.n, args.d
    keys = iter(jax.random.split(jax.random.key(0), 8))
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "up": (d, 4 * d),
              "down": (4 * d, d)}
    base = {name: jax.random.normal(next(keys), (n, *s)) / s[0] ** 0.5
            for name, s in shapes.items()}

    def trained(seed):  # b nonzero, as after training
        adapters = stackwise.lora.init(jax.random.key(seed), base, rank=args.rank)
        return jax.tree.map(lambda v: v + 0.01 * jax.random.normal(jax.random.key(seed),
                                                                   v.shape), adapters)

    many = max(args.adapters, 2 * args.batch)
    each = [trained(s) for s in range(many)]
    batch = stackwise.lora.stack_adapters(each[:args.adapters])
    rows = jnp.asarray([i % args.adapters for i in range(args.batch - 1)] + [-1], jnp.int32)
    spread = jnp.asarray([(3 * i) % many for i in range(args.batch - 1)] + [-1], jnp.int32)
    return {
        "base alone": lambda: base,
        "one adapter": lambda: stackwise.lora.attach(base, each[0]),
        f"multi-LoRA ({args.adapters} adapters, rows {rows.tolist()})":
            lambda: stackwise.lora.attach(base, batch, rows=rows),
        f"multi-LoRA, gathered ({many} adapters, rows {spread.tolist()})":
            lambda: stackwise.lora.attach(base, stackwise.lora.stack_adapters(each),
                                          rows=spread),
    }


def main(args) -> None:
    layers = stackwise.lora.stack(layer, args.n, with_state=True)
    step = jax.jit(layers.decode, donate_argnums=1)
    x = jax.random.normal(jax.random.key(1), (args.batch, 1, args.d))

    def fresh_cache():
        return {k: jnp.zeros((args.n, args.batch, args.cache, args.d)) for k in "kv"}

    made = variants(args)
    params = {name: make() for name, make in made.items()}
    compile_s, caches = {}, {}
    for name, p in params.items():
        jax.clear_caches()
        start = time.perf_counter()
        step.lower(p, fresh_cache(), x, 0).compile()
        compile_s[name] = time.perf_counter() - start
        caches[name] = fresh_cache()
        y, caches[name] = step(p, caches[name], x, 0)  # (compiled again by the call: warm)
        jax.block_until_ready(y)
    times: dict = {name: [] for name in params}
    pos = 1
    for _ in range(args.rounds):
        order = list(params)
        random.shuffle(order)
        for name in order:
            y, caches[name] = step(params[name], caches[name], x, pos % args.cache)
            jax.block_until_ready(y)
            start = time.perf_counter()
            y, caches[name] = step(params[name], caches[name], x, (pos + 1) % args.cache)
            jax.block_until_ready((y, caches[name]))
            times[name].append(time.perf_counter() - start)
        pos += 2
    base = times["base alone"]
    lines = [
        f"# Multi-LoRA decode: n={args.n}, D={args.d}, batch {args.batch}, "
        f"{args.adapters} adapters of rank {args.rank}, cache {args.cache}",
        "",
        f"`python {' '.join(sys.argv)}`: {args.rounds} rounds; Python "
        f"{platform.python_version()}, {os.cpu_count()} cores, {backend()}; load average "
        f"{os.getloadavg()[0]:.1f} (ratios within one run, not absolute times, are the result).",
        "",
        "ms/token: median over the rounds of one decode step (every row one token, the "
        "cache donated); ×base: median of the per-round ratios to the base alone; compile s: "
        "cold.",
        "",
        "| variant | ms/token | ×base | compile s |",
        "|---|---|---|---|",
    ]
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base))
        lines.append(f"| {name} | {statistics.median(ts) * 1e3:.3f} | {ratio:.2f} | "
                     f"{compile_s[name]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(parse_args())
