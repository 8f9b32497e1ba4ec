"""``python -m hif8qat.evaluate``: a model, an export folder or a run folder evaluated from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from hif8qat.artefacts import trusting_unverified
from hif8qat.boundary import guarded
from hif8qat.config.eval_tasks import DTYPES
from hif8qat.config.numerics import eval_numerics
from hif8qat.errors import concerning, one_line
from hif8qat.evaluate.outputs import format_results
from hif8qat.evaluate.runner import evaluate_export, evaluate_model, evaluate_run
from hif8qat.models.loading import RemoteCodeError, load_causal_lm
from hif8qat.runs.host_allocator import keep_freed_memory


def _whole_number(text: str) -> bool:
    return text.strip().isdigit() and int(text) >= 1


def main(argv=None) -> int:
    """``python -m hif8qat.evaluate``: lm-eval evaluation of a model, an export folder or a run folder.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status: 2 for a bad setting or missing input."""
    ap = argparse.ArgumentParser(description="lm-eval evaluation of a model, an export folder or a run")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="a run folder: evaluates export/ into eval/<mode>/")
    src.add_argument("--export", type=Path, help="a save_pretrained folder (+ hif8qat files for hif8)")
    src.add_argument("--model", help="a load_causal_lm name (tiny, smollm2_135m) or path; bf16 mode only")
    ap.add_argument("--modes", default="bf16,hif8", help="comma-separated subset of bf16,hif8")
    ap.add_argument("--tasks", default=None, help="mini | paper | paper_full | comma-separated names (default: "
                    "mini, or those of --eval-config)")
    ap.add_argument("--eval-config", type=Path, metavar="YAML",
                    help="take tasks, shots, subsets, batch size and offline_data from an eval config "
                         "(e.g. conf/eval/mini.yaml: the base model on exactly what the runs are evaluated on); "
                         "flags given here win")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out evaluation")
    ap.add_argument("--out", type=Path, help="output folder (--export/--model); default: print only")
    ap.add_argument("--limit", default=None, help="the first N docs per task, N a whole number >= 1 (smoke runs)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 16 (or the eval config's)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="auto (bf16 on CUDA, none on CPU) | bf16 (FP32 weights, bf16 autocast) | bf16_emulated | "
                         "none (FP32; fp32 is read as none)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when available) | cpu | cuda | cuda:N")
    ap.add_argument("--fewshot", action="append", default=[], metavar="TASK=K")
    ap.add_argument("--local-dataset", action="append", default=[], metavar="HUBID_OR_TASK=DIR")
    ap.add_argument("--subset", action="append", default=[], metavar="TASK=N",
                    help="a fixed seeded subset of N documents of TASK (stratified by subtask)")
    ap.add_argument("--subset-seed", type=int, default=None, help="default 0 (or the eval config's)")
    ap.add_argument("--offline-data", action="store_true",
                    help="paper tasks on the offline benchmark copies "
                         "(python -m hif8qat.evaluate.offline_benchmarks --install)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the modeling code a model ships beside its weights (config.json auto_map, as an "
                         "openPangu export has); without it such a model is refused")
    ap.add_argument("--trust-unverified", action="store_true",
                    help="evaluate an export that has no integrity record (hif8qat_files.json), marked unverified")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base: dict[str, Any] = {}
    if args.eval_config:

        base = yaml.safe_load(args.eval_config.read_text()) or {}
    if args.limit is not None and not _whole_number(args.limit):  # lm-eval reads 0.5 as half of each task
        print(f"error: --limit {args.limit}: allowed a whole number of documents >= 1 (the first N of each "
              "task); a fraction is refused", file=sys.stderr)
        return 2
    limit = base.get("limit") if args.limit is None else int(args.limit)
    subset = dict(base.get("subset") or {}) if isinstance(base.get("subset"), dict) else base.get("subset")
    if args.subset:
        subset = {**(subset if isinstance(subset, dict) else {}),
                  **{k: int(v) for k, v in (x.split("=", 1) for x in args.subset)}}
    kw = dict(limit=limit, batch_size=args.batch_size or base.get("batch_size", 16),
              num_fewshot={**(base.get("num_fewshot") or {}),
                           **{k: int(v) for k, v in (x.split("=", 1) for x in args.fewshot)}},
              local_datasets={**(base.get("local_datasets") or {}),
                              **dict(x.split("=", 1) for x in args.local_dataset)},
              subset=subset or None,
              subset_seed=args.subset_seed if args.subset_seed is not None else base.get("subset_seed", 0),
              offline_data=args.offline_data or bool(base.get("offline_data", False)))
    tasks = args.tasks or ",".join(base.get("tasks") or []) or "mini"
    args.tasks = tasks
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.out and not args.force:  # never overwrite a finished evaluation
        done = [p for p in ([args.out] if args.model else [args.out / m for m in modes])
                if (p / "results.json").exists()]
        if done:
            print(f"error: {done[0]}/results.json exists; pass --force to overwrite it or choose another --out",
                  file=sys.stderr)
            return 2
    # None, not False: the loader's default, which refuses remote code with an error naming the opt-in
    trust = True if args.trust_remote_code else None

    found: list[dict] = []

    def job() -> None:
        try:
            with trusting_unverified(args.trust_unverified):
                evaluate()
        except RemoteCodeError as err:  # the loader names the config setting; here the opt-in is a flag
            raise RemoteCodeError(f"{err} From the command line: add --trust-remote-code to allow it.") from None

    def evaluate() -> None:
        keep_freed_memory()  # as run.py's processes: the forwards' freed memory is reused, not mapped afresh
        device, numerics = eval_numerics(args.device, args.dtype)  # no training to follow: auto is the machine's
        if args.run_dir:
            found.append(evaluate_run(args.run_dir, modes, args.tasks, numerics=numerics, device=device,
                                      trust_remote_code=trust, **kw))
        elif args.export:
            found.append({m: evaluate_export(args.export, m, args.tasks, out_dir=args.out / m if args.out else None,
                                             numerics=numerics, device=device, trust_remote_code=trust, **kw)
                          for m in modes})
        else:
            with concerning(f"--model {args.model}"):
                model, tok = load_causal_lm(args.model, trust_remote_code=trust)
            model.to(device).eval()
            found.append({"bf16": evaluate_model(model, tok, args.tasks, out_dir=args.out, mode="bf16",
                                                 device=device, numerics=numerics, extra_meta={"model": args.model},
                                                 **kw)})

    try:  # the boundary every entry point has (hif8qat.boundary.guarded): one error line, or a traceback for a bug
        code = guarded(job)
    except ValueError as err:  # the evaluation's own checks of the flags' values
        print(f"error: {one_line(str(err), 2000)}", file=sys.stderr)
        return 2
    if code:
        return code
    res = found[0]
    for mode, r in res.items():
        meta = r["_meta"]
        print(f"== {mode}  ({meta['wall_time_s']:.1f} s, {meta['device']}, {meta['dtype']} weights, "
              f"autocast {meta['autocast']})")
        print(format_results(r))
    return 0

