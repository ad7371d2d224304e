"""Equinox rows: ``stackwise.equinox.Stack`` vs the hand-written ``eqx.filter_vmap`` +
``lax.scan`` pattern it replaces vs a Python loop of blocks, under ``jit(grad(loss))``.

For the MLP residual block and a pre-LN transformer block (the sizes of ``stackwise-bench``),
at each depth: the cold compile time, the step time (median over interleaved rounds; each
round calls every variant twice back to back and times the second call, the steady state)
and XLA's temp memory. The Stack is compared with the hand-written scan at the same remat
(off; ``stackwise.DEFAULT_REMAT``; full), as the paired median of per-round ratios. The
hand-written scan without remat also runs twice: its ``(control)`` row's ratio is the run's
noise floor.

    python benchmarks/equinox_rows.py                      # n in {8, 48}, both blocks
    python benchmarks/equinox_rows.py --n 8 --blocks mlp --rounds 3
    python benchmarks/equinox_rows.py --loop-max-n 8       # no Python loop at n=48
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import stackwise
import stackwise.equinox

SIZES = {  # those of stackwise-bench's blocks
    "mlp": dict(d=256, hidden=512, batch=64),
    "transformer": dict(d=128, hidden=512, heads=4, seq=32, batch=8),
}


# --------------------------------------------------------------------------
# The blocks, as ordinary Equinox modules acting on one example.


class Mlp(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, hidden: int, *, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d, hidden, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(hidden, d, use_bias=False, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Transformer(eqx.Module):
    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, hidden: int, heads: int, *, key):
        ks = jax.random.split(key, 4)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.qkv = eqx.nn.Linear(d, 3 * d, key=ks[0])
        self.out = eqx.nn.Linear(d, d, key=ks[1])
        self.fc1 = eqx.nn.Linear(d, hidden, key=ks[2])
        self.fc2 = eqx.nn.Linear(hidden, d, key=ks[3])
        self.heads = heads

    def __call__(self, x):  # x: [seq, d]
        t, d = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln1)(x)), 3, -1)
        q, k, v = (a.reshape(t, self.heads, d // self.heads) for a in (q, k, v))
        logits = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
        weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), -1)
        x = x + jax.vmap(self.out)(jnp.einsum("hts,shd->thd", weights, v).reshape(t, d))
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.ln2)(x))))


def make_block(block: str) -> Callable[..., eqx.Module]:
    s = SIZES[block]
    if block == "mlp":
        return lambda key: Mlp(s["d"], s["hidden"], key=key)
    return lambda key: Transformer(s["d"], s["hidden"], s["heads"], key=key)


def example_input(block: str) -> jax.Array:
    s = SIZES[block]
    shape = (s["batch"], s["d"]) if block == "mlp" else (s["batch"], s["seq"], s["d"])
    return jax.random.normal(jax.random.key(1), shape)


# --------------------------------------------------------------------------
# The variants: ``build(block, n) -> (params, x, loss)``, ``loss(params, x) -> scalar``.

REMATS = {"off": False, "dots": stackwise.DEFAULT_REMAT, "full": True}


def _loss(forward: Callable, static: Any) -> Callable:
    def loss(params, x):
        model = eqx.combine(params, static)
        return jnp.mean(jnp.square(jax.vmap(lambda e: forward(model, e))(x)))

    return loss


def loop(block: str, n: int):
    """A Python loop over n separately held blocks."""
    make = make_block(block)
    blocks = [make(k) for k in jax.random.split(jax.random.key(0), n)]
    params, static = eqx.partition(blocks, eqx.is_array)

    def forward(blocks, x):
        for b in blocks:
            x = b(x)
        return x

    return params, example_input(block), _loss(forward, static)


def hand_scan(remat: str):
    """What Equinox users write today: filter_vmap, partition, lax.scan, combine."""

    def build(block: str, n: int):
        keys = jax.random.split(jax.random.key(0), n)
        layers = eqx.filter_vmap(make_block(block))(keys)
        params, static = eqx.partition(layers, eqx.is_array)

        def forward(layers, x):
            layer_params, layer_static = eqx.partition(layers, eqx.is_array)

            def body(x, p):
                return eqx.combine(p, layer_static)(x), None

            if REMATS[remat] is not False:
                policy = None if REMATS[remat] is True else REMATS[remat]
                body = jax.checkpoint(body, prevent_cse=False, policy=policy)
            return jax.lax.scan(body, x, layer_params)[0]

        return params, example_input(block), _loss(forward, static)

    return build


def stack(remat: str):
    def build(block: str, n: int):
        s = stackwise.equinox.Stack(
            make_block(block), n, remat=REMATS[remat], key=jax.random.key(0)
        )
        params, static = eqx.partition(s, eqx.is_array)
        return params, example_input(block), _loss(lambda s, x: s(x), static)

    return build


class Variant(NamedTuple):
    name: str
    build: Callable
    reference: str = ""  # the row it is compared with


VARIANTS = [
    Variant("python loop", loop),
    Variant("filter_vmap+scan (hand)", hand_scan("off")),
    Variant("filter_vmap+scan (hand) (control)", hand_scan("off"), "filter_vmap+scan (hand)"),
    Variant("stackwise.equinox.Stack remat=False", stack("off"), "filter_vmap+scan (hand)"),
    Variant("filter_vmap+scan+checkpoint(dots) (hand)", hand_scan("dots")),
    Variant(
        "stackwise.equinox.Stack (default remat)",
        stack("dots"),
        "filter_vmap+scan+checkpoint(dots) (hand)",
    ),
    Variant("filter_vmap+scan+checkpoint (hand)", hand_scan("full")),
    Variant(
        "stackwise.equinox.Stack remat=True", stack("full"), "filter_vmap+scan+checkpoint (hand)"
    ),
]


# --------------------------------------------------------------------------
# Measuring.


class Row(NamedTuple):
    block: str
    n: int
    variant: Variant
    compile_s: float
    temp_bytes: int
    steps: list[float]


def compile_cold(params, x, loss) -> tuple[Any, float, int]:
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return compiled, seconds, getattr(memory, "temp_size_in_bytes", -1)


def measure(block: str, n: int, rounds: int, loop_max_n: int) -> list[Row]:
    variants = [v for v in VARIANTS if v.build is not loop or n <= loop_max_n]
    compiled, rows = [], []
    for v in variants:
        params, x, loss = v.build(block, n)
        fn, seconds, temp = compile_cold(params, x, loss)
        jax.block_until_ready(fn(params, x))  # warm
        compiled.append((fn, params, x))
        rows.append(Row(block, n, v, seconds, temp, []))
    for _ in range(rounds):  # interleaved: every variant once per round
        for (fn, params, x), row in zip(compiled, rows):
            jax.block_until_ready(fn(params, x))
            start = time.perf_counter()
            jax.block_until_ready(fn(params, x))
            row.steps.append(time.perf_counter() - start)
    return rows


def paired_ratio(row: Row, ref: Row) -> float:
    return statistics.median(a / b for a, b in zip(row.steps, ref.steps))


HEADER = (
    f"{'block':12} {'n':>3}  {'variant':42} {'compile s':>9} {'step ms':>8} "
    f"{'temp MiB':>8} {'step/ref':>8} {'compile/ref':>11}"
)


def report(rows: list[Row]) -> list[str]:
    """One line per row; ratios against the row's reference (same block and depth)."""
    lines = []
    by_name = {(r.block, r.n, r.variant.name): r for r in rows}
    for r in rows:
        ref = by_name.get((r.block, r.n, r.variant.reference))
        step_ratio = f"{paired_ratio(r, ref):8.2f}" if ref else f"{'':8}"
        compile_ratio = f"{r.compile_s / ref.compile_s:11.2f}" if ref else f"{'':11}"
        lines.append(
            f"{r.block:12} {r.n:3d}  {r.variant.name:42} {r.compile_s:9.2f} "
            f"{statistics.median(r.steps) * 1e3:8.2f} {r.temp_bytes / 2**20:8.2f} "
            f"{step_ratio} {compile_ratio}"
        )
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="8,48", help="depths, comma-separated (default: 8,48)")
    p.add_argument("--blocks", default="mlp,transformer")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default: 7)")
    p.add_argument(
        "--loop-max-n",
        type=int,
        default=48,
        help="run the Python loop only up to this depth (the transformer loop at n=48 "
        "compiled for 15 minutes on a loaded 2-core CPU)",
    )
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.devices()[0].platform}")
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    for block in args.blocks.split(","):
        for n in (int(s) for s in args.n.split(",")):
            measured = measure(block, n, args.rounds, args.loop_max_n)
            print("\n".join(report(measured)), flush=True)
            rows += measured
    return rows


if __name__ == "__main__":
    main()
