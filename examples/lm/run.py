"""A run of the example, once its flags are read (``cli.main``): the flags settled against
the checkpoint's run, then training (or restoring, or loading an export), the export, the
fine-tuning, and the checks and sample (``sample.py``).
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import argparse
import importlib
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm import checkpoints, finetune, sample, train
from lm.cli import (
    DEFAULT_RUN_S,
    DEFAULT_TEXT,
    FORMAT,
    LORA_STEPS,
    MODEL_FIELDS,
    RUN_DEFAULTS,
    CheckpointError,
    UsageError,
    flag,
    holds_files,
)
from lm.data import check_text, describe_loss, load_text, val_windows
from lm.model import KINDS, Config, build


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




def state_template(lm, args: argparse.Namespace, run: dict) -> dict:
    """The abstract training state a checkpoint of ``run`` holds: params, the state of its
    ``--optimizer`` and the RNG's key data."""
    params = jax.eval_shape(lm.init, jax.random.key(0))
    optimizer = train.make_optimizer(argparse.Namespace(**{**vars(args), **run}))
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
        if kind not in KINDS:
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


def run(args: argparse.Namespace, log=print) -> dict:
    """Runs the example for the flags ``args`` (``cli.parse_args``'s); returns what it
    measured (for the smoke tests). Raises UsageError and CheckpointError (``cli.main``
    lists them)."""
    start = time.perf_counter()
    saved, path = read_saved(args)
    settle(args, saved, path)
    pattern = parse_pattern(args)
    chars, data, text_sha256 = load_text(args.text)
    check_text(args, chars, data)
    run_id = run_identity(args, text_sha256)
    check_saved_run(args, saved, path, run_id, chars, log)
    split = int(0.9 * len(data))
    train_data, val = jnp.asarray(data[:split]), val_windows(data[split:], args.seq_len)
    config = Config(vocab=len(chars), layers=args.layers, d_model=args.d_model,
                    heads=args.heads, seq_len=args.seq_len, remat=args.remat, pattern=pattern,
                    window=args.window)
    lm = build(args.framework, config)
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
    names = checkpoints.hf_names(args.framework, template, pattern)  # --export, --load-...
    params = obtain_params(lm, args, saved, path, run_id, chars, names, train_data, val,
                           result, log)
    if params is None:  # stopped by Ctrl-C: saved, to --resume
        return result
    if args.export is not None:
        step, val_loss = result["val_loss"][-1] if "val_loss" in result else (
            saved["step"], saved["val_loss"])
        meta = {"format": FORMAT, "run": saved["run"] if args.restore else run_id,
                "chars": chars, "step": step, "val_loss": val_loss}
        files = checkpoints.export_safetensors(args.export, params, names, len(pattern), meta)
        log(f"exported the params to {args.export} as per-layer safetensors ({len(files)} files)")
        result["exported"] = files
    if args.lora:  # the adapters, trained on the frozen params, then sampled with
        lm, params = finetune.fine_tune(args, config, params, names, train_data, val, result,
                                        log)
    sample.check_and_sample(lm, config, params, args, chars, val, result, log)
    result["total_s"] = time.perf_counter() - start
    log(f"done in {result['total_s']:.0f} s")
    return result


def read_saved(args: argparse.Namespace) -> tuple[dict | None, pathlib.Path]:
    """The run saved where the flags read from (``--load-safetensors`` or ``--checkpoint``;
    None if nothing is there, or ``--overwrite`` replaces it), and that path."""
    path = args.checkpoint
    if args.load_safetensors is not None:  # sample from an export, as --restore does
        saved, path = checkpoints.read_export_meta(args.load_safetensors), args.load_safetensors
    else:
        fresh = args.overwrite and not args.lora  # (--lora --overwrite: of the adapters)
        saved = checkpoints.read_meta(path) if holds_files(path) and not fresh else None
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
    return saved, path


def settle(args: argparse.Namespace, saved: dict | None, path: pathlib.Path) -> None:
    """Fills the flags left out (``settle_args``: from the checkpoint's run for what it
    fixes, else the defaults) and refuses the sizes no model has."""
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


def check_saved_run(args: argparse.Namespace, saved: dict | None, path: pathlib.Path,
                    run_id: dict, chars: str, log=print) -> None:
    """Refuses a checkpoint of another text, and training over another run; the same
    command again, once its run has finished, samples from it (``args.restore``)."""
    sampling_only = args.restore or args.load_safetensors is not None
    if (sampling_only or args.lora) and saved["chars"] != chars:
        raise CheckpointError(
            f"{path} was trained on {pathlib.Path(saved['run']['text']).name}, whose "
            f"vocabulary ({len(saved['chars'])} characters) is not that of {args.text} "
            f"({len(chars)}); pass --text {saved['run']['text']}."
        )
    if args.resume and saved:
        differ = differences(saved["run"], run_id, ["text_sha256"])
        if differ:
            raise CheckpointError(
                f"{path} holds a run on another text ({differ[0]}): pass --text "
                f"{saved['run']['text']}, or --overwrite to start a new run."
            )
    if saved and not (sampling_only or args.resume or args.overwrite or args.lora):
        if not finished_same_run(saved, run_id):
            raise refuse_to_overwrite(path, saved, run_id)
        log(
            f"{path} already holds this run, trained to step {saved['step']}: sampling from it "
            "without training (--overwrite trains it again, --checkpoint PATH elsewhere)"
        )
        args.restore = True


def obtain_params(lm, args: argparse.Namespace, saved: dict | None, path: pathlib.Path,
                  run_id: dict, chars: str, names, train_data, val, result: dict, log=print):
    """The params to sample from: loaded from ``--load-safetensors``, restored from the
    checkpoint (``--restore``, ``--lora``), or trained (from step 0, or resumed); None if
    Ctrl-C stopped the training (it saved)."""
    if args.load_safetensors is not None:
        template = jax.eval_shape(lm.init, jax.random.key(0))
        params = checkpoints.load_safetensors(args.load_safetensors, template, names,
                                              len(args.pattern.split(",")))
        log(
            f"loaded {args.load_safetensors} (step {saved['step']} of {saved['run']['steps']}, "
            f"val {describe_loss(saved['val_loss'])})"
        )
        return params
    if args.restore or args.lora:
        template = state_template(lm, args, saved["run"])
        params = checkpoints.load_checkpoint(path, template)["params"]
        log(
            f"restored {path} (step {saved['step']} of {saved['run']['steps']}, "
            f"val {describe_loss(saved['val_loss'])})"
        )
        return params
    if args.resume and saved:
        state = checkpoints.load_checkpoint(path, state_template(lm, args, saved["run"]))
        state["rng"] = jax.random.wrap_key_data(state["rng"])
        first = saved["step"]
        log(f"resuming {path} at step {first} of {args.steps}")
    else:
        if args.resume:
            log(f"--resume: no checkpoint at {path} yet; starting at step 0")
        params = jax.jit(lm.init)(jax.random.key(args.seed))
        opt_state = train.make_optimizer(args).init(params)
        state = {"params": params, "opt_state": opt_state, "rng": jax.random.key(args.seed + 1)}
        first = 0
    if first >= args.steps:
        log(f"{path} is already at step {first} of {args.steps}: nothing left to train")
        result["val_loss"] = [(first, saved["val_loss"])]
        result["val_bits_per_char"] = result["val_loss"][-1][1] / math.log(2)
        return state["params"]
    return train_and_save(lm, args, state, first, path, run_id, chars, train_data, val, result,
                          log)


def train_and_save(lm, args: argparse.Namespace, state: dict, first: int, path: pathlib.Path,
                   run_id: dict, chars: str, train_data, val, result: dict, log=print):
    """Trains ``state`` from step ``first``, saving to ``path``; then reads the params back
    and checks them bitwise. Returns them, or None if Ctrl-C stopped the training."""
    replace = [args.overwrite and holds_files(path)]  # the old run's steps, at the first save

    def save(state, step, val_loss):
        if replace[0]:
            checkpoints.clear_checkpoint(path)
            replace[0] = False
        state = {**state, "rng": jax.random.key_data(state["rng"])}
        meta = {"format": FORMAT, "run": run_id, "step": step, "val_loss": val_loss}
        checkpoints.save_checkpoint(path, state, {**meta, "chars": chars, "remat": args.remat},
                                    args.keep)

    log(announce(args, first))
    every = args.save_every or max(1, args.steps // 8)
    log(f"saving to {path} every {every} steps and on Ctrl-C (keeping {args.keep})")
    state, record = train.train(lm, state, first, train_data, val, args, save, log)
    result.update(record)
    if "stopped_at" in record:
        log(
            f"stopped at step {record['stopped_at']} of {args.steps}: saved {path}. "
            "Run the same command with --resume to continue."
        )
        return None
    # Checkpoint round trip: read the params back, compare bitwise.
    params = checkpoints.load_checkpoint(path, state_template(lm, args, run_id))["params"]
    pairs = zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params))
    if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs):
        raise RuntimeError(f"the checkpoint {path} did not restore bitwise")
    size = sum(f.stat().st_size for f in (path / str(args.steps)).rglob("*") if f.is_file())
    log(f"saved and restored {path / str(args.steps)} ({size:,} bytes)")
    result["val_bits_per_char"] = result["val_loss"][-1][1] / math.log(2)
    return params
