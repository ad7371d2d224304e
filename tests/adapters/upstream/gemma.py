"""Flax's Gemma example (NNX), as upstream wrote it, in one file (a test fixture).

Source: https://github.com/google/flax, directory examples/gemma (Copyright 2024 The
Flax Authors, Apache License 2.0), files at these commits:

- layers.py: 0eeab5aa900aacc87cf36cd2e66e4ff102ee31c0 (Einsum, RMSNorm);
- positional_embeddings.py: f3c115183d9f82db3afefaddc7ab9743cbf2f667 (apply_rope);
- sow_lib.py: 17fc6810792ed469f11d5cc8073a3f1d52ee8a77 (SowConfig; the intermediates
  dataclasses are left out);
- modules.py: 97ed31e47ebeacd913545cf69d6dcbc7712d5d63 (Embedder, Attention,
  FeedForward, Block);
- helpers.py: 18f8f311c275d57f46d95e41b15aa97b454754c0 (module_from_linen_variables);
- transformer.py: 031d745ac98d263735c211b383a15b1cd3b3e4ed (TransformerConfig without
  the named model sizes and `from_path`; the linen-name mapping; Transformer without
  `init_intermediates`, its `from_params` taking the config; make_causal_attn_mask,
  build_positions_from_mask).

Copied unchanged but for 4-space indentation, line breaks, `jaxtyping`'s `Array` written
`jax.Array`, and one edit the installed flax needs: `Transformer.layers` is an
`nnx.List` (flax >= 0.12 refuses a plain list of modules as a module attribute).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
ArrayLike = jax.typing.ArrayLike

# --------------------------------------------------------------------------
# layers.py


Shape = Sequence[int | Any]


class Einsum(nnx.Module):
    """Einsum is a convenience module for parameterized tensor multiplication."""

    def __init__(self, einsum_str: str, shape: Shape, *, rngs: nnx.Rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(nn.initializers.normal()(rngs.params(), shape))

    def __call__(self, x: ArrayLike) -> Array:
        return jnp.einsum(self.einsum_str, x, self.w.value)

    @property
    def shape(self) -> Shape:
        return self.w.value.shape


class RMSNorm(nnx.Module):
    """RMSNorm layer."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(nn.initializers.zeros_init()(rngs.params(), dim))

    def __call__(self, x: Array) -> Array:
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed_inputs = jnp.asarray(x * jnp.reciprocal(jnp.sqrt(var + 1e-06)))
        # normed_inputs is a rank-K tensor, K > 1 (K is typically 2 or 3). scale is
        # a rank-1 tensor. To avoid implicit rank-promotion, reshape scale to
        # a (1, ..., 1, D) tensor, so the rank of scale matches normed_inputs.
        scale = jnp.expand_dims(self.scale.value, axis=range(len(x.shape) - 1))
        normed_inputs = normed_inputs * (1 + scale)
        return normed_inputs


# --------------------------------------------------------------------------
# positional_embeddings.py

_MAX_WAVELENGTH = 10_000


def apply_rope(
    inputs: jax.Array,  # [B, L]
    positions: jax.Array,  # [B, L]
    head_dim: int,
    max_wavelength: int = _MAX_WAVELENGTH,
    scale_factor: float = 1.0,
) -> jax.Array:
    """Applies RoPE."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction

    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    if scale_factor < 1.0:
        raise ValueError(f"scale_factor must be >= 1.0, got {scale_factor}")
    sinusoid_inp /= scale_factor

    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)

    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    out = jnp.concatenate([first_part, second_part], axis=-1)
    return out.astype(inputs.dtype)


# --------------------------------------------------------------------------
# sow_lib.py


@dataclasses.dataclass(frozen=True)
class SowConfig:
    """Module for sowing intermediate activations."""

    # Whether to sow embeddings.
    embeddings: bool = False

    # Whether to sow activations after each attention block (in residual stream).
    rs_after_attention: bool = False

    # Whether to sow activations after each FFW block (in residual stream).
    # This is the same as the residual stream activations after a whole layer.
    rs_after_ffw: bool = False

    # If non-zero, top-k activations in a ffw hidden layer are sowed.
    # We use a sparse representation here to save memory.
    mlp_hidden_topk: int = 0

    # If non-zero, top-k attention logits are sowed.
    # We use a sparse representation here to save memory.
    attn_logits_topk: int = 0

    def maybe_sow_embeddings(self, embeddings: jax.Array, module: nnx.Module):
        """Sows embeddings if configured."""
        if self.embeddings:
            module.sow(nnx.Intermediate, "embeddings", embeddings)

    def maybe_sow_rs_after_attention(self, activations: jax.Array, module: nnx.Module):
        """Sows activations after attention if configured."""
        if self.rs_after_attention:
            module.sow(nnx.Intermediate, "rs_after_attention", activations)

    def maybe_sow_rs_after_ffw(self, activations: jax.Array, module: nnx.Module):
        """Sows activations after FFW if configured."""
        if self.rs_after_ffw:
            module.sow(nnx.Intermediate, "rs_after_ffw", activations)

    def maybe_sow_mlp_hidden_topk(self, activations: jax.Array, module: nnx.Module):
        """Sows top-absolute-k activations in a mlp hidden layer if configured."""
        if self.mlp_hidden_topk:
            _, indices = jax.lax.top_k(jnp.abs(activations), self.mlp_hidden_topk)
            values = jnp.take_along_axis(activations, indices, axis=-1)
            module.sow(nnx.Intermediate, "hidden_topk_values", values)
            module.sow(nnx.Intermediate, "hidden_topk_indices", indices)

    def maybe_sow_attn_logits_topk(self, logits: jax.Array, module: nnx.Module):
        """Sows top-k attention logits if configured."""
        if self.attn_logits_topk:
            values, indices = jax.lax.top_k(logits, self.attn_logits_topk)
            module.sow(nnx.Intermediate, "logits_topk_values", values)
            module.sow(nnx.Intermediate, "logits_topk_indices", indices)


# --------------------------------------------------------------------------
# modules.py

LayerCache = dict[str, Array]

K_MASK = -2.3819763e38  # Set to a large negative number.
DEFAULT_ROPE_BASE_FREQUENCY = 10_000
DEFAULT_ROPE_SCALE_FACTOR = 1.0


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


class Embedder(nnx.Module):
    """Embedder module."""

    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.input_embedding = nnx.Param(
            nn.initializers.normal()(rngs.params(), (vocab_size, embed_dim))
        )

    def encode(self, x: ArrayLike) -> Array:
        x = self.input_embedding[(x,)]
        x *= jnp.sqrt(x.shape[-1]).astype(x.dtype)
        return x

    def decode(self, x: ArrayLike) -> Array:
        return jnp.dot(x, self.input_embedding.value.T)

    @property
    def embed_dim(self):
        return self.input_embedding.value.shape[1]

    @property
    def num_embed(self):
        return self.input_embedding.value.shape[0]


class Attention(nnx.Module):
    """Attention module."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        features: int,
        head_dim: int,
        query_pre_attn_scalar: float,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        rope_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY,
        rope_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR,
        attn_logits_soft_cap: float | None = None,
        sliding_window_size: int | None = None,
        use_qk_norm: bool = False,
        sow_config: SowConfig = SowConfig(),  # noqa: B008 (upstream's default)
    ):
        if attn_type == AttentionType.LOCAL_SLIDING and sliding_window_size is None:
            raise ValueError("`sliding_window_size` must be set if `attn_type` is Local Sliding.")

        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_type = attn_type
        self.sliding_window_size = sliding_window_size
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.attn_vec_einsum = Einsum(
            einsum_str="BTNH,NHD->BTD",
            shape=(num_heads, head_dim, features),
            rngs=rngs,
        )
        self.rope_base_frequency = rope_base_frequency
        self.rope_scale_factor = rope_scale_factor
        self.use_qk_norm = use_qk_norm
        self.sow_config = sow_config

        if num_heads == num_kv_heads:
            self.qkv_einsum = Einsum(
                einsum_str="BTD,SNDH->SBTNH",
                shape=(3, num_heads, features, head_dim),
                rngs=rngs,
            )
        else:
            self.q_einsum = Einsum(
                einsum_str="BTD,NDH->BTNH",
                shape=(num_heads, features, head_dim),
                rngs=rngs,
            )
            self.kv_einsum = Einsum(
                einsum_str="BSD,CKDH->CBSKH",
                shape=(2, num_kv_heads, features, head_dim),
                rngs=rngs,
            )
        if self.use_qk_norm:
            self._query_norm = RMSNorm(head_dim, rngs=rngs)
            self._key_norm = RMSNorm(head_dim, rngs=rngs)

    def __call__(
        self,
        x: Array,
        segment_pos: Array,
        cache: LayerCache | None,
        attn_mask: Array,
    ) -> tuple[LayerCache | None, Array]:
        seq_len = x.shape[1]

        if self.use_qkv_einsum:
            query_proj, key_proj, value_proj = self.qkv_einsum(x)
        else:
            query_proj = self.q_einsum(x)
            key_proj, value_proj = self.kv_einsum(x)

        if self.use_qk_norm:
            query_proj = self._query_norm(query_proj)
            key_proj = self._key_norm(key_proj)

        query_proj = apply_rope(
            query_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(
            key_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )

        # Cache is left aligned.
        if cache is not None:
            end_index = cache["end_index"][0]
            slice_indices = (0, end_index % cache["v"].shape[1], 0, 0)
            value_proj = jax.lax.dynamic_update_slice(
                cache["v"],
                value_proj,
                slice_indices,
            )
            key_proj = jax.lax.dynamic_update_slice(cache["k"], key_proj, slice_indices)

        logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)

        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap)
            logits = logits * self.attn_logits_soft_cap
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            if self.sliding_window_size is None:
                raise ValueError("sliding_window_size must be set if attn_type is Local Sliding.")

            all_ones = jnp.ones_like(attn_mask)
            sliding_mask = jnp.triu(all_ones, -1 * self.sliding_window_size + 1) * jnp.tril(
                all_ones, self.sliding_window_size - 1
            )
            attn_mask = sliding_mask * attn_mask

        padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
        self.sow_config.maybe_sow_attn_logits_topk(padded_logits, self)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
        attn_output = self.attn_vec_einsum(encoded)

        if cache is not None:
            new_cache = {
                "v": value_proj,
                "k": key_proj,
                "end_index": cache["end_index"] + seq_len,
            }
        else:
            new_cache = None

        return new_cache, attn_output

    @property
    def head_dim(self):
        return self.attn_vec_einsum.shape[1]

    @property
    def num_heads(self):
        return self.qkv_einsum.shape[1] if self.use_qkv_einsum else self.q_einsum.shape[0]

    @property
    def num_kv_heads(self):
        return self.qkv_einsum.shape[1] if self.use_qkv_einsum else self.kv_einsum.shape[1]

    @property
    def use_qkv_einsum(self):
        return hasattr(self, "qkv_einsum") and self.qkv_einsum is not None

    def init_cache(
        self,
        cache_size: int,
        batch_size: int,
        dtype: jnp.dtype = jnp.bfloat16,
    ) -> LayerCache:
        return {
            "v": jnp.zeros(
                (batch_size, cache_size, self.num_kv_heads, self.head_dim),
                dtype=dtype,
            ),
            "k": jnp.zeros(
                (batch_size, cache_size, self.num_kv_heads, self.head_dim),
                dtype=dtype,
            ),
            "end_index": jnp.zeros((batch_size,), dtype=jnp.int32),
        }


class FeedForward(nnx.Module):
    """Feed forward module."""

    def __init__(
        self,
        features: int,
        hidden_dim: int,
        *,
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),  # noqa: B008 (upstream's default)
    ):
        self.gate_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=nn.initializers.normal(),
        )
        self.up_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=nn.initializers.normal(),
        )
        self.down_proj = nnx.Linear(
            in_features=hidden_dim,
            out_features=features,
            use_bias=False,
            rngs=rngs,
            kernel_init=nn.initializers.normal(),
        )
        self.sow_config = sow_config

    def __call__(self, x: ArrayLike) -> Array:
        ff_gate = self.gate_proj(x)
        gate_value = nnx.gelu(ff_gate)

        ff1 = self.up_proj(x)
        activations = gate_value * ff1
        self.sow_config.maybe_sow_mlp_hidden_topk(activations, self)

        outputs = self.down_proj(activations)
        return outputs


class Block(nnx.Module):
    """Transformer block."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        embed_dim: int,
        head_dim: int,
        hidden_dim: int,
        use_post_attn_norm: bool,
        use_post_ffw_norm: bool,
        query_pre_attn_scalar: float,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        rope_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY,
        rope_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR,
        attn_logits_soft_cap: float | None = None,
        sliding_window_size: int | None = None,
        use_qk_norm: bool = False,
        sow_config: SowConfig = SowConfig(),  # noqa: B008 (upstream's default)
    ):
        self.pre_attention_norm = RMSNorm(embed_dim, rngs=rngs)
        self.attn = Attention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            features=embed_dim,
            head_dim=head_dim,
            query_pre_attn_scalar=query_pre_attn_scalar,
            attn_type=attn_type,
            rope_base_frequency=rope_base_frequency,
            rope_scale_factor=rope_scale_factor,
            attn_logits_soft_cap=attn_logits_soft_cap,
            sliding_window_size=sliding_window_size,
            rngs=rngs,
            use_qk_norm=use_qk_norm,
            sow_config=sow_config,
        )
        if use_post_attn_norm:
            self.post_attention_norm = RMSNorm(embed_dim, rngs=rngs)
        else:
            self.post_attention_norm = None

        self.pre_ffw_norm = RMSNorm(embed_dim, rngs=rngs)
        self.mlp = FeedForward(
            features=embed_dim,
            hidden_dim=hidden_dim,
            rngs=rngs,
            sow_config=sow_config,
        )
        if use_post_ffw_norm:
            self.post_ffw_norm = RMSNorm(embed_dim, rngs=rngs)
        else:
            self.post_ffw_norm = None
        self.sow_config = sow_config

    def __call__(
        self,
        x: jax.Array,
        segment_pos: jax.Array,
        cache: LayerCache | None,
        attn_mask: jax.Array,
    ) -> tuple[LayerCache | None, jax.Array]:
        # Attention.
        attn_inputs = self.pre_attention_norm(x)
        cache, attn_output = self.attn(
            attn_inputs,
            segment_pos,
            cache,
            attn_mask,
        )
        if self.post_attention_norm is not None:
            attn_output = self.post_attention_norm(attn_output)
        x += attn_output
        self.sow_config.maybe_sow_rs_after_attention(x, self)

        # Feed forward.
        ffw_inputs = self.pre_ffw_norm(x)
        ffw_outputs = self.mlp(ffw_inputs)
        if self.post_ffw_norm is not None:
            ffw_outputs = self.post_ffw_norm(ffw_outputs)
        x += ffw_outputs
        self.sow_config.maybe_sow_rs_after_ffw(x, self)

        return cache, x

    def init_cache(
        self,
        cache_size: int,
        batch_size: int,
        dtype: jnp.dtype = jnp.bfloat16,
    ) -> LayerCache:
        return self.attn.init_cache(
            cache_size=cache_size,
            batch_size=batch_size,
            dtype=dtype,
        )


# --------------------------------------------------------------------------
# helpers.py


def _flatten_path(path: tuple[str | int, ...]) -> str:
    def f(item) -> str:
        if isinstance(item, str):
            return f"{item}"
        elif isinstance(item, int):
            return f"[{item}]"
        else:
            raise ValueError(f"Unexpected type {type(item)}")

    return ".".join([f(item) for item in path]).replace(".[", "[")


def module_from_linen_variables(
    module_factory: Callable[[], nnx.Module],
    variables: Any,
    map_key_fn: None | (Callable[[tuple[str, ...]], tuple[str | int, ...]]) = None,
    assign_val_fn: None
    | (
        Callable[
            [dict[tuple[str, ...], Any], tuple[str | int, ...], Any],
            dict[tuple[str, ...], Any],
        ]
    ) = None,
) -> nnx.Module:
    """Returns an `nnx.Module` initialized with the `variables` of a linen module."""
    if map_key_fn is None:

        def map_key_fn(path: tuple[str, ...]) -> tuple[str | int, ...]:
            return path[1:] if "params" in variables else path

    if assign_val_fn is None:

        def assign_val_fn(
            state: dict[tuple[str, ...], Any],
            mapped_path: tuple[str | int, ...],
            val: Any,
        ) -> dict[tuple[str, ...], Any]:
            state[mapped_path].set_value(val)
            return state

    mdl = nnx.eval_shape(module_factory)
    graph_def, state = nnx.split(mdl)
    state = dict(nnx.to_flat_state(state))
    for path, val in flax.traverse_util.flatten_dict(variables).items():
        mapped_path = map_key_fn(path)
        if mapped_path not in state:
            raise ValueError(
                f"'{mdl.__class__.__name__}.{_flatten_path(mapped_path)}' doesn't "
                f" exist (original path={path})."
            )
        state = assign_val_fn(state, mapped_path, val)
    state = nnx.from_flat_state(state)

    return nnx.merge(graph_def, state)


# --------------------------------------------------------------------------
# transformer.py


def make_attention_layers_types(
    pattern: tuple[AttentionType, ...],
    num_layers: int,
) -> tuple[AttentionType, ...]:
    """Returns the list of attention types for every layers."""

    pattern_size = len(pattern)
    out = pattern * (num_layers // pattern_size)
    if num_layers % pattern_size != 0:
        out += pattern[: num_layers % pattern_size]
    return tuple(out)


class QueryPreAttentionNormalisation(enum.Enum):
    """Initialization strategy."""

    # Whether to scale the query by 1/sqrt(head_dim)
    BY_ONE_OVER_SQRT_HEAD_DIM = enum.auto()

    # Whether to scale the query by `embed_dim // num_heads`
    BY_EMBED_DIM_DIV_NUM_HEADS = enum.auto()

    # Whether to scale the query by `1/sqrt(embed_dim // num_heads)`
    BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS = enum.auto()


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Configuration for the gemma transformer."""

    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    final_logit_softcap: float | None
    use_post_attn_norm: bool
    use_post_ffw_norm: bool
    attention_types: Iterable[AttentionType]
    query_pre_attn_norm: QueryPreAttentionNormalisation = (
        QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    )
    attn_logits_soft_cap: float | None = None
    transpose_gating_einsum: bool = False
    local_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    global_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    local_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    global_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    use_qk_norm: bool = False
    sliding_window_size: int | None = None

    def query_pre_attn_scalar(self) -> float:
        """Returns the scalar to multiply the query by before attention."""
        match self.query_pre_attn_norm:
            case QueryPreAttentionNormalisation.BY_EMBED_DIM_DIV_NUM_HEADS:
                return self.embed_dim // self.num_heads
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:
                return (self.embed_dim // self.num_heads) ** -0.5
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM | _:
                return self.head_dim**-0.5


def _map_linen_var_names(key: tuple[str, ...]) -> tuple[str | int, ...]:
    """Maps linen variable names to nnx variable names."""
    new_key = []
    for k in key:
        if k.startswith("layer_"):
            prefix, suffix = k.split("layer_")
            assert not prefix, prefix
            new_key.append("layers")
            new_key.append(int(suffix))
        elif k == "gating_einsum":
            new_key.append("gate_proj")
            new_key.append("kernel")
        elif k == "linear":
            new_key.append("down_proj")
            new_key.append("kernel")
        else:
            new_key.append(k)

    return tuple(new_key)


def _assign_linen_params_to_nnx_state(
    state: dict[tuple[str, ...], Any],
    mapped_path: tuple[str | int, ...],
    val: Any,
    transpose_gating_einsum: bool,
) -> dict[tuple[str, ...], Any]:
    """Splits and maybe transposes gate_proj."""
    if "gate_proj" in mapped_path:
        if transpose_gating_einsum:
            val = jnp.swapaxes(val, 1, 2)
        state[mapped_path].value = val[0]
        state[mapped_path[:-2] + ("up_proj", "kernel")].value = val[1]
    else:
        state[mapped_path].value = val
    return state


class Transformer(nnx.Module):
    """Gemma transformer."""

    @classmethod
    def from_params(
        cls,
        params: dict,
        config: TransformerConfig,
        sow_config: SowConfig = SowConfig(),  # noqa: B008 (upstream's default)
    ) -> Transformer:
        assign_val_fn = functools.partial(
            _assign_linen_params_to_nnx_state,
            transpose_gating_einsum=config.transpose_gating_einsum,
        )
        return module_from_linen_variables(
            module_factory=lambda: cls(config, rngs=nnx.Rngs(params=0), sow_config=sow_config),
            variables=params["transformer"],
            map_key_fn=_map_linen_var_names,
            assign_val_fn=assign_val_fn,
        )

    def __init__(
        self,
        config: TransformerConfig,
        *,
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),  # noqa: B008 (upstream's default)
    ):
        self.embedder = Embedder(
            vocab_size=config.num_embed,
            embed_dim=config.embed_dim,
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                Block(
                    num_heads=config.num_heads,
                    num_kv_heads=config.num_kv_heads,
                    embed_dim=config.embed_dim,
                    head_dim=config.head_dim,
                    hidden_dim=config.hidden_dim,
                    sliding_window_size=config.sliding_window_size,
                    use_post_attn_norm=config.use_post_attn_norm,
                    use_post_ffw_norm=config.use_post_ffw_norm,
                    attn_logits_soft_cap=config.attn_logits_soft_cap,
                    attn_type=attn_type,
                    query_pre_attn_scalar=config.query_pre_attn_scalar(),
                    rngs=rngs,
                    rope_base_frequency=config.local_base_frequency
                    if attn_type == AttentionType.LOCAL_SLIDING
                    else config.global_base_frequency,
                    rope_scale_factor=config.local_scale_factor
                    if attn_type == AttentionType.LOCAL_SLIDING
                    else config.global_scale_factor,
                    use_qk_norm=config.use_qk_norm,
                    sow_config=sow_config,
                )
                for _, attn_type in zip(range(config.num_layers), config.attention_types)
            ]
        )
        self.final_norm = RMSNorm(config.embed_dim, rngs=rngs)
        self.final_logits_softcap = config.final_logit_softcap
        self.sow_config = sow_config

    def __call__(
        self,
        last_tokens: Array,  # [B, L]
        positions: Array,  # [B, L]
        cache: dict[str, LayerCache] | None,  # (sequence length L')
        attention_mask: Array,  # [B, L, L']
    ) -> tuple[Array, dict[str, LayerCache] | None]:
        """Transformer forward pass (returns predicted_logits, new_cache)."""
        new_cache = None if cache is None else {}
        x = self.embedder.encode(last_tokens)
        self.sow_config.maybe_sow_embeddings(x, self)
        for i, layer in enumerate(self.layers):
            layer_name = f"layer_{i}"
            layer_cache = cache[layer_name] if cache else None
            layer_cache, x = layer(
                x,
                positions,
                layer_cache,
                attention_mask,
            )
            if cache is not None:
                new_cache[layer_name] = layer_cache

        x = self.final_norm(x)
        logits = self.embedder.decode(x)

        if self.final_logits_softcap is not None:
            logits /= self.final_logits_softcap
            logits = jnp.tanh(logits) * self.final_logits_softcap

        return logits, new_cache

    @property
    def embed_dim(self) -> int:
        return self.embedder.embed_dim

    @property
    def num_embed(self) -> int:
        return self.embedder.num_embed

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def init_cache(
        self,
        cache_size: int,
        batch_size: int,
        dtype: jnp.dtype = jnp.bfloat16,
    ) -> dict[str, LayerCache]:
        """Initializes a new Transformer cache."""
        return {
            f"layer_{i}": self.layers[i].init_cache(
                cache_size=cache_size,
                batch_size=batch_size,
                dtype=dtype,
            )
            for i in range(self.num_layers)
        }


def make_causal_attn_mask(input_mask: Array) -> Array:
    """Attention mask in batch mode."""
    seq_len = input_mask.shape[-1]
    attn_mask = input_mask[..., None, :]
    causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
    # Prefixes can be attended by all tokens
    attn_mask *= causal_mask[None, ...]
    return attn_mask


def build_positions_from_mask(input_mask: Array) -> Array:
    """Computes the `positions` from the `input_mask`."""
    positions = jnp.cumsum(input_mask, axis=-1)
    # Subtract one for all positions from the first valid one as they are
    # 0-indexed
    return positions - (positions >= 1)
