"""quant.format / quant.margin / quant.algo=current: validation, the beyond-the-paper experiments, and the
delayed scaler running every format and ``current``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.formats.qdq import qdq_scaled_amax, target_for
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ScalingConfig

ROOT = Path(__file__).resolve().parents[2]


def compose_run(overrides: list[str]) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        data = OmegaConf.to_container(compose(config_name="config", overrides=overrides), resolve=True)
    return RunConfig.from_dict(data, check_paths=False)


BAD = [
    ("quant.format=fp8", "quant.format", "hybrid"),
    ("quant.format=e4m3fn", "quant.format", "e5m2"),
    ("quant.margin=-1", "quant.margin", "integer >= 0"),
    ("quant.margin=0.5", "quant.margin", "an integer"),  # the declared type answers first
    ("quant.margin=1", "quant.margin", "format=hif8"),  # the default format is hif8
    ("quant.algo=oracle", "quant.algo", "current"),
    ("quant.algo={0:max,4:now}", "quant.algo", "current"),
]


@pytest.mark.parametrize("override,setting,allowed", BAD)
def test_bad_format_settings_are_rejected_by_name(override, setting, allowed):
    with pytest.raises(ConfigError) as err:
        compose_run(["experiment=exp8", "profile=paper", override])
    msg = str(err.value)
    assert f"invalid setting {setting}=" in msg and "allowed" in msg and allowed in msg


@pytest.mark.parametrize("override,setting", [
    ("quant.target_fwd=10", "quant.target_fwd"),
    ("quant.target_bwd=7.5", "quant.target_bwd"),
    ("quant.grad_rounding=stochastic", "quant.grad_rounding"),
])
def test_hif8_only_settings_are_rejected_with_fp8(override, setting):
    with pytest.raises(ConfigError) as err:
        compose_run(["experiment=exp8", "profile=paper", "quant.format=hybrid", override])
    assert setting in str(err.value) and "format=hybrid" in str(err.value)
    compose_run(["experiment=exp8", "profile=paper", override])  # the same setting is fine with HiF8


def test_valid_format_settings_compose():
    cfg = compose_run(["experiment=exp8", "profile=paper", "quant.format=e5m2", "quant.margin=3",
                       "quant.algo={0:max,1000:current}"])
    training = cfg.quant.training
    assert training.format == "e5m2" and training.margin == 3 and training.algo == {0: "max", 1000: "current"}
    assert [target_for(training, r) for r in "AWG"] == [7168.0] * 3
    assert training.scaling().format == "e5m2"  # reaches the scaler's config


@pytest.mark.parametrize("exp,parent,baseline,format_,algo", [
    ("exp10", "exp2", "exp1", "hybrid", "most_recent"),
    ("exp11", "exp8", "exp7", "hybrid", "max"),
    ("exp12", "exp8", "exp7", "hif8", "current"),
    ("exp13", "exp2", "exp1", "hif8", "current"),
])
def test_beyond_the_paper_experiments(exp, parent, baseline, format_, algo):
    quant = compose_run([f"experiment={exp}", "profile=paper"]).quant
    ref_quant = compose_run([f"experiment={parent}", "profile=paper"]).quant
    cfg, ref = quant.training, ref_quant.training
    assert (cfg.format, cfg.algo) == (format_, algo)
    assert compose_run([f"experiment={exp}", "profile=paper"]).experiment.baseline == baseline
    # everything else as the parent (the full one-factor check is test_config's)
    assert (cfg.scope, cfg.history_len, quant.bf16_warmup_steps) == (ref.scope, ref.history_len,
                                                                     ref_quant.bf16_warmup_steps)
    targets = [target_for(cfg, r) for r in "AWG"]
    assert targets == ([448.0, 448.0, 57344.0] if format_ == "hybrid" else [15.0, 15.0, 15.0])


@pytest.mark.parametrize("kw,fmt,target", [({"format": "e4m3"}, "e4m3", 448.0), ({"format": "hybrid"}, "e4m3", 448.0),
                                           ({"algo": "current"}, "hif8", 15.0),
                                           ({"algo": {0: "max", 10: "current"}}, "hif8", 15.0)])
def test_the_delayed_scaler_runs_every_format_and_current(kw, fmt, target):
    x = torch.randn(64) * 3
    y = BankedScaler.standalone("A", ScalingConfig(**kw)).quantize(x)  # the first call: a cold start from x's own amax
    scale = torch.tensor(target / (x.abs().max().item() + 1e-12), dtype=torch.float64).to(torch.float32)
    assert torch.equal(y, qdq_scaled_amax(x, scale, fmt)[0])


def test_old_configs_without_the_new_fields_load_as_hif8():
    cfg = ScalingConfig.from_dict({"algo": "max", "history_len": 64})
    assert cfg.format == "hif8" and cfg.margin == 0 and target_for(cfg, "G") == 15.0
