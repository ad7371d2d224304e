"""One training step of a transformer at the size of a TPU chip: the stack, the loop,
``nn.scan`` and ``hk.layer_stack``, each with remat off, full, and saving the matmuls.

The model is ``stackwise-bench``'s ``transformer`` block (pre-LN causal attention + MLP,
``bench/workloads/``: the same builders) repeated n times, with the loss ``mean(y**2)``.
Params are float32; the step casts them and the input to bfloat16 at its start, so every
matmul, the attention and the norms run in bfloat16 (default matmul precision), and the
gradients come back float32 through the cast. A step is ``jit(value_and_grad(loss))`` and a
plain SGD update ``p - lr * g`` of the float32 params, donated (updated in place): the
framework's scan, not the optimizer, is what differs between the rows. Run on a TPU v5e from
the repository root:

    python benchmarks/tpu_train.py --markdown benchmarks/results/tpu_train.md

(d_model 1024, 16 heads, MLP 4096, 16 blocks, sequence 1024, batch 8; 12 rows; not yet timed
on a chip: the compiles dominate). Compiled for a v5e without a chip (libtpu's compile-only
devices), the loop without remat fits in 7.6 GiB, the three scans without remat do not (19-20
GiB of temporaries: their rows say so), and with the dots policy all fit in 4-5.6 GiB. ``--tiny`` runs the same rows at toy sizes on any backend in seconds. Rows, each at
remat ``off``, ``dots`` (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``:
stackwise's default, the matmul outputs saved) and ``full`` (nothing but each block's
input saved):

- ``loop``: a Python loop over per-layer params, each block ``jax.checkpoint``-ed with the
  policy (the loop the stack replaces; every ratio's reference);
- ``stackwise``: ``stackwise.stack(init, block, n, remat=...)`` on the same params (so its
  loss equals the loop's: the ``loss`` column);
- ``nn.scan``: linen's ``nn.scan`` of the block, in ``nn.remat`` with the policy;
- ``hk.layer_stack``: Haiku's, the block in ``hk.remat`` with the policy.

Columns: **compile s**, one cold compile (caches cleared; tracing, lowering and XLA);
**step ms**, the median of ``--rounds`` steps after two warm-up steps, each waited for
(``block_until_ready``); their ratios to the loop's and to each tool's at the same remat;
**model TFLOP**, counted: ``6 * (matmul params) * tokens`` plus the attention's
``12 * n * seq**2 * d * batch`` (the full score matrix, as computed; remat's recomputation
not counted); **XLA TFLOP**, the compiled program's own count
(``compiled.cost_analysis()["flops"]``, recomputation included; XLA counts a loop's body
once, whatever its trip count, so it is the model's only for the loop); **MFU**, model TFLOP
/ (step s x ``--peak`` TFLOP/s, 197: a v5e's bfloat16 peak); **peak MiB**, from
``compiled.memory_analysis()``: arguments + outputs - donated + temp; **loss**, the first
step's.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tpu_decode_hlo import positive, report  # benchmarks/tpu_decode_hlo.py, a sibling

#: A TPU v5e chip's peak bfloat16 matmul throughput, TFLOP/s (the MFU's denominator).
V5E_BF16_TFLOPS = 197.0
#: The sizes of one v5e (15.7 GiB of HBM): the loop without remat fits at batch 8.
CHIP = {"d": 1024, "heads": 16, "hidden": 4096, "n": 16, "seq": 1024, "batch": 8}
#: ``--tiny``: the same rows in seconds, on any backend.
TINY = {"d": 32, "heads": 2, "hidden": 64, "n": 3, "seq": 16, "batch": 2}
#: The rows' families, in table order; the loop is every ratio's reference.
FAMILIES = ("loop", "stackwise", "nn.scan", "hk.layer_stack")
#: The remats, in table order, and the bench's names for them (``common.REMATS``).
REMATS = {"off": "off", "dots": "dots", "full": "layer"}
#: The SGD learning rate of the step (small: the params change little over the rounds).
LR = 1e-4
#: Steps run before the timed ones (the first pays for the buffers' first placement).
WARMUP = 2


def variant_names() -> list[str]:
    """Every row's name, ``"<family>, remat <remat>"``, in table order."""
    return [f"{family}, remat {remat}" for remat in REMATS for family in FAMILIES]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, with the sizes not given taken from ``--tiny``'s or the chip's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, what in (("d", "d_model"), ("heads", "attention heads"),
                       ("hidden", "the MLP's width"), ("n", "blocks"),
                       ("seq", "sequence length"), ("batch", "sequences per step")):
        p.add_argument(f"--{flag}", type=positive,
                       help=f"{what} (default {CHIP[flag]}; --tiny: {TINY[flag]})")
    p.add_argument("--tiny", action="store_true", help="toy sizes: any backend, seconds")
    p.add_argument("--rounds", type=positive, default=5, help="timed steps per row (default 5)")
    p.add_argument("--variants", default="",
                   help="comma-separated parts of row names to run, e.g. 'stackwise,loop' or "
                        "'remat off' (default: all 12)")
    p.add_argument("--peak", type=float, default=V5E_BF16_TFLOPS,
                   help=f"the chip's peak TFLOP/s for the MFU (default {V5E_BF16_TFLOPS:g}, "
                        "a v5e's bfloat16)")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else CHIP
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.d % args.heads:
        p.error(f"argument --heads: {args.heads} heads do not divide --d {args.d}")
    if not (math.isfinite(args.peak) and args.peak > 0):
        p.error(f"argument --peak: expected a positive TFLOP/s, got {args.peak!r}")
    wanted = [w.strip().lower() for w in args.variants.split(",") if w.strip()]
    args.rows = [v for v in variant_names() if not wanted or any(w in v for w in wanted)]
    if not args.rows:
        p.error(f"argument --variants: {args.variants!r} matches no row; the rows are: "
                + "; ".join(variant_names()))
    return args


def model_flops(d: int, hidden: int, n: int, seq: int, batch: int) -> float:
    """A step's model FLOPs, forward and backward: ``6 * params * tokens`` for the matmuls'
    weights (qkv, out, fc1, fc2) plus ``12 * n * seq**2 * d * batch`` for the attention's
    two batched matmuls (scores and weighted values, the full causal matrix as computed).

    >>> model_flops(d=2, hidden=4, n=1, seq=3, batch=1) == 6 * (4 * 4 + 2 * 2 * 4) * 3 + 12 * 9 * 2
    True
    """
    params = n * (4 * d * d + 2 * d * hidden)
    return 6.0 * params * seq * batch + 12.0 * n * seq**2 * d * batch


def builds(args: argparse.Namespace, notes: list[str]) -> dict[str, Callable[[int], tuple]]:
    """Row name -> ``build(n) -> (params, x, loss)`` (float32 loss of float32 params and
    input), from ``stackwise-bench``'s transformer block; a framework that cannot be imported
    loses its rows, with a note."""
    import jax

    from stackwise.bench.config import BenchConfig
    from stackwise.bench.workloads import common, core

    cfg = BenchConfig(tf_d=args.d, tf_hidden=args.hidden, tf_heads=args.heads,
                      tf_seq=args.seq, tf_batch=args.batch)
    _, layer, inputs = core.transformer_block(cfg)

    def loop(remat: str) -> Callable[[int], tuple]:
        block = layer if remat == "off" else jax.checkpoint(
            layer, policy=common.tool_policy(remat))

        def build(n: int) -> tuple:
            stacked, x = inputs(n)

            def loss(ps, h):
                for p in ps:
                    h = block(p, h)
                return common.mean_square(h)

            return common.unstack(stacked), x, loss

        return build

    found = {f"loop, remat {r}": loop(bench) for r, bench in REMATS.items()}
    tools = {"stackwise": ("core", "stackwise"), "nn.scan": ("flax", "nn.scan"),
             "hk.layer_stack": ("haiku", "hk.layer_stack")}
    for family, (module, prefix) in tools.items():
        try:
            workload = __import__(f"stackwise.bench.workloads.{module}", fromlist=[module])
        except ImportError as e:
            notes.append(f"{family}: not importable ({e}); its rows are skipped")
            continue
        for case in workload.transformer(cfg, []):
            # the tool's (or the stack's) rows: neither a control, an adapter nor nested remat
            if case.name.startswith(prefix) and not case.tool and case.remat != "nested":
                remat = next(r for r, bench in REMATS.items() if bench == case.remat)
                found[f"{family}, remat {remat}"] = case.build
    return found


def in_bfloat16(loss: Callable) -> Callable:
    """``loss`` run on its params and input cast to bfloat16 (the floating leaves), its
    value returned as float32: float32 params, bfloat16 compute."""
    import jax
    import jax.numpy as jnp

    def cast(a):
        return a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a

    def mixed(params, x):
        return loss(jax.tree.map(cast, params), cast(x)).astype(jnp.float32)

    return mixed


def sgd_step(loss: Callable) -> Callable:
    """``params, loss = step(params, x)``: ``value_and_grad`` and ``p - LR * g``, jitted
    with the params donated."""
    import jax

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), value

    return jax.jit(step, donate_argnums=0)


def out_of_memory(e: Exception) -> bool:
    """Whether ``e`` is XLA's "the program does not fit the device's memory"."""
    return "RESOURCE_EXHAUSTED" in str(e)


def measure(name: str, build: Callable[[int], tuple], args: argparse.Namespace) -> dict:
    """One row: compile once (cold), run ``WARMUP`` then ``args.rounds`` timed steps."""
    import jax

    family, remat = name.split(", remat ")
    row: dict[str, Any] = {"variant": family, "remat": remat}
    jax.clear_caches()
    gc.collect()
    params, x, loss = build(args.n)
    try:
        start = time.perf_counter()
        compiled = sgd_step(in_bfloat16(loss)).trace(params, x).lower().compile()
        row["compile s"] = time.perf_counter() - start
        times, first = [], None
        for i in range(WARMUP + args.rounds):
            start = time.perf_counter()
            params, value = jax.block_until_ready(compiled(params, x))
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
            first = float(value) if first is None else first
    except jax.errors.JaxRuntimeError as e:
        if not out_of_memory(e):
            raise
        return {**row, "step ms": "does not fit: " + str(e).split(": ", 1)[-1][:100]}
    step_s = statistics.median(times)
    flops = model_flops(args.d, args.hidden, args.n, args.seq, args.batch)
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})
    row.update({
        "step ms": step_s * 1e3,
        "model TFLOP": flops / 1e12,
        "XLA TFLOP": cost["flops"] / 1e12 if "flops" in cost else "-",
        "MFU %": 100 * flops / (step_s * args.peak * 1e12),
        "peak MiB": "-" if memory is None else (
            memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes) / 2**20,
        "loss": f"{first:.6g}",
    })
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """The rows in table order, each with its compile and step ratios to the loop's and to
    each tool's at the same remat (where both were measured)."""
    by = {(r["variant"], r["remat"]): r for r in rows}
    out = []
    for remat in REMATS:
        for family in FAMILIES:
            row = by.get((family, remat))
            if row is None:
                continue
            row = dict(row)
            for what in ("compile s", "step ms"):
                key = what.split()[0]
                for ref in ("loop", "nn.scan", "hk.layer_stack"):
                    if ref == "loop" and key == "compile":
                        continue  # (the loop traces n blocks: not the tools' measure)
                    theirs = by.get((ref, remat), {}).get(what)
                    if isinstance(row.get(what), float) and isinstance(theirs, float):
                        row[f"{key} /{ref}"] = f"{row[what] / theirs:.2f}"
                    else:
                        row[f"{key} /{ref}"] = "-"
            out.append(row)
    order = ["variant", "remat", "compile s", "compile /nn.scan", "compile /hk.layer_stack",
             "step ms", "step /loop", "step /nn.scan", "step /hk.layer_stack", "model TFLOP",
             "XLA TFLOP", "MFU %", "peak MiB", "loss"]
    return [{k: r[k] for k in order if k in r} for r in out]


def title(args: argparse.Namespace) -> str:
    """The table's header: the model, the step and the machine."""
    from _devices import header  # benchmarks/_devices.py

    return header(
        f"Training step of {args.n} transformer blocks: d_model {args.d}, {args.heads} heads, "
        f"MLP {args.hidden}, sequence {args.seq}, batch {args.batch}; float32 params, bfloat16 "
        f"compute; jit(value_and_grad) + SGD, params donated; median of {args.rounds} steps; "
        f"MFU against {args.peak:g} TFLOP/s")


def main(argv: list[str] | None = None) -> list[dict]:
    """Measures the rows ``argv`` asks for, prints the table (and writes ``--markdown``);
    returns the rows."""
    args = parse_args(argv)
    notes: list[str] = []
    found = builds(args, notes)
    rows = []
    for name in args.rows:
        if name in found:
            rows.append(measure(name, found[name], args))
            print(rows[-1], file=sys.stderr, flush=True)  # (a run cut short keeps these)
    rows = with_ratios(rows)
    report(rows, title(args) + "".join(f"\n\nNote: {n}" for n in notes), args.markdown)
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
