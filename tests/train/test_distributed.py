"""Scale-out on CPU: FSDP2 over gloo (checkpoint, exact resume, export), emulated multi-node torchrun,
Hydra's submitit local launcher, and the SLURM -> torch.distributed environment mapping."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_state

from hif8qat.runs.launch_env import env_from_slurm, expand_hostlist

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["experiment=exp8", "profile=smoke", "stage=train", "logger.progress_bar=false", "train.num_threads=1"]
FSDP = ["train.distributed=fsdp", "quant.amax_reduce=max", "train.checkpoint_every=3"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# These tests check the distributed plumbing: the eager quantizer (bit-identical to the compiled one, see
# test_formats.py) spares every process a cold torch.compile on the two shared cores.
ENV = {"PYTHONHASHSEED": "0", "HIF8QAT_COMPILE": "0"}


def run(args: list[str], env_extra: dict | None = None, launcher: list[str] | None = None, check=True):
    env = {**os.environ, **ENV, **(env_extra or {})}
    cmd = (launcher or [sys.executable]) + [str(ROOT / "run.py")] + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


def only_run_folder(root: Path) -> Path:
    folders = list((root / "smoke" / "exp8").iterdir())
    assert len(folders) == 1, folders
    return folders[0]


def losses(folder: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def rank_states(checkpoint: Path, world_size: int = 2) -> list[dict]:
    return [torch.load(checkpoint / f"rank{r:03d}.pt", weights_only=True) for r in range(world_size)]


def activation_scales(rank_state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in rank_state["scalers"].items() if ".A." in k}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# SLURM environment mapping (fast)
# ------------------------------------------------------------------------------------------------
def test_expand_hostlist():
    assert expand_hostlist("gpu[001-003,7],login1") == ["gpu001", "gpu002", "gpu003", "gpu7", "login1"]
    assert expand_hostlist("node12") == ["node12"]
    assert expand_hostlist("a[1-2]-ib[3,5]") == ["a1-ib3", "a1-ib5", "a2-ib3", "a2-ib5"]


def test_env_from_slurm_maps_an_srun_task_to_torch_variables():
    env = {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "16",
           "SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "gpu-[017-018]",
           "SLURM_JOB_NODELIST": "gpu-[017-018]", "SLURM_JOB_ID": "123456", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    other_task = {**env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    set_now = env_from_slurm(env)
    assert set_now == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                       "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu-017", "MASTER_PORT": set_now["MASTER_PORT"]}
    assert env["RANK"] == "9" and 1024 < int(env["MASTER_PORT"]) < 32768
    env_from_slurm(other_task)  # every task of the job agrees on the rendezvous point
    assert (other_task["MASTER_ADDR"], other_task["MASTER_PORT"]) == (env["MASTER_ADDR"], env["MASTER_PORT"])
    another_job = {**env, "SLURM_JOB_ID": "123457"}
    for k in set_now:
        another_job.pop(k)
    env_from_slurm(another_job)
    assert another_job["MASTER_PORT"] != env["MASTER_PORT"]  # two jobs sharing a node do not collide


def test_env_from_slurm_leaves_torchrun_and_batch_scripts_alone():
    under_torchrun = {"WORLD_SIZE": "8", "RANK": "3", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    assert env_from_slurm(under_torchrun) == {} and under_torchrun["RANK"] == "3"
    # The sbatch script itself (no srun step): SLURM_NTASKS describes the allocation, not this process.
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "5"}
    assert env_from_slurm(batch_script) == {} and "WORLD_SIZE" not in batch_script
    assert env_from_slurm({}) == {}
    preset = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]",
              "SLURM_JOB_ID": "5", "MASTER_PORT": "29500"}
    env_from_slurm(preset)
    assert preset["MASTER_PORT"] == "29500" and preset["MASTER_ADDR"] == "n1" and preset["WORLD_SIZE"] == "2"


def test_env_from_slurm_maps_submitit_local_tasks():
    env = {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1",
           "SUBMITIT_LOCAL_JOB_ID": "4242"}
    env_from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "2", "1", "127.0.0.1")
    single = {"SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_JOB_ID": "1"}
    assert env_from_slurm(single) == {}


# ------------------------------------------------------------------------------------------------
# Checkpoint format under FSDP, in process (one gloo rank): same files as without FSDP, loadable both ways
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def single_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tiny(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _one_step(model):
    opt, sched = _optimizer(model)
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return opt, sched


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_checkpoint_is_the_plain_format_and_loads_both_ways(tmp_path, single_rank_group, tied):
    from safetensors.torch import load_file, load_model

    from hif8qat.train import checkpoint as ckpt
    from hif8qat.train.distributed import apply_fsdp, full_model_state_dict, full_optimizer_state_dict

    sharded = apply_fsdp(_tiny(tied))
    opt, sched = _one_step(sharded)
    path = ckpt.save_checkpoint(tmp_path / "fsdp", 1, model=sharded, optimizer=opt, scheduler=sched,
                                rank_state={"x": 1})
    weights = full_model_state_dict(sharded)

    # The same file names and keys as a checkpoint written without FSDP (tied weights stored once).
    plain = _tiny(tied)
    plain_opt, plain_sched = _one_step(plain)
    ref = ckpt.save_checkpoint(tmp_path / "plain", 1, model=plain, optimizer=plain_opt, scheduler=plain_sched,
                               rank_state={"x": 1})
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert load_file(path / "model.safetensors").keys() == load_file(ref / "model.safetensors").keys()

    # FSDP checkpoint -> plain model and optimizer (resume without FSDP).
    fresh = _tiny(tied)
    load_model(fresh, str(path / "model.safetensors"))
    fresh_opt, fresh_sched = _optimizer(fresh)
    step, state = ckpt.load_checkpoint(path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert step == 1 and state == {"x": 1}
    assert all(torch.equal(v, weights[k]) for k, v in fresh.state_dict().items())
    full_opt = full_optimizer_state_dict(sharded, opt)
    names = [n for n, _ in fresh.named_parameters()]
    for i, name in enumerate(names):
        for key, value in full_opt["state"][name].items():
            assert torch.equal(fresh_opt.state_dict()["state"][i][key], value), (name, key)

    # Plain (index-keyed optimizer) checkpoint -> FSDP model (resume with FSDP).
    target = apply_fsdp(_tiny(tied))
    target_opt, target_sched = _optimizer(target)
    ckpt.load_checkpoint(ref, model=target, optimizer=target_opt, scheduler=target_sched)
    got = full_model_state_dict(target)
    assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
    got_opt = full_optimizer_state_dict(target, target_opt)
    plain_names = [n for n, _ in plain.named_parameters()]
    for i, name in enumerate(plain_names):
        for key, value in plain_opt.state_dict()["state"][i].items():
            assert torch.equal(got_opt["state"][name][key], value), (name, key)


# ------------------------------------------------------------------------------------------------
# Gradient accumulation: two gloo ranks spawned in process, DDP and FSDP2 side by side
# ------------------------------------------------------------------------------------------------
ACCUM, STEPS, LAYERS = 2, 2, 2


def _accumulation_worker(rank: int, world: int, store: str, out: str, fsdp_grad_sync: bool) -> None:
    """Train the same tiny Llama under DDP and FSDP2 with ACCUM micro-batches per step; save what a test needs.

    Counts FSDP2's reduce-scatters per optimizer step by wrapping the collective FSDP2 calls.
    fsdp_grad_sync=False is the trainer before grad_sync: DDP's no_sync was used, FSDP2 (which has none) synced.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hif8qat.train.distributed import apply_fsdp, grad_sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    calls = {"reduce_scatter": 0}
    # FSDP2 reduce-scatters through reduce_scatter_single where torch has it (2.13), reduce_scatter_tensor before
    collective = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, collective)

    def counting(*args, **kwargs):
        calls["reduce_scatter"] += 1
        return original(*args, **kwargs)

    setattr(dist, collective, counting)
    try:
        models = {"ddp": DistributedDataParallel(_tiny(False)), "fsdp": apply_fsdp(_tiny(False))}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
        data = torch.randint(0, 96, (STEPS, ACCUM, world, 2, 9), generator=torch.Generator().manual_seed(3))
        result: dict = {"reduce_scatters": [], "grads": {}, "losses": {}}
        for name, model in models.items():
            losses = []
            for step in range(STEPS):
                before = calls["reduce_scatter"]
                for micro in range(ACCUM):
                    tokens = data[step, micro, rank]
                    last = micro == ACCUM - 1
                    sync = grad_sync(model, last) if name == "ddp" or fsdp_grad_sync else contextlib.nullcontext()
                    with sync:
                        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
                        (loss / ACCUM).backward()
                    losses.append(loss.item())
                if name == "fsdp":
                    result["reduce_scatters"].append(calls["reduce_scatter"] - before)
                if step == STEPS - 1:  # full gradients of the last step, before the optimizer consumes them
                    result["grads"][name] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                                 else p.grad).clone() for n, p in model.named_parameters()}
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
            result["losses"][name] = losses
        if rank == 0:
            torch.save(result, out)
    finally:
        setattr(dist, collective, original)
        dist.destroy_process_group()


def _accumulate(tmp_path: Path, fsdp_grad_sync: bool) -> dict:
    import torch.multiprocessing as mp

    out = tmp_path / "result.pt"
    mp.spawn(_accumulation_worker, args=(2, str(tmp_path / "store"), str(out), fsdp_grad_sync), nprocs=2)
    return torch.load(out, weights_only=True)


@pytest.mark.slow  # two spawned ranks
def test_fsdp2_accumulates_gradients_like_ddp_with_one_reduce_scatter_per_group_and_step(tmp_path):
    result = _accumulate(tmp_path, fsdp_grad_sync=True)
    groups = LAYERS + 1  # one FSDP unit per transformer block, plus the root (embeddings, norm, lm_head)
    assert result["reduce_scatters"] == [groups] * STEPS  # not one per micro-batch
    ddp, fsdp = result["grads"]["ddp"], result["grads"]["fsdp"]
    # DDP module names carry a "module." prefix; the tensors themselves must agree bit for bit.
    assert [n.removeprefix("module.") for n in ddp] == list(fsdp)
    assert all(torch.equal(g, fsdp[n.removeprefix("module.")]) for n, g in ddp.items())
    assert result["losses"]["ddp"] == result["losses"]["fsdp"]


@pytest.mark.slow
def test_without_grad_sync_fsdp2_reduce_scatters_every_micro_batch_and_drifts_from_ddp(tmp_path):
    """The control: what the trainer did before grad_sync (it looked for no_sync, which FSDP2 lacks)."""
    result = _accumulate(tmp_path, fsdp_grad_sync=False)
    assert result["reduce_scatters"] == [(LAYERS + 1) * ACCUM] * STEPS
    ddp, fsdp = result["grads"]["ddp"], result["grads"]["fsdp"]
    # Reduced per micro-batch, the sum is rounded in another order than DDP's: the bitwise test above can fail.
    assert any(not torch.equal(g, fsdp[n.removeprefix("module.")]) for n, g in ddp.items())


# ------------------------------------------------------------------------------------------------
# End to end (slow)
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp_two_cpu_ranks_resume_bit_exact_and_export_like_ddp(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hif8qat.models.loading import load_causal_lm
    from hif8qat.models.quant_files import load_quant_export
    from hif8qat.quant.linear import quant_state_dict

    # Uninterrupted run: two ranks started by submitit's local executor (the launcher's srun-like path:
    # env_from_slurm maps its task variables to torch's), FSDP over gloo, amax all-reduced.
    whole = tmp_path / "whole"
    run(["-m", "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={tmp_path}/sweep",
         *SMOKE, *FSDP, f"results_root={whole}"])
    # Interrupted run under torchrun: SIGKILL at the start of step 5, then resume from the step-3 checkpoint.
    crashed = tmp_path / "crashed"
    torchrun = TORCHRUN + ["--standalone", "--nproc_per_node", "2"]
    out = run(SMOKE + FSDP + [f"results_root={crashed}"], env_extra={"HIF8QAT_TEST_KILL_AT_STEP": "5"},
              launcher=torchrun, check=False)
    assert out.returncode != 0
    folder = only_run_folder(crashed)
    assert not (folder / "DONE").exists()
    assert [p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_0000003"]
    run(SMOKE + FSDP + [f"results_root={crashed}", "train.resume=auto"], launcher=torchrun)
    whole_folder = only_run_folder(whole)
    assert (folder / "DONE").exists() and (whole_folder / "DONE").exists()
    got, expected = losses(folder), losses(whole_folder)
    assert [s for s, _ in got] == list(range(8))
    assert got == expected  # exact float equality across the kill, the relaunch and the two launchers

    final = folder / "checkpoints" / "step_0000008"
    ranks = rank_states(final)
    scales = [activation_scales(r) for r in ranks]
    assert scales[0] and scales[0].keys() == scales[1].keys()
    assert all(torch.equal(scales[0][k], scales[1][k]) for k in scales[0])  # amax_reduce=max under FSDP
    assert [r["data"]["rank"] for r in ranks] == [0, 1]

    # The two ranks' sharded checkpoint loads into a plain (unsharded) model in one process.
    from hif8qat.train import checkpoint as ckpt
    from hif8qat.train.loop import parameter_groups

    assert json.loads((final / ckpt.COMPLETE_MARKER).read_text())["layout"] == "dcp"
    plain, _ = load_causal_lm("tiny:8")
    plain_opt = torch.optim.AdamW(parameter_groups(plain, 0.1), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda s: 1.0)
    assert ckpt.load_checkpoint(final, model=plain, optimizer=plain_opt, scheduler=sched)[0] == 8
    weights = plain.state_dict()
    # The export is a save_pretrained folder that plain transformers loads, with the final weights.
    export = folder / "export"
    hf = AutoModelForCausalLM.from_pretrained(export)
    assert all(torch.equal(v, weights[k]) for k, v in hf.state_dict().items() if k in weights)
    assert set(weights) <= set(hf.state_dict())
    load_quant_export(hf, export)
    assert any(".A." in k for k in quant_state_dict(hf))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["converted_linears"] > 0

    # The resumed run ends in the uninterrupted run's state, bit for bit: the weights and optimizer state of its
    # final checkpoint, each rank's scaler histories, data position and RNG, and the exported weights.
    other = load_causal_lm("tiny:8")[0]
    other_opt = torch.optim.AdamW(parameter_groups(other, 0.1), lr=1e-3)
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0)
    whole_final = whole_folder / "checkpoints" / "step_0000008"
    assert ckpt.load_checkpoint(whole_final, model=other, optimizer=other_opt, scheduler=other_sched)[0] == 8
    assert_same_state(plain.state_dict(), other.state_dict(), "model")
    assert_same_state(plain_opt.state_dict(), other_opt.state_dict(), "optimizer")
    assert_same_state(sched.state_dict(), other_sched.state_dict(), "scheduler")
    assert_same_state(ranks, rank_states(whole_final), "rank states")
    assert_same_state(*(load_file(f / "export" / "model.safetensors") for f in (folder, whole_folder)), "export")
    # FSDP against DDP: test_trainer_fsdp_equals_ddp_bitwise_with_gradient_accumulation.


@pytest.mark.slow
def test_trainer_fsdp_equals_ddp_bitwise_with_gradient_accumulation(tmp_path):
    from safetensors.torch import load_file

    torchrun = TORCHRUN + ["--standalone", "--nproc_per_node", "2"]
    # 2 ranks x 2 micro-batches x accumulation 2. No clipping: the gradient norm of sharded DTensors is summed
    # in another order than DDP's (last-bit differences in the clip factor), which is not what is tested here.
    accum = ["train.global_batch_size=8", "train.micro_batch_size=2", "quant.amax_reduce=max", "train.grad_clip=0"]
    folders = {}
    for strategy in ("ddp", "fsdp"):
        run(SMOKE + accum + [f"train.distributed={strategy}", f"results_root={tmp_path / strategy}"],
            launcher=torchrun)
        folders[strategy] = only_run_folder(tmp_path / strategy)
    # Bitwise because with 2 ranks every gradient reduction is a sum of two (order-free); with more ranks or
    # NCCL, FSDP and DDP differ by rounding.
    assert len(losses(folders["ddp"])) == 8 and losses(folders["fsdp"]) == losses(folders["ddp"])
    names = [sorted(p.name for p in (folders[s] / "export").iterdir()) for s in ("ddp", "fsdp")]
    assert names[0] == names[1]
    ddp, fsdp = (load_file(folders[s] / "export" / "model.safetensors") for s in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys() and all(torch.equal(ddp[k], fsdp[k]) for k in ddp)


@pytest.mark.slow
def test_two_emulated_nodes_shard_data_by_global_rank_into_one_run_folder(tmp_path):
    port = free_port()
    procs = []
    env = {**os.environ, **ENV}
    for node_rank in (0, 1):
        cmd = TORCHRUN + ["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
                          "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "hif8test",
                          str(ROOT / "run.py"), *SMOKE, f"results_root={tmp_path}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    folder = only_run_folder(tmp_path)  # one folder although two "nodes" each have a LOCAL_RANK 0
    assert (folder / "DONE").exists() and len(losses(folder)) == 8
    assert len(json.loads((folder / "run_info.json").read_text())["history"]) == 1  # written by rank 0 only
    ranks = rank_states(folder / "checkpoints" / "step_0000008")
    assert [r["data"]["rank"] for r in ranks] == [0, 1] and {r["data"]["world_size"] for r in ranks} == {2}
    # Different data on the two ranks: their (not reduced) activation amax histories differ.
    scales = [activation_scales(r) for r in ranks]
    assert scales[0] and any(not torch.equal(scales[0][k], scales[1][k]) for k in scales[0])


@pytest.mark.slow
def test_local_launcher_sweep_runs_both_points_into_distinct_folders(tmp_path):
    out = run(["-m", "hydra/launcher=local", *SMOKE, "quant.history_len=16,32", f"results_root={tmp_path}/runs",
               f"hydra.sweep.dir={tmp_path}/sweep"])
    assert "Submitit 'local' sweep" in out.stdout + out.stderr
    folders = sorted(p.name for p in (tmp_path / "runs" / "smoke" / "exp8").iterdir())
    assert folders == ["seed0-quant.history_len=16", "seed0-quant.history_len=32"]
    for name in folders:
        folder = tmp_path / "runs" / "smoke" / "exp8" / name
        assert (folder / "DONE").exists() and len(losses(folder)) == 8
    jobs = [p for p in (tmp_path / "sweep" / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 2  # two submitit jobs
