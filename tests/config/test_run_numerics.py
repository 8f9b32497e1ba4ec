"""A run's numerics: one typed value resolved from its config (training's and evaluation's), and a saved run's
read back through RunConfig."""

from __future__ import annotations

import pytest
import torch
import yaml
from test_config import run_config

from hif8qat import compute_dtype
from hif8qat.compute_dtype import Numerics
from hif8qat.config.numerics import EvalSettingError, run_numerics
from hif8qat.config.run_config import ConfigError
from hif8qat.evaluate.heldout import saved_eval_numerics
from hif8qat.runs.folders import load_run_config


@pytest.fixture
def no_native_bf16_no_gpu(monkeypatch):
    monkeypatch.setattr(compute_dtype, "native_bf16_supported", lambda device_type: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_resolved_value_is_never_auto_and_says_what_it_does():
    with pytest.raises(ValueError, match="numerics must be one of bf16, bf16_emulated, none, got 'auto'"):
        Numerics("auto")
    assert Numerics("bf16_emulated").emulates_bf16 and not Numerics("bf16").emulates_bf16
    assert (Numerics("bf16").autocast_dtype, Numerics("none").autocast_dtype) == (torch.bfloat16, None)
    assert Numerics("bf16_emulated", "cpu").describe()["numerics"] == "bf16_emulated"


def test_evaluation_follows_the_training_numerics_resolved_once(no_native_bf16_no_gpu):
    numerics = run_numerics(run_config(["experiment=exp1", "profile=mini", "train.autocast=auto"]))
    assert numerics.train == Numerics("bf16_emulated", "cpu")  # auto, on a CPU without native BF16
    assert (numerics.eval_device, numerics.eval) == ("cpu", numerics.train)  # eval.dtype=auto: the training's
    explicit = run_numerics(run_config(["experiment=exp1", "profile=mini", "eval.dtype=fp32"]))
    assert explicit.eval == Numerics("none", "cpu")  # fp32, the old name of none


def test_an_evaluation_device_this_machine_lacks_fails_only_a_stage_that_evaluates(no_native_bf16_no_gpu):
    with pytest.raises(EvalSettingError, match="eval.device=cuda but this machine has no CUDA device"):
        run_numerics(run_config(["experiment=exp1", "profile=mini", "stage=all", "eval.device=cuda"]))
    training = run_numerics(run_config(["experiment=exp1", "profile=mini", "stage=train", "eval.device=cuda"]))
    assert training.train == Numerics("bf16_emulated", "cpu") and training.eval is None


def _saved_run(tmp_path, **sections):
    cfg = run_config(["experiment=exp1", "profile=smoke"]).to_dict()
    for section, values in sections.items():
        cfg[section].update(values)
    del cfg["train"]["optimizer_impl"]  # a config saved before the setting existed
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config_resolved.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run_dir


def test_a_saved_run_is_read_back_as_a_run_config(tmp_path, no_native_bf16_no_gpu):
    run_dir = _saved_run(tmp_path, train={"autocast": "bf16_emulated"}, eval={"dtype": "auto"})
    assert load_run_config(run_dir).train.optimizer_impl == "torch_default"  # what it ran before the setting
    assert saved_eval_numerics(run_dir) == ("cpu", Numerics("bf16_emulated", "cpu"))
    assert saved_eval_numerics(run_dir, "cpu", "none") == ("cpu", Numerics("none", "cpu"))  # the CLI's overrides


def test_a_bad_saved_setting_is_named_as_the_setting_it_is(tmp_path):
    # as a raw dict, train.autocast's value reached the evaluation as eval.dtype and was named so
    run_dir = _saved_run(tmp_path, train={"autocast": "fp16"})
    with pytest.raises(ConfigError, match="invalid setting train.autocast='fp16'"):
        saved_eval_numerics(run_dir)
