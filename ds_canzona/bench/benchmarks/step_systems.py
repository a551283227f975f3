"""The systems of ``python -m ds_canzona.bench step``: the model, the engine config of each row.

``ModelShape`` is the Qwen3 model every row trains; ``SYSTEMS`` lists the rows (ds_canzona at
each stage, DeepSpeed's own Muon, the synchronous and layer-wise schemes); ``_engine_config`` and
``_client_optimizer`` turn a row into what ``deepspeed.initialize`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ADAMUON_PARAMS", "BENCH_OPTIMIZERS", "COLLECTIVE_NAMES", "MUON_PARAMS", "NORMUON_PARAMS", "SHAMPOO_PARAMS",
           "ModelShape", "SYSTEMS", "System", "model_numel", "optimizer_params"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The Qwen3 config of the benchmark model and the micro-batch it trains on."""

    hidden: int = 256
    layers: int = 8
    intermediate: int = 1024
    vocab: int = 8192
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    seq: int = 128
    micro_batch: int = 2

    def qwen3_config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "intermediate_size": self.intermediate,
                "vocab_size": self.vocab, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "max_position_embeddings": max(256, self.seq),
                "tie_word_embeddings": False, "attention_bias": False}

    def describe(self) -> str:
        return (f"Qwen3 architecture: hidden {self.hidden}, {self.layers} layers, intermediate {self.intermediate}, "
                f"vocab {self.vocab}, {self.heads} heads / {self.kv_heads} KV heads of {self.head_dim}, untied head; "
                f"fp32; micro-batch {self.micro_batch} x {self.seq} tokens per rank")


@dataclass(frozen=True, kw_only=True)
class System:
    key: str
    label: str
    runtime: str  # "canzona", "deepspeed", "synchronous", "layerwise"
    stage: int
    reduce_scatter: bool = True
    optimizers: tuple[str, ...] = ("muon",)
    # ds_canzona only: cut each vocab x hidden tensor (the embedding, the untied head) into this many
    # canonical pieces, by ``canzona.split_numel`` = vocab x hidden / pieces of the benchmark model.
    vocab_pieces: int | None = None


SYSTEMS: dict[str, System] = {s.key: s for s in (
    System(key="canzona-z1", label="ds_canzona ZeRO-1", runtime="canzona", stage=1,
           optimizers=("muon", "normuon", "adamuon", "shampoo")),
    System(key="canzona-z2", label="ds_canzona ZeRO-2", runtime="canzona", stage=2,
           optimizers=("muon", "normuon", "adamuon", "shampoo")),
    System(key="deepspeed-z1", label="DeepSpeed Muon ZeRO-1", runtime="deepspeed", stage=1),
    System(key="deepspeed-z1-ar", label="DeepSpeed Muon ZeRO-1, reduce_scatter off", runtime="deepspeed", stage=1,
           reduce_scatter=False),
    System(key="deepspeed-z2", label="DeepSpeed Muon ZeRO-2", runtime="deepspeed", stage=2),
    System(key="deepspeed-z2-ar", label="DeepSpeed Muon ZeRO-2, reduce_scatter off", runtime="deepspeed", stage=2,
           reduce_scatter=False),
    System(key="deepspeed-z3", label="DeepSpeed Muon ZeRO-3 (reduce_scatter off)", runtime="deepspeed", stage=3,
           reduce_scatter=False),
    System(key="canzona-z3", label="ds_canzona ZeRO-3", runtime="canzona", stage=3, reduce_scatter=False),
    System(key="canzona-z3-pieces", label="ds_canzona ZeRO-3, AdamW tensors in pieces", runtime="canzona", stage=3,
           reduce_scatter=False, vocab_pieces=8),
    System(key="synchronous", label="synchronous (every rank, every matrix)", runtime="synchronous", stage=0,
           optimizers=("muon", "normuon", "adamuon", "shampoo")),
    System(key="layerwise", label="layer-wise (all-reduce, LPT owners, broadcast)", runtime="layerwise", stage=0,
           optimizers=("muon", "normuon", "adamuon", "shampoo")),
)}

COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather_into_tensor", "broadcast")
MUON_PARAMS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "adam_lr": 3e-4,
               "betas": [0.9, 0.95], "eps": 1e-10}
SHAMPOO_PARAMS = {"lr": 1e-3, "adam_lr": 3e-4, "precondition_frequency": 5, "start_preconditioning_step": 1,
                  "max_preconditioner_dim": 1024}
# NorMuon and AdaMuon (not DeepSpeed types: ds_canzona's rows and the ZeRO-0 schemes only). Their
# own beta2 and eps; the auxiliary AdamW's as Muon's above.
NORMUON_PARAMS = {"lr": 0.02, "momentum": 0.95, "beta2": 0.95, "weight_decay": 0.0, "ns_method": "gram",
                  "adam_lr": 3e-4, "adam_betas": [0.9, 0.95], "adam_eps": 1e-10}
ADAMUON_PARAMS = {"lr": 3e-4, "momentum": 0.95, "beta2": 0.999, "weight_decay": 0.0, "ns_method": "gram",
                  "adam_betas": [0.9, 0.95], "adam_eps": 1e-10}
# The --optimizers names: config type and parameters; the Muon family takes --ns-method.
BENCH_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "muon": ("Muon", MUON_PARAMS), "normuon": ("NorMuon", NORMUON_PARAMS), "adamuon": ("AdaMuon", ADAMUON_PARAMS),
    "shampoo": ("Shampoo", SHAMPOO_PARAMS)}


def optimizer_params(optimizer: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The config's optimizer.params of one --optimizers name, with the run's Newton-Schulz method."""
    params = dict(BENCH_OPTIMIZERS[optimizer][1])
    if "ns_method" in params:
        params["ns_method"] = settings["ns_method"]
    return params



def model_numel(shape: ModelShape) -> int:
    """Parameters of the benchmark model (built on the meta device: no memory, no time)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config(**shape.qwen3_config())).parameters())


def _build_model(shape: ModelShape, seed: int = 0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**shape.qwen3_config())
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def _engine_config(system: System, optimizer: str, settings: dict[str, Any], world_size: int) -> dict[str, Any]:
    shape: ModelShape = settings["shape"]
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": shape.micro_batch * world_size,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "zero_optimization": {"stage": system.stage, "reduce_bucket_size": settings["bucket_numel"],
                              "allgather_bucket_size": settings["bucket_numel"]},
    }
    if system.runtime in ("canzona", "deepspeed"):
        config["optimizer"] = {"type": BENCH_OPTIMIZERS[optimizer][0], "params": optimizer_params(optimizer, settings)}
    if system.runtime == "canzona":
        config["canzona"] = {"log_plan": False, "kernels": "torch"}
        if system.vocab_pieces:
            # Below the default split_numel on this model, so the other rows own these tensors whole.
            config["canzona"]["split_numel"] = -(-shape.vocab * shape.hidden // system.vocab_pieces)
    if system.runtime == "deepspeed" or system.stage == 3:
        # DeepSpeed's ZeRO-3 Muon refuses reduce_scatter; ds_canzona's ZeRO-3 row takes the same config.
        config["zero_optimization"]["reduce_scatter"] = system.reduce_scatter
    if system.stage == 3:
        # DeepSpeed keeps tensors under 1e5 elements gathered on every rank, which on this small
        # model is every attention matrix; 10 x hidden (the HuggingFace integration's "auto")
        # keeps only the norms, as 1e5 does on a model of real size.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 10 * shape.hidden
    return config


def _client_optimizer(system: System, optimizer: str, model, settings: dict[str, Any]):
    """The synchronous and layer-wise schemes: ds_canzona's single-process optimizer as DeepSpeed sees it."""
    if system.runtime not in ("synchronous", "layerwise"):
        return None
    from ds_canzona import optim
    from ds_canzona.zero.build import translate_optimizer_params

    cls = getattr(optim, BENCH_OPTIMIZERS[optimizer][0])
    inner = cls([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                **translate_optimizer_params(optimizer, optimizer_params(optimizer, settings)))
    if system.runtime == "synchronous":
        return inner
    from .baselines import LayerwiseOptimizer
    return LayerwiseOptimizer(inner)
