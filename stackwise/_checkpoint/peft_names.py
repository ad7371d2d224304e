"""PEFT's module names from the names a checkpoint is loaded with: ``modules`` and ``layers``
for :func:`stackwise.lora.save_peft` / :func:`stackwise.lora.load_peft`, read off the
``names`` tree :func:`stackwise.load_checkpoint` takes, whatever the architecture."""

from __future__ import annotations

import re
from typing import Any

import jax

from stackwise._checkpoint.names import lookup
from stackwise._core import trees
from stackwise._finetune.lora import is_lora

__all__ = ["peft_modules"]

_FIELD = re.compile(r"\{(?::0\d+d)?\}")


def peft_modules(names: Any, adapters: Any) -> tuple[dict[str, str], str]:
    """``(modules, layers)`` for ``save_peft`` and ``load_peft``, from a checkpoint's names.

    Each adapted leaf of ``adapters`` (stacked :class:`stackwise.lora.LoraWeights`) is looked
    up in ``names`` (the tree given to :func:`stackwise.load_checkpoint`: a tensor name per
    leaf, ``{}`` for the layer): ``"model.layers.{}.self_attn.q_proj.weight"`` gives the
    module ``self_attn.q_proj`` and the layers ``base_model.model.model.layers.{i}``, PEFT's
    prefix for a model whose checkpoint names its layers so. Every adapted leaf's layers
    must be named alike. For a pattern's adapters, call it per position.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"q": jnp.zeros((2, 4, 4)), "norm": jnp.ones((2, 4))}
    >>> names = {"q": stackwise.Tensor("h.{}.attn.c_q.weight", transpose=(1, 0)),
    ...          "norm": "h.{}.ln_1.weight"}
    >>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=2, targets="['q']")
    >>> stackwise.lora.peft_modules(names, adapters)
    ({"['q']": 'attn.c_q'}, 'base_model.model.h.{i}')

    Raises:
      ValueError: an adapted leaf that ``names`` does not name, loads with ``reshape=`` (its
        adapter is not one of the module's 2-D weight), whose name has no layer field
        (``{}``) or more than one, does not end in ``.weight``, or whose layers are named
        otherwise than another adapted leaf's.
      TypeError: ``adapters`` holds no :class:`stackwise.lora.LoraWeights`.
    """
    who = "stackwise.lora.peft_modules"
    modules: dict[str, str] = {}
    prefixes: dict[str, str] = {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(adapters, is_leaf=is_lora):
        if not is_lora(leaf):
            continue
        path = jax.tree_util.keystr(keys)
        tensor = lookup(names, [trees.key_text(k) for k in keys], path, who)
        prefixes[path], module = _split(tensor, path, who)
        modules[path] = module.removesuffix(".weight")
    if not modules:
        raise TypeError(
            f"{who}: `adapters` holds no LoRA adapters (stackwise.lora.LoraWeights); give the "
            "adapters `stackwise.lora.init` made (or `load_peft` read)."
        )
    (a, pa), *others = prefixes.items()
    b, pb = next(((p, v) for p, v in others if v != pa), (None, None))
    if b is not None:
        raise ValueError(
            f"{who}: `names` puts the adapted leaves in layers named otherwise: {a} in "
            f"{pa + '{}'!r}, {b} in {pb + '{}'!r}; PEFT's file names every adapted module under "
            "one layer prefix: save the stacks of different layers to different files."
        )
    return modules, "base_model.model." + pa + "{i}"


def _split(tensor: Any, path: str, who: str) -> tuple[str, str]:
    """An adapted leaf's tensor name split at its layer field: ``(layers prefix, module)``."""
    name = tensor.name
    if tensor.reshape is not None:
        raise ValueError(
            f"{who}: `names` loads the adapted leaf {path} from {name!r} reshaped to "
            f"{tensor.reshape}, so its adapter is not one of the module's weight (PEFT's "
            "lora_A is (r, in) and lora_B (out, r) of the module's whole 2-D weight: per-"
            "head or split q/k/v adapters of a fused projection, as GPT-2's c_attn, have "
            "no PEFT form). Adapt the leaf loaded as the module's 2-D weight, without "
            "`reshape=`, and split it in the layer."
        )
    fields = _FIELD.findall(name)
    if len(fields) != 1 or not name.endswith(".weight"):
        what = ("no layer field `{}`" if not fields else "more than one layer field"
                if len(fields) > 1 else "no `.weight` at its end")
        raise ValueError(
            f"{who}: `names` gives the adapted leaf {path} the tensor {name!r}, with "
            f"{what}; PEFT puts an adapter on a module of each layer, named as "
            "'<layers>.{}.<module>.weight' (e.g. 'model.layers.{}.self_attn.q_proj.weight')."
        )
    field = _FIELD.search(name)
    module = name[field.end():].removeprefix(".")
    return name[:field.start()], module
