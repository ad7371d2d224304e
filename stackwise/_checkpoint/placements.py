"""Where :func:`stackwise.load_checkpoint` puts each leaf: its ``shardings`` argument read
against the target, as strictly as its ``names``. One ``Sharding`` for every leaf, or a tree
that mirrors the target (a ``Sharding`` or None per leaf, or one for a whole subtree, as
``jax.device_put`` takes a prefix); anything else is refused before a byte is read, since a
placement ignored puts the whole model on one device."""

from __future__ import annotations

import difflib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from stackwise._checkpoint.names import is_array
from stackwise._core import trees

_TREE = ("a tree like the target's of Shardings or None (None: the leaf's own sharding, else "
         "the first device), e.g. stackwise.stacked_shardings(mesh, specs) for a Stack's "
         "leaves and NamedSharding(mesh, spec) for the others.")


def _is_placement(x: Any) -> bool:
    return x is None or isinstance(x, Sharding)


def placements(shardings: Any, target: Any, who: str) -> list[Any]:
    """The sharding (or None) that ``shardings`` gives each leaf of ``target``, in the order
    of ``jax.tree_util.tree_leaves_with_path(target)``; refuses what places no leaf."""
    given = {
        tuple(trees.key_text(k) for k in keys): value
        for keys, value in jax.tree_util.tree_leaves_with_path(shardings, is_leaf=_is_placement)
    }
    if () in given and not _is_placement(given[()]):
        _refuse_whole(given[()], who)
    leaves = [tuple(trees.key_text(k) for k in keys)
              for keys, _ in jax.tree_util.tree_leaves_with_path(target)]
    prefixes = {keys[:i] for keys in leaves for i in range(len(keys) + 1)}
    for keys in given:
        if keys not in prefixes:
            _refuse_entry(keys, leaves, who)
    out = []
    for keys, (path, leaf) in zip(leaves, jax.tree_util.tree_leaves_with_path(target)):
        found = [given[keys[:i]] for i in range(len(keys) + 1) if keys[:i] in given]
        if not found and shardings is not None and is_array(leaf):
            raise ValueError(
                f"{who}: `shardings` has no entry for the target's leaf "
                f"{jax.tree_util.keystr(path)}, which would go to one device unasked. Give "
                "it a Sharding or None, as in " + _TREE
            )
        out.append(found[0] if found else None)
    return out


def _refuse_whole(value: Any, who: str) -> None:
    if isinstance(value, PartitionSpec):
        raise TypeError(
            f"{who}: `shardings` is the PartitionSpec {value}, which says how to split a leaf "
            "but not over which devices (and fits the leaves of one rank). Give it its mesh: "
            f"NamedSharding(mesh, {value}) for every leaf, or " + _TREE
        )
    if isinstance(value, Mesh):
        raise TypeError(
            f"{who}: `shardings` is a Mesh {dict(value.shape)}, which says which devices but "
            "not how to split each leaf. Replicate every leaf with NamedSharding(mesh, P()), "
            "or split them with " + _TREE
        )
    raise TypeError(
        f"{who}: `shardings` is {type(value).__name__} {value!r}, not a "
        "jax.sharding.Sharding. Pass one Sharding for every leaf (NamedSharding(mesh, "
        "spec)), or " + _TREE
    )


def _refuse_entry(keys: tuple, leaves: list[tuple], who: str) -> None:
    """A ``shardings`` entry at ``keys``, where the target has no leaf or subtree: names its
    first key that the target lacks, and the closest the target has there."""
    i = next(i for i in range(len(keys)) if not any(k[: i + 1] == keys[: i + 1] for k in leaves))
    there = sorted({k[i] for k in leaves if k[:i] == keys[:i] and len(k) > i})
    under = "/".join(keys[:i]) or "the top"
    close = difflib.get_close_matches(keys[i], there, n=1)
    if not there:
        what = f"the target has a leaf at {under}, not a subtree with key {keys[i]!r}"
    else:
        what = (f"the target has no key {keys[i]!r} under {under}"
                + (f"; did you mean {close[0]!r}?" if close else f"; it has {there}"))
    raise ValueError(
        f"{who}: `shardings` has an entry at {'/'.join(keys)} for no leaf of the target ({what}). "
        "A misspelt key would leave the leaf it meant without its placement. Fix the key, or "
        "remove the entry."
    )


def check_sharding(sharding: Any, shape: tuple, path: str, who: str) -> None:
    """A leaf's sharding: a Sharding whose spec (a NamedSharding's) fits ``shape``."""
    if not isinstance(sharding, Sharding):
        spec = isinstance(sharding, PartitionSpec)  # (its class is `P` in some jax releases)
        hint = f" (NamedSharding(mesh, {sharding}) gives it its mesh)" if spec else ""
        what = "a PartitionSpec" if spec else type(sharding).__name__
        raise TypeError(
            f"{who}: the sharding for leaf {path} is {what}, not a "
            f"jax.sharding.Sharding{hint}; build them with stackwise.stacked_shardings or "
            "NamedSharding(mesh, spec)."
        )
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(shape):
            raise ValueError(
                f"{who}: leaf {path} has shape {shape} but its sharding's spec "
                f"{sharding.spec} names {len(spec)} axes. Stacked leaves' specs include the "
                "layer axis: build them with stackwise.stacked_shardings(mesh, specs)."
            )
        for d, entry in enumerate(spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            size = int(np.prod([sharding.mesh.shape[a] for a in axes]))
            if shape[d] % size:
                raise ValueError(
                    f"{who}: leaf {path} has shape {shape}; axis {d} (length {shape[d]}) "
                    f"cannot be split over mesh axes {entry!r} of size {size} (spec "
                    f"{sharding.spec}). Shard another axis (stackwise.fsdp_specs picks one "
                    "that divides) or leave this one unsharded."
                )
