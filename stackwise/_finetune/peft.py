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
layers without adapters, full copies of ``modules_to_save``, ``lora_dropout`` as the
adapters' ``dropout``); a field stackwise cannot apply
exactly is refused by name (``docs/finetune.md`` has the table).
"""

from __future__ import annotations

import importlib
import os
import re
import string
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
    float_dtype,
    is_lora,
    plain_tree,
)
from stackwise._finetune.peft_config import CONFIG, WEIGHTS, read_config, refuse
from stackwise._finetune.quant import is_quantized
from stackwise._finetune.targets import leaf_paths, select
from stackwise._upstream import peft as peft_rules

__all__ = ["load_peft"]

#: Where a Llama-like transformers model keeps layer i (PEFT's key prefix included).
LAYERS = "base_model.model.model.layers.{i}"


def safetensors(who: str) -> Any:
    try:
        return importlib.import_module("safetensors.numpy")
    except ImportError:
        raise ImportError(
            f"{who} needs safetensors for PEFT's adapter files: pip install "
            "'stackwise[safetensors]'"
        ) from None


def check_modules(modules: Any, k: int | None, who: str) -> dict[str, str]:
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
        key = (position(path) if k else 0, module)
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


def position(path: str) -> int | None:
    """The pattern position of a leaf of a pattern's tuple of trees, from its path (None for
    a path that names no position: not a leaf's, refused where leaves are matched)."""
    m = re.match(r"\[(\d+)\]", path)
    return int(m.group(1)) if m else None


def check_pattern(tree: Any, pattern: Any, arg: str, who: str) -> int | None:
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


def layer_numbers(depths: dict[str, int], k: int | None, arg: str,
                   who: str) -> dict[str, list[int]]:
    """Each adapted leaf's transformers layer per row, ``depths`` its rows: row j of one
    stack is layer j; with ``pattern=k``, row j of position p's leaf is layer p + j*k.
    Checked: one depth per stack (per position), and positions' depths that a model has."""
    groups: dict[int, dict[str, int]] = {}
    for path, depth in depths.items():
        groups.setdefault(position(path) if k else 0, {})[path] = depth
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
    return {path: [(position(path) if k else 0) + j * (k or 1) for j in range(d)]
            for path, d in depths.items()}


def check_layers(layers: Any, who: str) -> str:
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


def layer_name(layers: str, i: int) -> str:
    return layers.format(i, i=i)


def check_layout(layout: Any, who: str) -> bool:
    """True for ``"out_in"``, False for ``"in_out"``; anything else refused."""
    if layout not in ("in_out", "out_in"):
        raise ValueError(
            f"{who}: `layout` is {layout!r}; give 'in_out' for weights used as `x @ W` (the "
            "core, Haiku, linen, NNX) or 'out_in' for `W @ x` (Equinox's and torch's Linear)."
        )
    return layout == "out_in"


def _saved_tensors(config: dict, tensors: dict, path: str, who: str) -> list[str]:
    """The file's tensors of the modules PEFT's ``modules_to_save`` names, sorted, as the
    PEFT that wrote the file (its config's ``peft_version``) wrapped them: by the end of
    their names, at a dot from peft 0.22.0 (``stackwise._upstream.peft.saved_module``). A
    version that says no release is refused where the two rules disagree on the file."""
    names = config.get("modules_to_save") or []
    held = sorted(name for name in tensors
                  if not name.endswith((".lora_A.weight", ".lora_B.weight")))
    modules = [peft_rules.strip_prefix(name).rsplit(".", 1)[0] for name in held]

    def saved(peft: tuple[int, ...]) -> list[str]:
        return [n for n, m in zip(held, modules) if peft_rules.saved_module(names, m, peft)]

    peft = peft_rules.release(config.get("peft_version"))
    if peft is None:
        old, new = saved(()), saved(peft_rules.DOTTED_SAVES)
        if old != new:
            differs = peft_rules.strip_prefix(sorted(set(old) ^ set(new))[0])
            raise refuse(
                who, path, "peft_version", config["peft_version"],
                f"it reads a release there, such as '0.21.2', to know which modules "
                f"`modules_to_save` {names!r} names: the module of {differs} before peft "
                "0.22.0 (the end of a module's name), not from 0.22.0 (the end at a dot); "
                "give the version of the PEFT that wrote the file")
        return old
    return saved(peft)


def _check_bias(config: dict, tensors: dict, saved: list[str], path: str, who: str) -> None:
    """bias 'all' or 'lora_only' loads only where PEFT trained no bias (none in the file
    but those of ``modules_to_save``, which are whole modules' copies)."""
    bias = config.get("bias", "none")
    held = sorted(k for k in tensors if k.endswith(".bias") and k not in saved)
    if bias != "none" and held:
        raise refuse(
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
        raise refuse(
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
        raise refuse(who, cfg_path, "use_dora", True,
                      "stackwise's DoRA scales the columns of weights used as x @ W; load "
                      "onto an (in, out) base (layout='in_out')")
    if dora and not all(on):
        fields = [f for f in ("layers_to_transform", "exclude_modules", "modules_to_save")
                  if config.get(f)]
        raise refuse(who, cfg_path, "use_dora", True,
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
                       jnp.asarray(np.stack(m)) if dora else None,
                       float(config.get("lora_dropout", 0.0)))


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
    without one. ``lora_dropout`` becomes each adapter's ``dropout``, applied while
    training with a key (``stackwise.lora.attach(..., key=)``), as PEFT applies it. A
    field stackwise cannot apply exactly is refused by name.

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
        range, a ``lora_dropout`` of 1), saved modules' copies without
        ``modules_to_save=True``, weights from another model (a layer or module missing,
        shapes that do not fit the base's leaves, or tensors left over: more layers, other
        modules), ``modules`` or ``layers`` as for saving, or an integer ``dtype``.
      TypeError: ``modules`` is not a mapping of paths to module names, ``base`` is
        served or attached, ``pattern`` not a positive int, a tuple of trees (a pattern's)
        without ``pattern``, or not k trees with it, or ``modules_to_save`` not a bool.
    """
    who = "stackwise.lora.load_peft"
    stacked_only(who, base=base)
    plain_tree(base, "base", who)
    k = check_pattern(base, pattern, "base", who)
    modules = check_modules(modules, k, who)
    layers = check_layers(layers, who)
    out_in = check_layout(layout, who)
    dtype = float_dtype(dtype, who)
    modules_to_save = check_bool(modules_to_save, "modules_to_save", who)
    directory = os.fspath(directory)
    config = read_config(directory, who)
    cfg_path = os.path.join(directory, CONFIG)
    tensors = safetensors(who).load_file(os.path.join(directory, WEIGHTS))
    saved_names = _saved_tensors(config, tensors, cfg_path, who)
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
    numbers = layer_numbers({path: leaf.shape[0] for (path, leaf), take in zip(leaves, chosen)
                              if take}, k, "base", who)
    used, out = set(), []
    for (path, leaf), take in zip(leaves, chosen):
        if not take:
            out.append(None)
            continue
        names = [f"{layer_name(layers, i)}.{modules[path]}" for i in numbers[path]]
        lw = _read_leaf(tensors, names, path, leaf, config, cfg_path, out_in, used, who)
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
