"""The CUDA path: bit-exact quantizer on GPU, compiled and eager; no host sync per scaler call; a QAT training
step with BF16 autocast; the trainer end to end on CUDA (DDP/FSDP over NCCL when there are 2+ GPUs); FSDP
checkpoints over NCCL; evaluation on the GPU with the training numerics. Every test here is `gpu`-marked
(skipped without CUDA by conftest.py; benchmarks/gpu_check.sh runs them). The helpers take a device so their
logic can be exercised on CPU as well."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hif8qat.formats import kernels as qdq_kernels
from hif8qat.formats import qdq as formats
from hif8qat.formats.qdq import hif8_encode, hif8_qdq, hif8_qdq_scaled, hif8_qdq_scaled_amax
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ScalingConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including NaN positions and signed zeros (compared as integers of the same width)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(view), b[~nan].view(view)))


def random_fp32_patterns(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 15.0, 32768.0, 40959.9,
                            40960.0, -40960.0, 2.0**-22, 2.0**-23, 1.5 * 2.0**-23, 2.0**-16, 1e-45])
    return torch.cat([bits.view(torch.float32), special])


def quantizer_matches_cpu(device: str) -> None:
    """qdq / encode / scaled / scaled+amax on `device` equal the CPU results bit for bit (fp32, bf16, fp16)."""
    x = random_fp32_patterns(1 << 20)
    xd = x.to(device)
    assert same_bits(hif8_qdq(xd), hif8_qdq(x))
    assert torch.equal(hif8_encode(xd).cpu(), hif8_encode(x))
    for dt in (torch.bfloat16, torch.float16):
        p = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dt)
        assert same_bits(hif8_qdq(p.to(device)), hif8_qdq(p))
    finite = x[torch.isfinite(x)][: 1 << 18]
    for scale in (3.7, 2.0**-10, 1e4):
        assert same_bits(hif8_qdq_scaled(finite.to(device), torch.tensor(scale, device=device)),
                         hif8_qdq_scaled(finite, scale))
        y, amax = hif8_qdq_scaled_amax(finite.to(device), torch.tensor(scale, device=device))
        y0, amax0 = hif8_qdq_scaled_amax(finite, scale)
        assert same_bits(y, y0) and same_bits(amax, amax0)


def scaler_calls(device: str, algo: str, unit: str, sync_guard) -> list[float]:
    """Run a scaler for a few steps with `sync_guard()` active around the calls; return its history."""
    cfg = ScalingConfig(algo=algo, history_len=8, interval={0: 1, 3: 2}, history_unit=unit, amax_reduce="none")
    sc = BankedScaler.standalone("A", cfg, device=device)
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).to(device)
    sc.quantize(x)  # warm-up: lazy imports, compiled kernels
    with sync_guard():
        for step in range(8):
            sc.set_step(step)
            for _ in range(2):  # two micro-batches per step
                sc.quantize(x * (step + 1))
    return sc.history_values()


class _CudaSyncErrors:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def qat_step(device: str, autocast: bool, steps: int = 3) -> list[float]:
    """A small Llama with MLP + attention linears in HiF8: forward/backward/AdamW steps; returns the losses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hif8qat.quant.linear import _convert_model, quant_linears, set_quantization, set_step

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    converted = _convert_model(model, "attn_mlp", [0], ScalingConfig(algo="max", history_len=16))
    assert len(converted) == 3 * 7
    set_quantization(model, True)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for step in range(steps):
        set_step(model, step)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    for _, mod in quant_linears(model):
        for _, sc in mod.scalers():
            assert sc.history.device.type == torch.device(device).type and sc.initialized
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


# ------------------------------------------------------------------------------------------------
def test_quantizer_cuda_equals_cpu_compiled():
    quantizer_matches_cpu("cuda")
    assert formats.compile_status()["failed"] is None, formats.compile_status()


def test_quantizer_cuda_equals_cpu_eager(monkeypatch):
    monkeypatch.setenv("HIF8QAT_COMPILE", "0")
    quantizer_matches_cpu("cuda")


def test_quantizer_is_compiled_on_gpu_and_equals_eager(monkeypatch):
    x = torch.randn(1 << 22, device="cuda") * 100
    s = torch.tensor(0.37, device="cuda")
    y, amax = hif8_qdq_scaled_amax(x, s)
    status = formats.compile_status()
    assert status == {"enabled": True, "failed": None}, status
    assert any(key[-2] == "cuda" for key in qdq_kernels._compiled), "no CUDA variant was compiled"
    monkeypatch.setenv("HIF8QAT_COMPILE", "0")
    y_eager, amax_eager = hif8_qdq_scaled_amax(x, s)
    assert same_bits(y, y_eager) and same_bits(amax, amax_eager)


@pytest.mark.parametrize("algo", ["max", "most_recent", "mean"])
@pytest.mark.parametrize("unit", ["call", "step"])
def test_scaler_makes_no_host_sync_per_call(algo, unit):
    history = scaler_calls("cuda", algo, unit, _CudaSyncErrors)
    assert history == scaler_calls("cpu", algo, unit, _Null)  # same amaxes, bit for bit


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_qat_training_step_on_cuda_with_bf16_autocast():
    cuda = qat_step("cuda", autocast=True)
    assert cuda[-1] < cuda[0]
    fp32_cuda, fp32_cpu = qat_step("cuda", autocast=False), qat_step("cpu", autocast=False)
    # Same algorithm on both devices: fp32 losses agree to GEMM rounding (not bitwise: different kernels).
    assert fp32_cuda == pytest.approx(fp32_cpu, rel=5e-3)


def _run(args: list[str], launcher: list[str] | None = None, timeout: int = 900):
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = (launcher or [sys.executable]) + [str(ROOT / "run.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


SMOKE_CUDA = ["experiment=exp8", "profile=smoke", "stage=train", "logger.progress_bar=false", "train.device=cuda",
              "train.autocast=bf16"]


def test_trainer_smoke_run_on_cuda_with_bf16_autocast(tmp_path):
    _run(SMOKE_CUDA + [f"results_root={tmp_path}"])
    folder = next((tmp_path / "smoke" / "exp8").iterdir())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    assert any(r.get("quant") for r in rows)
    assert (folder / "DONE").exists() and (folder / "export" / "hif8qat_scalers.safetensors").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_trainer_two_gpus_nccl(tmp_path, strategy):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run(SMOKE_CUDA + [f"results_root={tmp_path}", f"train.distributed={strategy}", "quant.amax_reduce=max"],
         launcher=torchrun)
    folder = next((tmp_path / "smoke" / "exp8").iterdir())
    assert (folder / "DONE").exists()
    final = sorted((folder / "checkpoints").glob("step_*"))[-1]
    ranks = [torch.load(final / f"rank{r:03d}.pt", weights_only=True) for r in (0, 1)]
    a = [{k: v for k, v in r["scalers"].items() if ".A." in k} for r in ranks]
    assert a[0] and all(torch.equal(a[0][k], a[1][k]) for k in a[0])


def fsdp_checkpoint_roundtrip(device: str, backend: str, tmp_path: Path) -> None:
    """One-rank FSDP on `device`: checkpoint written (gathered, CPU-offloaded) and read back (broadcast)."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hif8qat.train import checkpoint as ckpt
    from hif8qat.train.distributed import apply_fsdp, full_model_state_dict

    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)

        def build():
            torch.manual_seed(0)
            model = apply_fsdp(LlamaForCausalLM(cfg).to(device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

        model, opt, sched = build()
        tokens = torch.randint(0, 128, (2, 17), device=device)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        sched.step()
        path = ckpt.save_checkpoint(tmp_path / "ck", 1, model=model, optimizer=opt, scheduler=sched,
                                    rank_state={"r": 0})
        other, other_opt, other_sched = build()
        ckpt.load_checkpoint(path, model=other, optimizer=other_opt, scheduler=other_sched)
        a, b = full_model_state_dict(model), full_model_state_dict(other)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(v.device.type == "cpu" for v in a.values())
        assert all(p.device.type == torch.device(device).type for p in other.parameters())
    finally:
        dist.destroy_process_group()


def test_fsdp_checkpoint_roundtrip_over_nccl(tmp_path):
    fsdp_checkpoint_roundtrip("cuda", "nccl", tmp_path)


def test_evaluation_defaults_to_the_gpu_with_bf16_autocast_over_fp32_weights(tmp_path):
    from hif8qat.artefacts import write_folder_manifest
    from hif8qat.compute_dtype import Numerics
    from hif8qat.config.numerics import eval_numerics
    from hif8qat.evaluate import runner
    from hif8qat.models.loading import build_tiny_llama
    from hif8qat.models.quant_files import save_quant_export
    from hif8qat.quant.linear import _convert_model, set_quantization

    model, tok = build_tiny_llama(num_layers=2, hidden_size=64, intermediate_size=128)
    model.save_pretrained(tmp_path / "export")
    tok.save_pretrained(tmp_path / "export")
    _convert_model(model, "mlp", None, ScalingConfig(algo="max", history_len=4))
    set_quantization(model, True)
    with torch.no_grad():
        model(torch.randint(3, 200, (2, 16)))
    save_quant_export(model, tmp_path / "export", {"step": 1})
    write_folder_manifest(tmp_path / "export")
    device, numerics = eval_numerics("auto", "auto", train_device="auto", train=Numerics("bf16", "cuda"))
    assert (device, numerics) == ("cuda", Numerics("bf16", "cuda"))
    res = runner.evaluate_export(tmp_path / "export", "hif8", "mini_arc", device=device, numerics=numerics,
                                 limit=4, batch_size=4)
    meta = res["_meta"]
    assert meta["device"].startswith("cuda") and (meta["dtype"], meta["autocast"]) == ("float32", "bfloat16")
    assert res["mini_arc"]["n"] == 4
