"""The library as a foreign trainer uses it: only ``hif8qat``'s public API on the quantization side.

A plain loop (the README's), Hugging Face's ``Trainer``, ``torch.compile`` and FSDP2 each train a converted tiny
Llama; checkpoints made with ``model.state_dict()`` resume bit for bit, delayed-scaling history included; and the
plain loop's losses are the pipeline trainer's own on the same model, data and seed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hif8qat
from hif8qat import Hif8TrainingConfig, convert_to_hif8_training, set_step
from hif8qat.models.loading import build_tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def tiny(num_layers: int = 2):
    model, _ = build_tiny_llama(num_layers=num_layers, hidden_size=32, intermediate_size=64)
    return model


def batches(n: int, micro: int = 2, seq: int = 17, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (micro, seq), generator=g) for _ in range(n)]


# ------------------------------------------------------------------------------------------- the plain loop
def plain_loop(model, data, *, steps, accum=1, lr=1e-3, warmup=1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
               grad_clip=1.0, start=0, stop=None, state=None):
    """The README's loop: AdamW, warmup + cosine, clipping, ``set_step`` before each step. Returns the losses
    and a checkpoint made of state dicts only (the model's carries the scalers)."""
    from transformers import get_cosine_schedule_with_warmup

    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    sched = get_cosine_schedule_with_warmup(opt, warmup, steps)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    losses = []
    for step in range(start, stop or steps):
        set_step(model, step)  # drives step schedules (interval, algo) and history_unit="step"
        total = 0.0
        for tokens in data[step * accum:(step + 1) * accum]:
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
            (loss / accum).backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total / accum))
    return losses, {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


CONFIG = Hif8TrainingConfig(algo="most_recent", history_len=4, interval={0: 1, 2: 3}, scope="attn_mlp")


def test_the_public_names_import_and_the_formats_export_the_quantizers():
    from hif8qat.formats import fp8_qdq, hif8_qdq

    x = torch.linspace(-3, 3, 101)
    assert torch.equal(hif8_qdq(hif8_qdq(x)), hif8_qdq(x)) and fp8_qdq(x, "e4m3").shape == x.shape
    assert {"Hif8TrainingConfig", "convert_to_hif8_training", "set_step"} <= set(hif8qat.__all__)


def test_the_config_is_frozen_checked_once_and_a_scalar_target_still_works():
    with pytest.raises(ValueError, match="history_len"):
        Hif8TrainingConfig(history_len=0)
    with pytest.raises(ValueError, match="scope"):
        Hif8TrainingConfig(scope="everything")
    with pytest.raises(ValueError, match="target"):
        Hif8TrainingConfig(target={"X": 3.0})
    with pytest.raises(ValueError, match="target"):
        Hif8TrainingConfig(format="e4m3", target=8.0)
    config = Hif8TrainingConfig(target=8.0)
    with pytest.raises(AttributeError):
        config.history_len = 3  # frozen
    # one number for every role, or per role: the scalers' targets follow
    for target, want in ((8.0, [8.0, 8.0, 8.0]), ({"W": 4.0}, [15.0, 4.0, 15.0])):
        model = convert_to_hif8_training(tiny(1), config=Hif8TrainingConfig(target=target))
        (bank,) = hif8qat.quant.linear.scaler_banks(model)
        assert bank.targets[:3] == want


def test_one_bank_per_conversion_and_the_filter_decides(monkeypatch):
    from hif8qat.scaling import bank as bank_module

    built = []
    init = bank_module.ScalerBank.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(bank_module.ScalerBank, "__init__", counted)
    model = tiny(3)
    convert_to_hif8_training(model, config=Hif8TrainingConfig(scope="mlp", high_precision_blocks=[0]),
                             module_filter_fn=lambda mod, fqn: not fqn.endswith("down_proj"))
    assert len(built) == 1
    names = [n for n, m in model.named_modules() if isinstance(m, hif8qat.QuantLinear)]
    assert names == [f"model.layers.{i}.mlp.{p}" for i in (1, 2) for p in ("gate_proj", "up_proj")]


def test_the_plain_loop_resumes_bit_for_bit_from_state_dicts(tmp_path):
    data = batches(12)
    straight, final = plain_loop(convert_to_hif8_training(tiny(), config=CONFIG), data, steps=6, accum=2)
    first, state = plain_loop(convert_to_hif8_training(tiny(), config=CONFIG), data, steps=6, stop=3, accum=2)
    assert any(".hif8_scaler.A.history" in k for k in state["model"])
    torch.save(state, tmp_path / "ckpt.pt")
    other = convert_to_hif8_training(build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=9)[0],
                                     config=CONFIG)  # other weights: everything comes from the checkpoint
    rest, resumed = plain_loop(other, data, steps=6, accum=2, start=3, state=torch.load(tmp_path / "ckpt.pt"))
    assert first + rest == straight
    assert_same_state(resumed["model"], final["model"])


def test_a_plain_checkpoint_refuses_to_load_silently_without_scalers():
    model = convert_to_hif8_training(tiny(1), config=CONFIG)
    plain = {k: v for k, v in model.state_dict().items() if ".hif8_scaler." not in k}
    result = model.load_state_dict(plain, strict=False)
    assert result.missing_keys and all(".hif8_scaler." in k for k in result.missing_keys)
    with pytest.raises(RuntimeError, match="hif8_scaler"):
        model.load_state_dict(plain)


def test_the_plain_loop_gives_the_pipeline_trainers_losses(tmp_path):
    from test_reliability import cli_config

    from hif8qat.config.numerics import resolve_run, train_numerics
    from hif8qat.config.run_config import resolve_profile
    from hif8qat.data.loader import build_train_stream
    from hif8qat.models.loading import build_tiny_tokenizer
    from hif8qat.train.loop import seed_everything, train

    cfg = resolve_run(resolve_profile(cli_config(["experiment=exp3", "profile=smoke", "stage=train",
                                                  "model.name=tiny:2", "profile.steps=4", "train.autocast=none",
                                                  f"results_root={tmp_path}"])))
    assert cfg.quant.training.interval == {0: 1, 1: 10}  # exp3's switch, scaled: the plain loop must follow it too
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir, numerics=train_numerics(cfg))
    pipeline = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    t = cfg.train
    accum = t.global_batch_size // t.micro_batch_size
    stream = build_train_stream(cfg.data.source, build_tiny_tokenizer(), seq_len=t.seq_len,
                                micro_batch_size=t.micro_batch_size, seed=cfg.seed, cache_dir=cfg.data.cache_dir)
    data = [next(stream) for _ in range(t.steps * accum)]
    seed_everything(cfg.seed)
    model, _ = build_tiny_llama(num_layers=2)
    config = Hif8TrainingConfig(**cfg.quant.training.scaling().to_dict(), scope=cfg.quant.training.scope,
                                high_precision_blocks=cfg.quant.high_precision_blocks)
    convert_to_hif8_training(model, config=config)
    model.train()
    losses, _ = plain_loop(model, data, steps=t.steps, accum=accum, lr=t.lr, warmup=t.lr_warmup_steps,
                           betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, grad_clip=t.grad_clip)
    assert losses == pipeline


# ------------------------------------------------------------------------------------------- HF Trainer
def test_hf_trainer_trains_saves_and_resumes_bit_for_bit(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hif8qat.integrations.hf import StepCallback  # the optimizer step for the schedules

    rows = [{"input_ids": b[0], "labels": b[0]} for b in batches(16, micro=1)]

    def run(out: Path, resume: str | None = None):
        model = convert_to_hif8_training(tiny(), config=CONFIG)
        args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3,
                                 logging_steps=1, save_steps=3, save_strategy="steps", report_to=[], use_cpu=True,
                                 seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepCallback()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}, model

    straight, model = run(tmp_path / "a")
    saved = tmp_path / "a" / "checkpoint-3"
    resumed, again = run(tmp_path / "b", resume=str(saved))
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert {k: resumed[k] for k in (4, 5, 6)} == {k: straight[k] for k in (4, 5, 6)}
    assert_same_state(again.state_dict(), model.state_dict())
    from safetensors.torch import load_file

    assert any(".hif8_scaler.G.history" in k for k in load_file(saved / "model.safetensors"))


# ------------------------------------------------------------------------------------------- torch.compile
def test_torch_compile_of_a_converted_model_has_no_graph_break():
    model = convert_to_hif8_training(tiny(), config=CONFIG)
    ids = batches(1)[0]

    def step(ids):
        return model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        explain = torch._dynamo.explain(step)(ids)
    hif8qat.update_scales(model)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(step)
    with torch.no_grad():
        assert torch.isfinite(compiled(ids)).all()


# ------------------------------------------------------------------------------------------- FSDP2
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = convert_to_hif8_training(tiny(), config=CONFIG)
        hif8qat.set_weight_recompute(model)  # under FSDP: re-quantize the gathered weight in backward
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        # every rank the same batches: averaged gradients equal one process's, so the losses must too
        losses, state = plain_loop(model, batches(8), steps=4, accum=2, grad_clip=0)
        scalers = {k: v for k, v in state["model"].items() if ".hif8_scaler." in k}
        torch.save({"losses": losses, "scalers": scalers}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_two_cpu_ranks_trains_as_one_process(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    single, state = plain_loop(convert_to_hif8_training(tiny(), config=CONFIG), batches(8), steps=4, accum=2,
                               grad_clip=0)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["losses"] == single
        assert_same_state(got["scalers"], {k: v for k, v in state["model"].items() if ".hif8_scaler." in k})


# ------------------------------------------------------------------------------------------- installed alone
def test_the_package_installs_into_a_fresh_environment_with_torch(tmp_path):
    """``pip install`` into a new venv that sees only the system's torch and numpy (no project install): the
    public API imports, and no pipeline module is loaded by it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = next((venv / "lib").glob("python*/site-packages"))
    torch_dir = Path(torch.__file__).resolve().parents[1]
    # torch and numpy from this interpreter's site-packages, nothing else of it
    (site / "torch_only.pth").write_text(str(tmp_path / "deps") + "\n")
    (tmp_path / "deps").mkdir()
    import numpy

    for mod in (torch, numpy):
        (tmp_path / "deps" / Path(mod.__file__).parent.name).symlink_to(Path(mod.__file__).parent)
    for extra in ("typing_extensions.py", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
                  "fsspec", "numpy.libs", "torchgen"):
        if (torch_dir / extra).exists():
            (tmp_path / "deps" / extra).symlink_to(torch_dir / extra)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--disable-pip-version-check", "--target", str(site), str(ROOT)], check=True, env=env,
                   capture_output=True)
    code = ("import sys, hif8qat; from hif8qat import Hif8TrainingConfig, convert_to_hif8_training; "
            "from hif8qat.formats import hif8_qdq; "
            "assert 'site-packages' in hif8qat.__file__, hif8qat.__file__; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'safetensors', 'yaml', "
            "'hydra', 'pandas') or m.split('.')[:2] in (['hif8qat', 'config'], ['hif8qat', 'models'], "
            "['hif8qat', 'files'], ['hif8qat', 'train'])); assert not bad, bad; print('ok')")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_readmes_ten_line_example_trains_and_keeps_its_scalers_in_the_state_dict():
    """The README's "library in ten lines" block, run as printed on a tiny Llama: it converts the model, the
    losses are finite, and the scalers' state it promises (amax histories, scales) is in model.state_dict() and
    has moved off its initial values."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## The library in ten lines", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 10, code
    model = tiny(num_layers=30)
    (x,) = batches(1, micro=2, seq=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    namespace = {"model": model, "x": x, "steps": 2, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    exec(compile(code, "README.md", "exec"), namespace)
    assert torch.isfinite(namespace["loss"])
    state = model.state_dict()
    scaler_keys = [k for k in state if k not in before or "history" in k or "scale" in k]
    assert any("history" in k for k in scaler_keys), sorted(state)[:20]
    quantized = [n for n, m in model.named_modules() if n.endswith("mlp.up_proj") and type(m) is not torch.nn.Linear]
    assert quantized and not any(f"layers.{i}.mlp" in n for n in quantized for i in (0, 1, 2, 28, 29))
    histories = [state[k] for k in scaler_keys if k.endswith("history")]
    assert histories and all(h.dtype.is_floating_point for h in histories)
    assert all(bool((h > 0).any()) for h in histories)  # every quantizer recorded amaxes while training
