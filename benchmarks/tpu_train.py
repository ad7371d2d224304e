"""One training step of a transformer at the size of a TPU chip: the stack, the loop,
``nn.scan``, ``hk.layer_stack`` and the adapters ``stackwise.flax.Stack`` and
``stackwise.haiku.Stack``, each with remat off, full, and saving the matmuls.

The model is ``stackwise-bench``'s ``transformer`` block (pre-LN causal attention + MLP,
``bench/workloads/``: the same builders) repeated n times, with the loss ``mean(y**2)``.
Params are float32; the step casts them and the input to bfloat16 at its start, so every
matmul, the attention and the norms run in bfloat16 (default matmul precision), and the
gradients come back float32 through the cast. A step is ``jit(value_and_grad(loss))`` and a
plain SGD update ``p - lr * g`` of the float32 params, donated (updated in place): the
framework's scan, not the optimizer, is what differs between the rows. Run on a TPU v5e from
the repository root, one remat per run (``benchmarks/on_tpu.sh``'s ``train`` part):

    python benchmarks/tpu_train.py --variants "remat dots" --markdown tpu_train_dots.md

(d_model 1024, 16 heads, MLP 4096, 16 blocks, sequence 1024, batch 8; 7 rows a remat, 21 in
all; on a v5e a scan compiles in 6-8 s, the loop in ~40 s, a step takes ~160 ms: the compiles
dominate, an estimated 4-5 minutes for the 7 rows of a remat at the default ``--compiles``).
Compiled for a v5e without a chip (libtpu's compile-only devices), the loop without remat
fits in 7.6 GiB, the stack, ``nn.scan`` and ``hk.layer_stack`` without remat do not (19-20
GiB of temporaries: their rows say so; at batch 4 they fit), and with the dots policy all
fit in 4-5.6 GiB (the adapters' rows were not compiled so). ``--tiny`` runs the
same rows at toy sizes on any backend in seconds. Rows, each at remat ``off``, ``dots``
(``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: stackwise's default, the
matmul outputs saved) and ``full`` (nothing but each block's input saved):

- ``loop``: a Python loop over per-layer params, each block ``jax.checkpoint``-ed with the
  policy (the loop the stack replaces; every ``/loop`` ratio's reference);
- ``stackwise``: ``stackwise.stack(init, block, n, remat=...)`` on the same params (so its
  loss equals the loop's: the ``loss`` column). Its block is the pure-JAX one, whose norms
  reduce in bfloat16, unlike linen's and Haiku's ``LayerNorm`` (float32): compare it with
  the loop, and the adapters' rows with the tools;
- ``stackwise unroll=2``: the same stack at ``unroll=2`` (two blocks a scan iteration: the
  loop's program has no loop at all, the scan's one iteration per block);
- ``stackwise unroll=True``: the same stack as a Python loop over static slices of the
  stacked params (``unroll=True``, what ``Stacked.decode`` runs): the loop's program on
  stacked params and gradients, whose compile grows with n as the loop's does (on a v5e's
  host in the loop's time, 38-52 s: ``results/tpu_train.md``, eighth run; the 2-core VM's
  compile-only stand-in took 2.8-3.3x the loop's);
- ``nn.scan``: linen's ``nn.scan`` of linen's block, in ``nn.remat`` with the policy;
- ``stackwise.flax.Stack``: the same linen block stacked by ``stackwise.flax.Stack(block,
  n, remat=...)`` (``False``, the policy, ``True``), on the ``nn.scan`` row's params (the
  scanned block's variables, whose layout is the Stack's, under the Stack's name): the same
  block on the same params, so its loss is ``nn.scan``'s (at ``--tiny`` on the CPU, tested);
- ``hk.layer_stack``: Haiku's, the Haiku block in ``hk.remat`` with the policy;
- ``stackwise.haiku.Stack``: the same Haiku block stacked by ``stackwise.haiku.Stack``, on
  the ``hk.layer_stack`` row's params renamed by ``stackwise.haiku.from_layer_stack``: its
  loss is ``hk.layer_stack``'s (tested likewise).

(linen's and Haiku's initialisers differ, so the two frameworks' losses differ, and differ
from the loop's.) Every row compiles ``--compiles`` times (default 3; the rows of the loop and
of ``stackwise unroll=True`` ``--loop-compiles`` times, default 1), cold, interleaved: round r
compiles every row still to compile once, in the table's order rotated by r
(:func:`compile_order`), so that no row always goes first or second in the process; a row's
steps run after its first compile.

Columns: **compile s**, the median of the row's cold compiles (caches cleared before each;
tracing, lowering and XLA, for the params' and input's shapes); **compiles**, each of them in
round order, seconds (one for the loop's and the unrolled stack's rows by default: ~40 s each
on a v5e, and no ratio is to their compile); **trace / lower / XLA s**, the median of each of
those three stages apart (``jit(...).trace``, ``.lower()``, ``.compile()``); **step ms**, the
median of ``--rounds`` steps after two warm-up steps, each waited for (``block_until_ready``); their
ratios: **/tool**, an adapter's to its own framework's tool at the same remat
(``stackwise.flax.Stack`` / ``nn.scan``, ``stackwise.haiku.Stack`` / ``hk.layer_stack``; "-" on
the other rows), **/loop** (step only), **/nn.scan** and **/hk.layer_stack**, every row's to
those rows' at the same remat ("-" where either was not measured); **model TFLOP**, counted:
``6 * (matmul params) * tokens`` plus the attention's ``12 * n * seq**2 * d * batch`` (the full
score matrix, as computed; remat's recomputation not counted); **XLA TFLOP**, the compiled
program's own count (``compiled.cost_analysis()["flops"]``, recomputation included; XLA counts
a loop's body once, whatever its trip count, so it is the model's only for the loop); **MFU**,
model TFLOP / (step s x ``--peak`` TFLOP/s, 197: a v5e's bfloat16 peak); **peak MiB**, from
``compiled.memory_analysis()``: arguments + outputs - donated + temp; **loss**, the first
step's.

``--profile DIR`` also writes, per row, a ``jax.profiler`` trace of its timed steps
(``DIR/<row>/``, e.g. ``DIR/stackwise_remat_dots/``: read it with xprof or TensorBoard) and its
compiled program's text (``DIR/<row>.hlo.txt``, after XLA's passes: its copies, fusions and
while loops); ``benchmarks/on_tpu.sh``'s ``train-profile`` part runs the loop and the stack
so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
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
#: The rows' families, in table order (each adapter after its framework's tool); the loop is
#: every ``/loop`` ratio's reference.
FAMILIES = ("loop", "stackwise", "stackwise unroll=2", "stackwise unroll=True", "nn.scan",
            "stackwise.flax.Stack", "hk.layer_stack", "stackwise.haiku.Stack")
#: The families that compile as a Python loop of the blocks does (``--loop-compiles``).
LOOP_LIKE = ("loop", "stackwise unroll=True")
#: Each adapter's family -> its framework's tool, the reference of its ``/tool`` ratios.
ADAPTERS = {"stackwise.flax.Stack": "nn.scan", "stackwise.haiku.Stack": "hk.layer_stack"}
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
    p.add_argument("--compiles", type=positive, default=3,
                   help="cold compiles per row, interleaved; the compile column is their median "
                        "(default 3; the loop's and unroll=True's: --loop-compiles)")
    p.add_argument("--loop-compiles", type=positive, default=1,
                   help="cold compiles of the rows of the loop and of the stack at "
                        "unroll=True (default 1: ~40 s each on a v5e at the chip's sizes, and "
                        "no ratio is to their compile; give --compiles' number to treat them "
                        "as the others)")
    p.add_argument("--variants", default="",
                   help="comma-separated row selectors: a family's name (e.g. 'stackwise', "
                        "'loop', 'nn.scan') picks that family's rows, any other text the rows "
                        "whose name contains it, e.g. '.Stack' (the adapters) or 'remat off' "
                        f"(default: all {len(variant_names())})")
    p.add_argument("--remat", default="",
                   help="comma-separated remats to keep of the rows --variants picks, of "
                        f"{', '.join(REMATS)} (default: all)")
    p.add_argument("--peak", type=float, default=V5E_BF16_TFLOPS,
                   help=f"the chip's peak TFLOP/s for the MFU (default {V5E_BF16_TFLOPS:g}, "
                        "a v5e's bfloat16)")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    p.add_argument("--profile", default="", metavar="DIR",
                   help="write each row's jax.profiler trace of its timed steps and its "
                        "compiled program's text (HLO after XLA's passes) under DIR")
    args = p.parse_args(argv)
    if args.profile and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        p.error(f"argument --profile: {args.profile!r} is a file; expected a folder (new or "
                "existing) for the traces")
    sizes = TINY if args.tiny else CHIP
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.d % args.heads:
        p.error(f"argument --heads: {args.heads} heads do not divide --d {args.d}")
    if not (math.isfinite(args.peak) and args.peak > 0):
        p.error(f"argument --peak: expected a positive TFLOP/s, got {args.peak!r}")
    remats = [r.strip() for r in args.remat.split(",") if r.strip()]
    if any(r not in REMATS for r in remats):
        p.error(f"argument --remat: {args.remat!r} is not a comma-separated list of "
                + ", ".join(REMATS))
    args.rows = [v for v in select(variant_names(), args.variants)
                 if not remats or v.split(", remat ")[1] in remats]
    if not args.rows:
        also = f" at --remat {args.remat!r}" if remats else ""
        p.error(f"argument --variants: {args.variants!r} matches no row{also}; the rows are: "
                + "; ".join(variant_names()))
    return args


def select(names: list[str], variants: str) -> list[str]:
    """The rows of ``names`` that ``--variants`` picks: a part equal to a family's name picks
    that family's rows, any other part the rows whose name contains it (case-insensitive);
    nothing picks every row.

    >>> names = variant_names()
    >>> select(names, "stackwise, remat full")[:3]
    ['stackwise, remat off', 'stackwise, remat dots', 'loop, remat full']
    >>> [n.split(",")[0] for n in select(names, ".Stack") if n.endswith("off")]
    ['stackwise.flax.Stack', 'stackwise.haiku.Stack']
    """
    wanted = [w.strip().lower() for w in variants.split(",") if w.strip()]
    families = {f.lower() for f in FAMILIES}

    def picks(name: str, w: str) -> bool:
        family = name.split(", remat ")[0].lower()
        return family == w if w in families else w in name.lower()

    return [n for n in names if not wanted or any(picks(n, w) for w in wanted)]


def compile_order(rows: list[str], compiles: dict[str, int]) -> list[list[str]]:
    """The rows' cold compiles, round by round: round ``r`` compiles the rows in order
    ``rows`` rotated left by ``r`` (so that no row always goes first, or second), leaving out
    a row whose ``compiles[row]`` compiles are done.

    >>> compile_order(["a", "b", "c"], {"a": 3, "b": 3, "c": 3})
    [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b']]
    >>> compile_order(["loop", "b", "c"], {"loop": 1, "b": 3, "c": 3})
    [['loop', 'b', 'c'], ['b', 'c'], ['c', 'b']]
    """
    rounds = max((compiles[row] for row in rows), default=0)
    rotated = [[rows[(r + i) % len(rows)] for i in range(len(rows))] for r in range(rounds)]
    return [[row for row in order if compiles[row] > r] for r, order in enumerate(rotated)]


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
    layer_init, layer, inputs = core.transformer_block(cfg)

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

    def unrolled(remat: str, k: int | bool) -> Callable[[int], tuple]:
        import stackwise

        def build(n: int) -> tuple:
            stacked, x = inputs(n)
            layers = stackwise.stack(layer_init, layer, n, remat=common.stack_remat(remat),
                                     unroll=k)
            return stacked, x, lambda ps, h: common.mean_square(layers.apply(ps, h))

        return build

    found = {f"loop, remat {r}": loop(bench) for r, bench in REMATS.items()}
    for k in (2, True):
        found.update({f"stackwise unroll={k}, remat {r}": unrolled(bench, k)
                      for r, bench in REMATS.items()})
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
            # ("stackwise.autostack" is not a "stackwise" row)
            if (case.name.startswith(prefix) and not case.name[len(prefix):].startswith(".")
                    and not case.tool and case.remat != "nested"):
                remat = next(r for r, bench in REMATS.items() if bench == case.remat)
                found[f"{family}, remat {remat}"] = case.build
    for family, tool in ADAPTERS.items():
        try:
            adapter = _ADAPTER_BUILDS[family]
            for remat, bench in REMATS.items():
                if f"{tool}, remat {remat}" in found:
                    found[f"{family}, remat {remat}"] = adapter(
                        cfg, bench, found[f"{tool}, remat {remat}"])
        except ImportError as e:
            notes.append(f"{family}: not importable ({e}); its rows are skipped")
    return found


def same_layout(params: Any, expected: Any, who: str) -> None:
    """Raises unless ``params`` has the tree and the leaves' shapes and dtypes of
    ``expected`` (e.g. ``jax.eval_shape`` of the model's ``init``)."""
    import jax

    def spec(tree):
        return jax.tree.map(lambda a: (a.shape, a.dtype), tree)

    if spec(params) != spec(expected):
        raise ValueError(f"{who}: the tool's params converted are not the Stack's: "
                         f"{spec(params)} != {spec(expected)}")


def flax_stack(cfg: Any, remat: str, tool: Callable[[int], tuple]) -> Callable[[int], tuple]:
    """``stackwise.flax.Stack`` of linen's block (the ``nn.scan`` row's, ``bench/workloads/
    flax.py``) with ``remat`` (the bench's name), on the ``nn.scan`` row's params: the
    scanned cell's block, whose layout (layer axis first) is the Stack's, under the Stack's
    name."""
    import functools

    import flax.linen as nn
    import jax

    import stackwise.flax
    from stackwise.bench.workloads import common
    from stackwise.bench.workloads import flax as linen

    block = functools.partial(linen.Block, cfg.tf_d, cfg.tf_hidden, cfg.tf_heads)

    def build(n: int) -> tuple:
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                return stackwise.flax.Stack(block, n=n, remat=common.stack_remat(remat))(x)

        net = Model()
        scanned, x, _ = tool(n)
        (cell,) = scanned["params"]  # ScanCell_0 or ScanCheckpointCell_0
        params = {"params": {"Stack_0": scanned["params"][cell]["Block_0"]}}
        same_layout(params, jax.eval_shape(net.init, jax.random.key(0), x), "stackwise.flax")
        return params, x, lambda p, h: common.mean_square(net.apply(p, h))

    return build


def haiku_stack(cfg: Any, remat: str, tool: Callable[[int], tuple]) -> Callable[[int], tuple]:
    """``stackwise.haiku.Stack`` of Haiku's block (the ``hk.layer_stack`` row's, ``bench/
    workloads/haiku.py``) with ``remat`` (the bench's name), on the ``hk.layer_stack`` row's
    params, renamed by ``stackwise.haiku.from_layer_stack``."""
    import functools

    import haiku as hk
    import jax

    import stackwise.haiku
    from stackwise.bench.workloads import common
    from stackwise.bench.workloads import haiku as wh

    block = functools.partial(wh.Block, cfg.tf_d, cfg.tf_hidden, cfg.tf_heads)

    def build(n: int) -> tuple:
        net = hk.without_apply_rng(hk.transform(
            lambda x: stackwise.haiku.Stack(block, n=n, remat=common.stack_remat(remat))(x)))
        stacked, x, _ = tool(n)
        params = stackwise.haiku.from_layer_stack(stacked, "stack")
        same_layout(params, jax.eval_shape(net.init, jax.random.key(0), x), "stackwise.haiku")
        return params, x, lambda p, h: common.mean_square(net.apply(p, h))

    return build


#: An adapter's family -> ``adapter(cfg, bench remat, tool's build) -> build``.
_ADAPTER_BUILDS = {"stackwise.flax.Stack": flax_stack, "stackwise.haiku.Stack": haiku_stack}


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


def abstract(tree: Any) -> Any:
    """``tree``'s arrays as ``jax.ShapeDtypeStruct`` s: what a compile needs of them."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def cold_compile(loss: Callable, params: Any, x: Any) -> tuple[tuple[float, float, float], Any]:
    """``((trace, lower, XLA) seconds, compiled)``: the step of ``loss`` traced, lowered and
    compiled for ``params`` and ``x`` (shapes and dtypes) after every cache was cleared, each
    stage timed apart."""
    import jax

    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    traced = sgd_step(in_bfloat16(loss)).trace(params, x)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    end = time.perf_counter()
    return (traced_at - start, lowered_at - traced_at, end - lowered_at), compiled


def measure(name: str, build: Callable[[int], tuple], args: argparse.Namespace
            ) -> tuple[dict, tuple | None]:
    """One row's first round: build its params, compile (cold, for their shapes), run
    ``WARMUP`` then ``args.rounds`` timed steps. Returns the row (its ``"compiles"``, the
    compile's seconds) and ``(loss, params' and input's shapes)`` to compile it again, or
    None where it does not fit the device."""
    import jax

    family, remat = name.split(", remat ")
    row: dict[str, Any] = {"variant": family, "remat": remat}
    jax.clear_caches()
    gc.collect()
    params, x, loss = build(args.n)
    shapes = (abstract(params), abstract(x))
    try:
        stages, compiled = cold_compile(loss, *shapes)
        row["compiles"] = [stages]
        times, first = [], None
        for _ in range(WARMUP):
            params, value = jax.block_until_ready(compiled(params, x))
            first = float(value) if first is None else first
        with profiled(args.profile, name, compiled):
            for _ in range(args.rounds):
                start = time.perf_counter()
                params, value = jax.block_until_ready(compiled(params, x))
                times.append(time.perf_counter() - start)
    except jax.errors.JaxRuntimeError as e:
        if not out_of_memory(e):
            raise
        return {**row, "step ms": "does not fit: " + str(e).split(": ", 1)[-1][:100]}, None
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
    return row, (loss, *shapes)


def profiled(folder: str, name: str, compiled: Any) -> contextlib.AbstractContextManager:
    """With ``--profile`` (``folder``): writes ``compiled``'s text to ``folder/<row>.hlo.txt``
    and returns a ``jax.profiler`` trace into ``folder/<row>/`` (``<row>`` is the row's
    name, e.g. ``stackwise_remat_dots``); without, a context that does nothing."""
    if not folder:
        return contextlib.nullcontext()
    import jax

    slug = "_".join(name.replace(",", " ").split())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{slug}.hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    return jax.profiler.trace(os.path.join(folder, slug))


def measure_all(found: dict[str, Callable[[int], tuple]], args: argparse.Namespace) -> list[dict]:
    """The rows of ``args.rows`` that ``found`` builds, in rounds (:func:`compile_order`):
    a row's first compile is :func:`measure`'s, its later ones only compile (cold) again; a
    row that does not fit is not compiled again. Each row's ``"compile s"`` is the median of
    its compiles, ``"compiles"`` their seconds in round order."""
    names = [name for name in args.rows if name in found]
    counts = {name: args.loop_compiles if name.split(", remat ")[0] in LOOP_LIKE
              else args.compiles for name in names}
    rows: dict[str, dict] = {}
    again: dict[str, tuple | None] = {}
    for order in compile_order(names, counts):
        for name in order:
            if name not in rows:
                rows[name], again[name] = measure(name, found[name], args)
            elif again[name] is not None:
                rows[name]["compiles"].append(cold_compile(*again[name])[0])
            else:
                continue
            print(name, rows[name], file=sys.stderr, flush=True)  # (a run cut short keeps these)
    for row in rows.values():
        if "compiles" in row:
            stages = row["compiles"]
            row["compile s"] = statistics.median(sum(each) for each in stages)
            row["compiles"] = " ".join(f"{sum(each):.3g}" for each in stages)
            row["trace / lower / XLA s"] = " / ".join(
                f"{statistics.median(each[i] for each in stages):.3g}" for i in range(3))
    return [rows[name] for name in names]


def with_ratios(rows: list[dict]) -> list[dict]:
    """The rows in table order, each with its compile and step ratios to the loop's (step
    only) and to each tool's at the same remat, and an adapter's to its own framework's tool
    (``/tool``; "-" for the other rows), where both were measured."""
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
                for ref in ("loop", "nn.scan", "hk.layer_stack", "tool"):
                    if ref == "loop" and key == "compile":
                        continue  # (the loop traces n blocks: not the tools' measure)
                    theirs = by.get((ADAPTERS.get(family, "") if ref == "tool" else ref,
                                     remat), {}).get(what)
                    if isinstance(row.get(what), float) and isinstance(theirs, float):
                        row[f"{key} /{ref}"] = f"{row[what] / theirs:.2f}"
                    else:
                        row[f"{key} /{ref}"] = "-"
            out.append(row)
    return [{k: r[k] for k in COLUMNS if k in r} for r in out]


#: The table's columns, in order (the docstring says what each is).
COLUMNS = ["variant", "remat", "compile s", "compiles", "trace / lower / XLA s", "compile /tool",
           "compile /nn.scan", "compile /hk.layer_stack", "step ms", "step /loop", "step /tool",
           "step /nn.scan", "step /hk.layer_stack", "model TFLOP", "XLA TFLOP", "MFU %",
           "peak MiB", "loss"]


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
    rows = with_ratios(measure_all(found, args))
    report(rows, title(args) + "".join(f"\n\nNote: {n}" for n in notes), args.markdown)
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
