"""Offline planning: who owns which tensor, computed the same way on every rank.

Pure Python and deterministic; nothing here imports torch.distributed, and only
:func:`specs_from_module` / :func:`specs_from_hf_config` touch torch at all (lazily).
"""

from .cost import (
    ADAMW_FLOPS_PER_ELEMENT,
    CostModel,
    FlopsCost,
    NumelCost,
    adamw_flops,
    cost_model,
    muon_flops,
    newton_schulz_flops,
    shampoo_flops,
    soap_flops,
)
from .dp import (
    STRATEGIES,
    BucketPlan,
    DPPlan,
    alpha_balanced,
    lpt_loads,
    min_max_segment,
    plan_buckets,
    plan_dp_partitions,
    start_index,
    uniform,
)
from .models import (
    load_model_config,
    model_specs,
    qwen3_specs,
    shipped_models,
)
from .owners import (
    Zero3Plan,
    plan_zero3_owners,
)
from .specs import (
    MatrixRule,
    ParamSpec,
    PlanError,
    default_matrix_rule,
    shard_for_tp,
    specs_from_entries,
    specs_from_hf_config,
    specs_from_module,
    specs_from_shapes_file,
    tp_split_dim,
)
from .tp import (
    MicroGroup,
    TPPlan,
    plan_tp_micro_groups,
)

__all__ = [
    "ADAMW_FLOPS_PER_ELEMENT",
    "STRATEGIES",
    "BucketPlan",
    "CostModel",
    "DPPlan",
    "FlopsCost",
    "MatrixRule",
    "MicroGroup",
    "NumelCost",
    "ParamSpec",
    "PlanError",
    "TPPlan",
    "Zero3Plan",
    "adamw_flops",
    "alpha_balanced",
    "cost_model",
    "default_matrix_rule",
    "load_model_config",
    "lpt_loads",
    "min_max_segment",
    "model_specs",
    "muon_flops",
    "newton_schulz_flops",
    "plan_buckets",
    "plan_dp_partitions",
    "plan_tp_micro_groups",
    "plan_zero3_owners",
    "qwen3_specs",
    "shampoo_flops",
    "shard_for_tp",
    "shipped_models",
    "soap_flops",
    "specs_from_entries",
    "specs_from_hf_config",
    "specs_from_module",
    "specs_from_shapes_file",
    "start_index",
    "tp_split_dim",
    "uniform",
]
