"""LoRA and QLoRA fine-tuning of the example's pre-trained LM: ``transformer_lm.py --lora RANK``.

    python examples/transformer_lm.py --steps 400              # pre-train: saves the checkpoint
    python examples/transformer_lm.py --lora 8                 # LoRA on it, then sample
    python examples/transformer_lm.py --lora 8 --quantize nf4  # QLoRA: on an nf4 base

The pre-trained checkpoint (``--checkpoint``, any ``--framework``) is the frozen base. Its
blocks get rank-``RANK`` adapters (``stackwise.lora``) on every linear layer (``qkv``,
``out``, ``up``, ``down``: PEFT's ``target_modules="all-linear"``, which leaves out the
output head, and what the QLoRA paper found needed to match full fine-tuning); the
embedding, norms and head stay frozen too. Only the adapters train (``stackwise.lora.split``
and ``combine``), with ``--optimizer`` (adamw) at ``--lr`` for ``--steps`` (200) steps
through ``stackwise.optax.layerwise``, on the text's training part (its first 90%, as in
pre-training; ``--text`` may name another text of the same characters), and the loss is
measured on the same validation windows as pre-training's: before the first step it is the
checkpoint's own validation loss (the adapters' ``b`` starts at zero). ``--lora-dropout RATE``
drops the adapters' input while training, as PEFT's ``lora_dropout`` does (a new key each
step: ``stackwise.lora.combine(..., key=)``; none when evaluating or sampling), and writes
RATE to the adapters' config. ``--modules-to-save lm_head,norm,embed_tokens`` trains those
modules whole beside the adapters (PEFT's ``modules_to_save``), saved with them in the same
folder (``save_peft(..., modules_to_save=)``; ``load_peft(..., modules_to_save=True)`` reads
them back), and the model samples with the trained copies. With ``--quantize
int8|int4|nf4`` the base's linear layers are quantized per layer and output channel first
(``stackwise.quant``), and each block dequantizes its own slice inside the scan.

After training, one batch of three rows runs two adapters and none: the trained adapters on
the first row, a second adapter (the trained one at half its update) on the second and none on
the third (``stackwise.lora.attach(..., rows=[0, 1, -1])``, multi-LoRA serving), each row
checked against its own model, in one forward and in greedy generation with a KV cache per
row. The adapters are saved in Hugging Face PEFT's layout (``stackwise.lora.save_peft``, written
whole or not at all; ``stackwise.lora.load_peft`` reads them back), then the model samples,
through the example's one sampling path (``check_and_sample``): with a float base,
the adapters merged into it (``stackwise.lora.merge``: the plain model again); with a
quantized one, through the wrapped blocks (``stackwise.lora.wrap``) on the quantized base.
Every framework's checkpoint is fine-tuned in the pure-JAX model: the params are carried
over through the Hugging Face-style names all five share (``hf_names``), bitwise.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import argparse
import dataclasses
import hashlib
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stackwise
import stackwise.optax
from lm import model as lm_model
from lm.checkpoints import hf_names
from lm.data import sample_batch
from lm.train import check_finite, make_optimizer

#: --modules-to-save's modules (cli.SAVABLE_MODULES) and the pure-JAX model's params of each.
SAVED_PARAMS = {"embed_tokens": ("embed",), "norm": ("ln_f",), "lm_head": ("head", "head_bias")}

#: The adapted leaves of a block, with their modules in a Llama-like transformers layer (the
#: names of the example's --export; PEFT's adapter files use them).
MODULES = {
    "qkv": "self_attn.qkv_proj",
    "out": "self_attn.o_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def fine_tune(args: argparse.Namespace, config: lm_model.Config, params, names, train_data, val,
              result: dict, log=print) -> tuple[lm_model.LM, Any]:
    """``--lora``: the checkpoint's ``params`` (of ``--framework``'s model, named ``names``)
    fine-tuned in the pure-JAX model (:func:`finetune`); returns the model and params to
    sample, and adds the run's record to ``result``."""
    pattern = config.pattern
    if args.framework != "jax":  # the same params, read into the pure-JAX model's layout
        jax_template = jax.eval_shape(lm_model.build_jax(config).init, jax.random.key(0))
        params = pure_jax_params(params, names, jax_template,
                                 hf_names("jax", jax_template, pattern), len(pattern))
        log(f"fine-tuning the {args.framework} checkpoint in the pure-JAX model (the same "
            "params, through the Hugging Face-style names)")
    lm, params, record = finetune(
        args, config, params,
        batches=lambda key: sample_batch(key, train_data, args.batch, args.seq_len),
        val=val, optimizer=make_optimizer(args, layerwise=False),
        check=lambda loss, step: check_finite(loss, step, args), log=log)
    result.update(record)
    return lm, params


def with_saved_modules(trainable, frozen, modules: tuple[str, ...]):
    """``stackwise.lora.split``'s halves with the params of ``modules`` (--modules-to-save)
    moved from the frozen half to the trainable one: trained whole beside the adapters."""
    moved = [name for module in modules for name in SAVED_PARAMS[module]]
    return ({**trainable, **{name: frozen[name] for name in moved}},
            {**frozen, **{name: jax.tree.map(lambda _: None, frozen[name]) for name in moved}})


def saved_modules(params, modules: tuple[str, ...], pattern: tuple[str, ...]) -> dict:
    """The params of ``modules`` by their names in the Hugging Face-style model
    (``"lm_head.weight"``), in torch's layout (a Linear's weight ``(out, in)``): what
    ``stackwise.lora.save_peft(..., modules_to_save=)`` writes."""
    names = hf_names("jax", params, pattern)
    out = {}
    for module in modules:
        for name in SAVED_PARAMS[module]:
            for tensor, leaf in zip(jax.tree.leaves(names[name]), jax.tree.leaves(params[name])):
                leaf = np.asarray(leaf)
                out[tensor.name] = leaf.transpose(tensor.transpose) if tensor.transpose else leaf
    return out


def is_target(path: str, shape: tuple) -> bool:
    """``stackwise.lora.init``'s and ``stackwise.quant.quantize``'s ``targets``: the blocks'
    linear layers (a pattern's positions are ``[p]['qkv']``, ...)."""
    del shape
    return path.endswith(tuple(f"['{name}']" for name in MODULES))


def per_position(f: Callable, *trees, k: int):
    """``f`` of each pattern position's stacked trees (a plain stack: of the trees)."""
    return tuple(map(f, *trees)) if k > 1 else f(*trees)


def layer_order(tree, k: int):
    """A pattern's k stacked trees (position p: layers p, p + k, ...) as one stack of the
    model's layers in order, for PEFT's ``layers.{i}``; a plain stack as it is."""
    if k == 1:
        return tree
    layers = stackwise.unstack_layers(tree, pattern=k)
    return jax.tree.map(lambda *v: jnp.stack(v), *layers)


def pure_jax_params(params, names, jax_template, jax_names, k: int):
    """Another framework's params as the pure-JAX model's (``jax_template``, ``jax_names``):
    saved under the Hugging Face-style names the five share, read back in the pure-JAX
    layout (through a temporary folder; bitwise)."""
    pattern = k if k > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "hf"
        stackwise.save_safetensors(params, names, folder, pattern=pattern)
        return stackwise.load_checkpoint(str(folder), jax_template, jax_names, pattern=pattern)


def finetune(args: argparse.Namespace, config: lm_model.Config, params, *, batches, val,
             optimizer, check, log=print) -> tuple[lm_model.LM, Any, dict]:
    """Fine-tunes adapters on the pure-JAX model's pre-trained ``params`` (frozen) for
    ``args.steps`` steps; saves them to ``args.adapters``; returns the model and params to
    sample with (merged, or the quantized base with its adapters) and a record of the run.

    ``batches(key)`` gives a training batch ``(inputs, targets)``, ``val`` the validation
    windows, ``optimizer`` the run's optax transformation (wrapped here, per layer), and
    ``check(val_loss, step)`` stops a run that diverged, before anything is saved."""
    k = len(config.pattern)
    # Every block rematerialised while training: its float (dequantized, adapted) weights are
    # rebuilt in the backward pass, one layer at a time, instead of kept for every layer.
    lm = lm_model.build_jax(dataclasses.replace(config, remat=True), adapted=True)
    base = params["blocks"]
    if args.quantize:
        base = per_position(lambda b: stackwise.quant.quantize(b, args.quantize, is_target),
                            base, k=k)
    adapters = stackwise.lora.init(jax.random.key(args.seed + 5), base, rank=args.lora,
                                   alpha=args.lora_alpha, targets=is_target,
                                   dropout=args.lora_dropout)
    model = {**params, "blocks": per_position(stackwise.lora.attach, base, adapters, k=k)}
    trainable, frozen = with_saved_modules(*stackwise.lora.split(model), args.modules_to_save)
    log(describe(params, base, trainable, args))
    trainable, record = train(lm, trainable, frozen, batches, val, optimizer, args, log)
    check(record["lora_loss_after"], args.steps)
    model = stackwise.lora.combine(trainable, frozen)
    params = {**params, **{name: v for name, v in model.items() if name != "blocks"}}
    adapters = per_position(lambda m: m.adapters, model["blocks"], k=k)
    saved = saved_modules(params, args.modules_to_save, config.pattern)
    record["adapters_files"], record["adapters_sha256"] = save(args, adapters, saved, k, log)
    record["adapters"] = str(args.adapters)
    record["modules_to_save"] = sorted(saved)
    record["saved_sha256"] = digest(saved)
    # The merged model (into the dequantized base, for a quantized one) against the wrapped.
    floats = per_position(stackwise.quant.dequantize, base, k=k)
    merged = {**params, "blocks": per_position(stackwise.lora.merge, floats, adapters, k=k)}
    plain = lm_model.build_jax(config)
    window = val[0][:1]
    positions = jnp.arange(window.shape[1])
    wrapped_logits, _ = jax.jit(lm.apply)(model, window, positions)
    merged_logits, _ = jax.jit(plain.apply)(merged, window, positions)
    record["merge_diff"] = float(jnp.abs(wrapped_logits - merged_logits).max())
    log(f"the adapters merged into the {'dequantized ' * bool(args.quantize)}base give the "
        f"wrapped model's logits to {record['merge_diff']:.1e}")
    record["rows_diff"], record["rows_generate_equal"] = two_rows(
        lm, model, params, base, adapters, window, k)
    log(f"one batch of three rows, the first with these adapters, the second with a second "
        f"adapter (these at half their update) and the third with none (stackwise.lora.attach("
        f"..., rows=[0, 1, -1]): multi-LoRA serving), gives each row's "
        f"logits to {record['rows_diff']:.1e}, and generating from it with a KV cache per row "
        f"gives {'each row' if record['rows_generate_equal'] else 'NOT each row'} its own "
        "model's greedy tokens")
    if args.quantize:  # sampled from the quantized base, each block adapting its own slice
        return lm, model, record
    return plain, merged, record


def two_rows(lm, model, params, base, adapters, window, k: int) -> tuple[float, bool]:
    """A batch whose rows pick their adapters (``attach(..., rows=)``): the window three
    times, row 0 with the trained adapters, row 1 with a second adapter (the trained one at
    half its update, ``b / 2``: another adapter without a second training) and row 2 with
    none (the base alone). Returns the largest difference from each row's own model (its
    adapter attached alone; the base), and whether greedy generation from the batch, a KV
    cache per row, gives each row its own model's tokens."""
    half = jax.tree.map(lambda w: dataclasses.replace(w, b=w.b / 2), adapters, is_leaf=is_lora)
    pair = per_position(lambda a, h: stackwise.lora.stack_adapters([a, h]), adapters, half, k=k)
    rows = jnp.array([0, 1, -1])
    batch = {**params, "blocks": per_position(
        lambda b, a: stackwise.lora.attach(b, a, rows=rows), base, pair, k=k)}
    own = [model, {**params, "blocks": per_position(stackwise.lora.attach, base, half, k=k)},
           {**params, "blocks": per_position(
               lambda b, a: stackwise.lora.attach(b, jax.tree.map(jnp.zeros_like, a)), base,
               adapters, k=k)}]
    apply = jax.jit(lm.apply)
    positions = jnp.arange(window.shape[1])
    got, _ = apply(batch, jnp.concatenate([window] * 3), positions)
    diff = max(float(jnp.abs(got[i] - apply(p, window, positions)[0][0]).max())
               for i, p in enumerate(own))
    prompt = window[0, : window.shape[1] // 2]
    length = min(16, window.shape[1] - len(prompt))
    decode = jax.jit(lm.apply, donate_argnums=3)
    rows_tokens = greedy(decode, lm, batch, prompt, length, rows=3)
    equal = all(bool((rows_tokens[i] == greedy(decode, lm, p, prompt, length)[0]).all())
                for i, p in enumerate(own))
    return diff, equal


def is_lora(x) -> bool:
    return isinstance(x, stackwise.lora.LoraWeights)


def greedy(decode, lm, params, prompt, length: int, rows: int = 1) -> np.ndarray:
    """``length`` greedy tokens after ``prompt`` (each of ``rows`` rows starts from it), with
    the model's KV cache: ``(rows, length)``. ``decode = jax.jit(lm.apply, donate_argnums=3)``,
    made once by the caller."""
    cache = lm.init_cache(rows)
    logits, cache = decode(params, jnp.tile(prompt[None], (rows, 1)),
                           jnp.arange(len(prompt)), cache)
    out = []
    for pos in range(len(prompt), len(prompt) + length):
        token = jnp.argmax(logits[:, -1], -1)
        out.append(np.asarray(token))
        logits, cache = decode(params, token[:, None], jnp.array([pos]), cache)
    return np.stack(out, 1)


def describe(params, base, trainable, args) -> str:
    """One line: the adapters trained (and the modules trained whole) and the frozen base
    (its bytes, quantized or not)."""
    n_adapters = sum(v.size for v in jax.tree.leaves(trainable["blocks"]))
    n_saved = sum(v.size for name, v in trainable.items() if name != "blocks"
                  for v in jax.tree.leaves(v))
    n_params = sum(v.size for v in jax.tree.leaves(params)) - n_saved
    held = sum(v.nbytes for v in jax.tree.leaves(base))
    floats = sum(v.nbytes for v in jax.tree.leaves(params["blocks"]))
    kind = f"{args.quantize} " if args.quantize else ""
    dropout = f", dropout {args.lora_dropout:g}" if args.lora_dropout else ""
    whole = (f"; {', '.join(args.modules_to_save)} trained whole ({n_saved:,} params)"
             if args.modules_to_save else "")
    return (f"LoRA rank {args.lora} (alpha {args.lora_alpha:g}{dropout}) on "
            f"{', '.join(MODULES)} of every block: {n_adapters:,} trainable params{whole}; "
            f"the {n_params:,} others of the pre-trained model frozen, its blocks {kind}in "
            f"{held / 2**20:.2f} MiB"
            + (f" (float32: {floats / 2**20:.2f} MiB)" if args.quantize else ""))


def train(lm, trainable, frozen, batches, val, optimizer, args, log) -> tuple[Any, dict]:
    """``args.steps`` steps on the adapters only; the validation loss before and after."""
    # The blocks' leaves per layer; a module trained whole (--modules-to-save) is one matrix.
    axes = {name: stackwise.lora.layer_axes(v) if name == "blocks" else False
            for name, v in trainable.items()}
    tx = stackwise.optax.layerwise(optimizer, axes)

    def loss(trainable, inputs, targets, key=None):  # key: this step's LoRA dropout masks
        model = stackwise.lora.combine(trainable, frozen, key=key)
        return lm_model.loss_fn(lm, model, inputs, targets)

    @jax.jit
    def step(trainable, opt_state, key):
        value, grads = jax.value_and_grad(loss)(trainable, *batches(key),
                                                jax.random.fold_in(key, 1))
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    evaluate = jax.jit(lambda trainable: loss(trainable, *val))
    before = float(evaluate(trainable))
    log(f"fine-tuning {args.steps} steps: before, val {before:.3f} nats")
    opt_state, key = tx.init(trainable), jax.random.key(args.seed + 6)
    every, losses, t0 = max(1, args.steps // 4), [], time.perf_counter()
    for i in range(1, args.steps + 1):
        key, k = jax.random.split(key)
        trainable, opt_state, value = step(trainable, opt_state, k)
        if i % every == 0 or i == args.steps:
            losses.append((i, float(value)))
            log(f"lora step {i:5d}  train {losses[-1][1]:.3f}")
    after = float(evaluate(trainable))
    train_s = time.perf_counter() - t0
    log(f"fine-tuned in {train_s:.1f} s: val {before:.3f} -> {after:.3f} nats")
    return trainable, {"lora_loss_before": before, "lora_loss_after": after,
                       "lora_losses": losses, "lora_train_s": train_s}


def save(args, adapters, saved: dict, k: int, log) -> tuple[list[str], str]:
    """Saves the adapters in PEFT's layout to ``args.adapters``, with the modules trained
    whole (``saved``, by their names in the model): the files and the adapters' digest."""
    adapters = layer_order(adapters, k)
    modules = {f"['{name}']": module for name, module in MODULES.items()}
    files = stackwise.lora.save_peft(args.adapters, adapters, modules,
                                     base_model_name_or_path=str(args.checkpoint),
                                     modules_to_save=saved or None, overwrite=args.overwrite)
    sha256 = digest(adapters)
    also = f", with {', '.join(sorted(saved))}" if saved else ""
    log(f"saved the adapters to {args.adapters} in PEFT's layout ({', '.join(files)}; "
        f"SHA-256 of the arrays {sha256[:12]}{also}); stackwise.lora.load_peft reads them back"
        + (" (modules_to_save=True for the modules)" if saved else ""))
    return files, sha256


def digest(adapters) -> str:
    """The SHA-256 of the adapters' arrays (shapes, dtypes and bytes, in tree order; a dict
    of saved modules in the order of its names): the same for the adapters trained and those
    ``stackwise.lora.load_peft`` reads, if bitwise equal."""
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(adapters):
        leaf = np.asarray(leaf)
        sha.update(f"{leaf.dtype}{leaf.shape}".encode() + leaf.tobytes())
    return sha.hexdigest()
