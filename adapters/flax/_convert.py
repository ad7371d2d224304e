"""Exact conversions by name between a linen Stack's variables and other layouts.

- :func:`from_loop` / :func:`to_loop`: a Python loop of blocks (``layers_0``,
  ``layers_1``, ... or any naming, with a pattern of k blocks too), found by
  name;
- :func:`from_scan` / :func:`to_scan`: ``nn.scan`` (any ``variable_axes``,
  any ``metadata_params`` partition name).

:func:`stackwise.flax.convert`, which matches two whole models variable by
variable in the order their modules are first called, is in
``_correspond.py``; it shares the variables-dict helpers :func:`variables_dict`,
:func:`get`, :func:`put` and :func:`show` with this module.

Every collection is converted; partitioning boxes (``nn.Partitioned``,
``nn.LogicallyPartitioned``) keep their metadata with the layer axis added or
removed (``_boxes.py``). Every function moves every leaf exactly (bitwise,
dtype kept) or raises naming the variable, the layer and the fix; none
overwrites an entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import in_filter

from stackwise import _kit
from stackwise.flax import _boxes

__all__ = [
    "from_loop",
    "from_scan",
    "get",
    "put",
    "refuse_served",
    "show",
    "to_loop",
    "to_scan",
    "variables_dict",
]

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
        _kit.check_distinct(["/".join(p) for p in paths], who)
        return paths
    return [_parts(path, who)]


def _parent(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """Where a loop's layers are named: next to the Stack (the positions' common parent)."""
    if len(paths) == 1:
        return paths[0][:-1]
    return _kit.common_prefix(paths)[:-1]


def show(col: str, path: tuple) -> str:
    return f"{col}/{'/'.join(map(str, path))}"


def get(tree: Any, path: tuple) -> Any:
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
        if get(tree, path[:k]) == {}:
            _copy_to(tree, path[: k - 1]).pop(path[k - 1])
    return value


def put(tree: dict, path: tuple, value: Any, col: str, who: str) -> None:
    """Sets ``tree[path] = value``; never over an existing entry."""
    node = tree
    for k, p in enumerate(path[:-1]):
        if p in node and not isinstance(node[p], Mapping):
            raise ValueError(
                f"{who}: {show(col, path[: k + 1])} exists and is not a module, so "
                f"{show(col, path)} cannot be put under it; choose other names."
            )
        node = node.get(p, {})
    if get(tree, path) is not None:
        raise ValueError(
            f"{who}: {show(col, path)} already exists; stackwise never overwrites an "
            "entry. Remove it first, or convert to another path or names."
        )
    _copy_to(tree, path[:-1])[path[-1]] = value


def variables_dict(variables: Any, who: str, served: bool = False) -> dict[str, dict]:
    """``variables`` as a dict of dicts, checked; ``served``: may hold served leaves."""
    if not isinstance(variables, Mapping) or not all(
        isinstance(v, Mapping) for v in variables.values()
    ):
        raise TypeError(
            f"{who}: `variables` must be a linen variables dict, "
            f"`{{collection: {{name: ...}}}}` as `init` returns it, got "
            f"{type(variables).__name__}."
        )
    out = {col: dict(tree) for col, tree in variables.items()}
    if not served:
        refuse_served(out, who, "variables")
    return out


def refuse_served(tree: Any, who: str, what: str) -> None:
    """Refuses a tree holding a leaf in the serving layout where stacked ones go."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_kit.serving.is_serving)
    for path, leaf in flat:
        if _kit.serving.is_serving(leaf):
            raise TypeError(
                f"{who}: `{what}{jax.tree_util.keystr(path)}` is in the serving layout (a "
                f"`stackwise.Serving`), but {who} takes a Stack's stacked {what}. Stack "
                "them back first: `stackwise.flax.from_serving(variables, path)`."
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
    variables = variables_dict(variables, who)
    paths = _paths(path, who)
    parent = _parent(paths)
    n = _kit.check_n(n, who)
    name_of = _kit.layer_names(names, who, example="'layers_{}'")

    def exists(i: int) -> bool:
        try:
            where = _layer_path(name_of, parent, i, who)
        except (IndexError, KeyError):
            return False
        return any(get(tree, where) is not None for tree in variables.values())

    bound = sum(len(jax.tree.leaves(t, is_leaf=_boxes.is_box)) for t in variables.values())
    fixed = len(names) if isinstance(names, (list, tuple)) else None
    label = lambda i: repr("/".join(_layer_path(name_of, parent, i, who)))  # noqa: E731
    k = len(paths)
    n = _kit.find_depth(exists, label, n, bound, who, fixed=fixed, pattern=k)
    layer_paths = [_layer_path(name_of, parent, i, who) for i in range(n)]
    _kit.check_distinct(["/".join(p) for p in layer_paths], who)
    p_layer = _boxes.partition(layer_axis_name)
    out = {}
    for col, tree in variables.items():
        for q, where in enumerate(paths):
            present = [i for i in range(q, n, k) if get(tree, layer_paths[i]) is not None]
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
            _boxes.check_same_boxes(own, col, lab, who)
            values = _kit.stack_exact(
                [_boxes.unbox(layer) for layer in own],
                who,
                label=lab,
                leaf_name=lambda s, col=col, where=where: show(col, where) + s,
            )
            stacked = _boxes.rebox(own[0], values, lambda b: b.add_axis(0, p_layer))
            put(tree, where, stacked, col, who)
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
    variables = variables_dict(variables, who)
    paths = _paths(path, who)
    parent = _parent(paths)
    name_of = _kit.layer_names(names, who, example="'layers_{}'")
    if all(get(t, p) is None for t in variables.values() for p in paths):
        where = " or ".join(repr("/".join(p)) for p in paths)
        have = {col: sorted(t) for col, t in variables.items()}
        raise ValueError(f"{who}: no collection has {where}; the variables have {have}.")
    p_layer = _boxes.partition(layer_axis_name)
    k = len(paths)
    # A pattern's Stack: nothing else may stay there.
    stack = _kit.common_prefix(paths) if k > 1 else ()
    out, positions = {}, {}  # collection -> position -> its layers
    for col, tree in variables.items():
        out[col] = tree
        for q, where in enumerate(paths):
            if get(tree, where) is None:
                continue  # with a pattern: this collection has nothing of this kind
            stacked = _pop(tree, where)
            wrong = _boxes.wrong_layer_axis(stacked, layer_axis_name)
            if wrong is not None:
                at, axes = wrong
                raise ValueError(
                    f"{who}: variable {show(col, where)}{jax.tree_util.keystr(at)} is "
                    f"partitioned as {axes}, whose first (layer) axis should be named "
                    f"{layer_axis_name!r}; pass the Stack's "
                    f"`layer_axis_name={axes[0] if axes else None!r}`."
                )
            values = _boxes.unbox(stacked)
            depth = _kit.depth_of(values, who, f"variables at {show(col, where)}")
            layers = _kit.unstack_exact(values, depth)
            positions.setdefault(col, {})[q] = [
                _boxes.rebox(stacked, v, lambda b: b.remove_axis(0, p_layer)) for v in layers
            ]
        left = get(tree, stack) if stack else None
        if left:
            raise ValueError(
                f"{who}: {show(col, stack)} holds {sorted(left)} besides the pattern's "
                f"positions {['/'.join(p) for p in paths]}; they would be left behind, "
                "stacked. Check `path` (each position's path, in the pattern's order)."
            )
    depths: dict[int, int] = {}
    for col, held in positions.items():
        for q, layers in held.items():
            if depths.setdefault(q, len(layers)) != len(layers):
                raise ValueError(
                    f"{who}: {show(col, paths[q])} holds {len(layers)} layers but another "
                    f"collection holds {depths[q]} there; every collection of a block has "
                    "one layer axis."
                )
    span = _kit.pattern_depths(depths, k, who)
    _kit.check_names_count(names, span, who, "the stacked variables hold")
    indices = sorted({q + j * k for q, d in depths.items() for j in range(d)})
    layer_paths = {i: _layer_path(name_of, parent, i, who) for i in indices}
    _kit.check_distinct(["/".join(p) for p in layer_paths.values()], who)
    for col, held in positions.items():
        for q, layers in held.items():
            for j, layer in enumerate(layers):
                put(out[col], layer_paths[q + j * k], layer, col, who)
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
    variables = variables_dict(variables, who)
    where = () if path is None else _parts(path, who)
    if variable_axes is None:
        variable_axes = {True: 0}
    if not isinstance(variable_axes, Mapping):
        raise TypeError(
            f"{who}: `variable_axes` must be the mapping given to `nn.scan` (e.g. "
            f"{{'params': 0}}), got {type(variable_axes).__name__} {variable_axes!r}."
        )
    p_scan, p_layer = _boxes.partition(scan_axis_name), _boxes.partition(layer_axis_name)
    out, moved_any = {}, False
    for col, tree in variables.items():
        axis = _axis_for(variable_axes, col)
        sub = get(tree, where) if where else tree
        if axis is None or sub is None or sub == {}:
            out[col] = tree
            continue
        moved_any = True
        src, dst = (axis, 0) if to_stack else (0, axis)
        p_src, p_dst = (p_scan, p_layer) if to_stack else (p_layer, p_scan)

        def move(path, b, src=src, dst=dst, p_src=p_src, p_dst=p_dst, col=col):
            if jnp.ndim(_boxes.value(b)) <= src:
                raise ValueError(
                    f"{who}: variable {show(col, where)}{jax.tree_util.keystr(path)} has "
                    f"shape {jnp.shape(_boxes.value(b))}, without the layer axis {src}."
                )
            if not _boxes.is_box(b):
                return _kit.moveaxis(b, src, dst)
            names = getattr(b, "names", None)
            expected = p_src[nn.PARTITION_NAME]
            if names is not None and (len(names) <= src or names[src] != expected):
                fix = "`scan_axis_name`" if to_stack else "`layer_axis_name`"
                raise ValueError(
                    f"{who}: variable `{col}{jax.tree_util.keystr(path)}` "
                    f"is partitioned as {tuple(names)}, whose axis {src} should be named "
                    f"{expected!r}; pass the name it was given as {fix}."
                )
            moved = b.replace_boxed(_kit.moveaxis(_boxes.value(b), src, dst))
            return moved.remove_axis(src, p_src).add_axis(dst, p_dst)

        moved = jax.tree_util.tree_map_with_path(move, sub, is_leaf=_boxes.is_box)
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
