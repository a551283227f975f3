"""The planner's cost model for a model's param groups: what every runtime plans with.

Below the runtimes (stage12, tp, stage3 each call ``plan_cost_model`` through
``OwnerRuntime``) and below the factory (``build``), so neither reaches up for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_canzona.optim import rule_for_group
from ds_canzona.plan import CostModel, ParamSpec, cost_model, default_launch_bytes, default_machine_balance


@dataclass(frozen=True)
class PerGroupCost:
    """Prices each matrix with its own param group's cost model (groups whose rules price differently).

    Param groups that differ only in lr or weight decay share one model; groups with another
    Newton-Schulz method, step count or Shampoo/SOAP setting each price their own matrices.
    Everything else (AdamW tensors and their pieces) is priced alike by every model.
    """

    by_name: dict[str, CostModel]
    default: CostModel
    name: str
    label: str

    def cost(self, spec: ParamSpec) -> float:
        return self.by_name.get(spec.name, self.default).cost(spec)


def plan_cost_model(config, names: list[str], groups: list[dict], device_name: str) -> CostModel:
    """The planner's cost model for tensors ``names`` whose param groups are ``groups`` (one each).

    Built from the config and the device kind, never measured here: every rank must plan alike.
    """
    kind = config.cost_model
    if kind == "numel":
        return cost_model("numel")
    options = {}
    if kind == "roofline":
        options["machine_balance"] = config.machine_balance or default_machine_balance(device_name)
        launch = config.launch_bytes
        options["launch_bytes"] = default_launch_bytes(device_name) if launch is None else launch
        options["device"] = device_name
    models: dict[tuple, CostModel] = {}
    by_name: dict[str, CostModel] = {}
    for name, group in zip(names, groups):
        if group["kind"] == "adamw":
            continue
        # Priced with the group's own settings (Newton-Schulz steps and method, Shampoo's refresh
        # period, ...), so the plan balances what will actually run.
        settings = rule_for_group(group).cost_options()
        key = (group["kind"], tuple(sorted(settings.items())))
        if key not in models:
            models[key] = cost_model(kind, optimizer=group["kind"], **options, **settings)
        by_name[name] = models[key]
    if len(models) <= 1:
        return next(iter(models.values()), None) or cost_model(kind, **options)
    default = next(iter(models.values()))
    label = "+".join(model.label for model in models.values())
    return PerGroupCost(by_name=by_name, default=default, name=kind, label=label)


__all__ = ["PerGroupCost", "plan_cost_model"]
