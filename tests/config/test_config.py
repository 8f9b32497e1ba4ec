"""Config composition, validation and profile resolution (no model is loaded here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

from hif8qat.cli import command_line, hydra_config
from hif8qat.config.run_config import ConfigError, RunConfig, resolve_profile
from hif8qat.runs.folders import config_differences

ROOT = Path(__file__).resolve().parents[2]

EXPERIMENTS = hydra_config.known_experiments()
PROFILES = sorted(p.stem for p in (ROOT / "conf" / "profile").glob("*.yaml"))


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_config(overrides: list[str], resolve: bool = True) -> RunConfig:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(compose_cfg(overrides), resolve=True)
    cfg = RunConfig.from_dict(data, known_experiments=EXPERIMENTS, check_paths=False)
    return resolve_profile(cfg) if resolve else cfg


def test_all_eight_paper_experiments_exist():
    assert {f"exp{i}" for i in range(1, 9)} <= set(EXPERIMENTS)
    assert {"smoke", "mini", "paper"} <= set(PROFILES)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_under_every_profile(experiment, profile):
    cfg = run_config([f"experiment={experiment}", f"profile={profile}"])
    assert cfg.experiment.name == experiment
    assert cfg.profile.name == profile
    assert cfg.train.steps == (cfg.profile.steps or 10_000)
    if cfg.quant.enabled:
        depth = cfg.model_depth()
        assert all(0 <= b < depth for b in cfg.quant.high_precision_blocks)
        assert cfg.quant.bf16_warmup_steps < cfg.train.steps


def _unresolved(experiment: str) -> dict:
    return run_config([f"experiment={experiment}", "profile=paper"], resolve=False).to_dict()


def _matches(key: str, declared: list[str]) -> bool:
    return any(key == d or key.startswith(d + ".") for d in declared)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_differs_from_its_parent_exactly_in_declared_changes(experiment):
    cfg = _unresolved(experiment)
    meta = cfg["experiment"]
    if meta["derived_from"] is None:
        assert meta["changes"] == []
        return
    parent = _unresolved(meta["derived_from"])
    diff = [k for k in config_differences(cfg, parent) if not k.startswith("experiment.")]
    # Every differing setting is declared, and every declared change really differs.
    assert all(_matches(k, meta["changes"]) for k in diff), diff
    assert all(any(_matches(k, [d]) for k in diff) for d in meta["changes"]), (meta["changes"], diff)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_matches_its_baseline_outside_quantization(experiment):
    cfg = _unresolved(experiment)
    base = cfg["experiment"]["baseline"]
    if base is None:
        return
    diff = [k for k in config_differences(cfg, _unresolved(base)) if not k.startswith("experiment.")]
    assert diff and all(k.startswith("quant.") for k in diff), diff
    assert _unresolved(base)["quant"]["enabled"] is False


def test_paper_values_of_the_final_recipe():
    cfg = run_config(["experiment=exp8", "profile=paper"])
    assert cfg.train.lr == 1e-5 and cfg.train.steps == 10_000 and cfg.train.lr_warmup_steps == 300
    assert cfg.quant.training.algo == "max" and cfg.quant.training.history_len == 64
    assert cfg.quant.bf16_warmup_steps == 500
    assert cfg.quant.high_precision_blocks == [0, 1, 2, 24, 25]
    assert cfg.quant.training.high_precision_blocks == (0, 1, 2, 24, 25)  # what the conversion reads
    assert cfg.train.global_batch_size == 1024 and cfg.train.seq_len == 1024
    assert cfg.experiment.baseline == "exp7"


def test_one_default_scope_for_the_library_the_pipeline_and_the_yaml():
    """The quant YAML states every key (so that a command line overrides it without `+`), the scope too: it must
    be the one default the library and a config without the key use."""
    import yaml

    from hif8qat import Hif8TrainingConfig
    from hif8qat.quant.blocks import DEFAULT_SCOPE

    stated = yaml.safe_load((ROOT / "conf" / "quant" / "hif8.yaml").read_text())["scope"]
    assert stated == DEFAULT_SCOPE == Hif8TrainingConfig().scope
    assert RunConfig.from_dict({}, check_paths=False).quant.training.scope == DEFAULT_SCOPE
    assert run_config(["experiment=exp1", "profile=smoke", "quant=hif8"]).quant.training.scope == DEFAULT_SCOPE


def test_a_library_config_error_is_structured_and_the_pipeline_words_it_as_the_setting():
    """The library's config names the field, the value and what is allowed as attributes (no text to parse); the
    pipeline says quant.<field> as the YAML writes it, in its one error form."""
    from hif8qat import Hif8TrainingConfig
    from hif8qat.scaling.settings import SettingError

    with pytest.raises(SettingError) as err:
        Hif8TrainingConfig(history_len=0)
    assert (err.value.owner, err.value.field, err.value.value, err.value.allowed) == (
        "Hif8TrainingConfig", "history_len", 0, "an integer >= 1")
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"quant": {"history_len": 0}}, check_paths=False)
    assert str(err.value) == "invalid setting quant.history_len=0: allowed an integer >= 1"
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"quant": {"scope": "everything"}}, check_paths=False)
    assert str(err.value) == "invalid setting quant.scope='everything': allowed one of mlp, attn_mlp"


def test_profile_scales_step_valued_settings_and_maps_blocks_to_depth():
    cfg = run_config(["experiment=exp4", "profile=paper", "profile.steps=1000",
                      "quant.high_precision_blocks=first3_last2"])
    assert cfg.train.steps == 1000 and cfg.train.lr_warmup_steps == 30
    assert cfg.quant.training.algo == {0: "most_recent", 100: "exp_smooth"}
    assert cfg.quant.training.interval == {0: 1, 100: 10}
    mini = run_config(["experiment=exp8", "profile=mini"])
    assert mini.quant.high_precision_blocks == [0, 1, 2, 28, 29]  # SmolLM2 has 30 blocks
    assert mini.train.lr == 1e-5 and mini.quant.training.history_len == 64  # not scaled
    # Resolving twice changes nothing.
    assert resolve_profile(mini).to_dict() == mini.to_dict()


BAD_SETTINGS = [
    ("quant.history_len=0", "quant.history_len"),
    ("quant.history_len=-3", "quant.history_len"),
    ("quant.algo=median", "quant.algo"),
    ("train.lr=0", "train.lr"),
    ("train.lr=-1e-4", "train.lr"),
    ("quant.bf16_warmup_steps=20000", "quant.bf16_warmup_steps"),
    ("train.lr_warmup_steps=10000", "train.lr_warmup_steps"),
    ("quant.high_precision_blocks=[0,40]", "quant.high_precision_blocks"),
    ("quant.high_precision_blocks=firstthree", "quant.high_precision_blocks"),
    ("quant.scope=everything", "quant.scope"),
    ("quant.interval={5:1}", "quant.interval"),
    ("quant.interval=0", "quant.interval"),
    ("quant.amax_reduce=mean", "quant.amax_reduce"),
    ("quant.history_unit=epoch", "quant.history_unit"),
    ("train.global_batch_size=1000", "train.global_batch_size"),
    ("stage=deploy", "stage"),
    ("experiment.baseline=exp42", "experiment.baseline"),
    ("+train.learning_rate=1e-4", "train.learning_rate"),
    ("eval.modes=[fp8]", "eval.modes"),
    ("train.autocast=fp16", "train.autocast"),
    ("eval.device=tpu", "eval.device"),
    ("eval.dtype=fp16", "eval.dtype"),
]


@pytest.mark.parametrize("override,setting", BAD_SETTINGS)
def test_bad_setting_is_rejected_with_its_name(override, setting):
    with pytest.raises(ConfigError) as err:
        run_config(["experiment=exp8", "profile=paper", override])
    assert setting in str(err.value) and "allowed" in str(err.value)


def test_missing_model_path_is_rejected():
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(compose_cfg(["experiment=exp8", "model.name=/no/such/model"]), resolve=True)
    with pytest.raises(ConfigError, match="model.name"):
        RunConfig.from_dict(data, known_experiments=EXPERIMENTS)


def test_unknown_experiment_lists_the_available_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_cfg(["experiment=exp42"])
    assert "exp8" in str(err.value)


def test_run_tag_keeps_only_training_overrides():
    tag = hydra_config.run_tag_from_overrides(
        ["experiment=exp6", "seed=1", "quant.history_len=16", "eval.limit=4", "train.resume=never", "train.lr=2e-5"])
    assert tag == "quant.history_len=16,train.lr=2e-5"


def test_cli_rejects_bad_setting_before_loading_anything(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=exp8", "profile=smoke",
                          "quant.history_len=0", f"results_root={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "quant.history_len" in out.stderr and "allowed" in out.stderr
    assert not any(tmp_path.iterdir())  # no run folder was created


def test_the_baseline_query_answers_from_the_composed_config():
    for name in EXPERIMENTS:
        baseline = run_config([f"experiment={name}"], resolve=False).experiment.baseline
        assert command_line.experiment_baseline(name) == baseline
    assert command_line.experiment_baseline("exp8") == "exp7" and command_line.experiment_baseline("exp1") is None
    # the run's whole line counts: a baseline named on the command line is the one the run pairs with
    assert command_line.experiment_baseline("exp3", ["experiment.baseline=exp2"]) == "exp2"


@pytest.mark.parametrize("line,needles", [
    (["exp42"], ["experiment='exp42'", "allowed one of exp1"]),
    (["exp3", "quant.history_len=0"], ["quant.history_len"]),
    (["exp3", "quant.bogus=1"], ["unknown setting quant.bogus"]),
])
def test_make_expn_refuses_a_bad_line_before_its_baseline_trains(line, needles):
    # `make exp3 ARGS=...` asks run.py for the baseline first: a bad experiment or setting ends there, as one
    # error line on stderr and nothing on stdout (which make reads as the baseline's name).
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "--baseline", *line], capture_output=True, text=True,
                         timeout=120)
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert out.returncode == 2 and out.stdout == "" and len(errors) == 1, (out.stdout, out.stderr[-2000:])
    assert all(n in errors[0] for n in needles), errors[0]
    assert "Traceback" not in out.stderr


def test_the_baseline_query_prints_only_the_baseline():
    for name, answer in (("exp3", "exp1\n"), ("exp1", "")):
        out = subprocess.run([sys.executable, str(ROOT / "run.py"), "--baseline", name, "profile=smoke", "seed=0",
                              "stage=all"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout == answer, (out.stdout, out.stderr[-2000:])


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available(),
                    reason="needs a machine without CUDA")
def test_cli_rejects_an_evaluation_device_it_lacks_before_training(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=exp8", "profile=smoke", "stage=all",
                          "eval.device=cuda", f"results_root={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]  # a user's error: exit 2, not a crash
    assert "eval.device=cuda" in out.stderr and "no CUDA device" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing trained, no run folder


def test_mini_profile_evaluates_real_benchmarks_on_fixed_subsets():
    cfg = run_config(["experiment=exp3", "profile=mini"])
    assert cfg.eval.tasks == ["mmlu_continuation", "hellaswag", "arc_challenge"] and cfg.eval.offline_data
    assert all(isinstance(n, int) and n >= 100 for n in cfg.eval.subset.values())  # hundreds of items per task
    assert cfg.eval.modes == ["bf16"] and run_config(["experiment=exp8", "profile=mini"]).eval.modes == ["bf16", "hif8"]
    assert run_config(["experiment=exp3", "profile=mini", "eval.subset=full"]).eval.subset == "full"
    assert run_config(["experiment=exp3", "profile=smoke"]).eval.tasks[0] == "mini_mmlu"  # CI stays offline-generated
    with pytest.raises(ConfigError, match=r"eval.subset.hellaswag=0.*> 0"):
        run_config(["experiment=exp3", "profile=mini", "eval.subset.hellaswag=0"])
    with pytest.raises(ConfigError, match=r"eval.subset.nope.*keys among eval.tasks"):
        run_config(["experiment=exp3", "profile=mini", "+eval.subset.nope=5"])
    with pytest.raises(ConfigError, match=r"eval.subset='some'"):
        run_config(["experiment=exp3", "profile=mini", "eval.subset=some"])
