"""Exact conversions between a linen Stack's variables and other layouts.

- :func:`convert`: one model's variables onto another's, leaf by leaf in the
  order the modules are first called (an upstream loop model into its port
  onto a Stack, and back), in one call;
- :func:`from_loop` / :func:`to_loop`: a Python loop of blocks (``layers_0``,
  ``layers_1``, ... or any naming, with a pattern of k blocks too), found by
  name;
- :func:`from_scan` / :func:`to_scan`: ``nn.scan`` (any ``variable_axes``,
  any ``metadata_params`` partition name).

Every collection is converted; partitioning boxes (``nn.Partitioned``,
``nn.LogicallyPartitioned``) keep their metadata with the layer axis added or
removed. Every function moves every leaf exactly (bitwise, dtype kept) or
raises naming the variable, the layer and the fix; none overwrites an entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.core.scope import in_filter

from stackwise import _convert

__all__ = ["convert", "from_loop", "from_scan", "to_loop", "to_scan"]

Path = str | tuple[str, ...]
Names = str | Sequence[str] | Callable[[int], str]


# --------------------------------------------------------------------------
# Paths and nested dicts.


def _parts(path: Any, who: str, what: str = "path") -> tuple[str, ...]:
    if isinstance(path, str):
        parts = tuple(p for p in path.split("/") if p)
    elif isinstance(path, tuple) and all(isinstance(p, str) for p in path):
        parts = path
    else:
        parts = None
    if not parts:
        raise TypeError(
            f"{who}: `{what}` must name a module, e.g. 'layers' or 'decoder/layers' (or "
            f"a tuple of names), got {path!r}."
        )
    return parts


def _paths(path: Any, who: str) -> list[tuple[str, ...]]:
    """One path, or a list of k (a pattern: position p's block)."""
    if isinstance(path, list):
        if not path:
            raise TypeError(f"{who}: a pattern's `path` lists its k positions; got [].")
        paths = [_parts(p, who) for p in path]
        _convert.check_distinct(["/".join(p) for p in paths], who)
        return paths
    return [_parts(path, who)]


def _common(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The paths' longest common prefix (a pattern's positions: the Stack's path)."""
    common = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return common


def _parent(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """Where a loop's layers are named: next to the Stack (the positions' common parent)."""
    if len(paths) == 1:
        return paths[0][:-1]
    return _common(paths)[:-1]


def _show(col: str, path: tuple) -> str:
    return f"{col}/{'/'.join(map(str, path))}"


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        if not isinstance(tree, Mapping) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _copy_to(tree: dict, path: tuple) -> dict:
    """Copies the dicts along ``path`` so that it can be edited; returns the last one."""
    for p in path:
        tree[p] = dict(tree.get(p, {}))
        tree = tree[p]
    return tree


def _pop(tree: dict, path: tuple) -> Any:
    parent = _copy_to(tree, path[:-1])
    value = parent.pop(path[-1])
    # Drop dicts left empty by the pop, as Flax never stores them.
    for k in range(len(path) - 1, 0, -1):
        if _get(tree, path[:k]) == {}:
            _copy_to(tree, path[: k - 1]).pop(path[k - 1])
    return value


def _put(tree: dict, path: tuple, value: Any, col: str, who: str) -> None:
    """Sets ``tree[path] = value``; never over an existing entry."""
    node = tree
    for k, p in enumerate(path[:-1]):
        if p in node and not isinstance(node[p], Mapping):
            raise ValueError(f"{who}: {_show(col, path[: k + 1])} exists and is not a module.")
        node = node.get(p, {})
    if _get(tree, path) is not None:
        raise ValueError(
            f"{who}: {_show(col, path)} already exists; stackwise never overwrites an "
            "entry. Remove it first, or convert to another path or names."
        )
    _copy_to(tree, path[:-1])[path[-1]] = value


def _variables(variables: Any, who: str) -> dict[str, dict]:
    if not isinstance(variables, Mapping) or not all(
        isinstance(v, Mapping) for v in variables.values()
    ):
        raise TypeError(
            f"{who}: `variables` must be a linen variables dict, "
            f"`{{collection: {{name: ...}}}}` as `init` returns it, got "
            f"{type(variables).__name__}."
        )
    return {col: dict(tree) for col, tree in variables.items()}


# --------------------------------------------------------------------------
# Boxes.


def _box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _value(box: Any) -> Any:
    """A box's array (without the sharding constraint ``Partitioned.unbox`` may add)."""
    if isinstance(box, meta.Partitioned):
        return box.unbox(apply_constraint=False)
    return box.unbox() if _box(box) else box


def _unbox(tree: Any) -> Any:
    return jax.tree.map(_value, tree, is_leaf=_box)


def _params(axis_name: Any) -> dict:
    return {nn.PARTITION_NAME: axis_name}


def _rebox(boxed: Any, values: Any, update: Callable[[Any], Any]) -> Any:
    """``values`` (unboxed) put back in the boxes of ``boxed``, each box ``update``d."""
    return jax.tree.map(
        lambda b, v: update(b.replace_boxed(v)) if _box(b) else v, boxed, values, is_leaf=_box
    )


def _box_meta(b: Any) -> Any:
    return (type(b).__name__, b.replace_boxed(None)) if _box(b) else None


def _check_same_boxes(layers: list, col: str, label: Callable[[int], str], who: str) -> None:
    """Layers' boxes (partitioning metadata) must agree, or stacking would drop some."""
    first = jax.tree_util.tree_leaves_with_path(layers[0], is_leaf=_box)
    for i, layer in enumerate(layers[1:], 1):
        for (path, a), b in zip(first, jax.tree_util.tree_leaves(layer, is_leaf=_box)):
            if _box_meta(a) != _box_meta(b):
                raise ValueError(
                    f"{who}: variable {col}{jax.tree_util.keystr(path)} has partitioning "
                    f"{_box_meta(b)} in {label(i)} but {_box_meta(a)} in {label(0)}; the "
                    "stacked variable keeps one partitioning, so the layers must agree."
                )


def _check_layer_axis(stacked: Any, col: str, where: tuple, axis_name: Any, who: str) -> None:
    for path, b in jax.tree_util.tree_leaves_with_path(stacked, is_leaf=_box):
        names = getattr(b, "names", None)
        if _box(b) and names is not None and (not names or names[0] != axis_name):
            raise ValueError(
                f"{who}: variable {_show(col, where)}{jax.tree_util.keystr(path)} is "
                f"partitioned as {tuple(names)}, whose first (layer) axis should be named "
                f"{axis_name!r}; pass the Stack's "
                f"`layer_axis_name={names[0] if names else None!r}`."
            )


# --------------------------------------------------------------------------
# By name: a loop's blocks <-> a Stack's variables.


def _layer_path(name_of: Callable[[int], Any], parent: tuple, i: int, who: str) -> tuple:
    name = name_of(i)
    if not isinstance(name, str) or not name.strip("/"):
        raise TypeError(
            f"{who}: `names` must give a non-empty str for each layer index (a format "
            f"string like 'layers_{{}}', a function or a list), got {name!r} for layer {i}."
        )
    return parent + tuple(p for p in name.split("/") if p)


def from_loop(
    variables: Mapping[str, Any],
    path: Path | list[Path],
    names: Names = "layers_{}",
    *,
    n: int | None = None,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """A Python loop's variables in a Stack's layout, in every collection, exactly.

    The loop's blocks, named ``names.format(i)`` (or ``names(i)``, or
    ``names[i]``; a name with ``/`` nests) next to ``path``, are stacked
    along a new leading axis into ``path``. Other variables are kept.

    >>> import jax, jax.numpy as jnp, stackwise.flax
    >>> loop = {"params": {f"block{i}": {"w": jnp.full(2, i)} for i in range(3)}}
    >>> stacked = stackwise.flax.from_loop(loop, "stack", names="block{}")
    >>> stacked["params"]["stack"]["w"].tolist()
    [[0, 0], [1, 1], [2, 2]]
    >>> back = stackwise.flax.to_loop(stacked, "stack", names="block{}")
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, loop))
    True

    The layers are found by name, all of them: a gap (``layers_0``,
    ``layers_2``) or more layers than ``n`` is an error naming what was found.
    For a pattern of k blocks (``Stack([A, A, B], n)``), ``path`` lists the
    k positions' paths and layer i goes to position ``i % k``.

    Args:
      variables: all variables of a model, ``{collection: tree}``.
      path: where the Stack's variables go in each collection, e.g.
        ``"layers"`` or ``"decoder/layers"``; for a pattern, a list of the k
        positions' paths, e.g. ``["layers/Local_0", "layers/Local_1",
        "layers/Global_0"]``.
      names: the loop's blocks: a format string (``"layers_{}"``,
        ``"encoderdecoderblock_{}"``), a function of the index or a list of n
        names, next to the Stack (relative to the parent of ``path``; for a
        pattern, of the Stack that holds the positions, e.g. ``"layers"``).
      n: the number of layers; by default all layers found.
      layer_axis_name: the Stack's ``layer_axis_name`` (added to every
        partitioning spec).

    Returns:
      New variables (the input is not modified).

    Raises:
      ValueError: no layer found, a gap, more layers than ``n``, a collection
        holding only some layers, layers whose variables differ in structure,
        shape or partitioning, or a ``path`` that already exists.
      TypeError: a variable whose dtype differs between layers (never
        promoted), or a bad argument (e.g. ``names`` without ``{}``).
    """
    who = "stackwise.flax.from_loop"
    variables = _variables(variables, who)
    paths = _paths(path, who)
    parent = _parent(paths)
    n = _convert.check_n(n, who)
    name_of = _convert.layer_names(names, who, example="'layers_{}'")

    def exists(i: int) -> bool:
        try:
            where = _layer_path(name_of, parent, i, who)
        except (IndexError, KeyError):
            return False
        return any(_get(tree, where) is not None for tree in variables.values())

    bound = sum(len(jax.tree.leaves(t, is_leaf=_box)) for t in variables.values())
    fixed = len(names) if isinstance(names, (list, tuple)) else None
    label = lambda i: repr("/".join(_layer_path(name_of, parent, i, who)))  # noqa: E731
    k, asked = len(paths), fixed if fixed is not None else n
    if asked is not None and asked < k:
        raise ValueError(f"{who}: a pattern of {k} blocks needs at least {k} layers, got {asked}.")
    n = _convert.find_depth(exists, label, n, bound, who, fixed=fixed, pattern=k)
    layer_paths = [_layer_path(name_of, parent, i, who) for i in range(n)]
    _convert.check_distinct(["/".join(p) for p in layer_paths], who)
    p_layer = _params(layer_axis_name)
    out = {}
    for col, tree in variables.items():
        for q, where in enumerate(paths):
            present = [i for i in range(q, n, k) if _get(tree, layer_paths[i]) is not None]
            if not present:
                continue  # this collection has nothing of this kind of block
            if len(present) < len(range(q, n, k)):
                missing = sorted(set(range(q, n, k)) - set(present))
                kind = f" of pattern position {q}" if k > 1 else ""
                raise ValueError(
                    f"{who}: collection {col!r} has some of the {len(range(q, n, k))} layers"
                    f"{kind} but not layers "
                    f"{missing} ({', '.join(label(i) for i in missing[:3])}); a block's "
                    "collections exist in every layer."
                )
            own = [_pop(tree, layer_paths[i]) for i in present]
            lab = lambda j, q=q: f"layer {q + j * k} ({label(q + j * k)})"  # noqa: E731
            _check_same_boxes(own, col, lab, who)
            values = _convert.stack_exact(
                [_unbox(layer) for layer in own],
                who,
                label=lab,
                leaf_name=lambda s, col=col, where=where: _show(col, where) + s,
            )
            stacked = _rebox(own[0], values, lambda b: b.add_axis(0, p_layer))
            _put(tree, where, stacked, col, who)
        out[col] = tree
    return out


def to_loop(
    variables: Mapping[str, Any],
    path: Path | list[Path],
    names: Names = "layers_{}",
    *,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """A Stack's variables in the layout of a Python loop of blocks, in every collection.

    The inverse of :func:`from_loop`: the stacked subtree at ``path`` is
    replaced, in each collection, by ``n`` per-layer subtrees named
    ``names.format(i)`` (or ``names(i)``, ``names[i]``; a name with ``/``
    nests) next to it.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> stacked = {"params": {"layers": {"w": jnp.zeros((3, 2))}, "head": {"b": jnp.ones(2)}}}
    >>> loop = stackwise.flax.to_loop(stacked, "layers")
    >>> sorted(loop["params"]), loop["params"]["layers_2"]["w"].shape
    (['head', 'layers_0', 'layers_1', 'layers_2'], (2,))

    Args:
      variables: all variables of a model, ``{collection: tree}``.
      path: where the Stack's variables are in each collection; for a pattern,
        the list of the k positions' paths.
      names: the per-layer names, as for :func:`from_loop`.
      layer_axis_name: the Stack's ``layer_axis_name`` (removed from every
        partitioning spec; a spec whose first axis has another name is an
        error).

    Returns:
      New variables (the input is not modified); arrays are sliced exactly.

    Raises:
      ValueError: ``path`` in no collection, leaves without a common leading
        axis, two layers of one name, or a layer name that already exists.
      TypeError: a bad argument (e.g. ``names`` without ``{}``).
    """
    who = "stackwise.flax.to_loop"
    variables = _variables(variables, who)
    paths = _paths(path, who)
    parent = _parent(paths)
    name_of = _convert.layer_names(names, who, example="'layers_{}'")
    if all(_get(t, p) is None for t in variables.values() for p in paths):
        where = " or ".join(repr("/".join(p)) for p in paths)
        have = {col: sorted(t) for col, t in variables.items()}
        raise ValueError(f"{who}: no collection has {where}; the variables have {have}.")
    p_layer = _params(layer_axis_name)
    k = len(paths)
    stack = _common(paths) if k > 1 else ()  # a pattern's Stack: nothing else may stay there
    out, positions = {}, {}  # collection -> position -> its layers
    for col, tree in variables.items():
        out[col] = tree
        for q, where in enumerate(paths):
            if _get(tree, where) is None:
                continue  # with a pattern: this collection has nothing of this kind
            stacked = _pop(tree, where)
            _check_layer_axis(stacked, col, where, layer_axis_name, who)
            values = _unbox(stacked)
            depth = _convert.depth_of(values, who, f"variables at {_show(col, where)}")
            layers = _convert.unstack_exact(values, depth)
            positions.setdefault(col, {})[q] = [
                _rebox(stacked, v, lambda b: b.remove_axis(0, p_layer)) for v in layers
            ]
        left = _get(tree, stack) if stack else None
        if left:
            raise ValueError(
                f"{who}: {_show(col, stack)} holds {sorted(left)} besides the pattern's "
                f"positions {['/'.join(p) for p in paths]}; they would be left behind, "
                "stacked. Check `path` (each position's path, in the pattern's order)."
            )
    depths: dict[int, int] = {}
    for col, held in positions.items():
        for q, layers in held.items():
            if depths.setdefault(q, len(layers)) != len(layers):
                raise ValueError(
                    f"{who}: {_show(col, paths[q])} holds {len(layers)} layers but another "
                    f"collection holds {depths[q]} there; every collection of a block has "
                    "one layer axis."
                )
    lo, hi = _convert.pattern_depths(depths, k, who)
    if isinstance(names, (list, tuple)) and not lo <= len(names) <= hi:
        held = lo if lo == hi else f"{lo} to {hi}"
        raise ValueError(
            f"{who}: the stacked variables hold {held} layers but {len(names)} `names` "
            "were given; give one name per layer."
        )
    indices = sorted({q + j * k for q, d in depths.items() for j in range(d)})
    layer_paths = {i: _layer_path(name_of, parent, i, who) for i in indices}
    _convert.check_distinct(["/".join(p) for p in layer_paths.values()], who)
    for col, held in positions.items():
        for q, layers in held.items():
            for j, layer in enumerate(layers):
                _put(out[col], layer_paths[q + j * k], layer, col, who)
    return out


# --------------------------------------------------------------------------
# nn.scan's layout: the same stacked arrays, the layer axis maybe elsewhere.


def _axis_for(variable_axes: Mapping[Any, Any], col: str) -> int | None:
    for filt, axis in variable_axes.items():
        if in_filter(filt, col):
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise ValueError(
                    f"stackwise.flax: collection {col!r} has scan axis {axis!r} in "
                    "`variable_axes`; only collections stacked along an int axis convert "
                    "(a broadcast collection holds one copy shared by all layers)."
                )
            return axis
    return None


def _move(
    variables: Mapping[str, Any],
    path: Path | None,
    variable_axes: Mapping[Any, Any] | None,
    to_stack: bool,
    scan_axis_name: Any,
    layer_axis_name: Any,
    who: str,
) -> dict[str, Any]:
    variables = _variables(variables, who)
    where = () if path is None else _parts(path, who)
    if variable_axes is None:
        variable_axes = {True: 0}
    if not isinstance(variable_axes, Mapping):
        raise TypeError(
            f"{who}: `variable_axes` must be the mapping given to `nn.scan` (e.g. "
            f"{{'params': 0}}), got {type(variable_axes).__name__} {variable_axes!r}."
        )
    p_scan, p_layer = _params(scan_axis_name), _params(layer_axis_name)
    out, moved_any = {}, False
    for col, tree in variables.items():
        axis = _axis_for(variable_axes, col)
        sub = _get(tree, where) if where else tree
        if axis is None or sub is None or sub == {}:
            out[col] = tree
            continue
        moved_any = True
        src, dst = (axis, 0) if to_stack else (0, axis)
        p_src, p_dst = (p_scan, p_layer) if to_stack else (p_layer, p_scan)

        def move(path, b, src=src, dst=dst, p_src=p_src, p_dst=p_dst, col=col):
            if jnp.ndim(_value(b)) <= src:
                raise ValueError(
                    f"{who}: variable {_show(col, where)}{jax.tree_util.keystr(path)} has "
                    f"shape {jnp.shape(_value(b))}, without the layer axis {src}."
                )
            if not _box(b):
                return jnp.moveaxis(b, src, dst)
            names = getattr(b, "names", None)
            expected = p_src[nn.PARTITION_NAME]
            if names is not None and (len(names) <= src or names[src] != expected):
                fix = "`scan_axis_name`" if to_stack else "`layer_axis_name`"
                raise ValueError(
                    f"{who}: variable `{col}{jax.tree_util.keystr(path)}` "
                    f"is partitioned as {tuple(names)}, whose axis {src} should be named "
                    f"{expected!r}; pass the name it was given as {fix}."
                )
            moved = b.replace_boxed(jnp.moveaxis(_value(b), src, dst))
            return moved.remove_axis(src, p_src).add_axis(dst, p_dst)

        moved = jax.tree_util.tree_map_with_path(move, sub, is_leaf=_box)
        if where:
            tree = dict(tree)
            _copy_to(tree, where[:-1])[where[-1]] = moved
            out[col] = tree
        else:
            out[col] = moved
    if not moved_any:
        cols = sorted(variables)
        raise ValueError(
            f"{who}: nothing to convert: no collection matched by `variable_axes` "
            f"({dict(variable_axes)}) holds {'/'.join(where) or 'variables'!r}; the "
            f"collections are {cols}"
            + (f" with {[sorted(t) for t in variables.values()]}" if where else "")
            + ". Check `path`."
        )
    return out


def from_scan(
    variables: Mapping[str, Any],
    path: Path | None = None,
    *,
    variable_axes: Mapping[Any, Any] | None = None,
    scan_axis_name: str | None = None,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """Variables of an ``nn.scan`` of the block in a Stack's layout, in every collection.

    ``nn.scan(Block, variable_axes={True: 0}, ...)`` stores each collection
    with the layer axis first, which is the Stack's layout: with that setting
    and the same partition name the conversion is the identity. Other
    ``variable_axes`` (e.g. ``{"params": 1}``) and another
    ``metadata_params={nn.PARTITION_NAME: ...}`` name are moved and renamed.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> scanned = {"params": {"layers": {"w": jnp.zeros((5, 3, 2))}}}
    >>> v = stackwise.flax.from_scan(scanned, "layers", variable_axes={"params": 2})
    >>> v["params"]["layers"]["w"].shape
    (2, 5, 3)
    >>> back = stackwise.flax.to_scan(v, "layers", variable_axes={"params": 2})
    >>> back["params"]["layers"]["w"].shape
    (5, 3, 2)

    Args:
      variables: ``{collection: tree}``, all of a model's variables.
      path: where the scanned module's variables are in each collection
        (``None``: the whole collection, as from ``nn.scan(...)`` at top level).
      variable_axes: the ``variable_axes`` given to ``nn.scan`` (default
        ``{True: 0}``); collections it does not match are left as they are.
      scan_axis_name: ``nn.scan``'s ``metadata_params[nn.PARTITION_NAME]``.
      layer_axis_name: the Stack's ``layer_axis_name``.

    Returns:
      New variables (the input is not modified).

    Raises:
      ValueError: ``path`` in no collection that ``variable_axes`` matches, a
        collection broadcast by ``nn.scan`` (not stacked), or a partitioning
        whose scan axis has another name than ``scan_axis_name``.
    """
    return _move(
        variables,
        path,
        variable_axes,
        True,
        scan_axis_name,
        layer_axis_name,
        "stackwise.flax.from_scan",
    )


def to_scan(
    variables: Mapping[str, Any],
    path: Path | None = None,
    *,
    variable_axes: Mapping[Any, Any] | None = None,
    scan_axis_name: str | None = None,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """The inverse of :func:`from_scan`: a Stack's variables in ``nn.scan``'s layout.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> v = {"params": {"w": jnp.zeros((4, 3))}, "cache": {"k": jnp.zeros((4, 2))}}
    >>> s = stackwise.flax.to_scan(v, variable_axes={"params": 1, "cache": 0})
    >>> s["params"]["w"].shape, s["cache"]["k"].shape
    ((3, 4), (4, 2))

    Args and Returns: as :func:`from_scan`, the other way round.
    """
    return _move(
        variables,
        path,
        variable_axes,
        False,
        scan_axis_name,
        layer_axis_name,
        "stackwise.flax.to_scan",
    )


# --------------------------------------------------------------------------
# By creation order: one model's variables -> another's.


def _same_kind(a: nn.Module, b: nn.Module) -> bool:
    """Two blocks of one class and configuration (their fields but ``parent`` and ``name``)."""
    if type(a) is not type(b):
        return False
    for field in dataclasses.fields(a):
        if field.name in ("parent", "name"):
            continue
        x, y = getattr(a, field.name, None), getattr(b, field.name, None)
        try:
            if x is not y and not bool(x == y):
                return False
        except Exception:  # e.g. arrays: no single truth value
            return False
    return True


class _Pattern:
    """A pattern Stack, seen while ``init`` is traced.

    Each position's block runs as its own root, so its modules' paths are
    relative to it and say nothing of the position; and the core may trace
    the positions in any order (``reverse=True`` runs the last first). A
    block's run is told apart by the block itself: a root module of one
    position's class and configuration. Positions of one kind (``[Local,
    Local, Global]``) build the same modules, so one trace serves them all.
    """

    def __init__(self, stack: Any, rank: tuple, who: str):
        from stackwise.flax._stack import _fresh_block, _position_names

        blocks = list(stack.block)
        self.names = _position_names(blocks)
        self.fresh = [_fresh_block(b, who) for b in blocks]
        self.kinds = [
            next(q for q in range(p + 1) if _same_kind(self.fresh[q], self.fresh[p]))
            for p in range(len(blocks))
        ]
        self.rank, self.who = rank, who
        self.traces: dict[int, dict[tuple, list]] = {}  # kind -> module path -> [rank, class]

    def kind(self, module: nn.Module, where: str) -> int:
        for q, fresh in enumerate(self.fresh):
            if _same_kind(module, fresh):
                return self.kinds[q]
        raise ValueError(
            f"{self.who}: the pattern Stack at {where} ran a block "
            f"({type(module).__name__}) that is none of its positions' blocks "
            f"({', '.join(self.names)}), so its variables cannot be placed."
        )

    def record(self, kind: int, path: tuple, cls: str) -> None:
        trace = self.traces.setdefault(kind, {})
        trace.setdefault(path, [len(trace), cls])

    def modules(self, stack: tuple, side: str) -> dict[tuple, list]:
        """Every position's modules, as :class:`_Model` records them."""
        out = {}
        for p, name in enumerate(self.names):
            trace = self.traces.get(self.kinds[p])
            if trace is None:
                raise ValueError(
                    f"{self.who}: the {side} model's pattern Stack at {'/'.join(stack)} did "
                    f"not run position {p} ({name}) while init was traced."
                )
            root = stack + (name,)
            for rel, (rank, cls) in trace.items():
                out[root + rel] = [self.rank + (p, rank), cls, stack, root, p, len(self.names)]
        return out


class _Model:
    """A model's variables as :class:`stackwise._convert.Leaf` s, in creation order.

    ``init`` is traced (``jax.eval_shape``: shapes only) under
    ``nn.intercept_methods``, which sees every module's first call in order,
    also the block's modules inside a :class:`stackwise.flax.Stack` (whose
    block runs as its own root, so its modules' paths are relative to the
    Stack's, or to a pattern position's: see :class:`_Pattern`). A variable
    belongs to the innermost module on its path; the variables are ordered by
    their module's first call (a pattern's position by position), then by
    name.
    """

    def __init__(self, model: Any, side: str, args: tuple, kwargs: dict, who: str):
        from stackwise.flax._stack import Stack  # the adapter's module type

        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{who}: the {side} model must be a linen `nn.Module` (unbound, as you "
                f"call `.init` on it), got {type(model).__name__} {model!r}."
            )
        self.side, self.who = side, who
        # path -> [rank, class, stack path or None, the layer's root path or None,
        #          pattern position, pattern length]
        modules: dict[tuple, list] = {}
        patterns: dict[tuple, _Pattern] = {}
        prefix: list[tuple] = [()]
        stacks: list[list] = []  # [stack path, _Pattern or None, the kind running or None]

        def interceptor(f, a, kw, context):
            m = context.module
            if m.scope is None:
                return f(*a, **kw)
            path = prefix[-1] + tuple(m.path)
            cls = type(m).__name__
            if isinstance(m, Stack) and context.method_name != "__call__":
                return f(*a, **kw)  # the Stack's helpers, not a layer's call
            if isinstance(m, Stack):
                if stacks:
                    raise ValueError(
                        f"{who}: the {side} model nests a Stack in a Stack's block at "
                        f"{'/'.join(path)}; convert nested stacks by name with "
                        "`from_loop` / `to_loop`."
                    )
                entry = modules.setdefault(path, [(len(modules),), None, path, path, 0, 1])
                pattern = None
                if isinstance(m.block, (list, tuple)):
                    pattern = patterns.setdefault(path, _Pattern(m, entry[0], who))
                prefix.append(path)
                stacks.append([path, pattern, None])
                try:
                    return f(*a, **kw)
                finally:
                    prefix.pop()
                    stacks.pop()
            if not stacks:
                modules.setdefault(path, [(len(modules),), cls, None, None, 0, 1])
                return f(*a, **kw)
            stack, pattern, running = stacks[-1]
            if pattern is None:
                entry = modules.setdefault(path, [(len(modules),), cls, stack, stack, 0, 1])
                if entry[1] is None:  # the block's root, at the Stack's path
                    entry[1] = cls
                return f(*a, **kw)
            if running is not None:
                pattern.record(running, tuple(m.path), cls)
                return f(*a, **kw)
            stacks[-1][2] = pattern.kind(m, "/".join(stack))  # a position's block starts
            try:
                pattern.record(stacks[-1][2], tuple(m.path), cls)
                return f(*a, **kw)
            finally:
                stacks[-1][2] = None

        def traced():
            with nn.intercept_methods(interceptor):
                return model.init(jax.random.key(0), *args, **kwargs)

        self.shapes = _variables(jax.eval_shape(traced), who)
        for stack, pattern in patterns.items():
            modules.update(pattern.modules(stack, side))
        self.paths: dict[str, list[tuple]] = {}  # per collection, in the leaves' order
        self.leaves = {col: self._leaves(col, modules) for col in self.shapes}

    def _leaves(self, col: str, modules: dict) -> list[_convert.Leaf]:
        ranked = []
        for path, struct in jax.tree_util.tree_leaves_with_path(self.shapes[col], is_leaf=_box):
            keys = tuple(getattr(k, "key", k) for k in path)
            owner = next((keys[:j] for j in range(len(keys), -1, -1) if keys[:j] in modules), ())
            rank, cls, group, root, p, k = modules.get(owner, [(-1,), "", None, None, 0, 1])
            start = 0 if root is None else len(root)
            scope = tuple(
                modules[keys[:j]][1]
                for j in range(start, len(owner) + 1)
                if keys[:j] in modules and modules[keys[:j]][1]
            )
            value = _value(struct)
            shape, depth = tuple(value.shape), 0
            names = getattr(struct, "names", None)
            if group is not None:
                if not shape:
                    raise ValueError(
                        f"{self.who}: the {self.side} model's {_show(col, keys)} is a scalar "
                        "inside a Stack."
                    )
                depth, shape = shape[0], shape[1:]
                names = None if names is None else tuple(names)[1:]
            extra = None if names is None else ("partitioned", tuple(names))
            name = _show(col, keys)
            key = "/".join(keys[len(owner) :])
            leaf = _convert.Leaf(
                name, cls or "", key, shape, value.dtype, depth, group, extra, scope, p, k
            )
            ranked.append(((rank, keys[len(owner) :]), keys, leaf))
        ranked.sort(key=lambda t: t[0])
        self.paths[col] = [keys for _, keys, _ in ranked]
        return [leaf for _, _, leaf in ranked]

    def check(self, variables: dict) -> None:
        want = {
            _show(col, tuple(getattr(k, "key", k) for k in p)): _value(s)
            for col, tree in self.shapes.items()
            for p, s in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_box)
        }
        have = {
            _show(col, tuple(getattr(k, "key", k) for k in p)): _value(a)
            for col, tree in variables.items()
            for p, a in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_box)
        }
        bad = [f"  missing: {name}" for name in sorted(set(want) - set(have))]
        bad += [f"  not in the model: {name}" for name in sorted(set(have) - set(want))]
        bad += [
            f"  {name}: {_convert.describe(have[name])}, the model has "
            f"{_convert.describe(want[name])}"
            for name in sorted(set(want) & set(have))
            if tuple(jnp.shape(have[name])) != tuple(want[name].shape)
            or jnp.result_type(have[name]) != want[name].dtype
        ]
        if bad:
            raise ValueError(
                f"{self.who}: the variables given are not those of the {self.side} model "
                f"(its init with the arguments given):\n" + "\n".join(bad[:20])
            )


def convert(
    variables: Mapping[str, Any], source: nn.Module, target: nn.Module, *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """One model's variables in the layout of another, matched in creation order.

    Porting a model onto a :class:`Stack` keeps its blocks but moves their
    variables: the loop's ``encoderdecoderblock_0``, ``encoderdecoderblock_1``,
    ... (or, for a loop body that builds modules in the parent, ``Dense_{2i}``,
    ``Dense_{2i+1}``, ... across the loop) become the Stack's stacked
    variables. ``convert`` traces both models' ``init`` (shapes only, with
    :func:`jax.eval_shape`) under ``nn.intercept_methods``, orders every
    variable by the first call of the module that holds it, and moves the
    k-th variable of the source to the k-th of the target, layer by layer
    inside a Stack. It works both ways (loop → Stack, Stack → loop) in every
    collection.

    >>> import flax.linen as nn, jax, jax.numpy as jnp, stackwise.flax
    >>> class Body(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dense(4)(nn.LayerNorm()(x))
    >>> class Loop(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for _ in range(3):
    ...             x = x + nn.Dense(4)(nn.LayerNorm()(x))
    ...         return nn.LayerNorm()(x)
    >>> class Port(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.LayerNorm()(stackwise.flax.Stack(Body, 3, name="layers")(x))
    >>> x = jnp.ones((2, 4))
    >>> loop_vars = Loop().init(jax.random.key(0), x)
    >>> sorted(loop_vars["params"])
    ['Dense_0', 'Dense_1', 'Dense_2', 'LayerNorm_0', 'LayerNorm_1', 'LayerNorm_2', 'LayerNorm_3']
    >>> variables = stackwise.flax.convert(loop_vars, Loop(), Port(), x)
    >>> variables["params"]["layers"]["Dense_0"]["kernel"].shape
    (3, 4, 4)
    >>> bool(jnp.allclose(Port().apply(variables, x), Loop().apply(loop_vars, x), atol=1e-6))
    True
    >>> back = stackwise.flax.convert(variables, Port(), Loop(), x)
    >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, loop_vars))
    True

    The two models must correspond one to one: as many variables in each
    collection, each pair held by modules of one class under one name, of one
    shape, dtype and (one layer's) partitioning. Otherwise nothing is moved
    and the error shows the first variables that differ. Variables of one
    class and shape created in another order in the port cannot be told
    apart: port the loop's body unchanged.

    A pattern Stack (``Stack([Local, Local, Global], n)``) takes the loop's
    layer i into position ``i % k``, whatever order it runs its positions in;
    a loop layer of another position's kind of block (its class among the
    modules around the variable) is refused, even with alike variables.

    Args:
      variables: the source model's variables, ``{collection: tree}`` (with
        or without partitioning boxes; the result has them if these do).
      source: the model the variables belong to (an unbound ``nn.Module``).
      target: the model to convert to.
      *args: example arguments of both models' ``init`` (after the key);
        only their shapes and dtypes matter.
      **kwargs: keyword arguments of both models' ``init``.

    Returns:
      The target's variables; every array is the source's, bitwise (stacked
      or sliced).

    Raises:
      ValueError: the variables are not the source's (the differing ones
        are listed), or the models do not correspond one to one (the first
        difference is shown).
      TypeError: a model that is not an ``nn.Module``.
    """
    who = "stackwise.flax.convert"
    variables = _variables(variables, who)
    src = _Model(source, "source", args, kwargs, who)
    tgt = _Model(target, "target", args, kwargs, who)
    src.check(variables)
    if sorted(src.shapes) != sorted(tgt.shapes):
        raise ValueError(
            f"{who}: the source model has collections {sorted(src.shapes)} but the target "
            f"{sorted(tgt.shapes)}."
        )
    boxed = any(_box(b) for b in jax.tree.leaves(variables, is_leaf=_box))
    hint = "Models whose modules differ convert by name with `from_loop` / `to_loop`."
    out: dict[str, Any] = {}
    for col in tgt.shapes:
        sources = _convert.correspond(src.leaves[col], tgt.leaves[col], f"{who} ({col})", hint)
        values = [_value(_get(variables[col], keys)) for keys in src.paths[col]]
        tree: dict = {}
        templates = dict(
            (tuple(getattr(k, "key", k) for k in p), s)
            for p, s in jax.tree_util.tree_leaves_with_path(tgt.shapes[col], is_leaf=_box)
        )
        for keys, value in zip(tgt.paths[col], _convert.assemble(tgt.leaves[col], sources, values)):
            template = templates[keys]
            if boxed and _box(template):
                value = template.replace_boxed(value)
            _put(tree, keys, value, col, who)
        out[col] = tree
    return out
