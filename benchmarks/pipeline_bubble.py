"""Bubble fraction of the GPipe and circular schedules, measured against the theory.

Usage: ``python benchmarks/pipeline_bubble.py [--stages 4] [--rounds 9] [--markdown out.md]``
(sets ``XLA_FLAGS=--xla_force_host_platform_device_count=S`` itself).

Method. ``stackwise.pipeline`` is SPMD: every stage runs every tick, and a
stage with no microbatch (the fill and drain "bubble") computes on a
placeholder that is masked out. So a step costs ``c + b * T``: T ticks of
cost b, plus a fixed overhead c, where T = M*V + S - 1 and M*V of them do
useful work. Two facts are taken from the compiled program, not assumed:
T, the trip count of the loop that runs the stage-to-stage
``collective-permute``, and that it is one loop (the program is flat in M).
The time is measured in ratios that survive a loaded machine: in each round
every variant runs, in a new shuffled order, once untimed and then
``--calls`` times back to back (the fastest counts), and each variant's time
is divided by the same round's time of its schedule's largest M; the median
over rounds of those paired ratios r(M) is fitted by ``r = alpha + beta * T``.
Then the measured bubble at M is ``1 - M*V*beta / r(M)`` (the share of the step not spent on useful
ticks, overhead included) against the theory ``(S-1)/(M*V+S-1)``, and
``alpha/beta`` is the overhead in ticks. Circular against GPipe at the same
M is a paired ratio too, against ``(M*V+S-1) / (V*(M+S-1))`` (ticks of
``1/V`` the layers each).

On simulated CPU devices the S "devices" share the machine's cores, so a
tick costs all stages' work: absolute times say nothing about accelerators,
but the share of ticks that are bubble is the schedule's.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time


def _tick_loop_trips(hlo: str) -> list[int]:
    """Trip counts of the while loops whose body runs a collective-permute."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)

    def reaches_permute(comp, seen):
        if comp in seen:
            return False
        seen.add(comp)
        lines = comps.get(comp, ())
        if any(" collective-permute(" in ln or " collective-permute-start(" in ln for ln in lines):
            return True
        callees = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", "\n".join(lines))
        return any(reaches_permute(c, seen) for c in callees)

    trips = []
    for lines in comps.values():
        for line in lines:
            loop = re.search(r" while\(.*body=%([\w.\-]+)", line)
            count = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            if loop and count and reaches_permute(loop.group(1), set()):
                trips.append(int(count.group(1)))
    return trips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=128, help="rows per microbatch")
    parser.add_argument("--gpipe", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--circular", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2, help="V of the circular schedule")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=3,
                        help="back-to-back timed calls per variant per round (the fastest counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    if "jax" in sys.modules:
        raise RuntimeError("run this as a script: it must set XLA_FLAGS before importing jax")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.stages}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import stackwise

    S, d, V = args.stages, args.width, args.repeats
    n = S * args.layers_per_stage
    if len(jax.devices()) < S:
        raise SystemExit(f"need {S} devices, found {len(jax.devices())}")
    mesh = jax.make_mesh((S,), ("stage",), devices=jax.devices()[:S])

    def init(key):
        return {"w": jax.random.normal(key, (d, d)) / d**0.5}

    def apply(params, x):
        return x + jnp.tanh(x @ params["w"])

    params = jax.jit(stackwise.stack(init, apply, n).init)(jax.random.key(0))
    variants = {}  # (schedule, M) -> (compiled, params, x, ticks)
    for schedule, Ms in (("gpipe", args.gpipe), ("circular", args.circular)):
        repeats = V if schedule == "circular" else None
        placed = stackwise.shard_stacked(params, mesh, layer_axis="stage", repeats=repeats or 1)
        for M in Ms:
            pp = stackwise.pipeline(None, apply, n, mesh, microbatches=M, schedule=schedule,
                                    repeats=repeats)
            x = jax.random.normal(jax.random.key(1), (M * args.microbatch, d))
            compiled = jax.jit(pp.apply).lower(placed, x).compile()
            trips = _tick_loop_trips(compiled.as_text())
            expected = M * (repeats or 1) + S - 1
            if trips != [expected]:
                raise SystemExit(f"{schedule} M={M}: tick loop trips {trips}, expected {expected}")
            compiled(placed, x).block_until_ready()  # warm up
            variants[schedule, M] = (compiled, placed, x, expected)

    rng = random.Random(args.seed)
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        order = list(variants)
        rng.shuffle(order)
        for key in order:
            compiled, placed, x, _ = variants[key]
            compiled(placed, x).block_until_ready()
            best = float("inf")
            for _ in range(args.calls):
                start = time.perf_counter()
                compiled(placed, x).block_until_ready()
                best = min(best, time.perf_counter() - start)
            times[key].append(best)

    lines = [
        f"S={S} stages x {args.layers_per_stage} layers (n={n}), width {d}, {args.microbatch} "
        f"rows per microbatch, {S} simulated {jax.devices()[0].platform} devices, "
        f"{args.rounds} rounds of the fastest of {args.calls} calls; circular V={V}",
        "",
        "| schedule | M | ticks (program) | r(M) median [min, max] | bubble measured | "
        "bubble theory |",
        "|---|---|---|---|---|---|",
    ]
    fits = {}
    for schedule, Ms in (("gpipe", args.gpipe), ("circular", args.circular)):
        v = V if schedule == "circular" else 1
        ref = max(Ms)
        ratios = {M: [t / r for t, r in zip(times[schedule, M], times[schedule, ref])]
                  for M in Ms}
        med = {M: statistics.median(ratios[M]) for M in Ms}
        ticks = np.array([variants[schedule, M][3] for M in Ms], float)
        beta, alpha = np.polyfit(ticks, np.array([med[M] for M in Ms]), 1)
        fits[schedule] = (alpha, beta)
        for M in Ms:
            measured = 1 - M * v * beta / med[M]
            theory = (S - 1) / (M * v + S - 1)
            lines.append(
                f"| {schedule} | {M} | {variants[schedule, M][3]} | {med[M]:.3f} "
                f"[{min(ratios[M]):.3f}, {max(ratios[M]):.3f}] | {measured:.3f} | {theory:.3f} |"
            )
    lines += ["", "Fit r = alpha + beta * ticks: overhead alpha/beta in ticks: "
              + ", ".join(f"{s} {a / b:.2f}" for s, (a, b) in fits.items()), ""]
    both = sorted(set(args.gpipe) & set(args.circular))
    if both:
        lines += ["| M | circular / gpipe step, median [min, max] | theory |", "|---|---|---|"]
        for M in both:
            r = [c / g for c, g in zip(times["circular", M], times["gpipe", M])]
            theory = (M * V + S - 1) / (V * (M + S - 1))
            lines.append(f"| {M} | {statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] "
                         f"| {theory:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
