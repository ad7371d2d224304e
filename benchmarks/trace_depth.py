"""The training step's trace time against the Python call depth it starts at.

``tpu_train.md`` found the Stacks' training steps tracing slower than the tools' on the TPU
host (the Haiku Stack 0.45 s against ``hk.layer_stack``'s 0.21), where the CPU VM showed about
10%. The cause is CPython's, not the trace's work: CPython 3.11 keeps its Python frames in
chunks of a per-thread data stack, maps a new chunk (``mmap``) when a call goes deeper than the
chunks it has and unmaps it when that call returns, so a trace whose deepest calls cross a
chunk boundary maps and unmaps memory at each crossing, and touches the new pages (minor page
faults). Where the depth of that boundary falls depends on how deep the trace starts. This
script starts each trace under ``offset`` extra Python frames and times it, the Stacks and
their frameworks' tools interleaved, and reads the main thread's minor page faults
(``getrusage(RUSAGE_THREAD)``, where the kernel reports them).

    python benchmarks/trace_depth.py --markdown OUT.md [--offsets 0,4,...] [--rounds 3]

The model is ``tpu_train.py``'s default (d_model 1024, 16 heads, MLP 4096, 16 blocks, sequence
1024, batch 8, remat saving the matmuls, bfloat16 compute): only its shapes are traced.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tpu_decode_hlo import nonnegative, positive  # benchmarks/tpu_decode_hlo.py
from tpu_train import CHIP, sgd_step  # benchmarks/tpu_train.py

#: ``tpu_train.py``'s default model.
D, HEADS, HIDDEN, N, SEQ, BATCH = (CHIP[k] for k in ("d", "heads", "hidden", "n", "seq", "batch"))
#: Whose page faults are read: this thread's (Linux), else the process's.
WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def haiku_steps() -> dict[str, tuple[Callable, Any]]:
    """``{row: (loss(params, x), params' shapes)}`` for ``hk.layer_stack`` and the Haiku Stack."""
    import haiku as hk
    import jax

    import stackwise.haiku
    from stackwise.bench.workloads import haiku as wh

    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    block = functools.partial(wh.Block, D, HIDDEN, HEADS)

    def tool(x):
        return hk.layer_stack(N)(hk.remat(lambda x: block()(x), policy=policy))(x)

    def stack(x):
        return stackwise.haiku.Stack(block, n=N, remat=policy)(x)

    return {name: _transformed(hk.without_apply_rng(hk.transform(f)))
            for name, f in (("hk.layer_stack", tool), ("stackwise.haiku.Stack", stack))}


def linen_steps() -> dict[str, tuple[Callable, Any]]:
    """The same for ``nn.scan`` and the linen Stack."""
    import flax.linen as nn
    import jax

    import stackwise.flax
    from stackwise.bench.workloads import flax as wf

    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            cell = nn.remat(wf.Cell, policy=policy)
            scan = nn.scan(cell, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=N)
            return scan(D, HIDDEN, HEADS)(x, None)[0]

    class Stacked(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = functools.partial(wf.Block, D, HIDDEN, HEADS)
            return stackwise.flax.Stack(block, n=N, remat=policy)(x)

    return {name: _transformed(module)
            for name, module in (("nn.scan", Scanned()), ("stackwise.flax.Stack", Stacked()))}


def _transformed(net: Any) -> tuple[Callable, Any]:
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((BATCH, SEQ, D), jnp.float32)
    params = jax.eval_shape(net.init, jax.random.key(0), x)

    def loss(p, h):
        cast = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
        return jnp.mean(net.apply(jax.tree.map(cast, p), cast(h)).astype(jnp.float32) ** 2)

    return loss, (params, x)


def under(frames: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` called ``frames`` Python frames deeper than this call."""
    return fn() if frames == 0 else under(frames - 1, fn)


def timed(frames: int, loss: Callable, shapes: tuple) -> tuple[float, int]:
    """``(seconds, minor page faults of this thread)`` of one cold trace at the depth."""
    import jax

    jax.clear_caches()
    gc.collect()
    faults = resource.getrusage(WHO).ru_minflt
    start = time.perf_counter()
    under(frames, lambda: sgd_step(loss).trace(*shapes))
    seconds = time.perf_counter() - start
    return seconds, resource.getrusage(WHO).ru_minflt - faults


def offsets(value: str) -> list[int]:
    """An argparse type: comma-separated integers of 0 or more."""
    try:
        return [nonnegative(v.strip()) for v in value.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers of 0 or more, got {value!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offsets", type=offsets, default=list(range(0, 60, 4)),
                   help="the extra Python frames each trace starts under (default 0,4,...,56)")
    p.add_argument("--rounds", type=positive, default=3,
                   help="cold traces a row and offset, their median reported (default 3)")
    p.add_argument("--markdown", default="", help="also write the tables to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    args = parse_args(given)
    import jax

    pairs = [("Haiku", haiku_steps()), ("linen", linen_steps())]
    for _, rows in pairs:  # warm: imports, the tools' first-use caches
        for loss, shapes in rows.values():
            sgd_step(loss).trace(*shapes)
    lines = [f"Cold trace of the training step (`jit(value_and_grad)` + SGD; d_model {D}, "
             f"{HEADS} heads, MLP {HIDDEN}, {N} blocks, sequence {SEQ}, batch {BATCH}, remat "
             f"saving the matmuls), under `offset` extra Python frames; median of "
             f"{args.rounds}, rows interleaved; faults: the main thread's minor page faults "
             f"in one trace (on {jax.devices()[0].device_kind}, {jax.default_backend()}; "
             f"Python {platform.python_version()}; jax {jax.__version__}); "
             f"`python benchmarks/trace_depth.py {shlex.join(given)}`", ""]
    for framework, rows in pairs:
        (tool, tool_step), (stack, stack_step) = rows.items()
        lines += [f"| offset | {tool} ms | {stack} ms | {stack} / {tool} | faults, tool / Stack |",
                  "|---|---|---|---|---|"]
        ratios = []
        for frames in args.offsets:
            runs: dict[str, list] = {tool: [], stack: []}
            for _ in range(args.rounds):
                for name, (loss, shapes) in ((tool, tool_step), (stack, stack_step)):
                    runs[name].append(timed(frames, loss, shapes))
            ms = {k: 1e3 * statistics.median(s for s, _ in v) for k, v in runs.items()}
            faults = {k: statistics.median(f for _, f in v) for k, v in runs.items()}
            ratios.append(ms[stack] / ms[tool])
            lines.append(f"| {frames} | {ms[tool]:.1f} | {ms[stack]:.1f} | "
                         f"{ratios[-1]:.2f} | {faults[tool]:.0f} / {faults[stack]:.0f} |")
            print(framework, lines[-1], flush=True)
        lines += ["", f"{framework}: {stack} / {tool} from {min(ratios):.2f} to "
                  f"{max(ratios):.2f} over the offsets, median {statistics.median(ratios):.2f}.",
                  ""]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
