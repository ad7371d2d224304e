"""A batch of adapters of one base: :func:`stackwise.lora.stack_adapters`, run as groups
(``attach(base, batch)``: group j of ``x``'s leading axis with adapter j) or as rows
(``attach(base, batch, rows=idx)``: multi-LoRA serving, :mod:`.rows`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core.served import stacked_only
from stackwise._finetune.lora import is_lora

__all__ = ["stack_adapters"]


def stack_adapters(adapters: Sequence[Any]) -> Any:
    """A batch of adapters of one base: every ``a`` / ``b`` gains a leading axis g.

    Attached (:func:`attach`), layer ``i`` of example group ``j`` uses adapter ``j``: the
    stack's input ``x`` then has g on its leading axis. It runs on
    :func:`stackwise.lora.stack` and, attached with ``per_leaf=True``, on every framework
    Stack (``docs/finetune.md``), the base shared by the groups, never copied.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((3, 4, 4))}
    >>> one, two = (stackwise.lora.init(jax.random.key(s), base, rank=2) for s in (0, 1))
    >>> stackwise.lora.stack_adapters([one, two])["w"].a.shape
    (2, 3, 4, 2)

    Raises:
      ValueError: fewer than one adapter, or adapters of other structures, shapes or alphas.
    """
    who = "stackwise.lora.stack_adapters"
    adapters = list(adapters)
    stacked_only(who, **{f"adapters[{i}]": a for i, a in enumerate(adapters)})
    if not adapters:
        raise ValueError(f"{who}: give at least one adapter tree.")
    first = jax.tree_util.tree_leaves_with_path(adapters[0])
    ranks = [(path, lw.rank) for path, lw in jax.tree_util.tree_leaves_with_path(
        adapters[0], is_leaf=is_lora) if is_lora(lw)]
    for i, other in enumerate(adapters[1:], 1):
        theirs = [lw.rank for lw in jax.tree.leaves(other, is_leaf=is_lora) if is_lora(lw)]
        for (path, rank), their in zip(ranks, theirs):
            if their != rank:
                raise ValueError(
                    f"{who}: adapters[{i}]{jax.tree_util.keystr(path)} has rank {their} "
                    f"where adapters[0] has rank {rank}: a batch holds adapters of one rank "
                    "(its a and b are stacked); serve adapters of another rank in a batch "
                    "of their own, `stackwise.lora.stack_adapters([...])` per rank."
                )
        if jax.tree.structure(other) != jax.tree.structure(adapters[0]):
            raise ValueError(
                f"{who}: adapters {i} differ from adapters 0 in structure or alpha "
                "(targets, alpha, rsLoRA, dropout): a batch needs adapters made alike, e.g. "
                "by `stackwise.lora.init` with the same rank, alpha, dropout and targets."
            )
        for (path, v0), v in zip(first, jax.tree.leaves(other)):
            if np.shape(v) != np.shape(v0):
                raise ValueError(
                    f"{who}: adapters[{i}]{jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(v)} where adapters[0] has {np.shape(v0)}: a batch needs "
                    "adapters of one rank, depth and targets (`stackwise.lora.init` with "
                    "the same rank from the same base); serve adapters of another rank "
                    "in a batch of their own."
                )
    return jax.tree.map(lambda *vs: jnp.stack(vs), *adapters)
