"""The time estimate printed before make all & co.: what one run adds up to, worked by hand from its config, and what
the measurement times (the trainer's own model and step, each kind of step twice) with the clock scripted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from test_reliability import cli_config

from hif8qat.config.numerics import train_numerics
from hif8qat.launch import memory, recorded_evals, time_estimate
from hif8qat.launch.memory import GIB, SCREEN_MARGIN, generous_count
from hif8qat.launch.time_estimate import Costs, EvalWork, run_parts, run_seconds
from hif8qat.models.loading import model_config_facts
from hif8qat.quant.linear import quant_modules

COSTS = Costs(numerics="bf16", load_s=5.0, train_step_s=2.0, qat_step_s=3.0, eval_token_s=1e-3,
              quant_eval_token_s=2e-3, first_step_s=1.5, qat_start_s=7.0, heldout_batch_s=0.5, startup_s=4.0,
              write_byte_s=1e-9, eval_setup_s=15.0)
WORK = EvalWork(tokens=10_000, calls=100)
MODEL_BYTES, STATE_BYTES = 500_000_000, 3_000_000_000


def test_a_plain_run_is_its_start_its_steps_a_checkpoint_the_export_and_one_evaluation():
    cfg = cli_config(["experiment=exp1", "profile=mini"])
    assert not cfg.quant.enabled and list(cfg.eval.modes) == ["bf16"] and cfg.train.steps == 40
    parts = run_parts(cfg, COSTS, WORK, MODEL_BYTES, STATE_BYTES)
    assert parts["start"] == pytest.approx(4.0 + 5.0)  # the process's start and the model load
    # the first step's extra, 40 plain steps, the end-of-training held-out loss: 8 windows in 2 batches of 4
    assert parts["train"] == pytest.approx(1.5 + 40 * 2.0 + 2 * 0.5)
    # mini checkpoints at step 20 only (none at the end: keep_checkpoints_when_done=0), then the export
    assert parts["write"] == pytest.approx((3_000_000_000 + 500_000_000) * 1e-9)
    assert parts["evaluate"] == pytest.approx(5.0 + 15.0 + 10_000 * 1e-3)  # a load, lm-eval's setup, the forwards
    assert parts["heldout"] == 0.0  # only a quantized run compares held-out tokens
    assert run_seconds(cfg, COSTS, WORK, MODEL_BYTES, STATE_BYTES) == pytest.approx(sum(parts.values()))


def test_a_quantized_run_counts_its_warmup_its_quantized_steps_every_evaluation_mode_and_the_heldout_models():
    cfg = cli_config(["experiment=exp8", "profile=mini", "eval.modes=[bf16,hif8]"])
    warmup = cfg.quant.bf16_warmup_steps
    assert cfg.quant.enabled and 0 < warmup < 40 and cfg.experiment.baseline
    parts = run_parts(cfg, COSTS, WORK, MODEL_BYTES, STATE_BYTES)
    # plain warmup steps, the first quantized step's compile, quantized steps, the held-out loss quantized (2x)
    assert parts["train"] == pytest.approx(1.5 + warmup * 2.0 + 7.0 + (40 - warmup) * 3.0 + 2 * 0.5 * 2)
    assert parts["evaluate"] == pytest.approx(2 * (5.0 + 15.0) + 10_000 * 1e-3 + 10_000 * 2e-3)
    # 32 windows x 128 in batches of 4 through the baseline's export, the run's bf16 and its hif8 (2x the cost)
    assert parts["heldout"] == pytest.approx(3 * 5.0 + 8 * 0.5 + 8 * 0.5 + 8 * 0.5 * 2)


def test_the_modes_and_the_baseline_counted_are_the_configs():
    one = run_parts(cli_config(["experiment=exp3", "profile=mini"]), COSTS, WORK)
    two = run_parts(cli_config(["experiment=exp3", "profile=mini", "eval.modes=[bf16,hif8]"]), COSTS, WORK)
    assert two["evaluate"] - one["evaluate"] == pytest.approx(5.0 + 15.0 + 10_000 * 2e-3)  # the hif8 mode
    assert two["heldout"] - one["heldout"] == pytest.approx(5.0 + 8 * 0.5 * 2)  # and its held-out model
    alone = run_parts(cli_config(["experiment=exp3", "profile=mini", "experiment.baseline=null"]), COSTS, WORK)
    assert one["heldout"] - alone["heldout"] == pytest.approx(5.0 + 8 * 0.5)  # no baseline export to forward


def test_twice_the_steps_doubles_the_steps_part_of_training_only():
    short = cli_config(["experiment=exp3", "profile=mini"])
    long = cli_config(["experiment=exp3", "profile=mini", "profile.steps=80"])
    assert long.train.steps == 2 * short.train.steps
    a, b = run_parts(short, COSTS, WORK), run_parts(long, COSTS, WORK)
    assert b["train"] - a["train"] == pytest.approx(short.train.steps * 3.0)  # one more set of quantized steps
    assert a["evaluate"] == b["evaluate"] and a["heldout"] == b["heldout"]


def test_the_evaluation_workload_is_the_newest_recorded_one_scored_the_same_way_else_the_profiles_fallback(tmp_path):
    """Packed rows take a tenth of the cached way's calls: a record of one way never sizes the other's forward.
    A results.json without ``scoring`` was scored cached (the only way before packing)."""
    assert time_estimate.eval_work(tmp_path, "mini", "cached") == EvalWork(51_300, 227)
    assert time_estimate.eval_work(tmp_path, "mini", "packed") == EvalWork(51_000, 21)
    for name, tokens, calls, scoring in (("old", 40_000, 200, None), ("new", 30_000, 150, None),
                                         ("packed", 29_000, 14, "packed")):
        path = tmp_path / "mini" / name / "seed0" / "eval" / "bf16" / "results.json"
        path.parent.mkdir(parents=True)
        meta = {"eval_tokens": {"forwarded_padded": tokens, "forward_calls": calls}}
        path.write_text(json.dumps({"_meta": {**meta, **({"scoring": scoring} if scoring else {})}}))
    assert time_estimate.eval_work(tmp_path, "mini", "cached") == EvalWork(30_000, 150)
    assert time_estimate.eval_work(tmp_path, "mini", "packed") == EvalWork(29_000, 14)


def _recorded_run(root, experiment, wall, steps, quant=False, mtime=None, scoring="cached"):
    run = root / "mini" / experiment / "seed0"
    (run / "eval" / "bf16").mkdir(parents=True)
    results = run / "eval" / "bf16" / "results.json"
    results.write_text(json.dumps({"_meta": {"wall_time_s": wall, "scoring": scoring}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_time_s": t, "quant": quant}) + "\n"
                                               for i, t in enumerate(steps)))
    if mtime is not None:
        os.utime(results, (mtime, mtime))


def test_an_evaluation_in_steps_is_the_newest_plain_runs_wall_over_its_median_warm_step(tmp_path):
    """exp1 evaluated in 60 s with warm steps of 1, 2, 2, 3 s (the first, 9 s, is not warm): 30 steps. A quantized
    run's steps are not plain ones and are passed over; an older plain run loses to the newest; a folder with no
    record defers to the next (the committed reference runs)."""
    mine, reference = tmp_path / "mine", tmp_path / "reference"
    assert time_estimate.eval_in_steps([mine, reference], "mini", "cached") is None
    _recorded_run(reference, "exp7", 70.0, [5.0, 2.0, 2.0])
    assert time_estimate.eval_in_steps([mine, reference], "mini", "cached") == (35.0,
                                                                               str(reference / "mini/exp7/seed0"))
    _recorded_run(mine, "exp1", 60.0, [9.0, 1.0, 2.0, 3.0, 2.0], mtime=1_000)
    _recorded_run(mine, "exp3", 90.0, [9.0, 3.0, 3.0], quant=True, mtime=3_000)
    assert time_estimate.eval_in_steps([mine, reference], "mini", "cached") == (30.0, str(mine / "mini/exp1/seed0"))
    _recorded_run(mine, "exp7", 44.0, [9.0, 1.0, 1.2, 1.4], mtime=2_000)
    assert time_estimate.eval_in_steps([mine, reference], "mini", "cached")[0] == pytest.approx(44.0 / 1.2)


def test_an_evaluation_scored_another_way_is_not_counted_and_the_profiles_figure_stands_in(tmp_path, monkeypatch):
    """The committed reference runs were scored cached: a packed evaluation is counted from a packed record of this
    machine, else from the profile's packed figure, never from the slower cached ones."""
    mine, reference = tmp_path / "mine", tmp_path / "reference"
    _recorded_run(reference, "exp1", 70.0, [5.0, 2.0, 2.0])
    _recorded_run(mine, "exp7", 80.0, [5.0, 2.0, 2.0], mtime=3_000)
    monkeypatch.setitem(recorded_evals._EVAL_STEPS_FALLBACK, ("mini", "packed"), 25.0)
    assert time_estimate.eval_in_steps([mine, reference], "mini", "packed") == (
        25.0, "the mini profile's packed evaluations")
    _recorded_run(mine, "exp1", 40.0, [5.0, 2.0, 2.0], mtime=1_000, scoring="packed")
    assert time_estimate.eval_in_steps([mine, reference], "mini", "packed") == (20.0, str(mine / "mini/exp1/seed0"))
    monkeypatch.delitem(recorded_evals._EVAL_STEPS_FALLBACK, ("mini", "packed"))
    assert time_estimate.eval_in_steps([reference], "mini", "packed") is None


def test_an_evaluation_from_recorded_steps_is_that_many_plain_steps_a_quantized_mode_at_the_forwards_ratio():
    """30 plain steps of 2 s an evaluation: 60 s for bf16 and, at forwards twice as dear quantized, 120 s for hif8;
    lm-eval's setup and the model load are in the recorded wall time, not added again."""
    costs = replace(COSTS, eval_steps=30.0)
    one = run_parts(cli_config(["experiment=exp3", "profile=mini"]), costs, WORK)
    two = run_parts(cli_config(["experiment=exp3", "profile=mini", "eval.modes=[bf16,hif8]"]), costs, WORK)
    assert one["evaluate"] == pytest.approx(30 * 2.0)
    assert two["evaluate"] == pytest.approx(30 * 2.0 + 30 * 2.0 * 2)


class _Clock:
    """time.perf_counter for the estimate's module: moves only when a scripted step runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("experiment", "plain", "order", "expected"), [
    # quantized first (the run's first step, then a warm one), then one warm plain step for the plain runs
    # the first quantized step paid 7 s more, the compile the run will find cached: the run's first costs 2.2 warm
    # steps more (4.4 s)
    ("exp3", True, [True, True, False], (0.0, 1.0, 4.4, 2.0)),
    ("exp3", False, [True, True], (0.0, 2.0, 4.4, 2.0)),  # no plain step pending: none timed
    ("exp1", True, [False, False], (2.0, 1.0, 0.0, 1.0)),  # a plain config: its first and a warm step
])
def test_measure_steps_the_trainers_prepared_model_and_keeps_first_and_warm_steps_apart(
        monkeypatch, tmp_path, experiment, plain, order, expected):
    """Plain steps take 3 s then 1 s, quantized ones 9 s (AdamW's state, the compile) then 2 s, on the model
    prepare_model made for the run with the run's optimizer: the costs split the first step's extra from warm steps."""
    cfg = cli_config([f"experiment={experiment}", "profile=smoke", f"results_root={tmp_path}"])
    clock = _Clock()
    monkeypatch.setattr(time_estimate.time, "perf_counter", clock)
    prepared, stepped, events = [], [], []
    real_prepare = time_estimate.prepare_model

    def prepare(model, config, device, numerics):
        prepared.append((model, config))
        return real_prepare(model, config, device, numerics)

    def step(model, optimizer, scheduler, batches, config, numerics):
        quantized = any(m.quant_enabled for _, m in quant_modules(model))
        stepped.append((model, type(optimizer).__name__, quantized))
        events.append("step")
        first = len(stepped) == 1
        clock.now += (9.0 if first else 2.0) if quantized else (3.0 if first else 1.0)
        assert len(list(batches)) == config.grad_accum_steps(1)
        return 0.0

    monkeypatch.setattr(time_estimate, "prepare_model", prepare)
    monkeypatch.setattr(time_estimate, "train_step", step)
    monkeypatch.setattr(time_estimate, "write_byte_seconds", lambda folder: 1e-9)
    costs, sizes = time_estimate.measure(cfg, time_estimate.train_numerics(cfg), plain=plain,
                                         wait_beside=lambda: events.append("wait"))
    assert len(prepared) == 1 and prepared[0][1] is cfg
    assert all(s[0] is prepared[0][0] and s[1] == "AdamW" for s in stepped)
    assert [s[2] for s in stepped] == order
    # the run's start-up, timed beside, shares the cores with no timed step: it is waited for before the first
    assert events.index("wait") == 0 and events.count("wait") == 1
    assert (costs.first_step_s, costs.train_step_s, costs.qat_start_s, costs.qat_step_s) == pytest.approx(expected)
    assert sizes["state_bytes"] > sizes["model_bytes"] > 0


def test_the_estimate_says_each_phase_before_it_runs_and_how_long_measuring_took(tmp_path, capsys, monkeypatch):
    """Printed before make expN: a line per phase as it starts (the memory simulation, the configs, the model load,
    the wait for the run's start-up timed beside them, the first quantized step, the warm quantized step, the plain
    step, the evaluation forwards, the disk), then the total per run and per part. A run starts in what its imports
    took (7 s here) and its preflight's memory simulation. The seconds count from the process's start (its imports,
    5 s here): what the user waits. The tiny model stands in for the mini profile's: the whole measurement runs in
    seconds."""
    monkeypatch.setattr(time_estimate, "process_age_s", lambda: 5.0)

    def config_for(profile, experiment, seed, extra):
        return cli_config([f"experiment={experiment}", "profile=smoke", f"seed={seed}", f"results_root={tmp_path}"])

    waited = []
    assert time_estimate.main(["--profile", "mini", "--experiments", "exp3", "--baseline", "exp1",
                               "--results-root", str(tmp_path), "--label", "make exp3"], config_for,
                              run_startup=lambda: waited.append(1) or 7.0) == 0
    assert waited == [1]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("estimate: make exp3: ")]
    phases = [line.split("] ", 1)[1] for line in lines if line.startswith("estimate: make exp3: [")]
    # the smoke profile evaluates hif8 too: its forward's ratio to a bf16 one is timed
    expected = ["a training step's memory", "composing the configs", "loading ",
                "waiting for a run process's start", "timing a first hif8 (attn_mlp) training step",
                "timing a warm hif8 (attn_mlp) training step and a quantized evaluation forward",
                "timing a plain (BF16) training step", "timing an evaluation forward", "timing a write"]
    assert len(phases) == len(expected) and all(p.startswith(e) for p, e in zip(phases, expected, strict=True)), lines
    assert lines[0].startswith("estimate: make exp3: [5 s] "), lines[0]
    last = lines[-1]
    assert "2 run(s) to train and evaluate" in last and "exp1 " in last and "exp3 " in last, last
    assert "measured just now in " in last and "held-out comparison" in last, last
    assert 7.0 <= float(last.split(" s to start a run")[0].rsplit(" ", 1)[1]) < 30.0, last
    assert not list(tmp_path.iterdir()), "the disk's timing leaves nothing behind"
    assert math.isfinite(float(last.split("about ", 1)[1].split(" min", 1)[0]))


def test_an_evaluation_forward_is_timed_only_where_its_time_is_used(monkeypatch, tmp_path):
    """The forward at the evaluation's shape sizes an evaluation that no record counts in steps, or a quantized mode's
    ratio to a plain one. Counted in steps with bf16 only, none runs: only the held-out batch is forwarded."""
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"results_root={tmp_path}"])
    real_load = time_estimate.load_causal_lm
    forwards = []

    def load(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda module, args, kwargs: None if module.training else forwards.append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True)
        return model, tokenizer

    monkeypatch.setattr(time_estimate, "load_causal_lm", load)
    monkeypatch.setattr(time_estimate, "write_byte_seconds", lambda folder: 1e-9)
    heldout = (time_estimate.HELDOUT_BATCH_WINDOWS, cfg.train.seq_len)
    costs, _ = time_estimate.measure(cfg, time_estimate.train_numerics(cfg), eval_shape=lambda scoring: None)
    assert set(forwards) == {heldout} and costs.eval_token_s == 0.0
    forwards.clear()
    costs, _ = time_estimate.measure(cfg, time_estimate.train_numerics(cfg), eval_shape=lambda scoring: (3, 7))
    assert set(forwards) == {heldout, (3, 7)} and costs.eval_token_s > 0.0


def test_the_evaluations_shape_is_asked_for_only_where_no_record_counts_it_or_a_mode_is_quantized(
        monkeypatch, tmp_path):
    """exp3 at mini, bf16 evaluations: with the profile's figure for packed evaluations there is nothing to time; with
    no figure and no record (or with a quantized mode, whose ratio to bf16 is timed) the recorded mean call is."""
    shapes = []

    def measure(cfg, numerics, *, plain, quantized_eval, say, eval_shape, wait_beside):
        shapes.append(eval_shape("packed"))
        return time_estimate.Costs("bf16", 1.0, 1.0, 1.0, 1e-3, 1e-3), {"model_bytes": 1, "state_bytes": 1}

    monkeypatch.setattr(time_estimate, "measure", measure)
    monkeypatch.setattr(time_estimate, "print_memory", lambda *a: None)
    args = ["--profile", "mini", "--experiments", "exp3", "--baseline", "exp1", "--reference-root",
            str(tmp_path / "reference")]
    for extra in ([], ["eval.modes=[bf16,hif8]"]):
        def config_for(profile, experiment, seed, overrides, extra=extra):
            return cli_config([f"experiment={experiment}", "profile=mini", f"results_root={tmp_path}", *extra])

        time_estimate.main(args, config_for)
    monkeypatch.setattr(recorded_evals, "_EVAL_STEPS_FALLBACK", {})
    time_estimate.main(args, lambda profile, experiment, seed, overrides: cli_config(
        [f"experiment={experiment}", "profile=mini", f"results_root={tmp_path}"]))
    packed = time_estimate.eval_work(tmp_path, "mini", "packed")
    call = (32, round(packed.tokens / packed.calls / 32))
    assert shapes == [None, call, call]


def test_a_quantized_evaluation_forward_is_timed_only_when_a_run_evaluates_a_quantized_mode(monkeypatch, tmp_path):
    """exp3 at mini evaluates bf16 only: no quantized forward is timed for it; with eval.modes=[bf16,hif8] one is."""
    seen = []

    def measure(cfg, numerics, *, plain, quantized_eval, say, eval_shape, wait_beside):
        seen.append(quantized_eval)
        return time_estimate.Costs("bf16", 1.0, 1.0, 1.0, 1e-3, 1e-3), {"model_bytes": 1, "state_bytes": 1}

    monkeypatch.setattr(time_estimate, "measure", measure)
    monkeypatch.setattr(time_estimate, "print_memory", lambda *a: None)
    for extra in ([], ["eval.modes=[bf16,hif8]"]):
        def config_for(profile, experiment, seed, overrides, extra=extra):
            return cli_config([f"experiment={experiment}", "profile=mini", f"results_root={tmp_path}", *extra])

        time_estimate.main(["--profile", "mini", "--experiments", "exp3", "--baseline", "exp1"], config_for)
    assert seen == [False, True]


def test_a_plain_step_is_timed_as_the_evaluations_unit_even_when_only_quantized_steps_are_pending(
        monkeypatch, tmp_path):
    """exp1 finished, exp3 pending: with a recorded evaluation to count in plain steps a plain step is timed (the
    quantized one would overcount it by the quantizer's share); with none, only the quantized steps are."""
    seen = []

    def measure(cfg, numerics, *, plain, quantized_eval, say, eval_shape, wait_beside):
        seen.append(plain)
        return time_estimate.Costs("bf16", 1.0, 1.0, 1.0, 1e-3, 1e-3), {"model_bytes": 1, "state_bytes": 1}

    def config_for(profile, experiment, seed, overrides):
        return cli_config([f"experiment={experiment}", "profile=mini", f"results_root={tmp_path / 'runs'}"])

    monkeypatch.setattr(time_estimate, "measure", measure)
    monkeypatch.setattr(time_estimate, "print_memory", lambda *a: None)
    monkeypatch.setattr(time_estimate, "is_done", lambda folder: "exp1" in str(folder))
    monkeypatch.setattr(recorded_evals, "_EVAL_STEPS_FALLBACK", {})  # no figure: only a record counts
    args = ["--profile", "mini", "--experiments", "exp3", "--reference-root", str(tmp_path / "reference")]
    time_estimate.main(args, config_for)
    _recorded_run(tmp_path / "reference", "exp1", 60.0, [9.0, 2.0, 2.0])
    time_estimate.main(args, config_for)
    assert seen == [False, True]


def test_the_estimate_imports_neither_the_evaluator_nor_the_statistics_libraries():
    """What run.py --estimate loads: the trainer, the model loader and the configs; lm-eval, scipy and pandas (seconds
    of imports that a run's evaluation and report need) stay out, and the run job's own module too."""
    code = ("import sys; import hif8qat.cli.estimate; "
            "print(sorted(m for m in ('lm_eval', 'scipy', 'pandas', 'hif8qat.cli.main') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    # run.py starts the start-up's timer before the estimate's own imports: its module loads none of them
    code = ("import sys; import hif8qat.cli.startup_timer; "
            "print(sorted(m for m in ('transformers', 'hif8qat.launch.time_estimate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_runs_preflight_costs_the_memory_simulation_only_where_the_cache_does_not_hold_its_step(
        monkeypatch, tmp_path):
    """The estimate simulates exp3's step (kept in the cache, so exp3's preflight finds it); exp1's preflight still
    simulates its own: only exp1 starts that much later."""
    starts = {}
    real_parts = time_estimate.run_parts

    def measure(cfg, numerics, *, plain, quantized_eval, say, eval_shape, wait_beside):
        wait_beside()
        return time_estimate.Costs("bf16", 1.0, 1.0, 1.0, 1e-3, 1e-3), {"model_bytes": 1, "state_bytes": 1}

    def run_parts(cfg, costs, work, **sizes):
        starts[cfg.experiment.name] = costs.startup_s
        return real_parts(cfg, costs, work, **sizes)

    def config_for(profile, experiment, seed, overrides):
        return cli_config([f"experiment={experiment}", "profile=mini", f"results_root={tmp_path}"])

    monkeypatch.setattr(time_estimate, "measure", measure)
    monkeypatch.setattr(time_estimate, "print_memory", lambda *a: time.sleep(0.5))  # the simulation's seconds
    monkeypatch.setattr(time_estimate, "simulated_before", lambda cfg, *a: cfg.experiment.name == "exp3")
    monkeypatch.setattr(time_estimate, "run_parts", run_parts)
    monkeypatch.setattr(memory, "machine_memory", lambda device: (GIB, "RAM"))  # a step comes near it
    time_estimate.main(["--profile", "mini", "--experiments", "exp3", "--baseline", "exp1"], config_for,
                       run_startup=lambda: 7.0)
    assert starts["exp3"] == 7.0 and 7.5 <= starts["exp1"] < 8.5, starts
    # where the steps fit far below the memory, preflight screens them and simulates none
    monkeypatch.setattr(memory, "machine_memory", lambda device: (2 ** 50, "RAM"))
    time_estimate.main(["--profile", "mini", "--experiments", "exp3", "--baseline", "exp1"], config_for,
                       run_startup=lambda: 7.0)
    assert starts == {"exp3": 7.0, "exp1": 7.0}


def test_the_estimate_simulates_a_step_only_where_it_could_come_near_this_machines_memory(monkeypatch, tmp_path,
                                                                                           capsys):
    """As preflight: a step that SCREEN_MARGIN times the generous count says fits the memory here is printed as
    such, not simulated; one that may come near it is simulated, and so is one for another device (--device)."""
    cfg = cli_config(["experiment=exp3", "profile=mini", f"results_root={tmp_path}"])
    numerics = train_numerics(cfg)
    simulated = []
    monkeypatch.setattr(time_estimate, "cached_step_memory", lambda *a: simulated.append(a) or {"weights": GIB})
    bound = SCREEN_MARGIN * generous_count(cfg, model_config_facts(cfg.model.name))
    monkeypatch.setattr(memory, "machine_memory", lambda device: (bound + 1, "RAM"))
    time_estimate.print_memory(cfg, numerics, None, None)
    out = capsys.readouterr().out
    assert not simulated and "fits here with room to spare, not simulated" in out, out
    count_mib = bound / SCREEN_MARGIN / 2 ** 20  # binary units, as the simulated line's GiB
    shown = f"{count_mib / 1024:.1f} GiB" if count_mib >= 1024 else f"{count_mib:.1f} MiB"
    assert f"({shown}) is within the {(bound + 1) / GIB:.1f} GiB of RAM" in out, out
    time_estimate.print_memory(cfg, numerics, None, "cuda")  # the step on a GPU elsewhere: simulated
    assert len(simulated) == 1 and "needs about 1.0 GiB" in capsys.readouterr().out
    monkeypatch.setattr(memory, "machine_memory", lambda device: (bound, "RAM"))
    time_estimate.print_memory(cfg, numerics, None, None)
    assert len(simulated) == 2 and "needs about 1.0 GiB" in capsys.readouterr().out
