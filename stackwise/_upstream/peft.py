"""PEFT's rules for which module of a model gets a LoRA adapter, and of what rank and alpha.

Mirrored from peft 0.21.2 (December 2026), in plain Python: stackwise does not import peft;
checked against peft 0.22.0 too, which changed one rule (``saved_module``: which modules
``modules_to_save`` names), followed by the version that wrote the file.
``load_peft`` and ``save_peft`` use them to read and write a config exactly as PEFT applies
it. ``tests/finetune/test_upstream_peft.py`` checks each against peft's own function on a
table of keys and configs where peft is installed (it skips otherwise; CI's ``.ci/torch``
installs it), so a change upstream fails there.

A module's *key* is its name in the model PEFT wraps, without PEFT's prefix: for a
transformers Llama, ``model.layers.3.self_attn.q_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["adapted", "pattern_value", "release", "saved_module", "strip_prefix"]

#: The prefix PEFT gives a wrapped model's tensors in its files (``PeftModel`` ->
#: ``LoraModel`` -> the model): ``base_model.model.`` + the key.
PREFIX = "base_model.model."


def strip_prefix(name: str) -> str:
    """A tensor's module name in a PEFT file as PEFT's key (its prefix taken off)."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def _pattern_key(pattern_keys: Sequence[str], key: str) -> str:
    """peft.utils.other.get_pattern_key (0.21.2): the first pattern that matches the end
    of ``key`` at a dot, ``re.match(rf"(.*\\.)?({pattern})$", key)``; else ``key``."""
    for pattern in pattern_keys:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


def pattern_value(patterns: Mapping[str, Any], default: Any, key: str) -> Any:
    """The rank (or alpha) PEFT gives the module ``key``: ``rank_pattern`` (``alpha_pattern``)
    looked up as ``LoraModel._create_and_replace`` does (0.21.2), else the config's."""
    return patterns.get(_pattern_key(list(patterns), key), default)


def _layer_index(key: str, layers_pattern: Any) -> int | None:
    """The layer index PEFT reads from ``key`` (check_target_module_exists, 0.21.2): the
    first numbered segment, or the one after ``layers_pattern`` when given."""
    if layers_pattern is None or len(layers_pattern) == 0:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        patterns = [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern
        match = None
        for pattern in patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


#: The first peft whose ``_set_trainable`` matches ``modules_to_save`` at a dot.
DOTTED_SAVES = (0, 22)


def release(version: Any) -> tuple[int, ...] | None:
    """A config's ``peft_version`` as its release numbers: ``"0.22.0"`` and a development
    version's ``"0.22.0.dev0@1a2b3c"`` give ``(0, 22, 0)``; a missing one (None: PEFT writes
    it since 0.18.0) gives ``()``, a release older than any numbered one; anything else,
    None (unknown)."""
    if version is None:
        return ()
    match = re.match(r"\d+(?:\.\d+)*", version) if isinstance(version, str) else None
    return tuple(int(p) for p in match.group(0).split(".")) if match else None


def saved_module(modules_to_save: Sequence[str], key: str, peft: tuple[int, ...] = ()) -> bool:
    """Whether PEFT saves the module ``key`` whole: peft.utils.other._set_trainable wraps
    each module whose name ends with one of ``modules_to_save``; before peft 0.22.0 as a
    plain ``str.endswith`` (``"norm"`` names ``layers.0.xnorm`` too), from 0.22.0 the name
    itself or a suffix at a dot (``_is_valid_match``). ``peft``: the release that applied
    the config (:func:`release`); a development version counts as its release."""
    if peft >= DOTTED_SAVES:
        return any(key == m or key.endswith(f".{m}") for m in modules_to_save)
    return any(key.endswith(m) for m in modules_to_save)


def adapted(config: Mapping[str, Any], key: str) -> bool:
    """Whether PEFT gives the module ``key``, one of the config's target modules, an adapter:
    not excluded (``exclude_modules``), not saved whole (``modules_to_save``), and in
    ``layers_to_transform`` (read with
    ``layers_pattern``), as peft.tuners.tuners_utils.check_target_module_exists (0.21.2)
    decides. ``target_modules`` itself is not matched here: the file's tensors say which
    modules were targeted."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    saved = config.get("modules_to_save")
    if saved and any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in saved):
        return False  # PEFT never adapts a module it saves whole
    targets = config.get("target_modules")
    if isinstance(targets, str) or (targets is not None and key in targets):
        return True  # PEFT reads no layer index for these
    indexes = config.get("layers_to_transform")
    if indexes is None or (isinstance(indexes, list) and len(indexes) == 0):
        return True
    index = _layer_index(key, config.get("layers_pattern"))
    if index is None:
        return False
    return index == indexes if isinstance(indexes, int) else index in indexes
