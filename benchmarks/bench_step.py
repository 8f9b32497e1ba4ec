"""Training step time with every MLP linear converted to HiF8Linear versus the unconverted model.

Both models are built from the same weights in one process; steps (forward + backward + AdamW) are
interleaved (the order alternates every repeat) and the median over repeats is compared. Prints the
ratio quantized / unquantized (target: <= 1.3 on CPU, stretch <= 1.08; the authors' GPU
simulator: 7.75 s / 2.90 s = 2.67).

    python benchmarks/bench_step.py                       # ~20M-parameter Llama, batch 4 x 128, fp32
    python benchmarks/bench_step.py --model smollm2       # SmolLM2-135M via hif8qat.models.load_causal_lm
    python benchmarks/bench_step.py --autocast bf16 --compile

On a machine shared with other jobs use ``--threads 1``: intra-op thread pools stall under contention
and make the two-thread medians meaningless (seen here: plain 4.2 s vs 1.0 s single-threaded).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def build_small_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def build_model(name: str):
    if name == "small":
        return build_small_llama()
    if name == "smollm2":
        from hif8qat.models import load_causal_lm

        model, _ = load_causal_lm("smollm2_135m")
        return model
    raise SystemExit(f"--model {name!r}: allowed small, smollm2")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("small", "smollm2"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--autocast", default="none", choices=("none", "bf16"))
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile both models (quantized linears "
        "are graph breaks that run eagerly with their own compiled HiF8 kernel)",
    )
    ap.add_argument("--algo", default="max")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from hif8qat.qlinear import convert_model
    from hif8qat.scaling import ScalingConfig

    base = build_model(args.model).float().train()
    quant = copy.deepcopy(base)
    converted = convert_model(quant, "mlp", None, ScalingConfig(algo=args.algo))
    n_params = sum(p.numel() for p in base.parameters())
    models = {"plain": base, "hif8": quant}
    if args.compile:
        models = {k: torch.compile(m) for k, m in models.items()}
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
        for k, m in models.items()
    }
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
    inp, labels = ids[:, :-1], ids[:, 1:]

    def step(name: str) -> float:
        m, opt = models[name], opts[name]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            logits = m(input_ids=inp).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        for name in models:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.repeats):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(step(name))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": args.model,
        "params_M": round(n_params / 1e6, 1),
        "converted": len(converted),
        "batch": args.batch,
        "seq": args.seq,
        "autocast": args.autocast,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "plain_s": round(med["plain"], 4),
        "hif8_s": round(med["hif8"], 4),
        "ratio": round(med["hif8"] / med["plain"], 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model} ({result['params_M']}M params, {len(converted)} MLP linears converted), "
            f"batch {args.batch} x {args.seq}, autocast={args.autocast}, compile={args.compile}, "
            f"{result['threads']} threads, median of {args.repeats}"
        )
        print(
            f"  plain step {med['plain'] * 1e3:8.1f} ms   hif8 step {med['hif8'] * 1e3:8.1f} ms   "
            f"ratio {result['ratio']:.3f}  (target <= 1.3, stretch <= 1.08; authors' GPU simulator 2.67)"
        )
    return result


if __name__ == "__main__":
    main()
