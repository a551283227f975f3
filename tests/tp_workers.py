"""Rank-side functions of the AutoTP tests (tests/test_tp.py), spawned by tests/distributed.py.

The model is a transformers Qwen3 with 6 attention heads and 3 KV heads, so at TP=2 AutoTP gives
the ranks 2 and 1 KV heads (q: 32 and 16 rows, k and v: 16 and 8), and at TP=4 1/1/1/0 KV heads:
the last rank holds empty slices. Every rank returns its local parameters with AutoTP's split of
each, so the test reassembles the logical tensors itself (by concatenation along the split dim).

The fused-weight tests use a Phi3 (``make_phi3``) under AutoTP's phi3 preset: its ``qkv_proj``
and ``gate_up_proj`` are cut per sub-parameter, so each rank's slice is a piece of each of q, k, v
(gate, up); the test puts them back together from AutoTP's ``sub_param_shard_widths`` itself
(``reassemble_fused``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 96
QWEN3_TP = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=3, head_dim=8, tie_word_embeddings=False, use_cache=False,
                attn_implementation="eager", max_position_embeddings=64)
MICRO_BATCH = 2
SEQ = 13
CLIP = 1.0


def make_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_TP))
    model.train()
    return model


def make_phi3(seed: int = 0, kv_heads: int | None = None):
    """A Phi3: fused qkv_proj and gate_up_proj, which AutoTP shards per sub-parameter (SubParam* layers).

    By default with as many KV heads as heads (the phi3 preset cuts qkv in equal thirds);
    ``kv_heads`` makes k and v smaller than q (a partition config then gives the sizes)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    settings = {key: value for key, value in QWEN3_TP.items() if key != "head_dim"}
    settings["num_key_value_heads"] = kv_heads or settings["num_attention_heads"]
    model = Phi3ForCausalLM(Phi3Config(**settings, pad_token_id=0))
    model.train()
    return model


def tokens(step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """The micro-batch of data-parallel rank ``dp_rank`` (every TP rank of it sees the same)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (MICRO_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


def full_gradient(step: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A fixed gradient for (step, parameter), large enough that clipping at CLIP is active."""
    seed = 7919 * step + sum(ord(c) * (i + 1) for i, c in enumerate(name))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def ds_config(*, tp: int, dp: int, optimizer: dict, stage: int = 1, ga: int = 1, canzona: dict | None = None,
              bf16: bool = False, model: str = "qwen3") -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": CLIP,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "optimizer": optimizer,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if model == "phi3":
        config["tensor_parallel"]["preset_model"] = "phi3"  # fused qkv_proj and gate_up_proj, per sub-parameter
    if model == "phi3_gqa":  # the phi3 preset's layers, with q, k and v of their own sizes
        q, k, v = phi3_sub_sizes(model)["model.layers.0.self_attn.qkv_proj.weight"]
        config["tensor_parallel"]["partition_config"] = {"use_default_specs": False, "layer_specs": [
            {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.self_attn\.qkv_proj\.weight$"], "partition_type": "column", "shape": [[q, k, v], -1],
             "partition_dim": 0},
            {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
             "partition_dim": 0}]}
    if canzona is not None:
        config["canzona"] = {"log_plan": False, "bucket_numel": 3000, **canzona}
    return config


def _splits(engine) -> dict[str, tuple[int, tuple[int, ...]] | None]:
    """(partition dim, each TP rank's extent along it) per parameter; None: replicated."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    out = {}
    for name, param in engine.module.named_parameters():
        meta = getattr(param, DS_AUTOTP_UC_META, None)
        if meta is None or meta.get("replicated") or meta.get("partition_dim") is None:
            out[name] = None
        elif meta.get("sub_param_shard_widths") is not None:
            widths = meta["sub_param_shard_widths"]
            per_rank = tuple(sum(int(w[r]) for w in widths) for r in range(len(widths[0])))
            out[name] = (int(meta["partition_dim"]), per_rank)
        else:
            out[name] = (int(meta["partition_dim"]), tuple(int(s) for s in meta["partition_sizes"]))
    return out


def _sub_widths(engine) -> dict[str, tuple[tuple[int, ...], ...]]:
    """AutoTP's per-sub-parameter widths (one tuple per sub-parameter, one width per TP rank) of fused weights."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    out = {}
    for name, param in engine.module.named_parameters():
        widths = (getattr(param, DS_AUTOTP_UC_META, None) or {}).get("sub_param_shard_widths")
        if widths is not None and len(widths) > 1:
            out[name] = tuple(tuple(int(w) for w in per_rank) for per_rank in widths)
    return out


def rank_piece(full: torch.Tensor, dim: int, widths: tuple[tuple[int, ...], ...], rank: int) -> torch.Tensor:
    """TP rank ``rank``'s slice of a fused tensor: its piece of each sub-parameter, in sub-parameter order."""
    pieces, start = [], 0
    for per_rank in widths:
        pieces.append(full.narrow(dim, start + sum(per_rank[:rank]), per_rank[rank]))
        start += sum(per_rank)
    return torch.cat(pieces, dim=dim)


def reassemble_fused(slices: list[torch.Tensor], dim: int, widths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """The logical fused tensor from every TP rank's slice (each sub-parameter's pieces in rank order)."""
    subs = []
    for index, per_rank in enumerate(widths):
        pieces = []
        for rank, local in enumerate(slices):
            before = sum(w[rank] for w in widths[:index])
            pieces.append(local.narrow(dim, before, per_rank[rank]))
        subs.append(torch.cat(pieces, dim=dim))
    return torch.cat(subs, dim=dim)


def _local_params(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}


def _initialize(config: dict, model):
    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)

    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def _fed_run(config: dict, steps: int, tp: int, model: str = "qwen3", save: str | None = None,
             after=None) -> dict:
    """Each step's gradient is ``full_gradient`` (the TP slice of it on each rank), fed through backward."""
    from deepspeed.utils import groups

    engine = _initialize(config, MODELS[model]())
    splits = _splits(engine)
    fused = _sub_widths(engine)
    tp_rank = groups.get_tensor_model_parallel_rank()
    named = list(engine.module.named_parameters())
    for step in range(steps):
        loss = torch.zeros(())
        for name, param in named:
            logical = list(param.shape)
            if splits[name] is not None:
                dim, sizes = splits[name]
                logical[dim] = sum(sizes)
            grad = full_gradient(step, name, tuple(logical))
            if name in fused:
                grad = rank_piece(grad, splits[name][0], fused[name], tp_rank)
            elif splits[name] is not None:
                dim, sizes = splits[name]
                grad = grad.narrow(dim, sum(sizes[:tp_rank]), sizes[tp_rank])
            if getattr(param, "_ds_grad_allreduce_registered", False):
                grad = grad / tp  # AutoTP sums these over the TP group (exact: tp is a power of two)
            loss = loss + (param * grad).sum()
        engine.backward(loss)
        engine.step()
    if save is not None:
        engine.save_checkpoint(save, tag="saved")
    result = {"params": _local_params(engine), "splits": splits, "fused": fused}
    if after is not None:  # more checks on the trained engine (``after(engine)`` -> a dict of results)
        result.update(after(engine))
    return result


def _train_run(config: dict, steps: int, dp_rank: int, *, meter=None, load: str | None = None,
               save: str | None = None, model: str = "qwen3") -> dict:
    engine = _initialize(config, MODELS[model]())
    zero = engine.optimizer
    loaded = None
    if load is not None:
        engine.load_checkpoint(load)
        loaded = _local_params(engine)
    ga = engine.gradient_accumulation_steps()
    calls = []
    if meter is not None:  # counted: the boundary reduction (ZeRO-1, after backward) and engine.step
        zero.reduce_gradients = _metered(zero.reduce_gradients, meter)
        zero.step = _metered(zero.step, meter)
    for step in range(steps):
        if meter is not None:
            meter.reset()
        for micro in range(ga):
            loss = lm_loss(engine, tokens(step, micro, dp_rank))
            engine.backward(loss)
            engine.step()
        if meter is not None:
            calls.append(dict(meter.calls))
    if save is not None:
        engine.save_checkpoint(save, tag="saved")
    result = {"params": _local_params(engine), "splits": _splits(engine), "calls": calls, "loaded": loaded}
    if hasattr(zero, "exchange"):
        result["micro_groups"] = len(zero.exchange.groups)
        result["plan_summary"] = zero.plan_summary()
        result["buckets"] = len(zero.plan.buckets)
        result["segments"] = sum(cuts[r + 1] > cuts[r] for cuts in zero.layout.bucket_cuts
                                 for r in range(len(cuts) - 1))
    return result


def _metered(method, meter):
    def counted(*args, **kwargs):
        meter.active = True
        try:
            return method(*args, **kwargs)
        finally:
            meter.active = False

    return counted


def tp_scenarios(rank: int, world_size: int, scenarios: list[dict]) -> list[dict]:
    """Several engines in a row on one (DP x TP) mesh; each scenario's result from this rank."""
    from ds_canzona.bench.standins._instrument import CollectiveMeter, force_deepspeed_ns_dtype
    from ds_canzona.config import CanzonaConfigError

    results = []
    for scenario in scenarios:
        tp = scenario["tp"]
        dp = world_size // tp
        model = scenario.get("model", "qwen3")
        config = ds_config(tp=tp, dp=dp, optimizer=scenario["optimizer"], stage=scenario.get("stage", 1),
                           ga=scenario.get("ga", 1), canzona=scenario.get("canzona"), bf16=scenario.get("bf16", False),
                           model=model)
        if scenario["mode"] == "refused":
            try:
                _initialize(config, MODELS[model]())
            except CanzonaConfigError as error:
                results.append({"error": str(error)})
            else:
                results.append({"error": None})
            continue
        if scenario["mode"] == "fed":
            from fragment_workers import tp_fragment_checks
            after = tp_fragment_checks if scenario.get("fragments") else None
            results.append(_fed_run(config, scenario["steps"], tp, model, save=scenario.get("save"), after=after))
            continue
        if scenario.get("canzona") is None:
            force_deepspeed_ns_dtype(torch.float32)  # DeepSpeed's Muon in fp32 too: only the distribution differs
        meter = CollectiveMeter(world_size=world_size).install() if scenario.get("meter") else None
        try:
            results.append(_train_run(config, scenario["steps"], rank // tp, meter=meter, load=scenario.get("load"),
                                      save=scenario.get("save"), model=model))
        finally:
            if meter is not None:
                meter.uninstall()
    return results


def reference_training(optimizer: dict, *, dp: int, steps: int, ga: int = 1) -> dict[str, torch.Tensor]:
    """Single-process training with ``ds_canzona.optim`` on the whole model: each step's gradient is the
    mean over the DP ranks' micro-batches, clipped by the global norm as the runtime clips."""
    from grad_reference import whole_batch_training

    return whole_batch_training(optimizer, make_qwen3(), lambda model, step, micro, rank: lm_loss(
        model, tokens(step, micro, rank)), world_size=dp, steps=steps, ga=ga, clip=CLIP)


def reference_fed(optimizer: dict, *, steps: int, bf16: bool = False) -> dict[str, torch.Tensor]:
    """The single-process optimizer on the whole model fed ``full_gradient``, clipped as the runtime clips.

    ``bf16``: what a bf16 engine's fp32 masters see: parameters that start bf16-rounded and
    gradients rounded to bf16 (the ranks' gradients are bf16; summing two equal ones and halving
    is exact)."""
    import ds_canzona.optim as optim
    from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm
    from ds_canzona.zero.build import translate_optimizer_params

    model = make_qwen3()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if bf16:
        for _, p in named:
            p.data = p.data.bfloat16().float()
    name = optimizer["type"].lower()
    cls = {"muon": optim.Muon, "normuon": optim.NorMuon, "adamuon": optim.AdaMuon, "shampoo": optim.Shampoo,
           "soap": optim.SOAP}[name]
    opt = cls(named, **translate_optimizer_params(name, optimizer["params"]))
    for step in range(steps):
        grads = [full_gradient(step, n, tuple(p.shape)) for n, p in named]
        if bf16:
            grads = [g.bfloat16().float() for g in grads]
        _, coefficient = clip_coefficient(torch.stack([tensor_sq_norm(g) for g in grads]), CLIP)
        for (_, p), g in zip(named, grads):
            p.grad = g.mul_(coefficient) if coefficient < 1.0 else g
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def phi3_sub_sizes(model: str = "phi3") -> dict[str, tuple[int, ...]]:
    """The sub-parameter row counts of a Phi3's fused weights, from its config: q, k, v and gate, up."""
    model = MODELS[model]()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
           config.num_key_value_heads * head_dim)
    gate_up = (config.intermediate_size, config.intermediate_size)
    return {name: qkv if "qkv_proj" in name else gate_up for name, _ in model.named_parameters()
            if "qkv_proj.weight" in name or "gate_up_proj.weight" in name}


def reference_fed_phi3(optimizer: dict, *, steps: int, separate: bool, model: str = "phi3") -> dict[str, torch.Tensor]:
    """The single-process optimizer on make_phi3 fed ``full_gradient``, clipped as the runtime clips.

    ``separate``: each fused weight (qkv_proj, gate_up_proj) is given to the optimizer as its
    sub-parameters, separate matrices cut from it by ``phi3_sub_sizes`` (and each fused gradient
    cut the same way); the result is put back together by concatenation. Otherwise the fused
    weight is one matrix."""
    import ds_canzona.optim as optim
    from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm
    from ds_canzona.zero.build import translate_optimizer_params

    sub_sizes = phi3_sub_sizes(model) if separate else {}
    model = MODELS[model]()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tensors: list[tuple[str, torch.nn.Parameter]] = []  # what the optimizer sees
    for name, param in named:
        if name in sub_sizes:
            for index, part in enumerate(param.detach().split(sub_sizes[name], dim=0)):
                tensors.append((f"{name}.sub{index}", torch.nn.Parameter(part.clone())))
        else:
            tensors.append((name, param))
    name = optimizer["type"].lower()
    cls = {"muon": optim.Muon, "normuon": optim.NorMuon, "adamuon": optim.AdaMuon, "shampoo": optim.Shampoo,
           "soap": optim.SOAP}[name]
    opt = cls(tensors, **translate_optimizer_params(name, optimizer["params"]))
    by_name = dict(tensors)
    for step in range(steps):
        grads = {n: full_gradient(step, n, tuple(p.shape)) for n, p in named}
        _, coefficient = clip_coefficient(torch.stack([tensor_sq_norm(g) for g in grads.values()]), CLIP)
        for n, g in grads.items():
            g = g.mul_(coefficient) if coefficient < 1.0 else g
            if n in sub_sizes:
                for index, part in enumerate(g.split(sub_sizes[n], dim=0)):
                    by_name[f"{n}.sub{index}"].grad = part.clone()
            else:
                by_name[n].grad = g
        opt.step()
    out = {}
    for n, p in named:
        if n in sub_sizes:
            out[n] = torch.cat([by_name[f"{n}.sub{i}"].detach() for i in range(len(sub_sizes[n]))])
        else:
            out[n] = p.detach().clone()
    return out


MODELS = {"qwen3": make_qwen3, "phi3": make_phi3, "phi3_gqa": lambda: make_phi3(kv_heads=3)}


def logical_params(results: list[dict], tp: int) -> dict[str, torch.Tensor]:
    """The logical tensors of TP group 0 (ranks 0..tp-1), concatenated along AutoTP's split dim."""
    splits, fused = results[0]["splits"], results[0].get("fused", {})
    out = {}
    for name, local in results[0]["params"].items():
        if name in fused:
            out[name] = reassemble_fused([results[r]["params"][name] for r in range(tp)], splits[name][0], fused[name])
        elif splits[name] is None:
            out[name] = local
        else:
            dim, _ = splits[name]
            out[name] = torch.cat([results[r]["params"][name] for r in range(tp)], dim=dim)
    return out


__all__ = ["logical_params", "make_phi3", "phi3_sub_sizes", "reference_fed", "reference_fed_phi3",
           "reference_training", "tp_scenarios"]
