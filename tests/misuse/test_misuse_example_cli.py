"""Misuses of the example's command line (`examples/transformer_lm.py`), as a user who
mistypes at 2 a.m. would try them.

Each is refused before any work (training and sampling are replaced by functions that fail the
test if called) with an error that names the flag (or the file at fault), exit status 2 and no
traceback. The command runs in-process: `lm.cli.cli(argv)`, whose argparse errors exit.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from _scripts import load_example

#: A tiny model (the same as tests/examples' smoke runs) with a context of 16.
TINY = "--layers 2 --d-model 32 --heads 2 --seq-len 16 --batch 2 --steps 3 --quiet".split()
TEXT = "the quick brown fox jumps over the lazy dog\n" * 20

#: (argv, what the message must name (the flag, or the file), a part of the message).
#: "{tmp}" is a folder holding the files of :func:`files`.
CASES = [
    (["--temperature", "-1"], "--temperature", "expected a positive number"),
    (["--temperature", "0"], "--temperature", "expected a positive number"),
    (["--temperature", "nan"], "--temperature", "expected a positive number"),
    (["--temperature", "inf"], "--temperature", "expected a positive number"),
    (["--temperature", "warm"], "--temperature", "invalid float value"),
    (["--lr", "0"], "--lr", "expected a positive learning rate"),
    (["--lr", "-2e-3"], "--lr", "expected one argument"),  # (argparse: "-2e-3", a flag?)
    (["--lr", "nan"], "--lr", "expected a positive learning rate"),
    (["--lr", "inf"], "--lr", "expected a positive learning rate"),
    (["--preset", "tpu"], "--preset", "invalid choice: 'tpu'"),
    (["--compute-dtype", "float16"], "--compute-dtype",
     "invalid choice: 'float16'"),
    (["--steps", "0"], "--steps", "expected a positive integer"),
    (["--steps", "-3"], "--steps", "expected a positive integer"),
    (["--steps", "1.5"], "--steps", "expected a positive integer"),
    (["--steps", "1e3"], "--steps", "expected a positive integer"),
    (["--layers", "0"], "--layers", "expected a positive integer"),
    (["--d-model", "0"], "--d-model", "expected a positive integer"),
    (["--heads", "0"], "--heads", "expected a positive integer"),
    (["--seq-len", "0"], "--seq-len", "expected a positive integer"),
    (["--window", "0"], "--window", "expected a positive integer"),
    (["--batch", "0"], "--batch", "expected a positive integer"),
    (["--sample-len", "-1"], "--sample-len", "expected 0 or more characters"),
    (["--sample-len", "x"], "--sample-len", "invalid int value"),
    (["--seed", "-1"], "--seed", "expected an integer from 0 to"),
    (["--seed", str(2**32)], "--seed", "expected an integer from 0 to"),
    (["--seed", "x"], "--seed", "invalid int value"),
    (["--d-model", "36", "--heads", "4"], "--d-model", "must be a multiple of 2 * --heads = 8"),
    (["--pattern", "lokal"], "--pattern", "'lokal' is not a kind of block"),
    (["--pattern", ""], "--pattern", "'' is not a kind of block"),
    (["--pattern", "local", "--window", "17"], "--window", "longer than --seq-len 16"),
    (["--pattern", "local,global", "--layers", "1"], "--layers", "fewer than the 2 entries"),
    (["--framework", "torch"], "--framework", "invalid choice: 'torch'"),
    (["--resume", "--overwrite"], "--overwrite", "not allowed with argument --resume"),
    # The prompt and the text: checked before training (the prompt is used only after it).
    (["--prompt", ""], "--prompt", "expected at least one character"),
    (["--prompt", "héllo"], "--prompt", "not in the vocabulary of tiny.txt: 'é'"),
    (["--prompt", "q" * 17], "--prompt", "17 characters, more than the context, --seq-len 16"),
    (["--text", "{tmp}/latin1.txt"], "--text", "is not UTF-8 text (byte 0xe9 at offset 3)"),
    (["--text", "{tmp}/short.txt"], "--text", "has 3 characters, too few for --seq-len 16"),
    (["--text", "{tmp}/empty.txt"], "--text", "has 0 characters"),
    (["--text", "{tmp}"], "--text", "a folder, not a file"),
    (["--text", "{tmp}/missing.txt"], "--text", "no such file"),
    (["--text", "/dev/null"], "--text", "not a regular file"),
    (["--optimizer", "sgd"], "--optimizer", "invalid choice: 'sgd'"),
    (["--save-every", "0"], "--save-every", "expected a positive integer"),
    (["--keep", "0"], "--keep", "expected a positive integer"),
    # Checkpoints (orbax folders): where they go, and folders that are not (whole) checkpoints.
    (["--checkpoint", "{tmp}/tiny.txt"], "--checkpoint", "a file; checkpoints are folders"),
    (["--checkpoint", "{tmp}/old.npz"], "--checkpoint",
     "a file (an .npz of an older version of this example?); checkpoints are folders"),
    (["--checkpoint", "{tmp}/tiny.txt/lm"], "--checkpoint", "cannot write there"),
    (["--restore"], "--restore", "there is no checkpoint at"),
    (["--checkpoint", "{tmp}/junk"], "{tmp}/junk", "not a checkpoint of this example (a folder "
     "without a saved step)"),
    (["--checkpoint", "{tmp}/badmeta"], "{tmp}/badmeta/3", "damaged one (JSONDecodeError"),
    (["--resume", "--checkpoint", "{tmp}/emptymeta"], "{tmp}/emptymeta/3", "damaged one"),
    (["--restore", "--checkpoint", "{tmp}/nometa"], "{tmp}/nometa/3", "lacks ['chars']"),
    (["--restore", "--checkpoint", "{tmp}/short"], "{tmp}/short/3",
     "has no array params/head: it is incomplete"),
    (["--restore", "--checkpoint", "{tmp}/truncated"], "{tmp}/truncated/3",
     "is damaged (ValueError: DATA_LOSS"),
    (["--resume", "--checkpoint", "{tmp}/damaged"], "{tmp}/damaged/3",
     "is damaged (JSONDecodeError"),
    # Training over another run's checkpoint: one line, naming the flag to pass.
    (["--checkpoint", "{tmp}/short", "--steps", "5"], "--overwrite",
     "holds another run (step 3 of 3; --steps: 3 in the checkpoint vs 5 here): pass --overwrite"),
    (["--checkpoint", "{tmp}/short", "--optimizer", "lamb"], "--optimizer",
     "(step 3 of 3; --optimizer: adamw in the checkpoint vs lamb here): pass --overwrite"),
    (["--resume", "--checkpoint", "{tmp}/short", "--optimizer", "muon"], "--optimizer",
     "another run than the flags ask for (--optimizer: adamw in the checkpoint vs muon here)"),
    # Resuming or restoring with another text: named, with the one to pass.
    (["--resume", "--checkpoint", "{tmp}/short", "--text", "{tmp}/other.txt"], "--text",
     "holds a run on another text (--text: tiny.txt (SHA-256"),
    (["--restore", "--checkpoint", "{tmp}/short", "--text", "{tmp}/other.txt"], "--text",
     "was trained on tiny.txt, whose vocabulary (28 characters) is not that of"),
    # Per-layer safetensors: --export into a new folder, --load-safetensors from an export.
    (["--export", "{tmp}/junk"], "--export", "a folder that is not empty"),
    (["--export", "{tmp}/tiny.txt"], "--export", "a file; give a new or empty folder"),
    (["--export", "{tmp}/tiny.txt/out"], "--export {tmp}/tiny.txt/out",
     "cannot write there ({tmp}/tiny.txt is not a writable folder)"),
    (["--export", "{tmp}/out", "--load-safetensors", "{tmp}/export"], "--export",
     "not allowed with --load-safetensors"),
    (["--load-safetensors", "{tmp}/junk"], "--load-safetensors",
     "no transformer_lm.json there; give a folder that --export DIR wrote"),
    # Any --framework reads any framework's export (one set of names): here the nnx model
    # reads the jax model's export, and finds the tensor it lacks.
    (["--load-safetensors", "{tmp}/export", "--framework", "nnx"], "--load-safetensors",
     "for leaf ['blocks']['layers']['down']['bias'] is not in"),
    (["--load-safetensors", "{tmp}/export", "--resume"], "--load-safetensors",
     "not allowed with argument --load-safetensors"),
    (["--load-safetensors", "{tmp}/export", "--layers", "3"], "--layers",
     "another run than the flags ask for (--layers: 2 in the checkpoint vs 3 here): leave "
     "these flags out to use the checkpoint's, or pass --load-safetensors DIR of another "
     "export."),
    (["--load-safetensors", "{tmp}/export"], "--load-safetensors {tmp}/export",
     "layer 0's tensor 'model.layers.0.mlp.down_proj.weight' for leaf ['blocks']['down'] is "
     "not in"),
    (["--load-safetensors", "{tmp}/badexport"], "{tmp}/badexport/transformer_lm.json",
     "is not what --export writes, or is damaged (JSONDecodeError"),
    # Fine-tuning: --lora RANK on the checkpoint's run; --quantize for its base (QLoRA).
    (["--lora", "0"], "--lora", "expected a positive integer"),
    (["--lora", "4.5"], "--lora", "expected a positive integer"),
    (["--lora", "4"], "--lora", "there is no pre-trained checkpoint at {tmp}/none to fine-tune. "
     "Pre-train one first: the same command without --lora"),
    (["--lora", "64", "--checkpoint", "{tmp}/short"], "--lora",
     "64 is larger than the model's width, --d-model 32"),
    (["--lora", "4", "--checkpoint", "{tmp}/short"], "{tmp}/short/3",
     "has no array params/head: it is incomplete"),
    (["--lora", "4", "--checkpoint", "{tmp}/short", "--text", "{tmp}/other.txt"], "--text",
     "was trained on tiny.txt, whose vocabulary (28 characters) is not that of"),
    (["--lora", "4", "--checkpoint", "{tmp}/short", "--heads", "4"], "--heads",
     "another run than the flags ask for (--heads: 2 in the checkpoint vs 4 here)"),
    (["--quantize", "nf4"], "--quantize", "only with --lora RANK"),
    (["--quantize", "int2", "--lora", "4"], "--quantize", "invalid choice: 'int2'"),
    (["--lora-alpha", "8"], "--lora-alpha", "only with --lora RANK"),
    (["--adapters", "{tmp}/out"], "--adapters", "only with --lora RANK"),
    (["--lora-dropout", "0.1"], "--lora-dropout", "only with --lora RANK"),
    (["--modules-to-save", "lm_head"], "--modules-to-save", "only with --lora RANK"),
    (["--lora", "4", "--lora-dropout", "1"], "--lora-dropout", "expected a probability in [0, 1)"),
    (["--lora", "4", "--lora-dropout", "-0.1"], "--lora-dropout",
     "expected a probability in [0, 1)"),
    (["--lora", "4", "--lora-dropout", "nan"], "--lora-dropout",
     "expected a probability in [0, 1)"),
    (["--lora", "4", "--lora-dropout", "5%"], "--lora-dropout", "invalid float value: '5%'"),
    (["--lora", "4", "--modules-to-save", "head"], "--modules-to-save 'head'",
     "'head' is not a module to save; expected one or more of embed_tokens, norm, lm_head"),
    (["--lora", "4", "--modules-to-save", "lm_head,,norm"], "--modules-to-save",
     "'' is not a module to save"),
    (["--lora", "4", "--modules-to-save", "lm_head,lm_head"], "--modules-to-save",
     "'lm_head' is named twice"),
    (["--lora", "4", "--modules-to-save", "q_proj"], "--modules-to-save", "not a module to save"),
    (["--lora", "4", "--modules-to-save", "qkv_proj"], "--modules-to-save",
     "the blocks' linear layers hold the adapters"),
    (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha", "expected a positive number"),
    (["--lora", "4", "--lora-alpha", "nan"], "--lora-alpha", "expected a positive number"),
    (["--lora", "4", "--restore"], "--lora", "not allowed with --restore"),
    (["--lora", "4", "--resume"], "--lora", "not allowed with --resume"),
    (["--lora", "4", "--load-safetensors", "{tmp}/export"], "--lora",
     "not allowed with --load-safetensors"),
    (["--lora", "4", "--export", "{tmp}/out"], "--lora", "not allowed with --export"),
    (["--lora", "4", "--adapters", "{tmp}/junk"], "--adapters",
     "already holds files; pass --overwrite to replace them"),
    (["--lora", "4", "--adapters", "{tmp}/tiny.txt"], "--adapters {tmp}/tiny.txt",
     "a file, not a folder; PEFT adapters are a folder (adapter_config.json + "
     "adapter_model.safetensors)"),
    (["--lora", "4", "--adapters", "{tmp}/tiny.txt", "--overwrite"], "--adapters",
     "a file is never replaced: give a folder path, e.g. --adapters {tmp}/tiny_adapters"),
    (["--lora", "4", "--adapters", "{tmp}/tiny.txt/out"], "--adapters {tmp}/tiny.txt/out",
     "cannot write there ({tmp}/tiny.txt is not a writable folder)"),
    (["--lora", "4", "--checkpoint", "{tmp}/short", "--adapters", "{tmp}/short", "--overwrite"],
     "--adapters", "it would replace the pre-trained --checkpoint {tmp}/short or hold it"),
    (["--lora", "4", "--checkpoint", "{tmp}/short", "--adapters", "{tmp}", "--overwrite"],
     "--adapters", "or hold it; give a folder beside it, e.g. --adapters {tmp}/short_lora"),
    (["--stpes", "3"], "--stpes", "unrecognized arguments"),
    (["--checkpoint"], "--checkpoint", "expected one argument"),
]


@pytest.fixture(scope="module")
def lm():
    return load_example()  # (the package examples/lm)


@pytest.fixture(scope="module")
def files(lm, tmp_path_factory) -> pathlib.Path:
    """Texts and damaged checkpoints of the tiny model's run on ``tiny.txt``."""
    tmp = tmp_path_factory.mktemp("misuse_example")
    (tmp / "tiny.txt").write_text(TEXT)
    (tmp / "other.txt").write_text(TEXT.upper())
    (tmp / "latin1.txt").write_bytes("café au lait\n".encode("latin-1") * 20)
    (tmp / "short.txt").write_text("abc")
    (tmp / "empty.txt").write_text("")
    (tmp / "old.npz").write_bytes(b"PK an .npz of format 2")
    (tmp / "junk").mkdir()
    (tmp / "junk" / "notes.txt").write_text("not a checkpoint")
    # A checkpoint of the tiny run (zeros: the values do not matter here), to damage.
    args = lm.cli.parse_args([*TINY, "--text", str(tmp / "tiny.txt")])
    lm.run.settle_args(args, None, ())
    chars, _, sha256 = lm.data.load_text(args.text)
    lm_models = lm.model

    config = lm_models.Config(vocab=len(chars), layers=2, d_model=32, heads=2, seq_len=16)
    model = lm_models.build("jax", config)
    run = lm.run.run_identity(args, sha256)
    state = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype),
                         lm.run.state_template(model, args, run))
    meta = {"format": lm.cli.FORMAT, "run": run, "step": 3, "val_loss": 1.0, "chars": chars}
    for name in ("badmeta", "emptymeta", "truncated", "damaged"):
        lm.checkpoints.save_checkpoint(tmp / name, state, meta)
    (tmp / "badmeta" / "3" / "meta" / "metadata").write_text("{not json")
    (tmp / "emptymeta" / "3" / "meta" / "metadata").write_text("")
    for name, file in [("truncated", "manifest.ocdbt"), ("damaged", "_METADATA")]:
        path = tmp / name / "3" / "state" / file  # cut in half
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    params = dict(state["params"])
    del params["head"]
    lm.checkpoints.save_checkpoint(tmp / "short", {**state, "params": params}, meta)
    lm.checkpoints.save_checkpoint(tmp / "nometa", state,
                                   {k: v for k, v in meta.items() if k != "chars"})
    # An --export of the tiny run with one tensor missing.
    from safetensors.numpy import save_file

    (tmp / "export").mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((len(chars), 32), np.float32)},
              str(tmp / "export" / "model.safetensors"))
    (tmp / "export" / lm.cli.EXPORT_META).write_text(json.dumps(meta))
    (tmp / "badexport").mkdir()
    (tmp / "badexport" / lm.cli.EXPORT_META).write_text("{")
    return tmp


@pytest.fixture
def no_work(lm, monkeypatch):
    """Training or sampling fails the test: every misuse must be refused before them."""

    def started(*args, **kwargs):
        raise AssertionError("the example started working on a command it should refuse")

    for module, name in [(lm.train, "train"), (lm.sample, "generate"),
                         (lm.sample, "cached_vs_full"), (lm.finetune, "fine_tune")]:
        monkeypatch.setattr(module, name, started)


def refused(lm, argv: list[str], capsys) -> str:
    """The error of ``cli(argv)``, which must exit with status 2, without a traceback."""
    try:
        code = lm.cli.cli(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    error = err[err.index("error: "):]
    assert error.count("\n") == 1, error  # one line
    return error


@pytest.mark.every_case
@pytest.mark.parametrize("argv, names, message", CASES)
def test_misuse_is_refused_naming_the_flag(lm, files, no_work, capsys, argv, names, message):
    argv = [a.format(tmp=files) for a in argv]
    if "--text" not in argv:
        argv += ["--text", str(files / "tiny.txt")]
    if "--checkpoint" not in argv:
        argv += ["--checkpoint", str(files / "none")]
    before = snapshot(files)
    error = refused(lm, [*TINY, *argv], capsys)
    assert names.format(tmp=files) in error and message.format(tmp=files) in error, error
    assert snapshot(files) == before  # nothing written, nothing replaced


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_adapters_naming_a_file_never_suggests_overwrite(lm, files, no_work, capsys, overwrite):
    """--adapters naming a regular file is refused with or without --overwrite (a file is never
    replaced by the adapters' folder), its message never suggests --overwrite, and the folder
    it suggests is taken, as a new folder and, holding adapters, with --overwrite."""
    base = [*TINY, "--text", str(files / "tiny.txt"), "--checkpoint", str(files / "none"),
            "--lora", "4"]
    error = refused(lm, [*base, "--adapters", str(files / "tiny.txt"), *overwrite], capsys)
    assert f"--adapters {files / 'tiny.txt'}: a file, not a folder" in error, error
    assert "--overwrite" not in error, error
    suggested = error.rsplit("--adapters ", 1)[1].strip()
    args = lm.cli.parse_args([*base, "--adapters", suggested, *overwrite])
    assert args.adapters == pathlib.Path(suggested) and not args.adapters.exists()
    args = lm.cli.parse_args([*base, "--adapters", str(files / "junk"), "--overwrite"])
    assert args.adapters == files / "junk"  # an existing folder: replaced, when asked


def snapshot(folder: pathlib.Path) -> dict:
    """Every file under ``folder`` (checkpoints are folders): its bytes."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_diverged_run_is_stopped_naming_the_flag(lm):
    args = lm.cli.parse_args(["--lr", "10"])
    lm.train.check_finite(2.5, 7, args)  # a number: training goes on
    for loss in (float("nan"), float("inf")):
        with pytest.raises(lm.cli.UsageError, match=r"diverged: .* at step 7; pass a smaller --lr "
                           r"than 10\.0 \(the default is 0\.002\) and --overwrite"):
            lm.train.check_finite(loss, 7, args)


def test_a_framework_that_is_not_installed_gets_the_install_hint(
    lm, files, no_work, capsys, monkeypatch
):
    import stackwise

    monkeypatch.setitem(sys.modules, "haiku", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "stackwise.haiku", raising=False)
    if "haiku" in vars(stackwise):  # (hasattr would import it: a lazy submodule)
        monkeypatch.delattr(stackwise, "haiku")
    argv = [*TINY, "--framework", "haiku", "--text", str(files / "tiny.txt")]
    error = refused(lm, [*argv, "--checkpoint", str(files / "none")], capsys)
    assert "--framework haiku: `stackwise.haiku` needs dm-haiku: pip install" in error
