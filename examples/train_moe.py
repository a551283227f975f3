"""Train a small mixture-of-experts language model with DeepSpeed MoE layers and ds_canzona's ZeRO-2 Muon.

One machine, N ranks (on a CPU-only machine DeepSpeed's launcher starts CPU ranks on gloo)::

    deepspeed --num_gpus 2 examples/train_moe.py --ep 2 --steps 30

The model is a byte-level causal LM: an embedding, ``--layers`` blocks of causal self-attention and
a ``deepspeed.moe.layer.MoE`` feed-forward (``--experts`` experts, top-1 gating, expert-parallel
size ``--ep``), and an untied head. ds_canzona trains the dense tensors over the data-parallel
group and the experts inside their expert-data-parallel group (docs/ARCHITECTURE.md, "Expert
parallelism"); rank 0 prints both families' plans at start. The router's auxiliary load-balancing
loss is added with weight ``--aux-weight``. The data is the shipped corpus (``ds_canzona.data_utils``).

Wrong inputs end with a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "ds_configs" / "zero2_muon_moe.hjson"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_moe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_config", default=str(DEFAULT_CONFIG), help="DeepSpeed config, JSON or HJSON")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size (divides the world size)")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer (a multiple of --ep)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--aux-weight", type=float, default=0.01)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace):
    import torch
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from torch import nn

    from ds_canzona.data_utils import ByteTokenizer

    vocab = ByteTokenizer.vocab_size

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(args.dim, 2 * args.dim)
            self.down = nn.Linear(2 * args.dim, args.dim)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
            self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
            self.out = nn.Linear(args.dim, args.dim, bias=False)
            self.moe = MoE(hidden_size=args.dim, expert=Expert(), num_experts=args.experts, ep_size=args.ep, k=1)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 4, d // 4).transpose(1, 3).unbind(2)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.out(attn)
            moe_out, aux, _ = self.moe(self.norm2(x))
            return x + moe_out, aux

    class MoELM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, args.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = nn.RMSNorm(args.dim)
            self.lm_head = nn.Linear(args.dim, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens[:, :-1])
            aux_total = 0.0
            for block in self.blocks:
                x, aux = block(x)
                aux_total = aux_total + aux
            logits = self.lm_head(self.norm(x))
            lm = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            return lm + args.aux_weight * aux_total, lm

    torch.manual_seed(0)
    return MoELM()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problems = []
    if not Path(args.deepspeed_config).is_file():
        problems.append(f"no such DeepSpeed config: {args.deepspeed_config}")
    if args.ep < 1 or world % args.ep or args.experts % args.ep:
        problems.append(f"--ep {args.ep} must divide the world size {world} and --experts {args.experts}")
    if args.steps < 1 or args.dim % 4:
        problems.append("--steps must be positive and --dim a multiple of 4 (4 attention heads)")
    if problems:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_moe.py: error: {'; '.join(problems)}", file=sys.stderr)
        return 2

    import deepspeed

    import ds_canzona  # noqa: F401  (registers the engine hook that reads the canzona section)
    from ds_canzona.data_utils import load_corpus, token_blocks
    from ds_canzona.hf import load_ds_config

    deepspeed.init_distributed()
    config = load_ds_config(args.deepspeed_config)
    engine, *_ = deepspeed.initialize(model=build_model(args), config=config)
    blocks = token_blocks(load_corpus(), args.seq)
    micro = engine.train_micro_batch_size_per_gpu()
    rank, world = engine.global_rank, engine.world_size
    device = engine.device
    first = last = None
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            # Each rank its own blocks, a function of the step: the run is reproducible.
            start = ((step * world + rank) * micro) % (blocks.shape[0] - micro)
            loss, lm = engine(blocks[start:start + micro].to(device))
            engine.backward(loss)
            engine.step()
        last = float(lm.detach())
        first = last if first is None else first
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {last:.4f}", flush=True)
    if rank == 0:
        print(f"final loss {last:.4f} (start {first:.4f})", flush=True)
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
