"""Evaluation wall time: lm-eval's HF model (one forward per request) vs the shared-context LM, side by side.

    python benchmarks/bench_eval_lm.py                    # SmolLM2-135M, a quarter of the mini subsets
    python benchmarks/bench_eval_lm.py --fraction 1 --numerics none bf16_emulated

The mini profile's evaluation (conf/eval/mini.yaml: tasks, shots, batch size, subsets scaled by --fraction)
runs through ``hif8qat.evaluate.evaluate_model`` twice per numerics, once with
:class:`hif8qat.evaluate.prefix_lm.SharedContextLM` and once with lm-eval's ``HFLM`` under the same numerics context,
alternating which goes first. Printed: seconds for each, their ratio, and both scores (identical in FP32; under
BF16 the two round differently, their GEMM shapes differing, so a near-tied item can flip).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fraction", type=float, default=0.25, help="share of each mini subset to evaluate")
    ap.add_argument("--numerics", nargs="+", default=None, help="default: none, bf16_emulated, and bf16 if native")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import yaml
    from lm_eval.models.huggingface import HFLM

    from hif8qat import compute_dtype as nm
    from hif8qat.evaluate import prefix_lm
    from hif8qat.evaluate.runner import evaluate_model
    from hif8qat.models.loading import load_causal_lm

    class StockLM(HFLM):
        """lm-eval's HF model, every forward under the evaluation's numerics."""

        def __init__(self, *a, numerics=None, **kw):
            super().__init__(*a, **kw)
            self._numerics = numerics or contextlib.nullcontext
            self.token_counts = dict.fromkeys(("requests", "per_request", "forwarded", "forwarded_padded",
                                               "forward_calls"), 0)

        def _model_call(self, inps, attn_mask=None, labels=None):
            with self._numerics():
                return super()._model_call(inps, attn_mask, labels)

    cfg = yaml.safe_load((ROOT / "conf" / "eval" / "mini.yaml").read_text())
    # MMLU is stratified by subject: at least one document of each of its 57
    subset = {t: max(57 if t.startswith("mmlu") else 1, round(n * args.fraction)) for t, n in cfg["subset"].items()}
    modes = args.numerics or ["none", "bf16_emulated"] + (["bf16"] if nm.native_bf16_supported("cpu") else [])
    model, tok = load_causal_lm("smollm2_135m", dtype=torch.float32)

    def run(lm_class, mode):
        dtype = {"none": "fp32"}.get(mode, mode)
        with mock.patch.object(prefix_lm, "SharedContextLM", lm_class), open(os.devnull, "w") as sink, \
                contextlib.redirect_stdout(sink):
            t0 = time.perf_counter()
            res = evaluate_model(model, tok, cfg["tasks"], batch_size=cfg["batch_size"], subset=subset,
                                 num_fewshot=cfg["num_fewshot"], subset_seed=cfg["subset_seed"],
                                 offline_data=cfg["offline_data"], device="cpu", dtype=dtype)
            wall = time.perf_counter() - t0
        return wall, {t: res[t]["value"] for t in cfg["tasks"]}

    print(f"mini evaluation, subsets {subset}, batch {cfg['batch_size']}, {torch.get_num_threads()} threads")
    for i, mode in enumerate(modes):
        order = [("shared", prefix_lm.SharedContextLM), ("stock", StockLM)]
        results = dict((name, run(cls, mode)) for name, cls in (order if i % 2 == 0 else order[::-1]))
        (t_shared, s_shared), (t_stock, s_stock) = results["shared"], results["stock"]
        same = all(abs(s_shared[t] - s_stock[t]) < 1e-9 for t in s_shared)
        print(f"  {mode:14s} stock {t_stock:7.1f} s   shared-context {t_shared:7.1f} s   "
              f"stock / shared {t_stock / t_shared:5.2f}x   scores {'identical' if same else 'differ'}: "
              + ", ".join(f"{t} {100 * s_shared[t]:.1f}/{100 * s_stock[t]:.1f}" for t in s_shared))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
