"""A small decoder-only transformer for the runtime tests.

Odd sizes on purpose (no dimension is a multiple of another's bucket cut), 1-D norms and a bias,
an untied embedding and output head (which go to AdamW by the matrix rule), and a parameter that
receives no gradient unless ``use_dead`` is set.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

VOCAB = 61


class Block(nn.Module):

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim // 2, bias=False)
        self.v_proj = nn.Linear(dim, dim // 2, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=True)
        self.norm2 = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.heads // 2, -1).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.v_proj(h).view(b, t, self.heads // 2, -1).transpose(1, 2).repeat_interleave(2, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLM(nn.Module):

    def __init__(self, dim: int = 24, heads: int = 4, hidden: int = 44, layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def batches(step: int, micro: int, rank: int, world_size: int, micro_batch: int = 2, seq: int = 17) -> torch.Tensor:
    """The micro-batch that ``rank`` sees at (step, micro); a fixed function of its arguments.

    Sequences follow a simple learnable rule (token t+1 = token t + a per-sequence stride), so the
    loss can fall in a few steps.
    """
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    start = torch.randint(0, VOCAB, (micro_batch, 1), generator=g)
    stride = torch.randint(1, 4, (micro_batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % VOCAB


class TinyMoELM(nn.Module):
    """A decoder with a fused MoE expert stack, for the param-group and DeepSpeed-parity tests.

    The embedding and head go to AdamW by name; one attention block brings 1-D norms and a bias;
    a router mixes the experts softly (every expert gets a gradient) held as two 3-D stacks
    ``[experts, out, in]`` (Muon orthogonalises each expert on its own); ``unused`` never takes
    part in the forward, so it never gets a gradient. With ``conv`` a 4-D convolution filter
    joins (DeepSpeed 0.19.8's Muon crashes on one; ours must not).
    """

    def __init__(self, dim: int = 16, heads: int = 4, hidden: int = 24, experts: int = 4, expert_hidden: int = 32,
                 conv: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.block = Block(dim, heads, hidden)
        self.router = nn.Linear(dim, experts, bias=True)
        self.experts_up = nn.Parameter(torch.randn(experts, expert_hidden, dim) / dim**0.5)
        self.experts_down = nn.Parameter(torch.randn(experts, dim, expert_hidden) / expert_hidden**0.5)
        self.unused = nn.Linear(dim, dim)
        self.conv = nn.Conv2d(1, 2, 3, padding=1) if conv else None
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.block(self.embed_tokens(tokens[:, :-1]))
        if self.conv is not None:
            x = x + self.conv(x.unsqueeze(1)).mean(1)
        gate = torch.softmax(self.router(x), dim=-1)  # (batch, time, experts)
        h = F.silu(torch.einsum("btd,eod->bteo", x, self.experts_up))
        y = torch.einsum("bteo,edo->bted", h, self.experts_down)
        x = x + (gate.unsqueeze(-1) * y).sum(2)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_moe_model(seed: int = 0, **kwargs) -> TinyMoELM:
    torch.manual_seed(seed)
    return TinyMoELM(**kwargs)
