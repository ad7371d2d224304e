"""Training only the adapters: the trainable/frozen split and the optimizer's masks.

Every leaf inside a :class:`LoraWeights` is trainable; every other leaf (the base, its
quantized codes and scales, anything else in the tree) is frozen. Dropout keys
(``attach(..., key=)``) are neither: they belong to one step, so :func:`split` leaves them
out and :func:`combine` takes the next step's.
"""

from __future__ import annotations

from typing import Any

import jax

from stackwise._core import checks
from stackwise._core.served import stacked_only
from stackwise._finetune.lora import is_lora, rekey
from stackwise._finetune.quant import is_quantized

__all__ = ["combine", "layer_axes", "mask", "split"]


def _per_leaf(tree: Any, inside: Any, outside: Any, whole: Any = lambda v: False) -> Any:
    """``tree`` with each leaf of a LoraWeights ``inside(leaf, lw)`` and others ``outside``;
    a node for which ``whole`` holds is one leaf (``outside`` of the node itself)."""
    return jax.tree.map(
        lambda v: jax.tree.map(lambda leaf: inside(leaf, v), v) if is_lora(v) else outside(v),
        tree,
        is_leaf=lambda v: is_lora(v) or whole(v),
    )


def mask(tree: Any) -> Any:
    """A bool per leaf: True for the adapters' ``a`` / ``b``, False for everything else.

    For an optimizer that sees the whole tree, base included:
    ``optax.multi_transform({True: tx, False: optax.set_to_zero()}, mask)`` gives the base
    zero updates (``optax.masked(tx, mask)`` alone would pass the base's gradients through
    as its updates).

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((2, 4, 4)), "b": jnp.zeros((2, 4))}
    >>> model = stackwise.lora.attach(base, stackwise.lora.init(jax.random.key(0), base, rank=1))
    >>> jax.tree.leaves(stackwise.lora.mask(model))   # base b, base w, adapter a, adapter b
    [False, False, True, True]
    """
    return _per_leaf(tree, lambda leaf, lw: True, lambda v: False)


def split(tree: Any) -> tuple[Any, Any]:
    """``(trainable, frozen)``: the tree twice, each with None where the other has leaves.

    Differentiate with respect to ``trainable`` only and put the halves back together with
    :func:`combine`; nothing is copied. Dropout keys the tree holds (``attach(..., key=)``)
    are in neither half: give each step's to :func:`combine`.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((2, 4, 4))}
    >>> model = stackwise.lora.attach(base, stackwise.lora.init(jax.random.key(0), base, rank=1))
    >>> trainable, frozen = stackwise.lora.split(model)
    >>> [v.shape for v in jax.tree.leaves(trainable)], [v.shape for v in jax.tree.leaves(frozen)]
    ([(2, 4, 1), (2, 1, 4)], [(2, 4, 4)])
    >>> stackwise.lora.combine(trainable, frozen).base["w"] is base["w"]
    True

    Raises:
      ValueError: the tree holds no adapters (nothing would train; a quantized base given
        whole to an optimizer is the mistake this guards).
    """
    if not any(is_lora(v) for v in jax.tree.leaves(tree, is_leaf=is_lora)):
        raise ValueError(
            "stackwise.lora.split: the tree holds no adapters (no `LoraWeights`), so its "
            "trainable half would be empty and its frozen half the whole model. Attach them "
            "first: `params = stackwise.lora.attach(base, stackwise.lora.init(key, base, "
            "rank=r))`, then `trainable, frozen = stackwise.lora.split(params)`."
        )
    # A quantized weight is frozen whole: the trainable half holds None there, not an
    # empty `Quantized` (which an optimizer would refuse as a quantized leaf).
    tree = rekey(tree, None)  # (a step's dropout keys: neither trained nor kept)
    trainable = _per_leaf(tree, lambda leaf, lw: leaf, lambda v: None, is_quantized)
    frozen = _per_leaf(tree, lambda leaf, lw: None, lambda v: v, is_quantized)
    return trainable, frozen


def combine(trainable: Any, frozen: Any, *, key: jax.Array | None = None) -> Any:
    """The tree :func:`split` was given, from its two halves.

    With ``key`` (a new one each step), adapters with a dropout rate drop their input while
    training, as ``stackwise.lora.attach(..., key=key)`` makes them (the same keys for the
    same tree); without one, nothing is dropped, and differentiating adapters that drop is
    refused.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((2, 4, 4))}
    >>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=1, dropout=0.1)
    >>> trainable, frozen = stackwise.lora.split(stackwise.lora.attach(base, adapters))
    >>> stackwise.lora.combine(trainable, frozen, key=jax.random.key(1)).keys.shape
    (2,)

    Raises:
      ValueError: the halves are not the two halves of one tree.
      TypeError: ``key`` is not one PRNG key.
    """
    who = "stackwise.lora.combine"
    key = None if key is None else checks.prng_key(key, who)
    try:
        tree = jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen,
                            is_leaf=lambda v: v is None)
    except ValueError as e:
        raise ValueError(
            f"{who}: the two halves do not have one structure; pass the "
            f"`(trainable, frozen)` that `stackwise.lora.split` gave: {e}"
        ) from None
    return tree if key is None else rekey(tree, key)


def layer_axes(tree: Any) -> Any:
    """How many leading layer axes each leaf has, for ``stackwise.optax.layerwise(tx, stacked=)``.

    1 for every stacked leaf; 2 for a batch of adapters (``(g, n, ...)``: each of the g
    adapters' layers is its own matrix for a per-layer optimizer, like a stack of stacks).

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((2, 4, 4))}
    >>> one = stackwise.lora.init(jax.random.key(0), base, rank=1)
    >>> jax.tree.leaves(stackwise.lora.layer_axes(stackwise.lora.stack_adapters([one, one])))
    [2, 2]
    """
    stacked_only("stackwise.lora.layer_axes", tree=tree)
    return _per_leaf(tree, lambda leaf, lw: 2 if lw.a.ndim == 4 else 1, lambda v: 1)
