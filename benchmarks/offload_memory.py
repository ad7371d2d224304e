"""Host offload of a Stack's carries on a TPU: the memory the compiler plans, read from the
compiled program.

``jit(grad)`` of an MLP residual stack (``x + tanh(x @ w)``, n layers) under four remats:
none, ``remat=True`` (nothing saved but the scan's own carries), a policy that saves the
carry entering each layer (``save_only_these_names(stackwise.CARRY_NAME)``) and one that
offloads it to the host's pinned memory instead (``save_and_offload_only_these_names``).
Compiled for a TPU v5e, the table gives the device's temp memory (HBM) and the host's
temp memory from ``compile().memory_analysis()``, beside what the carries weigh (n x batch
x d float32), at the default matmul precision (a TPU's: bfloat16 passes) and at 'highest'.
Nothing runs: on a machine without a chip, libtpu compiles for a v5e described by name, as in
``tpu_decode_hlo.py`` (its docstring says how):

    TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost JAX_PLATFORMS=cpu \\
        python benchmarks/offload_memory.py --markdown benchmarks/results/offload_memory.md

That the offloaded program computes the same gradients is a test
(``tests/core/test_offload.py``), on the CPU in CI and on the chip in ``.ci/tpu``.
"""

from __future__ import annotations

import argparse
import itertools
import sys

# benchmarks/tpu_decode_hlo.py, next to this script
from tpu_decode_hlo import compiled_for, report, tpu_device, triples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=triples("n:d:batch"),
                   default="24:1024:4096,48:1024:2048,12:4096:8192",
                   help="n:d:batch triples, comma-separated")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    return p.parse_args(argv)


def measure(n: int, d: int, batch: int, dev) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import stackwise

    def apply(p, x):
        return x + jnp.tanh(x @ p["w"])

    names = [stackwise.CARRY_NAME]
    remats = {
        "no remat": False,
        "remat=True": True,
        "save the carries": jax.checkpoint_policies.save_only_these_names(*names),
        "offload the carries": jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=names,
            offload_src="device", offload_dst="pinned_host"),
    }
    sharding = jax.sharding.SingleDeviceSharding(dev)
    params = {"w": jax.ShapeDtypeStruct((n, d, d), jnp.float32, sharding=sharding)}
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32, sharding=sharding)
    carries = n * batch * d * 4 / 2**20
    rows = []
    for precision, (name, remat) in itertools.product(("default", "highest"), remats.items()):
        layers = stackwise.stack(None, apply, n, remat=remat)
        step = jax.jit(jax.grad(lambda p, x, layers=layers: layers.apply(p, x).sum()))
        with jax.default_matmul_precision(None if precision == "default" else precision):
            memory = step.trace(params, x).lower().compile().memory_analysis()
        rows.append({
            "matmuls": precision, "remat": name, "n": n, "d": d, "batch": batch,
            "carries MiB": carries,
            "device temp MiB": memory.temp_size_in_bytes / 2**20,
            "host temp MiB": memory.host_temp_size_in_bytes / 2**20,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = tpu_device()
    rows = []
    for n, d, batch in args.shapes:
        rows += measure(n, d, batch, dev)
    report(rows, compiled_for(dev), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
