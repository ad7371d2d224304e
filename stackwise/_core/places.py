"""A place in a tree: the ``path`` argument of the serving conversions, read once.

``path`` says where the part to convert is, in the core (a key of a params dict,
``"blocks"``) as in the adapters whose Stacks are modules (an attribute, ``"decoder.blocks"``):

- :func:`parts`: ``"decoder/blocks"`` or ``("decoder", "blocks")`` as a tuple of keys (text
  for names, ``int`` for list indices given in a tuple), checked;
- :func:`show`: the parts as text, for messages (``'decoder/blocks'``);
- :func:`get` / :func:`replace`: the value at the parts of nested dicts, lists and tuples
  (named tuples too), and a copy of the tree with it replaced (the containers on the way
  copied, everything else shared), each naming the place it could not reach.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from stackwise._core.trees import describe

__all__ = ["get", "parts", "replace", "show"]


def parts(path: Any, who: str, seps: str = "/") -> tuple:
    """``path`` as a tuple of keys: a string split at ``seps`` (``"a/b"``), or a tuple of
    strings and ints (a key holding a separator, a list index) as given.

    Raises:
      TypeError: a list of places (one is converted at a time), or no place (an empty
        string or tuple, or another type).
    """
    if isinstance(path, list):
        raise TypeError(
            f"{who}: `path` is one place, got a list {path!r}. A pattern converts as one "
            "place (the core's `pattern=k`; an NNX or Equinox Stack knows its own); convert "
            "several places one per call (each returns a new tree, which the next takes)."
        )
    if isinstance(path, str):
        found = path
        for sep in seps[1:]:
            found = found.replace(sep, seps[0])
        keys = tuple(p for p in found.split(seps[0]) if p)
    elif isinstance(path, tuple) and all(isinstance(p, (str, int)) for p in path):
        keys = path
    else:
        keys = ()
    if not keys:
        joined = " or ".join(repr(s) for s in seps)
        raise TypeError(
            f"{who}: `path` must name a place, e.g. 'blocks' or 'model{seps[0]}blocks' (keys "
            f"joined by {joined}), or a tuple of keys ('model', 'blocks'); got {path!r}. "
            "Leave `path` out (None) for the whole tree."
        )
    return keys


def show(keys: Sequence[Any]) -> str:
    """``('model', 'blocks')`` as ``'model/blocks'``."""
    return repr("/".join(map(str, keys)))


def _step(node: Any, key: Any) -> tuple[bool, Any]:
    """``(found, index)``: the index that ``key`` names in ``node``, a dict or a sequence."""
    if isinstance(node, Mapping):
        for candidate in (key, str(key)) if isinstance(key, int) else (key,):
            if candidate in node:
                return True, candidate
        return False, None
    if isinstance(node, Sequence) and not isinstance(node, str):
        fields = getattr(node, "_fields", ())
        if isinstance(key, str) and key in fields:
            return True, fields.index(key)
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(index, int) and 0 <= index < len(node):
            return True, index
        return False, None
    raise TypeError(f"{type(node).__name__}")


def _listed(node: Any) -> str:
    if isinstance(node, Mapping):
        keys = [repr(k) for k in node][:12]
        return f"its keys: {', '.join(keys) or 'none'}"
    fields = getattr(node, "_fields", None)
    if fields:
        return f"its fields: {', '.join(fields)}"
    return f"a {type(node).__name__} of {len(node)}"


def get(tree: Any, keys: tuple, who: str, what: str = "tree") -> Any:
    """The value at ``keys`` in ``tree`` (dicts, lists and tuples on the way).

    Raises:
      ValueError: a key that is not there (the keys there listed).
      TypeError: a value on the way that is neither a dict nor a list or tuple.
    """
    node = tree
    for i, key in enumerate(keys):
        at = f"`{what}` at {show(keys[:i])}" if i else f"`{what}`"
        try:
            found, index = _step(node, key)
        except TypeError:
            raise TypeError(
                f"{who}: `path` {show(keys)} goes through dicts, lists and tuples, but {at} is "
                f"{describe(node)}; convert that part itself (pass it as `{what}`)."
            ) from None
        if not found:
            raise ValueError(
                f"{who}: `path` {show(keys)} is not in `{what}`: {at} has no {key!r} "
                f"({_listed(node)}). Give the place of the stacked part, e.g. the key of "
                "the blocks' params."
            )
        node = node[index]
    return node


def replace(tree: Any, keys: tuple, value: Any) -> Any:
    """A copy of ``tree`` with ``value`` at ``keys`` (which :func:`get` has checked): the
    containers on the way copied, keeping their types; the rest shared."""
    if not keys:
        return value
    _, index = _step(tree, keys[0])
    inner = replace(tree[index], keys[1:], value)
    if isinstance(tree, MutableMapping):
        new = copy.copy(tree)
        new[index] = inner
        return new
    if isinstance(tree, Mapping):  # an immutable mapping (flax's FrozenDict)
        return type(tree)({**tree, index: inner})
    items = list(tree)
    items[index] = inner
    if hasattr(tree, "_fields"):
        return type(tree)(*items)
    return type(tree)(items)
