"""Saving checkpoints from several JAX processes (a pod's hosts): all gather, process 0 writes.

Loading needs nothing of this module: each process builds the shards of its own devices. A
saved file holds whole tensors, which no process holds alone, so every process takes part in
gathering each tensor (one collective per tensor, in the same order on every process) and
process 0 copies it to its host and writes the files. Process 0's findings (a checkpoint in
the way, a write that failed) reach every process, so that all of them raise or none does: a
process that raised alone would leave the others waiting in the next collective. With one
process, each function here is the plain one-process step and raises at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

__all__ = ["Writer", "agree", "host_row", "take_row"]


def several() -> bool:
    return jax.process_count() > 1


def agree(value: int) -> int:
    """Process 0's ``value`` on every process, once all have come here (a barrier too)."""
    if not several():
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


class Writer:
    """Process 0's writes to ``where``; with several processes its first failure is kept,
    and :meth:`settle` raises it on process 0 and a RuntimeError on the others."""

    def __init__(self, who: str, where: str):
        self.who, self.where = who, where
        self.failure: Exception | None = None

    @property
    def active(self) -> bool:
        """Whether this process writes and nothing has failed."""
        return jax.process_index() == 0 and self.failure is None

    def run(self, action: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``action(*args, **kwargs)`` on process 0 (unless an earlier step failed)."""
        if not self.active:
            return
        try:
            action(*args, **kwargs)
        except OSError as e:
            if not several():
                raise
            self.failure = e

    def always(self, action: Callable[..., Any], *args: Any) -> None:
        """``action(*args)`` on process 0, even after a failure (to clean up after it)."""
        if jax.process_index() == 0:
            action(*args)

    def settle(self) -> None:
        """With several processes, a barrier, after which every process raises if process 0
        failed (process 0 its own error)."""
        if not several() or not agree(self.failure is not None):
            return
        if self.failure is not None:
            raise self.failure
        raise RuntimeError(
            f"{self.who}: process 0, which writes {self.where}, failed (its error says why); "
            "this process stopped with it."
        )


def _take(a: jax.Array, j: jax.Array) -> jax.Array:
    """Row ``j`` of ``a``, bit for bit: a float array's row is taken as unsigned integers of
    its width (XLA may quiet a signalling NaN when it copies floats: its older CPU code
    generator copies bfloat16 through float32, so 0x7fbf became 0x7fc0)."""
    dtype = a.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return a[j]
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[dtype.itemsize]
    return lax.bitcast_convert_type(lax.bitcast_convert_type(a, bits)[j], dtype)


_row = jax.jit(_take)


def take_row(a: Any, j: int | None) -> Any:
    """Row ``j`` of leaf ``a`` (``a`` whole if ``j`` is None), bit for bit: on its devices
    for a ``jax.Array``, by NumPy's indexing for another."""
    if j is None:
        return a
    return _row(a, np.int32(j)) if isinstance(a, jax.Array) else a[j]


def _whole(a: jax.Array) -> jax.Array:
    return a


def _on_every_host(sharding: Any, row: bool) -> Sharding:
    """A sharding that gives each process holding part of an array (with ``sharding``, or row
    j of it) the whole array: ``sharding`` less the mesh axes that cross processes, so that
    the gather goes over those alone and each process's devices keep the array split as
    before; replicated on every device for a sharding other than a NamedSharding."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(sharding, NamedSharding) and isinstance(mesh, Mesh):
        owner = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
        crossing = {
            name
            for k, name in enumerate(mesh.axis_names)
            if (owner != owner.take([0], axis=k)).any()
        }
        spec = []
        for entry in tuple(sharding.spec)[1:] if row else tuple(sharding.spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            kept = tuple(a for a in axes if a not in crossing)
            spec.append(kept or None)
        # Along the kept axes a device's neighbours are its own process's: each process's
        # devices hold every part of the array.
        return NamedSharding(mesh, P(*spec))
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    return NamedSharding(Mesh(np.array(devices), ("devices",)), P())


def host_row(a: Any, j: int | None, writer: Writer, path: str) -> np.ndarray | None:
    """Row ``j`` of leaf ``a`` (``a`` whole if ``j`` is None) in process 0's host memory;
    None on the other processes (and on process 0 once a write failed).

    With several processes, every process calls it for every row in the same order: a leaf
    spread over several processes' devices is gathered by a collective among them (the
    row alone, over the mesh axes that cross processes: each of them gets it whole, split
    over its own devices as before), then copied shard by shard to process 0's host. A
    leaf held by one process alone (NumPy, or on its own devices) is that process's value;
    process 0 writes its own.
    """
    if not several():
        return np.asarray(jax.device_get(take_row(a, j)))
    if not isinstance(a, jax.Array) or a.is_fully_addressable:
        return np.asarray(take_row(a, j)) if writer.active else None
    owners = {d.process_index for d in a.sharding.device_set}
    if jax.process_index() not in owners:  # another process's array
        if writer.active:
            writer.failure = ValueError(
                f"{writer.who}: leaf {path} is on the devices of process(es) "
                f"{sorted(owners)} alone, and process 0, which writes {writer.where}, cannot "
                "read it. Place the params on a mesh over every process's devices (as "
                "load_checkpoint with shardings, or a jitted init with out_shardings, does)."
            )
        return None
    layout = _on_every_host(a.sharding, row=j is not None)
    row = (
        jax.jit(_take, out_shardings=layout)(a, np.int32(j))
        if j is not None
        else jax.jit(_whole, out_shardings=layout)(a)
    )
    if not writer.active:
        return None
    host, copied = np.empty(row.shape, row.dtype), set()
    for shard in row.addressable_shards:  # this process's devices hold the whole row
        where = tuple(s.indices(n) for s, n in zip(shard.index, row.shape))
        if where not in copied:  # a replica once
            host[shard.index] = np.asarray(shard.data)
            copied.add(where)
    return host
