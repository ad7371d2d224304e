"""What ``stackwise-bench`` measures (:class:`BenchConfig`), what it records (:class:`Result`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: The dtypes the decode and prefill blocks run in (:attr:`BenchConfig.dec_dtype`).
DEC_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure. The defaults are the full run; :meth:`quick` is the smoke run.

    Attributes:
      blocks: which blocks to run (the names in ``stackwise.bench.workloads.BLOCKS``:
        ``"mlp"``, ``"transformer"``, ``"decode"``, ``"prefill"``, ``"pattern"``).
      ns: the depths for the ``mlp`` block.
      transformer_ns: the depths for the ``transformer`` block.
      decode_ns, prefill_ns, pattern_ns: the depths for the ``decode``, ``prefill`` and
        ``pattern`` blocks.
      d, hidden, batch: the ``mlp`` block's sizes (and the ``pattern`` block's: its
        ``a`` blocks have ``hidden`` units).
      tf_d, tf_hidden, tf_heads, tf_seq, tf_batch: the ``transformer`` block's sizes.
      dec_d, dec_heads, dec_batch, dec_cache: the attention layer of the ``decode`` and
        ``prefill`` blocks and its KV cache (``dec_cache`` positions per layer).
      dec_prompt: the prompt's length: ``prefill`` writes that many tokens in one call,
        ``decode`` one token at that position.
      dec_dtype: the ``decode`` and ``prefill`` blocks' floating dtype (:data:`DEC_DTYPES`):
        every row's params, cache and tokens are made in float32 and cast to it, so a
        layer computes in it.
      pattern_hidden: the hidden size of the ``pattern`` block's ``b`` blocks.
      rounds: timed rounds per depth (each times every variant once).
      compile_repeats: cold compiles per variant and depth (the fastest is reported).
      warmup: compile every variant once at a tiny depth first (not recorded).
      one_at_a_time: measure the variants of a depth one after another, each built,
        compiled, timed and freed before the next is built, so that the device holds one
        variant's params and state at a time (for sizes where a depth's variants do not
        fit together); its rounds are then not interleaved with the other variants'.
      variants: run only the variants whose name contains one of these strings, or whose
        framework (``jax``, ``haiku``, ``flax``, ``nnx``) is one of them (empty: all).
      seed: the PRNG seed of params and inputs, and of the measuring order.
      smoke: a smoke run, for speed, not for figures: compile at XLA's backend
        optimisation level 0 (a third of the time or less; the code runs slower), and
        compile warm (no clearing of JAX's caches and no garbage collection before each).

    A block's depths are the field its ``stackwise.bench.workloads.BLOCKS`` entry names.
    """

    blocks: tuple[str, ...] = ("mlp", "transformer", "decode", "prefill", "pattern")
    ns: tuple[int, ...] = (8, 24, 48, 96)
    transformer_ns: tuple[int, ...] = (8,)
    decode_ns: tuple[int, ...] = (24,)
    prefill_ns: tuple[int, ...] = (24,)
    pattern_ns: tuple[int, ...] = (6, 26, 60)
    d: int = 256
    hidden: int = 512
    batch: int = 64
    tf_d: int = 128
    tf_hidden: int = 512
    tf_heads: int = 4
    tf_seq: int = 32
    tf_batch: int = 8
    dec_d: int = 256
    dec_heads: int = 4
    dec_batch: int = 8
    dec_cache: int = 512
    dec_prompt: int = 64
    dec_dtype: str = "float32"
    pattern_hidden: int = 1024
    rounds: int = 7
    compile_repeats: int = 1
    warmup: bool = True
    one_at_a_time: bool = False
    variants: tuple[str, ...] = ()
    seed: int = 0
    smoke: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """A smoke run (compile-bound: a minute or two): the ``mlp`` and ``pattern`` blocks
        (every variant, the Equinox rows included; pass ``blocks`` for others), tiny sizes, two
        depths each, two rounds, no warm-up, fast, warm compiles (:attr:`smoke`).

        The numbers mean little (the first compile of each framework pays its one-time
        costs, the code is less optimised); it checks that everything runs and writes its
        outputs.

        >>> BenchConfig.quick().blocks, BenchConfig.quick().ns
        (('mlp', 'pattern'), (2, 4))
        """
        small = dict(
            blocks=("mlp", "pattern"), smoke=True,
            ns=(2, 4), transformer_ns=(2,), decode_ns=(2,), prefill_ns=(2,), pattern_ns=(3, 5),
            d=16, hidden=32, batch=4, tf_d=16, tf_hidden=32, tf_heads=2, tf_seq=8, tf_batch=2,
            dec_d=16, dec_heads=2, dec_batch=2, dec_cache=16, dec_prompt=4, pattern_hidden=48,
            rounds=2, compile_repeats=1, warmup=False,
        )
        return cls(**{**small, **overrides})


@dataclasses.dataclass
class Result:
    """One variant at one depth. Times in seconds, sizes in bytes / characters.

    ``*_vs_scan``, ``*_vs_loop`` and ``*_vs_tool`` are paired ratios to the hand-written
    scan, the Python loop and (for an adapter) its framework's tool with the same remat,
    at the same depth in the same run (:func:`stackwise.bench.stats.paired_ratio`).
    """

    block: str
    n: int
    framework: str
    variant: str
    remat: str
    compile_s: float = math.nan  # the fastest of the cold compiles
    step_s: float = math.nan  # the median of the steady-state calls
    trace_s: float = math.nan  # the tracing + lowering part of compile_s (fastest)
    temp_bytes: int = -1
    state_bytes: int = -1  # the state a step donates and returns (a KV cache), if any
    program_chars: int = -1
    barrier_param_bytes: int = -1
    barrier_const_bytes: int = -1
    barrier_ops: int = -1
    compile_vs_scan: float = math.nan
    compile_vs_loop: float = math.nan
    step_vs_scan: float = math.nan
    step_vs_loop: float = math.nan
    tool: str = ""
    compile_vs_tool: float = math.nan
    step_vs_tool: float = math.nan
    program_hash: str = ""  # program_fingerprint of the compiled program
    ops_unlike_tool: int = -1  # instructions not shared with the tool's program; 0: the same
    note: str = ""
    compile_samples: tuple[float, ...] = ()  # one per repeat, in order
    step_samples: tuple[float, ...] = ()  # one per round, in order
