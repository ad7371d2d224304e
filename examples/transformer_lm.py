"""Train a character-level transformer whose 12 blocks are one stackwise stack, then sample.

    python examples/transformer_lm.py                      # pure JAX, ~3 min on 2 CPU cores
    python examples/transformer_lm.py --framework flax     # or haiku, nnx: the same model
    python examples/transformer_lm.py --remat --layers 24  # remat each block; any depth
    python examples/transformer_lm.py --restore            # sample from the saved checkpoint

What it shows:
  * the blocks' params are stacked (a leading layer axis) and run as ONE scanned layer, so the
    compile time does not grow with ``--layers``;
  * training with optax on the embedded text (``examples/data/shakespeare.txt``, or ``--text``);
  * sampling token by token with a stacked per-layer KV cache (the stack's per-layer state),
    checked against the full forward pass;
  * a checkpoint of the stacked params, restored and then loaded into the plain Python-loop
    layout (one params tree per block) with ``stackwise.unstack_layers``, giving the same logits.

Checkpoint format (``.npz``, readable with plain numpy): one array per params leaf, named by
``jax.tree_util.keystr`` of its path (e.g. ``['blocks']['qkv']``, shape ``[layers, ...]``), plus
``__meta__``, a JSON string with the framework, the model config and the vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_models  # noqa: E402  (the four model definitions, next to this file)

import stackwise  # noqa: E402

DEFAULT_TEXT = pathlib.Path(__file__).parent / "data" / "shakespeare.txt"

#: Cached decoding and the unstacked loop compute the same function in another order.
LOGITS_ATOL = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--framework", choices=lm_models.FRAMEWORKS, default="jax")
    p.add_argument("--steps", type=int, default=400, help="training steps (default: 400)")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (default: 12)")
    p.add_argument("--remat", action="store_true", help="rematerialise each block (less memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", type=pathlib.Path, default=DEFAULT_TEXT, help="a UTF-8 text to learn")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64, help="training context (default: 64)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--sample-len", type=int, default=400, help="characters to generate")
    p.add_argument("--prompt", default="\n", help="text the sample starts from")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument(
        "--checkpoint",
        type=pathlib.Path,
        default=None,
        help="checkpoint file (default: <tmp>/stackwise_lm_<framework>.npz)",
    )
    p.add_argument("--restore", action="store_true", help="skip training: load --checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.checkpoint is None:
        args.checkpoint = pathlib.Path(tempfile.gettempdir()) / f"stackwise_lm_{args.framework}.npz"
    return args


# --------------------------------------------------------------------------
# Data: characters to int ids.


def load_text(path: pathlib.Path) -> tuple[str, np.ndarray]:
    """The vocabulary (sorted distinct characters) and the text as int32 ids."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))
    lookup = {ch: i for i, ch in enumerate(chars)}
    return chars, np.array([lookup[ch] for ch in text], dtype=np.int32)


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


# --------------------------------------------------------------------------
# Training.


def loss_fn(lm: lm_models.LM, params, inputs, targets):
    positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
    logits, _ = lm.apply(params, inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(lm, params, train_data, val_data, args, log=print) -> tuple[Any, dict]:
    """Trains ``params`` for ``args.steps`` steps; returns them and a record of the run."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, max(1, args.steps // 10)), max(args.steps, 2), args.lr / 10
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, 0.9, 0.99))
    opt_state = optimizer.init(params)

    def step(params, opt_state, key):
        inputs, targets = sample_batch(key, train_data, args.batch, args.seq_len)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(lm, p, inputs, targets))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def evaluate(params, key):
        inputs, targets = sample_batch(key, val_data, 4 * args.batch, args.seq_len)
        return loss_fn(lm, params, inputs, targets)

    key = jax.random.key(args.seed + 1)
    t0 = time.perf_counter()
    step = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, key).compile()
    compile_s = time.perf_counter() - t0
    log(f"compiled the train step ({args.layers} blocks, one scanned stack) in {compile_s:.1f} s")

    eval_key = jax.random.key(args.seed + 2)  # the same validation batch every time
    record = {"compile_s": compile_s, "val_loss": [(0, float(evaluate(params, eval_key)))]}
    log(f"step     0  val loss {record['val_loss'][0][1]:.3f}")
    log_every = max(1, args.steps // 8)
    tokens_per_step = args.batch * args.seq_len
    losses = []
    bar = tqdm(range(1, args.steps + 1), disable=args.quiet, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    for i in bar:
        key, k = jax.random.split(key)
        params, opt_state, loss = step(params, opt_state, k)
        if i % 10 == 0 or i == args.steps:
            losses.append((i, float(loss)))
            tok_s = i * tokens_per_step / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{losses[-1][1]:.3f}", tok_s=f"{tok_s:,.0f}")
        if i % log_every == 0 or i == args.steps:
            val = float(evaluate(params, eval_key))
            record["val_loss"].append((i, val))
            line = f"step {i:5d}  train loss {float(loss):.3f}  val loss {val:.3f}"
            (bar.write if not args.quiet else log)(line)
    bar.close()
    train_s = time.perf_counter() - t0
    tokens_per_s = args.steps * tokens_per_step / train_s
    record.update(train_s=train_s, losses=losses, tokens_per_s=tokens_per_s)
    log(f"trained {args.steps} steps in {train_s:.1f} s ({record['tokens_per_s']:,.0f} tokens/s)")
    return params, record


# --------------------------------------------------------------------------
# Sampling with the stacked KV cache.


def generate(decode, lm, params, prompt: np.ndarray, length: int, key, temperature, emit=None):
    """Samples ``length`` tokens after ``prompt``, one at a time, with the KV cache.

    ``decode = jax.jit(lm.apply, donate_argnums=3)``. The prompt fills the cache in one call
    (prefill); after that each step feeds only the newest token: nothing is recomputed.
    ``emit(token_id)`` is called as each token is drawn.
    """
    window = jax.eval_shape(lambda: lm.init_cache(1))
    window = jax.tree.leaves(window)[0].shape[2]  # [layers, batch, seq_len, heads, head_dim]
    if not 1 <= len(prompt) <= window:
        raise ValueError(f"the prompt must have 1 to {window} characters, got {len(prompt)}.")
    cache = lm.init_cache(1)
    logits, cache = decode(params, jnp.asarray(prompt)[None], jnp.arange(len(prompt)), cache)
    out = []
    for pos in range(len(prompt), len(prompt) + length):
        key, k = jax.random.split(key)
        token = jax.random.categorical(k, logits[0, -1] / temperature)
        out.append(int(token))
        if emit is not None:
            emit(out[-1])
        logits, cache = decode(params, token.reshape(1, 1), jnp.array([pos]), cache)
    return np.array(out, dtype=np.int32)


def cached_vs_full(forward, decode, lm, params, tokens: np.ndarray, prefill: int) -> float:
    """Max |logits| difference: the full forward vs prefill + token-by-token cached decoding."""
    tokens = jnp.asarray(tokens)[None]
    full, _ = forward(params, tokens, jnp.arange(tokens.shape[1]))
    logits, cache = decode(params, tokens[:, :prefill], jnp.arange(prefill), lm.init_cache(1))
    steps = [logits]
    for pos in range(prefill, tokens.shape[1]):
        logits, cache = decode(params, tokens[:, pos : pos + 1], jnp.array([pos]), cache)
        steps.append(logits)
    return float(jnp.abs(jnp.concatenate(steps, axis=1) - full).max())


# --------------------------------------------------------------------------
# Checkpoints: the stacked params in a .npz file (see the module docstring for the format).


def save_checkpoint(path: pathlib.Path, params, meta: dict) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {
        jax.tree_util.keystr(p): np.asarray(leaf)
        for p, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:  # write, then rename: never a half-written checkpoint
        np.savez(f, __meta__=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def read_meta(path: pathlib.Path) -> dict:
    with np.load(path) as f:
        return json.loads(str(f["__meta__"]))


def load_checkpoint(path: pathlib.Path, template) -> Any:
    """The params saved at ``path``, in the structure (and shapes) of ``template``."""
    with np.load(path) as f:

        def load(p, leaf):
            name = jax.tree_util.keystr(p)
            if name not in f:
                raise ValueError(
                    f"checkpoint {path} has no array {name}; was it saved by another model?"
                )
            if f[name].shape != leaf.shape:
                raise ValueError(
                    f"checkpoint {path}: {name} has shape {f[name].shape}, the model expects "
                    f"{leaf.shape}; pass the --layers/--d-model it was trained with."
                )
            return jnp.asarray(f[name], dtype=leaf.dtype)

        return jax.tree_util.tree_map_with_path(load, template)


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Runs the example; returns what it measured (for the smoke tests)."""
    args = parse_args(argv)
    log = print
    start = time.perf_counter()
    chars, data = load_text(args.text)
    split = int(0.9 * len(data))
    train_data, val_data = jnp.asarray(data[:split]), jnp.asarray(data[split:])
    config = lm_models.Config(
        vocab=len(chars),
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        seq_len=args.seq_len,
        remat=args.remat,
    )
    meta = {"framework": args.framework, "config": dataclasses.asdict(config), "chars": chars}
    lm = lm_models.build(args.framework, config)
    template = jax.eval_shape(lm.init, jax.random.key(args.seed))
    n_params = sum(leaf.size for leaf in jax.tree.leaves(template))
    log(
        f"{args.framework}: {args.layers} blocks stacked as one layer, {n_params:,} params; "
        f"{len(data):,} characters of {args.text.name}, vocabulary {len(chars)}; "
        f"{jax.device_count()} {jax.default_backend()} device(s)"
    )
    result: dict[str, Any] = {"framework": args.framework, "n_params": n_params}

    if args.restore:
        saved = read_meta(args.checkpoint)
        if saved["config"] != dataclasses.asdict(config) or saved["chars"] != chars:
            raise ValueError(
                f"{args.checkpoint} was saved with {saved['config']} on another text; pass the "
                "same --text/--layers/--d-model/--heads/--seq-len/--remat flags."
            )
        params = load_checkpoint(args.checkpoint, template)
        log(f"restored {args.checkpoint}")
    else:
        params = jax.jit(lm.init)(jax.random.key(args.seed))
        params, record = train(lm, params, train_data, val_data, args, log)
        result.update(record)

        # Checkpoint round trip: save the stacked params, read them back, compare bitwise.
        save_checkpoint(args.checkpoint, params, meta)
        restored = load_checkpoint(args.checkpoint, template)
        pairs = zip(jax.tree.leaves(params), jax.tree.leaves(restored))
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
        if not same:
            raise RuntimeError(f"the checkpoint {args.checkpoint} did not restore bitwise")
        log(f"saved and restored {args.checkpoint} ({os.path.getsize(args.checkpoint):,} bytes)")
        params = restored

    forward = jax.jit(lm.apply)  # the full forward pass (no cache)
    decode = jax.jit(lm.apply, donate_argnums=(3,))  # with the KV cache, updated in place

    # The same params as a plain Python loop over blocks: unstack the layer axis.
    window = np.asarray(val_data[: args.seq_len])
    per_layer = stackwise.unstack_layers(lm.blocks_of(params))
    loop_logits = jax.jit(lm.loop_apply)(per_layer, params, window[None])
    stacked_logits, _ = forward(params, window[None], jnp.arange(len(window)))
    result["loop_diff"] = float(jnp.abs(loop_logits - stacked_logits).max())
    log(
        f"unstacked into {len(per_layer)} per-layer trees; the Python loop's logits match the "
        f"stack's to {result['loop_diff']:.1e}"
    )
    # Cached decoding computes the same logits as the full forward.
    t0 = time.perf_counter()
    result["cache_diff"] = cached_vs_full(forward, decode, lm, params, window, len(window) // 2)
    result["decode_check_s"] = time.perf_counter() - t0
    log(f"KV-cached decoding matches the full forward to {result['cache_diff']:.1e}")
    for name in ("loop_diff", "cache_diff"):
        if not result[name] <= LOGITS_ATOL:
            raise RuntimeError(f"{name} = {result[name]:.2e} exceeds {LOGITS_ATOL}")

    # Sample, printing each character as it comes.
    prompt = encode(chars, args.prompt)
    log(f"\n--- sample ({args.sample_len} characters, temperature {args.temperature}) ---")
    sys.stdout.write(args.prompt)

    def emit(token: int) -> None:
        sys.stdout.write(chars[token])
        sys.stdout.flush()

    t0 = time.perf_counter()
    key = jax.random.key(args.seed + 3)
    sample = generate(decode, lm, params, prompt, args.sample_len, key, args.temperature, emit)
    result["sample_chars_per_s"] = args.sample_len / (time.perf_counter() - t0)
    log(f"\n--- {result['sample_chars_per_s']:.0f} characters/s")
    result["sample"] = args.prompt + "".join(chars[t] for t in sample)
    result["total_s"] = time.perf_counter() - start
    log(f"done in {result['total_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
