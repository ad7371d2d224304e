"""Step-time / compile-time study: Python loop vs lax.scan over a stack of layers.

The study behind stackwise's default remat (``DEFAULT_REMAT``); its report is
``docs/step-time.md``. It measures what ``stackwise-bench`` does not: 21 scan schemes
(unroll, groups, custom_vjp over the layer axis...), CPU time and page faults per step,
gradients against the loop, and allocator / XLA-flag settings in subprocesses.

Workload: residual blocks  h <- h + gelu(h @ w1) @ w2,  D=256, hidden=512, batch=64,
n layers (default 48), loss = sum(output), timed: jax.jit(jax.grad(loss wrt params)).

Everything is measured in ONE process with interleaved rounds (the machine is shared and
noisy): each round visits every variant in a rotated order, cold-compiles it
(jax.clear_caches(); jit(f).lower(...).compile()) and times `--reps` steps, each right
after a timed step of the loop (block_until_ready). Reported: median ms/step over all
rounds, the median of the paired ratios to the Python loop over separately stored params,
median cold compile s, page faults per step (ru_minflt), compiled temp size, and the max
relative gradient error against the loop.

Environment sweeps (XLA_FLAGS / glibc malloc tunables are read at process start) run the
same script in subprocesses: `--env-sweep`.

Usage:
  # default: the n=48 table, n=8/96 for the best variants, an allocator sweep
  # (~5 min on a quiet machine, ~8 min on a loaded 2-core one)
  python benchmarks/step_time_study.py
  python benchmarks/step_time_study.py --variants loop_sep,scan,cvjp --rounds 5 --n 48
  python benchmarks/step_time_study.py --no-scaling --no-env-sweep
  python benchmarks/step_time_study.py --list
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

D, H, B = 256, 512, 64


# ----------------------------------------------------------------------------------------
# The general custom_vjp-over-the-layer-axis scheme (the candidate library default).
# ----------------------------------------------------------------------------------------
def stack_scan_vjp(layer, params, carry, xs=None, consts=()):
    """out_carry, ys = scan of `layer` over the leading axis of `params` (and `xs`).

    layer(p_i, carry, x_i, consts) -> (carry, y_i).  Exact gradients wrt params, carry,
    float leaves of xs, and consts.  Forward saves only the per-layer input carries; the
    backward is a reverse scan that recomputes each layer under jax.vjp.
    Closed-over tracers are NOT allowed in `layer` (custom_vjp cannot differentiate them):
    pass them as `consts`, or hoist them with jax.closure_convert (docs/step-time.md).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    tu = jax.tree_util

    def is_float(a):
        return jnp.issubdtype(jnp.result_type(a), jnp.inexact)

    def split_xs(xs):  # differentiable (float) leaves vs the rest (RNG keys, ints, ...)
        leaves, tdef = tu.tree_flatten(xs)
        fl = [leaf if is_float(leaf) else None for leaf in leaves]
        nf = [None if is_float(leaf) else leaf for leaf in leaves]
        return fl, nf, tdef

    def merge_xs(fl, nf, tdef):
        return tu.tree_unflatten(tdef, [a if a is not None else b for a, b in zip(fl, nf)])

    x_fl, x_nf, x_def = split_xs(xs)

    @jax.custom_vjp
    def run(params, carry, x_fl, consts):
        def body(c, pxs):
            p, xf, xn = pxs
            return layer(p, c, merge_xs(xf, xn, x_def), consts)

        return lax.scan(body, carry, (params, x_fl, x_nf))

    def fwd(params, carry, x_fl, consts):
        def body(c, pxs):
            p, xf, xn = pxs
            c2, y = layer(p, c, merge_xs(xf, xn, x_def), consts)
            return c2, (y, c)  # save the layer's INPUT carry only

        out, (ys, carries) = lax.scan(body, carry, (params, x_fl, x_nf))
        return (out, ys), (params, x_fl, consts, carries)

    def bwd(res, cts):
        params, x_fl, consts, carries = res
        g_out, g_ys = cts
        g_consts0 = tu.tree_map(jnp.zeros_like, consts)

        def body(acc, sl):
            g_c, g_k = acc
            p, xf, xn, c, gy = sl

            def f(p, c, xf, k, xn=xn):
                return layer(p, c, merge_xs(xf, xn, x_def), k)

            _, vjp = jax.vjp(f, p, c, xf, consts)
            gp, gc, gxf, gk = vjp((g_c, gy))
            return (gc, tu.tree_map(jnp.add, g_k, gk)), (gp, gxf)

        (g_carry, g_consts), (g_params, g_xfl) = lax.scan(
            body, (g_out, g_consts0), (params, x_fl, x_nf, carries, g_ys), reverse=True
        )
        return g_params, g_carry, g_xfl, g_consts

    run.defvjp(fwd, bwd)
    return run(params, carry, x_fl, consts)


# ----------------------------------------------------------------------------------------
# Workload and variants.
# ----------------------------------------------------------------------------------------
def build(n):
    import jax
    import jax.numpy as jnp
    from jax import lax

    def layer(p, h):
        w1, w2 = p
        return h + jax.nn.gelu(h @ w1) @ w2

    def layer_t(p, h):  # params stored transposed: w1t [H, D], w2t [D, H]
        w1t, w2t = p
        return h + lax.dot_general(
            jax.nn.gelu(lax.dot_general(h, w1t, (((1,), (1,)), ((), ())))),
            w2t,
            (((1,), (1,)), ((), ())),
        )

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    w1 = jax.random.normal(k1, (n, D, H), jnp.float32) / np.sqrt(D) / 4
    w2 = jax.random.normal(k2, (n, H, D), jnp.float32) / np.sqrt(H) / 4
    x = jax.random.normal(k3, (B, D), jnp.float32)
    stacked = (w1, w2)
    sep = [(w1[i], w2[i]) for i in range(n)]
    stacked_t = (jnp.swapaxes(w1, 1, 2), jnp.swapaxes(w2, 1, 2))

    def grouped(k):
        return jax.tree_util.tree_map(lambda a: a.reshape(n // k, k, *a.shape[1:]), stacked)

    # ---- forward functions: f(params, x) -> scalar loss
    def loop_sep(ps, x):
        h = x
        for p in ps:
            h = layer(p, h)
        return h.sum()

    def loop_slices(ps, x):
        h = x
        for i in range(n):
            h = layer((ps[0][i], ps[1][i]), h)
        return h.sum()

    def scan_fn(unroll=1, remat=False, policy=None, split=False, lay=layer):
        def body(h, p):
            return lay(p, h), None

        if remat:
            body = jax.checkpoint(body, prevent_cse=False, policy=policy)
        kw = dict(_split_transpose=True) if split else {}

        def f(ps, x):
            h, _ = lax.scan(body, x, ps, unroll=unroll, **kw)
            return h.sum()

        return f

    def group_fn(k, remat=False):
        def gbody(h, pg):
            for j in range(k):
                h = layer((pg[0][j], pg[1][j]), h)
            return h, None

        body = jax.checkpoint(gbody, prevent_cse=False) if remat else gbody

        def f(pg, x):
            h, _ = lax.scan(body, x, pg)
            return h.sum()

        return f

    def cvjp_fn(lay=layer):
        def lay4(p, c, x, k):
            return lay(p, c), None

        def f(ps, x):
            h, _ = stack_scan_vjp(lay4, ps, x)
            return h.sum()

        return f

    def cvjp_group_fn(k):
        def glayer(pg, c, xi, kk):
            for j in range(k):
                c = layer((pg[0][j], pg[1][j]), c)
            return c, None

        def f(pg, x):
            h, _ = stack_scan_vjp(glayer, pg, x)
            return h.sum()

        return f

    def cvjp_acc_fn():
        # custom_vjp whose backward accumulates param grads into a zero-initialised carry
        # with dynamic_update_index_in_dim instead of emitting them as scan ys.
        @jax.custom_vjp
        def run(ps, x):
            return lax.scan(lambda h, p: (layer(p, h), None), x, ps)[0]

        def fwd(ps, x):
            out, hs = lax.scan(lambda h, p: (layer(p, h), h), x, ps)
            return out, (ps, hs)

        def bwd(res, g):
            ps, hs = res
            gps0 = jax.tree_util.tree_map(jnp.zeros_like, ps)

            def body(carry, i):
                g, gps = carry
                p = jax.tree_util.tree_map(lambda a: a[i], ps)
                _, vjp = jax.vjp(layer, p, hs[i])
                gp, gh = vjp(g)
                gps = jax.tree_util.tree_map(
                    lambda A, a: lax.dynamic_update_index_in_dim(A, a, i, 0), gps, gp
                )
                return (gh, gps), None

            (gx, gps), _ = lax.scan(body, (g, gps0), jnp.arange(n), reverse=True)
            return gps, gx

        run.defvjp(fwd, bwd)
        return lambda ps, x: run(ps, x).sum()

    def to_stacked(g, kind):
        if kind == "sep":
            return (jnp.stack([a for a, _ in g]), jnp.stack([b for _, b in g]))
        if kind == "stacked":
            return g
        if kind == "stacked_t":
            return (jnp.swapaxes(g[0], 1, 2), jnp.swapaxes(g[1], 1, 2))
        if kind.startswith("group"):
            return jax.tree_util.tree_map(lambda a: a.reshape(n, *a.shape[2:]), g)
        raise ValueError(kind)

    V = {}
    V["loop_sep"] = (loop_sep, "sep", "Python loop, separately stored per-layer params")
    V["loop_slices"] = (loop_slices, "stacked", "Python loop over static slices of stacked params")
    V["scan"] = (scan_fn(), "stacked", "lax.scan over stacked params")
    V["scan_unroll2"] = (scan_fn(unroll=2), "stacked", "lax.scan unroll=2")
    V["scan_unroll4"] = (scan_fn(unroll=4), "stacked", "lax.scan unroll=4")
    V["scan_split"] = (scan_fn(split=True), "stacked", "lax.scan(_split_transpose=True)")
    V["scan_remat"] = (scan_fn(remat=True), "stacked", "scan + jax.checkpoint(prevent_cse=False)")
    V["scan_remat_dots"] = (
        scan_fn(remat=True, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
        "stacked",
        "scan + checkpoint(policy=dots_with_no_batch_dims_saveable)",
    )
    V["scan_remat_t"] = (
        scan_fn(remat=True, lay=layer_t),
        "stacked_t",
        "scan + checkpoint, params stored transposed",
    )
    V["cvjp"] = (
        cvjp_fn(),
        "stacked",
        "custom_vjp over layer axis (save carries, per-layer vjp, grads as ys)",
    )
    V["cvjp_t"] = (cvjp_fn(layer_t), "stacked_t", "custom_vjp, params stored transposed")
    V["cvjp_acc"] = (cvjp_acc_fn(), "stacked", "custom_vjp, grads accumulated in carry (DUS)")
    for k in (2, 4, 8):
        V[f"group{k}"] = (
            group_fn(k),
            f"group{k}",
            f"scan over n/{k} groups of {k} unrolled layers",
        )
        V[f"group{k}_remat"] = (
            group_fn(k, remat=True),
            f"group{k}",
            f"scan over groups of {k}, checkpoint per group",
        )
        V[f"cvjp_group{k}"] = (
            cvjp_group_fn(k),
            f"group{k}",
            f"custom_vjp over groups of {k} unrolled layers",
        )

    def args_for(kind):
        if kind == "sep":
            return sep
        if kind == "stacked":
            return stacked
        if kind == "stacked_t":
            return stacked_t
        if kind.startswith("group"):
            return grouped(int(kind[5:]))
        raise ValueError(kind)

    return V, args_for, to_stacked, x


# ----------------------------------------------------------------------------------------
# Measurement.
# ----------------------------------------------------------------------------------------
def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(names, n, rounds, reps, check=True, verbose=True, base="loop_sep"):
    """Interleaved, paired measurement.

    The reference (`base`, the Python loop) stays compiled for the whole run; every timed
    step of a variant is immediately preceded by a timed step of the reference, and the
    per-pair ratio variant/reference is recorded.  The median of paired ratios is robust to
    the slow load drift of a shared machine; absolute medians / minima are also reported.
    """
    import jax

    V, args_for, to_stacked, x = build(n)

    def group_k(v):
        m = re.search(r"group(\d+)", v)
        return int(m.group(1)) if m else 1

    names = [v for v in names if v in V and n % group_k(v) == 0]
    res = {
        v: dict(step=[], ratio=[], cpu=[], compile=[], minflt=[], temp=None, err=None)
        for v in names
    }
    fb, kb, _ = V[base]
    ab = args_for(kb)
    cb = jax.jit(jax.grad(fb)).lower(ab, x).compile()
    ref = None
    if check:
        ref = [np.asarray(a) for a in to_stacked(cb(ab, x), kb)]
    for _ in range(2):
        jax.block_until_ready(cb(ab, x))
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for v in order:
            f, kind, _ = V[v]
            a = args_for(kind)
            jax.clear_caches()
            t0 = time.perf_counter()
            c = jax.jit(jax.grad(f)).lower(a, x).compile()
            res[v]["compile"].append(time.perf_counter() - t0)
            g = jax.block_until_ready(c(a, x))
            if res[v]["temp"] is None:
                try:
                    res[v]["temp"] = c.memory_analysis().temp_size_in_bytes / 2**20
                except Exception:
                    res[v]["temp"] = float("nan")
            if check and res[v]["err"] is None:
                gs = [np.asarray(t) for t in to_stacked(g, kind)]
                res[v]["err"] = float(
                    max(np.max(np.abs(a_ - b_)) / np.max(np.abs(b_)) for a_, b_ in zip(gs, ref))
                )
                res[v]["ok"] = bool(
                    all(
                        np.allclose(a_, b_, rtol=1e-5, atol=1e-5 * np.max(np.abs(b_)))
                        for a_, b_ in zip(gs, ref)
                    )
                )
            del g
            jax.block_until_ready(c(a, x))
            flt = 0
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(cb(ab, x))
                tb = time.perf_counter() - t0
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                u0 = _cpu()
                t0 = time.perf_counter()
                out = c(a, x)
                jax.block_until_ready(out)
                tv = time.perf_counter() - t0
                res[v]["cpu"].append(_cpu() - u0)
                flt += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                res[v]["step"].append(tv)
                res[v]["ratio"].append(tv / tb)
                del out
            res[v]["minflt"].append(flt / reps)
            del c
        if verbose:
            print(f"  [n={n}] round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    out = {}
    for v in names:
        d = res[v]
        out[v] = dict(
            ms=1e3 * float(np.median(d["step"])),
            ms_min=1e3 * float(np.min(d["step"])),
            ratio=float(np.median(d["ratio"])),
            cpu_ms=1e3 * float(np.median(d["cpu"])),
            compile_s=float(np.median(d["compile"])),
            minflt=float(np.median(d["minflt"])),
            temp_mb=d["temp"],
            err=d["err"],
            ok=d.get("ok"),
            desc=V[v][2],
        )
    return out


def table(out, n, base="loop_sep"):
    b = out.get(base)
    lines = [
        f"n={n}",
        "| variant | ms/step median | ms/step min | x loop (paired median) | x loop (min/min) "
        "| CPU ms/step | compile s | x loop compile | temp MiB | page faults/step "
        "| max rel grad err | allclose 1e-5 |",
        "|" + "---|" * 12,
    ]
    for v, d in sorted(out.items(), key=lambda kv: kv[1]["ratio"]):
        rm = f"{d['ms_min'] / b['ms_min']:.2f}" if b else "-"
        rc = f"{d['compile_s'] / b['compile_s']:.2f}" if b else "-"
        err = "-" if d["err"] is None else f"{d['err']:.1e}"
        lines.append(
            f"| `{v}` | {d['ms']:.1f} | {d['ms_min']:.1f} | {d['ratio']:.2f} | {rm} | "
            f"{d['cpu_ms']:.0f} | {d['compile_s']:.2f} | {rc} | "
            f"{d['temp_mb']:.1f} | {d['minflt']:.0f} | {err} | {d.get('ok')} |"
        )
    return "\n".join(lines)


MALLOC_TUNED = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"
)

ENVS = {
    "default": {},
    # glibc malloc: large (>= mmap threshold, max 32 MiB) blocks are mmapped fresh each step
    # and every 4 KiB page is faulted in again; these remove or shrink that cost.
    "malloc_tuned": {"GLIBC_TUNABLES": MALLOC_TUNED},
    "thp": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "mmap32_trim": {
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
        "glibc.malloc.trim_threshold=1073741824"
    },
    "tuned_no_eigen_mt": {
        "GLIBC_TUNABLES": MALLOC_TUNED,
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    },
    "tuned_conc_sched": {
        "GLIBC_TUNABLES": MALLOC_TUNED,
        "XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    },
    "no_eigen_mt": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
    "conc_sched": {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"},
    "no_conc_sched": {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=false"},
    "no_ynn": {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="},
    "onednn": {"XLA_FLAGS": "--xla_cpu_use_onednn=true"},
    "no_xnnpack": {"XLA_FLAGS": "--xla_cpu_use_xnnpack=false"},
    "1thread": {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false",
        "OMP_NUM_THREADS": "1",
    },
}


def tune_malloc():
    """glibc only: keep big XLA buffers in the heap instead of fresh mmaps (no page faults)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
    return (
        libc.mallopt(M_ARENA_MAX, 1),
        libc.mallopt(M_MMAP_MAX, 0),
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--variants",
        default="loop_sep,loop_slices,scan,scan_unroll2,scan_unroll4,"
        "scan_split,scan_remat,scan_remat_dots,cvjp,cvjp_t,cvjp_acc,"
        "group4,group4_remat,cvjp_group4",
    )
    ap.add_argument("--scaling-variants", default="loop_sep,scan_remat_dots,cvjp")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--no-env-sweep", action="store_true")
    ap.add_argument("--env-sweep", action="store_true", help="only the env sweep")
    ap.add_argument("--envs", default="default,malloc_tuned")
    ap.add_argument("--env-variants", default="loop_sep,scan,scan_remat_dots,cvjp")
    ap.add_argument("--env-rounds", type=int, default=2)  # 'thp' also available
    ap.add_argument(
        "--malloc-tune",
        action="store_true",
        help="in-process mallopt(M_ARENA_MAX=1, M_MMAP_MAX=0, M_TRIM_THRESHOLD=1GiB) "
        "before importing jax (same effect as the malloc_tuned env)",
    )
    ap.add_argument(
        "--json", action="store_true", help="print one JSON result line (subprocess mode)"
    )
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()

    if a.malloc_tune:
        tune_malloc()
    if a.list:
        V, *_ = build(8)
        for k, v in V.items():
            print(f"{k:18s} {v[2]}")
        return

    if a.json:
        out = measure(a.variants.split(","), a.n, a.rounds, a.reps, verbose=False)
        print("JSON" + json.dumps(out))
        return

    t_start = time.time()
    if not a.env_sweep:
        out = measure(a.variants.split(","), a.n, a.rounds, a.reps)
        print(table(out, a.n), flush=True)
        if not a.no_scaling:
            for n in (8, 96):
                o = measure(a.scaling_variants.split(","), n, max(2, a.rounds // 2), a.reps)
                print(table(o, n), flush=True)
    if a.env_sweep or not a.no_env_sweep:
        print("\nEnvironment sweep (each env in its own process; XLA_FLAGS / GLIBC_TUNABLES)")
        print("| env | " + " | ".join(a.env_variants.split(",")) + " |")
        print("|---|" + "---|" * len(a.env_variants.split(",")))
        for e in a.envs.split(","):
            env = dict(os.environ)
            for k, v in ENVS[e].items():
                env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
            p = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--json",
                    "--n",
                    str(a.n),
                    "--rounds",
                    str(a.env_rounds),
                    "--reps",
                    str(a.reps),
                    "--variants",
                    a.env_variants,
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON")]
            if not line:
                print(f"| {e} | failed: {p.stderr.strip().splitlines()[-1:]} |")
                continue
            o = json.loads(line[0][4:])
            cells = []
            for v in a.env_variants.split(","):
                cells.append(
                    f"{o[v]['ms']:.1f} / min {o[v]['ms_min']:.1f} / x{o[v]['ratio']:.2f} "
                    f"({o[v]['minflt']:.0f} pf)"
                    if v in o
                    else "-"
                )
            print(f"| {e} | " + " | ".join(cells) + " |", flush=True)
    print(f"\ntotal wall {time.time() - t_start:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
