"""Measured bubble fraction of the GPipe schedule vs the theory (S-1)/(M+S-1).

Usage: ``python benchmarks/pipeline_bubble.py [--stages 4] [--reps 5]``
(sets ``XLA_FLAGS=--xla_force_host_platform_device_count=S`` itself when run
on CPU).

What is measured. ``stackwise.pipeline`` is SPMD: every stage runs every
tick, and a stage with no microbatch to work on (the fill and drain
"bubble") computes on a placeholder that is then masked out. So the wall time
of a pipelined step is ``overhead + (M + S - 1) * tick``: M useful ticks and
S - 1 bubble ticks. With the microbatch size held fixed we time the step for
several M and fit ``T(M) = c + b * M``: ``b`` is the time of one tick and
``c / b`` the number of ticks that do no useful work (theory: ``S - 1``, plus
a fixed overhead). The measured bubble fraction at each M is
``(T(M) - M * b) / T(M)``, to compare with ``(S-1)/(M+S-1)``.

On simulated CPU devices the S "devices" share the machine's cores, so a
tick costs S stages' work run side by side (or one after another on 2
cores), not one stage's: the absolute times say nothing about a real
accelerator, but the *fraction* of ticks wasted is the schedule's, which is
what this reports. On real devices each stage would run in parallel and the
bubble fraction would be the same (S-1)/(M+S-1), less whatever the
collective-permutes overlap.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=64, help="rows per microbatch")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if "jax" in sys.modules:
        raise RuntimeError("run this as a script: it must set XLA_FLAGS before importing jax")
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={args.stages}"
    )

    import jax
    import jax.numpy as jnp
    import numpy as np

    import stackwise
    from stackwise._pipeline import pipeline

    S, d = args.stages, args.width
    n = S * args.layers_per_stage
    if len(jax.devices()) < S:
        raise SystemExit(f"need {S} devices, found {len(jax.devices())}")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:S]), ("stage",))

    def init(key):
        return {"w": jax.random.normal(key, (d, d)) / d**0.5}

    def apply(params, x):
        return x + jnp.tanh(x @ params["w"])

    params = jax.jit(stackwise.stack(init, apply, n).init)(jax.random.key(0))

    def timed(fn, *a):
        fn(*a).block_until_ready()  # compile
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            fn(*a).block_until_ready()
            times.append(time.perf_counter() - start)
        return float(np.min(times))  # the least-disturbed run: the CPU may be shared

    Ms = args.microbatches
    T = []
    for M in Ms:
        x = jax.random.normal(jax.random.key(1), (M * args.microbatch, d))
        T.append(timed(jax.jit(pipeline(apply, n, mesh, microbatches=M)), params, x))
    b, c = np.polyfit(np.array(Ms, float), np.array(T), 1)

    print(f"GPipe, S={S} stages x {args.layers_per_stage} layers, width {d}, "
          f"{args.microbatch} rows per microbatch, {len(jax.devices())} "
          f"{jax.devices()[0].platform} devices, best of {args.reps}")
    print(f"fit T(M) = c + b*M: tick b = {b * 1e3:.2f} ms, c = {c * 1e3:.2f} ms = "
          f"{c / b:.2f} ticks (theory: S-1 = {S - 1} bubble ticks + overhead)")
    print(f"{'M':>4} {'ticks':>6} {'T (ms)':>9} {'measured':>9} {'theory':>8}")
    for M, t in zip(Ms, T):
        print(f"{M:>4} {M + S - 1:>6} {t * 1e3:>9.2f} {(t - M * b) / t:>9.3f} "
              f"{(S - 1) / (M + S - 1):>8.3f}")


if __name__ == "__main__":
    main()
