"""QAT training step versus the unquantized step: time ratio, aten ops per step, graph breaks.

Both models are built from the same weights in one process (every MLP linear converted to QuantLinear in
the QAT one, scaler bank with the max(64) estimator); steps (forward + backward + AdamW) are interleaved
(the order alternates every repeat) and the median over repeats is compared. Printed, all measured side
by side in this run:

* ``ratio``: QAT step time / plain step time (targets: <= 1.10 for SmolLM2 compiled; the authors' GPU
  simulator: 7.75 s / 2.90 s = 2.67).
* ``aten_ratio``: aten ops dispatched in one QAT step / in one plain step, counted by torch.profiler on
  the eager models (target <= 1.5). ``aten_ops_*`` count every aten op event (nested ones included).
* ``graph_breaks``: graph breaks of a whole-model ``torch.compile`` of the QAT forward beyond those of the
  plain model (``torch._dynamo.explain``; target 0).
* ``ratio_recompute`` (with ``--recompute-too``): a third model that re-quantizes W in the backward
  (``set_weight_recompute``: the FSDP path, and the formulation before Q(W) was saved), timed in the same
  interleaved loop.
* ``qdq_calls`` / ``qdq_MB``: qdq kernel calls in one QAT step and the bytes they read and write
  (``formats.count_qdq``), with ``qdq_calls_W``: those on a converted weight (expected: one per converted
  linear, the backward reuses the forward's quantized weight).

    python benchmarks/bench_step.py --threads 1                      # ~20M-parameter Llama, fp32 eager
    python benchmarks/bench_step.py --model smollm2 --compile --threads 1
    python benchmarks/bench_step.py --model llama1b --device cuda --autocast bf16 --compile --json
    python benchmarks/bench_step.py --threads 1 --format hybrid --algo current   # FP8, just-in-time scales

``--model llama1b`` is a randomly initialised Llama with openPangu-Embedded-1B's own config
(``hif8qat.models.pangu.OPENPANGU_EMBEDDED_1B_CONFIG``: 26 blocks, hidden 1536, GQA 12 q / 6 kv heads of 128 with
biased projections, intermediate 6144, vocabulary 153,376, tied head, rope_theta 4e6). On a machine shared with other
jobs use ``--threads 1``: intra-op thread pools stall under contention and make medians meaningless.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def build_llama(kind: str, seed: int = 0, device: str = "cpu"):
    """A randomly initialised Llama, built on `device` (a 1B model initialises in seconds on a GPU, not minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "llama1b":  # the paper's model as it is
        from hif8qat.models.pangu import OPENPANGU_EMBEDDED_1B_CONFIG, pangu_llama_config

        cfg = pangu_llama_config(OPENPANGU_EMBEDDED_1B_CONFIG)
    else:
        cfg = LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                          num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def build_model(name: str, device: str = "cpu"):
    if name in ("small", "llama1b"):
        return build_llama(name, device=device)
    from hif8qat.models.loading import load_causal_lm

    model, _ = load_causal_lm("smollm2_135m")
    return model


def count_aten_ops(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def graph_breaks(model, inp) -> int:
    import torch._dynamo

    from hif8qat.quant.linear import update_scales

    torch._dynamo.reset()
    with torch.no_grad():
        n = torch._dynamo.explain(lambda ids: model(input_ids=ids).logits)(inp).graph_break_count
    update_scales(model)
    torch._dynamo.reset()
    return n


def _ratio_spread(times: dict[str, list[float]], name: str) -> float:
    """Half the range of the per-repeat ``name``/plain ratios (each pair measured in the same repeat)."""
    r = [q / p for q, p in zip(times[name], times["plain"])]
    return (max(r) - min(r)) / 2


def step_flops(model, batch: int, seq: int) -> int:
    """FLOPs of one training step (forward + backward): 6 per matmul parameter per token (every linear, the LM
    head included, a tied one counted once) plus attention's 12 x blocks x attention width x sequence per token
    (PaLM's MFU count, without the causal halving)."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width = cfg.num_attention_heads * head_dim
    return 6 * matmul * batch * seq + 12 * cfg.num_hidden_layers * width * seq * batch * seq


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("small", "smollm2", "llama1b"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--autocast", default="none", choices=("none", "bf16"))
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile both models: each decoder block on its own, as train.compile=true does")
    ap.add_argument("--compile-whole", action="store_true", help="with --compile: one whole-model torch.compile")
    ap.add_argument("--algo", default="max", help="quant.algo, e.g. max or current (just-in-time scaling)")
    ap.add_argument("--format", default="hif8", choices=("hif8", "e4m3", "e5m2", "hybrid"), help="quant.format")
    ap.add_argument("--scope", default="mlp", choices=("mlp", "attn_mlp"))
    ap.add_argument("--no-counts", action="store_true", help="skip the aten-op and graph-break counts")
    ap.add_argument("--recompute-too", action="store_true",
                    help="also time a QAT model that re-quantizes W in the backward (the FSDP path)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    dev = torch.device(args.device)

    from hif8qat.quant.linear import _convert_model
    from hif8qat.scaling.settings import ScalingConfig

    base = build_model(args.model, args.device).float().train().to(dev)
    quant = copy.deepcopy(base)
    converted = _convert_model(quant, args.scope, None,
                              ScalingConfig(algo=args.algo, history_len=64, format=args.format))
    n_params = sum(p.numel() for p in base.parameters())
    eager = {"plain": base, "qat": quant}
    if args.recompute_too:
        from hif8qat.quant.linear import set_weight_recompute

        eager["qat_recompute"] = copy.deepcopy(quant)
        set_weight_recompute(eager["qat_recompute"])
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(dev)
    inp, labels = ids[:, :-1], ids[:, 1:]

    counts: dict[str, int] = {}
    if not args.no_counts:
        counts["graph_breaks_plain"] = graph_breaks(base, inp)
        counts["graph_breaks_qat"] = graph_breaks(quant, inp)
    if args.compile and args.compile_whole:
        models = {k: torch.compile(m) for k, m in eager.items()}
    else:
        if args.compile:
            from hif8qat.train.compiled_blocks import compile_blocks

            for m in eager.values():
                compile_blocks(m)
        models = dict(eager)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
            for k, m in eager.items()}

    def step(name: str, m=None) -> float:
        m, opt = m or models[name], opts[name]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            logits = m(input_ids=inp).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    if not args.no_counts:  # eager models: the ops a step dispatches (compiled kernels hide theirs)
        for name in eager:
            step(name, eager[name])
            counts[f"aten_ops_{name}"] = count_aten_ops(lambda name=name: step(name, eager[name]))
    for _ in range(args.warmup):
        for name in models:
            step(name)
    from hif8qat.formats.qdq import count_qdq

    counts_qdq = {}
    for name in [k for k in models if k != "plain"]:
        with count_qdq() as qdq:  # one more (untimed) step, counted
            step(name)
        w_ptrs = {m.weight.data_ptr() for m in eager[name].modules() if isinstance(m, torch.nn.Linear)}
        sfx = name[3:]  # "" for qat, "_recompute"
        counts_qdq.update({f"qdq_calls{sfx}": qdq.calls, f"qdq_MB{sfx}": round(qdq.bytes / 2**20, 1),
                           f"qdq_calls_W{sfx}": sum(ptr in w_ptrs for ptr in qdq.ptrs)})
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.repeats):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(step(name))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": args.model, "device": args.device, "params_M": round(n_params / 1e6, 1),
        "converted": len(converted), "scope": args.scope, "batch": args.batch, "seq": args.seq,
        "autocast": args.autocast, "compile": args.compile, "threads": torch.get_num_threads(),
        "format": args.format, "algo": args.algo,
        "compile_whole": args.compile and args.compile_whole,
        "repeats": args.repeats, "torch": torch.__version__, "flops_per_step": step_flops(base, args.batch, args.seq),
        "plain_s": round(med["plain"], 4), "qat_s": round(med["qat"], 4), "hif8_s": round(med["qat"], 4),
        "ratio": round(med["qat"] / med["plain"], 3),
        "spread": round(_ratio_spread(times, "qat"), 3), **counts_qdq,
    }
    if "qat_recompute" in med:
        result["qat_recompute_s"] = round(med["qat_recompute"], 4)
        result["ratio_recompute"] = round(med["qat_recompute"] / med["plain"], 3)
        result["spread_recompute"] = round(_ratio_spread(times, "qat_recompute"), 3)
    if counts:
        result.update(counts)
        result["aten_ratio"] = round(counts["aten_ops_qat"] / counts["aten_ops_plain"], 3)
        result["graph_breaks"] = counts["graph_breaks_qat"] - counts["graph_breaks_plain"]
    if args.json:
        print(json.dumps(result))
        return result
    print(f"{args.model} ({result['params_M']}M params, {len(converted)} {args.scope} linears converted, "
          f"{args.format} {args.algo}) on "
          f"{args.device}, batch {args.batch} x {args.seq}, autocast={args.autocast}, compile={args.compile}, "
          f"{result['threads']} threads, median of {args.repeats}")
    print(f"  step time       plain {med['plain'] * 1e3:8.1f} ms   qat {med['qat'] * 1e3:8.1f} ms   "
          f"ratio {result['ratio']:.3f}  (target <= 1.10 for SmolLM2 compiled; authors' GPU simulator 2.67)")
    print(f"  ratio spread    {result['spread']:.3f}  (half the range of the per-repeat ratios qat/plain)")
    print(f"  qdq per step    {result['qdq_calls']} calls, {result['qdq_MB']} MB read + written, "
          f"{result['qdq_calls_W']} on weights ({len(converted)} converted linears)")
    if "ratio_recompute" in result:
        print(f"  W recomputed    qat {med['qat_recompute'] * 1e3:8.1f} ms   ratio {result['ratio_recompute']:.3f} "
              f"+- {result['spread_recompute']:.3f}   qdq {result['qdq_calls_recompute']} calls, "
              f"{result['qdq_MB_recompute']} MB, {result['qdq_calls_W_recompute']} on weights")
    if counts:
        print(f"  aten ops/step   plain {counts['aten_ops_plain']:8d}      qat {counts['aten_ops_qat']:8d}      "
              f"ratio {result['aten_ratio']:.3f}  (eager, torch.profiler; target <= 1.5)")
        print(f"  graph breaks    plain {counts['graph_breaks_plain']:8d}      qat {counts['graph_breaks_qat']:8d}"
              f"      from quantized linears {result['graph_breaks']}  (whole-model compile; target 0)")
    return result


if __name__ == "__main__":
    main()
