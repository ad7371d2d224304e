"""Train a character-level transformer whose blocks are one stackwise stack, then sample.

    python examples/transformer_lm.py                      # pure JAX: 111 s on 2 idle CPU cores
    python examples/transformer_lm.py --steps 200          # a first sample sooner
    python examples/transformer_lm.py --framework flax     # or haiku, nnx, equinox: the same
    python examples/transformer_lm.py --pattern local,local,global --window 16  # local attention
    python examples/transformer_lm.py --resume             # continue an interrupted run
    python examples/transformer_lm.py --restore            # sample from the saved checkpoint
    python examples/transformer_lm.py --restore --export out/lm_hf  # as per-layer safetensors
    python examples/transformer_lm.py --load-safetensors out/lm_hf  # sample from them
    python examples/transformer_lm.py --remat --layers 24  # remat each block; any depth
    python examples/transformer_lm.py --lora 8             # fine-tune the checkpoint with LoRA
    python examples/transformer_lm.py --lora 8 --quantize nf4  # QLoRA, on an nf4 base

What it shows:
  * the blocks' params are stacked (a leading layer axis) and run as ONE scanned layer, so the
    compile time does not grow with ``--layers``;
  * a pattern of kinds of block (``--pattern local,local,global``: sliding-window attention
    over the last ``--window`` tokens, and attention over the whole context), repeated over
    the ``--layers`` blocks as one pattern stack, ``--layers`` need not be a multiple of it;
  * training with optax on the embedded text (``examples/data/shakespeare.txt``, or ``--text``),
    reporting the loss in nats, bits per character and perplexity;
  * sampling token by token with a stacked per-layer KV cache (the stack's per-layer state),
    checked against the full forward pass, with prefill and decode speeds; the pure-JAX model
    (and every ``--lora`` run) samples in the serving layout (``stackwise.to_serving``: one
    buffer per layer for the weights and the cache, run as a loop of layers);
  * checkpoints of the stacked params, restored and converted to the layout of the same model
    written as a plain Python loop over separate blocks (``stackwise.unstack_layers``,
    ``stackwise.haiku.to_loop``, ``stackwise.flax.to_loop`` or Equinox's
    ``Stack.to_layers()``), giving the same logits.

Checkpoints: orbax's ``CheckpointManager`` in the folder ``examples/checkpoints/lm_<framework>``
unless ``--checkpoint DIR``, one subfolder per saved step (``state``: the arrays, ``meta``: the
run as JSON), the last ``--keep`` (3) kept. Training saves every ``--save-every`` steps (by
default at every validation, every ``--steps``/8), at the last step and on Ctrl-C; orbax writes
a step to a temporary folder, then renames it, so a save is never half-written. A checkpoint
belongs to one run: the framework, the model's sizes and pattern, the text (its SHA-256), the
seed, batch, learning rate, optimizer and number of steps. Training never replaces an existing
checkpoint unless asked: ``--resume`` continues the run it holds from its last save (params,
optimizer state, step and RNG are saved, so a resumed run computes exactly what an
uninterrupted one does), ``--overwrite`` trains a new run over it. The same command again, once
its run has finished, samples from the checkpoint (and says so) instead of training. ``--resume``
and ``--restore`` take every run flag you leave out from the checkpoint; one you give must agree.

``--export DIR`` also saves the params as a per-layer safetensors checkpoint with Hugging
Face-style names (``model.layers.{i}.self_attn.qkv_proj.weight``, torch's ``(out, in)`` layout,
through ``stackwise.save_safetensors``) and the run (``transformer_lm.json``);
``--load-safetensors DIR`` samples from it (``stackwise.load_checkpoint``), as ``--restore``
does: the same samples. The names are the same for every ``--framework`` (``hf_names`` reads
them off each framework's params: Haiku's ``lm/blocks/block/qkv`` ``w``, linen's and NNX's
``kernel``, Equinox's ``weight``, which alone keeps torch's layout).

``--lora RANK`` fine-tunes the checkpoint's run (its frozen base) with LoRA adapters on every
linear layer of the blocks, for ``--steps`` (default 200) steps, saves them in Hugging Face
PEFT's layout (``--adapters DIR``, default ``<checkpoint>_lora``) and samples with them merged;
``--quantize int8|int4|nf4`` quantizes the base first (QLoRA) and samples from it with the
adapters. ``examples/lm_finetune.py`` says how.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import pathlib
import signal
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_TEXT = HERE / "data" / "shakespeare.txt"
CHECKPOINTS = HERE / "checkpoints"
FORMAT = 3  # of the checkpoints: 3, orbax folders (2 was one .npz file)
#: Saved steps kept by default (--keep).
KEEP = 3

#: The defaults of the flags that identify a run (see the module docstring).
RUN_DEFAULTS = {  # the best for a 2-minute budget on 2 CPU cores: docs/example-tuning.md
    "framework": "jax",
    "steps": 1600,
    "layers": 4,
    "d_model": 128,
    "heads": 4,
    "seq_len": 64,
    "pattern": "global",
    "window": 16,
    "batch": 8,
    "lr": 2e-3,
    "optimizer": "adamw",
    "seed": 0,
}
#: Seconds the default run takes on 2 idle CPU cores (the docstring's figure, the README's).
DEFAULT_RUN_S = 111
#: The run fields that fix the model (and so which params a checkpoint has).
MODEL_FIELDS = ("framework", "layers", "d_model", "heads", "seq_len", "pattern", "window")
#: What checkpoints saved before --pattern and --optimizer existed hold for these fields.
OLD_RUN_FIELDS = {"pattern": "global", "window": 16, "optimizer": "adamw"}
#: Validation: this many tokens, in evenly spaced windows of the validation text.
VAL_TOKENS = 8192
#: Cached decoding and the unstacked loop compute the same function in another order.
LOGITS_ATOL = 1e-3
#: The largest --seed (the run uses the keys of seed, seed + 1 and seed + 3).
MAX_SEED = 2**32 - 4
#: --framework's choices: lm_models.FRAMEWORKS (named here: the command line imports no JAX).
FRAMEWORKS = ("jax", "haiku", "flax", "nnx", "equinox")
#: --optimizer's choices: the keys of OPTIMIZERS.
OPTIMIZER_NAMES = ("adamw", "lamb", "adafactor", "muon")
#: The file an --export writes next to the safetensors: the run, step and vocabulary.
EXPORT_META = "transformer_lm.json"
#: --lora's default number of fine-tuning steps (--steps).
LORA_STEPS = 200
#: --quantize's choices: stackwise.quant.KINDS (named here: the command line imports no JAX).
QUANT_KINDS = ("int8", "int4", "nf4")


class UsageError(Exception):
    """The command cannot run as given; the message says what to change."""


class CheckpointError(UsageError):
    """A checkpoint is missing, belongs to another run, or would be overwritten: what to do."""


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = RUN_DEFAULTS
    p.add_argument("--framework", choices=FRAMEWORKS, help=f"(default: {d['framework']})")
    p.add_argument("--steps", type=positive, help=f"training steps (default: {d['steps']})")
    p.add_argument("--layers", type=positive, help=f"transformer blocks (default: {d['layers']})")
    p.add_argument("--d-model", type=positive, help=f"(default: {d['d_model']})")
    p.add_argument("--heads", type=positive, help=f"(default: {d['heads']})")
    p.add_argument("--seq-len", type=positive, help=f"training context (default: {d['seq_len']})")
    p.add_argument(
        "--pattern",
        help="the blocks' kinds, comma-separated and repeated over --layers: local\n"
        "(sliding-window attention) or global (the whole context), e.g. local,local,global\n"
        f"(default: {d['pattern']})",
    )
    p.add_argument(
        "--window",
        type=positive,
        help=f"a local block's window in tokens, at most --seq-len (default: {d['window']})",
    )
    p.add_argument("--batch", type=positive, help=f"(default: {d['batch']})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default: {d['lr']})")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZER_NAMES,
        help=f"optax optimizer, per layer of the stack (default: {d['optimizer']})",
    )
    p.add_argument("--seed", type=int, help=f"(default: {d['seed']})")
    p.add_argument(
        "--text",
        type=pathlib.Path,
        help=f"a UTF-8 text to learn (default: {DEFAULT_TEXT.relative_to(HERE.parent)})",
    )
    p.add_argument("--remat", action="store_true", help="rematerialise each block (less memory)")
    p.add_argument("--sample-len", type=int, default=400, help="characters to generate")
    p.add_argument("--prompt", default="\n", help="text the sample starts from")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature")
    p.add_argument(
        "--checkpoint",
        type=pathlib.Path,
        help="checkpoint folder, orbax's (default: examples/checkpoints/lm_<framework>)",
    )
    p.add_argument(
        "--save-every",
        type=positive,
        help="save (and validate) every this many steps, besides the last step and Ctrl-C\n"
        "(default: every validation, --steps/8)",
    )
    p.add_argument(
        "--keep", type=positive, default=KEEP, help=f"saved steps to keep (default: {KEEP})"
    )
    p.add_argument(
        "--export",
        type=pathlib.Path,
        metavar="DIR",
        help="also save the trained params to DIR as per-layer safetensors with Hugging\n"
        "Face-style names (model.layers.{i}.self_attn.qkv_proj.weight, ...), any --framework",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the checkpoint's run")
    mode.add_argument("--restore", action="store_true", help="skip training: sample from it")
    mode.add_argument("--overwrite", action="store_true", help="train anew over a checkpoint")
    mode.add_argument(
        "--load-safetensors",
        type=pathlib.Path,
        metavar="DIR",
        help="skip training: sample from the params an --export saved in DIR",
    )
    p.add_argument(
        "--lora",
        type=positive,
        metavar="RANK",
        help="fine-tune the checkpoint's run with LoRA adapters of this rank on every linear\n"
        f"layer of the blocks, --steps steps (default: {LORA_STEPS}), then sample with them",
    )
    p.add_argument("--lora-alpha", type=float, help="LoRA's alpha: the update is "
                   "alpha / RANK * a @ b (default: RANK)")
    p.add_argument("--quantize", choices=QUANT_KINDS,
                   help="with --lora: quantize the frozen base first (QLoRA), and sample from it")
    p.add_argument(
        "--adapters",
        type=pathlib.Path,
        metavar="DIR",
        help="where --lora saves the adapters, in PEFT's layout (default: the checkpoint's\n"
        "folder name + _lora, or _qlora_<kind> with --quantize)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.pattern is not None:  # one spelling, as checkpoints keep it: "local,local,global"
        args.pattern = ",".join(kind.strip() for kind in args.pattern.split(","))
    args.given = {field for field in (*RUN_DEFAULTS, "text") if getattr(args, field) is not None}
    if args.checkpoint is None:
        args.checkpoint = CHECKPOINTS / f"lm_{args.framework or RUN_DEFAULTS['framework']}"
    # Absolute, once: orbax and tensorstore's `file://` take no path relative to the cwd.
    args.checkpoint = args.checkpoint.absolute()
    if args.lora is not None:
        args.lora_alpha = float(args.lora) if args.lora_alpha is None else args.lora_alpha
        if args.adapters is None:
            tail = f"_qlora_{args.quantize}" if args.quantize else "_lora"
            args.adapters = args.checkpoint.with_name(args.checkpoint.name + tail)
    check_args(p, args)
    check_lora_args(p, args)
    return args


def unwritable_parent(path: pathlib.Path) -> pathlib.Path | None:
    """The closest existing folder above ``path`` if it is not a writable folder (a regular
    file, say), else None: the saves create the missing folders below it."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    return folder


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, before any work, the flags no run can use: ``p.error`` (one line naming the
    flag, exit status 2). What needs the text (its length, the prompt's characters) is checked
    once it is read, by :func:`check_text`."""

    def refuse(name: str, value, expected: str) -> None:
        p.error(f"{name} {value!r}: expected {expected}")

    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        refuse("--lr", args.lr, "a positive learning rate, e.g. --lr 2e-3")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        refuse("--temperature", args.temperature, "a positive number, e.g. --temperature 0.6 "
               "(lower: safer samples; 1: the model's own distribution)")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        refuse("--seed", args.seed, f"an integer from 0 to {MAX_SEED}")
    if args.sample_len < 0:
        refuse("--sample-len", args.sample_len, "0 or more characters to generate")
    if not args.prompt:
        refuse("--prompt", args.prompt, "at least one character to start the sample from "
               "(the default is a newline)")
    if args.text is not None and args.text.is_dir():
        p.error(f"--text {args.text}: a folder, not a file; give a UTF-8 text file")
    if args.text is not None and not args.text.is_file():
        what = "not a regular file" if args.text.exists() else "no such file"
        p.error(f"--text {args.text}: {what}; give a UTF-8 text file")
    if args.checkpoint.exists() and not args.checkpoint.is_dir():
        old = args.checkpoint.suffix == ".npz"
        hint = " (an .npz of an older version of this example?)" * old
        p.error(f"--checkpoint {args.checkpoint}: a file{hint}; checkpoints are folders (orbax's): "
                f"give a folder path, e.g. --checkpoint {args.checkpoint.with_suffix('')}")
    if args.export is not None and holds_files(args.export):
        what = "a file" if not args.export.is_dir() else "a folder that is not empty"
        p.error(f"--export {args.export}: {what}; give a new or empty folder (an export never "
                "replaces files)")
    if args.export is not None and (folder := unwritable_parent(args.export)):
        p.error(f"--export {args.export}: cannot write there ({folder} is not a writable "
                "folder); give a new folder in one you can write")
    if args.export is not None and args.load_safetensors is not None:
        p.error("--export: not allowed with --load-safetensors (it would save the same params)")
    if args.load_safetensors is not None and not (args.load_safetensors / EXPORT_META).is_file():
        p.error(f"--load-safetensors {args.load_safetensors}: no {EXPORT_META} there; give a "
                "folder that --export DIR wrote")
    if not (args.restore or args.load_safetensors or args.lora):  # training writes it
        if folder := unwritable_parent(args.checkpoint):
            p.error(f"--checkpoint {args.checkpoint}: cannot write there ({folder} is not a "
                    "writable folder); pass --checkpoint PATH in a folder you can write")


def check_lora_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses the fine-tuning flags no run can use (as :func:`check_args`)."""
    if args.lora is None:
        for name in ("lora_alpha", "quantize", "adapters"):
            if getattr(args, name) is not None:
                p.error(f"{flag(name)}: only with --lora RANK (it fine-tunes the checkpoint's "
                        f"run with LoRA adapters; {flag(name)} is one of its settings)")
        return
    for name in ("resume", "restore", "load_safetensors", "export"):
        if getattr(args, name):
            p.error(f"--lora: not allowed with {flag(name)} (--lora reads the pre-trained "
                    "--checkpoint, fine-tunes it and samples; its adapters go to --adapters DIR)")
    if not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        p.error(f"--lora-alpha {args.lora_alpha!r}: expected a positive number, e.g. "
                f"--lora-alpha {2 * args.lora} (the update is alpha / RANK * a @ b)")
    adapters, checkpoint = args.adapters.resolve(), args.checkpoint.resolve()
    if adapters == checkpoint or checkpoint in adapters.parents or adapters in checkpoint.parents:
        p.error(f"--adapters {args.adapters}: it would replace the pre-trained --checkpoint "
                f"{args.checkpoint} or hold it; give a folder beside it, e.g. --adapters "
                f"{args.checkpoint}_lora")
    if holds_files(args.adapters) and not args.overwrite:
        p.error(f"--adapters {args.adapters}: already holds files; pass --overwrite to "
                "replace them, or --adapters DIR for another folder")
    if folder := unwritable_parent(args.adapters):
        p.error(f"--adapters {args.adapters}: cannot write there ({folder} is not a writable "
                "folder); give a folder in one you can write")


def holds_files(path: pathlib.Path) -> bool:
    """Whether ``path`` exists and is not an empty folder (an empty one holds no checkpoint)."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


# --------------------------------------------------------------------------
# The command line above needs only the standard library: run as a script, --help and argument
# errors answer before JAX, optax and orbax are imported (seconds, not a minute on a busy
# machine). main() parses again, as a test's call does.

if __name__ == "__main__":
    parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import stackwise.optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_models  # noqa: E402  (the five model definitions, next to this file)


def check_text(args: argparse.Namespace, chars: str, data: np.ndarray) -> None:
    """Refuses a ``--text`` too short for the context and a ``--prompt`` the model cannot read
    (UsageError naming the flag), before training: the prompt is used only after it."""

    def fits(n: int) -> bool:  # room for a training window and a validation window
        split = int(0.9 * n)
        return split - args.seq_len - 1 >= 1 and n - split >= args.seq_len + 1

    if not fits(len(data)):
        need = next(n for n in range(len(data) + 1, 20 * args.seq_len + 40) if fits(n))
        raise UsageError(
            f"--text {args.text} has {len(data)} characters, too few for --seq-len "
            f"{args.seq_len} (90% trains, 10% validates, each needs more than the context): "
            f"give a text of at least {need} characters, or a smaller --seq-len."
        )
    missing = sorted(set(args.prompt) - set(chars))
    if missing:
        raise UsageError(
            f"--prompt {args.prompt!r} has characters that are not in the vocabulary of "
            f"{args.text.name}: {''.join(missing)!r}; use only characters of the training text."
        )
    if len(args.prompt) > args.seq_len:
        raise UsageError(
            f"--prompt has {len(args.prompt)} characters, more than the context, --seq-len "
            f"{args.seq_len}; give a shorter --prompt."
        )


# --------------------------------------------------------------------------
# Data: characters to int ids.


def load_text(path: pathlib.Path) -> tuple[str, np.ndarray, str]:
    """The vocabulary (sorted distinct characters), the text as int32 ids, and its SHA-256."""
    raw = pathlib.Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--text {path} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
            "give a UTF-8 file (e.g. convert it with iconv -t UTF-8)."
        ) from None
    chars = "".join(sorted(set(text)))
    lookup = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([lookup[ch] for ch in text], dtype=np.int32)
    return chars, ids, hashlib.sha256(raw).hexdigest()


def encode(chars: str, text: str) -> np.ndarray:
    missing = sorted(set(text) - set(chars))
    if missing:
        raise ValueError(f"the prompt has characters not in the training text: {missing!r}")
    return np.array([chars.index(ch) for ch in text], dtype=np.int32)


def sample_batch(key, data, batch: int, seq_len: int):
    """``batch`` random windows of ``seq_len + 1`` tokens: (inputs, targets)."""
    starts = jax.random.randint(key, (batch,), 0, data.shape[0] - seq_len - 1)
    windows = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, seq_len + 1))(starts)
    return windows[:, :-1], windows[:, 1:]


def val_windows(data: np.ndarray, seq_len: int, tokens: int = VAL_TOKENS):
    """Evenly spaced windows covering about ``tokens`` tokens: (inputs, targets), fixed."""
    count = max(1, tokens // seq_len)
    starts = np.linspace(0, len(data) - seq_len - 1, count).astype(np.int64)
    windows = np.stack([data[s : s + seq_len + 1] for s in starts])
    return jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


def describe_loss(nats: float) -> str:
    """A cross-entropy in nats per character, in bits per character, and as a perplexity."""
    return f"{nats:.3f} nats = {nats / math.log(2):.2f} bits/char (perplexity {math.exp(nats):.1f})"


# --------------------------------------------------------------------------
# Runs and their checkpoints.


def run_identity(args: argparse.Namespace, text_sha256: str) -> dict:
    """What makes two trainings the same run (``--remat`` changes memory, not the maths)."""
    run = {field: getattr(args, field) for field in RUN_DEFAULTS}
    return {**run, "text": str(pathlib.Path(args.text).resolve()), "text_sha256": text_sha256}


def differences(saved: dict, run: dict, fields) -> list[str]:
    """``--flag <saved> (checkpoint) vs <run> (this run)`` for each field that differs."""
    out = []
    for field in fields:
        if field == "text_sha256":
            if saved[field] != run[field]:
                out.append(
                    f"--text: {pathlib.Path(saved['text']).name} (SHA-256 {saved[field][:12]}) "
                    f"vs {pathlib.Path(run['text']).name} ({run[field][:12]})"
                )
        elif saved[field] != run[field]:
            out.append(f"{flag(field)}: {saved[field]} in the checkpoint vs {run[field]} here")
    return out


def settle_args(args: argparse.Namespace, saved: dict | None, fields, where=None,
                other="--checkpoint PATH") -> None:
    """Fills the run flags not given: from the checkpoint's run ``saved`` (in ``where``,
    by default ``--checkpoint``) for ``fields``, else the defaults. Raises CheckpointError
    naming the given flags that disagree with it, and ``other``, the flag to read another."""
    run = saved["run"] if saved else {}
    clashes = []
    for field in fields:
        if field in args.given and saved and getattr(args, field) != run[field]:
            clashes.append(field)
        elif field not in args.given and saved:
            setattr(args, field, run[field])
    if clashes:
        wanted = {field: getattr(args, field) for field in clashes}
        lines = differences(run, wanted, clashes)
        if "framework" in clashes:
            lines[clashes.index("framework")] += (
                f" (it was saved by the {run['framework']} model: pass --framework "
                f"{run['framework']}, or leave --framework out)"
            )
        raise CheckpointError(
            f"{where or args.checkpoint} holds another run than the flags ask for "
            f"({'; '.join(lines)}): "
            f"leave these flags out to use the checkpoint's, or pass {other}."
        )
    for field, default in RUN_DEFAULTS.items():
        if getattr(args, field) is None:
            setattr(args, field, default)
    if args.text is None:
        saved_text = pathlib.Path(run.get("text", DEFAULT_TEXT))
        args.text = saved_text if saved_text.is_file() else DEFAULT_TEXT


#: The items of each saved step: the arrays, and the run as JSON.
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


def state_template(lm, args: argparse.Namespace, run: dict) -> dict:
    """The abstract training state a checkpoint of ``run`` holds: params, the state of its
    ``--optimizer`` and the RNG's key data."""
    params = jax.eval_shape(lm.init, jax.random.key(0))
    optimizer = make_optimizer(argparse.Namespace(**{**vars(args), **run}))
    return {
        "params": params,
        "opt_state": jax.eval_shape(optimizer.init, params),
        "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    }


def finished_same_run(saved: dict, run: dict) -> bool:
    """Whether the checkpoint's run is this run, trained to its last step: running the same
    command again (the README's first one, say) then samples from it instead of training."""
    same = not differences(saved["run"], run, [*RUN_DEFAULTS, "text_sha256"])
    return same and saved["step"] >= saved["run"]["steps"]


def refuse_to_overwrite(path: pathlib.Path, saved: dict, run: dict) -> CheckpointError:
    """The error for training over an existing checkpoint without --resume or --overwrite,
    one line: what the checkpoint holds, what differs, the flags to pass."""
    where = f"step {saved['step']} of {saved['run']['steps']}"
    differ = differences(saved["run"], run, [*RUN_DEFAULTS, "text_sha256"])
    if not differ:
        return CheckpointError(
            f"{path} already holds this run (unfinished, {where}). Pass --resume to continue it, "
            "--restore to sample from it, or --overwrite to train it again from step 0."
        )
    return CheckpointError(
        f"{path} holds another run ({where}; {'; '.join(differ)}): pass --overwrite to replace "
        "it, --checkpoint PATH to train into another file, or --resume to continue that run "
        "(leaving out those flags)."
    )


# --------------------------------------------------------------------------
# Training.


OPTIMIZERS = {
    "adamw": lambda lr: optax.adamw(lr, 0.9, 0.99),
    "lamb": lambda lr: optax.lamb(lr, 0.9, 0.99),
    "adafactor": lambda lr: optax.adafactor(lr),
    "muon": lambda lr: optax.contrib.muon(lr),
}


def make_optimizer(args: argparse.Namespace, *, layerwise: bool = True):
    """The optimizer, through ``stackwise.optax.layerwise``: the blocks' leaves are stacked
    (every framework's params name them "blocks"), so LAMB's trust ratio, Adafactor's factored
    moments and Muon's orthogonalisation run per layer, as in the loop model, and the global
    norm stays global. ``layerwise=False``: the plain optimizer (for the loop model's params)."""
    warmup = min(100, max(1, args.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, 2), args.lr / 10
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), OPTIMIZERS[args.optimizer](schedule))
    if not layerwise:
        return tx
    return stackwise.optax.layerwise(tx, stacked=lambda path: "blocks" in path)


class StopOnCtrlC:
    """While active, the first Ctrl-C asks the training loop to stop after the current step
    (it then saves); a second one interrupts at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True  # (no printing here: the loop reports it)

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def scanned(args: argparse.Namespace) -> str:
    """How the blocks run: ``4 blocks, one scan``; with a pattern of k kinds, one scan over
    the whole repeats of the pattern and the last ``layers % k`` blocks after it."""
    k = len(args.pattern.split(","))
    if k == 1:
        return f"{args.layers} blocks, one scan"
    repeats, tail = divmod(args.layers, k)
    rest = f", then {tail} block{'s' * (tail > 1)}" if tail else ""
    return f"{args.layers} blocks: one scan of {repeats} x {args.pattern}{rest}"


def train(lm, state, start: int, train_data, val, args, save, log=print) -> tuple[Any, dict]:
    """Trains ``state = {"params", "opt_state", "rng"}`` from step ``start`` to ``args.steps``.

    ``save(state, step, val_loss)`` is called every ``--save-every`` steps (validating there:
    by default the validations, every ``--steps``/8), at the last step and when Ctrl-C stops the
    run early. Returns the state and a record of the run (``record["stopped_at"]`` if stopped).
    """
    optimizer = make_optimizer(args)

    def step(params, opt_state, key):
        inputs, targets = sample_batch(key, train_data, args.batch, args.seq_len)
        loss, grads = jax.value_and_grad(
            lambda p: lm_models.loss_fn(lm, p, inputs, targets)
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(lambda params: lm_models.loss_fn(lm, params, *val))
    params, opt_state, key = state["params"], state["opt_state"], state["rng"]
    log_every = max(1, args.steps // 8)
    save_every = args.save_every or log_every
    tokens_per_step = args.batch * args.seq_len
    write = tqdm.write if not args.quiet else log
    with StopOnCtrlC() as ctrl_c:
        # Compiling is its own phase, before the progress bar: the bar's estimate then comes
        # from the steps' times alone.
        write(f"compiling the train step ({scanned(args)}); once, before step {start + 1}...")
        t0 = time.perf_counter()
        step = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, key).compile()
        val_loss = float(evaluate(params))  # (compiles the validation too)
        compile_s = time.perf_counter() - t0
        write(f"compiled in {compile_s:.1f} s")
        record = {"compile_s": compile_s, "val_loss": [(start, val_loss)], "losses": []}
        write(f"step {start:5d}  val {describe_loss(val_loss)}")
        bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps,
                   disable=args.quiet, unit="step", dynamic_ncols=True)
        write = bar.write if not args.quiet else log
        estimate = Estimate(start, args.steps)
        t0 = time.perf_counter()
        i = start
        for i in bar:
            key, k = jax.random.split(key)
            params, opt_state, loss = step(params, opt_state, k)
            if (line := estimate.after(i, loss)) is not None:
                write(line)
            if i % 10 == 0 or i == args.steps:
                record["losses"].append((i, float(loss)))
                tok_s = (i - start) * tokens_per_step / (time.perf_counter() - t0)
                bar.set_postfix(loss=f"{record['losses'][-1][1]:.3f}", tok_s=f"{tok_s:,.0f}")
            if i % log_every == 0 or i % save_every == 0 or i == args.steps or ctrl_c.requested:
                val_loss = float(evaluate(params))
                check_finite(val_loss, i, args)  # (before saving: the last save stays finite)
                record["val_loss"].append((i, val_loss))
                save({"params": params, "opt_state": opt_state, "rng": key}, i, val_loss)
                write(f"step {i:5d}  train {float(loss):.3f}  val {describe_loss(val_loss)}")
            if ctrl_c.requested:
                record["stopped_at"] = i
                break
    bar.close()
    train_s = time.perf_counter() - t0
    record.update(train_s=train_s, tokens_per_s=(i - start) * tokens_per_step / max(train_s, 1e-9))
    log(
        f"trained steps {start + 1}-{i} in {train_s:.1f} s ({record['tokens_per_s']:,.0f} tokens/s)"
    )
    return {"params": params, "opt_state": opt_state, "rng": key}, record


class Estimate:
    """The time a run has left, from the times of its steps alone (not the compile): one line
    after the first ``WINDOW`` steps timed, which start after the first step."""

    WINDOW = 10

    def __init__(self, start: int, steps: int):
        self.steps, self.first, self.t0 = steps, start + 1, None

    def after(self, i: int, loss) -> str | None:
        """Called after step ``i`` with its (asynchronous) loss: the line to print, or None."""
        if i == self.first and self.steps - i > 2 * self.WINDOW:
            jax.block_until_ready(loss)
            self.t0 = time.perf_counter()
        elif self.t0 is not None and i == self.first + self.WINDOW:
            jax.block_until_ready(loss)
            per_step = (time.perf_counter() - self.t0) / self.WINDOW
            left = per_step * (self.steps - i)
            return (f"{per_step * 1e3:.0f} ms a step: about {duration(left)} for the "
                    f"{self.steps - i} steps left, plus validations and saves")
        return None


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_finite(val_loss: float, step: int, args: argparse.Namespace) -> None:
    """Stops a run whose loss is no longer a number: sampling from it would be noise."""
    if not math.isfinite(val_loss):
        raise UsageError(
            f"training diverged: the validation loss is {val_loss} at step {step}; pass a "
            f"smaller --lr than {args.lr} (the default is {RUN_DEFAULTS['lr']}) and --overwrite."
        )


# --------------------------------------------------------------------------
# Sampling with the stacked KV cache.


def generate(decode, lm, params, prompt: np.ndarray, length: int, key, temperature, emit=None):
    """Samples ``length`` tokens after ``prompt``, one at a time, with the KV cache.

    ``decode = jax.jit(lm.apply, donate_argnums=3)``. The prompt fills the cache in one call
    (prefill); after that each step feeds only the newest token: nothing is recomputed.
    ``emit(token_id)`` is called as each token is drawn. Returns the tokens and the decode
    speed in tokens/s (the steps after the first, which may compile).
    """
    window = jax.eval_shape(lambda: lm.init_cache(1))
    # [layers, batch, seq_len, heads, head_dim], or without `layers` in the serving layout
    window = jax.tree.leaves(window)[0].shape[-3]
    if not 1 <= len(prompt) <= window:
        raise ValueError(f"the prompt must have 1 to {window} characters, got {len(prompt)}.")
    cache = lm.init_cache(1)
    logits, cache = decode(params, jnp.asarray(prompt)[None], jnp.arange(len(prompt)), cache)
    out = []
    t0 = None
    for pos in range(len(prompt), len(prompt) + length):
        key, k = jax.random.split(key)
        token = jax.random.categorical(k, logits[0, -1] / temperature)
        out.append(int(token))
        if emit is not None:
            emit(out[-1])
        logits, cache = decode(params, token.reshape(1, 1), jnp.array([pos]), cache)
        if t0 is None:
            jax.block_until_ready(logits)
            t0 = time.perf_counter()
    jax.block_until_ready(logits)
    decode_tok_s = (length - 1) / (time.perf_counter() - t0) if length > 1 else float("nan")
    return np.array(out, dtype=np.int32), decode_tok_s


def prefill_speed(decode, lm, params, tokens: np.ndarray, repeats: int = 3) -> float:
    """Tokens/s of one prefill call filling an empty cache with ``tokens`` (best of repeats)."""
    tokens, positions = jnp.asarray(tokens)[None], jnp.arange(len(tokens))
    jax.block_until_ready(decode(params, tokens, positions, lm.init_cache(1)))  # compile
    best = float("inf")
    for _ in range(repeats):
        cache = jax.block_until_ready(lm.init_cache(1))
        t0 = time.perf_counter()
        jax.block_until_ready(decode(params, tokens, positions, cache))
        best = min(best, time.perf_counter() - t0)
    return len(tokens[0]) / best


def cached_vs_full(forward, decode, lm, params, tokens: np.ndarray, prefill: int,
                   decoded=None) -> float:
    """Max |logits| difference: the full forward vs prefill + token-by-token cached decoding
    (of ``decoded = (params, init_cache)``, another layout of the same params, if given)."""
    tokens = jnp.asarray(tokens)[None]
    full, _ = forward(params, tokens, jnp.arange(tokens.shape[1]))
    params, init_cache = decoded or (params, lm.init_cache)
    logits, cache = decode(params, tokens[:, :prefill], jnp.arange(prefill), init_cache(1))
    steps = [logits]
    for pos in range(prefill, tokens.shape[1]):
        logits, cache = decode(params, tokens[:, pos : pos + 1], jnp.array([pos]), cache)
        steps.append(logits)
    return float(jnp.abs(jnp.concatenate(steps, axis=1) - full).max())


def decode_speed(decode, init_cache, params, tokens: np.ndarray) -> float:
    """Tokens/s of one-token decode calls after a prefill of ``tokens[:1]`` (best of the
    calls; the cache donated, as ``generate`` runs it)."""
    tokens = jnp.asarray(tokens)[None]
    _, cache = decode(params, tokens[:, :1], jnp.arange(1), init_cache(1))
    best = float("inf")
    for pos in range(1, tokens.shape[1]):
        t0 = time.perf_counter()
        logits, cache = decode(params, tokens[:, pos : pos + 1], jnp.array([pos]), cache)
        jax.block_until_ready(logits)
        best = min(best, time.perf_counter() - t0)
    return 1 / best


# --------------------------------------------------------------------------


def announce(args: argparse.Namespace, first: int) -> str:
    """What a training run will do and about how long it takes, before it starts."""
    line = f"training {args.steps - first} steps ({first + 1} to {args.steps}; --steps N to change)"
    then = "the estimate from this machine's steps follows the compile"
    fields = ("steps", "layers", "d_model", "heads", "seq_len", "batch", "pattern")
    if first == 0 and not args.remat and all(getattr(args, f) == RUN_DEFAULTS[f] for f in fields):
        return (f"{line}: {DEFAULT_RUN_S} s from start to sample on 2 idle CPU cores, more on a "
                f"busy machine; {then}")
    return f"{line}: {then}"


def parse_pattern(args: argparse.Namespace) -> tuple[str, ...]:
    """``--pattern`` as a tuple of kinds, checked with ``--window`` and ``--layers``."""
    pattern = tuple(args.pattern.split(","))
    for kind in pattern:
        if kind not in lm_models.KINDS:
            raise UsageError(
                f"--pattern {args.pattern}: {kind!r} is not a kind of block; give a "
                "comma-separated list of local and global, e.g. --pattern local,local,global."
            )
    if "local" in pattern and args.window > args.seq_len:
        raise UsageError(
            f"--window {args.window} is longer than --seq-len {args.seq_len}: a local block "
            "sees at most the training context; pass a smaller --window."
        )
    if args.layers < len(pattern):
        raise UsageError(
            f"--layers {args.layers} is fewer than the {len(pattern)} entries of --pattern "
            f"{args.pattern}; pass at least --layers {len(pattern)}."
        )
    return pattern


def main(argv: list[str] | None = None, log=print) -> dict:
    """Runs the example; returns what it measured (for the smoke tests).

    Raises:
      UsageError: ``--d-model`` not a multiple of ``2 * --heads``, a ``--pattern`` entry other
        than local or global, ``--window`` over ``--seq-len``, fewer ``--layers`` than the
        pattern has entries, a ``--text`` that is not UTF-8 or too short for the context, a
        ``--prompt`` with characters outside the text's vocabulary or longer than the context,
        a ``--lora`` rank above ``--d-model``.
        (The flags' own ranges are refused by ``parse_args``, which exits as argparse does.)
      CheckpointError: ``--restore`` or ``--lora`` without a checkpoint, a checkpoint of
        another run than the flags given, training over another run's checkpoint without
        ``--resume`` or ``--overwrite``, or a damaged or incomplete checkpoint; the message
        says what to pass.
    """
    args = parse_args(argv)
    start = time.perf_counter()
    path = args.checkpoint
    if args.load_safetensors is not None:  # sample from an export, as --restore does
        saved, path = read_export_meta(args.load_safetensors), args.load_safetensors
    else:
        fresh = args.overwrite and not args.lora  # (--lora --overwrite: of the adapters)
        saved = read_meta(path) if holds_files(path) and not fresh else None
    if args.restore and saved is None:
        raise CheckpointError(
            f"--restore: there is no checkpoint at {path}. Train first (the same command without "
            "--restore saves there), or pass --checkpoint PATH of one you trained."
        )
    if args.lora and saved is None:
        raise CheckpointError(
            f"--lora: there is no pre-trained checkpoint at {path} to fine-tune. Pre-train one "
            "first: the same command without --lora, --lora-alpha, --quantize and --adapters "
            "(with the sizes you want) saves it there; or pass --checkpoint PATH of one."
        )
    sampling_only = args.restore or args.load_safetensors is not None
    if args.lora and args.steps is None:
        args.steps = LORA_STEPS
    if args.load_safetensors is not None:  # one export for every --framework (hf_names)
        fields = [f for f in MODEL_FIELDS if f != "framework" or f not in args.given]
        settle_args(args, saved, fields, path, "--load-safetensors DIR of another export")
    elif sampling_only or args.resume or args.lora:
        model_only = sampling_only or args.lora  # (fine-tuning has its own steps, lr, ...)
        settle_args(args, saved, MODEL_FIELDS if model_only else RUN_DEFAULTS, path)
    else:
        settle_args(args, None, ())
    if args.framework != "jax":  # its adapter, and so the framework, must import
        try:
            importlib.import_module(f"stackwise.{args.framework}")
        except ImportError as e:
            raise UsageError(f"--framework {args.framework}: {e}") from None
    if args.d_model % (2 * args.heads):
        raise UsageError(
            f"--d-model {args.d_model} must be a multiple of 2 * --heads = {2 * args.heads} "
            "(each head's width is split in two halves for the rotary embedding)."
        )
    if args.lora and args.lora > args.d_model:
        raise UsageError(
            f"--lora {args.lora} is larger than the model's width, --d-model {args.d_model}: "
            "a rank above min(in, out) of a weight adds nothing (every adapted weight is at "
            f"least {args.d_model} wide); give --lora {max(1, args.d_model // 16)}, say."
        )
    pattern = parse_pattern(args)
    chars, data, text_sha256 = load_text(args.text)
    check_text(args, chars, data)
    run = run_identity(args, text_sha256)
    if (sampling_only or args.lora) and saved["chars"] != chars:
        raise CheckpointError(
            f"{path} was trained on {pathlib.Path(saved['run']['text']).name}, whose "
            f"vocabulary ({len(saved['chars'])} characters) is not that of {args.text} "
            f"({len(chars)}); pass --text {saved['run']['text']}."
        )
    if args.resume and saved:
        differ = differences(saved["run"], run, ["text_sha256"])
        if differ:
            raise CheckpointError(
                f"{path} holds a run on another text ({differ[0]}): pass --text "
                f"{saved['run']['text']}, or --overwrite to start a new run."
            )
    if saved and not (sampling_only or args.resume or args.overwrite or args.lora):
        if not finished_same_run(saved, run):
            raise refuse_to_overwrite(path, saved, run)
        log(
            f"{path} already holds this run, trained to step {saved['step']}: sampling from it "
            "without training (--overwrite trains it again, --checkpoint PATH elsewhere)"
        )
        args.restore = True

    split = int(0.9 * len(data))
    train_data, val = jnp.asarray(data[:split]), val_windows(data[split:], args.seq_len)
    config = lm_models.Config(
        vocab=len(chars),
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        seq_len=args.seq_len,
        remat=args.remat,
        pattern=pattern,
        window=args.window,
    )
    lm = lm_models.build(args.framework, config)
    template = jax.eval_shape(lm.init, jax.random.key(args.seed))
    n_params = sum(leaf.size for leaf in jax.tree.leaves(template))
    kinds = "" if pattern == ("global",) else f" (pattern {args.pattern}, window {args.window})"
    log(
        f"{args.framework}: {args.layers} blocks{kinds} stacked as one "
        f"{'layer' if pattern == ('global',) else 'pattern stack'}, {n_params:,} params; "
        f"{len(data):,} characters of {args.text.name}, vocabulary {len(chars)}; "
        f"{jax.device_count()} {jax.default_backend()} device(s)"
    )
    result: dict[str, Any] = {"framework": args.framework, "n_params": n_params}

    k = len(pattern)
    names = hf_names(args.framework, template, pattern)  # for --export, --load-safetensors
    if args.load_safetensors is not None:
        params = load_safetensors(args.load_safetensors, template, names, k)
        log(
            f"loaded {args.load_safetensors} (step {saved['step']} of {saved['run']['steps']}, "
            f"val {describe_loss(saved['val_loss'])})"
        )
    elif args.restore or args.lora:
        params = load_checkpoint(path, state_template(lm, args, saved["run"]))["params"]
        log(
            f"restored {path} (step {saved['step']} of {saved['run']['steps']}, "
            f"val {describe_loss(saved['val_loss'])})"
        )
    else:
        if args.resume and saved:
            state = load_checkpoint(path, state_template(lm, args, saved["run"]))
            state["rng"] = jax.random.wrap_key_data(state["rng"])
            first = saved["step"]
            log(f"resuming {path} at step {first} of {args.steps}")
        else:
            if args.resume:
                log(f"--resume: no checkpoint at {path} yet; starting at step 0")
            params = jax.jit(lm.init)(jax.random.key(args.seed))
            opt_state = make_optimizer(args).init(params)
            state = {"params": params, "opt_state": opt_state, "rng": jax.random.key(args.seed + 1)}
            first = 0

        replace = [args.overwrite and holds_files(path)]  # the old run's steps, at the first save

        def save(state, step, val_loss):
            if replace[0]:
                clear_checkpoint(path)
                replace[0] = False
            state = {**state, "rng": jax.random.key_data(state["rng"])}
            meta = {"format": FORMAT, "run": run, "step": step, "val_loss": val_loss}
            save_checkpoint(path, state, {**meta, "chars": chars, "remat": args.remat}, args.keep)

        if first < args.steps:
            log(announce(args, first))
            every = args.save_every or max(1, args.steps // 8)
            log(f"saving to {path} every {every} steps and on Ctrl-C (keeping {args.keep})")
            state, record = train(lm, state, first, train_data, val, args, save, log)
            result.update(record)
            if "stopped_at" in record:
                log(
                    f"stopped at step {record['stopped_at']} of {args.steps}: saved {path}. "
                    "Run the same command with --resume to continue."
                )
                return result
            # Checkpoint round trip: read the params back, compare bitwise.
            params = load_checkpoint(path, state_template(lm, args, run))["params"]
            pairs = zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params))
            if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs):
                raise RuntimeError(f"the checkpoint {path} did not restore bitwise")
            size = sum(f.stat().st_size for f in (path / str(args.steps)).rglob("*") if f.is_file())
            log(f"saved and restored {path / str(args.steps)} ({size:,} bytes)")
        else:
            log(f"{path} is already at step {first} of {args.steps}: nothing left to train")
            result["val_loss"] = [(first, saved["val_loss"])]
            params = state["params"]
        result["val_bits_per_char"] = result["val_loss"][-1][1] / math.log(2)

    if args.export is not None:
        step, val_loss = result["val_loss"][-1] if "val_loss" in result else (
            saved["step"], saved["val_loss"])
        meta = {"format": FORMAT, "run": saved["run"] if args.restore else run, "chars": chars,
                "step": step, "val_loss": val_loss}
        files = export_safetensors(args.export, params, names, k, meta)
        log(f"exported the params to {args.export} as per-layer safetensors ({len(files)} files)")
        result["exported"] = files

    if args.lora:  # the adapters, trained on the frozen params, then sampled with
        lm, params = fine_tune(args, config, params, names, train_data, val, result, log)
    check_and_sample(lm, params, args, chars, val, result, log)
    result["total_s"] = time.perf_counter() - start
    log(f"done in {result['total_s']:.0f} s")
    return result


def check_and_sample(lm, params, args: argparse.Namespace, chars: str, val, result: dict,
                     log=print) -> None:
    """Checks the stacked params against the loop's layout and cached decoding against the
    full forward, then samples (``generate``): every run's sample, fine-tuned or not, comes
    from here. Adds what it measured to ``result``."""
    forward = jax.jit(lm.apply)  # the full forward pass (no cache)
    decode = jax.jit(lm.apply, donate_argnums=(3,))  # with the KV cache, updated in place
    stacked = params

    # The same params for the model written as a plain Python loop over separate blocks.
    window = np.asarray(val[0][0])
    loop_logits = jax.jit(lm.loop_apply)(lm.to_loop(params), window[None])
    stacked_logits, _ = forward(params, window[None], jnp.arange(len(window)))
    result["loop_diff"] = float(jnp.abs(loop_logits - stacked_logits).max())
    log(
        f"in the layout of a Python loop over {args.layers} separate blocks, the params give "
        f"the stack's logits to {result['loop_diff']:.1e}"
    )
    # Cached decoding computes the same logits as the full forward.
    result["cache_diff"] = cached_vs_full(forward, decode, lm, params, window, len(window) // 2)
    log(f"KV-cached decoding matches the full forward to {result['cache_diff']:.1e}")
    checked = ["loop_diff", "cache_diff"]
    if lm.serve is not None:  # the serving layout: per-layer buffers for weights and caches
        scanned = decode_speed(decode, lm.init_cache, params, window)
        params, init_cache = lm.serve(params)
        lm = lm._replace(init_cache=init_cache)
        result["serving_diff"] = cached_vs_full(forward, decode, lm, stacked, window,
                                                len(window) // 2, (params, init_cache))
        served = decode_speed(decode, init_cache, params, window)
        result["decode_best_tokens_per_s"] = {"stacked": scanned, "serving": served}
        checked.append("serving_diff")
        log(f"in the serving layout ({args.layers} per-layer buffers of weights and KV caches), "
            f"cached decoding matches the full forward to {result['serving_diff']:.1e} and "
            f"decodes {served:,.0f} tokens/s (best call; the stacked layout: {scanned:,.0f}); "
            "the sample comes from it")
    for name in checked:
        if not result[name] <= LOGITS_ATOL:
            raise RuntimeError(f"{name} = {result[name]:.2e} exceeds {LOGITS_ATOL}")

    # Sample, printing each character as it comes.
    prompt = encode(chars, args.prompt)
    log(f"\n--- sample ({args.sample_len} characters, temperature {args.temperature}) ---")
    sys.stdout.write(args.prompt)

    def emit(token: int) -> None:
        sys.stdout.write(chars[token])
        sys.stdout.flush()

    key = jax.random.key(args.seed + 3)
    sample, result["decode_tokens_per_s"] = generate(
        decode, lm, params, prompt, args.sample_len, key, args.temperature, emit
    )
    result["prefill_tokens_per_s"] = prefill_speed(decode, lm, params, window)
    log(
        f"\n--- prefill {result['prefill_tokens_per_s']:,.0f} tokens/s (one {len(window)}-token "
        f"prompt), decode {result['decode_tokens_per_s']:,.0f} tokens/s (one token per call)"
    )
    result["sample"] = args.prompt + "".join(chars[t] for t in sample)


def fine_tune(args: argparse.Namespace, config, params, names, train_data, val, result: dict,
              log=print):
    """``--lora``: the checkpoint's ``params`` (of ``--framework``'s model) fine-tuned in the
    pure-JAX model (``examples/lm_finetune.py``); returns the model and params to sample."""
    import lm_finetune  # (imported only for --lora)

    pattern = config.pattern
    if args.framework != "jax":  # the same params, read into the pure-JAX model's layout
        jax_template = jax.eval_shape(lm_models.build_jax(config).init, jax.random.key(0))
        params = lm_finetune.pure_jax_params(params, names, jax_template,
                                             hf_names("jax", jax_template, pattern),
                                             len(pattern))
        log(f"fine-tuning the {args.framework} checkpoint in the pure-JAX model (the same "
            "params, through the Hugging Face-style names)")
    lm, params, record = lm_finetune.finetune(
        args, config, params,
        batches=lambda key: sample_batch(key, train_data, args.batch, args.seq_len),
        val=val, optimizer=make_optimizer(args, layerwise=False),
        check=lambda loss, step: check_finite(loss, step, args), log=log)
    result.update(record)
    return lm, params


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main``, with its errors and Ctrl-C as messages, not tracebacks."""
    try:
        result = main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\ninterrupted (training saves at every validation and on a single Ctrl-C).",
            file=sys.stderr,
        )
        return 130
    return 130 if "stopped_at" in result else 0


if __name__ == "__main__":
    sys.exit(cli())
