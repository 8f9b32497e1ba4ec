"""The loss's log-softmax over the vocabulary, whole or in chunks, at a profile's micro-batch: time and rounding.

The training loss computes a micro-batch's logits whole when they fit in ``chunked_loss.CHUNK_ELEMENTS``
(every small profile) and in chunks of ``chunk_rows`` tokens otherwise, each chunk's logits recomputed in
backward. This times both paths side by side on the output layer alone (forward and backward of the head and
the loss under the run's numerics, the repeats interleaved so that a loaded machine slows both alike) and says
how far the chunked loss and gradients are from the whole ones.

    python benchmarks/bench_loss_chunks.py                       # mini: 4 x 128 tokens, SmolLM2's 49,152 x 576 head
    python benchmarks/bench_loss_chunks.py --rows 128 512 --repeats 7

Random hidden states and targets at the model's sizes (timing does not depend on the values); no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from hif8qat import compute_dtype
from hif8qat.cli.hydra_config import config_for
from hif8qat.models.loading import model_config_facts
from hif8qat.train.chunked_loss import chunked_cross_entropy


def whole_loss(hidden, weight, targets):
    """The small profiles' path (``lm_loss`` without a LossHead): whole logits, FP32 cross entropy."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mini")
    ap.add_argument("--experiment", default="exp1")
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256], help="tokens per chunk to try")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = config_for(args.profile, args.experiment, 0, ())
    facts = model_config_facts(cfg.model.name, revision=cfg.model.revision)
    vocab, width = facts["vocab_size"], facts["hidden_size"]
    t = cfg.train
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t.micro_batch_size, t.seq_len, width, generator=g).requires_grad_()
    weight = (0.02 * torch.randn(vocab, width, generator=g)).requires_grad_()
    targets = torch.randint(vocab, (t.micro_batch_size, t.seq_len), generator=g)
    autocast = t.autocast

    def run(rows):
        hidden.grad = weight.grad = None
        with compute_dtype.forward_context(autocast, "cpu"):
            loss = (whole_loss(hidden, weight, targets) if rows is None else
                    chunked_cross_entropy(hidden, weight, None, targets, rows, autocast == "bf16_emulated"))
        with compute_dtype.backward_context(autocast, "cpu"):
            loss.backward()
        return loss.detach(), hidden.grad.clone(), weight.grad.clone()

    cases = [None, *args.rows]
    results = {rows: run(rows) for rows in cases}  # warm-up, and the values compared
    times = {rows: [] for rows in cases}
    for r in range(args.repeats):
        for rows in (cases if r % 2 == 0 else cases[::-1]):
            t0 = time.perf_counter()
            run(rows)
            times[rows].append(time.perf_counter() - t0)
    ref_loss, ref_dh, ref_dw = results[None]
    out = {"profile": args.profile, "numerics": autocast, "tokens": t.micro_batch_size * t.seq_len, "vocab": vocab,
           "threads": torch.get_num_threads(), "whole_s": statistics.median(times[None]), "chunked": []}
    for rows in args.rows:
        loss, dh, dw = results[rows]
        seconds = statistics.median(times[rows])
        out["chunked"].append({
            "rows": rows, "s": seconds, "over_whole": seconds / out["whole_s"],
            "loss_abs_diff": abs(float(loss) - float(ref_loss)),
            "loss_bit_identical": bool(torch.equal(loss, ref_loss)),
            "grad_hidden_max_rel": float((dh - ref_dh).abs().max() / ref_dh.abs().max()),
            "grad_weight_max_rel": float((dw - ref_dw).abs().max() / ref_dw.abs().max())})
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
