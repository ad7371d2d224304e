"""Exact conversions between Haiku params/state layouts.

Three layouts hold the same numbers: a Python loop of ``n`` separately named
blocks (``block``, ``block_1``, ...), :class:`stackwise.haiku.Stack`
(``stack/block`` with a leading axis ``n``) and ``hk.layer_stack``
(``__layer_stack_no_per_layer/block`` with a leading axis ``n``).

- :func:`convert` maps a whole model's params or state onto another model's,
  leaf by leaf in the order Haiku creates them: an upstream loop model into
  its port onto a Stack, and back, in one call;
- :func:`from_loop` / :func:`to_loop` move the loop's modules, found by name,
  into a Stack's layout and back (with a pattern of k blocks too);
- :func:`from_layer_stack` / :func:`to_layer_stack` rename ``hk.layer_stack``'s
  prefix.

Every function moves every leaf exactly (bitwise, dtype kept) or raises
naming the module, the layer and the fix; none overwrites an entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from stackwise import _convert

__all__ = ["convert", "from_layer_stack", "from_loop", "to_layer_stack", "to_loop"]

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


def _check_tree(tree: Any, who: str) -> None:
    if not isinstance(tree, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) for k, v in tree.items()
    ):
        raise TypeError(
            f"{who}: `tree` must be a Haiku params or state dict, "
            f"`{{module_name: {{name: array}}}}`, got {type(tree).__name__}."
        )


def _paths(path: Any, who: str) -> list[str]:
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
    _convert.check_distinct(list(paths), who)
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
    _check_tree(tree, who)
    paths = _paths(path, who)
    n = _convert.check_n(n, who)
    name_of = _convert.layer_names(names, who, plain=_haiku_name, example="'block'")

    def exists(i: int) -> bool:
        try:
            name = name_of(i)
        except (IndexError, KeyError):
            return False
        return any(_inside(key, name) for key in tree)

    fixed = len(names) if isinstance(names, (list, tuple)) else None
    k, asked = len(paths), fixed if fixed is not None else n
    if asked is not None and asked < k:
        raise ValueError(f"{who}: a pattern of {k} blocks needs at least {k} layers, got {asked}.")
    label = lambda i: repr(name_of(i))  # noqa: E731
    n = _convert.find_depth(exists, label, n, len(tree), who, fixed=fixed, pattern=k)
    loop_names = [name_of(i) for i in range(n)]
    _convert.check_distinct(loop_names, who)
    per_layer, outside = [], dict(tree)
    for name in loop_names:
        inside, outside = _split(outside, name)
        per_layer.append(_flat(inside))
    new: dict[str, dict[str, Any]] = {}
    for p, prefix in enumerate(paths):
        if p >= n or not per_layer[p]:
            continue  # a kind of block with nothing in this tree (e.g. no state)
        stacked = _convert.stack_exact(
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
    _check_tree(tree, who)
    paths = _paths(path, who)
    k = len(paths)
    outside, positions = dict(tree), {}
    for p, prefix in enumerate(paths):
        inside, outside = _split(outside, prefix)
        if not inside:
            continue  # with a pattern: a kind of block with nothing in this tree
        flat = _flat(inside)
        depths = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in flat.values()}
        if len(depths) != 1 or None in depths:
            lines = "\n".join(f"  {prefix}{key}: shape {jnp.shape(a)}" for key, a in flat.items())
            raise ValueError(
                f"{who}: every leaf under {prefix!r} needs the same leading layer axis, "
                f"but the leaves are:\n{lines}"
            )
        positions[p] = _convert.unstack_exact(flat, depths.pop())
    if not positions:
        where = " or ".join(repr(prefix) for prefix in paths)
        raise ValueError(
            f"{who}: no module named {where} or under it; the tree has {_modules(tree)}."
        )
    if k > 1:
        _check_none_left(outside, paths, who)
    lo, hi = _convert.pattern_depths({p: len(v) for p, v in positions.items()}, k, who)
    name_of = _convert.layer_names(names, who, plain=_haiku_name, example="'block'")
    if isinstance(names, (list, tuple)) and not lo <= len(names) <= hi:
        held = lo if lo == hi else f"{lo} to {hi}"
        raise ValueError(
            f"{who}: the stacked leaves hold {held} layers but {len(names)} `names` were "
            "given; give one name per layer."
        )
    layers = sorted((p + j * k, p, j) for p, v in positions.items() for j in range(len(v)))
    loop_names = [name_of(i) for i, _, _ in layers]
    _convert.check_distinct(loop_names, who)
    new: dict[str, dict[str, Any]] = {}
    for (i, p, j), name in zip(layers, loop_names):
        layer = _nested(positions[p][j], name)
        clash = sorted(set(new) & set(layer))
        if clash:  # e.g. one loop name inside another's module
            raise ValueError(f"{who}: layer {i} would overwrite modules {clash}.")
        new.update(layer)
    return _merge(outside, new, who)


def _check_none_left(outside: Tree, paths: list[str], who: str) -> None:
    """A pattern's positions are modules of one Stack: nothing else may stay under it."""
    parts = [p.split("/") for p in paths]
    common = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    stack = "/".join(common)
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
    _check_tree(tree, who)
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

    Args:
      tree: a Haiku params or state dict.
      path: the Stack's module name, e.g. ``"stack"``.
      layer_stack_name: the ``hk.layer_stack``'s full name prefix.

    Returns:
      A new dict in the Stack's layout.

    Raises:
      ValueError: nothing under ``layer_stack_name``, or a renamed module
        that exists.
    """
    return _rename(tree, layer_stack_name, path, "stackwise.haiku.from_layer_stack")


# --------------------------------------------------------------------------
# By creation order: one model's params/state -> another's.

_KINDS = ("params", "state")


def _scope(calls: list, module: Any) -> tuple:
    """The classes of the modules around a leaf created in ``module``: from the block
    down inside a Stack or ``hk.layer_stack`` (after its lifting module), else from the root."""
    from stackwise.haiku._stack import Stack  # the adapter's module type

    chain = list(calls)
    if module is not None and (not chain or chain[-1] is not module):
        chain.append(module)
    start = max(
        (i + 1 for i, m in enumerate(chain) if isinstance(m, Stack) or _lifting(m)),
        default=0,
    )
    return tuple(type(m).__name__ for m in chain[start:])


def _lifting(module: Any) -> bool:
    """Haiku's own lifting module (``hk.lift``, ``hk.layer_stack``), not a user's block."""
    return type(module).__module__.startswith("haiku._src.lift")


def _position_names(stack: Any) -> list[str] | None:
    """A pattern Stack's positions' module names, in the pattern's order (None: no pattern).

    The Stack records them while its init is traced (``_Layers.names``).
    """
    layers = stack._layers
    return list(layers.names) if layers.pattern and layers.names is not None else None


class _Model:
    """A model's params and state as :class:`stackwise._convert.Leaf` s, in creation order.

    Both are recorded while ``init`` is traced (``jax.eval_shape``, nothing is
    computed) under an ``hk.custom_creator`` and an ``hk.custom_setter``, which
    see every ``hk.get_parameter`` / ``hk.get_state`` / ``hk.set_state`` in
    creation order, also those of
    a block inside a :class:`Stack` or ``hk.layer_stack`` (their lifted
    prefix plus the name is the leaf's name in the outer dict, with one
    layer's shape: the leaf's stacked shape then gives the depth). An
    ``hk.intercept_methods`` interceptor sees the modules around each leaf
    (its scope) and the Stacks; a pattern Stack's leaves are ordered position
    by position, whatever order the positions were traced in
    (``reverse=True`` runs the last first).
    """

    def __init__(self, model: Any, side: str, args: tuple, kwargs: dict, who: str):
        from stackwise.haiku._stack import Stack  # the adapter's module type

        if isinstance(model, (hk.Transformed, hk.TransformedWithState)):
            init = model.init
        elif callable(model):
            init = hk.transform_with_state(model).init
        else:
            raise TypeError(
                f"{who}: the {side} model must be an `hk.transform` / "
                "`hk.transform_with_state` of the model's function, or the function "
                f"itself, got {type(model).__name__} {model!r}."
            )
        created: dict[str, dict[str, tuple]] = {kind: {} for kind in _KINDS}
        calls: list = []  # the modules whose methods are running, outermost first
        stacks: dict[str, Any] = {}  # a Stack's lifted prefix -> the Stack

        def interceptor(f, a, kw, context):
            m = context.module
            if context.method_name == "__init__":
                return f(*a, **kw)
            if isinstance(m, Stack):
                stacks.setdefault(m.module_name + "/", m)
            calls.append(m)
            try:
                return f(*a, **kw)
            finally:
                calls.pop()

        def record(kind: str, context: Any, shape: tuple, dtype: Any) -> None:
            prefix = context.lifted_prefix_name or ""
            owner = type(context.module).__name__ if context.module is not None else ""
            created[kind].setdefault(
                prefix + context.full_name,
                (prefix, owner, shape, dtype, _scope(calls, context.module)),
            )

        def creator(kind: str) -> Callable:
            def create(next_creator, shape, dtype, init, context):
                value = next_creator(shape, dtype, init)
                if hasattr(value, "shape"):  # not DO_NOT_STORE
                    record(kind, context, tuple(value.shape), value.dtype)
                return value

            return create

        def setter(next_setter, value, context):
            # State first written by `hk.set_state` (e.g. hk.ExponentialMovingAverage's
            # average) is created there, not by a creator.
            record("state", context, tuple(jnp.shape(value)), jnp.result_type(value))
            return next_setter(value)

        def traced():
            with hk.intercept_methods(interceptor):
                with hk.custom_creator(creator("params"), params=True, state=False):
                    with hk.custom_creator(creator("state"), params=False, state=True):
                        with hk.custom_setter(setter):
                            return init(jax.random.key(0), *args, **kwargs)

        out = jax.eval_shape(hk.transform(traced).apply, {}, None)
        params, state = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
        self.side, self.who = side, who
        self.shapes = {"params": params, "state": state}
        self.positions = {prefix: _position_names(stack) for prefix, stack in stacks.items()}
        self.leaves = {kind: self._leaves(kind, created[kind]) for kind in _KINDS}

    def _rank(self, created: dict) -> dict[str, tuple]:
        """Each leaf's ``(rank, position, positions)``: its place in creation order (a
        pattern Stack's position by position) and its pattern position of how many."""
        order = {name: i for i, name in enumerate(created)}
        first: dict[str, int] = {}
        for name, (prefix, *_) in created.items():
            first.setdefault(prefix, order[name])
        rank = {}
        for name, (prefix, *_) in created.items():
            names = self.positions.get(prefix)
            if not names:
                rank[name] = ((order[name],), 0, 1)
                continue
            position = name[len(prefix) :].split("/")[0]
            if position not in names:
                raise ValueError(
                    f"{self.who}: the {self.side} model's {name} lies in a pattern Stack "
                    f"but in none of its positions {names}."
                )
            p = names.index(position)
            rank[name] = ((first[prefix], p, order[name]), p, len(names))
        return rank

    def _leaves(self, kind: str, created: dict) -> list[_convert.Leaf]:
        rank = self._rank(created)
        leaves = []
        for module, bundle in self.shapes[kind].items():
            for key, struct in bundle.items():
                name = f"{module}/{key}"
                if name not in created:
                    raise ValueError(
                        f"{self.who}: the {self.side} model's {kind} entry {name} was not "
                        "created by `hk.get_parameter` / `hk.get_state` / `hk.set_state` "
                        "during init, so its place in the model is unknown."
                    )
                prefix, owner, shape, dtype, scope = created[name]
                if tuple(struct.shape) == shape:
                    depth = 0
                elif tuple(struct.shape[1:]) == shape:
                    depth = struct.shape[0]
                else:
                    raise ValueError(
                        f"{self.who}: the {self.side} model's {name} has shape "
                        f"{tuple(struct.shape)} but each layer creates it with shape {shape}; "
                        "only one layer axis (one Stack or layer_stack, not nested ones) "
                        "converts leaf by leaf. Convert nested stacks with `from_loop` / "
                        "`to_loop`."
                    )
                place, p, k = rank[name]
                leaf = _convert.Leaf(
                    name, owner, key, shape, dtype, depth, prefix or None, None, scope, p, k
                )
                leaves.append((place, leaf))
        return [leaf for _, leaf in sorted(leaves, key=lambda t: t[0])]

    def check(self, tree: Tree, kind: str) -> None:
        """Raises unless ``tree`` has exactly this model's ``kind`` entries, shapes and dtypes."""
        want = {f"{m}/{k}": s for m, b in self.shapes[kind].items() for k, s in b.items()}
        have = {f"{m}/{k}": a for m, b in tree.items() for k, a in b.items()}
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
                f"{self.who}: the {kind} given are not those of the {self.side} model "
                f"(its init with the arguments given):\n" + "\n".join(bad[:20])
            )

    def kind_of(self, tree: Tree) -> str:
        names = {f"{m}/{k}" for m, b in tree.items() for k in b}
        for kind in _KINDS:
            if names == {f"{m}/{k}" for m, b in self.shapes[kind].items() for k in b}:
                return kind
        self.check(tree, "params")  # lists the differences
        raise AssertionError("unreachable")  # pragma: no cover


def convert(tree: Any, source: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
    """Params or state of one model in the layout of another, matched in creation order.

    Porting a model onto a :class:`Stack` keeps its code but changes its
    names: a loop body that creates ``layer_norm``, ``linear``,
    ``linear_1`` in each of n iterations names them ``layer_norm_{2i}``,
    ``linear_{2i}``, ... across the loop, and the module after the loop
    ``layer_norm_{2n}``; in the port they are ``stack/layer_norm`` (stacked)
    and ``layer_norm``. ``convert`` traces both models' ``init`` (shapes
    only, with :func:`jax.eval_shape`), records every ``hk.get_parameter`` /
    ``hk.get_state`` in the order Haiku creates them, and moves the k-th
    leaf the source creates to the k-th leaf the target creates, layer by
    layer inside a Stack (or ``hk.layer_stack``). It works both ways and
    between any two of a loop, a Stack and ``hk.layer_stack``.

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> def body(x):
    ...     h = hk.Linear(8)(hk.LayerNorm(-1, True, True)(x))
    ...     return x + hk.Linear(4)(jax.nn.gelu(h))
    >>> def loop(x):
    ...     for _ in range(3):
    ...         x = body(x)
    ...     return hk.LayerNorm(-1, True, True)(x)
    >>> def port(x):
    ...     return hk.LayerNorm(-1, True, True)(stackwise.haiku.Stack(body, n=3)(x))
    >>> loop, port = hk.transform(loop), hk.transform(port)
    >>> x = jnp.ones((2, 4))
    >>> loop_params = loop.init(jax.random.key(0), x)
    >>> sorted(loop_params)[:4]
    ['layer_norm', 'layer_norm_1', 'layer_norm_2', 'layer_norm_3']
    >>> params = stackwise.haiku.convert(loop_params, loop, port, x)
    >>> params["stack/linear_1"]["w"].shape, params["layer_norm"]["scale"].shape
    ((3, 8, 4), (4,))
    >>> bool(jnp.allclose(port.apply(params, None, x), loop.apply(loop_params, None, x), atol=1e-6))
    True
    >>> back = stackwise.haiku.convert(params, port, loop, x)
    >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, loop_params))
    True

    The two models must correspond one to one: as many leaves, each pair
    created by the same module class with the same name (``w``, ``scale``),
    shape and dtype. Otherwise nothing is moved and the error shows the first
    leaves that differ. Leaves of one class and shape created in another
    order in the port cannot be told apart: port the loop's body unchanged.

    A pattern Stack (``Stack([Local, Local, Global], n)``) takes the loop's
    layer i into position ``i % k``, whatever order it runs its positions in;
    a loop layer of another position's kind of block (its class among the
    modules around the variable) is refused, even with alike variables.

    Args:
      tree: the source model's params, its state, or ``(params, state)``
        (which of them is told from the entries' names).
      source: the model the tree belongs to: an ``hk.transform`` /
        ``hk.transform_with_state`` of it, or its function.
      target: the model to convert to, the same way.
      *args: example arguments of both models' ``init`` (after the key);
        only their shapes and dtypes matter.
      **kwargs: keyword arguments of both models' ``init``.

    Returns:
      The target's params, state or ``(params, state)``, as plain dicts; every
      array is the source's, bitwise (stacked or sliced).

    Raises:
      ValueError: the tree is not the source's (the differing entries are
        listed), or the models do not correspond one to one (the first
        difference is shown).
      TypeError: a model that is neither a transform nor a function.
    """
    who = "stackwise.haiku.convert"
    src = _Model(source, "source", args, kwargs, who)
    tgt = _Model(target, "target", args, kwargs, who)

    def one(sub: Tree, kind: str | None) -> dict[str, dict[str, Any]]:
        _check_tree(sub, who)
        kind = kind or src.kind_of(sub)
        src.check(sub, kind)
        hint = (
            "Models whose modules differ in order convert by name with "
            "`stackwise.haiku.from_loop` / `to_loop`."
        )
        sources = _convert.correspond(src.leaves[kind], tgt.leaves[kind], f"{who} ({kind})", hint)
        values = [_value(sub, leaf.name) for leaf in src.leaves[kind]]
        out: dict[str, dict[str, Any]] = {}
        for leaf, value in zip(
            tgt.leaves[kind], _convert.assemble(tgt.leaves[kind], sources, values)
        ):
            module, key = leaf.name.rsplit("/", 1)
            out.setdefault(module, {})[key] = value
        return {m: out[m] for m in tgt.shapes[kind] if m in out}

    if isinstance(tree, tuple) and len(tree) == 2:
        return one(tree[0], "params"), one(tree[1], "state")
    return one(tree, None)


def _value(tree: Tree, name: str) -> Any:
    module, key = name.rsplit("/", 1)
    return tree[module][key]
