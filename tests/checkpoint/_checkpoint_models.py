"""The checkpoint tests' model: the example's LM (examples/lm/model.py, the same numerics in
all five frameworks), saved as a Hugging Face-style per-layer checkpoint.

The names are Hugging Face's (a Phi-3-like fused ``qkv_proj``): layer i's tensors are
``model.layers.{i}.self_attn.qkv_proj.weight``, ... in torch's ``(out, in)`` layout; the
embedding, final norm and head are ``model.embed_tokens.weight``, ``model.norm.*``,
``lm_head.*``. ``names_for(framework, abstract)`` writes each framework's names tree from
its params' own leaf paths, so the same checkpoint loads into every framework.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import jax
import numpy as np

import stackwise

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from lm import model as lm_models  # noqa: E402
from lm.checkpoints import HF_MODULES as MODULES  # noqa: E402  (the example's -> Hugging Face's)

FRAMEWORKS = ("jax", "haiku", "flax", "nnx", "equinox")
WEIGHT = {"w", "kernel", "weight", "scale", "embeddings", "embedding"}
BIAS = {"b", "bias", "offset"}
LINEAR = {"qkv", "out", "up", "down", "head"}


def config(layers=3, pattern=("global",)) -> lm_models.Config:
    return lm_models.Config(vocab=11, layers=layers, d_model=8, heads=2, seq_len=8, window=4,
                            pattern=pattern)


def _keys(path) -> list[str]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return [k for k in out if k != "value"]


def _position(framework: str, keys: list[str], c) -> int | None:
    if len(c.pattern) == 1 or "blocks" not in "/".join(keys):
        return None
    if framework == "jax":
        return int(keys[1])
    if framework in ("nnx", "equinox"):
        return int(keys[2])
    if framework == "flax":
        kind, j = keys[1].split("_")
        return [p for p, k in enumerate(c.pattern) if k == kind.lower()][int(j)]
    module = keys[0].split("/")[2]  # haiku: lm/blocks/local_3/qkv
    kind, _, j = module.partition("_")
    return [p for p, k in enumerate(c.pattern) if k == kind][int(j or 0)]


def names_for(framework: str, abstract, c) -> dict:
    """The names tree (nested by the params' keys) of ``abstract``'s every leaf."""
    names: dict = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(abstract):
        keys = _keys(path)
        parts = [p for k in keys for p in re.split(r"[/]", k)]
        leaf = parts[-1]
        module = next(p for p in reversed(parts) if p in MODULES or p.endswith("_bias"))
        if module.endswith("_bias"):  # the pure-JAX model's "up_bias", "head_bias"
            module, leaf = module[: -len("_bias")], "bias"
        elif module == leaf:  # the pure-JAX model's bare "qkv", "embed"
            leaf = "weight"
        kind = "weight" if leaf in WEIGHT else "bias" if leaf in BIAS else None
        assert kind, (framework, keys)
        torch_layout = framework == "equinox"  # eqx.nn.Linear keeps (out, in) too
        transpose = (1, 0) if module in LINEAR and kind == "weight" and not torch_layout else None
        spec = stackwise.Tensor(f"{MODULES[module]}.{kind}", transpose=transpose,
                                position=_position(framework, keys, c))
        node = names
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = spec
    return names


def hf_arrays(params, names, c) -> dict[str, np.ndarray]:
    """What ``params`` (stacked) are as a per-layer checkpoint: written by hand, independently
    of stackwise's own saving."""
    k = len(c.pattern)
    out = {}
    for path, a in jax.tree_util.tree_leaves_with_path(params):
        node = names
        for key in _keys(path):
            node = node[key]
        a = np.asarray(a)
        if "{}" in node.name:
            for j in range(a.shape[0]):
                x = a[j].T if node.transpose else a[j]
                out[node.name.format((node.position or 0) + j * k)] = np.ascontiguousarray(x)
        else:
            out[node.name] = np.ascontiguousarray(a.T if node.transpose else a)
    return out


def random_hf(abstract, names, c, seed=0) -> dict[str, np.ndarray]:
    """A random checkpoint for the pure-JAX model's ``abstract`` params, by ``names``."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: (rng.standard_normal(a.shape) * 0.5).astype(a.dtype),
                          abstract)
    return hf_arrays(params, names, c)


def loop_of(hf, abstract, names, c) -> dict:
    """The pure-JAX model's loop params (``"blocks"``: one tree per layer, in layer order)
    read from the checkpoint by hand: layer i's tensors, transposed back."""
    k = len(c.pattern)

    def leaf(path, a, i=None):
        node = names
        for key in _keys(path):
            node = node[key]
        x = hf[node.name.format(i) if i is not None else node.name]
        return np.ascontiguousarray(x.T) if node.transpose else x

    top = {key: jax.tree_util.tree_map_with_path(
               lambda p, a, key=key: leaf((jax.tree_util.DictKey(key), *p), a), v)
           for key, v in abstract.items() if key != "blocks"}
    blocks = abstract["blocks"]
    layers = []
    for i in range(c.layers):
        tree = blocks[i % k] if k > 1 else blocks
        prefix = (jax.tree_util.DictKey("blocks"),) + (
            (jax.tree_util.SequenceKey(i % k),) if k > 1 else ())
        layers.append(jax.tree_util.tree_map_with_path(
            lambda p, a, i=i, prefix=prefix: leaf(prefix + p, a, i), tree))
    return {**top, "blocks": layers}


def write_hf(folder, arrays: dict[str, np.ndarray], files: int = 2) -> None:
    """A sharded safetensors checkpoint: ``files`` files plus model.safetensors.index.json."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    names = sorted(arrays)
    weight_map = {}
    for f in range(files):
        file = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        part = names[f::files]
        save_file({n: arrays[n] for n in part}, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
