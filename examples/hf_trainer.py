"""Train the tiny Qwen3 with HuggingFace's Trainer, DeepSpeed ZeRO-2 and ds_canzona's Muon.

A stock Trainer script with two ds_canzona lines: ``import ds_canzona``, which makes DeepSpeed
build the optimizer named in the config's ``"optimizer"`` section through ds_canzona, and
``ds_canzona.hf.training_arguments(config, ...)`` in place of ``TrainingArguments(deepspeed=config,
...)``::

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_configs/zero2_muon.json
    # then, continuing from the last checkpoint up to 40 steps:
    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_configs/zero2_muon.json --steps 40 --resume
    # the launcher's commented HJSON configs work as they are:
    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_configs/zero2_muon.hjson

``training_arguments`` loads JSON or HJSON (transformers reads config paths with ``json.load``),
takes the optimizer values the config sets concretely (the Trainer stops when its own arguments
differ), sets ``use_cpu`` on a machine without GPUs, and refuses combinations that would
otherwise fail late or silently (see docs/USAGE.md, "Trainer traps").

``--learning-rate`` is the Muon learning rate where the config says ``"lr": "auto"`` (the JSON
config); the auxiliary AdamW's is the config's ``adam_lr``. The final line is
``final loss X.XXX (start Y.YYY)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROG = "hf_trainer.py"
AUTO_DEFAULTS = {"learning_rate": 0.02, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed", default=str(REPO / "ds_configs" / "zero2_muon.json"),
                        help="DeepSpeed config, JSON or HJSON")
    parser.add_argument("--model-config", default=str(REPO / "examples" / "configs" / "qwen3-tiny.json"))
    parser.add_argument("--corpus", default=None, help="UTF-8 text file (default: the shipped corpus)")
    parser.add_argument("--output-dir", default="out/hf_trainer")
    parser.add_argument("--steps", type=int, default=20, help="Trainer max_steps")
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--resume", nargs="?", const=True, default=None,
                        help="resume from the last checkpoint in --output-dir, or from the given checkpoint")
    # These three default to the config's values; where it says "auto", to the value in brackets.
    parser.add_argument("--learning-rate", type=float, default=None, help="the Muon learning rate (0.02)")
    parser.add_argument("--batch-size", type=int, default=None, help="per_device_train_batch_size (4)")
    parser.add_argument("--grad-accum", type=int, default=None, help="gradient_accumulation_steps (1)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1,
                        help=argparse.SUPPRESS)  # passed by DeepSpeed's launcher
    return parser.parse_args(argv)


def fail(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import ds_canzona  # noqa: F401  (registers the DeepSpeed engine hook: the one ds_canzona line)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer

    from ds_canzona.data_utils import BlockDataset, load_corpus, token_blocks
    from ds_canzona.hf import ConfigFileError, check_trainer_config, trainer_values_from_config, training_arguments

    try:
        ds_config = check_trainer_config(args.deepspeed)
        model_config = json.loads(Path(args.model_config).read_text(encoding="utf-8"))
        text = load_corpus(args.corpus)
    except ConfigFileError as error:
        fail(str(error))
    except FileNotFoundError as error:
        fail(f"file not found: {error.filename or error}")
    except json.JSONDecodeError as error:
        fail(f"{args.model_config}: not valid JSON ({error})")

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(Qwen3Config(**model_config))
    dataset = BlockDataset(token_blocks(text, args.seq_len))

    # What the command line chose; where neither it nor the config says (the config's "auto"), this
    # script's defaults. training_arguments takes the rest from the config.
    chosen = {field: value for field, value in (("learning_rate", args.learning_rate),
                                                ("per_device_train_batch_size", args.batch_size),
                                                ("gradient_accumulation_steps", args.grad_accum),
                                                ("bf16", True if args.bf16 else None)) if value is not None}
    from_config = trainer_values_from_config(ds_config, {})
    for field, value in AUTO_DEFAULTS.items():
        if field not in chosen and field not in from_config:
            chosen[field] = value
    try:
        training_args = training_arguments(
            ds_config,
            **chosen,
            output_dir=args.output_dir,
            max_steps=args.steps,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="steps",
            save_steps=args.save_steps,
            seed=args.seed,
            data_seed=args.seed,
            dataloader_drop_last=True,
            report_to="none",
            disable_tqdm=os.environ.get("RANK", "0") != "0",
        )
    except ConfigFileError as error:
        fail(str(error))
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=args.resume)

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if trainer.is_world_process_zero() and losses:
        print(f"final loss {losses[-1]:.3f} (start {losses[0]:.3f})", flush=True)
    # Leaving with the process group alive lets gloo's threads be torn down at interpreter exit,
    # which can abort the process ("terminate called without an active exception").
    import torch.distributed as torch_dist
    if torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
