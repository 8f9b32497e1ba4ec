"""How closely the deployable 8-bit export computes what the fake-quantized model computes, on SmolLM2-135M.

    python benchmarks/bench_export_fidelity.py                        # HiF8 and E4M3, 4 training steps
    python benchmarks/bench_export_fidelity.py --formats hif8 --steps 2 --windows 8
    python benchmarks/bench_export_fidelity.py --model tiny:2 --seq-len 32      # a dry run in seconds

Per format: SmolLM2-135M (the offline weights the mini profile uses) converted with the library's public API,
trained a few AdamW steps on the mini corpus (so the scalers hold a history), its scales frozen; then
``hif8qat.export_8bit`` twice, with the rest (everything but the quantized weights) in BF16, as deployed, and in
FP32, and ``hif8qat.load_8bit_export`` of each. On held-out windows of the mini corpus: the mean per-token
KL(fake-quant || export) in nats, the top-1 agreement of their next-token predictions, and the largest absolute
logit difference. The FP32-rest export is expected bit-exact (difference 0); the BF16-rest one differs by the
BF16 rounding of the embeddings, norms and head alone (the quantized weights are the same codes in both).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2_135m", help="model.name as run.py takes it (tiny:2 for a dry run)")
    ap.add_argument("--formats", nargs="+", default=["hif8", "e4m3"], choices=["hif8", "e4m3", "hybrid"])
    ap.add_argument("--steps", type=int, default=4, help="training steps before the export")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows compared")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    import hif8qat
    from hif8qat.data.loader import build_eval_windows, build_train_stream
    from hif8qat.models.loading import load_causal_lm

    torch.manual_seed(0)
    print(f"command: python benchmarks/bench_export_fidelity.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = []
    for fmt in args.formats:
        t0 = time.perf_counter()
        model, tok = load_causal_lm(args.model, dtype=torch.float32)
        held = build_eval_windows("mini", tok, seq_len=args.seq_len, num_windows=args.windows)[:, :-1]
        stream = build_train_stream("mini", tok, seq_len=args.seq_len, micro_batch_size=4, seed=0)
        hif8qat.convert_to_hif8_training(model, config=hif8qat.Hif8TrainingConfig(format=fmt, history_len=16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        model.train()
        for step in range(args.steps):
            hif8qat.set_step(model, step)
            batch = next(stream)
            batch = batch[0] if isinstance(batch, (tuple, list)) else batch
            model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
            opt.step()
            opt.zero_grad()
        hif8qat.freeze_scales(model)
        model.eval()
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            fake = torch.cat([model(input_ids=w[None]).logits[0] for w in held]).float()
            for rest in (torch.bfloat16, torch.float32):
                out = Path(tmp) / str(rest)
                sizes = hif8qat.export_8bit(model, out, rest_dtype=rest, tokenizer=tok)
                loaded, _ = hif8qat.load_8bit_export(out)
                got = torch.cat([loaded(input_ids=w[None]).logits[0] for w in held]).float()
                logp, logq = fake.log_softmax(-1), got.log_softmax(-1)
                kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
                agree = (fake.argmax(-1) == got.argmax(-1)).double().mean().item()
                rows.append((fmt, str(rest).replace("torch.", ""), kl, agree, (fake - got).abs().max().item(),
                             sizes["bytes"] / 2**20, fake.shape[0]))
                del loaded
        print(f"  {fmt}: {time.perf_counter() - t0:.0f} s")
    print("\n| format | rest | KL(fake-quant to export), nats/token | top-1 agreement | max abs logit diff | "
          "weights file MiB | tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt, rest, kl, agree, diff, mib, n in rows:
        print(f"| {fmt} | {rest} | {kl:.3g} | {100 * agree:.1f} % | {diff:.3g} | {mib:.1f} | {n} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
