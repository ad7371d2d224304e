"""The serving layout's node, :class:`Serving`, and the refusals of it where only stacked
trees go.

Kept apart from :mod:`stackwise._core.serving` (the conversions and the serving call) so
that the core's functions over stacked trees (:mod:`stackwise._core.layout` among them,
which the conversions use) can refuse a :class:`Serving` without an import cycle.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["Serving", "found", "in_use", "is_serving", "refuse", "stacked_only"]


@jax.tree_util.register_pytree_with_keys_class
class Serving:
    """Params or state in the serving layout: one tree per layer, in layer order.

    Made by :func:`stackwise.to_serving` from a stacked tree; ``Stacked.apply`` runs it as
    a Python loop over the layers (see :func:`stackwise.to_serving`). A pytree: its
    children are the n per-layer trees (paths ``[i]...``), so ``jax.jit`` donates each
    layer's buffers separately.

    Attributes:
      layers: the n per-layer trees, layer 0 first (each leaf without the layer axis).
      pattern: None, or the pattern's length k it was made with (``to_serving(...,
        pattern=k)``): layer i then has position ``i % k``'s structure.
    """

    __slots__ = ("layers", "pattern")

    def __init__(self, layers: tuple[Any, ...] | list[Any], pattern: int | None = None):
        self.layers = tuple(layers)
        self.pattern = pattern

    def tree_flatten_with_keys(self):
        keys = [jax.tree_util.SequenceKey(i) for i in range(len(self.layers))]
        return list(zip(keys, self.layers)), self.pattern

    @classmethod
    def tree_unflatten(cls, pattern: int | None, children: Any) -> Serving:
        return cls(children, pattern)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        kind = f", pattern={self.pattern}" if self.pattern is not None else ""
        return f"Serving({len(self.layers)} layers{kind})"


def is_serving(value: Any) -> bool:
    """Whether ``value`` is a :class:`Serving` (an ``is_leaf`` that stops at one)."""
    return isinstance(value, Serving)


def found(tree: Any) -> list[str]:
    """The paths of the :class:`Serving` nodes inside ``tree`` (the root's is ``""``)."""
    nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_serving)
    return [jax.tree_util.keystr(path) for path, v in nodes if isinstance(v, Serving)]


def in_use(*values: Any) -> bool:
    """Whether any of ``values`` is, or holds, a :class:`Serving`."""
    return any(found(v) for v in values)


def refuse(who: str, runs: str, fix: str = "", **values: Any) -> None:
    """Refuses a :class:`Serving` in any of ``values`` (named by their keyword) where only
    stacked trees go: ``runs`` says what ``who`` does with them, ``fix`` what to do
    (default: pass the stacked tree back)."""
    for what, value in values.items():
        paths = found(value)
        if paths:
            at = what + paths[0]
            raise TypeError(
                f"{who}: `{at}` is in the serving layout (a `stackwise.Serving`), but {runs}. "
                + (fix or f"Pass the stacked tree: `stackwise.from_serving({what})`.")
            )


def stacked_only(who: str, **values: Any) -> None:
    """Refuses a :class:`Serving` anywhere in ``values`` (named by keyword) given to ``who``,
    a function over stacked trees: it would take each per-layer array's first axis for the
    layer axis (slicing, quantizing, sharding or saving the wrong axis), so it raises."""
    refuse(
        who,
        "this function takes stacked trees (every leaf with the layer axis first)",
        "Pass the stacked tree: `stackwise.from_serving(tree)` for the core's (with `path` "
        "for a part of a tree), or for a Stack's variables served leaf-wise its framework's "
        "`from_serving(tree, path)` (`stackwise.flax.from_serving`, "
        "`stackwise.haiku.from_serving`, `stackwise.nnx.from_serving`, "
        "`stackwise.equinox.from_serving`).",
        **values,
    )
