"""Which stacked leaves are quantized, and how: :func:`quantize` (and :func:`take`, a
lookup of rows in a quantized table), on :mod:`.quant`'s format."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core import checks
from stackwise._core.served import stacked_only
from stackwise._finetune.quant import (
    Quantized,
    block_size_of,
    check_block_size,
    check_double,
    check_kind,
    dequantize,
    doubled,
    is_quantized,
    quantize_rows,
)
from stackwise._finetune.targets import Targets, leaf_paths, select

__all__ = ["check_float", "is_float_matrix", "non_finite", "quantize", "take"]


def is_float_matrix(path: str, leaf: Any) -> bool:
    """The default target: a floating leaf that is 2-D per layer (3-D stacked)."""
    del path
    return len(np.shape(leaf)) == 3 and jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating)


def check_float(path: str, leaf: Any, who: str) -> np.dtype:
    """A target leaf's float dtype; refused if it is quantized already or not floating."""
    dtype = checks.leaf_dtype(leaf) if not is_quantized(leaf) else None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        got = "already quantized" if dtype is None else f"of dtype {np.dtype(dtype).name}"
        raise ValueError(
            f"{who}: target leaf {path} is {got}; only float weights are quantized. Leave "
            "it out of `targets`."
        )
    return np.dtype(dtype)


def _no_adapters(params: Any, who: str) -> None:
    """Refuses adapters (alone or attached) in ``params``: they stay float, they train."""
    from stackwise._finetune.lora import Adapted, LoraWeights  # lora imports this module

    node = lambda v: isinstance(v, (Adapted, LoraWeights))  # noqa: E731
    for path, leaf in leaf_paths(params, is_leaf=node):
        if node(leaf):
            raise TypeError(
                f"{who}: `params` holds LoRA adapters at {path}; adapters stay float (they "
                "are what trains). Quantize the base alone, then attach: "
                "`stackwise.lora.attach(stackwise.quant.quantize(base), adapters)`."
            )


@jax.jit
def _finite_layers(w: jax.Array) -> jax.Array:
    """Whether each layer of ``w (n, ...)`` is finite (one fused pass, no temporaries)."""
    return jnp.isfinite(w).all(axis=tuple(range(1, w.ndim)))


def _finite(path: str, leaf: Any, who: str) -> None:
    """Refuses a concrete weight holding NaN or inf: its block's scale would mean nothing."""
    if isinstance(leaf, jax.core.Tracer) or not getattr(leaf, "is_fully_addressable", True):
        return  # inside jit, or other processes' shards: the scales carry it (NaN or inf)
    bad = np.flatnonzero(~np.asarray(_finite_layers(leaf)))
    if bad.size:
        raise non_finite(path, bad.tolist(), who)


def non_finite(path: str, layers: list[int], who: str,
               targets: str = "leave the leaf out of `targets`") -> ValueError:
    """The error for a target leaf whose ``layers`` hold NaN or inf, as :func:`quantize` and
    ``load_checkpoint(quantize=)`` raise it."""
    return ValueError(
        f"{who}: target leaf {path} holds NaN or inf (layers {layers[:8]}); scaled by its "
        "absmax, every weight sharing its scale would be lost. Find where the non-finite "
        f"weights come from, or {targets}."
    )


def quantize(
    params: Any, kind: str = "int8", targets: Targets = None, *, block_size: int | None = None,
    double: bool | int = False, contract: Any = None, stacked: bool = True,
) -> Any:
    """Stacked params with their 2-D weights quantized per layer and output channel.

    Each target leaf ``(n, in, out)`` becomes a :class:`Quantized` node whose scales are
    ``(n, 1, out)``: layer i is quantized as the loop model's layer i would be, alone. The
    other leaves stay as they are. The layers are quantized one at a time
    (:func:`jax.lax.map`), so the float32 temporaries hold one layer. To quantize a
    checkpoint as it loads, without the float model whole in memory, pass ``quantize=`` to
    :func:`stackwise.load_checkpoint` (the same bits as this on its result).

    >>> import jax, jax.numpy as jnp, stackwise
    >>> params = {"w": jax.random.normal(jax.random.key(0), (4, 16, 8)), "b": jnp.zeros((4, 8))}
    >>> q = stackwise.quant.quantize(params, "nf4")
    >>> q["w"].codes.shape, q["w"].codes.dtype, q["w"].scale.shape   # packed along `in`
    ((4, 8, 8), dtype('uint8'), (4, 1, 8))
    >>> q["b"] is params["b"]
    True

    With ``block_size`` each block of that many inputs has its own scale per layer and
    output channel (QLoRA quantizes nf4 in blocks of 64):

    >>> q = stackwise.quant.quantize(params, "nf4", block_size=4)
    >>> q["w"].scale.shape, q["w"].block_size
    ((4, 4, 8), 4)

    With ``double=True`` (QLoRA's double quantization) the scales are stored in 8 bits too:
    ``scale`` holds int8 codes of the scales' logarithms, each layer's mean log-scale is
    ``scale_offset`` and each block of 256 of its centred log-scales (here 32 a block) has
    a float32 ``scale_step``; each scale is within a factor ``exp(step / 2)`` of its own:

    >>> d = stackwise.quant.quantize(params, "nf4", block_size=4, double=32)
    >>> d["w"].scale.dtype, d["w"].scale_step.shape, d["w"].scale_offset.shape
    (dtype('int8'), (4, 1), (4,))
    >>> err = abs(jnp.log(d["w"].float_scale / q["w"].scale)).max() / d["w"].scale_step.max()
    >>> bool(err <= 0.5 + 1e-4)                           # half a second-level step
    True

    A fused projection ``(n, E, H, D)`` contracted along E is its ``(n, E, H * D)``
    reshape, quantized, without reshaping by hand:

    >>> qkv = {"p": jax.random.normal(jax.random.key(1), (4, 16, 2, 3))}
    >>> p = stackwise.quant.quantize(qkv, "nf4", contract=0, block_size=8)["p"]
    >>> p.shape, p.codes.shape
    ((4, 16, 2, 3), (4, 8, 6))
    >>> by_hand = stackwise.quant.quantize({"p": qkv["p"].reshape(4, 16, 6)}, "nf4",
    ...                                    block_size=8)["p"]
    >>> bool((stackwise.quant.dequantize(p).reshape(4, 16, 6)
    ...       == stackwise.quant.dequantize(by_hand)).all())
    True

    Args:
      params: stacked params (leading layer axis on every leaf), e.g. ``Stacked.init``'s.
        For a pattern, quantize each position's tree.
      kind: ``"int8"`` (codes -127..127, scale ``absmax / 127``), ``"int4"`` (-7..7, scale
        ``absmax / 7``) or ``"nf4"`` (QLoRA's NormalFloat codes, scale ``absmax``).
      targets: which leaves: a predicate ``(path, per_layer_shape) -> bool``, leaf paths
        (``"['attn']['q']"``), or None for every floating leaf that is 2-D per layer.
      block_size: None for one scale per layer and output channel (the absmax of the whole
        input axis), or B: one per layer, output channel and B consecutive inputs (scales
        ``(n, in / B, out)``). B must divide every target's ``in``; nothing is padded.
      double: double quantization (QLoRA's, Dettmers et al. 2023, section 3): False (float32
        scales), True (k = 256) or an int k. Each layer's scales (positive), as logarithms
        and flattened row-major, have their mean subtracted (``scale_offset``, float32), and
        each k consecutive centred log-scales (the layer's last block may be shorter) are
        stored as int8 codes -127..127 with a float32 step ``absmax / 127`` of the block
        (``scale_step``); a scale decodes as ``exp(code * step + offset)``. Int8 codes of
        the logarithms rather than QLoRA's FP8 codes of the centred scales: the same 8 bits
        and memory, an error bound of one number per block, and a relative precision that
        an outlier does not spoil. (Of the scales themselves, a uniform step would let one
        outlier scale coarsen its 255 neighbours: measured, 1024 x 1024 normal weights in
        blocks of 64 with one weight of 200, its block's scales within 42%; of their
        logarithms, within 1.7%, and 0.28% without the outlier.) bitsandbytes' double
        quantization is likewise an 8-bit blockwise code with an fp32 scale per 256 and
        the mean offset, of a dynamic (exponent-like) map.
        Each decoded scale is within a factor ``exp(step / 2)`` of the float32 one
        (``|s' - s| <= s * (exp(step / 2) - 1)``, plus float32 rounding of the log and the
        exp), so a weight is within ``c * s * (exp(step / 2) - 1)`` of its singly-quantized
        value, ``c`` the largest level: 1 for nf4, 7 for int4, 127 for int8. Memory, nf4
        in blocks of 64: ``4 + 8 / 64 + 32 / (64 * 256) = 4.127`` bits per weight, against
        ``4 + 32 / 64 = 4.5`` (plus one float32 offset per layer). A weight that is NaN or
        inf (under ``jit``) makes its layer's offset, so the whole layer, dequantize to
        non-finite numbers (not its column only).
      contract: which axes of each weight (its own shape, without the layer axis) inputs
        are multiplied along: None (each target a 2-D ``(in, out)`` weight, contracted
        along ``in``), an axis or a tuple of axes for every target, or a dict of leaf
        paths to axes. A weight of any rank is quantized as the ``(in, out)`` matrix of
        its contracted axes (flattened, in their order) by the others: blocks of
        ``block_size`` run along the flattened contracted axes, and :func:`dequantize`
        gives it back in its own shape, as quantizing its reshape by hand would (an
        ``(E, H, D)`` projection with ``contract=0`` is its ``(E, H * D)`` reshape). A
        ``(V, D)`` embedding table with ``contract=1`` has each token's row scaled along
        D, so :func:`take` dequantizes the looked-up rows only. With ``contract``, the
        default targets are every float leaf of rank 2 or more per weight (one tuple for
        all) or the leaves a dict names. LoRA adapters go on 2-D weights only.
      stacked: True (every leaf has the layer axis first), or False: each target is one
        weight without a layer axis, e.g. an embedding table or a head outside the stack
        (its node's leaves have no layer axis either).

    Returns:
      The params, each target leaf a :class:`Quantized` node.

    Raises:
      ValueError: an unknown ``kind``, a target that is not 2-D per layer, not floating,
        already quantized, holding NaN or inf (eager; under ``jit`` its block's scale is
        non-finite), or no target at all; a ``block_size`` below 1 or not dividing a
        target's ``in``; ``double`` below 1; a target of rank other than 2 without
        ``contract``, or ``contract`` axes out of range, repeated or leaving no output axis.
      TypeError: a ``block_size`` that is not an int, ``double`` neither a bool nor an
        int, ``contract`` neither axes nor a dict of paths to axes, ``stacked`` not a
        bool, ``targets`` of another type (an int given as the third argument), or
        adapters in ``params`` (quantize the base alone).
    """
    who = "stackwise.quant.quantize"
    stacked_only(who, params=params)
    check_kind(kind, who)
    block_size = check_block_size(block_size, who)
    double = check_double(double, who)
    stacked = _check_stacked(stacked, who)
    contract_of = _check_contract(contract, who)
    _no_adapters(params, who)
    leaves = leaf_paths(params, is_leaf=is_quantized)
    lead = 1 if stacked else 0

    def default(path, leaf):
        # 2-D float weights; with `contract`, the leaves it names (a dict) or every float
        # leaf of rank 2 or more (one tuple of axes for all).
        rank = len(np.shape(leaf)) - lead
        named = path in contract if isinstance(contract, dict) else (
            contract is not None and rank >= 2)
        return (named or rank == 2) and not is_quantized(leaf) and \
            jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating)

    chosen = select(leaves, targets, who, default, matrix=False)
    plans = [_plan(path, tuple(np.shape(leaf))[lead:], contract_of(path), block_size,
                   stacked, who) if take else None
             for (path, leaf), take in zip(leaves, chosen)]
    out = []
    for (path, leaf), plan in zip(leaves, plans):
        if plan is None:
            out.append(leaf)
            continue
        axes, rows, block = plan
        dtype = check_float(path, leaf, who)
        w = jnp.asarray(leaf) if stacked else jnp.asarray(leaf)[None]
        _finite(path, w, who)
        codes, scale = quantize_rows(w, kind, block, axes)
        node = doubled(Quantized(codes, scale, kind, dtype.name, rows, axes=axes,
                                 weight_shape=w.shape[1:] if axes else ()), double)
        out.append(node if stacked else jax.tree.map(lambda v: v[0], node))
    treedef = jax.tree.structure(params, is_leaf=is_quantized)
    return jax.tree.unflatten(treedef, out)


def _check_stacked(stacked: Any, who: str) -> bool:
    if not isinstance(stacked, bool):
        raise TypeError(
            f"{who}: `stacked` must be a bool (False: each target is one weight without a "
            f"layer axis, e.g. an embedding table), got {type(stacked).__name__} {stacked!r}."
        )
    return stacked


def _axes(value: Any, who: str, where: str) -> tuple[int, ...]:
    """An int or a sequence of ints as a tuple, else a TypeError naming ``contract``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, (tuple, list)) and value and all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in value):
        return tuple(int(a) for a in value)
    raise TypeError(
        f"{who}: `contract`{where} must be an axis or a tuple of axes of the weight (without "
        "the layer axis) that inputs are multiplied along, e.g. 0 for (in, out), (0, 1) for "
        f"an (H, Dh, D) projection; got {type(value).__name__} {value!r}."
    )


def _check_contract(contract: Any, who: str):
    """``contract`` as a function of a leaf's path: its contracted axes, or None."""
    if contract is None:
        return lambda path: None
    if isinstance(contract, dict):
        checked = {}
        for path, axes in contract.items():
            if not isinstance(path, str):
                raise TypeError(
                    f"{who}: `contract` maps leaf paths (as `jax.tree_util.keystr` writes "
                    f"them, \"['attn']['o']\") to axes; got the key {path!r}."
                )
            checked[path] = _axes(axes, who, f"[{path!r}]")
        return checked.get
    axes = _axes(contract, who, "")
    return lambda path: axes


def _plan(path: str, shape: tuple, axes: tuple | None, block_size: int | None, stacked: bool,
          who: str) -> tuple[tuple, int, int]:
    """A target's ``(axes as stored, rows, block)``: its contracted axes checked against its
    own ``shape`` (``()`` for a 2-D weight contracted along its first axis, the default)."""
    per = "per layer" if stacked else "(a weight without a layer axis: `stacked=False`)"
    if len(shape) < 2:
        raise ValueError(
            f"{who}: target leaf {path} has shape {shape} {per}, not a 2-D (in, out) "
            "weight nor one of higher rank: a vector has no axis to scale along. Leave it "
            "out of `targets`."
        )
    if axes is None:
        if len(shape) != 2:
            raise ValueError(
                f"{who}: target leaf {path} has shape {shape} {per}, not a 2-D (in, out) "
                f"weight; name the axes that inputs are multiplied along: `contract="
                f"{{{path!r}: (0,)}}` (e.g. (0,) for a (D, H, Dh) projection, (0, 1) for an "
                "(H, Dh, D) one), or leave it out of `targets`."
            )
        return (), shape[0], block_size_of(block_size, shape[0], path, who)
    rank = len(shape)
    fixed = tuple(a + rank if -rank <= a < 0 else a for a in axes)
    if any(not 0 <= a < rank for a in fixed) or len(set(fixed)) != len(fixed) or \
            len(fixed) >= rank:
        raise ValueError(
            f"{who}: `contract` gives target leaf {path} the axes {axes}, but its weight has "
            f"shape {shape} {per}: give distinct axes in range({rank}) (negative ones count "
            "from the end), leaving at least one axis uncontracted (the outputs)."
        )
    rows = math.prod(shape[a] for a in fixed)
    block = block_size_of(block_size, rows, path, who)
    return (() if fixed == (0,) and rank == 2 else fixed), rows, block


def take(node: Quantized, ids: Any) -> jax.Array:
    """The rows ``ids`` of a quantized embedding table, dequantized alone.

    The table ``(V, D)`` is quantized along D (``contract=1``: each token's row has its own
    scales, in blocks of D), so a lookup gathers the codes and scales of its rows only and
    dequantizes those: ``take(q, ids)`` is ``dequantize(q)[ids]``, bitwise (under ``jit``,
    where XLA may fuse the product otherwise, within a float32 rounding), without the rest
    of the table in floats. Stacked tables ``(n, V, D)`` give ``(n, *ids.shape, D)``.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> table = jax.random.normal(jax.random.key(0), (10, 8))           # (V, D)
    >>> q = stackwise.quant.quantize({"e": table}, "nf4", contract=1, stacked=False,
    ...                              block_size=4, double=True)["e"]
    >>> ids = jnp.array([[3, 1], [7, 7]])
    >>> stackwise.quant.take(q, ids).shape
    (2, 2, 8)
    >>> bool((stackwise.quant.take(q, ids) == stackwise.quant.dequantize(q)[ids]).all())
    True

    Raises:
      TypeError: ``node`` is not a :class:`Quantized` node, or ``ids`` not integers.
      ValueError: a table not quantized along its second axis (``contract=1``).
    """
    who = "stackwise.quant.take"
    if not is_quantized(node):
        raise TypeError(f"{who}: `node` must be a stackwise.quant.Quantized table, got "
                        f"{type(node).__name__}.")
    if node.axes != (1,) or len(node.weight_shape) != 2:
        got = f"axes {node.axes}" if node.axes else "its first axis (the default)"
        raise ValueError(
            f"{who}: the table is quantized along {got} of its weight shape "
            f"{node.shape[-2:] if not node.axes else node.weight_shape}; a lookup gathers "
            "rows, which needs each row's own scales: quantize the (V, D) table along D, "
            "`stackwise.quant.quantize(params, kind, targets, contract=1, stacked=False)`."
        )
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{who}: `ids` must be integer token ids, got dtype {ids.dtype}.")
    flat = ids.reshape(-1)
    vocab = node.codes.shape[-1]
    scale = node.scale[..., flat]
    if node.double:  # each gathered scale decoded alone: its own step and the offset
        blocks = node.scale.shape[-2]
        where = jnp.arange(blocks)[:, None] * vocab + flat[None, :]
        step = jnp.take(node.scale_step, where // node.double, axis=-1)
        scale = jnp.exp(scale.astype(jnp.float32) * step + node.scale_offset[..., None, None])
    rows = Quantized(node.codes[..., flat], scale, node.kind, node.dtype, node.rows)
    out = jnp.swapaxes(dequantize(rows), -1, -2)  # (..., k, D)
    return out.reshape(*out.shape[:-2], *ids.shape, out.shape[-1])
