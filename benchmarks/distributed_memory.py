"""Per-device memory of FSDP and of pipelines on 8 simulated CPU devices, from the compiler.

Usage: ``python benchmarks/distributed_memory.py [--markdown out.md]`` (sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu`` itself, a
TPU host's too: ``benchmarks/_devices.py``).

Every figure is ``jax.jit(jax.grad(loss)).lower(...).compile().memory_analysis()``
of one device's program: what XLA allocates, independent of the machine's load.

FSDP table: one MLP block (``x + gelu(x @ w1) @ w2``), D=256, hidden 1024, n=8
layers (16 MiB of params), batch 64 split over 8 devices. Each entry point (the
core ``stackwise.stack`` and the Haiku, linen and NNX Stacks) runs with its params
replicated (data parallel) and FSDP-sharded (``fsdp="data"``, specs from
``stackwise.fsdp_specs``) at each remat. ``bound`` is (replicated params +
grads) / 8 + the replicated program's temp (its activations and workspace);
``/bound`` is the FSDP program's params + grads + temp over it.

Pipeline table: 8 layers of 256 x 256 on a ``(stage=4, data=2)`` mesh (0.5 MiB of
params per stage), batch 64, remat=True; temp for M = 4, 8, 16 microbatches.
"""

from __future__ import annotations

import argparse

from _devices import header, simulate_cpu_devices  # benchmarks/_devices.py

MIB = 2**20


def _fsdp_rows(jax, jnp, stackwise, mesh, d, hidden, n, batch):
    """``(entry point, remat, mode, params, grads, temp)`` rows."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.device_put(jnp.zeros((batch, d)), NamedSharding(mesh, P("data")))

    def measure(loss, params):
        # The grads laid out like the params (on auto axes XLA would pick their layout).
        like_params = jax.tree.map(lambda a: a.sharding, params)
        grad = jax.jit(jax.grad(loss), out_shardings=like_params)
        m = grad.lower(params, x).compile().memory_analysis()
        sizes = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
        return tuple(size / MIB for size in sizes)

    def place(params, fsdp):
        specs = stackwise.fsdp_specs(params, mesh) if fsdp else None
        return stackwise.shard_stacked(params, mesh, specs)

    def core(remat, fsdp):
        def init(key):
            k1, k2 = jax.random.split(key)
            return {"w1": jax.random.normal(k1, (d, hidden)) * 0.02,
                    "w2": jax.random.normal(k2, (hidden, d)) * 0.02}

        def apply(p, x):
            return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

        layers = stackwise.stack(init, apply, n, remat=remat, fsdp=fsdp)
        params = place(jax.jit(layers.init)(jax.random.key(0)), fsdp)
        return measure(lambda p, v: jnp.sum(layers.apply(p, v)), params)

    def haiku(remat, fsdp):
        import haiku as hk

        import stackwise.haiku

        class Block(hk.Module):
            def __call__(self, x):
                return x + hk.Linear(d)(jax.nn.gelu(hk.Linear(hidden)(x)))

        f = hk.without_apply_rng(hk.transform(
            lambda x: stackwise.haiku.Stack(Block, n, remat=remat, fsdp=fsdp)(x)))
        params = place(jax.jit(f.init)(jax.random.key(0), jnp.zeros((batch, d))), fsdp)
        return measure(lambda p, v: jnp.sum(f.apply(p, v)), params)

    def linen(remat, fsdp):
        import flax.linen as nn

        import stackwise.flax

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x):
                return x + nn.Dense(d)(nn.gelu(nn.Dense(hidden)(x)))

        stack = stackwise.flax.Stack(Block, n, remat=remat, fsdp=fsdp)
        params = jax.jit(stack.init)(jax.random.key(0), jnp.zeros((batch, d)))
        params = place(params, fsdp)
        return measure(lambda p, v: jnp.sum(stack.apply(p, v)), params)

    def nnx_(remat, fsdp):
        from flax import nnx

        import stackwise.nnx

        class Block(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.Linear(d, hidden, rngs=rngs)
                self.down = nnx.Linear(hidden, d, rngs=rngs)

            def __call__(self, x):
                return x + self.down(jax.nn.gelu(self.up(x)))

        stack = stackwise.nnx.Stack(Block, n, rngs=nnx.Rngs(0), remat=remat, fsdp=fsdp)
        graphdef, state = nnx.split(stack)
        state = place(state, fsdp)
        return measure(lambda s, v: jnp.sum(nnx.merge(graphdef, s)(v)), state)

    rows = []
    remats = {"off": False, "default": stackwise.DEFAULT_REMAT, "layer": True}
    for name, fn in {"stackwise.stack": core, "haiku.Stack": haiku, "flax.Stack": linen,
                     "nnx.Stack": nnx_}.items():
        for remat_name, remat in remats.items():
            for mode, fsdp in (("replicated", None), ("fsdp", "data")):
                try:
                    rows.append((name, remat_name, mode, *fn(remat, fsdp)))
                except TypeError as e:  # an adapter without `fsdp=` yet
                    rows.append((name, remat_name, mode, None, None, str(e).split("\n")[0]))
    return rows


def _pipeline_rows(jax, jnp, stackwise, width=256, n=8, batch=64):
    mesh = jax.make_mesh((4, 2), ("stage", "data"))

    def apply(p, x):
        return x + jnp.tanh(x @ p["w"])

    rows = []
    for schedule, repeats in (("gpipe", None), ("circular", 2)):
        params = stackwise.shard_stacked(
            {"w": jnp.zeros((n, width, width))}, mesh, layer_axis="stage",
            repeats=repeats or 1,
        )
        x = jnp.zeros((batch, width))
        for m in (4, 8, 16):
            pp = stackwise.pipeline(None, apply, n, mesh, microbatches=m, data_axis="data",
                                    remat=True, schedule=schedule, repeats=repeats)
            grad = jax.jit(jax.grad(lambda p, v, f=pp.apply: jnp.sum(f(p, v))))
            memory = grad.lower(params, x).compile().memory_analysis()
            rows.append((schedule, m, memory.temp_size_in_bytes / MIB))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    simulate_cpu_devices(8)

    import jax
    import jax.numpy as jnp

    import stackwise

    lines = [header("**FSDP, per device (MiB), 8 devices, 16 MiB of params**"), "",
             "| axes | entry point | remat | params | grads | temp | total | bound | /bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    reference = ["", "Replicated (data parallel) for reference:", "",
                 "| axes | entry point | remat | params | grads | temp |",
                 "|---|---|---|---|---|---|"]
    for axes, axis_type in (("explicit", jax.sharding.AxisType.Explicit),
                            ("auto", jax.sharding.AxisType.Auto)):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
        rows = _fsdp_rows(jax, jnp, stackwise, mesh, d=256, hidden=1024, n=8, batch=64)
        replicated = {(r[0], r[1]): r for r in rows if r[2] == "replicated"}
        for name, remat, mode, params, grads, temp in rows:
            if params is None:
                if mode == "fsdp":
                    lines.append(f"| {axes} | {name} | {remat} | - | - | - | - | - | {temp} |")
                continue
            if mode == "replicated":
                reference.append(f"| {axes} | {name} | {remat} | {params:.2f} | {grads:.2f} | "
                                 f"{temp:.2f} |")
                continue
            _, _, _, p_rep, g_rep, t_rep = replicated[(name, remat)]
            bound = (p_rep + g_rep) / 8 + t_rep
            total = params + grads + temp
            lines.append(f"| {axes} | {name} | {remat} | {params:.2f} | {grads:.2f} | "
                         f"{temp:.2f} | {total:.2f} | {bound:.2f} | {total / bound:.2f} |")
    lines += reference
    lines += ["", header("**Pipeline backward temp (MiB) against M, 0.5 MiB of params per "
                         "stage**"), "",
              "| schedule | M=4 | M=8 | M=16 | M=16 / M=4 |", "|---|---|---|---|---|"]
    prows = _pipeline_rows(jax, jnp, stackwise)
    for schedule in ("gpipe", "circular"):
        temps = [t for s, _, t in prows if s == schedule]
        lines.append(f"| {schedule} | " + " | ".join(f"{t:.2f}" for t in temps)
                     + f" | {temps[-1] / temps[0]:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
