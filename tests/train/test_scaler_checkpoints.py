"""A rank's scalers in a checkpoint: the scaler entries of its model.state_dict(), beside the shared weights; a
checkpoint written in the former layout (``quant_state_dict``'s keys under ``"quant"``) still resumes bit for bit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from conftest import assert_same_state
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from hif8qat.config.numerics import train_numerics
from hif8qat.config.run_config import RunConfig, resolve_profile
from hif8qat.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
# exp4's schedules (exp_smooth from step 1: its optional state entries), stochastic rounding (the bank's generator
# must come back too), checkpoints at steps 4 and 8
SETTINGS = ("experiment=exp4", "quant.grad_rounding=stochastic", "train.checkpoint_every=4")


def _train(cfg: RunConfig, run_dir: Path) -> None:
    train(cfg, run_dir, numerics=train_numerics(cfg))


def _smoke(tmp_path: Path, *overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=["profile=smoke", "stage=train", "logger.progress_bar=false",
                                                            "train.num_threads=1", f"results_root={tmp_path}",
                                                            *SETTINGS, *overrides])
    return resolve_profile(RunConfig.from_dict(OmegaConf.to_container(composed, resolve=True), check_paths=False))


def _rows(folder: Path) -> list[tuple]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


def _former_key(key: str) -> str:
    """The former rank-state key of a scaler entry of model.state_dict(): ``{module}.hif8_scaler.[{site}.]{role}.
    {key}`` was ``{module}.[{site}.]{role}.{key}``, ``{module}.hif8_scaler.enabled`` was ``{module}.enabled``, the
    bank's generator (``hif8qat_bank.*``) kept its name."""
    return key.replace(".hif8_scaler.", ".")


def _as_former_layout(new: Path, old: Path) -> None:
    """Copy checkpoint ``new`` to ``old`` as the trainer wrote it before: the rank's scalers under ``"quant"`` in
    the former keys (no settings record), the manifest's entry of the rewritten file updated."""
    shutil.copytree(new, old)
    state = torch.load(old / "rank000.pt", weights_only=True)
    scalers = state.pop("scalers")
    state["quant"] = {_former_key(k): v for k, v in scalers.items() if not k.endswith(".hif8_scaler.settings")}
    torch.save(state, old / "rank000.pt")
    manifest = json.loads((old / "COMPLETE").read_text())
    data = (old / "rank000.pt").read_bytes()
    manifest["files"]["rank000.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (old / "COMPLETE").write_text(json.dumps(manifest, indent=1) + "\n")


def test_scalers_travel_per_rank_as_state_dict_entries_and_the_former_layout_resumes_bit_for_bit(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("HIF8QAT_COMPILE", "0")  # the eager quantizer: bit-identical, no compile warm-up
    whole = tmp_path / "whole"
    whole.mkdir()
    _train(_smoke(tmp_path), whole)
    step4 = whole / "checkpoints" / "step_0000004"

    # the weights' file holds the weights only; the rank's state holds its scalers as model.state_dict() entries
    assert not [k for k in load_file(step4 / "model.safetensors") if "hif8_scaler" in k or "hif8qat_bank" in k]
    rank = torch.load(step4 / "rank000.pt", weights_only=True)
    assert "quant" not in rank and rank["scalers"]
    assert all(".hif8_scaler." in k or k.startswith("hif8qat_bank.") for k in rank["scalers"])
    assert any(k.endswith(".hif8_scaler.W.history") for k in rank["scalers"])
    assert any(k.startswith("hif8qat_bank.") for k in rank["scalers"])  # stochastic rounding's generator
    assert any(".hif8_scaler.A.es_" in k for k in rank["scalers"])  # exp_smooth's entries, which a fresh state lacks

    former = tmp_path / "former" / "step_0000004"
    _as_former_layout(step4, former)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    _train(_smoke(tmp_path, f"train.resume={former}"), resumed)
    assert [r[0] for r in _rows(resumed)] == list(range(4, 8))
    assert _rows(resumed) == _rows(whole)[4:]
    mine, theirs = (f / "checkpoints" / "step_0000008" for f in (resumed, whole))
    assert_same_state(load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors"), "model")
    for name in ("trainer.pt", "rank000.pt"):
        assert_same_state(torch.load(mine / name, weights_only=True), torch.load(theirs / name, weights_only=True),
                          name)
