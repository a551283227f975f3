"""The ``canzona`` section of a DeepSpeed config, validated before anything is allocated.

DeepSpeed keeps unknown top-level sections without looking at them, so this section has to
validate itself: an unknown key, a wrong type or a value out of range is one error naming the
key. The model follows DeepSpeed's own config models (pydantic, ``extra="forbid"``), with strict
types: a float key takes an int but not a bool or a string ("1.0"), an int key takes neither a
float nor a bool, so a value is never silently converted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from ds_canzona.plan import DEFAULT_SPLIT_NUMEL
from ds_canzona.plan.collectives import DEFAULT_COLLECTIVE_BYTES_PER_S, DEFAULT_COLLECTIVE_LAUNCH_S, CollectiveCosts
from ds_canzona.plan.gather_groups import check_all_gather_groups

CANZONA_SECTION = "canzona"

# Optimizer names that the canzona backend builds from the config's "optimizer" section, and
# the per-tensor kind each one uses for matrices. Non-matrix tensors always go to AdamW.
MATRIX_OPTIMIZERS = {"muon": "muon", "normuon": "normuon", "adamuon": "adamuon", "shampoo": "shampoo", "soap": "soap"}


class CanzonaConfigError(ValueError):
    """A bad ``canzona`` section or an unsupported combination with the rest of the config."""


class CanzonaConfigAssertion(CanzonaConfigError, AssertionError):
    """A config value DeepSpeed's own ZeRO optimizer rejects with an assertion, rejected alike.

    An ``AssertionError`` too, so code (and DeepSpeed's own tests) written against DeepSpeed's
    ZeRO optimizer catch it where they caught DeepSpeed's.
    """


class CanzonaConfig(DeepSpeedConfigModel):
    """The ``canzona`` section: how ds_canzona plans and runs the ZeRO-1/2 optimizer step."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, validate_assignment=True,
                              use_enum_values=True, populate_by_name=True, arbitrary_types_allowed=True,
                              protected_namespaces=())

    enabled: StrictBool = True
    """Build ds_canzona's ZeRO stage 1/2 optimizer. false: stock DeepSpeed, as if the section were absent."""

    alpha: float = Field(1.0, ge=0.0, le=1.0)
    """Blend of even elements per rank (0: best for communication) and even optimizer cost (1: best for compute)."""

    bucket_numel: int | None = Field(None, gt=0)
    """Elements per gradient/parameter bucket. Default: zero_optimization.reduce_bucket_size."""

    strategy: Literal["alpha_balanced", "start_index", "uniform"] = "alpha_balanced"
    """Cut placement. uniform is accepted only by the planner CLI and benchmarks; the runtime needs whole-tensor owners."""

    cost_model: Literal["roofline", "flops", "numel"] = "roofline"
    """What the planner balances: optimizer-step time as matmul FLOPs plus memory-bound elementwise passes
    (roofline), exact optimizer FLOPs per tensor, or the paper's numel."""

    machine_balance: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """roofline only: the device's matmul FLOP/s over its elementwise bytes/s. Default: 30 on the CPU, 150 on GPUs;
    `python -m ds_canzona.bench calibrate` measures it."""

    launch_bytes: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    """roofline only: the per-item launch floor, one kernel launch in elementwise bytes (launch seconds x
    elementwise bytes/s). Default: 1.5e4 on the CPU (measured), 1.5e7 on GPUs (estimated);
    `python -m ds_canzona.bench calibrate` measures it. 0: no floor."""

    split_numel: int | None = Field(DEFAULT_SPLIT_NUMEL, ge=0)
    """Plan non-matrix tensors above this many elements as pieces of this size, each owned by one rank (AdamW is
    elementwise), so a huge embedding does not bound the busiest rank; and 3-D expert stacks above it as pieces
    of whole experts (as many as fit, at least one: each expert is its own matrix to every matrix rule). 0 or
    null: every tensor whole (0 is what the planner CLI's --split-numel 0 means too)."""

    max_state_bytes_per_rank: int | None = Field(None, gt=0)
    """Hard cap on the bytes any one rank keeps for the items it owns (fp32 masters, optimizer state, reduced-gradient
    segment; see ds_canzona.plan.memory): the plan buys it with step time if needed, and init fails with the smallest
    feasible value if no plan meets it. null: no cap (the plan still minimises the busiest rank's bytes second)."""

    kernels: Literal["default", "triton", "torch"] = "default"
    """Matrix kernels: Triton on CUDA where the shape is supported (default), always Triton, or the torch reference.
    Not "auto": the HuggingFace Trainer takes any "auto" in a DeepSpeed config for a placeholder it must fill."""

    log_plan: StrictBool = True
    """Rank 0 logs the plan summary (buckets, per-rank cost and memory, the ratios) at init."""

    tp_micro_group_bytes: int = Field(512 * 2**20, gt=0)
    """Under AutoTP: the most bytes of gathered fp32 gradients one host rank holds per micro-group (the paper's
    C_max); matrices travel to their hosts in micro-groups of about this size, the exchange of one overlapping
    the update of the previous."""

    comm_timeout_s: float = Field(600.0, gt=0.0)
    """Timeout (s) of every process group ds_canzona uses (default, data-parallel, AutoTP's tensor-parallel) once
    the optimizer is built: a dead or hung peer makes every collective (steps, checkpoint saves and loads) raise
    within this bound."""

    collectives: Literal["default", "grouped", "padded", "allreduce"] = "default"
    """Form of each bucket's reduce-scatter and each gather group's all-gather (stages 1/2): one rank-rooted reduce /
    broadcast per non-empty segment in one grouped launch (grouped, the fewest bytes; gloo: the uneven list
    reduce-scatter and single broadcasts), one equal-size collective over segments padded to the bucket's largest
    (padded), one in-place all-reduce (allreduce: a gather group's all-gather is then one operation), or one
    operation each, padded or all-reduced as the cost model prices lower (default, so a step's operations do not
    grow with the world size; grouped on gloo). ds_canzona.plan.collectives.
    ZeRO-3: each fetch, each gradient bucket and the post-step refresh of persistent parameters is one launch:
    "grouped" issues its broadcasts / reduces in one NCCL group (one operation per piece; gloo cannot group and
    runs them one by one); "padded" one equal-size all_gather_into_tensor / reduce_scatter_tensor, every owner's
    segment padded to the largest; "allreduce" one all_reduce of the launch's pieces back to back; "default" one
    operation each, a single piece's broadcast / reduce, else padded or all-reduced as the cost model prices
    lower. All keep parameters below stage3_param_persistence_threshold resident and reduce gradients in buckets
    of reduce_bucket_size. "default" on gloo: one broadcast per piece and one reduce per item, nothing
    persistent (what measured best there). ds_canzona.zero.stage3_comm."""

    collective_launch_s: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """collectives "default" only: one collective operation's latency per hop (s); an operation over P ranks costs
    this times max(1, log2 P). Default: 5e-6 (NCCL-like)."""

    collective_bytes_per_s: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """collectives "default" only: the wire bandwidth (bytes/s) that prices the padding and the all-reduce's second
    pass. Default: 5e10 (400 Gb/s)."""

    @property
    def collective_costs(self) -> CollectiveCosts:
        """The cost model's constants: the configured values, or the documented defaults."""
        launch = DEFAULT_COLLECTIVE_LAUNCH_S if self.collective_launch_s is None else self.collective_launch_s
        rate = DEFAULT_COLLECTIVE_BYTES_PER_S if self.collective_bytes_per_s is None else self.collective_bytes_per_s
        return CollectiveCosts(launch_s=float(launch), bytes_per_s=float(rate))

    all_gather_groups: int | Literal["default", "per_bucket"] = "default"
    """Stages 1/2: how many launches the step's bucket all-gathers take. Consecutive buckets form a group whose
    all-gathers go out as one launch once its last bucket is updated, overlapping the update of the next group: an
    int n >= 1 (min(n, buckets) groups), "per_bucket" (one launch per bucket, the most overlap), or "default"
    (2 groups: as many all-gather launches as DeepSpeed's stage 2 issues; ds_canzona.plan.gather_groups). Not "auto":
    the HuggingFace Trainer takes any "auto" in a DeepSpeed config for a placeholder it must fill."""

    offload_staging_bytes: int = Field(256 * 2**20, gt=0)
    """With zero_optimization.offload_optimizer (device cpu): the device bytes the matrix items' masters, gradients
    and state take while staged for their update (two waves of at most half of it, one copied while the other
    computes); a matrix larger than half of it is staged alone."""

    offload_host_adam: Literal["canzona", "deepspeed_cpu_adam"] = "canzona"
    """With offload_optimizer: the host update of non-matrix items: ds_canzona's AdamW rule (bit-exact with the
    device run) or DeepSpeed's CPU Adam kernel (DeepSpeedCPUAdam's op; agrees to rounding, docs/NOTES.md)."""

    @field_validator("strategy")
    @classmethod
    def _runtime_strategy(cls, value: str) -> str:
        if value == "uniform":
            raise ValueError("'uniform' splits tensors across ranks; the runtime needs whole-tensor owners "
                             "(use 'alpha_balanced' or 'start_index')")
        return value

    @field_validator("all_gather_groups")
    @classmethod
    def _gather_groups(cls, value: int | str) -> int | str:
        return check_all_gather_groups(value)

    @field_validator("split_numel")
    @classmethod
    def _zero_means_whole(cls, value: int | None) -> int | None:
        return None if value == 0 else value

    @model_validator(mode="after")
    def _balance_needs_roofline(self) -> "CanzonaConfig":
        for key in ("machine_balance", "launch_bytes"):
            if getattr(self, key) is not None and self.cost_model != "roofline":
                raise ValueError(f"{key} applies to cost_model 'roofline' only, not {self.cost_model!r}")
        for key in ("collective_launch_s", "collective_bytes_per_s"):
            if getattr(self, key) is not None and self.collectives != "default":
                raise ValueError(f"{key} prices the choice of collectives 'default' only, not {self.collectives!r}")
        return self


def _format_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "<section>"
        if item["type"] == "extra_forbidden":
            parts.append(f"unknown key '{CANZONA_SECTION}.{key}'")
        else:
            parts.append(f"'{CANZONA_SECTION}.{key}': {item['msg']} (got {item.get('input')!r})")
    return "; ".join(parts)


def parse_canzona_section(param_dict: dict[str, Any]) -> CanzonaConfig | None:
    """The validated section of a DeepSpeed config dict, or None when it is absent or disabled."""
    raw = param_dict.get(CANZONA_SECTION)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CanzonaConfigError(f"'{CANZONA_SECTION}' must be an object, got {type(raw).__name__}")
    try:
        config = CanzonaConfig(strict=True, **raw)
    except ValidationError as error:
        raise CanzonaConfigError(f"invalid DeepSpeed config: {_format_error(error)}") from None
    return config if config.enabled else None
