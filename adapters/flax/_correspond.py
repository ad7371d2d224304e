"""``convert``: one linen model's variables onto another's, matched in creation order.

:func:`convert` traces both models' ``init`` (shapes only) under
``nn.intercept_methods``, records each variable's module and the order of the
modules' first calls (:class:`_Model`; a pattern Stack's positions with
:class:`_Pattern`), and moves the k-th variable of the source to the k-th of
the target with :mod:`stackwise._kit.matching`, layer by layer inside a Stack.
The conversions by name (``from_loop``, ``from_scan``, ...) are in
``_convert.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from stackwise import _kit
from stackwise.flax import _boxes
from stackwise.flax._blocks import fresh_block, position_names
from stackwise.flax._convert import get, put, show, variables_dict
from stackwise.flax._stack import Stack

__all__ = ["convert"]


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
        blocks = list(stack.block)
        self.names = position_names(blocks)
        self.fresh = [fresh_block(b, who) for b in blocks]
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
        name = type(module).__name__
        raise ValueError(
            f"{self.who}: the pattern Stack at {where} ran a block ({name}) whose fields "
            f"equal those of none of its positions' blocks ({', '.join(self.names)}), so "
            "its variables cannot be placed. A field built afresh for every block (a "
            "`default_factory`, a new function or array each time) never compares equal: "
            f"give the positions as template instances, `Stack([{name}(...), ...], n)`, "
            "whose fields every layer shares."
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
    """A model's variables as :class:`stackwise._kit.matching.Leaf` s, in creation order.

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

        self.shapes = variables_dict(jax.eval_shape(traced), who)
        for stack, pattern in patterns.items():
            modules.update(pattern.modules(stack, side))
        self.paths: dict[str, list[tuple]] = {}  # per collection, in the leaves' order
        self.leaves = {col: self._leaves(col, modules) for col in self.shapes}

    def _leaves(self, col: str, modules: dict) -> list[_kit.Leaf]:
        ranked = []
        for path, struct in jax.tree_util.tree_leaves_with_path(
            self.shapes[col], is_leaf=_boxes.is_box
        ):
            keys = tuple(getattr(k, "key", k) for k in path)
            owner = next((keys[:j] for j in range(len(keys), -1, -1) if keys[:j] in modules), ())
            rank, cls, group, root, p, k = modules.get(owner, [(-1,), "", None, None, 0, 1])
            start = 0 if root is None else len(root)
            scope = tuple(
                modules[keys[:j]][1]
                for j in range(start, len(owner) + 1)
                if keys[:j] in modules and modules[keys[:j]][1]
            )
            value = _boxes.value(struct)
            shape, depth = tuple(value.shape), 0
            names = getattr(struct, "names", None)
            if group is not None:  # the Stack's init refused any leaf without its n axis
                depth, shape = shape[0], shape[1:]
                names = None if names is None else tuple(names)[1:]
            extra = None if names is None else ("partitioned", tuple(names))
            name = show(col, keys)
            key = "/".join(keys[len(owner) :])
            leaf = _kit.Leaf(
                name, cls or "", key, shape, value.dtype, depth, group, extra, scope, p, k
            )
            ranked.append(((rank, keys[len(owner) :]), keys, leaf))
        ranked.sort(key=lambda t: t[0])
        self.paths[col] = [keys for _, keys, _ in ranked]
        return [leaf for _, _, leaf in ranked]

    def check(self, variables: dict) -> None:
        """Raises unless ``variables`` are this model's: its variables, shapes and dtypes."""

        def by_name(tree: dict) -> dict[str, Any]:
            named = {
                show(col, tuple(getattr(k, "key", k) for k in p)): _boxes.value(a)
                for col, sub in tree.items()
                for p, a in jax.tree_util.tree_leaves_with_path(sub, is_leaf=_boxes.is_box)
            }
            return dict(sorted(named.items()))

        what = (
            f"the variables given are not those of the {self.side} model (its init with "
            "the arguments given)"
        )
        _kit.check_given(
            by_name(self.shapes), by_name(variables), self.who, what, dtype=jnp.result_type
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
    variables = variables_dict(variables, who)
    src = _Model(source, "source", args, kwargs, who)
    tgt = _Model(target, "target", args, kwargs, who)
    src.check(variables)
    if sorted(src.shapes) != sorted(tgt.shapes):
        raise ValueError(
            f"{who}: the source model has collections {sorted(src.shapes)} but the target "
            f"{sorted(tgt.shapes)}; both models must create the same collections (convert "
            "the shared ones by name with `from_loop` / `to_loop`)."
        )
    boxed = any(_boxes.is_box(b) for b in jax.tree.leaves(variables, is_leaf=_boxes.is_box))
    hint = "Models whose modules differ convert by name with `from_loop` / `to_loop`."
    out: dict[str, Any] = {}
    for col in tgt.shapes:
        sources = _kit.correspond(src.leaves[col], tgt.leaves[col], f"{who} ({col})", hint)
        values = [_boxes.value(get(variables[col], keys)) for keys in src.paths[col]]
        tree: dict = {}
        templates = dict(
            (tuple(getattr(k, "key", k) for k in p), s)
            for p, s in jax.tree_util.tree_leaves_with_path(tgt.shapes[col], is_leaf=_boxes.is_box)
        )
        for keys, value in zip(
            tgt.paths[col], _kit.assemble(tgt.leaves[col], sources, values)
        ):
            template = templates[keys]
            if boxed and _boxes.is_box(template):
                value = template.replace_boxed(value)
            put(tree, keys, value, col, who)
        out[col] = tree
    return out
