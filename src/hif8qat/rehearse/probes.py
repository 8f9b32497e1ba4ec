"""Independent measurements that the paper-path rehearsal (:mod:`hif8qat.rehearse.paper_path`) holds a run
against, each computed without the trainer, FSDP or torchrun:

    python -m hif8qat.rehearse.probes replay MODEL_DIR FINEWEB SIZES
    python -m hif8qat.rehearse.probes resized-load SAVED_CHECKPOINT MODEL_DIR FINEWEB RESIZED_RUN SIZES
    python -m hif8qat.rehearse.probes evaluate RUN_DIR OUT

SIZES: ``--world --accum --seq-len --micro-batch --steps --resume-at``, the rehearsal's own. Each prints one
JSON object as its last line.

The rehearsal runs each in a process of its own, started with the rehearsed checkout's interpreter and
``src/`` (so a rehearsal of another checkout judges that checkout's data split and loader, not this one's),
and so that nothing a probe changes (the parquet reader it patches to count rows, the modules it loads)
leaks into the rehearsal or into another probe.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets.packaged_modules.parquet.parquet import Parquet
from safetensors.torch import load_model
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import LlamaConfig, LlamaForCausalLM

from hif8qat.data.loader import build_train_stream
from hif8qat.evaluate.heldout import saved_eval_numerics
from hif8qat.evaluate.runner import evaluate_export
from hif8qat.models.loading import build_tiny_tokenizer, load_causal_lm
from hif8qat.runs.folders import load_run_config
from hif8qat.train.checkpoint import load_checkpoint
from hif8qat.train.loop import parameter_groups
from hif8qat.train.provenance import SCALERS_KEY

# The tiny stand-ins tag each document's text with its id (standins.write_fineweb_shards).
_DOC_TAG = re.compile(r"<doc:([0-9]+-[0-9]+)>")
_DATA_STATE = ("epoch", "position", "docs_read")  # a stream's place in its data, as a checkpoint saves it


def _stream(fineweb: str, tok, sizes: argparse.Namespace, rank: int, world: int):
    return build_train_stream(fineweb, tok, seq_len=sizes.seq_len, micro_batch_size=sizes.micro_batch,
                              rank=rank, world_size=world)


@contextmanager
def _counting_parquet_rows(decoded: list[int]) -> Iterator[None]:
    """Inside, every row the parquet reader decodes (whichever rank keeps it) is added to decoded[-1].

    Adapter: datasets reports no count of the rows its parquet reader decodes; its private ``_generate_tables``
    is wrapped here, the one place that touches it."""
    real = Parquet._generate_tables

    def counting(self, *args, **kwargs):
        for key, table in real(self, *args, **kwargs):
            decoded[-1] += table.num_rows
            yield key, table

    Parquet._generate_tables = counting
    try:
        yield
    finally:
        Parquet._generate_tables = real


def replay(model_dir: str, fineweb: str, sizes: argparse.Namespace) -> dict:
    """{"docs": each rank's document ids in an epoch, "decoded": the rows each rank's reader decodes (kept or
    not), "grad_norm": step 0's gradient norm}. The norm is a plain Llama's with the model folder's weights
    (its remote code set aside), over each rank's first micro-batches under bf16 autocast, averaged as the
    trainer averages: what the sharded, accumulated step 0 must log.

    Args:
        model_dir: the tiny model's folder.
        fineweb: the FineWeb-format shards.
        sizes: the rehearsal's sizes (world, micro-batch, sequence length ...), as the probe's command line gives them.

    Returns:
        ``{docs, decoded, grad_norm}``."""
    tok = build_tiny_tokenizer()
    docs, decoded = [], []
    with _counting_parquet_rows(decoded):
        for rank in range(sizes.world):
            decoded.append(0)
            records = _stream(fineweb, tok, sizes, rank, sizes.world)._make(0)  # the rank's documents, epoch 0
            docs.append([_DOC_TAG.match(rec["text"])[1] for rec in records])
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("auto_map", "model_type", "architectures", "transformers_version"):
        config.pop(key, None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    load_model(model, str(Path(model_dir) / "model.safetensors"))
    model.train()
    for rank in range(sizes.world):
        stream = _stream(fineweb, tok, sizes, rank, sizes.world)
        for _ in range(sizes.accum):
            tokens = next(stream)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
            (loss / (sizes.accum * sizes.world)).backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    return {"docs": docs, "decoded": decoded, "grad_norm": float(norm)}


def resized_load(saved: str, model_dir: str, fineweb: str, resized_run: str, sizes: argparse.Namespace) -> dict:
    """The saved multi-rank checkpoint loaded on one process by the trainer's loader, compared with DCP's own
    conversion of its shards to one file (parameters, optimizer state, scalers); then the documents the saved
    ranks read (fresh streams replayed to the saved step), those a 1-rank stream resized from the saved data
    states reads until its epoch ends, and that stream's data state where the 1-rank run saved its last
    checkpoint, beside the one that run saved.

    Args:
        saved: the multi-rank checkpoint folder.
        model_dir: the tiny model's folder.
        fineweb: the FineWeb-format shards.
        resized_run: the 1-rank run's folder.
        sizes: the rehearsal's sizes (world, micro-batch, sequence length ...), as the probe's command line gives them.

    Returns:
        The comparisons (``step``, ``params_equal``, ``optimizer_equal``, ``scalers_equal``, ...) and the documents
        read."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(f"{saved}/dcp", f"{tmp}/full.pt")
        full = torch.load(f"{tmp}/full.pt", weights_only=True)
    model, _ = load_causal_lm(model_dir, trust_remote_code=True)
    opt = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step, state = load_checkpoint(Path(saved), model=model, optimizer=opt, scheduler=sched, rank=0, world_size=1)
    loaded = model.state_dict()
    params_equal = set(full["model"]) <= set(loaded) and all(
        torch.equal(loaded[k], v) for k, v in full["model"].items())
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer_equal = len(opt.state) == len(full["optimizer"]["state"]) > 0 and all(
        torch.equal(v, full["optimizer"]["state"][names[id(p)]][k])
        for p, st in opt.state.items() for k, v in st.items())
    rank0 = torch.load(f"{saved}/rank000.pt", weights_only=True)
    scalers_equal = all(torch.equal(state[SCALERS_KEY][k], v) for k, v in rank0[SCALERS_KEY].items())

    tok = build_tiny_tokenizer()

    def tags(batches) -> list[str]:
        return _DOC_TAG.findall("".join(tok.decode(row.tolist()) for b in batches for row in b))

    before = []
    for rank in range(sizes.world):
        stream = _stream(fineweb, tok, sizes, rank, sizes.world)
        before += tags([next(stream) for _ in range(sizes.resume_at * sizes.accum)])
    resized = _stream(fineweb, tok, sizes, 0, 1)
    resized.resize(state["data_by_rank"])
    epoch, after = resized.epoch, []
    while True:
        batch = next(resized)
        if resized.epoch != epoch:
            break
        after.append(batch)
    resized = _stream(fineweb, tok, sizes, 0, 1)
    resized.resize(state["data_by_rank"])
    for _ in range((sizes.steps - sizes.resume_at) * sizes.accum * sizes.world):  # to the run's last checkpoint
        next(resized)
    run_state = torch.load(f"{resized_run}/checkpoints/step_{sizes.steps:07d}/rank000.pt", weights_only=True)["data"]
    return {"step": step, "params_equal": params_equal, "optimizer_equal": optimizer_equal,
            "scalers_equal": scalers_equal, "scalers": len(state[SCALERS_KEY]), "docs_before": before,
            "docs_after": tags(after), "replayed_state": {k: resized.state_dict()[k] for k in _DATA_STATE},
            "run_state": {k: run_state[k] for k in _DATA_STATE}}


def evaluate_in_one_process(run_dir: str, out: str) -> dict:
    """The run's export evaluated in one process in every mode, with the evaluation settings and numerics the
    run recorded (its config_resolved.yaml, read back as a RunConfig), as run.py evaluates a run; results under
    out/<mode>/.

    Args:
        run_dir: the run folder.
        out: where the results go.

    Returns:
        ``{modes}``: the modes evaluated."""
    device, numerics = saved_eval_numerics(Path(run_dir))
    ev = load_run_config(Path(run_dir)).eval
    for mode in ev.modes:
        evaluate_export(Path(run_dir) / "export", mode, list(ev.tasks), out_dir=Path(out) / mode, numerics=numerics,
                        device=device, limit=ev.limit, batch_size=ev.batch_size, trust_remote_code=True)
    return {"modes": list(ev.modes)}


def _parser() -> argparse.ArgumentParser:
    sizes = argparse.ArgumentParser(add_help=False)
    for flag in ("--world", "--accum", "--seq-len", "--micro-batch", "--steps", "--resume-at"):
        sizes.add_argument(flag, type=int, required=True)
    ap = argparse.ArgumentParser(prog="python -m hif8qat.rehearse.probes", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="probe", required=True)
    p = sub.add_parser("replay", parents=[sizes], help=replay.__doc__.split(".")[0])
    p.add_argument("model_dir")
    p.add_argument("fineweb")
    p = sub.add_parser("resized-load", parents=[sizes], help=resized_load.__doc__.split(";")[0])
    for name in ("saved", "model_dir", "fineweb", "resized_run"):
        p.add_argument(name)
    p = sub.add_parser("evaluate", help=evaluate_in_one_process.__doc__.split(",")[0])
    p.add_argument("run_dir")
    p.add_argument("out")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.rehearse.probes {replay,resized-load,evaluate} ...``: one probe, its answer printed as JSON.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status."""
    args = _parser().parse_args(argv)
    if args.probe == "replay":
        result = replay(args.model_dir, args.fineweb, args)
    elif args.probe == "resized-load":
        result = resized_load(args.saved, args.model_dir, args.fineweb, args.resized_run, args)
    else:
        result = evaluate_in_one_process(args.run_dir, args.out)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
