"""The optimizer step on stacked params: ``stackwise.optax.layerwise`` against the alternatives.

For each optimizer, one jitted step (``tx.update`` + ``optax.apply_updates``, the gradients
given) of a residual-MLP stack's params, n layers of ``w1 (D, H)``, ``b1 (H,)``, ``w2 (H, D)``:

- **wrapped**: ``layerwise(tx)`` on the stacked params (the loop model's updates);
- **unwrapped**: ``tx`` on the stacked params (faster or not, but a different optimizer for the
  shape-aware ones: LAMB's trust ratio over all layers at once, Muon's orthogonalisation of
  a 3-D leaf replaced by AdamW, ...);
- **loop**: ``tx`` on the loop model's params (a list of n per-layer trees);
- for Muon, also **own batch axes**: ``contrib.muon`` with ``muon_weight_dimension_numbers``
  naming the layer axis a batch axis (``stackwise.optax.muon_dimensions()``: Muon's own way
  to be exact on stacked leaves, which ``layerwise`` now takes itself: the same program).

Rounds visit the variants in a new shuffled order; each variant is timed on the second of
two back-to-back calls, and the ratios are medians of the per-round ratios (so a drift of the
machine's speed cancels out). Cold compile: ``jax.clear_caches()``, then lower + compile.

    python benchmarks/optimizer_step.py --rounds 21 \\
        --markdown benchmarks/results/optimizer_step.md > benchmarks/results/optimizer_step.txt
    python benchmarks/optimizer_step.py --only lars adamw --rounds 61 \\
        --markdown benchmarks/results/optimizer_step_lars.md \\
        > benchmarks/results/optimizer_step_lars.txt

(No CSV in ``benchmarks/results/``: the saved-results tests read every CSV there as a
``stackwise-bench`` run; ``--csv`` writes one elsewhere.)
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import random
import statistics
import sys
import time


def positive(text: str) -> int:
    """An argparse type: an integer of 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=positive, default=48, help="layers (default 48)")
    p.add_argument("--d", type=positive, default=128, help="model width D (default 128)")
    p.add_argument("--hidden", type=positive, default=256, help="hidden width H (default 256)")
    p.add_argument("--rounds", type=positive, default=15, help="timed rounds (default 15)")
    p.add_argument("--only", nargs="*", default=(), help="optimizers whose name contains one")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--csv", help="write the rows here")
    return p.parse_args(argv)


# The command line above needs only the standard library: run as a script, --help and argument
# errors answer before JAX and optax are imported.
if __name__ == "__main__":
    parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import stackwise  # noqa: E402
import stackwise.optax  # noqa: E402
from stackwise.bench.report import backend  # noqa: E402

OPTIMIZERS = {
    "adamw (elementwise)": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-3),
    "lars": lambda: optax.lars(1e-1),
    "adafactor": lambda: optax.adafactor(1e-3),
    "contrib.muon": lambda: optax.contrib.muon(1e-3),
    "adaptive_grad_clip + sgd": lambda: optax.chain(optax.adaptive_grad_clip(0.01),
                                                     optax.sgd(1e-2)),
    "clip_by_block_rms + sgd": lambda: optax.chain(optax.clip_by_block_rms(0.1),
                                                    optax.sgd(1e-2)),
    "clip_by_global_norm + lamb": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                       optax.lamb(1e-3)),
}


def _params(n, d, h):
    k = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k[0], (n, d, h)) / d**0.5, "b1": jnp.zeros((n, h)),
            "w2": jax.random.normal(k[1], (n, h, d)) / h**0.5}


def _variants(name, params):
    n = params["w1"].shape[0]
    loop = [jax.tree.map(lambda a, i=i: a[i], params) for i in range(n)]
    out = {
        "wrapped": (stackwise.optax.layerwise(OPTIMIZERS[name]()), params),
        "unwrapped": (OPTIMIZERS[name](), params),
        "loop": (OPTIMIZERS[name](), loop),
    }
    if name == "contrib.muon":
        dims = stackwise.optax.muon_dimensions()
        own = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=dims)
        out["own batch axes"] = (own, params)
    return out


def _step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


def measure(n, d, h, rounds, only):
    params = _params(n, d, h)
    rows = []
    for name in OPTIMIZERS:
        if only and not any(o in name for o in only):
            continue
        cases = {}
        for variant, (tx, p) in _variants(name, params).items():
            grads = jax.tree.map(lambda a: jnp.sin(a) * 1e-2, p)
            state = tx.init(p)
            jax.clear_caches()
            start = time.perf_counter()
            compiled = _step(tx).lower(p, state, grads).compile()
            cases[variant] = (compiled, p, state, grads, time.perf_counter() - start)
        times = {v: [] for v in cases}
        for _ in range(rounds):
            order = list(cases)
            random.shuffle(order)
            for v in order:
                compiled, p, state, grads, _ = cases[v]
                jax.block_until_ready(compiled(p, state, grads))
                start = time.perf_counter()
                jax.block_until_ready(compiled(p, state, grads))
                times[v].append(time.perf_counter() - start)
        for v, (*_, compile_s) in cases.items():
            ratio = lambda other, v=v, times=times: statistics.median(  # noqa: E731
                a / b for a, b in zip(times[v], times[other]))
            rows.append({
                "optimizer": name, "variant": v, "n": n,
                "step_ms": 1e3 * statistics.median(times[v]),
                "x_unwrapped": ratio("unwrapped"), "x_loop": ratio("loop"),
                "compile_s": compile_s,
            })
        print(f"{name}: " + ", ".join(f"{r['variant']} {r['step_ms']:.2f} ms "
                                       f"({r['x_unwrapped']:.2f}x unwrapped)"
                                       for r in rows if r["optimizer"] == name), flush=True)
    return rows


def markdown(rows, args, load) -> str:
    head = (f"# Optimizer step on stacked params: n={args.n}, D={args.d}, H={args.hidden}\n\n"
            f"`python benchmarks/optimizer_step.py {' '.join(sys.argv[1:])}`: {args.rounds} "
            f"rounds; Python {platform.python_version()}, jax {jax.__version__}, optax "
            f"{optax.__version__}, {os.cpu_count()} cores, on {backend()}; load "
            f"average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after ("
            + ("the machine is shared: loaded, so " if load[0] > (os.cpu_count() or 1) else
               "otherwise idle; ")
            + "ratios within one run, not absolute times, are the result).\n\n"
            "step ms: median over the rounds; ×unwrapped, ×loop: medians of the per-round "
            "ratios of this variant's step to that one's; compile s: cold.\n\n"
            "| optimizer | variant | step ms | ×unwrapped | ×loop | compile s |\n"
            "|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['optimizer']} | {r['variant']} | {r['step_ms']:.2f} | "
                   f"{r['x_unwrapped']:.2f} | {r['x_loop']:.2f} | {r['compile_s']:.2f} |\n"
                   for r in rows)
    return head + body


def main(argv=None):
    args = parse_args(argv)
    load = os.getloadavg()
    rows = measure(args.n, args.d, args.hidden, args.rounds, args.only)
    text = markdown(rows, args, load)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
