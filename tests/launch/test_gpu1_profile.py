"""The one-GPU profile (profile=gpu1): its settings are the paper's scaled by 500 / 10,000 with 8 quantizer calls
per optimizer step, rehearsed on CPU with a tiny model for a few steps, and `make expN PROFILE=gpu1` gets an
estimate from FLOPs that says it is one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_reliability import cli_config

from hif8qat.config.run_config import resolve_profile
from hif8qat.launch import time_estimate
from hif8qat.models.pangu import OPENPANGU_EMBEDDED_1B_CONFIG, pangu_llama_config

ROOT = Path(__file__).resolve().parents[2]


def test_gpu1_scales_the_paper_schedule_and_keeps_8_calls_per_step():
    paper = {e: resolve_profile(cli_config([f"experiment={e}", "profile=paper"])) for e in ("exp3", "exp4", "exp6")}
    gpu1 = {e: resolve_profile(cli_config([f"experiment={e}", "profile=gpu1"])) for e in ("exp1", "exp3", "exp4",
                                                                                         "exp6")}
    factor = gpu1["exp1"].train.steps / paper["exp3"].train.steps
    for cfg in gpu1.values():
        assert cfg.train.steps == 500 and cfg.model.name == "openpangu_embedded_1b"
        assert (cfg.train.micro_batch_size, cfg.train.seq_len, cfg.train.autocast) == (4, 1024, "bf16")
        assert cfg.grad_accum_steps(1) == 8  # one process: 8 micro-batches, so 8 quantizer calls, per step
        assert cfg.train.lr_warmup_steps == round(300 * factor)
        assert cfg.eval.num_fewshot == {"mmlu": 5, "hellaswag": 10, "arc_challenge": 25}
    # the paper runs have 8 calls per step too (16 x 8 accumulation on each of 8 ranks)
    assert paper["exp3"].grad_accum_steps(8) == 8
    assert gpu1["exp3"].quant.training.interval == {0: 1, round(1000 * factor): 10}
    assert gpu1["exp4"].quant.training.algo == {0: "most_recent", round(1000 * factor): "exp_smooth"}
    assert gpu1["exp6"].quant.bf16_warmup_steps == round(500 * factor)
    for e in ("exp3", "exp4", "exp6"):  # the windows keep the paper's length, so cover the same steps
        assert gpu1[e].quant.training.history_len == paper[e].quant.training.history_len
        assert gpu1[e].quant.high_precision_blocks == paper[e].quant.high_precision_blocks


def test_the_1b_flops_per_token_count_every_multiplying_parameter():
    """6 N over the Linear weights of the 1B built on the meta device (the tied head multiplies too), plus
    attention's 12 L d T: the planning figure of about 7.4 GFLOP per token at seq 1024."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(pangu_llama_config(OPENPANGU_EMBEDDED_1B_CONFIG))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    train, forward = time_estimate.flops_per_token(OPENPANGU_EMBEDDED_1B_CONFIG, 1024)
    attention = 26 * 1536 * 1024
    assert train == 6 * linear + 12 * attention and forward == 2 * linear + 4 * attention
    assert 7.3e9 < train < 7.5e9


def test_the_gpu1_estimate_is_labelled_as_one_from_flops(tmp_path, capsys):
    def config_for(profile, experiment, seed, extra):
        return resolve_profile(cli_config([f"experiment={experiment}", f"profile={profile}", f"seed={seed}",
                                           *extra]))

    time_estimate.main(["--profile", "gpu1", "--experiments", "exp1", "exp3", "exp4", "exp6", "--label", "x",
                        "--results-root", str(tmp_path)], config_for)
    line = capsys.readouterr().out
    assert "4 run(s)" in line and "from FLOPs, not measured" in line and "TFLOP/s" in line, line
    # the profile's promise: the four runs, evaluations included, inside one hour at the stated throughput
    minutes = int(re.search(r"about (\d+) min", line).group(1))
    assert minutes <= 60, line


@pytest.mark.slow
def test_a_cpu_rehearsal_of_gpu1_runs_its_steps_accumulation_and_calls(tmp_path):
    """exp4 at profile=gpu1 with a tiny model (the profile's batch, accumulation, schedule and quantization; only
    the model, sequence length, data and device changed), stopped by SIGTERM after a few steps: its checkpoint and
    log hold what the profile says."""
    root = tmp_path / "runs"
    env = {**os.environ, "HIF8QAT_COMPILE": "0"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), "experiment=exp4", "profile=gpu1", "stage=train", "model.name=tiny:2",
         "data.source=mini", "train.seq_len=16", "train.device=cpu", "train.autocast=none", "train.num_threads=1",
         "data.eval_windows=2", f"results_root={root}", "logger.progress_bar=false"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            logs = list(root.glob("gpu1/exp4/*/metrics.jsonl"))
            if logs and len(logs[0].read_text().splitlines()) >= 3:
                break
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "checkpointed at step" in err, err[-3000:]
    (run_dir,) = root.glob("gpu1/exp4/*")
    cfg = yaml.safe_load((run_dir / "config_resolved.yaml").read_text())
    assert cfg["train"]["steps"] == 500 and cfg["train"]["lr_warmup_steps"] == 15
    assert cfg["quant"]["interval"] == {0: 1, 50: 10}
    assert cfg["quant"]["algo"] == {0: "most_recent", 50: "exp_smooth"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    for r in steps:  # the scaled LR warmup, linear to the peak at step 15
        assert r["lr"] == pytest.approx(1e-4 * r["step"] / 15)
    tokens = [r["tokens"] for r in steps]
    assert all(b - a == 32 * 16 for a, b in zip(tokens, tokens[1:]))  # 4 x 8 accumulated sequences of 16
    (ckpt,) = (run_dir / "checkpoints").glob("step_*")
    done = int(ckpt.name.split("_")[1])
    state = torch.load(ckpt / "rank000.pt", weights_only=False)
    assert state["data"]["position"] == 32 * done
    totals = {k: int(v) for k, v in state["scalers"].items() if k.endswith(".total")}
    histories = {k: v.numel() for k, v in state["scalers"].items() if k.endswith(".history")}
    assert totals and set(totals.values()) == {8 * done}  # every quantizer: 8 calls per optimizer step
    assert set(histories.values()) == {30}
