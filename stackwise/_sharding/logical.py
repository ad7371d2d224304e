"""Logical axis names: params annotated by meaning (``"embed"``, ``"mlp"``,
``"layers"``), mapped to mesh axes by rules, as ``flax.linen``'s
``logical_axis_rules`` and MaxText's ``logical_axis_rules`` do.

Framework-free: the names come from a plain per-leaf mapping (pure JAX,
Haiku) or from a framework's own annotations (``nn.get_partition_spec`` of
linen params made with ``nn.with_logical_partitioning``,
``nnx.get_partition_spec`` of NNX state made with ``nnx.with_partitioning``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from stackwise._core import checks

__all__ = ["logical_specs"]

_WHO = "stackwise.logical_specs"


def _is_names(v: Any) -> bool:
    """A leaf of a names tree: a PartitionSpec, None, or a tuple/list of names (one with a
    name and no subtree is a leaf, checked as one: ``("embed", 1)`` blames the 1)."""
    if v is None or isinstance(v, PartitionSpec):
        return True
    if not isinstance(v, (tuple, list)):
        return False
    if all(e is None or isinstance(e, str) for e in v):
        return True
    return any(isinstance(e, str) for e in v) and not any(
        isinstance(e, (tuple, list, Mapping)) for e in v)


def _check_rules(rules: Any, mesh: Mesh | AbstractMesh | None) -> list[tuple[str, Any]]:
    example = '(("embed", ("data", "fsdp")), ("mlp", "model"), ("layers", None))'
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"{_WHO}: `rules` must be a sequence of (logical name, mesh axes) pairs, e.g. "
            f"{example}; got {type(rules).__name__} {rules!r}."
        )
    checked = []
    for i, rule in enumerate(rules):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        axes = rule[1] if ok else None
        if ok and axes is not None and not isinstance(axes, str):
            ok = isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)
            axes = tuple(axes) if ok else axes
        if not ok:
            raise TypeError(
                f"{_WHO}: rule {i} is {rule!r}; each rule is a pair (logical name, mesh "
                "axes), the mesh axes a name, a tuple of names (the dimension is split over "
                f"all of them, e.g. FSDP over two axes) or None (replicated): {example}."
            )
        if mesh is not None:
            missing = [a for a in ((axes,) if isinstance(axes, str) else axes or ()) if
                       a not in mesh.shape]
            if missing:
                raise ValueError(
                    f"{_WHO}: rule {i}, {tuple(rule)!r}, names mesh axes {missing} that the "
                    f"mesh does not have (its axes: {dict(mesh.shape)}). Give the mesh these "
                    "axes (size 1 is fine) or drop the rule."
                )
        checked.append((rule[0], axes))
    return checked


def _mesh_axes(entry: Any) -> set[str]:
    return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)


def _one(names: Any, rules: list[tuple[str, Any]], where: str) -> PartitionSpec:
    """Flax's rule: in rule order, a name takes its rule's mesh axes if it has none
    yet and no other dimension of the leaf uses them; a name no rule gives mesh
    axes stays replicated."""
    if names is None:
        return PartitionSpec()
    if not isinstance(names, (PartitionSpec, tuple, list)):
        example = f"({names!r},)" if isinstance(names, str) else "('embed', 'mlp')"
        raise TypeError(
            f"{_WHO}: leaf {where} has logical names {type(names).__name__} {names!r}; give "
            "one logical name (a str) or None per dimension, as a tuple or a "
            f"`PartitionSpec`, e.g. `{example}`."
        )
    names = tuple(names)
    for e in names:
        if e is not None and not isinstance(e, str):
            raise TypeError(
                f"{_WHO}: leaf {where} has logical names {names}; each dimension has one "
                f"logical name (a str) or None, got {e!r}."
            )
    dups = sorted({e for e in names if e is not None and names.count(e) > 1})
    if dups:
        raise ValueError(
            f"{_WHO}: leaf {where} names dimensions {names}, with {dups} more than once; "
            "give each dimension its own logical name."
        )
    result: list[Any] = [None] * len(names)
    assigned = [False] * len(names)
    for name, axes in rules:
        if name not in names:
            continue
        pos = names.index(name)
        used = set().union(*(_mesh_axes(e) for e in result))
        if not assigned[pos] and not (_mesh_axes(axes) & used):
            result[pos], assigned[pos] = axes, True
    return PartitionSpec(*result)


def logical_specs(
    names: Any, rules: Sequence[tuple[str, Any]], *, mesh: Mesh | AbstractMesh | None = None
) -> Any:
    """Mesh ``PartitionSpec`` s from logical axis names, by rules.

    Each leaf of ``names`` names the dimensions of one param, by meaning;
    ``rules`` say which mesh axes each name is split over, as
    ``flax.linen.logical_axis_rules`` and MaxText's ``logical_axis_rules``:
    rules are taken in order, a name takes the first of its rules whose mesh
    axes no other dimension of that param uses, and a name without a rule
    (or whose axes are taken) is replicated. A rule may split a name over
    several mesh axes: ``("embed", ("data", "fsdp"))`` is FSDP over both.

    Per-layer names (one layer's dimensions, as a plain mapping for pure JAX
    or Haiku params) give per-layer specs for
    :func:`stackwise.shard_stacked`, which adds the layer axis:

    >>> import jax, jax.numpy as jnp, stackwise
    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> names = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed"), "b": ("embed",)}
    >>> rules = [("embed", ("data", "fsdp")), ("mlp", "model")]
    >>> specs = stackwise.logical_specs(names, rules)
    >>> specs["w1"], specs["w2"]
    (P(('data', 'fsdp'), 'model'), P('model', ('data', 'fsdp')))

    Names of whole stacked leaves, e.g. ``nn.get_partition_spec`` of a linen
    ``Stack(..., layer_axis_name="layers")``'s params or
    ``nnx.get_partition_spec`` of an NNX ``Stack``'s state, name the layer
    axis too, and a rule places it (``None``: every stage holds every layer;
    a stage axis: pipeline stages):

    >>> stackwise.logical_specs(P("layers", "embed", "mlp"), [("layers", "stage"),
    ...                                                       ("embed", "data")])
    P('stage', 'data', None)

    Args:
      names: a tree whose leaves are logical names: a ``PartitionSpec`` of
        names, a tuple or list of names (``None`` for an unnamed dimension),
        or ``None`` (replicated).
      rules: ``(logical name, mesh axes)`` pairs; the mesh axes a name, a
        tuple of names or ``None``.
      mesh: if given, every mesh axis the rules name must be one of its axes.

    Returns:
      A tree like ``names`` with a mesh ``PartitionSpec`` per leaf.

    Raises:
      TypeError: a malformed rule or name (a str is one name, not the names of a
        leaf: ``("embed",)``), or ``mesh`` not a mesh.
      ValueError: a name used twice in one leaf, or (with ``mesh``) a rule
        naming an axis the mesh lacks.
    """
    mesh = checks.mesh(mesh, _WHO, optional=True)
    checked = _check_rules(rules, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, v: _one(v, checked, jax.tree_util.keystr(path) or "<root>"),
        names,
        is_leaf=_is_names,
    )
