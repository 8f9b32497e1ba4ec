"""Tokens one evaluation forwards: lm-eval's HF model (one forward per request) vs the shared-context LM.

    python benchmarks/eval_tokens.py                                   # conf/eval/mini.yaml, SmolLM2-135M
    python benchmarks/eval_tokens.py --eval-config conf/eval/smoke.yaml --model tiny

The evaluation runs as ``hif8qat.evaluate.evaluate_model`` runs it (tasks, shots, subsets, batch size of
the eval config; lm-eval builds and tokenizes the requests), but the scoring of each batch is replaced by
a stub: no model forward runs, so this takes seconds and its scores are meaningless. Printed per task and
in total: requests, ``per_request`` (the sum of the requests' input lengths, what lm-eval's HFLM forwards)
and ``forwarded`` (what :class:`hif8qat.evaluate.prefix_lm.SharedContextLM` forwards; ``padded`` with padding;
``calls``: its model calls). ``ratio``: per_request / forwarded.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval-config", type=Path, default=ROOT / "conf" / "eval" / "mini.yaml")
    ap.add_argument("--model", default="smollm2_135m", help="load_causal_lm name (its tokenizer matters)")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import yaml

    from hif8qat.evaluate.prefix_lm import SharedContextLM
    from hif8qat.evaluate.runner import evaluate_model
    from hif8qat.models.loading import load_causal_lm

    cfg = yaml.safe_load(args.eval_config.read_text()) or {}
    model, tok = load_causal_lm(args.model, dtype=torch.float32)

    def no_forward(self, batch, subs, requests):  # every request of the batch: packed rows' or cached units'
        for row in batch:
            for i in ([i for i, _ in row[3]] if subs is None else row[1]):
                yield i, (0.0, False)

    print(f"{args.eval_config.name} on {args.model}'s tokenizer, batch size {cfg.get('batch_size', 16)}")
    print(f"{'task':<20}{'requests':>9}{'per_request':>13}{'forwarded':>11}{'padded':>9}{'ratio':>7}{'calls':>7}")
    total = dict.fromkeys(("requests", "per_request", "forwarded", "forwarded_padded", "forward_calls"), 0)
    with mock.patch.object(SharedContextLM, "_score", no_forward):
        for task in cfg["tasks"]:
            shots, subset = cfg.get("num_fewshot") or {}, cfg.get("subset") or {}
            res = evaluate_model(model, tok, [task], batch_size=cfg.get("batch_size", 16), limit=cfg.get("limit"),
                                 num_fewshot={task: shots[task]} if task in shots else None,
                                 subset={task: subset[task]} if task in subset else None,
                                 subset_seed=cfg.get("subset_seed", 0), offline_data=cfg.get("offline_data", False),
                                 device="cpu")
            c = res["_meta"]["eval_tokens"]
            for k in total:
                total[k] += c[k]
            print(f"{task:<20}{c['requests']:>9}{c['per_request']:>13}{c['forwarded']:>11}"
                  f"{c['forwarded_padded']:>9}{c['per_request'] / c['forwarded']:>7.2f}{c['forward_calls']:>7}")
    print(f"{'total':<20}{total['requests']:>9}{total['per_request']:>13}{total['forwarded']:>11}"
          f"{total['forwarded_padded']:>9}{total['per_request'] / total['forwarded']:>7.2f}"
          f"{total['forward_calls']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
