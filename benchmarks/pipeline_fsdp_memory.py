"""Per-device memory and gathers of FSDP inside pipeline stages, 8 simulated CPU devices.

Usage: ``python benchmarks/pipeline_fsdp_memory.py [--markdown out.md]`` (sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu`` itself, a
TPU host's too: ``benchmarks/_devices.py``).

8 layers of ``x + tanh(x @ w + b)``, width 256 (2 MiB of params, 0.5 MiB per stage),
on a ``(stage=4, data=2)`` mesh, batch 64, ``remat=True``. Each schedule (GPipe;
circular with V=2) runs with each stage's params replicated over ``"data"`` and with
``fsdp="data"`` (specs from ``stackwise.fsdp_specs``), gathering once per step or per
tick. Every figure is ``jax.jit(jax.grad(loss)).lower(...).compile()`` of one device's
program: the params' shard on one device, ``memory_analysis()`` for grads (the outputs)
and temp, and the
compiled HLO for the all-gathers of the stage's ``w`` (inside the tick loop or not).
``bound`` is the params' total / 8.
"""

from __future__ import annotations

import argparse
import os
import sys

from _devices import header, simulate_cpu_devices  # benchmarks/_devices.py

MIB = 2**20


def _rows():
    import jax
    import jax.numpy as jnp

    import stackwise

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
    from _hlo import collectives

    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    width, n, batch = 256, 8, 64

    def init(key):
        return {"w": jax.random.normal(key, (width, width)) / width**0.5,
                "b": jnp.zeros((width,))}

    def apply(p, x):
        return x + jnp.tanh(x @ p["w"] + p["b"])

    shapes = jax.eval_shape(stackwise.stack(init, apply, n).init, jax.random.key(0))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total = sum(a.nbytes for a in jax.tree.leaves(zeros)) / MIB
    x = jnp.zeros((batch, width))
    rows = []
    for schedule, repeats in (("gpipe", None), ("circular", 2)):
        for fsdp, gather in ((None, "step"), ("data", "step"), ("data", "tick")):
            specs = stackwise.fsdp_specs(zeros, mesh, "data") if fsdp else None
            params = stackwise.shard_stacked(zeros, mesh, specs, layer_axis="stage",
                                             repeats=repeats or 1)
            temps, gathers = [], None
            for m in (4, 8, 16):
                pp = stackwise.pipeline(None, apply, n, mesh, microbatches=m, data_axis="data",
                                        schedule=schedule, repeats=repeats, remat=True,
                                        fsdp=fsdp, fsdp_gather=gather)
                grad = jax.jit(jax.grad(lambda p, v, pp=pp: jnp.sum(pp.apply(p, v))))
                compiled = grad.lower(params, x).compile()
                stats = compiled.memory_analysis()
                temps.append(stats.temp_size_in_bytes / MIB)
                if m == 4:
                    found = [c for c in collectives(compiled.as_text())
                             if c[0] == "all-gather" and f",{width}," in c[1] + ","]
                    gathers = (sum(d == 0 for *_, d in found), sum(d > 0 for *_, d in found))
                    held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params))
                    sizes = (held / MIB, stats.output_size_in_bytes / MIB)
            mode = "replicated" if fsdp is None else f"fsdp, {gather}"
            rows.append((schedule, mode, *sizes, *temps, *gathers, total / 8))
    return rows


def _markdown(rows) -> str:
    lines = [
        header("**FSDP inside 4 pipeline stages: per device (MiB), 8 devices, 2 MiB of params**"),
        "",
        "| schedule | stage params | params | grads | temp M=4 | temp M=8 | temp M=16 "
        "| gathers of w: outside / inside the tick loop | bound (total/8) | params / bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule, mode, params, grads, t4, t8, t16, outside, inside, bound in rows:
        lines.append(
            f"| {schedule} | {mode} | {params:.3f} | {grads:.3f} | {t4:.2f} | {t8:.2f} | "
            f"{t16:.2f} | {outside} / {inside} | {bound:.3f} | {params / bound:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    text = _markdown(_rows())
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    simulate_cpu_devices(8)
    main()
