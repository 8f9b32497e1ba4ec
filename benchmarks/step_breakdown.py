"""Where a training step and an evaluation batch spend their time, against the time their GEMMs need.

Builds the run's model as the trainer does (``config_for``: the profile and experiment's resolved config; the
model from ``train.loop.prepare_model``, quantization switched on for a QAT experiment) and, in one process:

1. profiles a training step (the config's micro-batches, forward + backward under the run's numerics, gradient
   clipping, the AdamW step) once per AdamW implementation (``fused`` and ``torch_default``, same weights, same
   tokens) and one evaluation batch (``eval.batch_size`` rows, a forward without gradients and the log-softmax
   over the vocabulary, as lm-eval scores a batch);
2. measures the machine's GEMM rate at the shapes those GEMMs had (the shapes holding 95 % of their FLOPs, each
   timed alone in the dtype the step's GEMMs receive: BF16, or FP32 under emulated BF16 and FP32 numerics);
3. prints, per step, the time by kind (torch.profiler's self time of each op, classified: GEMMs, attention, the
   optimizer's ops, casts (``copy_``), ``fill_``/``zero_``, the loss's log-softmax and NLL, the quantizer's ops,
   the rest, listed by op as well; the casts' and ``fill_``'s call counts, which a loaded machine leaves
   unchanged) and the two ratios: step time / GEMM time as profiled, and step time / GEMM FLOPs at the measured
   rate (what the step would take if it did nothing but its GEMMs at the machine's speed). Step times are
   medians of ``--repeats`` unprofiled steps, the implementations interleaved, so their ratio survives a loaded
   machine better than either time.

    python benchmarks/step_breakdown.py                                   # mini profile, exp1 (SmolLM2-135M)
    python benchmarks/step_breakdown.py --experiment exp3 --repeats 5     # a HiF8 QAT step
    python benchmarks/step_breakdown.py --profile smoke --json            # the tiny model: seconds
    python benchmarks/step_breakdown.py --casts-per-micro-batch train.micro_batch_size=1
        # 4 micro-batches a step; also times the step that casts each weight once per micro-batch (as before)

Offline: the model comes from the local cache (``HF_HUB_OFFLINE=1``), the tokens are random (timing does not
depend on them). On a shared machine, also print ``uptime`` beside the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from tempfile import TemporaryDirectory

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from hif8qat import compute_dtype
from hif8qat.cli.hydra_config import config_for
from hif8qat.models.loading import load_causal_lm
from hif8qat.quant import gemm as quant_gemm
from hif8qat.quant.linear import freeze_scales, set_quantization
from hif8qat.runs.host_allocator import keep_freed_memory
from hif8qat.runs.provenance import machine
from hif8qat.train.chunked_loss import lm_loss
from hif8qat.train.guards import clip_gradients
from hif8qat.train.loop import DistContext, _forward_backward, build_optimizer, prepare_model

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
            "aten::mkldnn_linear", "aten::_weight_int8pack_mm", "aten::_scaled_mm"}
LOSS_OPS = {"aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward",
            "aten::nll_loss_backward", "aten::nll_loss2d_forward", "aten::nll_loss2d_backward"}
CAST_OPS = {"aten::copy_", "aten::_to_copy"}
FILL_OPS = {"aten::fill_", "aten::zero_"}
QUANTIZER_LABEL = "hif8qat.quantizer"
KINDS = ("gemm", "attention", "optimizer", "casts", "fill", "loss", "quantizer", "rest")


def _labelled_quantizer():
    """The quantized linear's qdq calls under a profiler label (this process only), so their ops count as the
    quantizer's wherever they run."""
    original = quant_gemm.bank_qdq  # the quantized GEMM's module, where every quantized layer calls it

    def bank_qdq(*args, **kwargs):
        with record_function(QUANTIZER_LABEL):
            return original(*args, **kwargs)

    quant_gemm.bank_qdq = bank_qdq


def _kind(event, ancestors: list[str]) -> str:
    if any(a.startswith("Optimizer.") for a in ancestors):
        return "optimizer"
    if QUANTIZER_LABEL in ancestors:
        return "quantizer"
    name = event.name
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in LOSS_OPS:
        return "loss"
    if name in CAST_OPS:
        return "casts"
    if name in FILL_OPS:
        return "fill"
    return "rest"


def breakdown(prof, total_s: float) -> tuple[dict[str, float], list[tuple[str, tuple, float]], dict[str, float],
                                             dict[str, int]]:
    """Seconds by kind (self CPU time; ``rest`` also takes what no op accounts for, up to total_s), the GEMM
    calls as (name, input shapes, FLOPs), the rest's seconds by op (what no op accounts for as ``(outside ops)``:
    Python, the autograd engine) and the op calls by kind."""
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    rest_ops: dict[str, float] = defaultdict(float)
    gemms = []
    for event in prof.events():
        if event.device_type.name != "CPU" or not event.name.startswith(("aten::", "mkldnn::")):
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        kind = _kind(event, ancestors)
        seconds[kind] += event.self_cpu_time_total / 1e6
        calls[kind] += 1
        if kind == "rest":
            rest_ops[event.name] += event.self_cpu_time_total / 1e6
        if event.name in GEMM_OPS and kind == "gemm":
            gemms.append((event.name, tuple(tuple(s) for s in event.input_shapes), float(event.flops or 0)))
    rest_ops["(outside ops)"] = max(0.0, total_s - sum(seconds.values()))
    seconds["rest"] += rest_ops["(outside ops)"]
    return {k: seconds.get(k, 0.0) for k in KINDS}, gemms, rest_ops, {k: calls.get(k, 0) for k in KINDS}


def fill_sources(prof, depth: int = 3) -> list[tuple[str, int, float]]:
    """``fill_``/``zero_`` calls grouped by the ops they ran inside (innermost first): (chain, calls, ms)."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.name not in FILL_OPS:
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None and len(chain) < depth:
            chain.append(parent.name)
            parent = parent.cpu_parent
        group = groups[" < ".join(chain) or "(top level)"]
        group[0] += 1
        group[1] += event.self_cpu_time_total / 1e3
    return sorted(((k, int(v[0]), v[1]) for k, v in groups.items()), key=lambda r: -r[2])


def _gemm_operands(name: str, shapes: tuple, dtype: torch.dtype):
    """Operands of the GEMM's shape (bias and batch kept; strides contiguous)."""
    make = [torch.randn(s, dtype=dtype) if len(s) else torch.tensor(1.0) for s in shapes if s]
    if name in ("aten::addmm", "aten::_addmm_activation"):
        return torch.addmm, make[:3]
    if name == "aten::baddbmm":
        return torch.baddbmm, make[:3]
    if name == "aten::bmm":
        return torch.bmm, make[:2]
    return torch.mm, make[:2]


def gemm_rates(gemms, dtype: torch.dtype, repeats: int = 5, share: float = 0.95) -> tuple[float, list[dict]]:
    """GFLOP/s of the machine at the step's own GEMM shapes: the shapes holding ``share`` of the FLOPs, each
    timed alone (median of ``repeats``); returns their FLOP-weighted rate and one row per shape."""
    by_shape: dict[tuple, float] = defaultdict(float)
    for name, shapes, flops in gemms:
        by_shape[(name, shapes)] += flops
    total = sum(by_shape.values())
    rows, covered, timed_flops, timed_s = [], 0.0, 0.0, 0.0
    for (name, shapes), flops in sorted(by_shape.items(), key=lambda kv: -kv[1]):
        if covered >= share * total or flops == 0:
            break
        covered += flops
        fn, operands = _gemm_operands(name, shapes, dtype)
        with torch.no_grad():
            fn(*operands)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = fn(*operands)
                times.append(time.perf_counter() - t0)
            per_call_flops = 2.0 * out.numel() * operands[-1].shape[-2]
        rate = per_call_flops / statistics.median(times)
        timed_flops += flops
        timed_s += flops / rate
        rows.append({"op": name, "shapes": [list(s) for s in shapes], "share": flops / total, "gflops": rate / 1e9})
    return (timed_flops / timed_s if timed_s else float("nan")), rows


class Bench:
    def __init__(self, args):
        self.tmp = TemporaryDirectory()
        cfg = config_for(args.profile, args.experiment, 0, (f"results_root={self.tmp.name}", *args.overrides))
        self.cfg = cfg
        self.device = torch.device("cpu")
        model, _ = load_causal_lm(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code,
                                  revision=cfg.model.revision)
        self.numerics = compute_dtype.Numerics(cfg.train.autocast)
        prepare_model(model, cfg, self.device, self.numerics)
        if cfg.quant.enabled:
            set_quantization(model, True)
        self.model = model
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.accum = cfg.grad_accum_steps(1)
        vocab = model.get_output_embeddings().out_features
        g = torch.Generator().manual_seed(0)
        t = cfg.train
        self.micro = [torch.randint(vocab, (t.micro_batch_size, t.seq_len + 1), generator=g) for _ in range(self.accum)]
        self.eval_tokens = torch.randint(vocab, (cfg.eval.batch_size, args.eval_len), generator=g)
        self.optimizers = {impl: build_optimizer(model, _with_impl(cfg, impl)) for impl in ("fused", "torch_default")}

    def train_step(self, impl: str, casts_per_micro_batch: bool = False) -> None:
        cfg, numerics = self.cfg, self.numerics
        if casts_per_micro_batch:  # as before the trainer kept autocast's weight casts for the whole step
            for tokens in self.micro:
                with numerics.forward():
                    loss = lm_loss(self.model, tokens, double_label_shift=cfg.quirks.double_label_shift)
                with numerics.backward():
                    (loss / self.accum).backward()
        else:  # the trainer's own forward and backward of a step's micro-batches
            _forward_backward(self.model, iter(self.micro), self.accum, numerics, cfg, DistContext())
        clip_gradients(self.model, cfg.train.grad_clip)
        optimizer = self.optimizers[impl]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def eval_batch(self) -> None:
        self.model.eval()
        freeze_scales(self.model, True)
        try:
            with self.numerics.forward():
                logits = self.model(input_ids=self.eval_tokens, use_cache=False).logits
            F.log_softmax(logits.float(), dim=-1)
        finally:
            freeze_scales(self.model, False)
            self.model.train()


def _with_impl(cfg, impl):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer_impl=impl))


def _profiled(fn) -> tuple[float, object]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        t0 = time.perf_counter()
        fn()
        total = time.perf_counter() - t0
    return total, prof


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--experiment", default="exp1")
    ap.add_argument("--repeats", type=int, default=3, help="unprofiled timings per case (median)")
    ap.add_argument("--eval-len", type=int, default=128, help="tokens per row of the evaluation batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--casts-per-micro-batch", action="store_true",
                    help="also time the fused step with each weight cast once per micro-batch (as before)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("overrides", nargs="*", help="run.py settings, e.g. train.micro_batch_size=2")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as run.py's runs allocate (HIF8QAT_HOST_ALLOCATOR=default: glibc's defaults)
    _labelled_quantizer()
    bench = Bench(args)
    cases = {"train (fused AdamW)": lambda: bench.train_step("fused"),
             "train (torch_default AdamW)": lambda: bench.train_step("torch_default"),
             "eval batch": bench.eval_batch}
    if args.casts_per_micro_batch:
        cases["train (fused, casts per micro-batch)"] = lambda: bench.train_step("fused", casts_per_micro_batch=True)
    for fn in cases.values():  # warm-up: AdamW makes its moments, kernels are compiled, caches filled
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.repeats):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))  # interleaved: the load hits all alike
        for name in order:
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    results, all_gemms = {}, []
    for name, fn in cases.items():
        total, prof = _profiled(fn)
        kinds, gemms, rest_ops, calls = breakdown(prof, total)
        all_gemms += gemms
        results[name] = {"step_s": statistics.median(times[name]), "profiled_s": total, "kinds_s": kinds,
                         "kinds_calls": calls,
                         "gemm_flops": sum(f for _, _, f in gemms), "fill_sources": fill_sources(prof)[:6],
                         "rest_ops_s": dict(sorted(rest_ops.items(), key=lambda kv: -kv[1])[:8])}
    # the dtype the step's GEMMs received (emulated BF16: FP32; a BF16 GEMM there takes minutes at these shapes)
    rate, shape_rows = gemm_rates(all_gemms, bench.numerics.gemm_operand_dtype)
    for row in results.values():
        row["gemm_at_rate_s"] = row["gemm_flops"] / rate
        row["step_per_gemm_profiled"] = row["profiled_s"] / max(row["kinds_s"]["gemm"], 1e-12)
        row["step_per_gemm_flops"] = row["step_s"] / row["gemm_at_rate_s"]
    t = bench.cfg.train
    out = {"profile": args.profile, "experiment": args.experiment, "model": bench.cfg.model.name,
           "machine": machine(), "numerics": compute_dtype.describe(t.autocast, "cpu"),
           "threads": torch.get_num_threads(),
           "micro_batches": bench.accum, "micro_batch": [t.micro_batch_size, t.seq_len],
           "eval_batch": list(bench.eval_tokens.shape), "gemm_rate_gflops": rate / 1e9, "gemm_shapes": shape_rows,
           "cases": results,
           "fused_over_torch_default": (results["train (fused AdamW)"]["step_s"]
                                        / results["train (torch_default AdamW)"]["step_s"])}
    print(json.dumps(out, indent=1) if args.json else _table(out))
    return out


def _table(out: dict) -> str:
    cpu = out["machine"]
    lines = [f"{out['model']} ({out['profile']}/{out['experiment']}), {out['numerics']['numerics']} on "
             f"{cpu['cpu'] or 'a CPU'} ({', '.join(cpu['cpu_features']) or 'no GEMM features named'}; torch's "
             f"{out['numerics'].get('cpu_capability', 'cpu')} kernels), {out['threads']} threads; training step "
             f"{out['micro_batches']} x {out['micro_batch'][0]} x {out['micro_batch'][1]} tokens, evaluation batch "
             f"{out['eval_batch'][0]} x {out['eval_batch'][1]}",
             f"GEMM rate at the step's shapes: {out['gemm_rate_gflops']:.0f} GFLOP/s "
             + ", ".join(f"{r['op'][6:]}{r['shapes']} {r['gflops']:.0f} ({100 * r['share']:.0f} %)"
                         for r in out["gemm_shapes"][:4]), ""]
    names = list(out["cases"])
    lines.append("| ms | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for kind in KINDS:
        lines.append(f"| {kind} | " + " | ".join(f"{1e3 * out['cases'][n]['kinds_s'][kind]:.0f}" for n in names) + " |")
    for kind in ("casts", "fill"):  # counts: unlike times, the same on a loaded machine
        lines.append(f"| {kind}, calls | " + " | ".join(str(out["cases"][n]["kinds_calls"][kind]) for n in names)
                     + " |")
    for key, label, fmt in (("profiled_s", "step, profiled", "{:.0f}"), ("step_s", "step, median unprofiled", "{:.0f}"),
                            ("gemm_at_rate_s", "GEMM FLOPs at the measured rate", "{:.0f}")):
        lines.append(f"| {label} | " + " | ".join(fmt.format(1e3 * out["cases"][n][key]) for n in names) + " |")
    for key, label in (("step_per_gemm_profiled", "step / GEMM (profiled)"),
                       ("step_per_gemm_flops", "step / GEMM FLOPs at rate")):
        lines.append(f"| {label} | " + " | ".join(f"{out['cases'][n][key]:.1f}" for n in names) + " |")
    lines.append("\nfused / torch_default AdamW step time (same run, interleaved): "
                 f"{out['fused_over_torch_default']:.2f}")
    for name in names:
        lines.append(f"fill_/zero_ in {name}, by the ops they ran inside (calls, ms): "
                     + "; ".join(f"{chain} ({calls}, {ms:.0f})"
                                 for chain, calls, ms in out["cases"][name]["fill_sources"]))
    for name in names:
        lines.append(f"the rest in {name}, by op (ms): "
                     + "; ".join(f"{op} {1e3 * sec:.0f}" for op, sec in out["cases"][name]["rest_ops_s"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
