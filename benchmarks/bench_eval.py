"""Where an evaluation's wall time goes, plain (bf16) and quantized (hif8), with and without the weights cast once.

    python benchmarks/bench_eval.py --run-dir results/runs/mini/exp3/seed0                  # a quarter of the subsets
    python benchmarks/bench_eval.py --run-dir results/runs/mini/exp3/seed0 --fraction 1 --skip-eval
    python benchmarks/bench_eval.py --run-dir results/runs/mini/exp1/seed0 --scoring --repeats 3
    python benchmarks/bench_eval.py --run-dir results/runs/mini/exp1/seed0 --setup --repeats 3

The run folder's export is loaded in each mode (``hif8`` needs a quantized run's export) under bf16 numerics
(``--dtype``). In one process:

1. forwards: one batch of ``--rows`` x ``--width`` tokens through the trunk, and its last positions through the
   output layer (as :class:`hif8qat.evaluate.prefix_lm.SharedContextLM` scores a batch), for each mode with the
   weights cast (and quantized) at every forward ("per forward", the code before) and once per evaluation
   (``hif8qat.evaluate.runner.weights_cast_once``), interleaved over ``--repeats``; prints the median ms per token
   of each, their ratios, and whether the two ways give bit-identical logits;
2. evaluations (unless ``--skip-eval``): the mini profile's tasks on ``--fraction`` of its subsets, with its
   shots and batch size (conf/eval/mini.yaml), per mode and way, split into model load, forwards (of which the
   quantizer), the rest of the scoring (batching, log-softmax), writing the eval folder, and lm-eval's own work
   (task setup, tokenisation, metrics): the remainder. Prints the accuracies too: they must not depend on the way.

With ``--scoring``, instead: the mini profile's whole bf16 evaluation once (its requests captured), then those
requests scored packed and cached (:class:`hif8qat.evaluate.prefix_lm.SharedContextLM`) alternately, ``--repeats``
times: the median seconds of each way, their ratio, the model calls and the largest log-likelihood difference.

With ``--setup``, instead: lm-eval's own setup of the mini profile's bf16 evaluation (building the tasks, the
requests, the metrics and the eval folder), its scoring stubbed (no forward runs), with the runner's setup speed-ups
(:mod:`hif8qat.evaluate.task_data`: parquet copies read by datasets' parquet loader, Jinja templates compiled once,
only the subsets' documents formatted) off and on alternately, after one warm-up of each: the median seconds of
each, their ratio, and whether both chose the same items and built the same requests (items hashes, token counts,
the stub's scores).
The copies' cards are read once per copy both ways.

The process keeps freed memory in its heap as run.py's processes do
(``hif8qat.runs.host_allocator.keep_freed_memory``): with glibc's defaults each large activation would be mapped
afresh, a cost the runs do not pay. On a shared machine the absolute seconds move with the load; the ratios,
measured side by side, move less.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

WAYS = ("per_forward", "once")


def _timed(counter: collections.Counter, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            counter[name] += time.perf_counter() - t0
    return wrapper


def _way(name: str):
    """The evaluation's weight handling: the runner's (``once``) or a null one (``per_forward``)."""
    from hif8qat.evaluate import runner

    return runner.weights_cast_once if name == "once" else (lambda model: contextlib.nullcontext())


def bench_forwards(models: dict, numerics, rows: int, width: int, repeats: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    times = collections.defaultdict(list)
    logits = {}

    def forward(model):
        with numerics.forward():
            hidden = model.base_model(input_ids=ids).last_hidden_state
            return model.get_output_embeddings()(hidden[:, -1])

    with torch.no_grad():  # as the evaluation runs
        for model in models.values():  # warm-up
            forward(model)
        for _ in range(repeats):  # interleaved: a load change hits every variant alike
            for mode, model in models.items():
                t0 = time.perf_counter()
                logits[mode, "per_forward"] = forward(model)
                times[mode, "per_forward"].append(time.perf_counter() - t0)
                with _way("once")(model):
                    forward(model)  # casts and quantizes; the timed forward reuses
                    t0 = time.perf_counter()
                    logits[mode, "once"] = forward(model)
                    times[mode, "once"].append(time.perf_counter() - t0)
    tokens = rows * width
    ref = statistics.median(times[next(iter(models)), "per_forward"])
    print(f"forwards: {rows} x {width} tokens, median of {repeats}, ratios to {next(iter(models))} per forward")
    print(f"{'mode':<6}{'weights cast':<14}{'ms/token':>10}{'ratio':>8}{'logits identical':>18}")
    for (mode, way), ts in sorted(times.items()):
        same = bool(torch.equal(logits[mode, "per_forward"], logits[mode, way]))
        print(f"{mode:<6}{way.replace('_', ' '):<14}{1000 * statistics.median(ts) / tokens:>10.3f}"
              f"{statistics.median(ts) / ref:>8.2f}{str(same):>18}")


def _mini_profile() -> dict:
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "eval" / "mini.yaml").read_text())


def bench_evaluation(export: Path, mode: str, way: str, numerics, fraction: float, batch_size: int) -> None:
    import torch

    from hif8qat.evaluate import prefix_lm, runner
    from hif8qat.evaluate.loading import load_for_eval
    from hif8qat.scaling.bank import ScalerBank

    spent: collections.Counter = collections.Counter()
    patches = [
        (prefix_lm.SharedContextLM, "_forward"), (prefix_lm.SharedContextLM, "_score_requests"),
        (ScalerBank, "quantize"), (runner, "write_eval_dir"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    saved.append((runner, "weights_cast_once", runner.weights_cast_once))
    for owner, name, fn in saved[:-1]:
        setattr(owner, name, _timed(spent, name, fn))
    runner.weights_cast_once = _way(way)
    try:
        t0 = time.perf_counter()
        model, tok = load_for_eval(export, mode, device="cpu")
        spent["load"] = time.perf_counter() - t0
        mini = _mini_profile()
        # MMLU is stratified by subject: at least one document of each of its 57
        sizes = {t: max(57 if t.startswith("mmlu") else 1, round(n * fraction)) for t, n in mini["subset"].items()}
        with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
            t0 = time.perf_counter()
            res = runner.evaluate_model(model, tok, list(sizes), out_dir=Path(tmp) / mode, mode=mode,
                                        batch_size=batch_size, subset=sizes, num_fewshot=mini["num_fewshot"],
                                        subset_seed=mini["subset_seed"], offline_data=True, device="cpu",
                                        numerics=numerics)
            total = time.perf_counter() - t0
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    tokens = res["_meta"]["eval_tokens"]
    fwd, score = spent["_forward"], spent["_score_requests"]
    parts = {"load": spent["load"], "forwards": fwd, "  of which quantizer": spent["quantize"],
             "scoring rest": score - fwd, "write": spent["write_eval_dir"],
             "lm-eval setup, tokens, metrics": total - score - spent["write_eval_dir"]}
    print(f"\nevaluation {mode}, weights cast {way.replace('_', ' ')}: {spent['load'] + total:.1f} s, "
          f"{tokens['forwarded']} tokens forwarded ({tokens['forwarded_padded']} with padding, "
          f"{tokens['forward_calls']} model calls), {1000 * fwd / tokens['forwarded']:.3f} ms/token in forwards")
    for name, s in parts.items():
        print(f"  {name:<32}{s:>8.1f} s")
    print("  scores: " + ", ".join(f"{t} {res[t]['value']:.4f}" for t in sizes))


def bench_scoring(export: Path, numerics, batch_size: int, repeats: int) -> None:
    """The mini profile's whole bf16 evaluation requests, scored packed and cached alternately in one process."""
    import torch

    from hif8qat.evaluate import prefix_lm, runner
    from hif8qat.evaluate.loading import load_for_eval, weights_cast_once

    model, tok = load_for_eval(export, "bf16", device="cpu")
    mini = _mini_profile()
    captured = []
    real = prefix_lm.SharedContextLM._loglikelihood_tokens

    def capture(self, requests, *args, **kwargs):
        captured.extend((None, c, k) for _, c, k in requests)
        return real(self, requests, *args, **kwargs)

    prefix_lm.SharedContextLM._loglikelihood_tokens = capture
    try:
        with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
            runner.evaluate_model(model, tok, list(mini["subset"]), out_dir=Path(tmp) / "bf16", mode="bf16",
                                  batch_size=batch_size, subset=mini["subset"], num_fewshot=mini["num_fewshot"],
                                  subset_seed=mini["subset_seed"], offline_data=True, device="cpu",
                                  numerics=numerics)
    finally:
        prefix_lm.SharedContextLM._loglikelihood_tokens = real
    ways = {way: prefix_lm.SharedContextLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device="cpu",
                                           numerics=numerics.forward, softmax_dtype=torch.float32, scoring=way)
            for way in ("cached", "packed")}
    times, answers, calls = collections.defaultdict(list), {}, {}
    with torch.no_grad(), weights_cast_once(model):
        for _ in range(repeats):  # interleaved: a load change hits both ways alike
            for way, lm in ways.items():
                before = lm.token_counts["forward_calls"]
                t0 = time.perf_counter()
                answers[way] = lm._loglikelihood_tokens(captured, disable_tqdm=True)
                times[way].append(time.perf_counter() - t0)
                calls[way] = lm.token_counts["forward_calls"] - before
    ref = statistics.median(times["cached"])
    print(f"\nscoring the mini evaluation's {len(captured)} requests (bf16), median of {repeats}")
    for way, ts in times.items():
        print(f"  {way:<8}{statistics.median(ts):>8.1f} s{statistics.median(ts) / ref:>7.2f}x{calls[way]:>6} calls")
    diff = max(abs(a[0] - b[0]) for a, b in zip(answers["cached"], answers["packed"], strict=True))
    print(f"  largest log-likelihood difference {diff:.3f} nats (bf16 rounding)")


def _setup_way(on: bool) -> contextlib.ExitStack:
    """The runner with its lm-eval setup speed-ups (``on``) or without them."""
    from unittest import mock

    from hif8qat.evaluate import runner, task_data

    stack = contextlib.ExitStack()
    if not on:
        stack.enter_context(mock.patch.object(task_data, "local_parquet_files", lambda *args: None))
        stack.enter_context(mock.patch.object(runner, "compiled_jinja_templates", contextlib.nullcontext))
        stack.enter_context(mock.patch.object(runner, "selected_docs_only", contextlib.nullcontext))
    return stack


def bench_setup(export: Path, numerics, batch_size: int, repeats: int) -> None:
    """The mini profile's bf16 evaluation with its scoring stubbed, lm-eval's setup speed-ups off and on alternately."""
    from unittest import mock

    from hif8qat.evaluate import prefix_lm, runner
    from hif8qat.evaluate.loading import load_for_eval
    from hif8qat.evaluate.outputs import ITEMS_KEY

    def no_forward(self, batch, subs, requests):  # every request of the batch, packed rows' or cached units'
        for row in batch:
            for i in ([i for i, _ in row[3]] if subs is None else row[1]):
                yield i, (0.0, False)

    model, tok = load_for_eval(export, "bf16", device="cpu")
    mini = _mini_profile()
    times, seen = collections.defaultdict(list), {}
    with mock.patch.object(prefix_lm.SharedContextLM, "_score", no_forward), \
            tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        for i in range(repeats + 1):  # the first round warms both ways (datasets' caches, imports)
            for name, on in (("off", False), ("on", True)):  # interleaved: a load change hits both alike
                with _setup_way(on):
                    t0 = time.perf_counter()
                    res = runner.evaluate_model(model, tok, list(mini["subset"]), out_dir=Path(tmp) / name,
                                                mode="bf16", batch_size=batch_size, subset=mini["subset"],
                                                num_fewshot=mini["num_fewshot"], subset_seed=mini["subset_seed"],
                                                offline_data=True, device="cpu", numerics=numerics)
                    if i:
                        times[name].append(time.perf_counter() - t0)
                seen[name] = (res[ITEMS_KEY], res["_meta"]["eval_tokens"], {t: res[t] for t in mini["subset"]})
    off = statistics.median(times["off"])
    print(f"\nlm-eval setup of the mini evaluation (scoring stubbed), median of {repeats}, load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"  speed-ups {name:<4}{statistics.median(ts):>7.1f} s{statistics.median(ts) / off:>7.2f}x  "
              f"({', '.join(f'{t:.1f}' for t in ts)})")
    print(f"  same items and requests: {seen['off'] == seen['on']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="a finished run folder (hif8: a quantized run's)")
    ap.add_argument("--modes", default="bf16,hif8")
    ap.add_argument("--dtype", default="bf16", help="the evaluation numerics (eval.dtype's values)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.25, help="share of each mini subset to evaluate")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the mini profile's")
    ap.add_argument("--skip-eval", action="store_true", help="the forwards only")
    ap.add_argument("--scoring", action="store_true",
                    help="only the whole evaluation's requests, scored packed and cached alternately")
    ap.add_argument("--setup", action="store_true",
                    help="only lm-eval's setup of the evaluation (scoring stubbed), speed-ups off and on alternately")
    args = ap.parse_args(argv)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    logging.disable(logging.WARNING)
    import torch

    from hif8qat.config.numerics import eval_numerics
    from hif8qat.evaluate.loading import load_for_eval
    from hif8qat.runs.host_allocator import keep_freed_memory

    keep_freed_memory()  # as run.py's processes and the evaluation CLI allocate
    args.batch_size = args.batch_size or _mini_profile()["batch_size"]
    _, numerics = eval_numerics("cpu", args.dtype)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    export = args.run_dir / "export"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, numerics {numerics.mode}, "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.scoring:
        bench_scoring(export, numerics, args.batch_size, args.repeats)
        return 0
    if args.setup:
        bench_setup(export, numerics, args.batch_size, args.repeats)
        return 0
    models = {m: load_for_eval(export, m, device="cpu")[0] for m in modes}
    bench_forwards(models, numerics, args.rows, args.width, args.repeats)
    del models
    if not args.skip_eval:
        for mode in modes:
            for way in WAYS:
                bench_evaluation(export, mode, way, numerics, args.fraction, args.batch_size)
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
