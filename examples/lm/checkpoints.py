"""The run's checkpoints: orbax folders of the training state, and the per-layer safetensors
of an ``--export``, under Hugging Face-style names the five frameworks share.

A step of an orbax checkpoint holds two items, ``state`` (the params, the optimizer's state
and the RNG's key data) and ``meta`` (the run as JSON); :func:`load_checkpoint` refuses an
array of another shape or dtype (orbax alone would cast it) and a damaged step, naming it.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import json
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import stackwise
from lm.cli import EXPORT_META, FORMAT, OLD_RUN_FIELDS, CheckpointError

ITEMS = ("state", "meta")


def checkpoint_manager(path: pathlib.Path, keep: int | None = None):
    """orbax's CheckpointManager of the folder ``path`` (steps saved synchronously: a Ctrl-C
    never leaves half a step, which orbax writes to a temporary folder, then renames)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=keep is not None, enable_async_checkpointing=False
    )
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(pathlib.Path(path).resolve(), options=options,
                                 item_handlers=handlers)


def save_checkpoint(path: pathlib.Path, state, meta: dict, keep: int = 3) -> None:
    """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON) as step ``meta["step"]`` of the
    orbax checkpoint folder ``path``, keeping the last ``keep`` steps."""
    with checkpoint_manager(path, keep) as manager:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta))
        manager.save(meta["step"], args=args, force=True)


def clear_checkpoint(path: pathlib.Path) -> None:
    """Deletes the saved steps of ``path`` (``--overwrite``, as its new run first saves)."""
    with checkpoint_manager(path) as manager:
        for step in manager.all_steps():
            manager.delete(step)


#: What orbax and tensorstore raise reading a damaged step (truncated, empty, not JSON).
DAMAGED = (OSError, ValueError, KeyError, EOFError, TypeError)


def latest_step(path: pathlib.Path) -> int:
    """The last saved step of the checkpoint folder ``path``: CheckpointError if none."""
    with checkpoint_manager(path) as manager:
        step = manager.latest_step()
    if step is None:
        raise CheckpointError(
            f"{path} is not a checkpoint of this example (a folder without a saved step); pass "
            "--overwrite to train into it, or --checkpoint PATH for another folder."
        )
    return step


def read_meta(path: pathlib.Path) -> dict:
    """The run saved with the last step of ``path``: its fields, step, validation loss and
    vocabulary. CheckpointError, naming the step's folder, if it cannot be read."""
    step = latest_step(path)
    try:
        with checkpoint_manager(path) as manager:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
    except DAMAGED as e:
        raise CheckpointError(
            f"{path / str(step)} is not a checkpoint of this example, or a damaged one "
            f"({type(e).__name__}: {first_line(e)}); pass --overwrite to train over it, or "
            "--checkpoint PATH for another folder."
        ) from None
    if not isinstance(meta, dict):
        meta = {}
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is a checkpoint of an older version of this example (format "
            f"{meta.get('format', 1)}, this one reads {FORMAT}); train again with --overwrite."
        )
    if not {"run", "step", "val_loss", "chars"} <= set(meta):
        raise CheckpointError(
            f"{path / str(step)} is not a complete checkpoint of this example (its meta lacks "
            f"{sorted({'run', 'step', 'val_loss', 'chars'} - set(meta))}); pass --overwrite to "
            "train over it, or --checkpoint PATH for another folder."
        )
    for field, value in OLD_RUN_FIELDS.items():
        meta["run"].setdefault(field, value)
    return meta


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def leaf_names(tree) -> dict[str, Any]:
    """The leaves of ``tree`` by a name of their path that orbax's metadata tree shares
    (``params/blocks/qkv``; a named tuple's fields and a module's attributes by name)."""

    def name(k) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(name(k) for k in p): leaf for p, leaf in leaves}


def load_checkpoint(path: pathlib.Path, template) -> Any:
    """The arrays of the last step saved at ``path``, in the structure of ``template`` (the
    same shapes and dtypes: orbax alone would cast a dtype that differs).

    Raises CheckpointError, naming the folder, for a missing or mismatched array and for a step
    that cannot be read (truncated, empty)."""
    step = latest_step(path)
    where = path / str(step)
    try:
        _check_readable(where / "state")
        with checkpoint_manager(path) as manager:
            saved = leaf_names(manager.item_metadata(step)["state"])
            for name, leaf in leaf_names(template).items():
                _check_leaf(where, name, saved.get(name), leaf)
            for name in sorted(set(saved) - set(leaf_names(template))):
                raise CheckpointError(
                    f"checkpoint {where} has an array {name} this model lacks: it was saved by "
                    "another model; train again with --overwrite, or pass --checkpoint PATH."
                )
            restore = ocp.args.Composite(state=ocp.args.StandardRestore(template))
            return manager.restore(step, args=restore)["state"]
    except DAMAGED as e:
        raise CheckpointError(
            f"checkpoint {where} is damaged ({type(e).__name__}: {first_line(e)}); train again "
            "with --overwrite, or pass --checkpoint PATH of another."
        ) from None


def _check_readable(state: pathlib.Path) -> None:
    """Reads every record of a saved state's OCDBT store, synchronously, before orbax opens
    it: orbax reads asynchronously, and on a damaged step (a truncated manifest or data file)
    its reads still in flight outlive its event loop and print tracebacks after the error.
    Raises ValueError (one of DAMAGED: tensorstore's DATA_LOSS) for a record it cannot read;
    the example's states are a few MB."""
    import tensorstore as ts  # (orbax's own storage layer)

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state}/"}).result()
    for key in store.list().result():
        store.read(key).result()


def _check_leaf(where: pathlib.Path, name: str, saved, leaf) -> None:
    """Refuses a leaf the checkpoint lacks or holds with another shape or dtype."""
    if saved is None:
        raise CheckpointError(
            f"checkpoint {where} has no array {name}: it is incomplete or was saved by another "
            "model; train again with --overwrite, or pass --checkpoint PATH of another."
        )
    if tuple(saved.shape) != tuple(leaf.shape) or np.dtype(saved.dtype) != np.dtype(leaf.dtype):
        raise CheckpointError(
            f"checkpoint {where}: {name} is {np.dtype(saved.dtype)}{list(saved.shape)}, the "
            f"model expects {np.dtype(leaf.dtype)}{list(leaf.shape)}; pass the "
            "--layers/--d-model/--heads it was trained with."
        )


#: The model's modules under Hugging Face-style names (a Llama's, where it has the tensor;
#: "{}" is the layer), the same in every framework: each framework's leaves are named by their
#: module (the last key that is one of these) and their kind (a weight or a bias).
HF_MODULES = {
    "ln1": "model.layers.{}.input_layernorm",
    "qkv": "model.layers.{}.self_attn.qkv_proj",
    "out": "model.layers.{}.self_attn.o_proj",
    "ln2": "model.layers.{}.post_attention_layernorm",
    "up": "model.layers.{}.mlp.up_proj",
    "down": "model.layers.{}.mlp.down_proj",
    "embed": "model.embed_tokens",
    "ln_f": "model.norm",
    "head": "lm_head",
}
#: The frameworks' names of a module's bias (Haiku's "b", a Haiku norm's "offset"); every
#: other leaf of a module is its weight ("w", "kernel", a norm's "scale", "embedding", ...).
HF_BIAS = {"b", "bias", "offset"}
#: The Linear layers: torch stores their weight (out, in); every framework here but Equinox
#: keeps (in, out), so the export transposes them.
HF_LINEAR = {"qkv", "out", "up", "down", "head"}


def _keys(path) -> list[str]:
    """A leaf's path as strings (dict keys, attribute names, indices)."""
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _hf_position(parts: list[str], pattern: tuple[str, ...]) -> int | None:
    """The pattern position of a stacked leaf: the key after "blocks" (and NNX's and
    Equinox's "layers") is its index (JAX, NNX, Equinox) or its kind's module, numbered by
    kind (linen's "Local_1", Haiku's "local_1")."""
    if len(pattern) == 1 or "blocks" not in parts:
        return None
    after = parts[parts.index("blocks") + 1 :]
    tag = after[1] if after[0] == "layers" else after[0]
    if tag.isdigit():
        return int(tag)
    kind, _, j = tag.lower().partition("_")
    return [p for p, k in enumerate(pattern) if k == kind][int(j or 0)]


def hf_names(framework: str, template, pattern: tuple[str, ...]) -> dict:
    """The names tree of ``stackwise.load_checkpoint``/``save_safetensors`` for the
    ``framework`` model's params ``template`` (nested by its keys) with ``pattern``: one
    Hugging Face-style checkpoint for all five frameworks."""
    names: dict = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(template):
        keys = _keys(path)
        parts = [part for key in keys for part in key.split("/")]  # Haiku's "lm/blocks/..."
        module = next(p for p in reversed(parts) if p in HF_MODULES or p.endswith("_bias"))
        if module.endswith("_bias"):  # the pure-JAX model's "up_bias", "head_bias"
            module, kind = module[: -len("_bias")], "bias"
        else:  # a module's leaf ("w", "b", "scale", ...), or the pure-JAX model's bare "qkv"
            kind = "bias" if parts[-1] in HF_BIAS else "weight"
        transpose = kind == "weight" and module in HF_LINEAR and framework != "equinox"
        node = names
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = stackwise.Tensor(
            f"{HF_MODULES[module]}.{kind}", transpose=(1, 0) if transpose else None,
            position=_hf_position(parts, pattern))
    return names


def export_safetensors(folder: pathlib.Path, params, names, k: int, meta: dict) -> list[str]:
    """Saves ``params`` to ``folder`` as per-layer safetensors (``hf_names``), with the run
    as JSON (``EXPORT_META``) for ``--load-safetensors``. Returns the paths written."""
    files = stackwise.save_safetensors(params, names, folder, pattern=k if k > 1 else None)
    (pathlib.Path(folder) / EXPORT_META).write_text(json.dumps(meta))
    return [*files, str(pathlib.Path(folder) / EXPORT_META)]


def read_export_meta(folder: pathlib.Path) -> dict:
    """The run an --export saved in ``folder``: CheckpointError naming the file if damaged."""
    path = pathlib.Path(folder) / EXPORT_META
    try:
        meta = json.loads(path.read_text())
        if not {"run", "step", "val_loss", "chars"} <= set(meta):
            raise KeyError(sorted({"run", "step", "val_loss", "chars"} - set(meta)))
    except (*DAMAGED, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"--load-safetensors: {path} is not what --export writes, or is damaged "
            f"({type(e).__name__}: {first_line(e)}); export it again with --restore --export DIR."
        ) from None
    for field, value in OLD_RUN_FIELDS.items():
        meta["run"].setdefault(field, value)
    return meta


def load_safetensors(folder: pathlib.Path, template, names, k: int) -> Any:
    """The params an --export saved in ``folder``, via ``stackwise.load_checkpoint`` (each
    tensor read and transposed back, every shape and dtype checked against ``template``)."""
    try:
        return stackwise.load_checkpoint(
            str(folder), template, names, pattern=k if k > 1 else None
        )
    except (ValueError, TypeError) as e:
        raise CheckpointError(
            f"--load-safetensors {folder}: {' '.join(str(e).split())} (export it again with "
            "--restore --export DIR)"
        ) from None

