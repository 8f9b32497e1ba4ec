"""A scale target per role (``target``: one number, or {A, W, G}; MindSpeed's HiF8 recipe puts G at 224): its
validation, the older ``target_fwd`` / ``target_bwd`` configs, the experiments that use it, and the target each
role used in the telemetry, the per-layer dump and the export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from hif8qat import Hif8TrainingConfig
from hif8qat.config.numerics import resolve_run
from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.models.quant_files import QUANT_JSON, dump_telemetry, read_quant_export, save_quant_export
from hif8qat.quant.linear import _convert_model, quant_linears, set_step, step_telemetry
from hif8qat.runs.folders import training_differences
from hif8qat.scaling.settings import ScalingConfig

ROOT = Path(__file__).resolve().parents[2]
MINDSPEED = {"A": 15.0, "W": 15.0, "G": 224.0}


def compose_run(overrides: list[str]) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        data = OmegaConf.to_container(compose(config_name="config", overrides=overrides), resolve=True)
    return RunConfig.from_dict(data, check_paths=False)


def tiny_llama(num_layers=2, seed=0):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("kw,want", [
    ({}, [15.0, 15.0, 15.0]),
    ({"target": 224}, [224.0, 224.0, 224.0]),
    ({"target": MINDSPEED}, [15.0, 15.0, 224.0]),
    ({"target": {"G": 224}}, [15.0, 15.0, 224.0]),  # the roles left out keep target_fwd / target_bwd
    ({"target": {"G": 224}, "target_fwd": 12.0}, [12.0, 12.0, 224.0]),
    ({"target_fwd": 12.0, "target_bwd": 7.0}, [12.0, 12.0, 7.0]),  # the older spelling
])
def test_each_role_gets_its_target(kw, want):
    assert list(ScalingConfig(**kw).targets().values()) == want
    assert list(Hif8TrainingConfig(**kw).scaling().targets().values()) == want  # the library config holds it too


@pytest.mark.parametrize("kw,allowed", [
    ({"target": 0}, "mapping of roles A, W, G"),
    ({"target": -15.0}, "finite number > 0"),
    ({"target": math.inf}, "finite number > 0"),
    ({"target": True}, "finite number > 0"),
    ({"target": {}}, "mapping of roles A, W, G"),
    ({"target": {"X": 3.0}}, "mapping of roles A, W, G"),
    ({"target": {"G": "224"}}, "mapping of roles A, W, G"),
    ({"target": {"G": 224}, "target_bwd": 7.0}, "target_bwd is set"),  # two settings for G's target
    ({"target": 15, "target_fwd": 12.0}, "target_fwd is set"),
    ({"target": 224, "format": "hybrid"}, "format=hybrid"),  # FP8 targets come from the format
])
def test_a_bad_target_is_refused_naming_what_is_allowed(kw, allowed):
    with pytest.raises(ValueError, match=r"ScalingConfig\.target=") as err:
        ScalingConfig(**kw)
    assert allowed in str(err.value)


@pytest.mark.parametrize("override", ["quant.target=0", "quant.target={X:1}", "quant.target=many"])
def test_a_bad_quant_target_names_the_setting(override):
    with pytest.raises(ConfigError, match=r"invalid setting quant\.target=.*allowed null, a finite number > 0"):
        compose_run(["experiment=exp8", "profile=paper", override])


def test_the_target_from_the_command_line():
    assert compose_run(["experiment=exp2", "profile=paper", "quant.target=224"]).quant.training.targets() == \
        {"A": 224.0, "W": 224.0, "G": 224.0}
    cfg = compose_run(["experiment=exp2", "profile=paper", "quant.target={A:15,W:15,G:224}"])
    assert cfg.quant.training.target == MINDSPEED and cfg.to_dict()["quant"]["target"] == MINDSPEED


@pytest.mark.parametrize("exp,parent,baseline", [("exp14", "exp8", "exp7"), ("exp15", "exp2", "exp1")])
def test_the_gradient_target_experiments(exp, parent, baseline):
    cfg = compose_run([f"experiment={exp}", "profile=mini"])
    ref = compose_run([f"experiment={parent}", "profile=mini"])
    assert cfg.quant.training.targets() == MINDSPEED and ref.quant.training.targets() == {r: 15.0 for r in "AWG"}
    assert (cfg.experiment.derived_from, cfg.experiment.baseline, cfg.experiment.changes) == \
        (parent, baseline, ["quant.target"])
    # a pair for the report: they differ in the declared change only
    assert training_differences(cfg.to_dict(), ref.to_dict()) == ["quant.target"]
    assert training_differences(cfg.to_dict(), ref.to_dict(), may_differ=["quant.target"]) == []


@pytest.mark.parametrize("saved", sorted((ROOT / "results" / "reference_runs" / "mini")
                                          .glob("exp*/seed*/config_resolved.yaml"))
                         or [pytest.param(None, marks=pytest.mark.skip(reason="no committed reference runs"))])
def test_committed_configs_load_with_their_targets_and_still_pair(saved):
    """A run saved before ``target`` existed loads with its old targets (``target_fwd`` / ``target_bwd``), one saved
    with ``target`` with the targets it names; either still pairs with (and resumes as) a run of the same
    experiment saved now."""
    old = yaml.safe_load(saved.read_text())
    cfg = RunConfig.from_dict(old, check_paths=False)
    if "target" in old["quant"]:
        named = old["quant"]["target"]
        assert cfg.quant.training.targets() == (named if isinstance(named, dict) else {r: named for r in "AWG"})
    elif old["quant"].get("format", "hif8") == "hif8":
        assert cfg.quant.training.targets() == {"A": old["quant"]["target_fwd"], "W": old["quant"]["target_fwd"],
                                               "G": old["quant"]["target_bwd"]}
    # resumed now: train.optimizer_impl=auto keeps what the run recorded (a run saved before the setting: torch's
    # default AdamW), the rest as saved
    resumed = resolve_run(cfg, saved_optimizer_impl=old["train"].get("optimizer_impl", "torch_default"))
    assert training_differences(old, resumed.to_dict()) == []


def _trained(config: ScalingConfig, steps: int = 2):
    m = tiny_llama()
    _convert_model(m, "mlp", None, config)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        set_step(m, step)
        ids = torch.randint(0, 96, (2, 8), generator=gen)
        m(ids, labels=ids).loss.backward()
    return m


def test_the_gradients_are_scaled_to_their_own_target():
    # just-in-time scaling: each call's scale maps that call's own amax to the role's target
    m = _trained(ScalingConfig(algo="current", target=MINDSPEED, telemetry_stats_every=1))
    for _, layer in quant_linears(m):
        for role, scaler in layer.scalers():
            rec = scaler.telemetry_record()
            assert rec["amax"] * rec["scale"] == pytest.approx(MINDSPEED[role], rel=1e-6), role


def test_the_target_each_role_used_is_in_the_telemetry_the_dump_and_the_export(tmp_path):
    m = _trained(ScalingConfig(algo="max", history_len=4, target={"G": 224}))
    n = dump_telemetry(m, tmp_path / "telemetry.jsonl", step=1)
    lines = [json.loads(x) for x in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(lines) == n and {(r["role"], r["target"]) for r in lines} == set(MINDSPEED.items())
    tel = step_telemetry(m)
    assert {r: tel[f"tel/{r}/target"] for r in "AWG"} == MINDSPEED
    save_quant_export(m, tmp_path / "export")
    doc = json.loads((tmp_path / "export" / QUANT_JSON).read_text())
    assert doc["targets"] == MINDSPEED and doc["config"]["target"] == {"G": 224}
    # an export written before either key existed reads back with the targets it was trained with
    doc.pop("targets")
    doc["config"].pop("target")
    (tmp_path / "export" / QUANT_JSON).write_text(json.dumps(doc))
    assert read_quant_export(tmp_path / "export")["targets"] == {r: 15.0 for r in "AWG"}


def test_an_fp8_run_records_its_format_targets():
    tel = step_telemetry(_trained(ScalingConfig(format="hybrid", algo="max", history_len=4)))
    assert {r: tel[f"tel/{r}/target"] for r in "AWG"} == {"A": 448.0, "W": 448.0, "G": 57344.0}
