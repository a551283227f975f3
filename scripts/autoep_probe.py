"""Does DeepSpeed's AutoEP train a tiny Qwen3-MoE with the transformers installed here? Two CPU ranks.

    python scripts/autoep_probe.py            # DeepSpeed's own Muon
    python scripts/autoep_probe.py canzona    # with the canzona section (refused while AutoEP is, support.py)

Prints one line per rank: the losses of three steps, or the error. With DeepSpeed 0.19.8 and
transformers 5.25.0 both ranks fail inside deepspeed.initialize (the Qwen3-MoE preset calls
transformers' ``_CanRecordRegistry.get`` with a default it no longer takes); rerun it when
either is upgraded, and lift the refusal in ds_canzona/zero/support.py once it trains.
"""
import sys
import traceback

from ds_canzona.bench.standins._ranks import run_ranks


def worker(rank, world_size, canzona):
    import torch, deepspeed, transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    if canzona:
        import ds_canzona  # noqa
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64,
                         use_cache=False)
    model = Qwen3MoeForCausalLM(cfg)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2,
                                                                    "preset_model": "qwen3_moe"},
              "optimizer": {"type": "Muon", "params": {"lr": 0.02}}}
    if canzona:
        config["canzona"] = {"log_plan": False}
    try:
        engine, *_ = deepspeed.initialize(model=model, config=config)
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
        losses = []
        for _ in range(3):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return f"transformers {transformers.__version__}: trained, losses {losses}"
    except Exception as error:
        return f"transformers {transformers.__version__}: {type(error).__name__}: {error}\n" + "".join(
            traceback.format_exc().splitlines(True)[-6:])


if __name__ == "__main__":
    canzona = len(sys.argv) > 1
    for line in run_ranks(worker, 2, canzona, timeout=600):
        print(line)
