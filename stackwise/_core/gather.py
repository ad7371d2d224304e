"""What ``stackwise.stack(..., fsdp=axes)`` runs: each layer's params gathered over the FSDP
mesh axes inside the loop, and the check that those axes exist (jax only)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from stackwise._core import checks, trees


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of one `PartitionSpec` entry (None, a name or a tuple of names)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def check_fsdp_axes(params: Any, axes: tuple[str, ...], who: str) -> None:
    """``fsdp=axes`` on a mesh without them would gather nothing: FSDP silently off.

    The meshes are the one set by ``jax.set_mesh`` and those the params are placed on;
    off every mesh (one device) ``fsdp`` changes nothing but the remat, by design.
    """
    meshes = [jax.sharding.get_abstract_mesh()]
    for _, leaf in trees.named_leaves(params):
        meshes.append(getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None))
    for mesh in meshes:
        if mesh is None or getattr(mesh, "empty", True):
            continue
        missing = checks.mesh_lacks(mesh, axes)
        if missing:
            raise ValueError(
                f"{who}: `fsdp={axes if len(axes) > 1 else axes[0]!r}` names mesh axis "
                f"{missing[0]!r}, but the mesh in use (`jax.set_mesh`, or the params' own) has "
                "axes "
                f"{dict(mesh.shape)}: nothing would be gathered and FSDP would be off. Name "
                "the mesh axis the params are sharded over (e.g. `fsdp='data'`), or build "
                f"the mesh with a {missing[0]!r} axis."
            )


def gather(params: Any, axes: str | tuple[str, ...]) -> Any:
    """``params`` resharded without the mesh ``axes`` (an all-gather over them).

    Explicit mesh axes only: a leaf whose type carries no sharding over
    ``axes`` (replicated, ``Auto`` axes, outside a mesh) is returned as it is;
    other axes of the leaf (e.g. a tensor-parallel ``"model"``) keep their
    sharding. Used by ``stackwise.stack(..., fsdp=axes)`` on each layer's
    params inside the loop.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def one(leaf):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if not any(set(entry_axes(e)) & set(axes) for e in spec):
            return leaf
        kept = [tuple(a for a in entry_axes(e) if a not in axes) or None for e in spec]
        kept = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in kept]
        return jax.reshard(leaf, NamedSharding(sharding.mesh, PartitionSpec(*kept)))

    return jax.tree.map(one, params)

