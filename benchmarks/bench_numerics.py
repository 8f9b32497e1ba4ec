"""Training-step time under each compute numerics (fp32, emulated BF16, native BF16), side by side in one run,
and the same on this CPU limited to AVX2, the class of CPU without native BF16 (most laptops).

    python benchmarks/bench_numerics.py                        # SmolLM2-135M, 4 x 128 tokens, this CPU
    python benchmarks/bench_numerics.py --classes              # also limited to AVX2, plus the FP32 GEMM ratio
    python benchmarks/bench_numerics.py --model small --repeats 3

Printed, measured in this run, for an unquantized model (exp1) and one with exp3's quantized linears: the median
step (forward + backward + AdamW) under ``none`` (FP32), ``bf16_emulated`` and ``bf16`` (native autocast), the
ratios to FP32 (target: emulated <= 1.3x FP32 for both), and how many GEMMs of an emulated step received a BF16
operand (must be 0: on a CPU without native BF16 each one is torch's slow path).
``--classes`` reruns it in a child process with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2``: torch then reports no native BF16 and runs BF16 GEMMs through its slow path,
as on an AVX2-only CPU, and the FP32 GEMM throughput of both classes gives the factor by which times measured
on one class scale to the other. Steps alternate between numerics every repeat; use a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
NUMERICS = ("none", "bf16_emulated", "bf16")
SCOPES = {"none": "exp1 (unquantized)", "attn_mlp": "exp3 (q/k/v/o + MLP quantized)", "mlp": "exp6/exp8 (MLP)"}
bf16_gemms: dict[str, int] = {}  # per scope: GEMMs of one emulated step that received a BF16 operand


def gemm_gflops(repeats: int = 20) -> float:
    """FP32 GEMM throughput at a SmolLM2 MLP shape (4 x 128 tokens, 576 -> 1536)."""
    a, w = torch.randn(512, 576), torch.randn(1536, 576)
    torch.nn.functional.linear(a, w)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        times.append(time.perf_counter() - t0)
    return 2 * 512 * 576 * 1536 / statistics.median(times) / 1e9


def step_times(model_name: str, batch: int, seq: int, repeats: int, numerics_list: list[str],
               scope: str = "none") -> dict[str, float]:
    from bench_step import build_model

    from hif8qat import compute_dtype as numerics
    from hif8qat.quant.gemm_check import GemmOperandCount
    from hif8qat.quant.linear import _convert_model, set_bf16_emulation, set_quantization
    from hif8qat.scaling.settings import ScalingConfig

    model = build_model(model_name).float().train()
    if scope != "none":  # exp3's quantized linears (attn_mlp), or exp6/exp8's (mlp), every block quantized
        _convert_model(model, scope, None, ScalingConfig())
        set_quantization(model, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def step(mode: str) -> float:
        set_bf16_emulation(model, mode == "bf16_emulated")  # the layers are told the numerics, as the trainer does
        t0 = time.perf_counter()
        with numerics.forward_context(mode, "cpu"):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        with numerics.backward_context(mode, "cpu"):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for mode in numerics_list:
        step(mode)  # warm-up
    # what reaches torch's kernels under emulation: a BF16 GEMM there is the slow path on CPUs without native BF16
    counter = GemmOperandCount()
    with counter:
        step("bf16_emulated")
    bf16_gemms[scope] = counter.bf16_calls()
    times: dict[str, list[float]] = {m: [] for m in numerics_list}
    for r in range(repeats):
        for mode in (numerics_list if r % 2 == 0 else list(reversed(numerics_list))):
            times[mode].append(step(mode))
    return {m: statistics.median(v) for m, v in times.items()}


def measure(args) -> dict:
    from hif8qat import compute_dtype as numerics

    modes = [m for m in NUMERICS if m != "bf16" or numerics.native_bf16_supported("cpu") or args.slow_native]
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "native_bf16": numerics.native_bf16_supported("cpu"), "threads": torch.get_num_threads(),
              "fp32_gemm_gflops": round(gemm_gflops(), 2), "step_s": {}, "ratio_to_fp32": {}}
    for scope in args.scopes.split(","):
        times = step_times(args.model, args.batch, args.seq, args.repeats, modes, scope)
        result["step_s"][scope] = {m: round(t, 3) for m, t in times.items()}
        result["ratio_to_fp32"][scope] = {m: round(t / times["none"], 3) for m, t in times.items()}
    result["bf16_gemms_in_emulated_step"] = dict(bf16_gemms)
    return result


def show(label: str, r: dict) -> None:
    print(f"{label}: cpu {r['cpu_capability']}, native BF16 {r['native_bf16']}, {r['threads']} threads, "
          f"FP32 GEMM {r['fp32_gemm_gflops']} GFLOP/s")
    for scope, steps in r["step_s"].items():
        print(f"  {SCOPES.get(scope, scope)}: GEMMs with a BF16 operand in an emulated step: "
              f"{r['bf16_gemms_in_emulated_step'][scope]}")
        for mode, t in steps.items():
            print(f"    {mode:14s} step {t:7.3f} s   {r['ratio_to_fp32'][scope][mode]:6.2f}x fp32")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=("small", "smollm2"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scopes", default="none,attn_mlp", help="comma-separated: none (exp1), attn_mlp (exp3), mlp")
    ap.add_argument("--classes", action="store_true", help="also measure this CPU limited to AVX2 (a child process)")
    ap.add_argument("--slow-native", action="store_true", help="time native BF16 autocast even without native BF16")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {"this_cpu": measure(args)}
    if args.classes:
        cmd = [sys.executable, __file__, "--json", "--model", args.model, "--batch", str(args.batch), "--seq",
               str(args.seq), "--repeats", str(args.repeats), "--scopes", args.scopes] \
            + (["--slow-native"] if args.slow_native else [])
        # its own inductor cache: the ISA limits change the generated code but not inductor's cache key, and a
        # kernel cached for one ISA and loaded under the other was seen to corrupt the heap (free(): invalid pointer)
        with tempfile.TemporaryDirectory(prefix="inductor-avx2-") as cache:
            child = subprocess.run(cmd, env={**os.environ, **AVX2_ENV, "TORCHINDUCTOR_CACHE_DIR": cache},
                                   capture_output=True, text=True, check=True)
        out["avx2"] = json.loads(child.stdout.strip().splitlines()[-1])["this_cpu"]
        out["fp32_gemm_speed_this_over_avx2"] = round(out["this_cpu"]["fp32_gemm_gflops"]
                                                      / out["avx2"]["fp32_gemm_gflops"], 3)
    if args.json:
        print(json.dumps(out))
        return out
    show("this CPU", out["this_cpu"])
    if "avx2" in out:
        show("limited to AVX2", out["avx2"])
        print(f"FP32 GEMM speed, this CPU / AVX2-limited: {out['fp32_gemm_speed_this_over_avx2']}x "
              "(times measured here scale to an AVX2 machine by this factor, for GEMM-bound work)")
    return out


if __name__ == "__main__":
    main()
