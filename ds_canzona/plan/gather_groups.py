"""Which stage-1/2 buckets share one all-gather launch: gather groups.

After the step each bucket's parameters are all-gathered. Issued per bucket, as soon as the
rank has updated what it owns there, each gather overlaps the update of the next bucket, but a
step then launches one all-gather per bucket: with the reduce-scatters (one per bucket) and the
norm's all-reduce that is ``2 B + 1`` launches for B buckets, where DeepSpeed's stage 2 issues
about ``B + 3`` (below). A *gather group* is a run of consecutive buckets, in plan order, whose
all-gathers go out as one launch once the last bucket of the group is updated: G groups give
``B + G + 1`` launches per step, and the gather of group g still overlaps the update of group
g + 1, so every group but the last is hidden behind updates.

``canzona.all_gather_groups`` sets G:

- an int ``n >= 1``: ``min(n, B)`` groups (1: every bucket in one launch after the whole update);
- ``"per_bucket"``: ``B`` groups, one launch per bucket (the most overlap);
- ``"default"``: ``min(DEEPSPEED_STAGE2_ALL_GATHERS, B)`` = ``min(2, B)`` groups.

Why 2. DeepSpeed 0.19.8's stage 2 step issues, for the same model and bucket size: one
gradient-reduction launch per bucket of its own (it closes a bucket, as the planner does, when
the next gradient would take it past ``reduce_bucket_size`` elements, so it has about as many
as the plan's B), at least one norm all-reduce (``get_grad_norm_direct``), and one
``all_gather_into_tensor`` per parameter group of its flat buffers (``all_gather_dp_groups``; two
for a matrix optimizer beside AdamW, Muon's ``MuonWithAuxAdam``). That is at least ``B + 3``, and
``B + G + 1 <= B + 3`` holds for ``G <= 2``: the default issues as many all-gather launches as
DeepSpeed does and keeps half of the gathers behind updates. Counted on Qwen3-8B and Qwen3-32B
(``python -m ds_canzona.bench collectives``, docs/NOTES.md) DeepSpeed issues ``B + 5`` to
``B + 7``: a G up to 4 would still be at or below it there, but that margin is DeepSpeed's
bucketing detail, not a bound. On NCCL one launch costs tens of microseconds at 1024 ranks and a
bucket's gather tens of milliseconds, so a run that can afford the launches gains by more
groups: set the int.

The groups are a function of B and the setting only (plan-derived), so every rank groups alike.
Buckets are spread as evenly as possible; where B is not a multiple of G the earlier groups get
one bucket more (the last group, whose gather nothing hides, is never the larger).

Launches per group: by default a group's all-gather is one operation (``ds_canzona.plan.collectives``:
one all-reduce over the group's parameter buffer, or a lone owner's broadcasts), so the step is
``B + G + 1`` operations, not only launches. Under a forced form, a group whose buckets all take one form
is one launch: the grouped form's broadcasts in one coalesced launch, or the padded form's
``all_gather_into_tensor`` calls in one (torch's coalescing manager issues ops of one type as one
``allgather_into_tensor_coalesced``). A group holding both forms issues one launch per form: torch
2.13 coalesces only ops of one type through its fast path, the broadcasts go through the
backend's own grouping, and whether one NCCL group then covers both is not documented (it differs
between versions of torch's NCCL process group), so they are never mixed. gloo cannot group at
all: there the grouping only decides when the gathers are issued, never what they move.

Only the standard library is imported: ``ds-canzona plan`` reports the groups offline.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ALL_GATHER_GROUP_NAMES", "DEEPSPEED_STAGE2_ALL_GATHERS", "DEFAULT", "PER_BUCKET", "all_gather_group_count",
           "all_gather_groups", "all_gather_launches", "check_all_gather_groups", "step_launches"]

PER_BUCKET = "per_bucket"
DEFAULT = "default"
# The named values of ``canzona.all_gather_groups`` (besides an int >= 1).
ALL_GATHER_GROUP_NAMES = (DEFAULT, PER_BUCKET)
# DeepSpeed's stage 2 all-gather launches per step: one per parameter group, two with a matrix optimizer.
DEEPSPEED_STAGE2_ALL_GATHERS = 2


def check_all_gather_groups(setting) -> int | str:
    """``setting`` if it is an int >= 1 (not a bool) or one of ``ALL_GATHER_GROUP_NAMES``, else ``ValueError``."""
    if isinstance(setting, bool) or not isinstance(setting, (int, str)):
        raise ValueError(f"all_gather_groups is an int >= 1, {DEFAULT!r} or {PER_BUCKET!r}, got {setting!r}")
    if isinstance(setting, str) and setting not in ALL_GATHER_GROUP_NAMES:
        raise ValueError(f"all_gather_groups is an int >= 1, {DEFAULT!r} or {PER_BUCKET!r}, got {setting!r}")
    if isinstance(setting, int) and setting < 1:
        raise ValueError(f"all_gather_groups must be at least 1, got {setting}")
    return setting


def all_gather_group_count(buckets: int, setting: int | str = DEFAULT) -> int:
    """How many gather groups ``setting`` means for ``buckets`` buckets (0 buckets: 0 groups)."""
    check_all_gather_groups(setting)
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 0:
        raise ValueError(f"buckets must be a non-negative int, got {buckets!r}")
    if setting == PER_BUCKET:
        wanted = buckets
    elif setting == DEFAULT:
        wanted = DEEPSPEED_STAGE2_ALL_GATHERS
    else:
        wanted = setting
    return min(wanted, buckets)


def all_gather_groups(buckets: int, setting: int | str = DEFAULT) -> tuple[tuple[int, ...], ...]:
    """The gather groups: consecutive bucket indices, in plan order, as even as possible, larger groups first."""
    count = all_gather_group_count(buckets, setting)
    if count == 0:
        return ()
    size, larger = divmod(buckets, count)
    groups, start = [], 0
    for g in range(count):
        stop = start + size + (g < larger)
        groups.append(tuple(range(start, stop)))
        start = stop
    return tuple(groups)


def all_gather_launches(groups: Sequence[Sequence[int]], forms: Sequence[str], world_size: int) -> int:
    """All-gather launches per step on a backend that groups (not gloo): per group, one per form its buckets take.

    ``forms``: each bucket's all-gather form. One rank gathers nothing.
    """
    if world_size <= 1:
        return 0
    covered = sorted(b for group in groups for b in group)
    if covered != list(range(len(forms))):
        raise ValueError(f"the groups {groups} do not cover the {len(forms)} buckets once each, in order")
    return sum(len({forms[b] for b in group}) for group in groups)


def step_launches(groups: Sequence[Sequence[int]], forms: Sequence[str], world_size: int) -> dict[str, int]:
    """A stage-1/2 step's collective launches on a backend that groups: one reduce-scatter per bucket, the gather
    groups' all-gathers, the norm's one all-reduce (none of them with one rank)."""
    if world_size <= 1:
        return {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    return {"reduce_scatter": len(forms), "all_gather": all_gather_launches(groups, forms, world_size),
            "all_reduce": 1}
