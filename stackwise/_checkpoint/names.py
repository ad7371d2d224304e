"""The names of a checkpoint's tensors, as the conversions name layers: ``{}`` for the layer
index (``{:02d}`` for one zero-padded to two digits, ``layers.03.w``), one :class:`Tensor`
per leaf, nested by the target's keys. Shared by loading
(:mod:`stackwise._checkpoint.load`), saving (:mod:`stackwise._checkpoint.save`) and inspecting
(:mod:`stackwise._checkpoint.inspect`)."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from stackwise._core import checks

__all__ = ["Tensor"]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one leaf comes from in a checkpoint, and how it is turned into the leaf.

    The transforms apply to each stored tensor (one layer's, for a name with
    ``{}``) in this order: ``transpose``, then ``reshape``, then the cast to
    ``dtype``. Saving applies them backwards.

    >>> import jax.numpy as jnp, stackwise
    >>> q = stackwise.Tensor("model.layers.{}.self_attn.q_proj.weight", transpose=(1, 0))
    >>> q.name.format(3)
    'model.layers.3.self_attn.q_proj.weight'

    Zero-padded layer numbers (``layers.00.w``, ``layers.01.w``, ...) are
    named with a format spec: ``"layers.{:02d}.w"`` (as
    :func:`stackwise.inspect_checkpoint` reports them); ``{}`` matches
    unpadded numbers only, so that ``layers.1`` and ``layers.01`` are never
    taken for one layer.

    >>> stackwise.Tensor("layers.{:02d}.w").name.format(3)
    'layers.03.w'

    Attributes:
      name: the tensor's name in the checkpoint, ``{}`` for the layer index
        (``{:0Nd}`` for one zero-padded to N digits).
      transpose: a permutation of the stored tensor's axes (torch's
        ``Linear`` keeps ``(out, in)``, JAX layers ``(in, out)``: ``(1, 0)``).
      reshape: the leaf's per-layer shape after the transpose (split or
        merge heads: ``(H*D, E)`` stored, ``(E, H, D)`` wanted); one entry
        may be -1, inferred from the others as NumPy does.
      dtype: cast to this dtype (it must be the leaf's); without it, a
        dtype that differs from the leaf's is an error, never a cast.
      position: with ``pattern=k``, the pattern position (0..k-1) whose
        stacked leaf this is; its row j is layer ``position + j*k``.
      stored_shape: the stored per-layer shape, needed only to save a leaf
        with ``reshape`` back (the merge has many inverses).
    """

    name: str
    transpose: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    dtype: Any = None
    position: int | None = None
    stored_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # The shared checks of `stackwise._core.checks`: ints (NumPy ones too, never a bool), each
        # shape and permutation a tuple of them, the dtype a dtype; named by the Tensor.
        who = f"stackwise.Tensor({self.name!r})"
        for arg in ("transpose", "reshape", "stored_shape"):
            value = getattr(self, arg)
            if value is None:
                continue
            try:
                items = None if isinstance(value, (str, bytes)) else tuple(value)
            except TypeError:
                items = None
            if items is None:
                raise TypeError(
                    f"{who}: `{arg}` must be a tuple of ints (e.g. `{arg}=(1, 0)`), got "
                    f"{type(value).__name__} {value!r}."
                )
            ints = tuple(checks.integer(v, who, f"{arg}[{i}]") for i, v in enumerate(items))
            object.__setattr__(self, arg, ints)
        if self.reshape is not None and (
                self.reshape.count(-1) > 1 or any(d < -1 for d in self.reshape)):
            raise ValueError(
                f"{who}: `reshape={self.reshape}` may infer one axis (-1), no more, and no "
                "other entry may be negative; e.g. `reshape=(E, H, -1)`."
            )
        if self.stored_shape is not None and any(d < 0 for d in self.stored_shape):
            raise ValueError(
                f"{who}: `stored_shape={self.stored_shape}` must be the stored tensor's "
                "shape, every entry at least 0 (none inferred)."
            )
        if self.position is not None:
            object.__setattr__(
                self, "position", checks.integer(self.position, who, "position", minimum=0)
            )
        if self.dtype is not None:
            try:
                dtype = np.dtype(self.dtype)
            except TypeError:
                raise TypeError(
                    f"{who}: `dtype` must be a dtype (e.g. `dtype=jnp.bfloat16` or "
                    f"'float32'), got {type(self.dtype).__name__} {self.dtype!r}."
                ) from None
            object.__setattr__(self, "dtype", dtype)

    @property
    def per_layer(self) -> bool:
        """Whether ``name`` has ``{}`` or ``{:0Nd}`` (one tensor per layer)."""
        return isinstance(self.name, str) and _LAYER.search(self.name) is not None


# The layer index in a name: ``{}`` (unpadded) or ``{:0Nd}`` (zero-padded to N digits).
_LAYER = re.compile(r"\{(?::0(\d+)d)?\}")


def layers_of(template: str, names: Sequence[str]) -> dict[int, str]:
    """``{layer: name}`` of every name that ``template`` (one ``{}`` or ``{:0Nd}``) matches:
    the number written as the template writes it (``{}``: ``3``, never ``03``)."""
    m = _LAYER.search(template)
    regex = re.compile(f"^{re.escape(template[:m.start()])}(\\d+){re.escape(template[m.end():])}$")
    found = {}
    for name in names:
        got = regex.match(name)
        if got and template.format(int(got.group(1))) == name:
            found[int(got.group(1))] = name
    return found


def resolve_reshape(reshape: tuple[int, ...], size: int) -> tuple[int, ...] | None:
    """``reshape`` with its -1 (if any) inferred for a tensor of ``size`` elements, as NumPy
    infers it; None if no shape of that size has it."""
    known = int(np.prod([d for d in reshape if d != -1]))
    if -1 not in reshape:
        return reshape if known == size else None
    if known == 0 or size % known:
        return None
    return tuple(size // known if d == -1 else d for d in reshape)


def check_not_prng_key(leaf: Any, path: str, who: str) -> None:
    """A PRNG key leaf (``jax.random.key``) has no bytes a checkpoint can hold as they are:
    refused, naming the leaf and the fix."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"{who}: leaf {path} is a PRNG key ({dtype}), which a checkpoint cannot hold as "
            "it is. Save and load its raw bits instead: `jax.random.key_data(key)` (uint32) "
            "in the params, and `jax.random.wrap_key_data(bits)` after loading; or leave "
            "the key out of the params."
        )



def check_no_finetune_nodes(tree: Any, arg: str, who: str) -> None:
    """Refuses a quantized weight or an attached base and adapters in ``tree``: a checkpoint
    names float weights, one tensor per name, which these nodes are not."""
    from stackwise._finetune.lora import Adapted
    from stackwise._finetune.quant import is_quantized

    node = lambda v: isinstance(v, Adapted) or is_quantized(v)  # noqa: E731
    loading = who == "stackwise.load_checkpoint"
    for keys, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=node):
        path = jax.tree_util.keystr(keys) or "<root>"
        if isinstance(leaf, Adapted):
            raise TypeError(
                f"{who}: `{arg}` holds a base and its adapters attached at {path} "
                "(`stackwise.lora.attach`); a checkpoint holds the base alone: give the "
                "tree given to `attach` (`params.base` of a whole-tree attach), and "
                + ("load" if loading else "save") + " the adapters with `stackwise.lora."
                + ("load_peft`." if loading else "save_peft` (PEFT's adapter folder).")
            )
        if is_quantized(leaf):
            raise TypeError(
                f"{who}: `{arg}` holds a quantized weight ({leaf.kind}) at {path}; a "
                "checkpoint holds float weights. "
                + ("Give the float target and `quantize=` to quantize as it loads, e.g. "
                   f"`quantize={leaf.kind!r}`." if loading else
                   "Save the float params (before `stackwise.quant.quantize`), and quantize "
                   "again as they load (`load_checkpoint(..., quantize=)`).")
            )


def is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _is_name(x: Any) -> bool:
    return isinstance(x, (str, Tensor))


def lookup(names: Any, keys: list[str], path: str, who: str) -> Tensor:
    node, walked = names, []
    for i, k in enumerate(keys):
        if _is_name(node):
            if keys[i:] == ["value"]:  # an NNX Variable's value
                break
            raise ValueError(
                f"{who}: `names` gives the tensor {_as_tensor(node).name!r} at "
                f"{'/'.join(walked)}, but the target has a subtree there (leaf {path}); "
                "give a name per leaf."
            )
        entries = (
            {str(key): v for key, v in node.items()}
            if isinstance(node, Mapping)
            else {str(j): v for j, v in enumerate(node)}
            if isinstance(node, (list, tuple))
            else {}
        )
        if k not in entries:
            close = difflib.get_close_matches(k, list(entries), n=1)
            raise ValueError(
                f"{who}: `names` has no tensor name for the target's leaf {path} (no entry "
                f"{k!r} under {'/'.join(walked) or 'the top'}"
                + (f"; did you mean {close[0]!r}?" if close else f"; it has {sorted(entries)}")
                + "). Give every array leaf of the target a name, nested as the target is, "
                "e.g. {'params': {'w': 'model.layers.{}.w'}}."
            )
        node, walked = entries[k], walked + [k]
    if not _is_name(node):
        raise ValueError(
            f"{who}: `names` has a subtree, not a name, for the target's leaf {path}."
        )
    return _as_tensor(node)


def _as_tensor(name: Any) -> Tensor:
    return name if isinstance(name, Tensor) else Tensor(name)


def name_leaves(names: Any) -> list[str]:
    out = []

    def walk(node, prefix):
        if _is_name(node):
            out.append("/".join(prefix))
        elif isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, prefix + [str(k)])
        elif isinstance(node, (list, tuple)):
            for j, v in enumerate(node):
                walk(v, prefix + [str(j)])

    walk(names, [])
    return out


def check_template(spec: Tensor, path: str, who: str) -> None:
    if not isinstance(spec.name, str):
        raise TypeError(f"{who}: the name of leaf {path} must be a str, got {spec.name!r}.")
    rest = _LAYER.sub("", spec.name)
    if len(_LAYER.findall(spec.name)) > 1 or "{" in rest or "}" in rest:
        raise ValueError(
            f"{who}: the name {spec.name!r} of leaf {path} must have one `{{}}` for the "
            "layer index (or none for a tensor that is not per layer), e.g. "
            "'model.layers.{}.mlp.up_proj.weight'; `{:02d}` for a number zero-padded to "
            "two digits ('layers.03.w'), `{:03d}` to three, and so on."
        )


def check_layout(spec: Tensor, shape: tuple[int, ...], k: int | None, path: str, who: str) -> None:
    """The pattern position and layer axis a leaf of ``shape`` needs for ``spec`` (with
    ``pattern=k``), as loading and saving both read them."""
    if spec.position is not None and (k is None or not 0 <= spec.position < k):
        raise ValueError(
            f"{who}: leaf {path} has position={spec.position}, which needs `pattern=k` with "
            f"k > {spec.position} (got pattern={k})."
        )
    if spec.per_layer:
        if k is not None and k > 1 and spec.position is None:
            raise ValueError(
                f"{who}: with pattern={k}, the per-layer name {spec.name!r} of leaf {path} "
                "needs the pattern position it fills: stackwise.Tensor(name, position=p), "
                "p in 0..k-1 (its row j is layer p + j*k)."
            )
        if not shape:
            raise ValueError(
                f"{who}: leaf {path} is a scalar, so it has no layer axis for the "
                f"per-layer name {spec.name!r}; give it a name without `{{}}`."
            )
