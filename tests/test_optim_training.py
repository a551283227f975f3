"""Behaviour check: on a small synthetic task each optimizer beats SGD given the same step budget."""

from __future__ import annotations

import pytest
import torch

from ds_canzona.optim import SOAP, AdamW, Muon, Shampoo

STEPS = 60


def make_task() -> tuple[torch.Tensor, torch.Tensor]:
    """Regression onto a random two-layer teacher with badly scaled inputs (an ill-conditioned problem)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator) * torch.logspace(-1.5, 1, 16)
    teacher_in = torch.randn(16, 32, generator=generator) / 4
    teacher_out = torch.randn(32, 8, generator=generator) / 3
    return x, torch.tanh(x @ teacher_in) @ teacher_out


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8))


def final_loss(make_optimizer) -> float:
    """Full-batch training for STEPS steps with the lr decayed linearly to zero, for every optimizer alike.

    The decay matters for Muon: its step has a fixed spectral size, so at a constant lr it keeps
    circling the minimum instead of settling into it.
    """
    x, y = make_task()
    model = make_model()
    opt = make_optimizer(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / STEPS)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        schedule.step()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


@pytest.fixture(scope="module")
def sgd_loss() -> float:
    # SGD with momentum at the best of a small lr grid: a fair baseline, not a strawman.
    # (0.4 already diverges part way; measured best: 0.0845 at 0.3.)
    return min(final_loss(lambda m, lr=lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
               for lr in (0.1, 0.2, 0.3, 0.4))


# Measured final losses: Muon 0.020, Muon standard/Polar Express 0.016, Shampoo 0.025, Shampoo
# (Newton roots) 0.025, SOAP 0.031, AdamW 0.060; SGD's best 0.085.
OPTIMIZERS = {
    "muon": lambda m: Muon(m.named_parameters(), lr=0.1, adam_lr=0.03),
    "muon_standard_polar_express": lambda m: Muon(m.named_parameters(), lr=0.1, adam_lr=0.03,
                                                  ns_method="standard", ns_coefficients="polar_express"),
    "shampoo": lambda m: Shampoo(m.named_parameters(), lr=0.03, precondition_frequency=5),
    "shampoo_newton": lambda m: Shampoo(m.named_parameters(), lr=0.03, precondition_frequency=5,
                                        inverse_root="newton", epsilon=1e-6),
    "soap": lambda m: SOAP(m.named_parameters(), lr=0.03, weight_decay=0.0, precondition_frequency=5),
    "adamw": lambda m: AdamW(m.named_parameters(), lr=0.03, weight_decay=0.0),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_beats_sgd_with_the_same_budget(name, sgd_loss):
    loss = final_loss(OPTIMIZERS[name])
    assert loss < sgd_loss, f"{name}: {loss:.4g} vs SGD {sgd_loss:.4g}"
