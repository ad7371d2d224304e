"""Tests of the example's fine-tuning: ``transformer_lm.py --lora RANK [--quantize KIND]``.

A tiny pre-training run, then LoRA and QLoRA (nf4) on its checkpoint for a few steps, in
subprocesses as tests/examples/test_examples.py runs the example. Checked here, in this
process, from what the runs left on disk: the adapters PEFT's files hold are the ones trained
(``stackwise.lora.load_peft`` reads them bitwise), the loss went down, the merged model gives
the wrapped (unmerged) model's logits, and the pre-trained checkpoint is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scripts import load_example
from _tolerance import assert_close, reassociation_bound
from test_examples import TINY, checkpoint_arrays, env, run_example

import stackwise

__all__ = ["env"]  # (the fixture, shared with test_examples)

#: The adapted leaves and their modules in a transformers layer (examples/lm/finetune.py's).
MODULES = {"['qkv']": "self_attn.qkv_proj", "['out']": "self_attn.o_proj",
           "['up']": "mlp.up_proj", "['down']": "mlp.down_proj"}
_is_lora = lambda v: isinstance(v, stackwise.lora.LoraWeights)  # noqa: E731


def files_of(folder: pathlib.Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env) -> dict:
    """A 3-step pre-training of the pure-JAX model and of Equinox's with a pattern; then, on
    the first, LoRA rank 4 and QLoRA (nf4), and LoRA on the second (fine-tuned in the
    pure-JAX model): ``{"ckpt", "before", "after", "lora", "qlora", "other", ...}``."""
    tmp = tmp_path_factory.mktemp("lora")
    ckpt, other = tmp / "lm", tmp / "eqx"
    pattern = "--framework equinox --pattern local,global --window 4 --layers 3"
    run_example(env, f"--steps 3 {TINY} --checkpoint {ckpt}",
                f"--steps 3 {TINY.replace('--layers 2 ', '')} {pattern} --checkpoint {other}")
    before = files_of(ckpt)
    lora = f"--lora 4 --steps 8 --lr 1e-2 --sample-len 12 --quiet --checkpoint {ckpt}"
    lora, qlora, lora_other = run_example(
        env, lora, f"{lora} --quantize nf4",
        f"--lora 2 --lora-alpha 4 --steps 8 --lr 1e-2 --sample-len 12 --quiet "
        f"--lora-dropout 0.1 --modules-to-save lm_head --checkpoint {other}")
    return {"ckpt": ckpt, "before": before, "after": files_of(ckpt), "lora": lora,
            "qlora": qlora, "other": other, "lora_other": lora_other}


def digest(adapters) -> str:
    """examples/lm/finetune.py's digest of adapters: their shapes, dtypes and bytes."""
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(adapters):
        leaf = np.asarray(leaf)
        sha.update(f"{leaf.dtype}{leaf.shape}".encode() + leaf.tobytes())
    return sha.hexdigest()


def restored(ckpt: pathlib.Path):
    """The checkpoint's pure-JAX model: its config and params (as the example reads them)."""
    example = load_example()
    lm_models = example.model

    meta = example.checkpoints.read_meta(ckpt)
    run = meta["run"]
    config = lm_models.Config(vocab=len(meta["chars"]), layers=run["layers"],
                              d_model=run["d_model"], heads=run["heads"],
                              seq_len=run["seq_len"])
    template = jax.eval_shape(lm_models.build_jax(config).init, jax.random.key(0))
    arrays = checkpoint_arrays(ckpt)
    params = jax.tree_util.tree_map_with_path(
        lambda path, _: jnp.asarray(arrays["['params']" + jax.tree_util.keystr(path)]), template)
    chars, data, _ = example.data.load_text(run["text"])
    val = example.data.val_windows(data[int(0.9 * len(data)):], run["seq_len"])
    return config, params, val


def check_finetuned(result: dict, ckpt: pathlib.Path, quantize: str | None) -> None:
    config, params, val = restored(ckpt)
    lm_finetune, lm_models = load_example().finetune, load_example().model

    base = params["blocks"]
    if quantize:
        base = stackwise.quant.quantize(base, quantize, lm_finetune.is_target)
    folder = ckpt.with_name(ckpt.name + (f"_qlora_{quantize}" if quantize else "_lora"))
    assert result["adapters"] == str(folder)  # (the default folder)
    config_json = json.loads((folder / "adapter_config.json").read_text())
    assert config_json["r"] == 4 and config_json["lora_alpha"] == 4.0
    assert sorted(config_json["target_modules"]) == ["down_proj", "o_proj", "qkv_proj", "up_proj"]
    # The file holds the trained adapters, bitwise.
    adapters = stackwise.lora.load_peft(folder, base, MODULES)
    assert digest(adapters) == result["adapters_sha256"]
    assert all(bool(jnp.any(lw.b != 0)) for lw in jax.tree.leaves(
        adapters, is_leaf=lambda v: isinstance(v, stackwise.lora.LoraWeights)))
    # The loss went down, and the adapters read back give the loss the run reported.
    assert result["lora_loss_after"] < result["lora_loss_before"]
    wrapped_lm = lm_models.build_jax(config, adapted=True)
    wrapped = {**params, "blocks": stackwise.lora.attach(base, adapters)}
    loss = lm_models.loss_fn(wrapped_lm, wrapped, *val)
    assert float(loss) == pytest.approx(result["lora_loss_after"], rel=1e-5)
    # Merged (into the dequantized base) against wrapped: the same logits, up to the order
    # of the sums; and not the base's.
    merged = {**params, "blocks": stackwise.lora.merge(stackwise.quant.dequantize(base),
                                                       adapters)}
    tokens = val[0][:2]
    positions = jnp.arange(tokens.shape[1])
    plain = lm_models.build_jax(config)
    got, _ = plain.apply(merged, tokens, positions)
    want, _ = wrapped_lm.apply(wrapped, tokens, positions)
    d, hidden = config.d_model, 4 * config.d_model
    widths = [d, config.head_dim, config.seq_len, d, d, hidden]  # a block's chained sums
    bound = reassociation_bound(depth=config.layers, width=widths)
    assert_close(got, want, bound, what="merged vs wrapped logits")
    tolerance = bound * float(np.finfo(np.float32).eps) * float(jnp.abs(want).max())
    assert result["merge_diff"] <= tolerance  # (the run's own check, on its first window)
    base_logits, _ = plain.apply(params, tokens, positions)
    assert float(jnp.abs(base_logits - got).max()) > 10 * tolerance  # the adapters count
    # The run's three-row batch (the adapters on row 0, a second adapter, the same at half its
    # update, on row 1, none on row 2): each row its model's.
    assert result["rows_diff"] <= tolerance
    assert result["rows_generate_equal"]  # and generating from it, a KV cache per row


@pytest.mark.slow  # two subprocesses, two pre-trainings and three fine-tunings: ~1 min of CPU
def test_lora_fine_tunes_the_checkpoint_and_saves_peft_adapters(runs):
    check_finetuned(runs["lora"], runs["ckpt"], None)
    # Before the first step the adapters change nothing: the checkpoint's own validation loss.
    assert runs["lora"]["lora_loss_before"] == pytest.approx(
        load_example().checkpoints.read_meta(runs["ckpt"])["val_loss"], rel=1e-6)
    assert runs["lora"]["loop_diff"] <= 1e-4 and runs["lora"]["cache_diff"] <= 1e-4
    assert runs["lora"]["serving_diff"] <= 1e-4  # merged, sampled in the serving layout
    assert len(runs["lora"]["sample"]) == 1 + 12
    assert runs["after"] == runs["before"]  # the base checkpoint is untouched


@pytest.mark.slow  # (the same runs)
def test_qlora_trains_on_an_nf4_base_and_samples_from_it(runs):
    check_finetuned(runs["qlora"], runs["ckpt"], "nf4")
    assert runs["qlora"]["loop_diff"] <= 1e-4 and runs["qlora"]["cache_diff"] <= 1e-4
    assert runs["qlora"]["serving_diff"] <= 1e-4  # nf4 codes in per-layer buffers
    assert runs["after"] == runs["before"]


@pytest.mark.slow  # (the same runs)
def test_lora_of_another_framework_and_a_pattern_in_layer_order(runs):
    # Equinox's checkpoint, blocks local, global, local (positions 0, 1): fine-tuned in the
    # pure-JAX model; PEFT's layers.{i} are the model's layers in order.
    result = runs["lora_other"]
    assert result["lora_loss_after"] < result["lora_loss_before"]
    # Carried over into the pure-JAX model, the params give the Equinox model's loss.
    assert result["lora_loss_before"] == pytest.approx(
        load_example().checkpoints.read_meta(runs["other"])["val_loss"], rel=1e-5)
    folder = runs["other"].with_name(runs["other"].name + "_lora")
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert sorted({name.split(".")[4] for name in tensors if ".layers." in name}) == [
        "0", "1", "2"]
    assert tensors["base_model.model.model.layers.2.self_attn.qkv_proj.lora_A.weight"].shape \
        == (2, 32)
    # --lora-dropout 0.1 --modules-to-save lm_head: in the config, the head beside the adapters.
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.1 and config["modules_to_save"] == ["lm_head"]
    assert tensors["base_model.model.lm_head.weight"].shape[1] == 32  # (vocab, width)
    assert result["modules_to_save"] == ["lm_head.bias", "lm_head.weight"]
    assert result["loop_diff"] <= 1e-4 and result["cache_diff"] <= 1e-4


def _finetuned_in_process(tmp_path, *flags):
    """``finetune.finetune`` of the example on a tiny pure-JAX model (2 blocks, width 16, a
    pattern of two kinds) and random tokens, in this process, with the command line's
    ``flags``: ``(args, config, params, base, record, returned params)``."""
    example = load_example()
    cli, finetune, lm_models = example.cli, example.finetune, example.model
    args = cli.parse_args(["--lora", "2", "--steps", "3", "--lr", "1e-2", "--batch", "2",
                           "--checkpoint", str(tmp_path / "lm"), *flags])
    for field, value in cli.RUN_DEFAULTS.items():  # (the run's: as settled without a checkpoint)
        setattr(args, field, value if getattr(args, field) is None else getattr(args, field))
    config = lm_models.Config(vocab=11, layers=2, d_model=16, heads=2, seq_len=8,
                              pattern=("local", "global"), window=4)
    params = lm_models.build_jax(config).init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (6, 9), 0, 11)
    val = (tokens[:2, :-1], tokens[:2, 1:])
    _, returned, record = finetune.finetune(
        args, config, params, batches=lambda key: (tokens[2:4, :-1], tokens[2:4, 1:]), val=val,
        optimizer=load_example().train.make_optimizer(args, layerwise=False),
        check=lambda loss, step: None, log=lambda line: None)
    return args, config, params, record, returned, val


@pytest.fixture(scope="module")
def dropped(tmp_path_factory):
    """``--lora-dropout 0.2 --modules-to-save lm_head,norm``, in this process (~10 s)."""
    return _finetuned_in_process(tmp_path_factory.mktemp("dropout"), "--lora-dropout", "0.2",
                                 "--modules-to-save", "lm_head,norm")


@pytest.mark.slow  # a fine-tuning in this process: ~10 s (the command line's rows are fast)
def test_lora_dropout_and_modules_to_save_are_trained_saved_and_read_back(dropped):
    """The config holds the rate and the modules; ``load_peft(..., modules_to_save=True)``
    gives the adapters trained (with the rate) and the modules trained whole, bitwise; they
    give the run's validation loss (evaluated without dropout); the embedding stayed frozen."""
    args, config, params, record, returned, val = dropped
    folder = args.adapters
    config_json = json.loads((folder / "adapter_config.json").read_text())
    assert config_json["lora_dropout"] == 0.2
    assert config_json["modules_to_save"] == ["lm_head", "model.norm"]
    assert record["modules_to_save"] == ["lm_head.bias", "lm_head.weight", "model.norm.bias",
                                         "model.norm.weight"]
    lm_finetune, lm_models = load_example().finetune, load_example().model
    base = params["blocks"]
    adapters, saved = stackwise.lora.load_peft(folder, lm_finetune.layer_order(base, 2),
                                               MODULES, modules_to_save=True)
    assert digest(adapters) == record["adapters_sha256"] and digest(saved) == record[
        "saved_sha256"]
    assert {lw.dropout for lw in jax.tree.leaves(adapters, is_leaf=_is_lora) if _is_lora(lw)} \
        == {0.2}
    # The modules were trained whole (the sampled model holds them); the embedding was not.
    np.testing.assert_array_equal(returned["head"], saved["lm_head.weight"].T)
    np.testing.assert_array_equal(returned["ln_f"]["scale"], saved["model.norm.weight"])
    assert np.abs(saved["lm_head.weight"].T - np.asarray(params["head"])).max() > 1e-4
    np.testing.assert_array_equal(returned["embed"], params["embed"])
    # Read back, they give the run's validation loss.
    trained = {**params, "head": jnp.asarray(saved["lm_head.weight"].T),
               "head_bias": jnp.asarray(saved["lm_head.bias"]),
               "ln_f": {"scale": jnp.asarray(saved["model.norm.weight"]),
                        "bias": jnp.asarray(saved["model.norm.bias"])},
               "blocks": tuple(stackwise.lora.attach(b, jax.tree.map(lambda v, p=p: v[p::2],
                                                                     adapters))
                               for p, b in enumerate(base))}
    loss = lm_models.loss_fn(lm_models.build_jax(config, adapted=True), trained, *val)
    assert float(loss) == pytest.approx(record["lora_loss_after"], rel=1e-5)


@pytest.mark.slow  # (one more fine-tuning in this process)
def test_lora_dropout_changes_the_training(dropped, tmp_path):
    """The same run with rate 0 ends with other adapters: the masks changed the gradients."""
    _, _, _, plain, _, _ = _finetuned_in_process(tmp_path, "--modules-to-save", "lm_head,norm")
    assert plain["adapters_sha256"] != dropped[3]["adapters_sha256"]
    assert json.loads((tmp_path / "lm_lora" / "adapter_config.json").read_text())[
        "lora_dropout"] == 0.0


def test_the_command_line_offers_the_quantizers_stackwise_has():
    # --quantize's choices are named without importing JAX; they are stackwise.quant's kinds.
    assert load_example().cli.QUANT_KINDS == stackwise.quant.KINDS
