"""A CPU rehearsal of the paper profile's code path, with only the sizes and the device changed.

`make rehearse` (``python -m hif8qat.rehearse.paper_path``) generates its inputs (a tiny remote-code Llama,
FineWeb-format shards), runs the paper profile's exp8 under ``torchrun --nproc_per_node 2`` (gloo) with FSDP2,
gradient accumulation, activation checkpointing and amax all-reduce, kills and resumes it on 2 ranks and on 1,
evaluates it on both ranks and builds the report, checking each step against what
:mod:`hif8qat.rehearse.probes` measures. docs/running_at_scale.md ("Rehearsal without a GPU") lists the checks.
The evaluation runs the smoke profile's offline mini tasks (the paper's need their datasets)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from hif8qat.rehearse.checks import finish, parse_work_args, run_check
from hif8qat.rehearse.standins import write_fineweb_shards, write_remote_code_model
from hif8qat.train.provenance import SCALERS_KEY

# ----------------------------------------------------------------------------------------------------------
# the rehearsal
# ----------------------------------------------------------------------------------------------------------
WORLD = 2
STEPS = 12  # paper step-valued settings scale by 12/10,000: LR warmup 1 step, BF16 warmup 1 step (QAT from 1)
KILL_AT = 6  # after the step-4 checkpoint
RESUME_AT = 4
SEQ_LEN, MICRO_BATCH = 32, 2
ACCUM = 2  # global batch 8 = micro-batch 2 x 2 ranks x 2 accumulation steps
DUMP_EVERY = 3
SHARDS, DOCS_PER_SHARD = 3, 3  # 3 files for 2 ranks; about 2,000 tokens, fewer than the run's 12 x 264
HELDOUT = 2  # held-out documents, for the validation loss


def run_args(work: Path, model_dir: Path, results: Path, stage: str) -> list[str]:
    """The paper profile's exp8 with only sizes and device changed (and the offline mini evaluation).

    Args:
        work: the rehearsal's folder.
        model_dir: the tiny model's folder.
        results: the results root.
        stage: the stage to run.

    Returns:
        run.py's overrides."""
    return ["experiment=exp8", "profile=paper", f"profile.steps={STEPS}", f"stage={stage}",
            f"model.name={model_dir}", f"results_root={results}", "train.device=cpu",
            "train.distributed=fsdp", "train.activation_checkpointing=true", "quant.amax_reduce=max",
            f"train.global_batch_size={MICRO_BATCH * WORLD * ACCUM}", f"train.micro_batch_size={MICRO_BATCH}",
            f"train.seq_len={SEQ_LEN}", "train.checkpoint_every=4", "train.num_threads=1",
            f"quant.telemetry_dump_every={DUMP_EVERY}",
            "data.eval_windows=4", "eval=smoke", "eval.limit=4", "logger.progress_bar=false",
            f"hydra.run.dir={work / 'hydra' / stage}"]


class _Launcher:
    def __init__(self, work: Path, repo: Path, env: dict[str, str]):
        self.work, self.repo, self.env, self.n = work, repo, env, 0

    def __call__(self, name: str, args: list[str], *, nproc: int = WORLD, env: dict | None = None):
        """Run run.py (under torchrun when nproc > 1); return its exit status and its output (also in logs/)."""
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                    if nproc > 1 else [sys.executable])
        self.n += 1
        log = self.work / "logs" / f"{self.n}_{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with log.open("w") as fh:
            proc = subprocess.run([*launcher, str(self.repo / "run.py"), *args], stdout=fh, stderr=subprocess.STDOUT,
                                  env={**self.env, **(env or {})}, cwd=self.work, timeout=900)
        print(f"  {name}: exit {proc.returncode} in {time.time() - t0:.0f} s ({log})", flush=True)
        return proc.returncode, log.read_text(errors="replace")


def _run_folder(results: Path) -> Path:
    found = sorted(results.glob("paper/exp8/*/config_resolved.yaml"))
    if len(found) != 1:
        raise AssertionError(f"expected one exp8 run folder under {results}, found {[str(p) for p in found]}")
    return found[0].parent


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _probe(name: str, args: list[str], env: dict[str, str], *, sizes: bool = True) -> dict:
    """hif8qat.rehearse.probes NAME ARGS (with the rehearsal's sizes) in a process of its own, under env (the
    rehearsed checkout's src/): its JSON answer. Raises RuntimeError with its output's end when it fails."""
    sizes_args = ["--world", str(WORLD), "--accum", str(ACCUM), "--seq-len", str(SEQ_LEN), "--micro-batch",
                  str(MICRO_BATCH), "--steps", str(STEPS), "--resume-at", str(RESUME_AT)] if sizes else []
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "hif8qat.rehearse.probes", name, *args, *sizes_args],
                         capture_output=True, text=True, env=env, timeout=900)
    print(f"  probe {name}: exit {out.returncode} in {time.time() - t0:.0f} s", flush=True)
    if out.returncode:
        raise RuntimeError(f"probe {name} failed: {out.stdout[-1500:]}{out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _csv_rows(path: Path) -> list[list[str]]:
    with path.open() as fh:
        return list(csv.reader(fh))[1:]


def rehearse(work: Path, repo: Path) -> dict[str, str | None]:
    """Run the rehearsal in ``work``.

    Args:
        work: the rehearsal's folder.
        repo: the checkout whose run.py and src/ are rehearsed.

    Returns:
        Check name -> None if it passed, else why it failed."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = write_remote_code_model(work / f"tiny_pangu_{os.getpid()}_{int(time.time())}", num_layers=8)
    fineweb = work / "fineweb"
    write_fineweb_shards(fineweb, shards=SHARDS, docs_per_shard=DOCS_PER_SHARD, row_group_size=1, heldout_docs=HELDOUT)
    env = {**os.environ, "FINEWEB_PATH": str(fineweb), "PYTHONPATH": str(repo / "src"), "PYTHONHASHSEED": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "HF_MODULES_CACHE": str(work / "hf_modules"), "OMP_NUM_THREADS": "1",
           "HIF8QAT_COMPILE": "0"}  # the eager quantizer is bit-identical and spares each process a cold compile
    launch = _Launcher(work, repo, env)
    checks: dict[str, str | None] = {}

    whole, crashed, resized = work / "runs" / "whole", work / "runs" / "crashed", work / "runs" / "resized"
    rc_whole, log_whole = launch("whole_run_train_eval", run_args(work, model_dir, whole, "all"))
    rc_kill, _ = launch("killed_run", run_args(work, model_dir, crashed, "train"),
                        env={"HIF8QAT_TEST_KILL_AT_STEP": str(KILL_AT)})
    saved = work / "saved_checkpoint"  # the 2-rank checkpoint both resumes start from (they prune theirs)
    try:
        shutil.copytree(crashed, resized)
        shutil.copytree(_run_folder(crashed) / "checkpoints" / f"step_{RESUME_AT:07d}", saved)
    except Exception as err:  # noqa: BLE001 - the killed run's check reports what is missing
        print(f"  no checkpoint to copy: {err}", flush=True)
    rc_one, log_one = launch("resume_on_1_rank", run_args(work, model_dir, resized, "train"), nproc=1)
    rc_resume, log_resume = launch("resume_on_2_ranks", run_args(work, model_dir, crashed, "train"))
    # what the checks hold the runs against, each an exception when it could not be had (the checks that need
    # it report it)
    try:
        one_process = _probe("evaluate", [str(_run_folder(whole)), str(work / "eval_one_process")], env, sizes=False)
    except Exception as err:  # noqa: BLE001
        one_process = err
    try:
        replayed = _probe("replay", [str(model_dir), str(fineweb)], env)
    except Exception as err:  # noqa: BLE001
        replayed = err
    try:
        reloaded = _probe("resized-load", [str(saved), str(model_dir), str(fineweb), str(_run_folder(resized))], env)
    except Exception as err:  # noqa: BLE001
        reloaded = err
    rc_report, log_report = launch("report", ["stage=report", "profile=paper", f"results_root={whole}",
                                              f"hydra.run.dir={work / 'hydra' / 'report'}"], nproc=1)

    def whole_run_finished():
        assert rc_whole == 0, f"exit {rc_whole}: {log_whole[-1500:]}"
        assert (_run_folder(whole) / "DONE").exists()

    def evaluation_in_both_modes_on_both_ranks():
        folder = _run_folder(whole)
        assert json.loads((folder / "export" / "config.json").read_text()).get("auto_map"), "export lost auto_map"
        for mode in ("bf16", "hif8"):
            meta = json.loads((folder / "eval" / mode / "results.json").read_text())["_meta"]
            assert meta["mode"] == mode
            assert meta["ranks"] == WORLD and all(c["requests"] > 0 for c in meta["eval_tokens_by_rank"]), \
                f"{mode}: requests per rank {meta.get('eval_tokens_by_rank')}"

    def sharded_evaluation_equals_one_process():
        if isinstance(one_process, Exception):
            raise one_process
        folder = _run_folder(whole)
        for mode in ("bf16", "hif8"):
            ranks, one = folder / "eval" / mode, work / "eval_one_process" / mode
            a, b = json.loads((ranks / "results.json").read_text()), json.loads((one / "results.json").read_text())
            tasks = [t for t in a if not t.startswith("_")]
            assert tasks and tasks == [t for t in b if not t.startswith("_")]
            for task in tasks:
                assert a[task] == b[task], f"{mode} {task}: {a[task]} vs {b[task]}"
                rows = [_csv_rows(d / f"samples_{task}.csv") for d in (ranks, one)]
                assert [r[:2] for r in rows[0]] == [r[:2] for r in rows[1]], f"{mode} {task}: other choices"
                for x, y in zip(*rows):  # bf16 autocast: test_prefix_lm's bound for a tiny model
                    assert abs(float(x[2]) - float(y[2])) <= 1e-3 + 4e-3 * abs(float(y[2])), (mode, task, x, y)

    def telemetry_dumps_hold_their_steps():
        folder = _run_folder(whole)
        quant_steps = [r["step"] for r in _metrics(folder) if r["quant"]]
        expected = [f"step{s:07d}_rank{r}.jsonl" for s in quant_steps if s % DUMP_EVERY == 0 for r in range(WORLD)]
        found = sorted(p.name for p in (folder / "telemetry").glob("*.jsonl"))
        assert found == sorted(expected), f"dumps {found}, expected {sorted(expected)}"
        for name in found:
            for line in (folder / "telemetry" / name).read_text().splitlines():
                rec = json.loads(line)
                assert rec["step"] == int(name[4:11]), rec
                # one call per micro-batch this step, each with saturation statistics
                assert (rec["calls"], rec["stats_calls"]) == (ACCUM, ACCUM), f"{name}: {rec}"

    def identical_parameters_on_all_ranks():
        # Every rank's weight quantizers recorded the amax of the weights that rank used at every step:
        # equal histories on all ranks mean equal weights at every step (A and G: equal by the amax all-reduce).
        final = _run_folder(whole) / "checkpoints" / f"step_{STEPS:07d}"
        states = [torch.load(final / f"rank{r:03d}.pt", weights_only=True) for r in range(WORLD)]
        weights = [k for k in states[0][SCALERS_KEY] if ".W." in k and k.endswith("history")]
        assert weights, "no weight-quantizer history in the checkpoint"
        for key in states[0][SCALERS_KEY]:
            assert torch.equal(states[0][SCALERS_KEY][key], states[1][SCALERS_KEY][key]), f"{key} differs across ranks"
        assert states[0]["train"] == states[1]["train"], "ranks skipped different steps"

    def grad_norm_equals_the_unsharded_one():
        step0 = _metrics(_run_folder(whole))[0]
        assert step0["step"] == 0 and not step0["quant"]
        if isinstance(replayed, Exception):
            raise replayed
        reference = replayed["grad_norm"]
        assert abs(step0["grad_norm"] - reference) <= 2e-3 * reference, \
            f"logged {step0['grad_norm']} vs unsharded {reference}"

    def data_never_duplicated_across_ranks():
        if isinstance(replayed, Exception):
            raise replayed
        parts = replayed["docs"]  # what each rank's stream reads in an epoch
        everything = {f"{s}-{i}" for s in range(SHARDS) for i in range(DOCS_PER_SHARD + (s < HELDOUT))}
        read = parts[0] + parts[1]
        assert len(read) == len(set(read)), f"a document is read by both ranks: {parts}"
        assert set(read) == everything, f"ranks read {parts}, the source holds {sorted(everything)}"
        # and no rank decodes the others' part to throw it away (one row group per row here)
        assert all(n == len(part) for n, part in zip(replayed["decoded"], parts)), \
            f"rows decoded per rank {replayed['decoded']} for parts of {[len(p) for p in parts]} documents"
        final = _run_folder(whole) / "checkpoints" / f"step_{STEPS:07d}"
        data = [torch.load(final / f"rank{r:03d}.pt", weights_only=True)["data"] for r in range(WORLD)]
        assert [(d["rank"], d["world_size"]) for d in data] == [(r, WORLD) for r in range(WORLD)]

    def epoch_wraps_logged():
        epochs = [r["epoch"] for r in _metrics(_run_folder(whole))]
        assert epochs[0] == 0 and max(epochs) >= 1, f"epochs {epochs}: the data never wrapped"
        for rank in range(WORLD):
            assert re.search(rf"rank {rank}: step \d+: the training data ran out", log_whole), f"rank {rank} silent"

    def kill_and_resume_equal_the_uninterrupted_run():
        assert rc_kill != 0, "the killed run exited normally"
        assert rc_resume == 0, f"resume exit {rc_resume}: {log_resume[-1500:]}"
        assert f"at step {RESUME_AT}" in log_resume, "did not resume from the last checkpoint"
        a, b = _run_folder(whole), _run_folder(crashed)
        got = [(r["step"], r["loss"], r["grad_norm"]) for r in _metrics(b)]
        want = [(r["step"], r["loss"], r["grad_norm"]) for r in _metrics(a)]
        assert got == want, f"losses differ after the resume:\n{got}\n{want}"
        wa, wb = load_file(a / "export" / "model.safetensors"), load_file(b / "export" / "model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"

    def resume_on_one_rank_continues_the_saved_state():
        assert rc_one == 0, f"exit {rc_one}: {log_one[-1500:]}"
        assert f"at step {RESUME_AT}" in log_one and "differs from an uninterrupted run" in log_one, log_one[-1500:]
        steps = [r["step"] for r in _metrics(_run_folder(resized))]
        assert steps == list(range(STEPS)), f"steps {steps}"
        assert (_run_folder(resized) / "DONE").exists()
        if isinstance(reloaded, Exception):
            raise reloaded
        # loaded on one process as the trainer loads it, against DCP's own conversion of the saved shards
        assert reloaded["step"] == RESUME_AT
        assert reloaded["params_equal"] and reloaded["optimizer_equal"], reloaded
        assert reloaded["scalers_equal"] and reloaded["scalers"] > 0, reloaded

    def resume_on_one_rank_reads_no_document_twice():
        if isinstance(reloaded, Exception):
            raise reloaded
        before, after = reloaded["docs_before"], reloaded["docs_after"]
        assert before and after, reloaded
        assert not set(before) & set(after), f"read again in the epoch: {sorted(set(before) & set(after))}"
        assert len(after) == len(set(after)), after
        # the replayed stream is the one the 1-rank run trained on: same data state at its next checkpoint
        assert reloaded["replayed_state"] == reloaded["run_state"], reloaded

    def report_builds():
        assert rc_report == 0, f"exit {rc_report}: {log_report[-1500:]}"
        tables = whole / "tables" / "paper"
        assert any(tables.glob("*.md")), f"no tables in {tables}"

    for fn in (whole_run_finished, evaluation_in_both_modes_on_both_ranks, sharded_evaluation_equals_one_process,
               telemetry_dumps_hold_their_steps, identical_parameters_on_all_ranks,
               grad_norm_equals_the_unsharded_one, data_never_duplicated_across_ranks, epoch_wraps_logged,
               kill_and_resume_equal_the_uninterrupted_run, resume_on_one_rank_continues_the_saved_state,
               resume_on_one_rank_reads_no_document_twice, report_builds):
        run_check(checks, fn)
    return checks


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.rehearse.paper_path [--work DIR] [--repo DIR]``: the rehearsal, its checks printed.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status: 0 when every check passed."""
    parsed = parse_work_args("python -m hif8qat.rehearse.paper_path", __doc__.split("\n")[0], "hif8qat-rehearsal-",
                             argv)
    if isinstance(parsed, int):
        return parsed
    args, work = parsed
    t0 = time.time()
    print(f"rehearsal of the paper profile in {work} (repo {args.repo})", flush=True)
    return finish(rehearse(work, Path(args.repo).resolve()), work, t0, keep=bool(args.work))


if __name__ == "__main__":
    raise SystemExit(main())
