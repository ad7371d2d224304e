"""``convert``: one NNX model's state onto another's, matched in NNX's graph order.

:func:`convert` walks both models' state in NNX's order (by attribute name,
lists by index), records each variable's module and the Stacks around it
(:class:`_Model`), and moves the k-th leaf of the source to the k-th of the
target with :mod:`stackwise._kit.matching`, a Stack's block layer by layer;
names are local in NNX, so paired leaves must also share their path within
the layer (:func:`_check_names`). The conversions by name (``from_loop``,
``from_scan``, ...) are in ``_convert.py``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from stackwise import _kit
from stackwise.nnx._convert import BLOCK, flatten, raw_value, refuse_served, show, unflatten
from stackwise.nnx._stack import Stack

__all__ = ["convert"]


class _Model:
    """A model's state as :class:`stackwise._kit.matching.Leaf` s, in NNX's graph order.

    NNX orders a module's state by attribute name (lists by index), the order
    of ``nnx.state`` and ``nnx.to_flat_state``. A :class:`Stack`'s block is a
    stack: its leaves come layer by layer.
    """

    def __init__(self, model: Any, side: str, who: str):
        if not isinstance(model, nnx.Module):
            if not callable(model):
                raise TypeError(
                    f"{who}: the {side} model must be an `nnx.Module` or a function "
                    f"building one, got {type(model).__name__} {model!r}."
                )
            model = nnx.eval_shape(model)
            if not isinstance(model, nnx.Module):
                raise TypeError(f"{who}: the {side} model's function did not build a module.")
        self.side, self.who = side, who
        owners, stacks = {}, {}  # path -> class name; a Stack's block path -> pattern length
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Pytree):  # modules and their containers (nnx.List)
                owners[tuple(path)] = type(node).__name__
            if isinstance(node, Stack):
                stacks[tuple(path) + (BLOCK,)] = len(node.layers) if node.pattern else 1
        self.flat = dict(nnx.to_flat_state(nnx.state(model)))
        refuse_served(self.flat, who)
        self.paths = list(self.flat)
        self.groups = []  # each leaf's layer root: its Stack's block, or pattern position
        self.leaves = []
        for path in self.paths:
            value = raw_value(self.flat[path])
            group = next((g for g in stacks if path[: len(g)] == g), None)
            shape, depth, position, k, root = tuple(value.shape), 0, 0, 1, ()
            if group is not None:
                depth, shape, k, root = shape[0], shape[1:], stacks[group], group
                if k > 1:
                    position = path[len(group)]
                    root = group + (position,)
            scope = tuple(
                owners[path[:j]] for j in range(len(root), len(path)) if path[:j] in owners
            )
            owner = owners.get(path[:-1], "")
            self.groups.append(None if group is None else root)
            self.leaves.append(
                _kit.Leaf(
                    show(path),
                    owner,
                    str(path[-1]),
                    shape,
                    value.dtype,
                    depth,
                    group,
                    None,
                    scope,
                    position,
                    k,
                )
            )

    def check(self, flat: dict) -> None:
        """Raises unless ``flat`` is this model's state: its variables, shapes and dtypes."""
        _kit.check_given(
            {show(p): raw_value(self.flat[p]) for p in self.paths},
            {show(p): raw_value(v) for p, v in flat.items()},
            self.who,
            f"the state given is not the {self.side} model's",
        )


def _local(model: _Model, i: int) -> tuple:
    path, group = model.paths[i], model.groups[i]
    return path if group is None else path[len(group) :]


def _check_names(src: _Model, tgt: _Model, sources: list, who: str) -> None:
    """NNX names are local: paired leaves must have the same path within their layer.

    A loop's layer i is one subtree (``layers.3``, ``layer_3``): all leaves
    paired with one layer of a stack share one root, the rest of their path
    being the stacked leaf's path inside the block.
    """
    roots: dict[tuple, tuple] = {}
    for t, slots in enumerate(sources):
        for j, s in enumerate(slots):
            a, b = _local(src, s.leaf), _local(tgt, t)
            s_group, t_group = src.groups[s.leaf], tgt.groups[t]
            if (s_group is None) == (t_group is None):
                ok = a == b
            else:  # one side is a loop: its path ends with the stacked leaf's
                long, short = (a, b) if s_group is None else (b, a)
                layer = ("target", t_group, j) if s_group is None else ("source", s_group, s.layer)
                ok = long[len(long) - len(short) :] == short
                if ok:
                    root = long[: len(long) - len(short)]
                    ok = roots.setdefault(layer, root) == root
            if not ok:
                where = f" (layer {s.layer})" if s.layer is not None else ""
                raise ValueError(
                    f"{who}: in graph order, the target's {show(tgt.paths[t])} takes the "
                    f"source's {show(src.paths[s.leaf])}{where}, but their names within "
                    "the layer differ. NNX orders state by attribute name: keep the loop's "
                    "attribute names in the port (`self.layers = Stack(...)` where upstream "
                    "had `self.layers = [...]`), or convert by name with "
                    "`stackwise.nnx.from_loop` / `to_loop`."
                )


def convert(tree: Any, source: Any, target: Any) -> Any:
    """One model's state in the layout of another, matched in NNX's graph order.

    Porting a model onto a :class:`Stack` keeps its blocks and attribute
    names: upstream ``self.layers = [Block(...) for _ in range(n)]`` (state
    ``layers.0.attn...``, ``layers.1.attn...``) becomes ``self.layers =
    stackwise.nnx.Stack(lambda rngs: Block(...), n, rngs=rngs)`` (state
    ``layers.layers.attn...`` with a leading axis n). ``convert`` walks both
    models' state in NNX's order (by attribute name, lists by index; a
    Stack's block layer by layer) and moves the k-th leaf of the source to
    the k-th of the target, checking that they agree in module class,
    variable name, path within the layer, shape and dtype. It works both ways.

    A pattern Stack (``Stack([Local, Local, Global], n)``) takes the loop's
    layer i into position ``i % k``, whatever order it runs its positions in;
    a loop layer of another position's kind of block (its class among the
    modules around the variable) is refused, even with alike variables.

    >>> import jax, jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.norm = nnx.LayerNorm(4, rngs=rngs)
    ...         self.linear = nnx.Linear(4, 4, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + self.linear(self.norm(x))
    >>> class Loop(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.List([Block(rngs) for _ in range(3)])
    ...         self.final_norm = nnx.LayerNorm(4, rngs=rngs)
    ...     def __call__(self, x):
    ...         for layer in self.layers:
    ...             x = layer(x)
    ...         return self.final_norm(x)
    >>> class Port(Loop):
    ...     def __init__(self, rngs):
    ...         self.layers = stackwise.nnx.Stack(Block, 3, rngs=rngs)
    ...         self.final_norm = nnx.LayerNorm(4, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.final_norm(self.layers(x))
    >>> loop = Loop(nnx.Rngs(0))
    >>> port = nnx.eval_shape(lambda: Port(nnx.Rngs(1)))
    >>> nnx.update(port, stackwise.nnx.convert(nnx.state(loop), loop, port))
    >>> x = jnp.ones((2, 4))
    >>> bool(jnp.allclose(port(x), loop(x), atol=1e-6))
    True
    >>> back = stackwise.nnx.convert(nnx.state(port), port, loop)
    >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, nnx.state(loop)))
    True

    Args:
      tree: the source model's state: an ``nnx.State`` or a nested dict of
        arrays (``nnx.to_pure_dict``, e.g. a checkpoint).
      source: the model the state belongs to: an ``nnx.Module`` (abstract,
        from ``nnx.eval_shape``, is enough) or a function building it.
      target: the model to convert to, the same way.

    Returns:
      The target's state, of the input's kind (an ``nnx.State`` of the
      target's variables, or a nested dict); every array is the source's,
      bitwise (stacked or sliced). Load it with ``nnx.update(target, state)``.

    Raises:
      TypeError: a state holding a served Stack's variables (``stackwise.nnx.to_serving``).
      ValueError: the state is not the source's (the differing variables are
        listed), or the models do not correspond one to one (the first
        difference is shown).
      TypeError: a model that is neither a module nor a function.
    """
    who = "stackwise.nnx.convert"
    flat, is_state = flatten(tree, who)
    src, tgt = _Model(source, "source", who), _Model(target, "target", who)
    src.check(flat)
    hint = "Models whose state differs in names convert by name with `from_loop` / `to_loop`."
    sources = _kit.correspond(src.leaves, tgt.leaves, who, hint)
    _check_names(src, tgt, sources, who)
    values = [raw_value(flat[p]) for p in src.paths]
    out = {}
    for path, value in zip(tgt.paths, _kit.assemble(tgt.leaves, sources, values)):
        out[path] = tgt.flat[path].copy(value) if is_state else value
    return unflatten(out, is_state)
