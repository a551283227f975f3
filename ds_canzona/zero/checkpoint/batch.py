"""The global batch across a resume: what a checkpoint records, and the warning when it changes.

DeepSpeed's global batch is micro-batch x gradient accumulation steps x data-parallel ranks. A
config that leaves ``train_batch_size`` out (all the shipped ones do, so that one file serves any
world size) therefore changes the batch when a job resumes at another world size: 8 samples per
step at 2 ranks become 12 at 3. Loading works either way; the warning says so, with both numbers
and how to keep the saved batch.
"""

from __future__ import annotations

from typing import Any


def batch_record(*, train_batch_size: int, micro_batch: int, accumulation: int, ranks: int) -> dict[str, int]:
    """The manifest's ``batch`` entry."""
    return {"train_batch_size": int(train_batch_size), "micro_batch_per_gpu": int(micro_batch),
            "gradient_accumulation_steps": int(accumulation), "data_parallel_size": int(ranks)}


def _product(record: dict[str, int]) -> str:
    return (f"{record['data_parallel_size']} ranks x micro-batch {record['micro_batch_per_gpu']} x "
            f"{record['gradient_accumulation_steps']} accumulation steps")


def _how_to_keep(saved_batch: int, ranks: int, micro_batch: int) -> str:
    """Settings that give ``saved_batch`` at ``ranks`` ranks, or why none does."""
    if saved_batch % ranks:
        lower = saved_batch // ranks * ranks
        options = [str(b) for b in (lower, lower + ranks) if b > 0]
        return (f"{saved_batch} is not a multiple of {ranks} ranks, so no micro-batch and accumulation keep it at "
                f"this size: the nearest global batches are {' and '.join(options)}, or resume at a world size that "
                f"divides {saved_batch}")
    per_rank = saved_batch // ranks
    micro = max(d for d in range(1, min(micro_batch, per_rank) + 1) if per_rank % d == 0)
    return (f"set train_micro_batch_size_per_gpu {micro} and gradient_accumulation_steps {per_rank // micro} "
            f"({micro} x {per_rank // micro} x {ranks} ranks = {saved_batch}; with the HF Trainer: "
            "per_device_train_batch_size and gradient_accumulation_steps), or set train_batch_size "
            f"{saved_batch} and leave gradient_accumulation_steps out so that DeepSpeed derives it")


def batch_change_warning(saved: dict[str, Any] | None, saved_ranks: int, current: dict[str, int]) -> str | None:
    """The warning for a load whose global batch differs from the checkpoint's; None when it is the same.

    ``saved`` is the manifest's ``batch`` entry (None in checkpoints written before it existed:
    then only a change of world size can be reported).
    """
    batch = current["train_batch_size"]
    if saved is None:
        if saved_ranks == current["data_parallel_size"]:
            return None
        return (f"ds_canzona: this checkpoint was saved at {saved_ranks} data-parallel ranks and is loaded at "
                f"{current['data_parallel_size']}; it does not record its global batch (an older checkpoint), "
                f"this run's is {batch} samples per optimizer step ({_product(current)}). If the saved batch was "
                f"different, the data per step and the effective learning rate change: set train_batch_size in "
                "the DeepSpeed config to the saved one")
    saved_batch = int(saved["train_batch_size"])
    if saved_batch == batch:
        return None
    change = "more" if batch > saved_batch else "less"
    return (f"ds_canzona: this checkpoint was trained with a global batch of {saved_batch} samples per optimizer "
            f"step ({_product(saved)}); this run takes {batch} ({_product(current)}), so every step from here on "
            f"sees {change} data than before. To keep {saved_batch}: "
            f"{_how_to_keep(saved_batch, current['data_parallel_size'], current['micro_batch_per_gpu'])}")
