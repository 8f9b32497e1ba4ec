"""A resume that lands exactly at the end of the BF16 warmup continues quantized: the step the run was killed
at is the first quantized one, and the resumed run's quantizers run from there on."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_train import run

# exp8 at the smoke profile: the warmup (5000 steps at paper scale) ends at step 4, where a checkpoint is written
# (train.checkpoint_every=4); killed as step 5 starts, the resume starts at step 4 itself.
ARGS = ["experiment=exp8", "profile=smoke", "stage=train", "logger.progress_bar=false", "train.num_threads=1",
        "quant.bf16_warmup_steps=5000", "train.checkpoint_every=4"]


@pytest.mark.slow
def test_a_resume_at_the_end_of_the_warmup_continues_quantized(tmp_path):
    out = run(ARGS + [f"results_root={tmp_path}"], env_extra={"HIF8QAT_TEST_KILL_AT_STEP": "5",
                                                              "HIF8QAT_COMPILE": "0"}, check=False)
    assert out.returncode != 0
    (folder,) = (tmp_path / "smoke" / "exp8").glob("seed0*")
    assert sorted(p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_0000004"]
    cold = load_file(str(folder / "checkpoints" / "step_0000004" / "model.safetensors"))
    assert all(int(v.sum()) == 0 for k, v in cold.items() if k.endswith(".total"))  # no quantized call before it
    run(ARGS + [f"results_root={tmp_path}", "train.resume=auto"], env_extra={"HIF8QAT_COMPILE": "0"})
    scalers = load_file(str(Path(folder) / "export" / "hif8qat_scalers.safetensors"))
    totals = {k: int(v.sum()) for k, v in scalers.items() if k.endswith(".total")}
    # every quantizer ran in each of the 2 micro-batches of steps 4-7, as in an uninterrupted run
    assert totals and set(totals.values()) == {2 * 4}
