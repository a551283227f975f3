"""Small models for the runtime tests.

``TinyLM``: a decoder-only transformer with odd sizes on purpose (no dimension is a multiple of
another's bucket cut), 1-D norms and a bias, an untied embedding and output head (which go to
AdamW by the matrix rule). ``CheckpointedLM``: TinyLM's layers under activation checkpointing, with
a parameter used in every block and a branch that some steps skip. ``HFCausalLM``: a transformers
Qwen3 built from ``examples/configs/qwen3-tiny.json``, optionally with a tied embedding, HuggingFace
gradient checkpointing, and frozen weights with LoRA adapters.
"""

from __future__ import annotations

from pathlib import Path

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


# --------------------------------------------------------------------------- models whose gradients do not
# arrive exactly once per backward (tests/test_grad_arrival.py)

def uses_branch(step: int, rank: int) -> bool:
    """Whether ``CheckpointedLM.branch`` runs at (step, rank): on no rank at steps 0, 3, ..., on every
    rank at steps 1, 4, ..., and on rank 0 only at steps 2, 5, ..."""
    return step % 3 == 1 or (step % 3 == 2 and rank == 0)


class CheckpointedLM(nn.Module):
    """TinyLM's layers under activation checkpointing, with parameters whose gradients arrive irregularly.

    ``checkpoint``: "deepspeed" (``deepspeed.checkpointing.checkpoint``), "reentrant" or
    "non_reentrant" (``torch.utils.checkpoint``), or None. ``shared`` is one Linear applied inside
    every block: under a reentrant checkpoint each block's nested backward gives it a gradient, so it
    gets one per block. ``branch`` (if built) runs only when ``forward`` is told ``use_branch`` (see
    ``uses_branch``) and otherwise gets no gradient. ``shared_first`` registers ``shared`` before the
    embedding, so its bucket also waits for the embedding (the last gradient of backward); otherwise
    it comes last, alone in the first bucket to be reduced when buckets are small.
    """

    def __init__(self, checkpoint: str | None = "deepspeed", *, shared_first: bool = True, branch: bool = True,
                 dim: int = 24, heads: int = 4, hidden: int = 44, layers: int = 2):
        super().__init__()
        if shared_first:
            self.shared = nn.Linear(dim, dim, bias=False)
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.branch = nn.Linear(dim, dim, bias=True) if branch else None
        if not shared_first:
            self.shared = nn.Linear(dim, dim, bias=False)
        self.checkpoint = checkpoint

    def _block(self, layer: Block, x: torch.Tensor) -> torch.Tensor:
        return layer(x) + 0.5 * self.shared(x)

    def _run_block(self, layer: Block, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint == "deepspeed":
            from deepspeed import checkpointing
            return checkpointing.checkpoint(self._block, layer, x)
        if self.checkpoint in ("reentrant", "non_reentrant"):
            import torch.utils.checkpoint as torch_checkpoint
            return torch_checkpoint.checkpoint(self._block, layer, x, use_reentrant=self.checkpoint == "reentrant")
        return self._block(layer, x)

    def forward(self, tokens: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        x = self.embed_tokens(tokens[:, :-1])
        for layer in self.layers:
            x = self._run_block(layer, x)
        if use_branch:
            x = x + self.branch(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_moe_model(seed: int = 0, **kwargs) -> TinyMoELM:
    torch.manual_seed(seed)
    return TinyMoELM(**kwargs)


def make_checkpointed_model(seed: int = 0, **kwargs) -> CheckpointedLM:
    torch.manual_seed(seed)
    return CheckpointedLM(**kwargs)


QWEN3_TINY_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "qwen3-tiny.json"


class HFCausalLM(nn.Module):
    """A transformers Qwen3ForCausalLM built from ``examples/configs/qwen3-tiny.json`` (no download), as a loss.

    ``tie_word_embeddings``: one parameter for the embedding and the output head. ``checkpointing``:
    None, or ``use_reentrant`` for HuggingFace's ``gradient_checkpointing_enable``. ``lora_rank``: every
    base parameter frozen and low-rank adapters (trainable) added to each attention q/v projection.
    """

    def __init__(self, *, tie_word_embeddings: bool = True, checkpointing: bool | None = None, lora_rank: int = 0):
        super().__init__()
        import json
        import warnings

        from transformers import Qwen3Config, Qwen3ForCausalLM

        settings = json.loads(QWEN3_TINY_CONFIG.read_text())
        settings.update(tie_word_embeddings=tie_word_embeddings, use_cache=False, attn_implementation="eager")
        self.model = Qwen3ForCausalLM(Qwen3Config(**settings))
        self.model.train()
        self.vocab = settings["vocab_size"]
        if lora_rank:
            self.model.requires_grad_(False)
            for layer in self.model.model.layers:
                layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj, lora_rank)
                layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj, lora_rank)
        if checkpointing is not None:
            with warnings.catch_warnings():  # the method's deprecation notice in favour of another name
                warnings.simplefilter("ignore", FutureWarning)
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), tokens[:, 1:].reshape(-1))


class HFMoECausalLM(nn.Module):
    """A transformers Qwen3MoeForCausalLM (no download), as a loss: two layers of four experts, top 2,
    held as transformers 5 holds them, two fused 3-D stacks per layer (``mlp.experts.gate_up_proj``
    ``[4, 64, 16]`` and ``mlp.experts.down_proj`` ``[4, 16, 32]``)."""

    def __init__(self):
        super().__init__()
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(vocab_size=61, hidden_size=16, intermediate_size=24, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=False,
                                use_cache=False, attn_implementation="eager")
        self.model = Qwen3MoeForCausalLM(config)
        self.model.train()
        self.vocab = config.vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), tokens[:, 1:].reshape(-1))


def make_hf_moe_model(seed: int = 0) -> HFMoECausalLM:
    torch.manual_seed(seed)
    return HFMoECausalLM()


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B @ A`` (both non-zero, so both get gradients)."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def make_hf_model(seed: int = 0, **kwargs) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM(**kwargs)
