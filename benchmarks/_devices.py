"""Where the mesh benchmarks run (distributed_memory, pipeline_bubble, pipeline_decode_memory,
pipeline_fsdp_memory): S devices simulated on the CPU, and the backend named in each table.

Their tables compare layouts over 8 devices (or S stages), and a TPU v5e host has one chip: so
each sets, before JAX starts, XLA:CPU's host device count (added to XLA_FLAGS already set,
unless they set a count) and ``JAX_PLATFORMS=cpu`` (over a TPU host's ``tpu``). Run unchanged
on a TPU host, they measure the CPU's simulated devices and say so in their headers.
"""

from __future__ import annotations

import os
import sys


def simulate_cpu_devices(count: int) -> None:
    """``count`` simulated CPU devices for the JAX this process is about to start."""
    if "jax" in sys.modules:
        raise RuntimeError("run this as a script: it must set XLA_FLAGS and JAX_PLATFORMS "
                           "before importing jax")
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={count}".strip()
        os.environ["XLA_FLAGS"] = flags
    os.environ["JAX_PLATFORMS"] = "cpu"


def header(title: str) -> str:
    """``title`` with the backend, its devices and the versions that measured."""
    from stackwise.bench.report import backend

    return f"{title} (on {backend()})"
