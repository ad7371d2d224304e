"""Per-device memory of one pipelined decode step with a donated KV cache, from the compiler.

Usage: ``python benchmarks/pipeline_decode_memory.py [--markdown out.md]`` (sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu`` itself, a
TPU host's too: ``benchmarks/_devices.py``).

Every figure is ``jax.jit(apply, donate_argnums=1).lower(...).compile().memory_analysis()``
of one device's program: what XLA allocates, independent of the machine's load.

The model: 8 attention layers (D=64), a pattern of a local and a global layer (or 3
positions, local : local : global), a KV cache of 1024 positions for a batch of 8 (32
MiB in all), on a ``(stage=4, data=2)`` mesh with the params and the cache placed on the
stages (``shard_stacked(..., layer_axis="stage")``; with 3 positions, whose 3, 3 and 2
layers do not split over 4 stages, replicated) and the cache's batch on the data axis;
4 microbatches. ``cache`` is one device's share of it; ``aliased`` how much of the
donated cache the step writes in place; ``temp`` the step's scratch memory. The last row
is the unpipelined stack on one device, for scale.
"""

from __future__ import annotations

import argparse

from _devices import header, simulate_cpu_devices  # benchmarks/_devices.py

MIB = 2**20


def _layer(jax, jnp, window, d, context, batch):
    def init(key):
        params = {"qkv": jax.random.normal(key, (d, 3 * d)) / d**0.5}
        cache = {"k": jnp.zeros((batch, context, d)), "v": jnp.zeros((batch, context, d))}
        return params, cache

    def apply(params, cache, x, pos):
        q, k, v = jnp.split(x @ params["qkv"], 3, -1)
        cache = {
            "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k, pos, 1),
            "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v, pos, 1),
        }
        j = jnp.arange(context)
        seen = (j <= pos) & (pos - j < (window or context))
        scores = jnp.where(seen, jnp.einsum("bqd,bkd->bqk", q, cache["k"]), -1e30)
        return x + jax.nn.softmax(scores, -1) @ cache["v"], cache

    return init, apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    simulate_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import stackwise

    d, context, batch, n = 64, 1024, 8, 8
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    rows = []
    for name, windows, schedule, repeats in (
        ("gpipe, local : global (k divides n/S)", (4, None), "gpipe", None),
        ("gpipe, local : local : global (phases 0, 2, 1, 0)", (4, 4, None), "gpipe", None),
        ("circular (V=2), local : global", (4, None), "circular", 2),
    ):
        kinds = [_layer(jax, jnp, w, d, context, batch) for w in windows]
        inits, applies = [i for i, _ in kinds], [a for _, a in kinds]
        dec = stackwise.pipeline(
            inits, applies, n, mesh, microbatches=4, data_axis="data", with_state=True,
            schedule=schedule, repeats=repeats,
        )  # fmt: skip
        params, cache = jax.jit(dec.init)(jax.random.key(0))
        # 3 positions' layers (3, 3, 2) do not split over 4 stages: replicated there.
        stages = "stage" if len(windows) == 2 else None
        params = stackwise.shard_stacked(params, mesh, layer_axis=stages)
        cache = stackwise.shard_stacked(cache, mesh, P("data"), layer_axis=stages)
        x = jax.device_put(jnp.ones((batch, 1, d)), NamedSharding(mesh, P("data")))
        step = jax.jit(dec.apply, donate_argnums=1).lower(params, cache, x, jnp.int32(3))
        m = step.compile().memory_analysis()
        share = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(cache))
        rows.append((name, share, m.alias_size_in_bytes, m.temp_size_in_bytes))
    kinds = [_layer(jax, jnp, w, d, context, batch) for w in (4, None)]
    plain = stackwise.stack([i for i, _ in kinds], [a for _, a in kinds], n, with_state=True)
    params, cache = jax.jit(plain.init)(jax.random.key(0))
    step = jax.jit(plain.apply, donate_argnums=1).lower(
        params, cache, jnp.ones((batch, 1, d)), jnp.int32(3)
    )
    m = step.compile().memory_analysis()
    share = sum(a.nbytes for a in jax.tree.leaves(cache))
    rows.append(("stackwise.stack, one device", share, m.alias_size_in_bytes, m.temp_size_in_bytes))
    lines = [
        header("**One decode step, per device (MiB), a donated 32 MiB KV cache**"),
        "",
        "| pipeline | cache | aliased | temp |",
        "|---|---|---|---|",
        *(f"| {r[0]} | {r[1] / MIB:.2f} | {r[2] / MIB:.2f} | {r[3] / MIB:.2f} |" for r in rows),
    ]
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
