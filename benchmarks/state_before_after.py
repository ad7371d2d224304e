"""Training with state, before and after the in-place state change: step time, memory, values.

Until commit ``fd92f18`` the per-layer state of ``stackwise.stack(..., with_state=True)`` went
through the scan as its per-layer input and output; since then a state leaf written with
``dynamic_update_slice`` is updated in place after the scan, and every other leaf (BatchNorm
statistics, counters) leaves the layer whole as before. Decoding gets faster; training with
state must not get worse. This script measures the same stateful training step with both
versions of the package::

    python benchmarks/state_before_after.py                       # before = fd92f18
    python benchmarks/state_before_after.py --repeats 10 --rounds 9 \\
        --markdown benchmarks/results/state_before_after.md

The "before" tree is ``git archive`` of the commit, unpacked in a temporary directory; the
"after" tree is this checkout, as it is on disk. Each measurement runs in a subprocess that
imports one tree (``PYTHONPATH``; the adapters from its ``adapters/``), and the subprocesses
alternate: before, after, after, before, before, after, ... (each pair in the other order
than the last, so that a drift of the machine's speed cancels out of the paired ratio). A
subprocess compiles every case (timed cold), records ``memory_analysis().temp_size_in_bytes``
and the first step's loss, gradients and new state, then times ``--rounds`` rounds (each a
new shuffle of the cases, each case timed on the second of two back-to-back calls; the state
each call returns is given to the next); its step time for a case is the median. The table
shows per version the median over the subprocesses, and after / before as the median of the
per-pair ratios with a distribution-free ~95% interval (from 6 pairs on).

The cases: a residual MLP block with BatchNorm-like running statistics and a step counter as
per-layer state, n=24 layers, ``jit(value_and_grad(loss, has_aux=True))`` returning the new
state; written for ``stackwise.stack(..., with_state=True)`` and as a linen module under
``stackwise.flax.Stack`` (``nn.BatchNorm`` and a counter in ``batch_stats``), each with remat
off, the default policy and full remat. Both versions get the same params (each leaf drawn
from a seed made of its path), so their losses, gradients and new states are compared too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("stack", "flax")  # stackwise.stack(with_state=True), stackwise.flax.Stack
REMATS = ("off", "default", "full")
N, D, HIDDEN, BATCH = 24, 256, 512, 64
# Loss, gradients and state of the same float32 program compiled by two versions.
RTOL, ATOL = 1e-5, 1e-6


# ==========================================================================
# The worker: one version, every case.


def _import_tree(tree: pathlib.Path):
    """``stackwise`` and ``stackwise.flax`` from ``tree`` (a source checkout), checked."""
    import stackwise

    adapters = str(tree / "adapters")
    if adapters not in stackwise.__path__:  # older trees do not add their adapters/ themselves
        stackwise.__path__.append(adapters)
    import stackwise.flax

    for module in (stackwise, stackwise.flax):
        if not pathlib.Path(module.__file__).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"{module.__name__} imported from {module.__file__}, not {tree}")
    return stackwise, stackwise.flax


def _cases(stackwise, sw_flax):
    """``{name: (params, state, x, loss)}`` with ``loss(params, state, x) -> (scalar,
    new_state)``, params filled by :func:`_fill`."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    momentum, eps = 0.9, 1e-5
    remat = {"off": False, "default": stackwise.DEFAULT_REMAT, "full": True}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, D), np.float32))

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {
            "w1": jax.random.normal(k1, (D, HIDDEN)) / D**0.5,
            "w2": jax.random.normal(k2, (HIDDEN, D)) / HIDDEN**0.5,
            "scale": jnp.ones(HIDDEN), "bias": jnp.zeros(HIDDEN),
        }
        state = {"mean": jnp.zeros(HIDDEN), "var": jnp.ones(HIDDEN),
                 "count": jnp.zeros((), jnp.int32)}
        return params, state

    def apply(p, s, h):
        z = h @ p["w1"]
        mean, var = z.mean(0), z.var(0)
        z = (z - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]
        new = {"mean": momentum * s["mean"] + (1 - momentum) * mean,
               "var": momentum * s["var"] + (1 - momentum) * var, "count": s["count"] + 1}
        return h + jax.nn.gelu(z) @ p["w2"], new

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            count = self.variable("batch_stats", "count", lambda: jnp.zeros((), jnp.int32))
            count.value += 1
            z = nn.BatchNorm(use_running_average=False, momentum=momentum, epsilon=eps)(
                nn.Dense(HIDDEN, use_bias=False)(h))
            return h + nn.Dense(D, use_bias=False)(jax.nn.gelu(z))

    def mean_square(y):
        return jnp.mean(jnp.square(y))

    out = {}
    for r in REMATS:
        layers = stackwise.stack(init, apply, N, with_state=True, remat=remat[r])
        params, state = layers.init(jax.random.key(0))

        def loss(params, state, x, layers=layers):
            y, state = layers.apply(params, state, x)
            return mean_square(y), state

        out[f"stack/{r}"] = (_fill(params), state, x, loss)

        model = sw_flax.Stack(Block, n=N, remat=remat[r])
        variables = model.init(jax.random.key(0), x)

        def loss(params, state, x, model=model):
            y, new = model.apply({"params": params, "batch_stats": state}, x,
                                 mutable=["batch_stats"])
            return mean_square(y), new["batch_stats"]

        out[f"flax/{r}"] = (_fill(variables["params"]), variables["batch_stats"], x, loss)
    return out


def _fill(params):
    """The same values for the same leaf in every version: each leaf drawn from a seed made
    of its path (``[n, fan_in, fan_out]`` kernels scaled by ``1/sqrt(fan_in)``)."""
    import jax
    import numpy as np

    def one(path, a):
        name = jax.tree_util.keystr(path)
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        value = rng.standard_normal(a.shape).astype(np.float32)
        if a.ndim == 3:
            value /= np.sqrt(a.shape[1])
        else:
            value = 0.1 * value + (1.0 if "scale" in name else 0.0)
        return jax.numpy.asarray(value, a.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def worker(tree: pathlib.Path, rounds: int, seed: int, values: pathlib.Path | None) -> dict:
    """Measures every case with the package in ``tree``; returns what the parent reads."""
    import gc

    import jax
    import numpy as np

    stackwise, sw_flax = _import_tree(tree)
    cases = _cases(stackwise, sw_flax)
    compiled, out = {}, {}
    for name, (params, state, x, loss) in cases.items():
        jax.clear_caches()
        gc.collect()
        start = time.perf_counter()
        lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, state, x)
        traced = time.perf_counter() - start
        fn = lowered.compile()
        seconds = time.perf_counter() - start
        memory = fn.memory_analysis()
        (value, new_state), grads = fn(params, state, x)
        if values is not None:  # the first step's results, for the comparison of versions
            flat = jax.tree_util.tree_leaves_with_path(
                {"loss": value, "grads": grads, "state": new_state})
            np.savez(values / f"{name.replace('/', '_')}.npz",
                     **{jax.tree_util.keystr(p): np.asarray(a) for p, a in flat})
            (values / f"{name.replace('/', '_')}.hlo").write_text(fn.as_text())
        compiled[name] = [fn, params, new_state, x]
        out[name] = {"compile_s": seconds, "trace_s": traced,
                     "temp_bytes": int(memory.temp_size_in_bytes), "samples": []}

    def call(name):
        fn, params, state, x = compiled[name]
        start = time.perf_counter()
        (_, compiled[name][2]), _ = jax.block_until_ready(fn(params, state, x))
        return time.perf_counter() - start

    for r in range(rounds):
        for name in random.Random(f"{seed}/{r}").sample(list(compiled), len(compiled)):
            call(name)  # untimed: the machine as this case leaves it
            out[name]["samples"].append(call(name))
    for name in out:
        out[name]["step_s"] = statistics.median(out[name]["samples"])
    out["_versions"] = {"jax": jax.__version__, "stackwise": str(stackwise.__file__)}
    return out


# ==========================================================================
# The parent: both trees, alternating subprocesses, the table.


def _archive(commit: str, where: pathlib.Path) -> pathlib.Path:
    """``git archive`` of ``commit`` unpacked under ``where``."""
    tree = where / commit
    tree.mkdir()
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                          check=True, capture_output=True).stdout
    tar = where / "tree.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as f:
        f.extractall(tree, filter="data")
    return tree


def _run_worker(tree, rounds, seed, values, timeout) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--worker", str(tree), "--rounds", str(rounds),
           "--seed", str(seed)]
    if values is not None:
        cmd += ["--values", str(values)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tree)
    if done.returncode:
        raise RuntimeError(f"worker for {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same_values(before: pathlib.Path, after: pathlib.Path, name: str) -> str:
    """"yes", or what differs between the two versions' first step of case ``name``."""
    import numpy as np

    file = f"{name.replace('/', '_')}.npz"
    with np.load(before / file) as a, np.load(after / file) as b:
        if set(a) != set(b):
            return f"no: leaves differ ({sorted(set(a) ^ set(b))[:3]})"
        bad = [k for k in a if a[k].shape != b[k].shape
               or not np.allclose(a[k], b[k], rtol=RTOL, atol=ATOL)]
    return "yes" if not bad else f"no: {', '.join(bad[:3])}"


def _same_program(before: pathlib.Path, after: pathlib.Path, name: str) -> str:
    """"same" when both versions compiled case ``name`` to the same program (XLA's optimised
    HLO, names and metadata aside: then only noise can tell their step times apart), else
    how many instructions differ."""
    from stackwise.bench import instructions_unlike, program_instructions

    file = f"{name.replace('/', '_')}.hlo"
    a, b = (program_instructions((v / file).read_text()) for v in (before, after))
    unlike = instructions_unlike(a, b)
    return "same" if not unlike else f"{unlike} of {len(a) + len(b)} instr. differ"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="fd92f18", help="the commit before (default fd92f18)")
    p.add_argument("--repeats", type=int, default=6,
                   help="subprocesses per version, alternating (default 6)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per subprocess")
    p.add_argument("--seed", type=int, default=0, help="seed of the case orders")
    p.add_argument("--markdown", default="", metavar="PATH", help="also write the results")
    p.add_argument("--note", default="", help="a line for the results' header")
    p.add_argument("--json", default="", metavar="PATH",
                   help="also write every subprocess's measurements (raw timings)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--values", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        values = pathlib.Path(args.values) if args.values else None
        print(json.dumps(worker(pathlib.Path(args.worker), args.rounds, args.seed, values)))
        return 0

    from stackwise.bench.report import backend, machine, print_table
    from stackwise.bench.stats import median_interval

    start = time.perf_counter()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stackwise-before-") as tmp:
        tmp = pathlib.Path(tmp)
        trees = {"before": _archive(args.before, tmp), "after": ROOT}
        values = {v: tmp / f"values-{v}" for v in trees}
        runs: dict[str, list[dict]] = {v: [] for v in trees}
        for r in range(args.repeats):
            for version in ("before", "after") if r % 2 == 0 else ("after", "before"):
                first = not runs[version]
                if first:
                    values[version].mkdir()
                print(f"repeat {r + 1}/{args.repeats}: {version}", file=sys.stderr)
                runs[version].append(_run_worker(
                    trees[version], args.rounds, args.seed + r,
                    values[version] if first else None, args.timeout))
        names = [n for n in runs["after"][0] if not n.startswith("_")]
        same = {n: _same_values(values["before"], values["after"], n) for n in names}
        programs = {n: _same_program(values["before"], values["after"], n) for n in names}
    load_after = os.getloadavg()

    rows = []
    for name in names:
        kind, remat = name.split("/")
        b = [run[name] for run in runs["before"]]
        a = [run[name] for run in runs["after"]]
        ratio, low, high = median_interval([y["step_s"] / x["step_s"] for x, y in zip(b, a)])
        interval = "" if low != low else f" ({low:.2f}-{high:.2f})"  # NaN: too few pairs
        step = [statistics.median(r["step_s"] for r in v) * 1e3 for v in (b, a)]
        comp = [f"{min(r['compile_s'] for r in v):.2f} ({min(r['trace_s'] for r in v):.2f})"
                for v in (b, a)]
        temps = [{r["temp_bytes"] for r in v} for v in (b, a)]
        temp = ["/".join(f"{t / 2**20:.1f}" for t in sorted(ts)) for ts in temps]
        rows.append([
            {"stack": "stackwise.stack", "flax": "stackwise.flax.Stack"}[kind], remat,
            f"{step[0]:.1f}", f"{step[1]:.1f}", f"{ratio:.3f}{interval}", temp[0], temp[1],
            comp[0], comp[1], programs[name], same[name],
        ])
    headers = ["case", "remat", "step ms\nbefore", "step ms\nafter", "after /\nbefore",
               "temp MiB\nbefore", "temp MiB\nafter", "compile s\n(trace) before",
               "compile s\n(trace) after",
               "program", "same\nvalues"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    after = _git("rev-parse", "--short", "HEAD") + (" + changes" if _git("status", "--porcelain",
                                                                         "--", "stackwise",
                                                                         "adapters") else "")
    title = (f"Training with state, {args.before} (before) vs {after} (after): n={N}, D={D}, "
             f"hidden={HIDDEN}, batch={BATCH}")
    print_table(title, headers, rows, wide=True)
    minutes = (time.perf_counter() - start) / 60
    header = [
        f"# {title}",
        "",
        f"`python benchmarks/state_before_after.py --repeats {args.repeats} --rounds "
        f"{args.rounds}` ({minutes:.0f} min): {args.repeats} subprocesses per version, "
        f"alternating; Python {platform.python_version()}, "
        f"jax {runs['after'][0]['_versions']['jax']}, {machine()}, on {backend()}; load average "
        f"{load[0]:.1f} before, {load_after[0]:.1f} after.",
        *(["", args.note] if args.note else []),
        "",
        "step ms: median over the subprocesses of each one's median step; after / before: "
        "median of the per-pair ratios (~95% interval from 6 pairs on); temp MiB: "
        "`memory_analysis().temp_size_in_bytes` (deterministic; a/b when it varied); "
        "compile s: fastest cold compile (in brackets, its tracing and lowering part); "
        "program: whether both versions compiled the case to the same program (XLA's "
        "optimised HLO, names and metadata aside), when only noise can tell their step "
        "times apart; same values: loss, gradients and new state "
        f"of the first step equal (rtol {RTOL:g}, atol {ATOL:g}).",
        "",
    ]
    table = ["| " + " | ".join(h.replace("\n", " ") for h in headers) + " |",
             "|" + "---|" * len(headers)]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(header + table) + "\n")
        print(f"wrote {args.markdown}")
    return 0 if all(v == "yes" for v in same.values()) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
