"""Exact conversions by name between Haiku params/state layouts.

Three layouts hold the same numbers: a Python loop of ``n`` separately named
blocks (``block``, ``block_1``, ...), :class:`stackwise.haiku.Stack`
(``stack/block`` with a leading axis ``n``) and ``hk.layer_stack``
(``__layer_stack_no_per_layer/block`` with a leading axis ``n``).

- :func:`from_loop` / :func:`to_loop` move the loop's modules, found by name,
  into a Stack's layout and back (with a pattern of k blocks too);
- :func:`from_layer_stack` / :func:`to_layer_stack` rename ``hk.layer_stack``'s
  prefix.

:func:`stackwise.haiku.convert`, which matches two whole models leaf by leaf
in the order Haiku creates them, is in ``_correspond.py``; it shares
:func:`check_tree` with this module.

Every function moves every leaf exactly (bitwise, dtype kept) or raises
naming the module, the layer and the fix; none overwrites an entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stackwise import _kit

__all__ = [
    "check_paths",
    "check_tree",
    "from_layer_stack",
    "from_loop",
    "positions_of",
    "refuse_served",
    "to_layer_stack",
    "to_loop",
]

Tree = Mapping[str, Mapping[str, Any]]
Names = str | Sequence[str] | Callable[[int], str]


# --------------------------------------------------------------------------
# Module names.


def _haiku_name(name: str, i: int) -> str:
    """How Haiku names the i-th module built with one name: ``block``, ``block_1``, ..."""
    return name if i == 0 else f"{name}_{i}"


def _inside(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


def _split(tree: Tree, prefix: str) -> tuple[dict, dict]:
    """``(inside, outside)``: entries under module ``prefix`` (keyed by the rest of
    their name, e.g. ``""`` or ``"/linear"``) and all others."""
    inside, outside = {}, {}
    for key, bundle in tree.items():
        if _inside(key, prefix):
            inside[key[len(prefix) :]] = bundle
        else:
            outside[key] = bundle
    return inside, outside


def _modules(tree: Tree) -> str:
    names = sorted(tree)
    shown = ", ".join(repr(k) for k in names[:12])
    return (shown + (f", ... ({len(names)} modules)" if len(names) > 12 else "")) or "none"


def check_tree(tree: Any, who: str) -> None:
    """Raises a TypeError unless ``tree`` is a Haiku params or state dict."""
    if not isinstance(tree, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) for k, v in tree.items()
    ):
        raise TypeError(
            f"{who}: `tree` must be a Haiku params or state dict, "
            f"`{{module_name: {{name: array}}}}`, got {type(tree).__name__}."
        )


def refuse_served(tree: Tree, who: str, under: Sequence[str] | None = None) -> None:
    """Refuses a leaf in the serving layout (a ``stackwise.Serving``) where stacked or loop
    params and state go (in the modules ``under`` those names; all by default), naming it
    and the way back."""
    for module, bundle in tree.items():
        if under is not None and not any(_inside(module, name) for name in under):
            continue
        for name, value in bundle.items():
            if _kit.serving.served(value):
                raise TypeError(
                    f"{who}: `tree[{module!r}][{name!r}]` is in the serving layout (a "
                    f"`stackwise.Serving` of per-layer arrays), but {who} converts stacked "
                    "params and state. Stack the Stack's leaves back first: "
                    "`stackwise.haiku.from_serving(tree, path)` (`path` as given to "
                    "`stackwise.haiku.to_serving`)."
                )


def check_paths(path: Any, who: str) -> list[str]:
    """The stacked module name(s): one, or one per position of a pattern."""
    paths = [path] if isinstance(path, str) else path
    if (
        not isinstance(paths, (list, tuple))
        or not paths
        or not all(isinstance(p, str) and p for p in paths)
    ):
        raise TypeError(
            f"{who}: `path` must be the stacked block's module name (e.g. 'stack/block') "
            "or, for a pattern of k blocks, a list of the k positions' names (e.g. "
            f"['stack/local', 'stack/local_1', 'stack/global']), got {path!r}."
        )
    _kit.check_distinct(list(paths), who)
    return list(paths)


def _merge(outside: dict, new: dict, who: str) -> dict:
    clash = sorted(set(outside) & set(new))
    if clash:
        raise ValueError(
            f"{who}: the converted modules {clash} already exist in the tree; stackwise "
            "never overwrites an entry. Remove them first, or choose other names."
        )
    return {**outside, **new}


def _flat(inside: dict) -> dict[str, Any]:
    """``{"/linear": {"w": a}}`` -> ``{"/linear/w": a}`` (one layer's leaves)."""
    return {f"{rest}/{name}": v for rest, bundle in inside.items() for name, v in bundle.items()}


def _nested(flat: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        rest, name = key.rsplit("/", 1)
        out.setdefault(prefix + rest, {})[name] = value
    return out


def _leaf_name(prefix: str) -> Callable[[str], str]:
    """A ``keystr`` path of a :func:`_flat` dict as a Haiku leaf name under ``prefix``."""
    return lambda path: prefix + path[2:-2]


# --------------------------------------------------------------------------
# By name: a loop's modules <-> a Stack's.


def from_loop(
    tree: Tree,
    path: str | Sequence[str],
    names: Names,
    *,
    n: int | None = None,
) -> dict[str, dict[str, Any]]:
    """A Python loop's params or state → a :class:`Stack`'s (stacked), exactly.

    Layer i's modules ``names[i] + rest`` are stacked along a new leading
    axis into ``path + rest``; other modules are kept as they are. The inverse
    of :func:`to_loop`.

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> def loop(x):
    ...     for _ in range(3):
    ...         x = x + hk.Linear(4)(x)
    ...     return x
    >>> loop = hk.transform(loop)
    >>> loop_params = loop.init(jax.random.key(0), jnp.ones(4))
    >>> sorted(loop_params)
    ['linear', 'linear_1', 'linear_2']
    >>> params = stackwise.haiku.from_loop(loop_params, "stack/linear", "linear")
    >>> jax.tree.map(jnp.shape, params)
    {'stack/linear': {'b': (3, 4), 'w': (3, 4, 4)}}
    >>> stacked = hk.transform(lambda x: stackwise.haiku.Stack(lambda x: x + hk.Linear(4)(x), 3)(x))
    >>> bool(jnp.allclose(stacked.apply(params, None, jnp.ones(4)),
    ...                   loop.apply(loop_params, None, jnp.ones(4))))
    True

    The loop's layers are found by name, all of them: a gap (``linear``,
    ``linear_2`` without ``linear_1``) or more layers than ``n`` is an error
    that says what it found, never a shallower model.

    Args:
      tree: a Haiku params or state dict, ``{module_name: {name: value}}``.
      path: the block's module name in the stacked model, e.g.
        ``"stack/block"`` or ``"model/~/stack/block"`` (``"stack/linear"``
        for a function block whose one module is an ``hk.Linear``). For a
        pattern of k blocks, the list of the k positions' names, e.g.
        ``["stack/local_block", "stack/local_block_1", "stack/global_block"]``:
        layer i goes to position ``i % k``.
      names: the loop's module names: a name expanded as Haiku names repeated
        modules (``"block"`` → ``block``, ``block_1``, ...), a format string
        (``"layer_{}"``), a function of the layer index, or a list of n names.
      n: the number of layers; by default all layers found (a list of names
        gives its length).

    Returns:
      A new dict in the stacked layout (the input is not modified).

    Raises:
      ValueError: no layer found, a gap, more layers than ``n``, two layers
        of one name, layers whose modules or shapes differ, or converted names
        that already exist.
      TypeError: a leaf whose dtype differs between layers (never promoted),
        or a bad argument.
    """
    who = "stackwise.haiku.from_loop"
    check_tree(tree, who)
    paths = check_paths(path, who)
    n = _kit.check_n(n, who)
    name_of = _kit.layer_names(names, who, plain=_haiku_name, example="'block'")

    def exists(i: int) -> bool:
        try:
            name = name_of(i)
        except (IndexError, KeyError):
            return False
        return any(_inside(key, name) for key in tree)

    fixed = len(names) if isinstance(names, (list, tuple)) else None
    k = len(paths)
    label = lambda i: repr(name_of(i))  # noqa: E731
    n = _kit.find_depth(exists, label, n, len(tree), who, fixed=fixed, pattern=k)
    loop_names = [name_of(i) for i in range(n)]
    _kit.check_distinct(loop_names, who)
    refuse_served(tree, who, loop_names)
    per_layer, outside = [], dict(tree)
    for name in loop_names:
        inside, outside = _split(outside, name)
        per_layer.append(_flat(inside))
    new: dict[str, dict[str, Any]] = {}
    for p, prefix in enumerate(paths):
        if p >= n or not per_layer[p]:
            continue  # a kind of block with nothing in this tree (e.g. no state)
        stacked = _kit.stack_exact(
            per_layer[p::k],
            who,
            label=lambda j, p=p: f"layer {p + j * k} ({loop_names[p + j * k]!r})",
            leaf_name=_leaf_name(prefix),
        )
        new.update(_nested(stacked, prefix))
    return _merge(outside, new, who)


def to_loop(tree: Tree, path: str | Sequence[str], names: Names) -> dict[str, dict[str, Any]]:
    """A :class:`Stack`'s (or ``hk.layer_stack``'s) params or state → a Python loop's, exactly.

    Every module under ``path`` is sliced along its leading axis into ``n``
    modules: layer i's ``path + rest`` becomes ``names[i] + rest``. Other
    modules are kept as they are. The inverse of :func:`from_loop`.

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> stacked = {"stack/block/linear": {"w": jnp.zeros((3, 4, 4))}, "head": {"b": jnp.ones(2)}}
    >>> loop = stackwise.haiku.to_loop(stacked, "stack/block", "block")
    >>> {k: v["w" if "w" in v else "b"].shape for k, v in loop.items()}
    {'head': (2,), 'block/linear': (4, 4), 'block_1/linear': (4, 4), 'block_2/linear': (4, 4)}

    Args:
      tree: a Haiku params or state dict.
      path: the stacked block's module name, e.g. ``"stack/block"`` (a Stack)
        or ``"__layer_stack_no_per_layer/block"`` (``hk.layer_stack``); for a
        pattern, the list of the k positions' names.
      names: the loop's module names, as for :func:`from_loop`; the depth
        comes from the leaves' leading axis.

    Returns:
      A new dict in the loop's layout.

    Raises:
      ValueError: nothing under ``path``, leaves without a common leading
        axis (listed), a list of names of another length, two layers of one
        name, or converted names that already exist.
    """
    who = "stackwise.haiku.to_loop"
    check_tree(tree, who)
    paths = check_paths(path, who)
    k = len(paths)
    found, outside = positions_of(tree, paths, who)
    refuse_served(tree, who, paths)
    positions = {}
    for p, inside in enumerate(found):
        if not inside:
            continue  # with a pattern: a kind of block with nothing in this tree
        flat = _flat(inside)
        depth = _kit.depth_of(
            flat, who, f"modules under {paths[p]!r}", leaf_name=_leaf_name(paths[p])
        )
        positions[p] = _kit.unstack_exact(flat, depth)
    span = _kit.pattern_depths({p: len(v) for p, v in positions.items()}, k, who)
    name_of = _kit.layer_names(names, who, plain=_haiku_name, example="'block'")
    _kit.check_names_count(names, span, who, "the stacked leaves hold")
    layers = sorted((p + j * k, p, j) for p, v in positions.items() for j in range(len(v)))
    loop_names = [name_of(i) for i, _, _ in layers]
    _kit.check_distinct(loop_names, who)
    # Layers' modules never clash: each is its layer's name plus "" or "/...", and
    # check_distinct refused a name equal to another or lying inside it.
    new: dict[str, dict[str, Any]] = {}
    for (_, p, j), name in zip(layers, loop_names):
        new.update(_nested(positions[p][j], name))
    return _merge(outside, new, who)


def positions_of(tree: Tree, paths: list[str], who: str) -> tuple[list[dict], dict]:
    """``(inside, outside)``: each position's modules (keyed by the rest of their name
    below it, as :func:`_split`) and all others, checked: something lies under one of
    ``paths``, and with a pattern nothing else lies under its Stack."""
    outside, found = dict(tree), []
    for prefix in paths:
        inside, outside = _split(outside, prefix)
        found.append(inside)
    if not any(found):
        where = " or ".join(repr(prefix) for prefix in paths)
        raise ValueError(
            f"{who}: no module named {where} or under it; the tree has {_modules(tree)}."
        )
    if len(paths) > 1:
        _check_none_left(outside, paths, who)
    return found, outside


def _check_none_left(outside: Tree, paths: list[str], who: str) -> None:
    """A pattern's positions are modules of one Stack: nothing else may stay under it."""
    stack = "/".join(_kit.common_prefix([p.split("/") for p in paths]))
    left = sorted(key for key in outside if stack and _inside(key, stack))
    if left:
        raise ValueError(
            f"{who}: {left[:3]} lie in the Stack {stack!r} but under none of the pattern's "
            f"positions {paths}; they would be left behind, stacked. Check `path` (each "
            "position's module name, in the pattern's order)."
        )


# --------------------------------------------------------------------------
# hk.layer_stack: the same stacked arrays under another prefix.


def _rename(tree: Tree, old: str, new: str, who: str) -> dict[str, dict[str, Any]]:
    check_tree(tree, who)
    refuse_served(tree, who, [old])
    inside, outside = _split(tree, old)
    if not inside:
        raise ValueError(
            f"{who}: no module named {old!r} or under it; the tree has {_modules(tree)}."
        )
    return _merge(outside, {new + rest: dict(b) for rest, b in inside.items()}, who)


def to_layer_stack(
    tree: Tree, path: str, layer_stack_name: str = "__layer_stack_no_per_layer"
) -> dict[str, dict[str, Any]]:
    """A :class:`Stack`'s params or state → ``hk.layer_stack``'s (same arrays, renamed).

    Both layouts stack every leaf along a leading axis ``n`` and keep the
    block's own module names; only the prefix differs. For
    ``hk.layer_stack(n)(lambda x: Block()(x))`` called where the Stack was,
    the block lives under ``"<scope>/__layer_stack_no_per_layer/block"``
    (``__layer_stack_with_per_layer`` with ``with_per_layer_inputs=True``, or
    the ``name`` given to ``hk.layer_stack``).

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> tree = {"stack/block/linear": {"w": jnp.zeros((3, 4, 4))}}
    >>> list(stackwise.haiku.to_layer_stack(tree, "stack"))
    ['__layer_stack_no_per_layer/block/linear']

    Args:
      tree: a Haiku params or state dict.
      path: the Stack's module name, e.g. ``"stack"`` or ``"model/~/stack"``.
      layer_stack_name: the ``hk.layer_stack``'s full name prefix.

    Returns:
      A new dict in ``hk.layer_stack``'s layout.

    Raises:
      ValueError: nothing under ``path``, or a renamed module that exists.
    """
    return _rename(tree, path, layer_stack_name, "stackwise.haiku.to_layer_stack")


def from_layer_stack(
    tree: Tree, path: str, layer_stack_name: str = "__layer_stack_no_per_layer"
) -> dict[str, dict[str, Any]]:
    """``hk.layer_stack``'s params or state → a :class:`Stack`'s; see :func:`to_layer_stack`.

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> tree = {"__layer_stack_no_per_layer/block/linear": {"w": jnp.zeros((3, 4, 4))}}
    >>> list(stackwise.haiku.from_layer_stack(tree, "stack"))
    ['stack/block/linear']

    Args and Returns: as :func:`to_layer_stack`, the other way round (a new
    dict in the Stack's layout).

    Raises:
      ValueError: nothing under ``layer_stack_name``, or a renamed module
        that exists.
    """
    return _rename(tree, layer_stack_name, path, "stackwise.haiku.from_layer_stack")
