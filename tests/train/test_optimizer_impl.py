"""train.optimizer_impl: fused AdamW where torch has it for the device, recorded in the run's config; a run saved
before the setting existed ran torch's default and keeps it when resumed; runs of different implementations are
not paired."""

from pathlib import Path

import pytest
import torch
import yaml

from hif8qat.cli.hydra_config import config_for
from hif8qat.config.numerics import resolve_run
from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.runs.folders import find_baseline_run, prepare_run_dir, release_run_dir
from hif8qat.train.loop import build_optimizer


def _smoke(root, *extra):
    return config_for("smoke", "exp1", 0, (f"results_root={root}", *extra))


def _save_run(cfg, *, impl):
    """A run folder of cfg whose saved config records impl (None: saved before the setting existed)."""
    saved = cfg.to_dict()
    if impl is None:
        del saved["train"]["optimizer_impl"]
    else:
        saved["train"]["optimizer_impl"] = impl
    run_dir = Path(cfg.results_root) / "smoke" / "exp1" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "config_resolved.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return run_dir


def test_a_new_cpu_run_records_fused_and_an_explicit_choice_is_kept(tmp_path):
    assert _smoke(tmp_path).train.optimizer_impl == "fused"  # torch has a fused AdamW for CPUs
    assert _smoke(tmp_path, "train.optimizer_impl=torch_default").train.optimizer_impl == "torch_default"
    assert resolve_run(RunConfig()).train.optimizer_impl == "fused"


def test_a_resumed_run_keeps_the_implementation_it_began_with(tmp_path):
    new = _smoke(tmp_path)
    run_dir = _save_run(new, impl=None)  # an unfinished run saved before the setting existed
    resumed = _smoke(tmp_path)
    assert resumed.train.optimizer_impl == "torch_default"
    try:  # and its saved config matches: it resumes instead of refusing for a changed setting
        assert prepare_run_dir(resumed) == (run_dir, "resume")
    finally:
        release_run_dir(run_dir)
    (run_dir / "config_resolved.yaml").write_text(yaml.safe_dump(new.to_dict(), sort_keys=False))
    assert _smoke(tmp_path).train.optimizer_impl == "fused"
    # force=true starts the run again: the device's choice
    _save_run(_smoke(tmp_path / "b"), impl="torch_default")
    assert _smoke(tmp_path / "b", "force=true").train.optimizer_impl == "fused"


def test_runs_of_other_implementations_are_not_paired(tmp_path):
    base = _smoke(tmp_path)
    old = base.to_dict()
    del old["train"]["optimizer_impl"]  # the baseline ran before the setting existed: torch's default
    folder = tmp_path / "smoke" / "exp1" / "seed0"
    folder.mkdir(parents=True)
    (folder / "config_resolved.yaml").write_text(yaml.safe_dump(old))
    for impl, paired in (("fused", False), ("torch_default", True)):
        run = tmp_path / "smoke" / "exp3" / f"seed0-{impl}"
        run.mkdir(parents=True)
        mine = base.to_dict()
        mine["train"]["optimizer_impl"] = impl
        (run / "config_resolved.yaml").write_text(yaml.safe_dump(mine))
        path, why = find_baseline_run(tmp_path, "smoke", "exp1", run)
        assert (path == folder) is paired
        assert paired or "train.optimizer_impl" in why


def test_the_optimizer_is_the_one_the_config_names():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = RunConfig()
    for impl, fused in (("fused", True), ("auto", True), ("torch_default", None)):
        cfg.train.optimizer_impl = impl
        optimizer = build_optimizer(model, cfg)
        assert optimizer.defaults["fused"] is fused and optimizer.defaults["foreach"] is None


def test_torch_default_updates_exactly_as_before_the_setting():
    """torch_default is what runs were made with; fused differs in the last bits for BF16 weights."""
    def trained(**options):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
        if options.pop("run_config", False):
            cfg = RunConfig()
            cfg.train.optimizer_impl = options["impl"]
            optimizer = build_optimizer(model, cfg)
        else:
            optimizer = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                                           {"params": [model.bias], "weight_decay": 0.0}], lr=1e-4,
                                          betas=(0.9, 0.95), eps=1e-8)
        for _ in range(3):
            model(torch.randn(8, 64, dtype=torch.bfloat16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model.weight.detach()

    old = trained()
    assert torch.equal(trained(run_config=True, impl="torch_default"), old)
    assert not torch.equal(trained(run_config=True, impl="fused"), old)


def test_an_unknown_implementation_is_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"train\.optimizer_impl='foreach'.*auto, fused, torch_default"):
        RunConfig.from_dict({"train": {"optimizer_impl": "foreach"}}, check_paths=False)
