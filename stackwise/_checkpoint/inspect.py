"""What a checkpoint holds: per-layer or stacked, how deep, which pattern, which names."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from stackwise._checkpoint.read import open_checkpoint

__all__ = ["CheckpointLayout", "inspect_checkpoint"]


class CheckpointLayout(NamedTuple):
    """What :func:`inspect_checkpoint` finds in a checkpoint.

    Attributes:
      kind: ``"safetensors"``, ``"orbax"``, ``"npz"`` or ``"arrays"``.
      layout: ``"per-layer"`` (names with a layer index), ``"stacked"``
        (no layer index; most tensors share a leading axis, the depth), or
        ``"flat"`` (neither).
      depth: the number of layers, or None.
      pattern: the smallest k such that each per-layer name is in layers
        of whole residue classes mod k (1: every layer has every name).
      names: the per-layer names (``{}`` for the index, ``{:02d}`` for one
        zero-padded to two digits), sorted: the templates
        :func:`stackwise.load_checkpoint` takes.
      other: the other tensors' names, sorted.
    """

    kind: str
    layout: str
    depth: int | None
    pattern: int | None
    names: list[str]
    other: list[str]


def _templates(names: Sequence[str]) -> dict[str, dict[int, str]]:
    """Per-layer templates: a number that is a whole component of a name (``layers.3.w``,
    ``layers_3/w``, not ``ln1``) replaced by ``{}``, or by ``{:0Nd}`` where the numbers are
    zero-padded to N digits (``layers.03.w``); the widest kept."""
    runs: dict[tuple[str, str], dict[str, str]] = {}  # (before, after) -> {digits: name}
    for name in names:
        for m in re.finditer(r"(?<![^./_])\d+(?![^./])", name):  # a whole name component
            runs.setdefault((name[: m.start()], name[m.end() :]), {})[m.group()] = name
    options: dict[str, dict[int, str]] = {}
    for (before, after), numbers in runs.items():
        padded = {len(d) for d in numbers if len(d) > 1 and d.startswith("0")}
        spec = f"{{:0{max(padded)}d}}" if padded else "{}"
        template = before + spec + after
        options[template] = {int(d): n for d, n in numbers.items()
                             if template.format(int(d)) == n}  # written as it writes them
    # The layer index is the number run that varies most: widest templates first, each
    # name in one template.
    chosen: dict[str, dict[int, str]] = {}
    taken: set[str] = set()
    for t, found in sorted(options.items(), key=lambda tv: (-len(tv[1]), tv[0])):
        if len(found) > 1 and not taken & set(found.values()):
            chosen[t] = found
            taken |= set(found.values())
    return chosen


def inspect_checkpoint(source: Any) -> CheckpointLayout:
    """Says whether a checkpoint is per-layer or stacked, how deep, which pattern, which names.

    >>> import numpy as np, stackwise
    >>> arrays = {f"model.layers.{i}.mlp.weight": np.zeros((4, 2)) for i in range(6)}
    >>> arrays |= {f"model.layers.{i}.attn.weight": np.zeros(2) for i in range(0, 6, 3)}
    >>> layout = stackwise.inspect_checkpoint(arrays | {"lm_head.weight": np.zeros(2)})
    >>> layout.layout, layout.depth, layout.pattern
    ('per-layer', 6, 3)
    >>> layout.names, layout.other
    (['model.layers.{}.attn.weight', 'model.layers.{}.mlp.weight'], ['lm_head.weight'])

    Args:
      source: anything :func:`stackwise.open_checkpoint` opens.

    Returns:
      A :class:`CheckpointLayout`.
    """
    ckpt = open_checkpoint(source)
    names = sorted(ckpt.tensors)
    templates = _templates(names)
    covered = {n for found in templates.values() for n in found.values()}
    other = [n for n in names if n not in covered]
    if templates:
        depth = 1 + max(max(f) for f in templates.values())
        k = next(
            k
            for k in range(1, depth + 1)
            if all(set(f) == {i for i in range(depth) if i % k in {j % k for j in f}}
                   for f in templates.values())
        )
        return CheckpointLayout(ckpt.kind, "per-layer", depth, k, sorted(templates), other)
    leading = [s.shape[0] for s in ckpt.tensors.values() if len(s.shape) >= 2]
    if leading:
        d = max(set(leading), key=leading.count)
        if leading.count(d) * 2 > len(leading) and leading.count(d) > 1:
            return CheckpointLayout(ckpt.kind, "stacked", d, None, [], names)
    return CheckpointLayout(ckpt.kind, "flat", None, None, [], names)
