"""The data: a UTF-8 text as int ids of its characters, training batches and validation windows."""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import argparse
import hashlib
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from lm.cli import UsageError

#: Validation: this many tokens, in evenly spaced windows of the validation text.
VAL_TOKENS = 8192


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

