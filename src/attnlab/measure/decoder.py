"""A small decoder-only transformer in plain torch, for profiling a real prefill.

Random weights, no downloads, no transformers dependency: the layer is the common
Llama-style block (RMSNorm -> Q/K/V projections -> RoPE -> attention -> output
projection, RMSNorm -> SwiGLU MLP).  The attention core is a parameter, so the same
model runs once with eager attention and once with attnlab's kernel, and everything
else stays byte-for-byte the same.

The attention core always runs inside ``torch.profiler.record_function("attention")``:
that scope is how :mod:`attnlab.measure.profile` attributes the eager path's batched
matrix multiplies (which have GEMM kernel names) to attention rather than to the MLP.
Only the core (QK^T, mask, softmax, PV) is inside it; the projections are not, to
match the lesson's split of prefill time into attention and MLP/norms/projections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from attnlab.checks import check_int

# Scope name the classifier's default ``attention_scopes`` pattern matches exactly.
ATTENTION_SCOPE = "attention"

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the decoder.  ``head_dim * query_heads`` need not equal ``hidden``."""

    layers: int = 8
    hidden: int = 2048
    query_heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    mlp_hidden: int = 5632
    vocab: int = 32000
    prompt_tokens: int = 4096
    batch: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check_int(f"DecoderConfig.{name}", value, minimum=1)
        if self.query_heads % self.kv_heads:
            raise ValueError(f"DecoderConfig.kv_heads ({self.kv_heads}) must divide "
                             f"query_heads ({self.query_heads})")

    def parameters(self) -> int:
        """Weights in the model (embedding and LM head untied)."""
        attention = self.hidden * self.head_dim * (2 * self.query_heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.mlp_hidden
        norms = 2 * self.hidden
        return self.layers * (attention + mlp + norms) + 2 * self.vocab * self.hidden + self.hidden

    def as_dict(self) -> dict:
        return asdict(self)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as eager PyTorch code writes it, in the bhsd layout.

    The naive path the lesson starts from: GQA expanded by copying, the full score
    matrix materialised, masked, soft-maxed in FP32 and multiplied by V.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    # Bottom-right alignment (query i sees keys <= i + seqlen_k - seqlen_q), as attnlab's API.
    future = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).triu(
        seqlen_k - seqlen_q + 1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def attnlab_attention(impl: str = "triton") -> AttentionCore:
    """attnlab's public ``attention`` (bhsd layout) as an attention core."""
    from attnlab.api import attention

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, causal=True, enable_gqa=k.shape[1] != q.shape[1], impl=impl)

    return core


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary_tables(tokens: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inverse_frequency = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(tokens, dtype=torch.float64), inverse_frequency)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden, config.head_dim
        self.attention_norm = RMSNorm(h)
        self.q_proj = nn.Linear(h, config.query_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.query_heads * d, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, config.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(h, config.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_core: AttentionCore) -> torch.Tensor:
        c = self.config
        batch, tokens, _ = x.shape
        normed = self.attention_norm(x)
        # bshd from the projections, then bhsd for the core (SDPA layout).
        q = self.q_proj(normed).view(batch, tokens, c.query_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(normed).view(batch, tokens, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(normed).view(batch, tokens, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        with torch.profiler.record_function(ATTENTION_SCOPE):
            attended = attention_core(q, k, v)
        attended = attended.transpose(1, 2).reshape(batch, tokens, c.query_heads * c.head_dim)
        x = x + self.o_proj(attended)
        normed = self.mlp_norm(x)
        mlp = self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))
        return x + mlp


class Decoder(nn.Module):
    """Embedding -> layers -> final norm -> LM head on the last position.

    Logits only for the last position, as serving engines compute in prefill: the
    next token needs nothing else, and a full (tokens x vocab) GEMM would inflate the
    non-attention share with work a server does not do.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))
        self.final_norm = RMSNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        cos, sin = rotary_tables(config.prompt_tokens, config.head_dim)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, attention_core: AttentionCore) -> torch.Tensor:
        length = tokens.shape[1]
        cos = self.rotary_cos[:length].to(self.embed.weight.dtype)
        sin = self.rotary_sin[:length].to(self.embed.weight.dtype)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, attention_core)
        return self.lm_head(self.final_norm(x[:, -1:, :]))


def build_decoder(config: DecoderConfig, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, seed: int = 0) -> Decoder:
    """The decoder with random weights (std 0.02, the usual initialisation), in eval mode.

    Built directly on ``device`` (initialising 0.9B parameters on a GPU takes
    milliseconds, on the CPU tens of seconds) with its own generator, so the global
    RNG state is left alone.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Decoder(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:  # norms keep their identity initialisation
                parameter.normal_(0.0, 0.02, generator=generator)
    return model.to(dtype=dtype).eval()


def prompt(config: DecoderConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab, (config.batch, config.prompt_tokens), generator=generator)
    return ids.to(device)


def attention_flops(config: DecoderConfig) -> int:
    """Causal attention FLOPs of one prefill (QK^T and PV over the visible pairs only)."""
    tokens = config.prompt_tokens
    visible_pairs = tokens * (tokens + 1) // 2
    return 4 * config.batch * config.layers * config.query_heads * config.head_dim * visible_pairs


def describe(config: DecoderConfig) -> str:
    return (f"{config.layers} layers, hidden {config.hidden}, {config.query_heads} query / "
            f"{config.kv_heads} KV heads x d={config.head_dim}, MLP {config.mlp_hidden}, "
            f"{config.prompt_tokens} prompt tokens, batch {config.batch}, "
            f"{_count(config.parameters())} parameters")


def _count(parameters: int) -> str:
    if parameters >= 10**9:
        return f"{parameters / 1e9:.2f}B"
    return f"{parameters / 1e6:.2f}M"


__all__ = ["ATTENTION_SCOPE", "Decoder", "DecoderConfig", "attention_flops", "attnlab_attention",
           "build_decoder", "describe", "eager_attention", "prompt"]
