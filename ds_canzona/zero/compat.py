"""Reading engine state whose form differs between the DeepSpeed releases ds_canzona supports."""

from __future__ import annotations


def at_accumulation_boundary(optimizer) -> bool:
    """Whether the engine has told ``optimizer`` that this micro-batch ends an accumulation.

    DeepSpeed 0.19.5+ keeps the flag behind ``ZeROOptimizer.is_gradient_accumulation_boundary()``
    (set through ``set_gradient_accumulation_boundary``); 0.19.0-0.19.4 assign a bool to the
    optimizer's ``is_gradient_accumulation_boundary`` attribute, which shadows any method of that
    name, and have no default before the first assignment (DeepSpeed's own optimizers start at True).
    """
    flag = getattr(optimizer, "is_gradient_accumulation_boundary", True)
    return bool(flag()) if callable(flag) else bool(flag)


__all__ = ["at_accumulation_boundary"]
