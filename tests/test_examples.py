"""The example jobs, end to end on two CPU ranks under DeepSpeed's launcher.

- examples/train_qwen3.py, ZeRO stage 1, 2 and 3 with Muon: the loss falls, checkpoints are
  written, and a run resumed from the middle checkpoint ends with the same losses and the same
  checkpoint tensors as the run that did not stop; wrong inputs end with one line and status 2.
- the shipped offload configs (ds_configs/zero2_muon_offload.hjson, zero3_muon_offload.hjson)
  under the launcher: train and save; the ZeRO-2 one resumes to the same checkpoint tensors.
- examples/hf_trainer.py (HF Trainer + ``import ds_canzona``): the loss falls, checkpoints are
  saved, and resuming from checkpoint-3 reaches the same weights at step 6 as the run that did
  not stop.
- examples/train_moe.py (DeepSpeed MoE layers, EP=2) with ds_configs/zero2_muon_moe.hjson: the
  loss falls and both families' plans are printed; a bad --ep ends with one line and status 2.
- the shipped corpus and the byte tokenizer.

Each launcher job gets its own master port (tests of other modules may run beside it) and its
own process group, killed whole when it outlives its timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train_qwen3.py"
HF_TRAINER = REPO / "examples" / "hf_trainer.py"
MOE = REPO / "examples" / "train_moe.py"
FINAL = re.compile(r"final loss (\d+\.\d+) \(start (\d+\.\d+)\)")
STEP = re.compile(r"^step (\d+)/\d+ loss (\S+)", re.MULTILINE)


def run(cmd: list[str], timeout: float, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # No LOCAL_SIZE: DeepSpeed's launcher sets it for each rank (docs/USAGE.md).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("LOCAL_SIZE", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} exceeded {timeout:.0f}s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(script: Path, *args: str, timeout: float = 150) -> str:
    """``deepspeed --num_gpus 2 script args``; the combined output, or a failure showing its tail."""
    cmd = [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()",
           "--num_gpus", "2", "--master_port", str(free_port()), str(script), *args]
    result = run(cmd, timeout)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(f"exit status {result.returncode}\n{output[-6000:]}")
    # A rank that aborts at interpreter exit after its work is done still fails the job; the
    # example destroys its process group first (tests/test_rank_exit.py has the harness's side).
    assert "terminate called" not in output, output[-3000:]
    return output


def final_losses(output: str) -> tuple[float, float]:
    match = FINAL.search(output)
    assert match, output[-3000:]
    return float(match.group(1)), float(match.group(2))


def tensors_of(tag_dir: Path) -> dict:
    """Every tensor of every safetensors file under a checkpoint tag, by key (file names may vary)."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(tag_dir.glob("*.safetensors")):
        for key, value in load_file(path).items():
            assert key not in out, f"{key} is saved twice under {tag_dir}"
            out[key] = value
    assert out, f"no safetensors under {tag_dir}"
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


# --------------------------------------------------------------------------- launcher job


# One launch per runtime: stage 1 runs the same runtime as stage 2, and its bitwise resume is
# tests/test_checkpoint.py's (DP=2 at stage 1), so the launcher job is not repeated for it.
@pytest.mark.parametrize("stage", [2, 3])
def test_launcher_trains_saves_and_resumes(stage: int, tmp_path: Path):
    config = str(REPO / "ds_configs" / f"zero{stage}_muon.hjson")
    full = tmp_path / "full"
    output = launch(TRAIN, "--deepspeed_config", config, "--steps", "6", "--save-dir", str(full),
                    "--save-every", "3", "--no-progress")
    final, start = final_losses(output)
    assert final < start - 0.5, output[-3000:]
    # The plan summary (log_plan) shows which runtime trained: owner placement at stage 3.
    assert ("ds_canzona ZeRO-3 owner plan" in output) == (stage == 3), output[-3000:]
    assert (full / "step3").is_dir() and (full / "step6").is_dir()
    assert (full / "latest").read_text().strip() == "step6"

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "step3", resumed / "step3")
    (resumed / "latest").write_text("step3")
    output2 = launch(TRAIN, "--deepspeed_config", config, "--steps", "6", "--save-dir", str(resumed), "--resume",
                     "--no-progress")
    assert "resumed from" in output2 and "ds_canzona: saved checkpoint 'step6'" in output2
    # "start" is still step 1's loss (kept in the checkpoint), and the line says where the run resumed
    assert final_losses(output2)[1] == final_losses(output)[1]
    assert re.search(r"over steps 1-6, resumed at step 3 \(step 4: \d+\.\d+\)", output2), output2[-3000:]
    steps_full = dict(STEP.findall(output))
    steps_resumed = dict(STEP.findall(output2))
    assert sorted(steps_resumed) == ["4", "5", "6"]
    assert {k: steps_full[k] for k in steps_resumed} == steps_resumed
    assert_same_tensors(tensors_of(full / "step6"), tensors_of(resumed / "step6"))


@pytest.mark.parametrize("config_name", ["zero2_muon_offload", "zero3_muon_offload"])
def test_launcher_trains_with_the_shipped_offload_configs(config_name: str, tmp_path: Path):
    """The shipped offload configs as a user runs them: trains, saves; ZeRO-2 also resumes bit for bit.

    One launch per config, and the resume only at ZeRO-2 (CI time); tests/test_offload.py checks
    offloaded checkpoints at every stage and across world sizes.
    """
    config = str(REPO / "ds_configs" / f"{config_name}.hjson")
    steps, save_every = (4, 2) if config_name.startswith("zero2") else (3, 3)
    full = tmp_path / "full"
    output = launch(TRAIN, "--deepspeed_config", config, "--steps", str(steps), "--save-dir", str(full),
                    "--save-every", str(save_every), "--no-progress")
    final, start = final_losses(output)
    assert final < start - 0.3, output[-3000:]
    # Rank 0's plan log says the owners' state is on the host, and which runtime trained.
    assert "ds_canzona offload_optimizer cpu: owned fp32 masters and optimizer state in host memory" in output
    assert ("ds_canzona ZeRO-3 owner plan" in output) == config_name.startswith("zero3"), output[-3000:]
    assert (full / "latest").read_text().strip() == f"step{steps}"
    if not config_name.startswith("zero2"):
        return
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / f"step{save_every}", resumed / f"step{save_every}")
    (resumed / "latest").write_text(f"step{save_every}")
    output2 = launch(TRAIN, "--deepspeed_config", config, "--steps", str(steps), "--save-dir", str(resumed),
                     "--resume", "--no-progress")
    assert "resumed from" in output2, output2[-3000:]
    steps_full, steps_resumed = dict(STEP.findall(output)), dict(STEP.findall(output2))
    assert sorted(steps_resumed) == [str(s) for s in range(save_every + 1, steps + 1)]
    assert {k: steps_full[k] for k in steps_resumed} == steps_resumed
    assert_same_tensors(tensors_of(full / f"step{steps}"), tensors_of(resumed / f"step{steps}"))


def run_script(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, str(TRAIN), *args], timeout=90)


def assert_usage_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("train_qwen3.py: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_launcher_trains_the_moe_example_with_expert_parallelism():
    # examples/train_moe.py with ds_configs/zero2_muon_moe.hjson: DeepSpeed MoE layers, EP=2 on two
    # ranks (each expert-data-parallel group a single rank), both families' plans printed.
    output = launch(MOE, "--ep", "2", "--steps", "8")
    final, start = final_losses(output)
    assert final < start - 0.3, (final, start)
    assert "family dense (" in output and "family ep_size_2 (" in output, output[-3000:]
    bad = run([sys.executable, str(MOE), "--ep", "3"], timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--ep 3 must divide the world size 1" in bad.stderr


def test_launcher_job_reports_bad_inputs_in_one_line(tmp_path: Path):
    config = str(REPO / "ds_configs" / "zero2_muon.hjson")
    assert_usage_error(run_script("--deepspeed_config", str(tmp_path / "nope.hjson")), "not found", "nope.hjson")
    bad = tmp_path / "bad.hjson"
    bad.write_text("{\n  zero_optimization: {stage: 2\n")
    assert_usage_error(run_script("--deepspeed_config", str(bad)), "bad.hjson", "not valid HJSON", "line")
    assert_usage_error(run_script("--deepspeed_config", config, "--model-config", str(tmp_path / "m.json")),
                       "model config not found")
    broken_model = tmp_path / "model.json"
    broken_model.write_text('{"hidden_size": 64,')
    assert_usage_error(run_script("--deepspeed_config", config, "--model-config", str(broken_model)),
                       "model.json", "not valid JSON")
    assert_usage_error(run_script("--deepspeed_config", config, "--corpus", str(tmp_path / "c.txt")),
                       "corpus file not found")
    trainer_file = str(REPO / "ds_configs" / "zero2_muon.json")
    assert_usage_error(run_script("--deepspeed_config", trainer_file), "'auto'", "HF Trainer")
    unknown = tmp_path / "unknown.hjson"
    unknown.write_text((REPO / "ds_configs" / "zero2_muon.hjson").read_text().replace("alpha: 1.0", "alpah: 1.0"))
    assert_usage_error(run_script("--deepspeed_config", str(unknown)), "unknown key 'canzona.alpah'")


# --------------------------------------------------------------------------- HF Trainer


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("hf") / "full"
    output = launch(HF_TRAINER, "--steps", "6", "--save-steps", "3", "--output-dir", str(out), timeout=200)
    return out, output


def test_trainer_loss_falls_and_checkpoints(trainer_run):
    out, output = trainer_run
    final, start = final_losses(output)
    assert final < start - 0.5, output[-3000:]
    for step in (3, 6):
        checkpoint = out / f"checkpoint-{step}"
        assert (checkpoint / "model.safetensors").is_file()
        assert (checkpoint / f"global_step{step}").is_dir(), "the DeepSpeed engine's own checkpoint"
        assert (checkpoint / "trainer_state.json").is_file()


def test_trainer_resume_continues_like_an_uninterrupted_run(trainer_run, tmp_path: Path):
    full, _ = trainer_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    launch(HF_TRAINER, "--steps", "6", "--save-steps", "3", "--output-dir", str(resumed), "--resume", timeout=200)
    from safetensors.torch import load_file

    assert_same_tensors(load_file(full / "checkpoint-6" / "model.safetensors"),
                        load_file(resumed / "checkpoint-6" / "model.safetensors"))


# --------------------------------------------------------------------------- data


def test_shipped_corpus_is_the_generators_output_and_small():
    from ds_canzona.data_utils import DEFAULT_CORPUS, generate_corpus

    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    assert text == generate_corpus()
    assert 50_000 < len(text.encode("utf-8")) < 100_000


def test_byte_tokenizer_round_trip_and_blocks():
    from ds_canzona.data_utils import ByteTokenizer, token_blocks

    tok = ByteTokenizer()
    text = "Mira walked to the bridge. Grüße, naïve café!"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert max(ids) < tok.vocab_size == 259
    assert tok.decode(ids) == text
    blocks = token_blocks(text * 10, 16, tok)
    assert blocks.shape[1] == 16 and (blocks[:, 0] == tok.bos_token_id).all()
    assert tok.decode(blocks[0, 1:]) == text[:15]
    with pytest.raises(ValueError):
        token_blocks("ab", 16, tok)
