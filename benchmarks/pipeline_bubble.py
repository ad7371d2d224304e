"""Bubble fraction of the GPipe, circular and 1F1B schedules, measured against the theory.

Usage: ``python benchmarks/pipeline_bubble.py [--stages 4] [--rounds 9] [--markdown out.md]``
(sets ``XLA_FLAGS=--xla_force_host_platform_device_count=S`` and ``JAX_PLATFORMS=cpu`` itself,
a TPU host's too: ``benchmarks/_devices.py``); the 1F1B
training step and GPipe's: ``--gpipe --circular --gpipe-step 1 2 4 8 16 --1f1b 1 2 4
8 16 --memory 4 8 16 32``; interleaved 1F1B (``--repeats`` chunks per stage, M a
multiple of S): ``--1f1b-interleaved 4 8 16``.

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

The training steps (``value_and_grad`` of a mean squared error) are fitted the
same way. GPipe's step runs a forward and a backward loop of ``M + S - 1`` ticks
each: a bubble of ``(S-1)/(M+S-1)``. 1F1B runs ``M + 2S - 2`` ticks in three
loops: ``S - 1`` in which every stage runs a forward (masked when it has no
microbatch), ``M - S + 1`` of a forward and a backward, ``S - 1`` of a backward:
the time of ``T = M + S - 1`` ticks of a forward and a backward (the fit's T),
M of them useful: a bubble of ``(S-1)/(M+S-1)``. Interleaved 1F1B
(``schedule="1f1b", repeats=V``) runs ``M*V + V*S + S - 2`` ticks of ``1/V``
the layers in loops of ``V*S - 1``, ``M*V + S - V*S`` and ``V*S - 1``: the time
of ``T = M*V + S - 1`` full ticks, M*V of them useful, a bubble of
``(S-1)/(M*V+S-1)``; against 1F1B at the same M its step takes
``(M*V+S-1) / (V*(M+S-1))`` as long (ticks of ``1/V`` the layers each). The
loops' trip counts are checked against these.
``--memory`` reads the steps' compiled temp memory at fixed rows per
microbatch, so that the batch grows with M.

On simulated CPU devices the S "devices" share the machine's cores, so a
tick costs all stages' work: absolute times say nothing about accelerators,
but the share of ticks that are bubble is the schedule's.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time

from _devices import header, simulate_cpu_devices  # benchmarks/_devices.py


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
    parser.add_argument("--gpipe", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                        help="M of GPipe forward passes to time (none: skip)")
    parser.add_argument("--circular", type=int, nargs="*", default=[4, 8, 16],
                        help="M of circular forward passes to time (none: skip)")
    parser.add_argument("--gpipe-step", type=int, nargs="*", default=[],
                        help="M of GPipe training steps (value_and_grad) to time")
    parser.add_argument("--1f1b", dest="one_f_one_b", type=int, nargs="*", default=[],
                        help="M of 1F1B training steps (value_and_grad) to time")
    parser.add_argument("--1f1b-interleaved", dest="interleaved", type=int, nargs="*",
                        default=[], help="M of interleaved 1F1B training steps (repeats=V, "
                                         "M a multiple of S) to time")
    parser.add_argument("--memory", type=int, nargs="*", default=[],
                        help="M at which to read the training steps' compiled temp memory "
                             "(GPipe, 1F1B and, for M a multiple of S, interleaved 1F1B; "
                             "remat=True, --microbatch rows each)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="V of the circular and interleaved 1F1B schedules")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=3,
                        help="back-to-back timed calls per variant per round (the fastest counts)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: time.process_time, the CPU time of "
                             "all of this process's threads (the simulated devices' work), "
                             "less disturbed by other processes on a shared machine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    simulate_cpu_devices(args.stages)

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

    def mse(y, t):
        return jnp.mean((y - t) ** 2)

    def step(schedule, M, remat=False):
        """A schedule's jitted call: the forward pass, or a training step (loss and grads)."""
        if schedule in ("gpipe", "circular"):
            repeats = V if schedule == "circular" else None
            pp = stackwise.pipeline(None, apply, n, mesh, microbatches=M, schedule=schedule,
                                    repeats=repeats)
            return jax.jit(pp.apply), repeats or 1
        if schedule in ("1f1b", "1f1b-interleaved"):
            repeats = V if schedule == "1f1b-interleaved" else 1
            pp = stackwise.pipeline(None, apply, n, mesh, microbatches=M, schedule="1f1b",
                                    loss=mse, remat=remat, repeats=repeats)
            return jax.jit(jax.value_and_grad(pp.apply)), repeats
        pp = stackwise.pipeline(None, apply, n, mesh, microbatches=M, remat=remat)
        return jax.jit(jax.value_and_grad(lambda p, x, t: mse(pp.apply(p, x), t))), 1

    def ticks(schedule, M, v):
        """The schedule's ticks T (1F1B: the time of its loops in ticks of a forward and a
        backward) and the trip counts of the loops that run them (a loop of one trip is
        inlined by XLA: not counted)."""
        T = M * v + S - 1
        if schedule in ("1f1b", "1f1b-interleaved"):
            fill = v * S - 1  # forwards only, then backwards only
            return T, [t for t in (fill, T - fill, fill) if t > 1]
        return T, [T, T] if schedule == "gpipe-step" else [T]

    params = jax.jit(stackwise.stack(init, apply, n).init)(jax.random.key(0))
    series = [("gpipe", args.gpipe), ("circular", args.circular),
              ("gpipe-step", args.gpipe_step), ("1f1b", args.one_f_one_b),
              ("1f1b-interleaved", args.interleaved)]
    series = [(schedule, Ms) for schedule, Ms in series if Ms]
    variants = {}  # (schedule, M) -> (compiled, inputs, ticks, useful ticks)
    for schedule, Ms in series:
        fn, v = step(schedule, Ms[0])
        placed = stackwise.shard_stacked(params, mesh, layer_axis="stage", repeats=v)
        for M in Ms:
            fn, v = step(schedule, M)
            x = jax.random.normal(jax.random.key(1), (M * args.microbatch, d))
            inputs = (placed, x) if schedule in ("gpipe", "circular") else (placed, x, x)
            compiled = fn.lower(*inputs).compile()
            trips = _tick_loop_trips(compiled.as_text())
            T, loops = ticks(schedule, M, v)
            if sorted(trips) != sorted(loops):
                raise SystemExit(f"{schedule} M={M}: tick loop trips {trips}, expected {loops}")
            jax.block_until_ready(compiled(*inputs))  # warm up
            variants[schedule, M] = (compiled, inputs, T, M * v)

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    rng = random.Random(args.seed)
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        order = list(variants)
        rng.shuffle(order)
        for key in order:
            compiled, inputs, _, _ = variants[key]
            jax.block_until_ready(compiled(*inputs))
            best = float("inf")
            for _ in range(args.calls):
                start = clock()
                jax.block_until_ready(compiled(*inputs))
                best = min(best, clock() - start)
            times[key].append(best)

    lines = [
        f"S={S} stages x {args.layers_per_stage} layers (n={n}), width {d}, {args.microbatch} "
        f"rows per microbatch, {S} simulated {jax.devices()[0].platform} devices, "
        f"{args.rounds} rounds of the fastest of {args.calls} calls ({args.clock} clock); "
        f"circular and 1f1b-interleaved V={V}; "
        + header("gpipe and circular: the forward pass; gpipe-step, 1f1b and 1f1b-interleaved: "
                 "a training step (value_and_grad of the mean squared error, remat=False)"),
        "",
        "| schedule | M | ticks (program) | r(M) median [min, max] | bubble measured | "
        "bubble theory |",
        "|---|---|---|---|---|---|",
    ]
    fits = {}
    for schedule, Ms in series:
        ref = max(Ms)
        ratios = {M: [t / r for t, r in zip(times[schedule, M], times[schedule, ref])]
                  for M in Ms}
        med = {M: statistics.median(ratios[M]) for M in Ms}
        tick_counts = np.array([variants[schedule, M][2] for M in Ms], float)
        beta, alpha = np.polyfit(tick_counts, np.array([med[M] for M in Ms]), 1)
        fits[schedule] = (alpha, beta)
        for M in Ms:
            T, useful = variants[schedule, M][2:]
            measured = 1 - useful * beta / med[M]
            theory = 1 - useful / T
            lines.append(
                f"| {schedule} | {M} | {T} | {med[M]:.3f} "
                f"[{min(ratios[M]):.3f}, {max(ratios[M]):.3f}] | {measured:.3f} | {theory:.3f} |"
            )
    lines += ["", "Fit r = alpha + beta * ticks: overhead alpha/beta in ticks: "
              + ", ".join(f"{s} {a / b:.2f}" for s, (a, b) in fits.items()), ""]
    for a, b, theory, what in (
        ("circular", "gpipe", lambda M: (M * V + S - 1) / (V * (M + S - 1)),
         "(M*V+S-1) / (V*(M+S-1)) (ticks of 1/V the layers each)"),
        ("1f1b", "gpipe-step", lambda M: 1.0,
         "1, the ratio of ticks (M+S-1 of a forward and a backward each), the step ratio if a "
         "1F1B tick cost a GPipe forward tick plus a backward tick; it costs more, as its "
         "backward recomputes the stage's forward from the stage's input (2F+B against F+B)"),
        ("1f1b-interleaved", "1f1b", lambda M: (M * V + S - 1) / (V * (M + S - 1)),
         "(M*V+S-1) / (V*(M+S-1)) (ticks of 1/V the layers each)"),
    ):
        both = sorted(set(dict(series).get(a, [])) & set(dict(series).get(b, [])))
        if both:
            lines += [header(f"{a} / {b}") + ":", "",
                      f"| M | {a} / {b} step, median [min, max] | theory |", "|---|---|---|"]
            for M in both:
                r = [x / y for x, y in zip(times[a, M], times[b, M])]
                lines.append(f"| {M} | {statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] "
                             f"| {theory(M):.3f} |")
            lines += ["", f"Theory: {what}.", ""]
    if args.memory:
        lines += [
            header(f"Compiled temp memory (MiB) of the training step, remat=True, "
                   f"{args.microbatch} rows per microbatch (the batch grows with M), gradients "
                   "of the params") + ":",
            "",
            "| schedule | " + " | ".join(f"M={M}" for M in args.memory) + " | last / first |",
            "|---|" + "---|" * (len(args.memory) + 1),
        ]
        for schedule in ("gpipe-step", "1f1b", "1f1b-interleaved"):
            mib = []
            for M in args.memory:
                if schedule == "1f1b-interleaved" and M % S:
                    mib.append(float("nan"))  # interleaved 1F1B needs M a multiple of S
                    continue
                fn, v = step(schedule, M, remat=True)
                placed = stackwise.shard_stacked(params, mesh, layer_axis="stage", repeats=v)
                x = jnp.zeros((M * args.microbatch, d))
                mem = fn.lower(placed, x, x).compile().memory_analysis()
                mib.append(mem.temp_size_in_bytes / 2**20)
            real = [m for m in mib if m == m]  # not nan
            lines.append(f"| {schedule} | " + " | ".join(f"{m:.2f}" for m in mib)
                         + f" | {real[-1] / real[0]:.2f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
