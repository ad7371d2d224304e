"""``convert``: one Haiku model's params or state onto another's, matched in creation order.

:func:`convert` traces both models' ``init`` (shapes only), records every
``hk.get_parameter`` / ``hk.get_state`` / ``hk.set_state`` in the order Haiku
creates them and the modules around each (:class:`_Model`), and moves the
k-th leaf of the source to the k-th of the target with
:mod:`stackwise._kit.matching`, layer by layer inside a Stack or
``hk.layer_stack``. The conversions by name (``from_loop``,
``from_layer_stack``, ...) are in ``_convert.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from stackwise import _kit
from stackwise.haiku._convert import check_tree, refuse_served
from stackwise.haiku._stack import Stack

__all__ = ["convert"]

Tree = Mapping[str, Mapping[str, Any]]

_KINDS = ("params", "state")


def _scope(calls: list, module: Any) -> tuple:
    """The classes of the modules around a leaf created in ``module``: from the block
    down inside a Stack or ``hk.layer_stack`` (after its lifting module), else from the root."""
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


class _Model:
    """A model's params and state as :class:`stackwise._kit.matching.Leaf` s, in creation order.

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
        self.positions = {prefix: stack.position_names for prefix, stack in stacks.items()}
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
                    f"but in none of its positions {names}, so its place in the loop is "
                    "unknown. A pattern's block factory must build only the module it "
                    "returns: build and call other modules inside that module."
                )
            p = names.index(position)
            rank[name] = ((first[prefix], p, order[name]), p, len(names))
        return rank

    def _leaves(self, kind: str, created: dict) -> list[_kit.Leaf]:
        rank = self._rank(created)
        leaves = []
        for module, bundle in self.shapes[kind].items():
            for key, struct in bundle.items():
                name = f"{module}/{key}"
                if name not in created:
                    raise ValueError(
                        f"{self.who}: the {self.side} model's {kind} entry {name} was not "
                        "created by `hk.get_parameter` / `hk.get_state` / `hk.set_state` "
                        "during init, so its place in the model is unknown. Create it with "
                        "`hk.get_parameter` / `hk.get_state` in the model, or convert the "
                        "tree without it and add it back by hand."
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
                leaf = _kit.Leaf(
                    name, owner, key, shape, dtype, depth, prefix or None, None, scope, p, k
                )
                leaves.append((place, leaf))
        return [leaf for _, leaf in sorted(leaves, key=lambda t: t[0])]

    def check(self, tree: Tree, kind: str) -> None:
        """Raises unless ``tree`` has exactly this model's ``kind`` entries, shapes and dtypes."""
        want = {f"{m}/{k}": s for m, b in self.shapes[kind].items() for k, s in b.items()}
        have = {f"{m}/{k}": a for m, b in tree.items() for k, a in b.items()}
        what = (
            f"the {kind} given are not those of the {self.side} model (its init with the "
            "arguments given)"
        )
        _kit.check_given(
            dict(sorted(want.items())),
            dict(sorted(have.items())),
            self.who,
            what,
            dtype=jnp.result_type,
        )

    def kind_of(self, tree: Tree) -> str:
        """Which of the model's trees ``tree`` is, by its entries' names; ``"params"``
        when neither, whose :meth:`check` then lists the differences."""
        names = {f"{m}/{k}" for m, b in tree.items() for k in b}
        return next(
            (
                kind
                for kind in _KINDS
                if names == {f"{m}/{k}" for m, b in self.shapes[kind].items() for k in b}
            ),
            "params",
        )


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
        check_tree(sub, who)
        refuse_served(sub, who)
        kind = kind or src.kind_of(sub)
        src.check(sub, kind)
        hint = (
            "Models whose modules differ in order convert by name with "
            "`stackwise.haiku.from_loop` / `to_loop`."
        )
        sources = _kit.correspond(
            src.leaves[kind], tgt.leaves[kind], f"{who} ({kind})", hint
        )
        values = [_value(sub, leaf.name) for leaf in src.leaves[kind]]
        out: dict[str, dict[str, Any]] = {}
        for leaf, value in zip(
            tgt.leaves[kind], _kit.assemble(tgt.leaves[kind], sources, values)
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
