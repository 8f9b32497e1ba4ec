"""Pairing a run with its baseline: same seed and same training settings, or no pair and the reason."""

import yaml

from hif8qat.runs.folders import find_baseline_run


def _cfg(exp, seed, *, lr=1e-4, quant=False, tag="", **extra):
    cfg = {"experiment": {"name": exp, "description": f"{exp} run"}, "seed": seed, "run_tag": tag,
           "train": {"lr": lr, "steps": 40, "log_every": 1, "checkpoint_every": 20},
           "quant": {"enabled": quant, "algo": "max" if quant else None},
           "eval": {"tasks": ["arc_challenge"]}, "logger": {"wandb": False}}
    for dotted, value in extra.items():
        sect, key = dotted.split("__")
        cfg[sect][key] = value
    return cfg


def _run(root, exp, name, cfg, done=True):
    d = root / "mini" / exp / name
    d.mkdir(parents=True)
    (d / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    if done:
        (d / "DONE").write_text("")
    return d


def test_same_seed_and_training_settings_pair_and_nothing_else(tmp_path):
    _run(tmp_path, "exp7", "seed0", _cfg("exp7", 0))
    _run(tmp_path, "exp7", "seed1", _cfg("exp7", 1))
    run = _run(tmp_path, "exp8", "seed1", _cfg("exp8", 1, quant=True))
    path, why = find_baseline_run(tmp_path, "mini", "exp7", run)
    assert path == tmp_path / "mini" / "exp7" / "seed1" and why == ""
    # another seed is never a fallback: no pair, and the reason names the seeds there are
    lone = _run(tmp_path, "exp8", "seed2", _cfg("exp8", 2, quant=True))
    path, why = find_baseline_run(tmp_path, "mini", "exp7", lone)
    assert path is None and "seed 2" in why and "its seeds: 0, 1" in why
    # no such experiment at all
    path, why = find_baseline_run(tmp_path, "mini", "exp99", run)
    assert path is None and "exp99 has no run" in why


def test_settings_that_do_not_change_training_are_ignored(tmp_path):
    # the baseline logged, evaluated and checkpointed differently, and carries a run tag: still its pair
    base = _cfg("exp7", 0, tag="eval.limit=5", train__log_every=5, train__checkpoint_every=0)
    base["eval"]["tasks"] = ["hellaswag"]
    _run(tmp_path, "exp7", "seed0-eval.limit=5", base)
    run = _run(tmp_path, "exp8", "seed0", _cfg("exp8", 0, quant=True))
    path, why = find_baseline_run(tmp_path, "mini", "exp7", run)
    assert path is not None and path.name == "seed0-eval.limit=5", why


def test_a_training_setting_that_differs_breaks_the_pair(tmp_path):
    _run(tmp_path, "exp7", "seed0-train.lr=1e-3", _cfg("exp7", 0, lr=1e-3, tag="train.lr=1e-3"))
    run = _run(tmp_path, "exp8", "seed0", _cfg("exp8", 0, quant=True))
    path, why = find_baseline_run(tmp_path, "mini", "exp7", run)
    assert path is None and "seed0-train.lr=1e-3 differs in train.lr" in why
    # a derived-from pair may differ in the declared changes only: quant.* is no longer free
    _run(tmp_path, "exp6", "seed0", _cfg("exp6", 0, quant=True, quant__algo="most_recent"))
    path, why = find_baseline_run(tmp_path, "mini", "exp6", run, may_differ=["train.lr"])
    assert path is None and "quant.algo" in why
    path, why = find_baseline_run(tmp_path, "mini", "exp6", run, may_differ=["train.lr", "quant.algo"])
    assert path == tmp_path / "mini" / "exp6" / "seed0"


def test_archives_are_skipped_and_finished_runs_win(tmp_path):
    _run(tmp_path, "exp7", "seed0.old-20260101-000000", _cfg("exp7", 0))
    run = _run(tmp_path, "exp8", "seed0", _cfg("exp8", 0, quant=True))
    path, why = find_baseline_run(tmp_path, "mini", "exp7", run)
    assert path is None and "has no run" in why  # the archive alone is no run
    _run(tmp_path, "exp7", "seed0", _cfg("exp7", 0), done=False)
    _run(tmp_path, "exp7", "seed0-x", _cfg("exp7", 0, tag="x"), done=True)
    path, _ = find_baseline_run(tmp_path, "mini", "exp7", run)
    assert path.name == "seed0-x"  # the finished one, though tagged
