"""Adapters out to Hugging Face PEFT's layout: :func:`stackwise.lora.save_peft` (the layout
and the names are :mod:`stackwise._finetune.peft`'s, which reads them back)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from stackwise._core.served import stacked_only
from stackwise._finetune.lora import check_rate, float_adapter, is_lora, plain_tree
from stackwise._finetune.peft import (
    LAYERS,
    check_layers,
    check_layout,
    check_modules,
    check_pattern,
    layer_name,
    layer_numbers,
    safetensors,
)
from stackwise._finetune.peft_config import CONFIG, WEIGHTS
from stackwise._finetune.quant import is_quantized
from stackwise._finetune.targets import leaf_paths
from stackwise._upstream import peft as peft_rules

__all__ = ["save_peft"]


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
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(
            f"{who}: {directory} is a file, and PEFT's layout is a folder ({CONFIG}, "
            f"{WEIGHTS}); give a folder's path (`overwrite=True` replaces a folder only)."
        )
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
        safetensors(who).save_file(tensors, weights, metadata={"format": "pt"})
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


def _dropout(given: Any, found: dict, who: str) -> float:
    """The ``lora_dropout`` to write: ``given``, or the adapters' one rate."""
    if given is not None:
        return check_rate(given, who, "lora_dropout")
    rates = sorted({lw.dropout for lw in found.values()})
    if len(rates) > 1:
        raise ValueError(
            f"{who}: the adapters have dropout rates {rates}, and PEFT's config holds one "
            "`lora_dropout`; make them with one `stackwise.lora.init(..., dropout=)`, or "
            "give the one to write, `lora_dropout=p`."
        )
    return rates[0] if rates else 0.0


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
    lora_dropout: float | None = None,
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
      lora_dropout: PEFT's dropout on the adapters' input while training: None (the
        default) writes the adapters' own ``dropout`` (one rate for all), a number in
        [0, 1) writes that instead (``load_peft`` then gives adapters with it).
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
        or not k trees with it, ``lora_dropout`` not a number, or ``modules_to_save`` not a
        mapping of names to float arrays.
      ValueError: an adapted leaf without a module, a module for a leaf without an adapter,
        two leaves on one module (of one pattern position), a module named as a weight
        (``...q_proj.weight``), ``layers`` without one ``{i}`` (or ``{}``), a batch of
        adapters, adapted leaves of one stack (or position) with different numbers of
        layers, pattern positions whose depths no model has, rsLoRA or DoRA adapters beside
        plain ones (PEFT's config holds one ``use_rslora`` and one ``use_dora``), DoRA with
        ``layout="out_in"``, ``lora_dropout`` outside [0, 1) or, without it, adapters of
        several dropout rates, or a
        ``modules_to_save`` name that is not a tensor's, or names a module
        that is adapted (PEFT adapts no module it saves whole). Every name is checked
        before anything is written.
      FileExistsError: ``directory`` exists and ``overwrite`` is False.
      ValueError: ``directory`` is a file (with or without ``overwrite``).
    """
    who = "stackwise.lora.save_peft"
    stacked_only(who, adapters=adapters)
    plain_tree(adapters, "adapters", who)
    k = check_pattern(adapters, pattern, "adapters", who)
    modules = check_modules(modules, k, who)
    layers = check_layers(layers, who)
    out_in = check_layout(layout, who)
    base_model_name_or_path = _check_base_model(base_model_name_or_path, who)
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
    lora_dropout = _dropout(lora_dropout, found, who)
    numbers = layer_numbers({path: lw.a.shape[0] for path, lw in found.items()}, k,
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
    names = {path: [f"{layer_name(layers, i)}.{modules[path]}" for i in numbers[path]]
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
