"""Which leaves of stacked params a LoRA adapter or a quantizer takes.

``targets`` is given the same way everywhere: a predicate of ``(path, shape)`` (the leaf's
``jax.tree_util.keystr`` path and its shape per layer, without the layer axis), a sequence
of paths, or None (a default). A target must be a 2-D ``(in, out)`` weight per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from stackwise._core import checks

#: A predicate ``(path, per_layer_shape) -> bool``, or leaf paths (``"['attn']['q']"``).
Targets = Callable[[str, tuple], bool] | Sequence[str] | str | None


def leaf_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """``(keystr path, leaf)`` of every leaf, ``is_leaf`` nodes counted as leaves."""
    return [
        (jax.tree_util.keystr(path) or "<root>", leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)
    ]


def check_targets(targets: Any, who: str) -> Targets:
    """``targets`` if it is None, a predicate, a path or a sequence of paths; else TypeError."""
    if targets is None or callable(targets) or isinstance(targets, str):
        return targets
    if isinstance(targets, Sequence) and all(isinstance(t, str) for t in targets):
        return targets
    hint = (f" An int as the third argument: `block_size` is keyword-only, "
            f"`block_size={targets}`." if isinstance(targets, int) else "")
    raise TypeError(
        f"{who}: `targets` must be None, a predicate `(path, shape) -> bool` or leaf paths "
        f"(\"['attn']['q']\"), got {type(targets).__name__} {targets!r:.60}.{hint}"
    )


def select(
    leaves: list[tuple[str, Any]],
    targets: Targets,
    who: str,
    default: Callable[[str, Any], bool],
    arg: str = "targets",
    matrix: bool = True,
) -> list[bool]:
    """One bool per leaf: whether it is a target, each target checked to be 2-D per layer
    (unless ``matrix`` is False: the caller checks the shapes).

    ``default(path, leaf)`` decides when ``targets`` is None; ``arg`` is what the caller
    calls the targets in its messages.
    """
    targets = check_targets(targets, who)
    paths = [p for p, _ in leaves]
    if targets is None:
        chosen = [default(p, leaf) for p, leaf in leaves]
    elif callable(targets):
        chosen = []
        for path, leaf in leaves:
            got = targets(path, tuple(checks.leaf_shape(leaf, who, path)[1:]))
            if not isinstance(got, bool):
                raise TypeError(
                    f"{who}: the `targets` predicate must return a bool for each leaf, got "
                    f"{type(got).__name__} {got!r} for {path}; it is called as "
                    "`targets(path, shape)`, shape being the leaf's shape per layer."
                )
            chosen.append(got)
    else:
        wanted = [targets] if isinstance(targets, str) else list(targets)
        unknown = [w for w in wanted if w not in paths]
        if unknown:
            raise ValueError(
                f"{who}: `{arg}` names {unknown!r}, which are not leaf paths of "
                f"the params; the leaves are {paths}. Name them as `jax.tree_util.keystr` "
                "writes them, e.g. \"['attn']['q']\""
                + (", or pass a predicate `(path, shape) -> bool`." if arg == "targets" else ".")
            )
        chosen = [p in wanted for p in paths]
    if not any(chosen):
        raise ValueError(
            f"{who}: `{arg}` chose no leaf of the params (leaves: {paths}); name the "
            "weights to adapt, e.g. `targets=lambda path, shape: len(shape) == 2`."
        )
    for (path, leaf), take in zip(leaves, chosen):
        shape = tuple(checks.leaf_shape(leaf, who, path))
        if matrix and take and len(shape) != 3:
            raise ValueError(
                f"{who}: target leaf {path} has shape {shape}, {list(shape[1:])} per layer; "
                "a target must be a 2-D (in, out) weight per layer (stacked: (n, in, out)). "
                f"Reshape it to (in, out) inside the layer's params, or leave it out of "
                f"`{arg}`."
            )
    return chosen
