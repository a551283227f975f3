"""Compare ds_canzona's NorMuon rule with the NorMuon authors' ``normuon_update``, step by step.

The authors' code (github.com/zichongli5/NorMuon, normuon.py) is not on the package registry, so it
is not a test dependency; fetch that file yourself and point this script at it:

    python scripts/compare_normuon_reference.py /path/to/normuon.py

Their Newton-Schulz runs in bf16 and ours (on the CPU) in fp32, so both sides get ds_canzona's
fp32 standard iteration: what is compared is NorMuon's own part (momentum, the per-row second
moment, the normalisation, the norm-preserving rescale, the sqrt(max(1, rows/cols)) factor,
decoupled weight decay), which is theirs on one side and ours on the other. Prints the largest
weight difference per shape after 8 steps and the largest relative difference of the row moments.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from ds_canzona.optim import rule_for_group
from ds_canzona.optim.newton_schulz import orthogonalize

SHAPES = [(32, 64), (64, 32), (48, 48), (3, 16, 24)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", help="path to the authors' normuon.py")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("normuon_reference", args.reference)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    reference.zeropower_via_newtonschulz5 = lambda g, steps=5: orthogonalize(g, method="standard", steps=steps,
                                                                             dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    lr = 0.02
    for shape in SHAPES:
        for weight_decay in (0.0, 0.1):
            ours = torch.randn(shape, generator=generator) * 0.1
            theirs = ours.clone()
            rule = rule_for_group({"kind": "normuon", "ns_method": "standard", "weight_decay": weight_decay})
            state = rule.init_state(ours)
            momentum, moment = torch.zeros_like(theirs), torch.zeros_like(theirs[..., 0:1])
            for _ in range(args.steps):
                grad = torch.randn(shape, generator=generator)
                rule.update_([ours], [grad], [state], lr=lr)
                update = reference.normuon_update(grad.clone(), momentum, moment, beta=0.95, beta2=0.95, ns_steps=5)
                if weight_decay:
                    theirs.mul_(1 - lr * weight_decay)
                theirs.add_(update.reshape(theirs.shape), alpha=-lr)
            ours_moment = state["row_second_moment"].reshape(moment.shape)
            moment_rel = float((ours_moment - moment).abs().max() / moment.abs().max())
            print(f"shape {shape} weight_decay {weight_decay}: max |weights - theirs| "
                  f"{float((ours - theirs).abs().max()):.2e} (weights up to {float(theirs.abs().max()):.2f}), "
                  f"row moment max rel diff {moment_rel:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
