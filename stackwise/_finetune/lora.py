"""Stacked low-rank adapters: made per layer, attached to a frozen base, merged into it.

An adapter on a stacked weight ``W`` of shape ``(n, in, out)`` is a :class:`LoraWeights`
pair ``a (n, in, r)``, ``b (n, r, out)``: layer i uses ``W[i] + scale * a[i] @ b[i]`` with
``scale = alpha / r`` (``alpha / sqrt(r)`` with ``rslora=True``); a DoRA adapter also holds
a magnitude ``m (n, out)``, and layer i uses ``(W[i] + scale * a[i] @ b[i]) * m[i] / norm``,
the norm taken per output column. The adapters are a tree shaped like the base's params,
with :class:`LoraWeights` at the target leaves and None elsewhere; :func:`attach` pairs them
with the base (which is never copied) for :func:`stackwise.lora.wrap` to run. An adapter
with a ``dropout`` rate p (PEFT's ``lora_dropout``), attached with a key, trains as PEFT
trains it: ``x @ W + scale * (dropout(x) @ a) @ b`` (:mod:`.dropout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core import checks
from stackwise._core.options import check_bool
from stackwise._core.served import stacked_only
from stackwise._finetune.quant import dequantize, is_quantized
from stackwise._finetune.targets import Targets, leaf_paths, select

__all__ = ["Adapted", "LoraWeights", "add", "attach", "check_rate", "check_shapes", "column_norms",
           "delta", "dora_scaled", "float_adapter", "float_dtype", "init", "layer_keys",
           "lora_scale", "pairs", "plain_tree", "rekey", "scaled_update"]


@dataclass(frozen=True)
class LoraWeights:
    """One stacked weight's adapter: ``a (n, in, r)`` and ``b (n, r, out)``.

    A batch of g adapters (:func:`stack_adapters`) has ``a (g, n, in, r)``,
    ``b (g, n, r, out)``. ``alpha`` and ``rslora`` are static: the update is
    ``scale * a @ b``, ``scale = alpha / r``, or rank-stabilised LoRA's
    ``alpha / sqrt(r)`` with ``rslora=True`` (PEFT's ``use_rslora``). A DoRA adapter (PEFT's
    ``use_dora``) also holds ``magnitude`` ``(n, out)``: the adapted weight
    ``V = W + scale * a @ b`` is rescaled to ``V * magnitude / |V|``, ``|V|`` each output
    column's norm, held constant for gradients (DoRA's section 4.3, as PEFT does).
    ``dropout`` (static; PEFT's ``lora_dropout``) is the probability p with which each
    element of the adapter's input is dropped while training, the rest scaled by
    ``1 / (1 - p)``: attached with a key (``attach(..., key=)``), each product ``x @ W`` of
    the layer becomes ``x @ W + scale * (dropout(x) @ a) @ b``; without one (inference) the
    adapter runs as if p were 0, and differentiating it is refused.

    >>> import jax.numpy as jnp, stackwise
    >>> a, b = jnp.ones((2, 8, 4)), jnp.zeros((2, 4, 8))
    >>> LoraWeights = stackwise.lora.LoraWeights
    >>> LoraWeights(a, b, 8.0).scale, LoraWeights(a, b, 8.0, rslora=True).scale
    (2.0, 4.0)
    """

    a: jax.Array
    b: jax.Array
    alpha: float = 1.0
    rslora: bool = False
    magnitude: jax.Array | None = None
    dropout: float = 0.0

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    @property
    def dora(self) -> bool:
        return self.magnitude is not None

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.rslora)


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling, as its ``LoraLayer.update_layer`` computes it in Python floats:
    ``alpha / r``, or ``alpha / math.sqrt(r)`` for rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


jax.tree_util.register_dataclass(LoraWeights, data_fields=["a", "b", "magnitude"],
                                 meta_fields=["alpha", "rslora", "dropout"])


def check_rate(p: Any, who: str, arg: str = "dropout") -> float:
    """A dropout rate (PEFT's ``lora_dropout``) as a float in [0, 1), else an error naming
    ``arg``."""
    if isinstance(p, bool) or not isinstance(p, (int, float, np.number)):
        raise TypeError(f"{who}: `{arg}` must be a number in [0, 1), PEFT's lora_dropout "
                        f"(e.g. 0.05), got {type(p).__name__} {p!r}.")
    if not 0 <= p < 1:
        raise ValueError(
            f"{who}: `{arg}` is {p!r}; it is the probability that each element of the "
            "adapters' input is dropped while training (PEFT's lora_dropout), a number in "
            "[0, 1): 0 drops none, and 1 would drop every input, so the adapters would never "
            "train (e.g. 0.05 or 0.1)."
        )
    return float(p)


def layer_keys(key: jax.Array, node: int, n: int) -> jax.Array:
    """The dropout keys of the ``node``-th attached node of a tree, one per layer (``(n,)``):
    ``jax.random.split(jax.random.fold_in(key, node), n)``, typed keys. Inside layer i, the
    node's base leaf j draws from ``fold_in(keys[i], j)`` (:mod:`.dropout`)."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return jax.random.split(jax.random.fold_in(key, node), n)


def is_lora(value: Any) -> bool:
    return isinstance(value, LoraWeights)


@jax.tree_util.register_pytree_with_keys_class
class Adapted:
    """A frozen base and its adapters, as one params tree for ``Stacked.apply``.

    Made by :func:`attach`, which checks them; its children are ``base``, ``adapters``
    (a batch of g adapters is held layer axis first, ``(n, g, ...)``, so that the scan
    slices layers) and ``rows`` (with ``attach(..., rows=...)``: each batch row's adapter
    index, held once per layer, ``(n, batch)``; else None) and ``keys`` (with
    ``attach(..., key=)`` and adapters with a ``dropout`` rate: one dropout key per layer,
    ``(n,)``; else None); ``groups`` is static (g, or None for one adapter).
    """

    __slots__ = ("adapters", "base", "groups", "keys", "rows")

    def __init__(self, base: Any, adapters: Any, groups: int | None = None, rows: Any = None,
                 keys: Any = None):
        self.base, self.adapters, self.groups, self.rows = base, adapters, groups, rows
        self.keys = keys

    def tree_flatten_with_keys(self):
        names = ("base", "adapters", "rows", "keys")
        children = (self.base, self.adapters, self.rows, self.keys)
        return tuple((jax.tree_util.GetAttrKey(k), v) for k, v in zip(names, children)), \
            self.groups

    @classmethod
    def tree_unflatten(cls, groups, children):
        base, adapters, rows, keys = children
        return cls(base, adapters, groups, rows, keys)

    def __repr__(self) -> str:
        per_row = "" if self.rows is None else ", rows=..."
        keyed = "" if self.keys is None else ", keys=..."
        return f"stackwise.lora.Adapted(groups={self.groups}{per_row}{keyed})"

    def rates(self) -> list[float]:
        """The dropout rate of each of the node's adapters (0 where a leaf has none)."""
        return [lw.dropout for lw in jax.tree.leaves(self.adapters, is_leaf=is_lora)
                if is_lora(lw)]

    def with_keys(self, key: jax.Array | None, node: int) -> Adapted:
        """The node with its layers' dropout keys from ``key`` (:func:`layer_keys`; none
        without a key, or without an adapter that drops)."""
        if key is None or not any(self.rates()):
            return Adapted(self.base, self.adapters, self.groups, self.rows)
        n = jax.tree.leaves(self.base, is_leaf=is_quantized)[0].shape[0]
        return Adapted(self.base, self.adapters, self.groups, self.rows,
                       layer_keys(key, node, n))


def _uniform(keys: jax.Array, shape: tuple, dtype: Any, bound: float) -> jax.Array:
    """One ``uniform(-bound, bound)`` array of ``shape`` per key, stacked."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape, dtype, -bound, bound))(keys)


def _rank(rank: Any, who: str) -> int:
    return checks.integer(rank, who, "rank", minimum=1)


def float_dtype(dtype: Any, who: str) -> Any:
    """``dtype`` (the adapters') if None or a floating dtype, else an error naming it."""
    if dtype is None:
        return None
    try:
        kind = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"{who}: `dtype` must be a dtype or None, got {dtype!r}.") from None
    if not jnp.issubdtype(kind, jnp.floating):
        raise ValueError(
            f"{who}: `dtype` is {kind.name}; adapters are trained floats, and integers would "
            "truncate them: give a float dtype (float32, bfloat16) or None."
        )
    return kind


def plain_tree(tree: Any, arg: str, who: str) -> None:
    """Refuses an :class:`Adapted` node in ``tree`` (a base or adapters wanted alone)."""
    for path, leaf in leaf_paths(tree, is_leaf=lambda v: isinstance(v, Adapted)):
        if isinstance(leaf, Adapted):
            raise TypeError(
                f"{who}: `{arg}` holds base and adapters attached at {path} "
                "(`stackwise.lora.attach`); give the "
                + ("adapters alone: `params.adapters`, or the tree from `stackwise.lora.init`."
                   if arg == "adapters" else
                   "base alone (`params.base`), and attach the adapters afterwards.")
            )


def init(
    key: jax.Array,
    params: Any,
    *,
    rank: int,
    alpha: float | None = None,
    rslora: bool = False,
    dora: bool = False,
    dropout: float = 0.0,
    targets: Targets = None,
    dtype: Any = None,
) -> Any:
    """Adapters for the target leaves of stacked params: ``b`` zero, ``a`` from one key per layer.

    For a target ``(n, in, out)`` (float, or :class:`stackwise.quant.Quantized`), layer i's
    ``a[i]`` is uniform in ``±1/sqrt(in)`` (PEFT's default) from its own key, and ``b`` is
    zero, so the adapted model starts equal to the base.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((4, 16, 8)), "b": jnp.zeros((4, 8))}
    >>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=2, alpha=4.0)
    >>> adapters["w"].a.shape, adapters["w"].b.shape, adapters["w"].scale, adapters["b"]
    ((4, 16, 2), (4, 2, 8), 2.0, None)

    Args:
      key: one PRNG key; each target leaf and layer gets its own key from it.
      params: the stacked base (for a pattern: a tuple of stacked trees, each position's
        leaves with their own depth).
      rank: r, at most ``min(in, out)`` of every target.
      alpha: the scale's numerator (``scale = alpha / rank``); default ``rank`` (scale 1).
      rslora: rank-stabilised LoRA's scale, ``alpha / sqrt(rank)`` (PEFT's ``use_rslora``).
      dora: DoRA (PEFT's ``use_dora``): each adapter also holds a magnitude per output
        column, ``magnitude (n, out)``, starting at the base's column norms (so the adapted
        model starts equal to the base). Weights are used as ``x @ W`` (columns are outputs).
      dropout: PEFT's ``lora_dropout``, in [0, 1): attached with a key
        (``attach(..., key=)``), each adapter's input is dropped with this probability while
        training (:class:`LoraWeights`); 0 (the default) drops none.
      targets: a predicate ``(path, per_layer_shape) -> bool``, leaf paths, or None for
        every float (or quantized) leaf that is 2-D per layer: integer leaves are no target.
      dtype: the adapters' dtype; default the base leaf's float dtype (float32 for a
        quantized leaf).

    Returns:
      A tree shaped like ``params``: :class:`LoraWeights` at targets, None elsewhere.

    Raises:
      TypeError: ``key`` is not one PRNG key, ``rank`` is not an int, ``alpha`` or
        ``dropout`` is not a number, ``rslora`` or ``dora`` not a bool, or ``params`` holds
        a base and adapters attached.
      ValueError: ``rank`` larger than a target's ``in`` or ``out``, ``alpha`` not
        positive and finite, ``dropout`` outside [0, 1), a ``dtype`` that is not a float,
        or a target that is not 2-D per layer or is an integer leaf (the default targets
        skip those).
    """
    who = "stackwise.lora.init"
    stacked_only(who, params=params)
    key = checks.prng_key(key, who)
    rank = _rank(rank, who)
    alpha = float(rank) if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.number)):
        raise TypeError(f"{who}: `alpha` must be a number, got {type(alpha).__name__}.")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(
            f"{who}: `alpha` must be positive and finite, got {alpha}; the update is scaled "
            "by alpha / rank (PEFT's lora_alpha, e.g. 2 * rank)."
        )
    rslora = check_bool(rslora, "rslora", who)
    dora = check_bool(dora, "dora", who)
    dropout = check_rate(dropout, who)
    dtype = float_dtype(dtype, who)
    plain_tree(params, "params", who)
    leaves = leaf_paths(params, is_leaf=is_quantized)
    chosen = select(leaves, targets, who, lambda p, leaf: len(np.shape(leaf)) == 3 and (
        is_quantized(leaf) or jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating)))
    out = []
    for j, ((path, leaf), take) in enumerate(zip(leaves, chosen)):
        if not take:
            out.append(None)
            continue
        _float_base(path, leaf, who)
        n, d_in, d_out = leaf.shape
        if rank > min(d_in, d_out):
            raise ValueError(
                f"{who}: rank {rank} is larger than target {path}'s per-layer weight "
                f"({d_in}, {d_out}); a rank above min(in, out) = {min(d_in, d_out)} adds "
                "nothing. Give a smaller `rank`, or leave this leaf out of `targets`."
            )
        kind = np.dtype(leaf.dtype) if is_quantized(leaf) else checks.leaf_dtype(leaf)
        own = dtype if dtype is not None else (
            jnp.float32 if is_quantized(leaf) else kind)
        keys = jax.random.split(jax.random.fold_in(key, j), n)
        a = _uniform(keys, (d_in, rank), own, 1.0 / np.sqrt(d_in))
        magnitude = column_norms(leaf).astype(own) if dora else None
        out.append(LoraWeights(a, jnp.zeros((n, rank, d_out), own), float(alpha), rslora,
                               magnitude, dropout))
    treedef = jax.tree.structure(params, is_leaf=is_quantized)
    return jax.tree.unflatten(treedef, out)


def pairs(base: Any, adapters: Any, who: str) -> list[tuple[str, Any, Any]]:
    """``(path, base leaf, LoraWeights or None)`` for each leaf of the base, checked."""
    leaves = leaf_paths(base, is_leaf=is_quantized)
    treedef = jax.tree.structure(base, is_leaf=is_quantized)
    try:
        subs = treedef.flatten_up_to(adapters)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{who}: the adapters are not shaped like the base params (make them with "
            f"`stackwise.lora.init(key, base, ...)` from this base): {e}"
        ) from None
    for (path, _), sub in zip(leaves, subs):
        if not (sub is None or is_lora(sub)):
            raise TypeError(
                f"{who}: the adapters hold {type(sub).__name__} at {path}, where a "
                "`LoraWeights` or None belongs; make them with `stackwise.lora.init`."
            )
    return [(path, leaf, sub) for (path, leaf), sub in zip(leaves, subs)]


def _float_base(path: str, leaf: Any, who: str) -> None:
    """Refuses an integer base leaf: its weight plus an update would be rounded."""
    if not is_quantized(leaf) and not jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating):
        raise ValueError(
            f"{who}: base leaf {path} is of dtype {np.dtype(checks.leaf_dtype(leaf)).name}; "
            "an adapter's update added to integers would be rounded away. Adapt float "
            "weights (or quantized ones, `stackwise.quant.quantize`): leave it out of "
            "`targets`."
        )


def float_adapter(path: str, lw: LoraWeights, who: str) -> None:
    """Refuses an adapter whose ``a`` or ``b`` is quantized or integer."""
    for name, v in (("a", lw.a), ("b", lw.b)):
        kind = None if is_quantized(v) else checks.leaf_dtype(v)
        if kind is None or not jnp.issubdtype(kind, jnp.floating):
            got = "quantized" if kind is None else f"of dtype {np.dtype(kind).name}"
            raise TypeError(
                f"{who}: adapter {path}'s `{name}` is {got}; adapters are float (they are "
                "what trains): quantize the base alone, then attach, "
                "`stackwise.lora.attach(stackwise.quant.quantize(base), adapters)`."
            )


def check_shapes(path: str, leaf: Any, lw: LoraWeights, who: str) -> int | None:
    """The batch size g (None for one adapter) after checking ``lw`` against the base leaf."""
    float_adapter(path, lw, who)
    _float_base(path, leaf, who)
    shape = tuple(leaf.shape)
    a, b = tuple(lw.a.shape), tuple(lw.b.shape)
    if len(a) not in (3, 4) or len(b) != len(a):
        raise ValueError(
            f"{who}: adapter {path} has a {a}, b {b}; expected a (n, in, r) and b (n, r, out)"
            ", or (g, n, ...) for a batch of g adapters (`stackwise.lora.stack_adapters`)."
        )
    groups = a[0] if len(a) == 4 else None
    lead = a[:-2]
    if len(shape) != 3:
        raise ValueError(f"{who}: base leaf {path} has shape {shape}, not (n, in, out).")
    n, d_in, d_out = shape
    if lead[-1] != n or b[:-2] != lead:
        raise ValueError(
            f"{who}: adapter {path} has {lead[-1]} layers (a {a}, b {b}) but its base leaf "
            f"has n={n} (shape {shape}): adapters of another depth. Make them from this "
            "base with `stackwise.lora.init`, or take its layers with "
            "`stackwise.slice_layers`."
        )
    if a[-2] != d_in or b[-1] != d_out or a[-1] != b[-2]:
        raise ValueError(
            f"{who}: adapter {path} has a {a}, b {b}, which do not fit its base leaf "
            f"{shape}: expected a (..., {n}, {d_in}, r) and b (..., {n}, r, {d_out})."
        )
    if lw.magnitude is not None and tuple(lw.magnitude.shape) != lead + (d_out,):
        raise ValueError(
            f"{who}: DoRA adapter {path} has magnitude {tuple(lw.magnitude.shape)}, which does "
            f"not fit its base leaf {shape}: expected one per output column, "
            f"{lead + (d_out,)}."
        )
    return groups


def attach(base: Any, adapters: Any, *, per_leaf: bool = False, rows: Any = None,
           key: jax.Array | None = None) -> Any:
    """The base and its adapters as one params tree for a stack of wrapped layers.

    Nothing is copied: the base's arrays are held as they are, so several adapters (or one
    batch of them) share one base. A batch of g adapters is stored layer axis first.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((3, 4, 4))}
    >>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=2)
    >>> params = stackwise.lora.attach(base, adapters)
    >>> params.base["w"] is base["w"]
    True

    With ``per_leaf=True`` each adapted leaf becomes its own :class:`Adapted` node where the
    leaf was, so the tree keeps its structure: a framework's params (a Haiku dict, an
    Equinox module) stay what the framework's Stack takes, and it runs them one layer at a
    time (``docs/finetune.md``); the core's wrapped layers take either form.

    >>> params = stackwise.lora.attach(base, adapters, per_leaf=True)
    >>> sorted(params), params["w"].base is base["w"]
    (['w'], True)

    With ``rows`` (multi-LoRA serving, as S-LoRA and vLLM serve it) a batch of g adapters
    (:func:`stack_adapters`) serves a batch of rows, each row picking its adapter:
    ``rows[i]`` is row i's adapter index, or -1 for the base alone. Each adapted weight is
    used as ``x @ W + scale * (x @ a[rows[i]]) @ b[rows[i]]``: the base is read once for
    the whole batch and no per-row weight is built. The layer's state, if any, is per row
    (every state leaf has the batch first: a KV cache), so decoding with a cache works.

    >>> one, two = (jax.tree.map(lambda v: v + s, adapters) for s in (0.1, -0.1))
    >>> batch = stackwise.lora.stack_adapters([one, two])
    >>> layers = stackwise.lora.stack(lambda p, x: x @ p["w"], 3)
    >>> x = jnp.ones((3, 4))                      # three rows
    >>> with jax.default_matmul_precision("highest"):  # float32 products on any backend
    ...     y = layers.apply(stackwise.lora.attach(base, batch, rows=[1, -1, 0]), x)
    ...     alone = layers.apply(stackwise.lora.attach(base, two), x[:1])
    >>> bool(jnp.allclose(y[0], alone[0], rtol=1e-6)), y.shape
    (True, (3, 4))

    (Compared at ``'highest'``: at a TPU's default bfloat16 products, a row's ``x @ W +
    scale * (x @ a) @ b`` and the attached ``x @ (W + scale * a @ b)`` round apart.)

    With ``key`` (a new one each training step), adapters made with a ``dropout`` rate p
    (``init(..., dropout=p)``, or PEFT's ``lora_dropout`` read by ``load_peft``) drop their
    input as PEFT does while it trains: each product ``x @ W`` of an adapted weight becomes
    ``x @ W + scale * (dropout(x) @ a) @ b``, the mask drawn per layer, per adapted leaf and
    per product (:mod:`stackwise._finetune.dropout`). Without a key (evaluation, decoding)
    nothing is dropped, and differentiating such adapters is refused, naming the key:

    >>> drop = stackwise.lora.init(jax.random.key(0), base, rank=2, dropout=0.5)
    >>> drop = jax.tree.map(lambda v: v + 0.1, drop)               # as if trained
    >>> one = stackwise.lora.stack(lambda p, x: x @ p["w"], 3)
    >>> train = one.apply(stackwise.lora.attach(base, drop, key=jax.random.key(1)), x)
    >>> infer = one.apply(stackwise.lora.attach(base, drop), x)
    >>> bool(jnp.allclose(train, infer)), train.shape
    (False, (3, 4))

    Args:
      base: the stacked base params (float, or quantized: ``stackwise.quant.quantize``).
      adapters: from :func:`init` (one adapter) or :func:`stack_adapters` (a batch).
      per_leaf: an :class:`Adapted` node at each adapted leaf instead of one at the root.
      rows: None (one adapter; or a batch serving groups: group j of ``x``'s leading
        axis uses adapter j), or an int array ``(batch,)`` of adapter indices, one per
        row of ``x`` (its leading axis), -1 for the base alone. Concrete indices are
        checked to lie in ``[-1, g)``; traced ones (under ``jax.jit``) are not: a row
        whose index is outside ``[0, g)`` runs the base alone, as -1 does (never another
        adapter's weights, which a clipping gather would give).
      key: None (no dropout: evaluation, decoding), or one PRNG key for this step's dropout
        masks. Attached node t of the result (one, or one per adapted leaf with
        ``per_leaf``; in tree order) holds ``jax.random.split(jax.random.fold_in(key, t),
        n)``, layer i's key; inside layer i, the node's base leaf j draws its u-th product's
        mask from ``fold_in(fold_in(keys[i], j), u)``. Adapters whose rates are all 0 need
        none, and take it unchanged (bitwise the run without it). The keys are leaves of
        the result: differentiate the adapters (attach inside the loss, or
        :func:`stackwise.lora.split` and ``combine(..., key=)``), not the attached tree.

    Raises:
      ValueError: the adapters are not shaped like the base, have another depth, or do
        not fit their leaf; a batch mixed with single adapters, or batches of two sizes;
        ``rows`` with one adapter (not a batch) or with a DoRA adapter, ``rows`` not of
        shape ``(batch,)``, or a concrete index outside ``[-1, g)``.
        ``key`` with ``rows`` and adapters that drop their input.
      TypeError: something other than LoraWeights or None where an adapter belongs,
        ``per_leaf`` not a bool, ``rows`` not integers, or ``key`` not one PRNG key.
    """
    who = "stackwise.lora.attach"
    stacked_only(who, base=base, adapters=adapters)
    per_leaf = check_bool(per_leaf, "per_leaf", who)
    key = None if key is None else checks.prng_key(key, who)
    found = set()
    paired = pairs(base, adapters, who)
    for path, leaf, lw in paired:
        if lw is not None:
            found.add(check_shapes(path, leaf, lw, who))
    if len(found) > 1:
        raise ValueError(
            f"{who}: the adapters mix batch sizes {sorted(found, key=str)} (None: one adapter); "
            "a batch holds the same g adapters on every target: build it with "
            "`stackwise.lora.stack_adapters([adapters_0, ..., adapters_g-1])`."
        )
    groups = found.pop() if found else None
    if rows is not None:
        rows = _check_rows_arg(rows, groups, paired, who)
        if key is not None:
            _refuse_rows_key(paired, who)
    if groups is not None:
        adapters = jax.tree.map(lambda v: jnp.moveaxis(v, 0, 1), adapters)

    def per_layer(n: int) -> Any:  # the row indices, once per layer (the scan slices them)
        return None if rows is None else jnp.broadcast_to(rows, (n, rows.shape[0]))

    if not per_leaf:
        depth = next((leaf.shape[0] for _, leaf, lw in paired if lw is not None), 0)
        return rekey(Adapted(base, adapters, groups, per_layer(depth)), key)
    treedef = jax.tree.structure(base, is_leaf=is_quantized)
    subs = treedef.flatten_up_to(adapters)
    return rekey(jax.tree.unflatten(treedef, [
        leaf if lw is None else Adapted(leaf, lw, groups, per_layer(leaf.shape[0]))
        for (_, leaf, _), lw in zip(paired, subs)
    ]), key)


def rekey(tree: Any, key: jax.Array | None) -> Any:
    """``tree`` with each attached node's dropout keys drawn from ``key`` (node t, in tree
    order: :meth:`Adapted.with_keys`), or removed (``key`` None)."""
    count = iter(range(len(jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, Adapted)))))
    return jax.tree.map(lambda v: v.with_keys(key, next(count)) if isinstance(v, Adapted)
                        else v, tree, is_leaf=lambda v: isinstance(v, Adapted))


def _refuse_rows_key(paired: list, who: str) -> None:
    dropping = [(path, lw.dropout) for path, _, lw in paired if lw is not None and lw.dropout]
    if dropping:
        raise ValueError(
            f"{who}: `key` draws dropout masks for training, but with `rows` each row's "
            "update is added beside the base product (multi-LoRA serving), where no input is "
            f"dropped, and the adapter at {dropping[0][0]} has dropout {dropping[0][1]}. Train "
            "each adapter attached alone (`attach(base, adapters, key=key)`), or serve the "
            "batch without `key`."
        )


def _check_rows_arg(rows: Any, groups: int | None, paired: list, who: str) -> jax.Array:
    """``rows`` as an int32 array ``(batch,)`` of adapter indices, checked."""
    if groups is None:
        raise ValueError(
            f"{who}: `rows` picks an adapter per row from a batch of adapters, but the "
            "adapters are one adapter (a (n, in, r)); make a batch of them, "
            "`stackwise.lora.stack_adapters([adapters_0, ..., adapters_g-1])`, or drop "
            "`rows` to run this one adapter on every row."
        )
    dora = [path for path, _, lw in paired if lw is not None and lw.dora]
    if dora:
        raise ValueError(
            f"{who}: `rows` applies each row's update as (x @ a) @ b without building its "
            f"weight, but the adapter at {dora[0]} is DoRA's, whose weight is rescaled by "
            "its own column norms: serve DoRA adapters one at a time, or merged "
            "(`stackwise.lora.merge`)."
        )
    if isinstance(rows, (bool, float, complex, str)) or not hasattr(rows, "dtype") and not (
            isinstance(rows, (list, tuple)) and all(
                isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in rows)):
        raise TypeError(
            f"{who}: `rows` must be an int array of adapter indices, one per row (-1: the "
            f"base alone), e.g. `jnp.array([0, 2, -1])`; got {type(rows).__name__} "
            f"{rows!r:.60}."
        )
    kind = np.dtype(rows.dtype) if hasattr(rows, "dtype") else np.dtype(np.int32)
    if not jnp.issubdtype(kind, jnp.integer) or kind == np.dtype(bool):
        raise TypeError(
            f"{who}: `rows` must hold integer adapter indices (-1: the base alone), got "
            f"dtype {kind.name}; e.g. `rows.astype(jnp.int32)` if they are whole numbers."
        )
    shape = tuple(np.shape(rows))
    if len(shape) != 1:
        raise ValueError(
            f"{who}: `rows` must have shape (batch,), one adapter index per row of `x`'s "
            f"leading axis; got shape {shape}."
        )
    rows = jnp.asarray(rows, jnp.int32)
    if not isinstance(rows, jax.core.Tracer):
        bad = np.asarray(rows)
        bad = bad[(bad < -1) | (bad >= groups)]
        if bad.size:
            raise ValueError(
                f"{who}: `rows` holds {bad.tolist()}, outside [-1, {groups}): the batch has "
                f"{groups} adapters (indices 0..{groups - 1}), and -1 runs a row on the base "
                "alone."
            )
    return rows


# --------------------------------------------------------------------------
# The adapted weight (merged into the base by :mod:`.merge`).


def scaled_update(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * a @ b`` in the adapters' dtype (any leading axes)."""
    return jnp.matmul(a, b) * jnp.asarray(scale, a.dtype)


def column_norms(leaf: Any) -> jax.Array:
    """Each layer's output-column norms of a stacked ``(n, in, out)`` weight, float or
    quantized (dequantized one layer at a time), in float32: ``(n, out)``."""
    return jax.lax.map(
        lambda w: jnp.linalg.norm(dequantize(w).astype(jnp.float32), axis=0), leaf)


def dora_scaled(v: jax.Array, magnitude: jax.Array) -> jax.Array:
    """DoRA's weight from the adapted one, ``v * magnitude / |v|`` (``|v|`` each output
    column's norm over the inputs, axis -2, held constant for gradients), in ``v``'s dtype."""
    norm = jax.lax.stop_gradient(jnp.linalg.norm(v, axis=-2, keepdims=True))
    return (v * (magnitude[..., None, :].astype(v.dtype) / norm)).astype(v.dtype)


def delta(lw: LoraWeights) -> jax.Array:
    """``scale * a @ b`` in the adapters' dtype (any leading axes)."""
    return scaled_update(lw.a, lw.b, lw.scale)


def add(w: jax.Array, d: jax.Array, sign: int = 1) -> jax.Array:
    """``w ± d`` computed in their common dtype, returned in ``w``'s dtype."""
    common = jnp.promote_types(w.dtype, d.dtype)
    d = d.astype(common)
    return (w.astype(common) + (d if sign > 0 else -d)).astype(w.dtype)
