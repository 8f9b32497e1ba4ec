"""The time estimate printed before make all & co.: what one run adds up to, worked by hand."""

from __future__ import annotations

import pytest
from test_reliability import cli_config

from hif8qat.launch.time_estimate import EVAL_SETUP_S, Costs, run_seconds

COSTS = Costs(numerics="bf16", load_s=5.0, train_step_s=2.0, qat_step_s=3.0, eval_token_s=1e-3,
              quant_eval_token_s=2e-3)


def test_a_plain_run_is_its_steps_one_evaluation_and_two_loads():
    cfg = cli_config(["experiment=exp1", "profile=mini", "profile.steps=40"])
    assert not cfg.quant.enabled and list(cfg.eval.modes) == ["bf16"]
    # 40 plain steps x 2 s + 10,000 tokens x 1 ms + setup + a load for training and one for the evaluation
    assert run_seconds(cfg, COSTS, 10_000) == pytest.approx(80 + 10 + EVAL_SETUP_S + 2 * 5)


def test_a_quantized_run_counts_its_warmup_its_quantized_steps_and_every_evaluation_mode():
    cfg = cli_config(["experiment=exp8", "profile=mini", "profile.steps=40", "eval.modes=[bf16,hif8]"])
    warmup = cfg.quant.bf16_warmup_steps
    assert cfg.quant.enabled and 0 < warmup < 40
    expected = (warmup * 2.0 + (40 - warmup) * 3.0  # plain warmup steps, then quantized ones
                + 10_000 * 1e-3 + 10_000 * 2e-3 + 2 * EVAL_SETUP_S  # the bf16 and the quantized evaluation
                + 3 * 5.0  # loads: training and two evaluation modes
                # held-out distances on 32 windows x 128 = 4,096 tokens: a load and a forward each for the
                # baseline's export (bf16), the run's bf16 and its quantized mode
                + 3 * 5.0 + 4096 * 1e-3 + 4096 * 1e-3 + 4096 * 2e-3)
    assert run_seconds(cfg, COSTS, 10_000) == pytest.approx(expected)


def test_the_estimate_says_each_phase_before_it_runs_and_how_long_measuring_took(tmp_path, capsys):
    """Printed before make expN: a line per phase as it starts (the memory simulation, the configs, the model load,
    the plain steps, the evaluation forward, the quantized steps), then the total with the seconds it measured for.
    The tiny model stands in for the mini profile's so that the whole measurement runs in seconds."""
    from hif8qat.launch import time_estimate

    def config_for(profile, experiment, seed, extra):
        return cli_config([f"experiment={experiment}", "profile=smoke", f"seed={seed}", f"results_root={tmp_path}"])

    assert time_estimate.main(["--profile", "mini", "--experiments", "exp3", "--baseline", "exp1",
                               "--results-root", str(tmp_path), "--label", "make exp3"], config_for) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("estimate: make exp3: ")]
    phases = [line.split("] ", 1)[1] for line in lines if line.startswith("estimate: make exp3: [")]
    expected = ["simulating a training step's memory", "composing the configs", "loading ", "timing 2 training steps",
                "timing an evaluation forward", "converting to "]
    assert len(phases) == len(expected) and all(p.startswith(e) for p, e in zip(phases, expected, strict=True)), lines
    assert "2 run(s) to train and evaluate" in lines[-1] and "measured just now in " in lines[-1], lines[-1]
