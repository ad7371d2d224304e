"""Adapters out to, and back from, Hugging Face PEFT's layout.

PEFT saves a LoRA adapter as a folder with ``adapter_model.safetensors`` (per layer and
module: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` of shape
``(r, in)`` and ``...lora_B.weight`` of shape ``(out, r)``, torch's ``(out, in)`` layout) and
``adapter_config.json`` (``peft_type``, ``r``, ``lora_alpha``, ``target_modules``, ...).
A stacked adapter ``a (n, in, r)``, ``b (n, r, out)`` is layer i's ``lora_A = a[i].T``,
``lora_B = b[i].T``: the transposes are exact, so a round trip is bitwise. With weights
stored ``(out, in)`` (``layout="out_in"``: Equinox's ``Linear``) the adapter is ``a (n, out,
r)``, ``b (n, r, in)``, and layer i's ``lora_A = b[i]``, ``lora_B = a[i]``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core.served import stacked_only
from stackwise._finetune.lora import LoraWeights, is_lora
from stackwise._finetune.quant import is_quantized
from stackwise._finetune.targets import leaf_paths, select

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


def _check_modules(modules: Any, who: str) -> dict[str, str]:
    if not isinstance(modules, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in modules.items()
    ):
        raise TypeError(
            f"{who}: `modules` maps each adapted leaf's path to its module in a layer of "
            "the transformers model, e.g. `{\"['attn']['q']\": 'self_attn.q_proj'}`; got "
            f"{modules!r:.80}."
        )
    return dict(modules)


def _check_layout(layout: Any, who: str) -> bool:
    """True for ``"out_in"``, False for ``"in_out"``; anything else refused."""
    if layout not in ("in_out", "out_in"):
        raise ValueError(
            f"{who}: `layout` is {layout!r}; give 'in_out' for weights used as `x @ W` (the "
            "core, Haiku, linen, NNX) or 'out_in' for `W @ x` (Equinox's and torch's Linear)."
        )
    return layout == "out_in"


def _config(r: int, alpha: float, modules: dict[str, str], base_model: str | None) -> dict:
    """PEFT's ``LoraConfig`` fields, as ``LoraConfig.save_pretrained`` writes them."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules.values()}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_peft(
    directory: str | os.PathLike,
    adapters: Any,
    modules: Mapping[str, str],
    *,
    base_model_name_or_path: str | None = None,
    layers: str = LAYERS,
    layout: str = "in_out",
    overwrite: bool = False,
) -> list[str]:
    """Writes stacked adapters as a PEFT LoRA adapter folder, all or nothing.

    The files are written in a staging folder next to ``directory`` and renamed into place
    once both are whole.

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
      overwrite: replace an adapter folder already at ``directory``.

    Returns:
      The file names written, sorted.

    Raises:
      TypeError: ``modules`` is not a mapping of paths to module names.
      ValueError: an adapted leaf without a module, a module for a leaf without an adapter,
        a batch of adapters, or adapters of several ranks or alphas (PEFT's config has one).
      FileExistsError: ``directory`` exists and ``overwrite`` is False.
    """
    who = "stackwise.lora.save_peft"
    stacked_only(who, adapters=adapters)
    modules = _check_modules(modules, who)
    out_in = _check_layout(layout, who)
    tensors, ranks = {}, set()
    found = {path: lw for path, lw in leaf_paths(adapters, is_leaf=is_lora) if is_lora(lw)}
    if set(found) != set(modules):
        raise ValueError(
            f"{who}: `modules` names {sorted(modules)}, the adapters are on {sorted(found)}; "
            "give one module name per adapted leaf."
        )
    for path, lw in found.items():
        if lw.a.ndim != 3:
            raise ValueError(
                f"{who}: adapter {path} is a batch of {lw.a.shape[0]} adapters; save one: "
                "`jax.tree.map(lambda v: v[j], adapters)` takes adapter j."
            )
        ranks.add((lw.rank, lw.alpha))
        a, b = np.asarray(lw.a), np.asarray(lw.b)
        for i in range(a.shape[0]):
            name = f"{layers.format(i=i)}.{modules[path]}"
            lora_a, lora_b = (b[i], a[i]) if out_in else (a[i].T, b[i].T)
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(lora_a)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    if len(ranks) != 1:
        raise ValueError(
            f"{who}: the adapters have several (rank, alpha) pairs {sorted(ranks)}; PEFT's "
            "config holds one `r` and `lora_alpha`: make them with one `stackwise.lora.init`."
        )
    (r, alpha), = ranks
    config = _config(r, alpha, modules, base_model_name_or_path)
    directory = os.fspath(directory)
    if os.path.exists(directory) and not overwrite:
        raise FileExistsError(
            f"{who}: {directory} exists; pass `overwrite=True` to replace it, or another folder."
        )
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".stackwise-peft-", dir=parent)
    try:
        _safetensors(who).save_file(tensors, os.path.join(stage, WEIGHTS),
                                    metadata={"format": "pt"})
        with open(os.path.join(stage, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        if os.path.exists(directory):
            old = tempfile.mkdtemp(prefix=".stackwise-peft-old-", dir=parent)
            os.replace(directory, os.path.join(old, "adapter"))
            try:
                os.replace(stage, directory)
            except OSError:  # put the old folder back: all or nothing
                os.replace(os.path.join(old, "adapter"), directory)
                raise
            finally:
                shutil.rmtree(old)
        else:
            os.replace(stage, directory)
    finally:
        if os.path.exists(stage):
            shutil.rmtree(stage)
    return sorted([CONFIG, WEIGHTS])


def _read_config(directory: str, who: str) -> dict:
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
    unsupported = {
        "peft_type": ("LORA", config.get("peft_type")),
        "use_dora": (False, config.get("use_dora", False)),
        "use_rslora": (False, config.get("use_rslora", False)),
        "fan_in_fan_out": (False, config.get("fan_in_fan_out", False)),
        "rank_pattern": ({}, config.get("rank_pattern") or {}),
        "alpha_pattern": ({}, config.get("alpha_pattern") or {}),
    }
    for field, (want, got) in unsupported.items():
        if got != want:
            raise ValueError(
                f"{who}: {path} has {field}={got!r}; stackwise loads plain LoRA adapters "
                f"({field}={want!r}), one rank and alpha for every module."
            )
    return config


def load_peft(
    directory: str | os.PathLike,
    base: Any,
    modules: Mapping[str, str],
    *,
    layers: str = LAYERS,
    layout: str = "in_out",
    dtype: Any = None,
) -> Any:
    """A PEFT LoRA adapter folder as stacked adapters for ``base`` (see :func:`save_peft`).

    Args:
      directory: the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).
      base: the stacked base the adapters go on (float or quantized leaves).
      modules: each leaf path to adapt -> its module within a layer, as for saving.
      layers: the name of layer ``{i}``, PEFT's prefix included.
      layout: ``"in_out"`` or ``"out_in"``, how ``base`` stores its weights (as for saving).
      dtype: the adapters' dtype; default the file's.

    Returns:
      The adapters, shaped like ``base`` (:class:`LoraWeights` at the ``modules``' leaves).

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: a config stackwise does not load (DoRA, rsLoRA, per-module ranks, another
        PEFT type), or weights from another model: a layer or module missing, shapes that do
        not fit the base's leaves, or tensors left over (more layers, other modules).
      TypeError: ``modules`` is not a mapping of paths to module names.
    """
    who = "stackwise.lora.load_peft"
    modules = _check_modules(modules, who)
    out_in = _check_layout(layout, who)
    directory = os.fspath(directory)
    config = _read_config(directory, who)
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    tensors = _safetensors(who).load_file(os.path.join(directory, WEIGHTS))
    leaves = leaf_paths(base, is_leaf=is_quantized)
    chosen = select(leaves, list(modules), who, lambda p, leaf: False)
    used, out = set(), []
    for (path, leaf), take in zip(leaves, chosen):
        if not take:
            out.append(None)
            continue
        n, d_in, d_out = leaf.shape
        if out_in:
            d_in, d_out = d_out, d_in
        a, b = [], []
        for i in range(n):
            name = f"{layers.format(i=i)}.{modules[path]}"
            for key, want, into in ((f"{name}.lora_A.weight", (r, d_in), a),
                                    (f"{name}.lora_B.weight", (d_out, r), b)):
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
        if dtype is not None:
            a, b = a.astype(dtype), b.astype(dtype)
        out.append(LoraWeights(a, b, alpha))
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(
            f"{who}: {len(left)} tensors of {directory} fit no layer of the base (e.g. "
            f"{left[0]}): PEFT files from another model (more layers, or modules not in "
            "`modules`)? Give every adapted module in `modules`, and a base of as many layers."
        )
    return jax.tree.unflatten(jax.tree.structure(base, is_leaf=is_quantized), out)
