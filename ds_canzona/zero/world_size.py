"""One clear error when the HuggingFace Trainer counted fewer processes than DeepSpeed runs.

On a machine without GPUs, accelerate finds no distributed backend unless the Trainer is told
``TrainingArguments(use_cpu=True)``; every rank then believes it is alone. It shows in the config
DeepSpeed receives in one of two ways:

- ``"train_batch_size": "auto"`` is filled with micro batch x accumulation x **1**, and DeepSpeed's
  own check, inside ``DeepSpeedConfig`` (before the engine exists), stops with a bare assertion
  ``train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size``;
- without a ``train_batch_size`` key DeepSpeed derives a consistent one and training runs, wrong:
  the data is not sharded and every rank counts as process zero. What is left to see is
  accelerate's state, which says one process while DeepSpeed has several.

``install_batch_check`` wraps ``DeepSpeedConfig._batch_assertion`` (the earliest point at which
DeepSpeed has both the batch sizes and its world size) so that either case raises one
CanzonaConfigError with the fix, before DeepSpeed's assertion and before anything is allocated.
Configs without an enabled ``canzona`` section go straight to DeepSpeed's check, untouched.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

_PATCHED_FLAG = "_ds_canzona_batch_check"


def accelerate_process_count() -> int | None:
    """How many processes accelerate's state counts, or None when accelerate has not set one up."""
    state_module = sys.modules.get("accelerate.state")
    if state_module is None or not state_module.PartialState._shared_state:
        return None
    return int(state_module.PartialState().num_processes)


def batch_world_size_error(*, train_batch: int, micro_batch: int, grad_acc: int, world_size: float,
                           process_count: int | None, total_processes: int, on_cpu: bool) -> str | None:
    """The one-line message for a world-size or batch-size mismatch, or None when all agree.

    ``world_size`` is DeepSpeed's data-parallel size, ``total_processes`` all its processes,
    ``process_count`` the processes accelerate counted (None when accelerate is not in use).
    """
    if process_count is not None and process_count != total_processes:
        fix = ("pass TrainingArguments(use_cpu=True) on a machine without GPUs (ds_canzona.hf.training_arguments "
               "does it)" if on_cpu else "start every process with the same launcher and environment")
        sized_for = ""
        if train_batch == micro_batch * grad_acc * process_count != micro_batch * grad_acc * world_size:
            sized_for = (f" (train_batch_size {train_batch} = micro batch {micro_batch} x gradient accumulation "
                         f"{grad_acc} x {process_count} instead of x {world_size})")
        return (f"the HuggingFace Trainer (accelerate) counted {process_count} process"
                f"{'es' if process_count != 1 else ''} but DeepSpeed runs {total_processes}{sized_for}: {fix}")
    if train_batch != micro_batch * grad_acc * world_size:
        return (f"train_batch_size {train_batch} is not micro batch {micro_batch} x gradient accumulation "
                f"{grad_acc} x {world_size} data-parallel ranks = {micro_batch * grad_acc * world_size}: "
                "leave train_batch_size out (DeepSpeed derives it) or make the three agree")
    return None


def _canzona_enabled(param_dict: dict[str, Any]) -> bool:
    section = param_dict.get("canzona")
    return isinstance(section, dict) and section.get("enabled", True) is not False


def _wrap_batch_assertion(original):

    @functools.wraps(original)
    def _batch_assertion(self):
        if _canzona_enabled(self._param_dict):
            from deepspeed import comm as dist
            from deepspeed.accelerator import get_accelerator

            from ds_canzona.config import CanzonaConfigError

            total = dist.get_world_size() if dist.is_initialized() else 1
            message = batch_world_size_error(
                train_batch=self.train_batch_size, micro_batch=self.train_micro_batch_size_per_gpu,
                grad_acc=self.gradient_accumulation_steps, world_size=self.world_size,  # a float when sequence parallelism divides it
                process_count=accelerate_process_count(), total_processes=total,
                on_cpu=get_accelerator().device_name() == "cpu")
            if message is not None:
                raise CanzonaConfigError(message)
        return original(self)

    return _batch_assertion


def install_batch_check(config_class: type) -> None:
    """Wrap ``config_class._batch_assertion`` (DeepSpeed's ``DeepSpeedConfig``) once; idempotent."""
    if getattr(config_class, _PATCHED_FLAG, False):
        return
    config_class._batch_assertion = _wrap_batch_assertion(config_class._batch_assertion)
    setattr(config_class, _PATCHED_FLAG, True)
