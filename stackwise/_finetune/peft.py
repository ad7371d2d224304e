"""Adapters out to, and back from, Hugging Face PEFT's layout.

PEFT saves a LoRA adapter as a folder with ``adapter_model.safetensors`` (per layer and
module: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` of shape
``(r, in)`` and ``...lora_B.weight`` of shape ``(out, r)``, torch's ``(out, in)`` layout) and
``adapter_config.json`` (``peft_type``, ``r``, ``lora_alpha``, ``target_modules``, ...).
A stacked adapter ``a (n, in, r)``, ``b (n, r, out)`` is layer i's ``lora_A = a[i].T``,
``lora_B = b[i].T``: the transposes are exact, so a round trip is bitwise. With weights
stored ``(out, in)`` (``layout="out_in"``: Equinox's ``Linear``) the adapter is ``a (n, out,
r)``, ``b (n, r, in)``, and layer i's ``lora_A = b[i]``, ``lora_B = a[i]``.

The config is read and written as PEFT applies it (rsLoRA, per-module ranks and alphas,
layers without adapters, full copies of ``modules_to_save``); a field stackwise cannot apply
exactly is refused by name (``docs/finetune.md`` has the table).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import stat
import string
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core import convert
from stackwise._core.options import check_bool
from stackwise._core.served import stacked_only
from stackwise._finetune.lora import (
    LoraWeights,
    float_adapter,
    float_dtype,
    is_lora,
    plain_tree,
)
from stackwise._finetune.quant import is_quantized
from stackwise._finetune.targets import leaf_paths, select
from stackwise._upstream import peft as peft_rules

__all__ = ["load_peft", "save_peft"]

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
#: Where a Llama-like transformers model keeps layer i (PEFT's key prefix included).
LAYERS = "base_model.model.model.layers.{i}"


def _safetensors(who: str) -> Any:
    try:
        return importlib.import_module("safetensors.numpy")
    except ImportError:
        raise ImportError(
            f"{who} needs safetensors for PEFT's adapter files: pip install "
            "'stackwise[safetensors]'"
        ) from None


def _check_modules(modules: Any, k: int | None, who: str) -> dict[str, str]:
    """``modules`` checked: one module (not a weight) per leaf, no module named twice in one
    stack (with ``pattern=k``, in one position: positions hold different layers)."""
    if not isinstance(modules, Mapping) or not all(
        isinstance(path, str) and isinstance(v, str) and v for path, v in modules.items()
    ):
        raise TypeError(
            f"{who}: `modules` maps each adapted leaf's path to its module in a layer of "
            "the transformers model, e.g. `{\"['attn']['q']\": 'self_attn.q_proj'}`; got "
            f"{modules!r:.80}."
        )
    seen: dict[tuple[int, str], str] = {}
    for path, module in modules.items():
        parts = module.split(".")
        if not all(part.isidentifier() or part.isdigit() for part in parts):
            raise ValueError(
                f"{who}: `modules` maps {path} to {module!r}, not a module name; give the "
                "module's dotted name within a layer, e.g. 'self_attn.q_proj'."
            )
        if parts[-1] in ("weight", "bias", "lora_A", "lora_B"):
            raise ValueError(
                f"{who}: `modules` maps {path} to {module!r}, a tensor's name, not a module's; "
                "PEFT names the module the adapter sits on (its weight is the module's "
                "`.weight`): give "
                + (repr(".".join(parts[:-1])) if parts[:-1]
                   else "the module, e.g. 'self_attn.q_proj'") + "."
            )
        key = (_position(path) if k else 0, module)
        if key in seen:
            raise ValueError(
                f"{who}: `modules` maps both {seen[key]} and {path} to {module!r}; a layer's "
                "module holds one adapter, so one would overwrite the other in the file. Give "
                "each leaf its own module"
                + (" (of one pattern position; positions hold different layers, so they "
                   "may share module names)." if k else ".")
            )
        seen[key] = path
    return dict(modules)


def _position(path: str) -> int | None:
    """The pattern position of a leaf of a pattern's tuple of trees, from its path (None for
    a path that names no position: not a leaf's, refused where leaves are matched)."""
    m = re.match(r"\[(\d+)\]", path)
    return int(m.group(1)) if m else None


def _check_pattern(tree: Any, pattern: Any, arg: str, who: str) -> int | None:
    """k for a pattern's k stacked trees (``pattern=k``), None for one stack; a tuple of
    trees without ``pattern`` (a pattern's params, whose layers it would misnumber) refused."""
    k = convert.check_pattern(pattern, who)
    kind = type(tree).__name__
    if k is None:
        is_node = lambda v: is_lora(v) or is_quantized(v)  # noqa: E731
        if isinstance(tree, (tuple, list)) and len(tree) > 1 and not all(
                jax.tree_util.treedef_is_leaf(jax.tree.structure(t, is_leaf=is_node))
                for t in tree):
            n = len(tree)
            raise TypeError(
                f"{who}: `{arg}` is a {kind} of {n} trees, as a pattern's params are "
                f"(position p holding layers p, p+{n}, ...): pass `pattern={n}`, so that row "
                f"j of position p is the file's layer p + j*{n}, the model's layer index; "
                "without it each position would be numbered from 0, as the wrong layers. "
                f"(For one stack whose params are a {kind} of trees, put them in a dict, "
                f"`{{'layers': {arg}}}`, and start `modules`' paths with ['layers'].)"
            )
        return None
    if not isinstance(tree, (tuple, list)) or len(tree) != k:
        got = f"a {kind} of {len(tree)} trees" if isinstance(tree, (tuple, list)) else kind
        raise TypeError(
            f"{who}: with pattern={k}, `{arg}` must be a tuple of {k} stacked trees (position "
            f"p holding layers p, p+{k}, ...), as `Stacked.init` returns a pattern's params; "
            f"got {got}."
        )
    return k


def _layer_numbers(depths: dict[str, int], k: int | None, arg: str,
                   who: str) -> dict[str, list[int]]:
    """Each adapted leaf's transformers layer per row, ``depths`` its rows: row j of one
    stack is layer j; with ``pattern=k``, row j of position p's leaf is layer p + j*k.
    Checked: one depth per stack (per position), and positions' depths that a model has."""
    groups: dict[int, dict[str, int]] = {}
    for path, depth in depths.items():
        groups.setdefault(_position(path) if k else 0, {})[path] = depth
    for p, group in groups.items():
        if len(set(group.values())) > 1:
            where = f" of pattern position {p}" if k else ""
            raise ValueError(
                f"{who}: the adapted leaves{where} of `{arg}` hold different numbers of layers "
                f"({', '.join(f'{path}: {d}' for path, d in group.items())}); a stack's leaves "
                "hold one row per layer: give adapters made for one model "
                "(`stackwise.lora.init` of its stacked params)."
            )
    if k:
        counts = {p: next(iter(group.values())) for p, group in sorted(groups.items())}
        if not any(all(len(range(p, n, k)) == c for p, c in counts.items())
                   for n in range(1, k * max(counts.values()) + 1)):
            raise ValueError(
                f"{who}: with pattern={k}, the pattern positions of `{arg}` hold "
                + ", ".join(f"position {p}: {c}" for p, c in counts.items())
                + f" layers, which no depth gives: position p of {k} holds layers p, p+{k}, "
                f"... (of n layers, len(range(p, n, {k}))). Give the positions' trees in "
                "order, as `Stacked.init` returns them."
            )
    return {path: [(_position(path) if k else 0) + j * (k or 1) for j in range(d)]
            for path, d in depths.items()}


def _check_layers(layers: Any, who: str) -> str:
    """``layers`` checked to name layer i by one field, ``{i}`` or ``{}``."""
    if not isinstance(layers, str):
        raise TypeError(
            f"{who}: `layers` names layer i with `{{i}}`, e.g. {LAYERS!r}; got "
            f"{type(layers).__name__} {layers!r}."
        )
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(layers) if f is not None]
    except ValueError as e:
        fields = [f"unbalanced braces ({e})"]
    if fields not in (["i"], [""]):
        raise ValueError(
            f"{who}: `layers` is {layers!r}, with fields {fields}; it must name layer i by "
            f"one `{{i}}` (or `{{}}`), e.g. {LAYERS!r}: without it every layer would get the "
            "same tensor names, and a file would keep the last layer only."
        )
    return layers


def _layer(layers: str, i: int) -> str:
    return layers.format(i, i=i)


def _check_layout(layout: Any, who: str) -> bool:
    """True for ``"out_in"``, False for ``"in_out"``; anything else refused."""
    if layout not in ("in_out", "out_in"):
        raise ValueError(
            f"{who}: `layout` is {layout!r}; give 'in_out' for weights used as `x @ W` (the "
            "core, Haiku, linen, NNX) or 'out_in' for `W @ x` (Equinox's and torch's Linear)."
        )
    return layout == "out_in"


def _check_base_model(value: Any, who: str) -> str | None:
    """``base_model_name_or_path`` as PEFT's config holds it: a str (a path's) or None."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, (str, type(None))):
        raise TypeError(
            f"{who}: `base_model_name_or_path` is written to PEFT's config: give a str (a "
            f"hub name or a folder) or None, got {type(value).__name__} {value!r}."
        )
    return value


def _config(r: int, alpha: float, modules: dict[str, str], base_model: str | None, *,
            rslora: bool, dora: bool, dropout: float, rank_pattern: dict, alpha_pattern: dict,
            layers_to_transform: list[int] | None, modules_to_save: list[str] | None) -> dict:
    """PEFT's ``LoraConfig`` fields, as ``LoraConfig.save_pretrained`` writes them."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules.values()}),
        "lora_dropout": dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": rslora,
        "use_dora": dora,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": modules_to_save,
        "layers_to_transform": layers_to_transform,
        "layers_pattern": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "revision": None,
    }


def _write(directory: str, tensors: dict, config: dict, overwrite: bool, who: str) -> None:
    """The adapter folder written whole in a staging holder next to it, then moved in place."""
    if os.path.exists(directory) and not overwrite:
        raise FileExistsError(
            f"{who}: {directory} exists; pass `overwrite=True` to replace it, or another folder."
        )
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    # A private (0700) holder; the folder and files in it are made as any other, their
    # modes from the umask (0755 and 0644 under 022), so a job of another user can read them.
    stage = tempfile.mkdtemp(prefix=".stackwise-peft-", dir=parent)
    new = os.path.join(stage, "adapter")
    try:
        os.mkdir(new)
        with open(os.path.join(new, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        weights = os.path.join(new, WEIGHTS)
        _safetensors(who).save_file(tensors, weights, metadata={"format": "pt"})
        # safetensors writes 0600 whatever the umask: give it the config's mode, open()'s.
        os.chmod(weights, stat.S_IMODE(os.stat(os.path.join(new, CONFIG)).st_mode))
        if os.path.exists(directory):
            old = os.path.join(stage, "old")
            os.replace(directory, old)
            try:
                os.replace(new, directory)
            except OSError:  # put the old folder back: all or nothing
                os.replace(old, directory)
                raise
        else:
            os.replace(new, directory)
    finally:
        shutil.rmtree(stage)

def _check_dropout(p: Any, who: str) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float, np.number)) or not 0 <= p <= 1:
        raise ValueError(
            f"{who}: `lora_dropout` is {p!r}; it is PEFT's dropout probability on the "
            "adapters' input while PEFT trains, a number in [0, 1] (stackwise's training "
            "applies none; the value is written for PEFT)."
        )
    return float(p)


def _check_saved(saved: Any, names: dict, who: str) -> dict[str, np.ndarray]:
    """``modules_to_save``'s tensors checked: float arrays under tensor names of modules
    that hold no adapter."""
    if saved is None:
        return {}
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        raise TypeError(
            f"{who}: `modules_to_save` maps each saved tensor's name in the model to its "
            "array, e.g. `{'lm_head.weight': head}` (torch's layout); got "
            f"{type(saved).__name__} {saved!r:.80}."
        )
    out = {}
    adapted = [peft_rules.strip_prefix(n) for rows in names.values() for n in rows]
    for name, v in saved.items():
        parts = name.split(".")
        if len(parts) < 2 or not all(p.isidentifier() or p.isdigit() for p in parts):
            raise ValueError(
                f"{who}: `modules_to_save` names {name!r}, not a tensor's name in the model; "
                "give the module's tensor, e.g. 'lm_head.weight' or "
                "'model.embed_tokens.weight'."
            )
        module = ".".join(parts[:-1])
        clash = [k for k in adapted if peft_rules.adapted({"modules_to_save": [module]}, k)
                 is False or peft_rules.saved_module([module], k)]
        if clash:
            raise ValueError(
                f"{who}: `modules_to_save` names {name!r}, of module {module!r}, which "
                f"holds an adapter ({clash[0]}); PEFT adapts no module it saves whole, so it "
                "would load neither as given. Save a module without adapters."
            )
        array = np.asarray(v) if hasattr(v, "dtype") and not is_quantized(v) else None
        if array is None or not jnp.issubdtype(array.dtype, jnp.floating):
            got = ("quantized" if is_quantized(v) else type(v).__name__) if array is None \
                else f"of dtype {array.dtype}"
            raise TypeError(
                f"{who}: `modules_to_save`[{name!r}] is {got}; give the module's float "
                "tensor (dequantized), in torch's layout."
            )
        out[name] = np.ascontiguousarray(array)
    return out


def _layers_left_out(found: dict, numbers: dict, names: dict, arrays: dict) -> set[int]:
    """The model's layers where every adapter is zero (``a`` and ``b``: what ``load_peft``
    gives a layer PEFT's ``layers_to_transform`` leaves out), to leave out of the file and
    of ``layers_to_transform``; none when some are left, when all are, or when PEFT would
    not read the layer index from the names (then the zeros are written: as exact)."""
    rows: dict[int, list[tuple[str, int]]] = {}
    for path in found:
        for j, i in enumerate(numbers[path]):
            rows.setdefault(i, []).append((path, j))
    zero = {i for i, where in rows.items()
            if all(not arrays[p][0][j].any() and not arrays[p][1][j].any() for p, j in where)}
    if not zero or zero == set(rows):
        return set()
    config = {"layers_to_transform": sorted(set(rows) - zero), "layers_pattern": None,
              "target_modules": sorted({n.rsplit(".", 1)[-1] for v in names.values()
                                        for n in v})}
    for path in found:
        for i, name in zip(numbers[path], names[path]):
            if peft_rules.adapted(config, peft_rules.strip_prefix(name)) == (i in zero):
                return set()
    return zero


def _patterns(found: dict, names: dict, modules: dict) -> tuple[int, float, dict, dict]:
    """``r`` and ``lora_alpha`` (the most common), and ``rank_pattern`` and
    ``alpha_pattern`` for the modules of other ranks or alphas, checked to give each
    written module its own as PEFT matches them (:mod:`stackwise._upstream.peft`)."""
    def common(values):
        counts: dict = {}
        for v in values:
            counts[v] = counts.get(v, 0) + 1
        return max(sorted(counts), key=lambda v: counts[v])

    r = common(lw.rank for lw in found.values())
    alpha = common(lw.alpha for lw in found.values())
    want = {peft_rules.strip_prefix(name): (lw.rank, lw.alpha)
            for path, lw in found.items() for name in names[path]}

    def build(per_layer: bool) -> tuple[dict, dict]:
        ranks, alphas = {}, {}
        for default, into, get in ((r, ranks, lambda lw: lw.rank),
                                    (alpha, alphas, lambda lw: lw.alpha)):
            by_module: dict[str, set] = {}
            for path, lw in found.items():
                by_module.setdefault(modules[path], set()).add(get(lw))
            layer_keys, module_keys = {}, {}
            for path, lw in found.items():
                value = get(lw)
                if value == default and len(by_module[modules[path]]) == 1:
                    continue
                if per_layer or len(by_module[modules[path]]) > 1:
                    if value != default:
                        for name in names[path]:
                            layer_keys[re.escape(peft_rules.strip_prefix(name))] = value
                else:
                    module_keys[re.escape(modules[path])] = value
            layer_keys.update(module_keys)
            # The longest first: PEFT takes the first key that matches, and a key matches
            # only names as long as itself or longer.
            into.update(sorted(layer_keys.items(),
                               key=lambda kv: -len(kv[0].replace("\\.", "."))))
        return ranks, alphas

    ranks, alphas = build(per_layer=False)
    if all((peft_rules.pattern_value(ranks, r, key), peft_rules.pattern_value(
            alphas, alpha, key)) == v for key, v in want.items()):
        return r, alpha, ranks, alphas
    # A module's name that ends another's (`q_proj`, `attn.q_proj`): one key per layer's
    # module, each the whole name, which no other name ends with.
    ranks, alphas = build(per_layer=True)
    return r, alpha, ranks, alphas


def save_peft(
    directory: str | os.PathLike,
    adapters: Any,
    modules: Mapping[str, str],
    *,
    base_model_name_or_path: str | None = None,
    layers: str = LAYERS,
    layout: str = "in_out",
    pattern: int | None = None,
    lora_dropout: float = 0.0,
    modules_to_save: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Writes stacked adapters as a PEFT LoRA adapter folder, all or nothing.

    The files are written in a staging folder next to ``directory`` and renamed into place
    once both are whole. The config says what PEFT needs to apply them as stackwise does:
    ``use_rslora`` from the adapters' ``rslora``, ``use_dora`` (and each layer's
    ``lora_magnitude_vector``) from their ``magnitude``; the most common rank and alpha as ``r`` and
    ``lora_alpha``, and each other module's in ``rank_pattern`` and ``alpha_pattern`` (keyed
    by the module's name, or by each layer's module where pattern positions share a module
    name with different ranks); and, where every adapter of some layers is zero (``a`` and
    ``b``: what :func:`load_peft` gives a layer PEFT left without one), those layers left out
    of the file and the rest in ``layers_to_transform``.

    >>> import jax, jax.numpy as jnp, stackwise, tempfile, os
    >>> base = {"q": jnp.ones((2, 8, 8))}
    >>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=4, alpha=8.0)
    >>> folder = os.path.join(tempfile.mkdtemp(), "adapter")
    >>> stackwise.lora.save_peft(folder, adapters, {"['q']": "self_attn.q_proj"})
    ['adapter_config.json', 'adapter_model.safetensors']
    >>> back = stackwise.lora.load_peft(folder, base, {"['q']": "self_attn.q_proj"})
    >>> bool((back["q"].a == adapters["q"].a).all()), back["q"].alpha
    (True, 8.0)

    Args:
      directory: the adapter folder to write (PEFT's ``save_pretrained`` folder).
      adapters: one stack's adapters (``stackwise.lora.init``'s tree; not a batch).
      modules: each adapted leaf's path -> its module within a layer of the transformers
        model (``"self_attn.q_proj"``, ``"mlp.down_proj"``).
      base_model_name_or_path: written to the config, as PEFT does.
      layers: the name of layer ``{i}``, PEFT's prefix included.
      layout: how the adapted weights are stored per layer: ``"in_out"`` (``x @ W``: the
        core, Haiku, linen, NNX; ``a (in, r)``, ``b (r, out)``) or ``"out_in"`` (``W @ x``:
        torch's and Equinox's ``Linear``; ``a (out, r)``, ``b (r, in)``, so ``lora_A`` is
        ``b`` and ``lora_B`` is ``a``). Files written from either are PEFT's same layout.
      pattern: None for one stack, or k for a pattern's adapters (a tuple of k trees,
        position p holding layers p, p+k, ...: ``stackwise.lora.init`` of ``Stacked.init``'s
        params): row j of position p is written as layer ``p + j*k``, the model's layer
        index, so positions may share module names (``self_attn.q_proj`` in every layer).
      lora_dropout: PEFT's dropout on the adapters' input while PEFT trains, written to the
        config for PEFT; stackwise's training applies none (each layer is given its adapted
        weight, not the adapters' input).
      modules_to_save: full trained copies of whole modules to write beside the adapters
        (PEFT's ``modules_to_save``: embeddings, heads, norms), each tensor's name in the
        transformers model (``"lm_head.weight"``, ``"model.embed_tokens.weight"``) -> its
        array in torch's layout (a head ``(vocab, width)``), as ``load_peft(...,
        modules_to_save=True)`` returns them. The config names their modules.
      overwrite: replace an adapter folder already at ``directory``.

    Returns:
      The file names written, sorted.

    Raises:
      TypeError: ``modules`` is not a mapping of paths to module names, ``layers`` not a
        str, ``base_model_name_or_path`` not a str, path or None, ``adapters`` attached,
        ``pattern`` not a positive int, a tuple of trees (a pattern's) without ``pattern``,
        or not k trees with it, or ``modules_to_save`` not a mapping of names to float
        arrays.
      ValueError: an adapted leaf without a module, a module for a leaf without an adapter,
        two leaves on one module (of one pattern position), a module named as a weight
        (``...q_proj.weight``), ``layers`` without one ``{i}`` (or ``{}``), a batch of
        adapters, adapted leaves of one stack (or position) with different numbers of
        layers, pattern positions whose depths no model has, rsLoRA or DoRA adapters beside
        plain ones (PEFT's config holds one ``use_rslora`` and one ``use_dora``), DoRA with
        ``layout="out_in"``, ``lora_dropout`` not a number in [0, 1], or a
        ``modules_to_save`` name that is not a tensor's, or names a module
        that is adapted (PEFT adapts no module it saves whole). Every name is checked
        before anything is written.
      FileExistsError: ``directory`` exists and ``overwrite`` is False.
    """
    who = "stackwise.lora.save_peft"
    stacked_only(who, adapters=adapters)
    plain_tree(adapters, "adapters", who)
    k = _check_pattern(adapters, pattern, "adapters", who)
    modules = _check_modules(modules, k, who)
    layers = _check_layers(layers, who)
    out_in = _check_layout(layout, who)
    base_model_name_or_path = _check_base_model(base_model_name_or_path, who)
    lora_dropout = _check_dropout(lora_dropout, who)
    tensors = {}
    found = {path: lw for path, lw in leaf_paths(adapters, is_leaf=is_lora) if is_lora(lw)}
    if set(found) != set(modules):
        raise ValueError(
            f"{who}: `modules` names {sorted(modules)}, the adapters are on {sorted(found)}; "
            "give one module name per adapted leaf."
        )
    for path, lw in found.items():
        float_adapter(path, lw, who)
        if lw.a.ndim != 3:
            raise ValueError(
                f"{who}: adapter {path} is a batch of {lw.a.shape[0]} adapters; save one: "
                "`jax.tree.map(lambda v: v[j], adapters)` takes adapter j."
            )
    numbers = _layer_numbers({path: lw.a.shape[0] for path, lw in found.items()}, k,
                             "adapters", who)
    rslora = sorted({lw.rslora for lw in found.values()})
    if len(rslora) > 1:
        raise ValueError(
            f"{who}: some adapters scale by alpha / r and others by alpha / sqrt(r) (rsLoRA); "
            "PEFT's config holds one `use_rslora`: make them with one "
            "`stackwise.lora.init(..., rslora=)`."
        )
    dora = sorted({lw.dora for lw in found.values()})
    if len(dora) > 1:
        raise ValueError(
            f"{who}: some adapters are DoRA's (with a magnitude) and others plain LoRA; PEFT's "
            "config holds one `use_dora`: make them with one `stackwise.lora.init(..., dora=)`."
        )
    if dora[0] and out_in:
        raise ValueError(
            f"{who}: DoRA adapters with layout='out_in': stackwise's DoRA scales the columns "
            "of weights used as x @ W, which are PEFT's output channels only with "
            "layout='in_out'."
        )
    names = {path: [f"{_layer(layers, i)}.{modules[path]}" for i in numbers[path]]
             for path in found}
    arrays = {path: (np.asarray(lw.a), np.asarray(lw.b)) for path, lw in found.items()}
    skip = set() if dora[0] else _layers_left_out(found, numbers, names, arrays)
    for path, lw in found.items():
        a, b = arrays[path]
        m = np.asarray(lw.magnitude) if lw.dora else None
        for i, (layer, name) in enumerate(zip(numbers[path], names[path])):
            if layer in skip:
                continue
            lora_a, lora_b = (b[i], a[i]) if out_in else (a[i].T, b[i].T)
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(lora_a)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(lora_b)
            if m is not None:
                tensors[f"{name}.lora_magnitude_vector"] = np.ascontiguousarray(m[i])
    saved = _check_saved(modules_to_save, names, who)
    for name, v in saved.items():
        tensors[peft_rules.PREFIX + name] = v
    r, alpha, rank_pattern, alpha_pattern = _patterns(found, names, modules)
    kept = sorted({i for rows in numbers.values() for i in rows} - skip) if skip else None
    config = _config(r, alpha, modules, base_model_name_or_path, rslora=rslora[0], dora=dora[0],
                     dropout=lora_dropout, rank_pattern=rank_pattern,
                     alpha_pattern=alpha_pattern, layers_to_transform=kept,
                     modules_to_save=sorted({n.rsplit(".", 1)[0] for n in saved}) or None)
    _write(os.fspath(directory), tensors, config, overwrite, who)
    return sorted([CONFIG, WEIGHTS])


#: PEFT LoraConfig fields (peft 0.21.2) that change nothing in what a loaded adapter computes,
#: accepted with any value: bookkeeping, the initialisers' own settings (``init_lora_weights``
#: decides whether an initialiser changed the base), and settings of features refused below.
INERT = {
    "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "runtime_config",
    # The file's tensors say which modules are adapted (checked against `modules`).
    "target_modules",
    # Ties the copies of tied modules (modules_to_save, trainable tokens, an adapted tied
    # embedding) in PEFT's model; a file holds each saved tensor once, returned as it is.
    "ensure_weight_tying",
}
#: Fields ``load_peft`` reads, each checked in :func:`_read_config`.
READ = {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
        "layers_to_transform", "layers_pattern", "exclude_modules", "lora_dropout", "bias",
        "init_lora_weights", "modules_to_save", "use_dora"}
#: Fields refused unless unset (None, False, empty): what each one is in PEFT.
REFUSED = {
    "fan_in_fan_out": "base weights stored (in, out), as GPT-2's Conv1D",
    "lora_bias": "a trained bias on lora_B",
    "trainable_token_indices": "trained rows of the embedding",
    "layer_replication": "layers repeated to deepen the model",
    "target_parameters": "adapters on parameters, not modules (MoE experts)",
    "alora_invocation_tokens": "Activated LoRA, on only after its invocation tokens",
    "use_qalora": "QA-LoRA's pooled inputs",
    "megatron_config": "Megatron's parallel layers",
    "velora_config": "VeLoRA, a LoRA variant",
    "monteclora_config": "MonteCLoRA, a LoRA variant",
    "use_bdlora": "block-diagonal LoRA, a LoRA variant",
    "arrow_config": "Arrow routing among adapters",
    "kasa_config": "KaSA, a LoRA variant",
}
#: ``init_lora_weights`` values that only initialise A and B: the base is PEFT's as given.
PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva")
SUPPORTED = ("stackwise loads LoRA (W + scale * B A on each adapted module, scale "
             "lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; DoRA's rescaling with "
             "use_dora)")


def _refuse(who: str, path: str, field: str, got: Any, why: str) -> ValueError:
    return ValueError(f"{who}: {path} has {field}={got!r}, which stackwise does not support: "
                      f"{why}.")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_alpha(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            and math.isfinite(v))


def _names(v: Any) -> bool:
    """None, a str, or a list of str (PEFT's pattern and module lists)."""
    return v is None or isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(x, str) for x in v))


def _read_config(directory: str, who: str) -> dict:
    """``adapter_config.json``, every field checked: read (rank, alpha, rsLoRA, patterns,
    layers, exclusions, dropout, bias), inert, or refused by name."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS)):
        raise FileNotFoundError(
            f"{who}: {directory} lacks {CONFIG} or {WEIGHTS}; give the folder PEFT's "
            "`save_pretrained` (or `stackwise.lora.save_peft`) wrote."
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{who}: {path} is not JSON ({e}); give the folder PEFT's "
                         "`save_pretrained` wrote.") from None
    missing = [k for k in ("peft_type", "r", "lora_alpha")
               if not isinstance(config, dict) or k not in config]
    if missing:
        raise ValueError(
            f"{who}: {path} lacks {missing}: not a PEFT adapter config (PEFT's LoRA config "
            "has `peft_type`, `r`, `lora_alpha`, `target_modules`)."
        )
    if config["peft_type"] != "LORA":
        raise _refuse(who, path, "peft_type", config["peft_type"],
                      f"{SUPPORTED}, peft_type='LORA'")
    r, alpha = config["r"], config["lora_alpha"]
    if not _is_int(r) or r < 1:
        raise ValueError(f"{who}: {path} has r={r!r}; PEFT's rank is an int of at least 1.")
    if not _is_alpha(alpha):
        raise ValueError(
            f"{who}: {path} has lora_alpha={alpha!r}; PEFT's `lora_alpha` is a finite "
            "positive number (the update is scaled by lora_alpha / r)."
        )
    for field, got in config.items():
        if field in READ or field in INERT:
            continue
        if field in REFUSED:
            if got:
                raise _refuse(who, path, field, got,
                              f"{REFUSED[field]}; {SUPPORTED}, {field} unset")
        elif got not in (None, False, "", [], {}):
            raise _refuse(who, path, field, got,
                          f"a field stackwise does not know (a newer PEFT's?); {SUPPORTED}, "
                          "and refuses what it cannot apply exactly")
    for field in ("use_rslora", "use_dora"):
        if not isinstance(config.get(field, False), bool):
            raise _refuse(who, path, field, config[field], "it is true or false")
    for field, check, what in (("rank_pattern", _is_int, "an int rank of at least 1"),
                               ("alpha_pattern", _is_alpha, "a finite positive alpha")):
        got = config.get(field) or {}
        if not isinstance(got, dict) or not all(
                isinstance(k, str) and check(v) and (v >= 1 if field == "rank_pattern" else True)
                for k, v in got.items()):
            raise _refuse(who, path, field, got,
                          f"PEFT's {field} maps module-name patterns to {what} each")
        for key in got:
            try:
                re.compile(key)
            except re.error as e:
                raise _refuse(who, path, field, got, f"its key {key!r} is not a regular "
                              f"expression ({e}), as PEFT matches it") from None
    layers = config.get("layers_to_transform")
    if not (layers is None or _is_int(layers) or (
            isinstance(layers, list) and all(_is_int(i) for i in layers))):
        raise _refuse(who, path, "layers_to_transform", layers,
                      "PEFT's layers_to_transform is a layer index or a list of them")
    if isinstance(config.get("modules_to_save"), str):
        raise _refuse(who, path, "modules_to_save", config["modules_to_save"],
                      "PEFT's modules_to_save is a list of module names")
    for field in ("layers_pattern", "exclude_modules", "modules_to_save"):
        if not _names(config.get(field)):
            raise _refuse(who, path, field, config[field],
                          f"PEFT's {field} is a str or a list of str")
    if config.get("layers_pattern") and layers is None:
        raise _refuse(who, path, "layers_pattern", config["layers_pattern"],
                      "PEFT reads it only with layers_to_transform, and refuses it without")
    dropout = config.get("lora_dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool)
            and 0 <= dropout <= 1):
        raise _refuse(who, path, "lora_dropout", dropout,
                      "PEFT's lora_dropout is a probability in [0, 1]")
    bias = config.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise _refuse(who, path, "bias", bias, "PEFT's bias is 'none', 'all' or 'lora_only'")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise _refuse(
            who, path, "init_lora_weights", init,
            "PEFT changed the base weights when it made this adapter (PiSSA, OLoRA, CorDA, "
            "LoRA-GA and LoftQ train on a residual base; MiCA is a variant), so on the "
            "original base it gives other outputs; in PEFT, save it with "
            "`save_pretrained(..., path_initial_model_for_weight_conversion=...)` to convert "
            f"it to plain LoRA. stackwise loads init_lora_weights {list(PLAIN_INITS)}")
    return config


def _saved_tensors(config: dict, tensors: dict) -> list[str]:
    """The file's tensors of the modules PEFT's ``modules_to_save`` names (PEFT's
    ``_set_trainable`` wraps each module whose name ends with one of them), sorted."""
    names = config.get("modules_to_save") or []
    return sorted(
        name for name in tensors
        if not name.endswith((".lora_A.weight", ".lora_B.weight"))
        and peft_rules.saved_module(names, peft_rules.strip_prefix(name).rsplit(".", 1)[0])
    )


def _check_bias(config: dict, tensors: dict, saved: list[str], path: str, who: str) -> None:
    """bias 'all' or 'lora_only' loads only where PEFT trained no bias (none in the file
    but those of ``modules_to_save``, which are whole modules' copies)."""
    bias = config.get("bias", "none")
    held = sorted(k for k in tensors if k.endswith(".bias") and k not in saved)
    if bias != "none" and held:
        raise _refuse(
            who, path, "bias", bias,
            f"the file holds {len(held)} trained biases (e.g. {held[0]}), and stackwise's "
            "adapters are LoRA's A and B alone; it loads bias='none', or 'all' and "
            "'lora_only' from a model without biases (a Llama), whose files hold none")


def _leaf_rank(config: dict, keys: list[str], on: list[bool], path: str, cfg_path: str,
               who: str) -> tuple[int, float]:
    """The one (rank, alpha) PEFT gives the rows of a stacked leaf (the adapted ones; all of
    them when none is): ``rank_pattern`` and ``alpha_pattern`` as PEFT matches them."""
    r, alpha = config["r"], config["lora_alpha"]
    got = {}
    for key, adapted in zip(keys, on):
        if adapted or not any(on):
            got[key] = (peft_rules.pattern_value(config.get("rank_pattern") or {}, r, key),
                        peft_rules.pattern_value(config.get("alpha_pattern") or {}, alpha, key))
    pairs = sorted(set(got.values()))
    if len(pairs) > 1:
        field = ("rank_pattern" if len({p[0] for p in pairs}) > 1 else "alpha_pattern")
        raise _refuse(
            who, cfg_path, field, config.get(field),
            f"it gives the layers of {path} several (rank, alpha) pairs ("
            + ", ".join(f"{key}: {v}" for key, v in list(got.items())[:4])
            + ", ...), and a stacked leaf holds one rank and alpha for all its layers; "
            "stackwise loads patterns that give every layer of a module one rank and alpha "
            "(a key that names the module, e.g. 'q_proj', not one layer's)")
    rank, alpha = pairs[0]
    return int(rank), float(alpha)


def _read_leaf(tensors: dict, names: list[str], path: str, leaf: Any, config: dict,
               cfg_path: str, out_in: bool, used: set, who: str) -> LoraWeights:
    """Layer i's ``lora_A.T`` and ``lora_B.T`` (``names[i]``'s), stacked, each checked; a
    layer PEFT leaves without an adapter (``layers_to_transform``, ``exclude_modules``) gets
    zeros, which change nothing and take no gradient, as in PEFT."""
    _, d_in, d_out = leaf.shape
    if out_in:
        d_in, d_out = d_out, d_in
    keys = [peft_rules.strip_prefix(name) for name in names]
    on = [peft_rules.adapted(config, key) for key in keys]
    r, alpha = _leaf_rank(config, keys, on, path, cfg_path, who)
    kind = next((tensors[f"{name}.lora_A.weight"].dtype for name, adapted in zip(names, on)
                 if adapted and f"{name}.lora_A.weight" in tensors),
                next((v.dtype for v in tensors.values()), np.dtype(np.float32)))
    dora = bool(config.get("use_dora", False))
    if dora and out_in:
        raise _refuse(who, cfg_path, "use_dora", True,
                      "stackwise's DoRA scales the columns of weights used as x @ W; load "
                      "onto an (in, out) base (layout='in_out')")
    if dora and not all(on):
        fields = [f for f in ("layers_to_transform", "exclude_modules", "modules_to_save")
                  if config.get(f)]
        raise _refuse(who, cfg_path, "use_dora", True,
                      f"with {' and '.join(fields)} PEFT leaves some layers of {path} "
                      "without an adapter, and a DoRA adapter cannot stand for none (its "
                      "magnitude trains); stackwise loads DoRA on every layer of a module"
                      + ("" if any(on) else f" (PEFT adapts {path}'s module on no layer: "
                         "leave it out of `modules`)"))
    a, b, m = [], [], []
    for name, adapted in zip(names, on):
        parts = [(f"{name}.lora_A.weight", (r, d_in), a), (f"{name}.lora_B.weight", (d_out, r), b)]
        if dora:
            parts.append((f"{name}.lora_magnitude_vector", (d_out,), m))
        for key, want, into in parts:
            if not adapted:
                into.append(np.zeros(want[::-1], kind))
                continue
            got = tensors.get(key)
            if got is None or got.shape != want:
                found = "missing" if got is None else f"of shape {got.shape}"
                raise ValueError(
                    f"{who}: {key} is {found}, expected {want} for {path} (base "
                    f"{leaf.shape}, r={r}): PEFT files from another model? Check "
                    "`modules`, `layers` and that the base is the one the adapter was "
                    "trained on."
                )
            used.add(key)
            into.append(got.T)
    a, b = jnp.asarray(np.stack(a)), jnp.asarray(np.stack(b))
    if out_in:  # a (out, r) is lora_B, b (r, in) is lora_A
        a, b = jnp.swapaxes(b, 1, 2), jnp.swapaxes(a, 1, 2)
    return LoraWeights(a, b, alpha, bool(config.get("use_rslora", False)),
                       jnp.asarray(np.stack(m)) if dora else None)


def load_peft(
    directory: str | os.PathLike,
    base: Any,
    modules: Mapping[str, str],
    *,
    layers: str = LAYERS,
    layout: str = "in_out",
    pattern: int | None = None,
    dtype: Any = None,
    modules_to_save: bool = False,
) -> Any:
    """A PEFT LoRA adapter folder as stacked adapters for ``base`` (see :func:`save_peft`).

    The config is read as PEFT applies it (``docs/finetune.md`` has every field): the
    rank and alpha of each module from ``rank_pattern`` and ``alpha_pattern`` (PEFT's
    keys, matched as PEFT matches them; one rank and alpha per stacked leaf), rsLoRA's
    scale with ``use_rslora``, DoRA's magnitudes with ``use_dora``, and zeros for the
    layers ``layers_to_transform`` (read with ``layers_pattern``) or ``exclude_modules``
    leave without an adapter: zeros change nothing and take no gradient, as a layer
    without one. A field stackwise cannot apply
    exactly is refused by name.

    >>> import json, os, tempfile, numpy as np, jax.numpy as jnp, stackwise
    >>> from safetensors.numpy import save_file
    >>> folder = tempfile.mkdtemp()   # PEFT's files: layer 0 adapted, rsLoRA
    >>> name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    >>> save_file({name.format("A"): np.ones((2, 8), np.float32),
    ...            name.format("B"): np.ones((8, 2), np.float32)},
    ...           os.path.join(folder, "adapter_model.safetensors"))
    >>> config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_rslora": True,
    ...           "layers_to_transform": [0], "target_modules": ["q_proj"]}
    >>> with open(os.path.join(folder, "adapter_config.json"), "w") as f:
    ...     json.dump(config, f)
    >>> base = {"q": jnp.ones((2, 8, 8))}
    >>> adapters = stackwise.lora.load_peft(folder, base, {"['q']": "self_attn.q_proj"})
    >>> adapters["q"].scale == 4 / 2**0.5, float(adapters["q"].b[0].sum()), float(
    ...     adapters["q"].b[1].sum())    # layer 1: no adapter, zeros
    (True, 16.0, 0.0)

    Args:
      directory: the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).
      base: the stacked base the adapters go on (float or quantized leaves).
      modules: each leaf path to adapt -> its module within a layer, as for saving.
      layers: the name of layer ``{i}``, PEFT's prefix included.
      layout: ``"in_out"`` or ``"out_in"``, how ``base`` stores its weights (as for saving).
      pattern: None for one stack, or k for a pattern's base (a tuple of k stacked trees):
        row j of position p reads layer ``p + j*k`` of the file, as for saving.
      dtype: the adapters' dtype (and the saved modules'); default the file's.
      modules_to_save: also return the full copies of the modules PEFT's
        ``modules_to_save`` names (trained embeddings, heads, norms). A file that holds
        some is refused without it, so that none is lost.

    Returns:
      The adapters, shaped like ``base`` (:class:`LoraWeights` at the ``modules``' leaves);
      with ``modules_to_save=True``, ``(adapters, saved)``: ``saved`` maps each saved
      tensor's name in the transformers model (``"lm_head.weight"``,
      ``"model.layers.0.input_layernorm.weight"``: the name its checkpoint gives it) to its
      array, in torch's layout as the file holds it; empty if the file holds none.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: a config stackwise does not load (another PEFT type, a ``bias`` other
        than 'none' with biases in the file, an ``init_lora_weights`` that changed the base,
        any other field set that stackwise does not apply, a pattern giving one stacked
        leaf's layers several ranks or alphas, DoRA with layers left without adapters or
        onto an ``(out, in)`` base, an ``r``, ``lora_alpha`` or other field out of PEFT's
        range), saved modules' copies without ``modules_to_save=True``, weights from another
        model (a layer or module missing, shapes that do not fit the base's leaves, or
        tensors left over: more layers, other modules), ``modules`` or ``layers`` as for
        saving, or an integer ``dtype``.
      TypeError: ``modules`` is not a mapping of paths to module names, ``base`` is
        served or attached, ``pattern`` not a positive int, a tuple of trees (a pattern's)
        without ``pattern``, or not k trees with it, or ``modules_to_save`` not a bool.
    """
    who = "stackwise.lora.load_peft"
    stacked_only(who, base=base)
    plain_tree(base, "base", who)
    k = _check_pattern(base, pattern, "base", who)
    modules = _check_modules(modules, k, who)
    layers = _check_layers(layers, who)
    out_in = _check_layout(layout, who)
    dtype = float_dtype(dtype, who)
    modules_to_save = check_bool(modules_to_save, "modules_to_save", who)
    directory = os.fspath(directory)
    config = _read_config(directory, who)
    cfg_path = os.path.join(directory, CONFIG)
    tensors = _safetensors(who).load_file(os.path.join(directory, WEIGHTS))
    saved_names = _saved_tensors(config, tensors)
    _check_bias(config, tensors, saved_names, cfg_path, who)
    if saved_names and not modules_to_save:
        raise ValueError(
            f"{who}: {cfg_path} has modules_to_save={config['modules_to_save']!r}: the file "
            f"holds full trained copies of those modules ({len(saved_names)} tensors, e.g. "
            f"{peft_rules.strip_prefix(saved_names[0])}) beside the adapters, which the "
            "adapters alone would lose. Pass `modules_to_save=True` to get them too: "
            "`adapters, saved = stackwise.lora.load_peft(..., modules_to_save=True)`, `saved` "
            "mapping each tensor's name in the model to its array (torch's layout)."
        )
    leaves = leaf_paths(base, is_leaf=is_quantized)
    chosen = select(leaves, list(modules), who, lambda p, leaf: False, arg="modules")
    numbers = _layer_numbers({path: leaf.shape[0] for (path, leaf), take in zip(leaves, chosen)
                              if take}, k, "base", who)
    used, out = set(), []
    for (path, leaf), take in zip(leaves, chosen):
        if not take:
            out.append(None)
            continue
        lw = _read_leaf(tensors, [f"{_layer(layers, i)}.{modules[path]}" for i in numbers[path]],
                        path, leaf, config, cfg_path, out_in, used, who)
        if dtype is not None:
            lw = jax.tree.map(lambda v: v.astype(dtype), lw)
        out.append(lw)
    used.update(saved_names)
    left = sorted(set(tensors) - used)
    if left:
        skipped = [f for f in ("layers_to_transform", "exclude_modules") if config.get(f)]
        raise ValueError(
            f"{who}: {len(left)} tensors of {directory} fit no layer of the base (e.g. "
            f"{left[0]}): PEFT files from another model (more layers, or modules not in "
            "`modules`)? Give every adapted module in `modules`, and a base of as many layers."
            + (f" (Or tensors of layers that the config's {' and '.join(skipped)} leave "
               "without an adapter, which PEFT would not load either.)" if skipped else "")
        )
    adapters = jax.tree.unflatten(jax.tree.structure(base, is_leaf=is_quantized), out)
    if not modules_to_save:
        return adapters
    saved = {}
    for name in saved_names:
        v = jnp.asarray(tensors[name])
        saved[peft_rules.strip_prefix(name)] = v if dtype is None else v.astype(dtype)
    return adapters, saved
