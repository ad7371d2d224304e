"""The example's command line: its flags, their checks, and the run's errors as messages.

``python examples/transformer_lm.py`` runs :func:`cli`. This module needs only the standard
library: ``--help`` and a bad flag answer before JAX, optax and orbax are imported (seconds,
not a minute on a busy machine); :func:`main` imports the run (``run.py``) once the flags are
read. Every other module of the package takes its defaults and errors from here.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import argparse
import math
import os
import pathlib
import sys

import lm  # (the package: its docstring is the --help text)

EXAMPLES = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TEXT = EXAMPLES / "data" / "shakespeare.txt"
CHECKPOINTS = EXAMPLES / "checkpoints"
FORMAT = 3  # of the checkpoints: 3, orbax folders (2 was one .npz file)
#: Saved steps kept by default (--keep).
KEEP = 3

#: The defaults of the flags that identify a run (see the package's docstring: the --help).
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
#: Seconds the default run takes on 2 idle CPU cores (the --help's figure, the README's).
DEFAULT_RUN_S = 111
#: The run fields that fix the model (and so which params a checkpoint has).
MODEL_FIELDS = ("framework", "layers", "d_model", "heads", "seq_len", "pattern", "window")
#: What checkpoints saved before --pattern and --optimizer existed hold for these fields.
OLD_RUN_FIELDS = {"pattern": "global", "window": 16, "optimizer": "adamw"}
#: The largest --seed (the run uses the keys of seed, seed + 1 and seed + 3).
MAX_SEED = 2**32 - 4
#: --framework's choices: model.FRAMEWORKS (named here: the command line imports no JAX).
FRAMEWORKS = ("jax", "haiku", "flax", "nnx", "equinox")
#: --optimizer's choices: the keys of train.OPTIMIZERS.
OPTIMIZER_NAMES = ("adamw", "lamb", "adafactor", "muon")
#: The file an --export writes next to the safetensors: the run, step and vocabulary.
EXPORT_META = "transformer_lm.json"
#: --lora's default number of fine-tuning steps (--steps).
LORA_STEPS = 200
#: --quantize's choices: stackwise.quant.KINDS (named here: the command line imports no JAX).
QUANT_KINDS = ("int8", "int4", "nf4")
#: --modules-to-save's choices: PEFT's names of the modules outside the blocks (each the last
#: part of its Hugging Face-style name: model.embed_tokens, model.norm, lm_head).
SAVABLE_MODULES = ("embed_tokens", "norm", "lm_head")
#: --compute-dtype's choices: the dtype the training step computes in (params stay float32).
COMPUTE_DTYPES = ("float32", "bfloat16")
#: --preset's sizes: flags a user would type, each overridden by the same flag given. "v5e":
#: a model that fills one TPU v5e chip (15.7 GiB): 16 blocks of d_model 1024 (201M params in
#: the blocks), context 1024, batch 8, bfloat16 compute on float32 params, each block
#: rematerialised (without, the scanned blocks' saved activations need ~19 GiB at this size,
#: as compiled for a v5e). Run on one v5e (docs/example.md): 175 ms a step; with 600 steps the
#: validation loss was lowest at steps 225-300 and rose after (the shipped text learnt by heart),
#: so 300.
PRESETS = {
    "v5e": {"layers": 16, "d_model": 1024, "heads": 16, "seq_len": 1024, "batch": 8,
            "steps": 300, "lr": 3e-4, "compute_dtype": "bfloat16", "remat": True},
}


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
    """The flags of ``argv`` (default: the command line's), with the defaults that depend on
    others filled in and ``args.given``, the run flags given; refuses those no run can use
    (``p.error``: exit status 2)."""
    p = parser()
    args = p.parse_args(argv)
    for field, value in PRESETS.get(args.preset, {}).items():
        if getattr(args, field) in (None, False):  # (a flag given wins over the preset)
            setattr(args, field, value)
    if args.compute_dtype is None:
        args.compute_dtype = COMPUTE_DTYPES[0]
    if args.pattern is not None:  # one spelling, as checkpoints keep it: "local,local,global"
        args.pattern = ",".join(kind.strip() for kind in args.pattern.split(","))
    args.given = {field for field in (*RUN_DEFAULTS, "text") if getattr(args, field) is not None}
    if args.checkpoint is None:
        args.checkpoint = CHECKPOINTS / f"lm_{args.framework or RUN_DEFAULTS['framework']}"
    # Absolute, once: orbax and tensorstore's `file://` take no path relative to the cwd.
    args.checkpoint = args.checkpoint.absolute()
    if args.lora is not None:
        args.lora_alpha = float(args.lora) if args.lora_alpha is None else args.lora_alpha
        args.lora_dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
        if args.adapters is None:
            tail = f"_qlora_{args.quantize}" if args.quantize else "_lora"
            args.adapters = args.checkpoint.with_name(args.checkpoint.name + tail)
    check_args(p, args)
    check_lora_args(p, args)
    return args


def parser() -> argparse.ArgumentParser:
    """The command line's flags: first the run's (None by default: ``settle_args`` fills
    them from a checkpoint's run or the defaults), then the others."""
    p = argparse.ArgumentParser(description=lm.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
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
        help=f"a UTF-8 text to learn (default: {DEFAULT_TEXT.relative_to(EXAMPLES.parent)})",
    )
    add_other_flags(p)
    return p


def add_other_flags(p: argparse.ArgumentParser) -> None:
    """The flags that are not the run's: memory, sampling, checkpoints, modes, fine-tuning
    (:func:`add_lora_flags`)."""
    p.add_argument("--remat", action="store_true", help="rematerialise each block (less memory)")
    p.add_argument(
        "--compute-dtype",
        choices=COMPUTE_DTYPES,
        help="the training step's compute dtype: bfloat16 casts the float32 params and\n"
        "activations to bfloat16 in the forward and backward pass; the gradients, the\n"
        "optimizer, evaluation and sampling stay float32 (default: float32)",
    )
    p.add_argument(
        "--preset",
        choices=PRESETS,
        help="a model of a given size in one flag; the flags you give override it. v5e: one\n"
        "TPU v5e chip: --layers 16 --d-model 1024 --heads 16 --seq-len 1024 --batch 8\n"
        "--steps 300 --lr 3e-4 --compute-dtype bfloat16 --remat",
    )
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
    add_lora_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """The fine-tuning flags: ``--lora RANK`` and its settings."""
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
        "--lora-dropout",
        type=float,
        metavar="RATE",
        help="with --lora: PEFT's lora_dropout, the probability that each element of the\n"
        "adapters' input is dropped while training (a new mask each step; none when\n"
        "evaluating or sampling), written to the adapters' config (default: 0)",
    )
    p.add_argument(
        "--modules-to-save",
        metavar="NAMES",
        help="with --lora: modules outside the blocks trained whole beside the adapters and\n"
        "saved with them (PEFT's modules_to_save), comma-separated, of:\n"
        + ", ".join(SAVABLE_MODULES) + " (default: none)",
    )
    p.add_argument(
        "--adapters",
        type=pathlib.Path,
        metavar="DIR",
        help="where --lora saves the adapters, in PEFT's layout (default: the checkpoint's\n"
        "folder name + _lora, or _qlora_<kind> with --quantize)",
    )


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
        for name in ("lora_alpha", "quantize", "adapters", "lora_dropout", "modules_to_save"):
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
    if not 0 <= args.lora_dropout < 1:  # (NaN fails too)
        p.error(f"--lora-dropout {args.lora_dropout!r}: expected a probability in [0, 1), e.g. "
                "--lora-dropout 0.05 (0: none; 1 would drop every input to the adapters, "
                "which would then never train)")
    check_modules_to_save(p, args)
    adapters, checkpoint = args.adapters.resolve(), args.checkpoint.resolve()
    if adapters == checkpoint or checkpoint in adapters.parents or adapters in checkpoint.parents:
        p.error(f"--adapters {args.adapters}: it would replace the pre-trained --checkpoint "
                f"{args.checkpoint} or hold it; give a folder beside it, e.g. --adapters "
                f"{args.checkpoint}_lora")
    if args.adapters.exists() and not args.adapters.is_dir():  # --overwrite or not: a folder
        p.error(f"--adapters {args.adapters}: a file, not a folder; PEFT adapters are a folder "
                "(adapter_config.json + adapter_model.safetensors), and a file is never "
                "replaced: give a folder path, e.g. --adapters "
                f"{args.adapters.with_name(args.adapters.stem + '_adapters')}")
    if holds_files(args.adapters) and not args.overwrite:
        p.error(f"--adapters {args.adapters}: already holds files; pass --overwrite to "
                "replace them, or --adapters DIR for another folder")
    if folder := unwritable_parent(args.adapters):
        p.error(f"--adapters {args.adapters}: cannot write there ({folder} is not a writable "
                "folder); give a folder in one you can write")


def check_modules_to_save(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--modules-to-save`` as a tuple of names of :data:`SAVABLE_MODULES` (empty if not
    given), or ``p.error`` naming the one at fault."""
    if args.modules_to_save is None:
        args.modules_to_save = ()
        return
    names = [name.strip() for name in args.modules_to_save.split(",")]
    expected = (f"one or more of {', '.join(SAVABLE_MODULES)}, comma-separated (the modules "
                "outside the blocks), e.g. --modules-to-save lm_head,norm")
    for name in names:
        if name not in SAVABLE_MODULES:
            hint = (" (the blocks' linear layers hold the adapters: PEFT saves no adapted module "
                    "whole)" if name in ("qkv_proj", "o_proj", "up_proj", "down_proj") else "")
            p.error(f"--modules-to-save {args.modules_to_save!r}: {name!r} is not a module to "
                    f"save{hint}; expected {expected}")
        if names.count(name) > 1:
            p.error(f"--modules-to-save {args.modules_to_save!r}: {name!r} is named twice; "
                    f"expected {expected}")
    args.modules_to_save = tuple(names)


def holds_files(path: pathlib.Path) -> bool:
    """Whether ``path`` exists and is not an empty folder (an empty one holds no checkpoint)."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))




def main(argv: list[str] | None = None, log=print) -> dict:
    """Runs the example (``run.run``, after the flags are read); returns what it measured
    (for the smoke tests).

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
    from lm import run  # (JAX, optax and orbax: only once the flags are read)

    return run.run(args, log)


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
