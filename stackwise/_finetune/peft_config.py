"""PEFT's ``adapter_config.json`` as :func:`stackwise.lora.load_peft` reads it: every LoraConfig
field (peft 0.21.2 and 0.22.0) is read and checked, inert (it changes nothing a loaded adapter
computes), or refused by name with what stackwise supports (``docs/finetune.md`` has the
table).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

__all__ = ["CONFIG", "WEIGHTS", "read_config", "refuse"]

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


#: PEFT LoraConfig fields (peft 0.21.2 and 0.22.0) that change nothing in what a loaded
#: adapter computes, accepted with any value: bookkeeping, the initialisers' own settings
#: (``init_lora_weights`` decides whether an initialiser changed the base), and settings of
#: features refused below.
INERT = {
    "task_type", "auto_mapping", "base_model_name_or_path", "revision",
    "inference_mode", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "astra_config", "runtime_config",
    # The file's tensors say which modules are adapted (checked against `modules`).
    "target_modules",
    # Ties the copies of tied modules (modules_to_save, trainable tokens, an adapted tied
    # embedding) in PEFT's model; a file holds each saved tensor once, returned as it is.
    "ensure_weight_tying",
    # The base module stores its weight (in, out) (GPT-2's Conv1D; PEFT sets it for them and
    # clears it for nn.Linear): lora_A is still (r, in) and lora_B (out, r), so the tensors
    # mean what they mean without it (tests/finetune/test_peft_gpt2.py).
    "fan_in_fan_out",
}
#: Fields ``load_peft`` reads, each checked in :func:`_read_config`.
READ = {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
        "layers_to_transform", "layers_pattern", "exclude_modules", "lora_dropout", "bias",
        "init_lora_weights", "modules_to_save", "use_dora",
        "peft_version"}  # (which rule matched modules_to_save: stackwise.lora.load_peft)
#: Fields refused unless unset (None, False, empty): what each one is in PEFT.
REFUSED = {
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


def refuse(who: str, path: str, field: str, got: Any, why: str) -> ValueError:
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


def read_config(directory: str, who: str) -> dict:
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
        raise refuse(who, path, "peft_type", config["peft_type"],
                      f"{SUPPORTED}, peft_type='LORA'")
    r, alpha = config["r"], config["lora_alpha"]
    if not _is_int(r) or r < 1:
        raise ValueError(f"{who}: {path} has r={r!r}; PEFT's rank is an int of at least 1.")
    if not _is_alpha(alpha):
        raise ValueError(
            f"{who}: {path} has lora_alpha={alpha!r}; PEFT's `lora_alpha` is a finite "
            "positive number (the update is scaled by lora_alpha / r)."
        )
    _check_fields(config, path, who)
    return config


def _check_fields(config: dict, path: str, who: str) -> None:
    """Every field but ``peft_type``, ``r`` and ``lora_alpha``: read and checked, inert, or
    refused by name."""
    for field, got in config.items():
        if field in READ or field in INERT:
            continue
        if field in REFUSED:
            if got:
                raise refuse(who, path, field, got,
                              f"{REFUSED[field]}; {SUPPORTED}, {field} unset")
        elif got not in (None, False, "", [], {}):
            raise refuse(who, path, field, got,
                          f"a field stackwise does not know (a newer PEFT's?); {SUPPORTED}, "
                          "and refuses what it cannot apply exactly")
    for field in ("use_rslora", "use_dora"):
        if not isinstance(config.get(field, False), bool):
            raise refuse(who, path, field, config[field], "it is true or false")
    for field, check, what in (("rank_pattern", _is_int, "an int rank of at least 1"),
                               ("alpha_pattern", _is_alpha, "a finite positive alpha")):
        got = config.get(field) or {}
        if not isinstance(got, dict) or not all(
                isinstance(k, str) and check(v) and (v >= 1 if field == "rank_pattern" else True)
                for k, v in got.items()):
            raise refuse(who, path, field, got,
                          f"PEFT's {field} maps module-name patterns to {what} each")
        for key in got:
            try:
                re.compile(key)
            except re.error as e:
                raise refuse(who, path, field, got, f"its key {key!r} is not a regular "
                              f"expression ({e}), as PEFT matches it") from None
    layers = config.get("layers_to_transform")
    if not (layers is None or _is_int(layers) or (
            isinstance(layers, list) and all(_is_int(i) for i in layers))):
        raise refuse(who, path, "layers_to_transform", layers,
                      "PEFT's layers_to_transform is a layer index or a list of them")
    if isinstance(config.get("modules_to_save"), str):
        raise refuse(who, path, "modules_to_save", config["modules_to_save"],
                      "PEFT's modules_to_save is a list of module names")
    for field in ("layers_pattern", "exclude_modules", "modules_to_save"):
        if not _names(config.get(field)):
            raise refuse(who, path, field, config[field],
                          f"PEFT's {field} is a str or a list of str")
    if config.get("layers_pattern") and layers is None:
        raise refuse(who, path, "layers_pattern", config["layers_pattern"],
                      "PEFT reads it only with layers_to_transform, and refuses it without")
    dropout = config.get("lora_dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool)
            and 0 <= dropout <= 1):
        raise refuse(who, path, "lora_dropout", dropout,
                      "PEFT's lora_dropout is a probability in [0, 1]")
    if dropout == 1:
        raise refuse(who, path, "lora_dropout", dropout,
                      "it drops every input to the adapters while training, so they would "
                      "never train (PEFT's dropout then gives zeros); stackwise loads "
                      "lora_dropout in [0, 1), applied while training with a key "
                      "(`stackwise.lora.attach(..., key=)`)")
    bias = config.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise refuse(who, path, "bias", bias, "PEFT's bias is 'none', 'all' or 'lora_only'")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise refuse(
            who, path, "init_lora_weights", init,
            "PEFT changed the base weights when it made this adapter (PiSSA, OLoRA, CorDA, "
            "LoRA-GA, Astra and LoftQ train on a residual base; MiCA is a variant), so on the "
            "original base it gives other outputs; in PEFT, save it with "
            "`save_pretrained(..., path_initial_model_for_weight_conversion=...)` to convert "
            f"it to plain LoRA. stackwise loads init_lora_weights {list(PLAIN_INITS)}")
