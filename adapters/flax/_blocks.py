"""A linen block as the Stack builds it: its class, a fresh unbound copy, a pattern's names.

The Stack (``_stack.py``) builds and names its blocks with these, and
:func:`stackwise.flax.convert` (``_correspond.py``) tells a pattern's
positions apart with the same, so that both always agree.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn

__all__ = ["block_class", "fresh_block", "position_names"]


def block_class(block: Any) -> type:
    """The module class of a block given as a class, a partial of one or a template."""
    while isinstance(block, functools.partial):
        block = block.func
    return block if isinstance(block, type) else type(block)


def fresh_block(block: Any, who: str) -> nn.Module:
    """An unbound copy of the block, never attached to the surrounding module."""
    if isinstance(block, nn.Module):
        return block.clone(parent=None, name=None)
    try:
        return block(parent=None)
    except TypeError as e:
        cls = block_class(block).__name__
        raise TypeError(
            f"{who}: building the block failed: {e}. The Stack builds it as "
            f"`{cls}()`: give its fields with `functools.partial({cls}, ...)` or a template "
            f"instance, `Stack({cls}(...), n)`."
        ) from None


def position_names(blocks: list) -> list[str]:
    """Natural names of a pattern's positions: ``A_0``, ``A_1``, ``B_0`` (linen's own)."""
    seen: dict[str, int] = {}
    names = []
    for block in blocks:
        cls = block_class(block).__name__
        names.append(f"{cls}_{seen.get(cls, 0)}")
        seen[cls] = seen.get(cls, 0) + 1
    return names
