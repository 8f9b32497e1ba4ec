"""The library as a stranger drives it: each test runs a script in a fresh Python process that imports only the
public names (``hif8qat``, ``hif8qat.integrations.hf``) besides torch and transformers, on a tiny Llama built
from a transformers config. The scripts print JSON; the test compares what they print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import hif8qat
    from hif8qat import Hif8TrainingConfig, convert_to_hif8_training

    def tiny(seed=0):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                            tie_word_embeddings=True))

    def batches(n, micro=2, seq=16):
        g = torch.Generator().manual_seed(7)  # the data never draws from the global generator
        return [torch.randint(0, 64, (micro, seq), generator=g) for _ in range(n)]

    def emit(obj):
        print("RESULT " + json.dumps(obj))
''')


def run_script(body: str, *args: str, cwd: Path, block: tuple[str, ...] = ()) -> dict:
    """Run PRELUDE + body in a fresh interpreter; ``block``: modules made unimportable (an install without them)."""
    blocker = ""
    if block:
        blocker = textwrap.dedent(f'''
            import importlib.abc, sys
            class _Absent(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] in {set(block)!r}:
                        raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            sys.meta_path.insert(0, _Absent())
        ''')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline", "HIF8QAT_COMPILE": "0", "TOKENIZERS_PARALLELISM": "false"}
    code = blocker \
        + (PRELUDE if not block else "import json\ndef emit(obj):\n    print('RESULT ' + json.dumps(obj))\n") \
        + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, \
        f"script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------------------------------
PLAIN_LOOP = '''
    mode, path, global_seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = Hif8TrainingConfig(grad_rounding="stochastic", history_len=4, interval={0: 1, 3: 2})
    model = convert_to_hif8_training(tiny(0), config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, start = batches(8), 0
    if mode == "resume":
        torch.manual_seed(global_seed)  # another global stream: only the saved state may decide what follows
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    losses = {}
    for step in range(start, len(data)):
        hif8qat.set_step(model, step)
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item().hex()
        if mode == "full" and step + 1 == 4:  # what any trainer saves: the model's and the optimizer's state
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 4}, path)
    emit(losses)
'''


def test_plain_loop_with_stochastic_rounding_resumes_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "step4.pt")
    full = run_script(PLAIN_LOOP, "full", ckpt, "0", cwd=tmp_path)
    resumed = run_script(PLAIN_LOOP, "resume", ckpt, "12345", cwd=tmp_path)
    assert sorted(resumed, key=int) == ["4", "5", "6", "7"]
    assert resumed == {k: full[k] for k in resumed}


# --------------------------------------------------------------------------------------------------
TRAINER = '''
    from transformers import Trainer, TrainingArguments
    from hif8qat.integrations.hf import StepCallback
    out, resume = sys.argv[1], (sys.argv[2] or None)
    config = Hif8TrainingConfig(grad_rounding="stochastic", history_len=4, interval={0: 1, 2: 3})
    model = convert_to_hif8_training(tiny(0), config=config)
    rows = [{"input_ids": b[0], "labels": b[0]} for b in batches(12, micro=1)]
    args = TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3,
                             logging_steps=1, save_steps=3, save_strategy="steps", report_to=[], use_cpu=True,
                             seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepCallback()])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    emit({"losses": {h["step"]: float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h},
          "step": max(b.step for b in [model.hif8qat_bank]),
          "step_warnings": [str(w.message) for w in seen if "set_step" in str(w.message)]})
'''


def test_trainer_with_the_shipped_callback_resumes_bit_for_bit(tmp_path):
    straight = run_script(TRAINER, str(tmp_path / "a"), "", cwd=tmp_path)
    resumed = run_script(TRAINER, str(tmp_path / "b"), str(tmp_path / "a" / "checkpoint-3"), cwd=tmp_path)
    assert sorted(straight["losses"], key=int) == ["1", "2", "3", "4", "5", "6"]
    assert {k: resumed["losses"][k] for k in ("4", "5", "6")} == {k: straight["losses"][k] for k in ("4", "5", "6")}
    assert straight["step"] == 5  # the schedules followed the optimizer steps (the last one began at step 5)
    assert straight["step_warnings"] == [] and resumed["step_warnings"] == []


def test_a_step_schedule_without_set_step_warns_once(tmp_path):
    result = run_script('''
        model = convert_to_hif8_training(tiny(0), config=Hif8TrainingConfig(interval={0: 1, 2: 4}))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for b in batches(4):
                model(input_ids=b, labels=b).loss.backward()
                opt.step()
                opt.zero_grad()
        emit([str(w.message) for w in seen if "set_step" in str(w.message)])
    ''', cwd=tmp_path)
    assert len(result) == 1 and "hif8qat.set_step(model, step)" in result[0]


# --------------------------------------------------------------------------------------------------
def test_export_of_a_filter_converted_model_loads_back_bit_exact_with_fp32_rest(tmp_path):
    result = run_script('''
        from safetensors.torch import load_file
        model = convert_to_hif8_training(tiny(0), config=Hif8TrainingConfig(history_len=4, scope="attn_mlp"),
                                         module_filter_fn=lambda mod, fqn: "layers.0.mlp" not in fqn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step, b in enumerate(batches(3)):
            hif8qat.set_step(model, step)
            model(input_ids=b, labels=b).loss.backward()
            opt.step()
            opt.zero_grad()
        sizes = hif8qat.export_8bit(model, "out", rest_dtype=torch.float32)
        loaded, tokenizer = hif8qat.load_8bit_export("out")
        hif8qat.freeze_scales(model)
        model.eval()
        probe = batches(4)[3]
        with torch.no_grad():
            same = torch.equal(model(input_ids=probe).logits, loaded(input_ids=probe).logits)
        emit({"same": same, "layers": sizes["layers"], "tokenizer": tokenizer is None,
              "scaler_keys": [k for k in load_file("out/model.safetensors") if "hif8" in k],
              "quantized": sorted(n for n, m in loaded.named_modules() if isinstance(m, hif8qat.QuantLinear))})
    ''', cwd=tmp_path)
    assert result["layers"] == 11  # 2 blocks x 7 linears, less layer 0's three MLP projections
    assert result["same"] and result["tokenizer"] and result["scaler_keys"] == []
    assert not any("layers.0.mlp" in n for n in result["quantized"]) and len(result["quantized"]) == 11


# --------------------------------------------------------------------------------------------------
def test_misuse_is_refused_with_what_to_do(tmp_path):
    result = run_script('''
        def outcome(fn):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 (the class and message are the result)
                return [type(err).__name__, str(err)]
            return None

        def trained(config):
            m = convert_to_hif8_training(tiny(0), config=config)
            b = batches(1)[0]
            m(input_ids=b, labels=b).loss.backward()
            return m

        converted = convert_to_hif8_training(tiny(0), config=Hif8TrainingConfig())
        moved = convert_to_hif8_training(tiny(0), config=Hif8TrainingConfig())
        hif8qat.set_step(moved, 5)
        saved = trained(Hif8TrainingConfig(format="hif8", algo="max")).state_dict()
        emit({
            "twice": outcome(lambda: convert_to_hif8_training(converted, config=Hif8TrainingConfig(format="e4m3"))),
            "step_str": outcome(lambda: hif8qat.set_step(converted, "3")),
            "step_float": outcome(lambda: hif8qat.set_step(converted, 2.5)),
            "step_negative": outcome(lambda: hif8qat.set_step(converted, -1)),
            "step_back": outcome(lambda: hif8qat.set_step(moved, 4)),
            "step_unconverted": outcome(lambda: hif8qat.set_step(tiny(0), 1)),
            "target": outcome(lambda: Hif8TrainingConfig(target=1e9)),
            "other_state": outcome(lambda: convert_to_hif8_training(
                tiny(0), config=Hif8TrainingConfig(format="e4m3", algo="mean")).load_state_dict(saved)),
            "dict": outcome(lambda: convert_to_hif8_training(tiny(0), config={"algo": "max"})),
            "class_named": outcome(lambda: Hif8TrainingConfig(algo="bogus")),
        })
    ''', cwd=tmp_path)
    not_refused = sorted(k for k, v in result.items() if v is None)
    assert not_refused == []
    assert "already converted" in result["twice"][1] and "fresh" in result["twice"][1]
    assert [result[k][0] for k in ("step_str", "step_float")] == ["TypeError", "TypeError"]
    assert "int >= 0" in result["step_negative"][1] and "goes back" in result["step_back"][1]
    assert "convert_to_hif8_training" in result["step_unconverted"][1]
    assert "Hif8TrainingConfig.target" in result["target"][1] and "32768" in result["target"][1]
    assert "format='hif8'" in result["other_state"][1] and "format='e4m3'" in result["other_state"][1]
    assert result["dict"][0] == "TypeError" and "Hif8TrainingConfig(**" in result["dict"][1]
    assert result["class_named"][1].startswith("Hif8TrainingConfig.algo=")


# --------------------------------------------------------------------------------------------------
def test_a_pipeline_import_without_the_extra_names_the_extra(tmp_path):
    result = run_script('''
        import hif8qat  # the library itself needs none of them
        from hif8qat import Hif8TrainingConfig, export_8bit
        messages = {}
        for module in ("hif8qat.config.run_config", "hif8qat.report", "hif8qat.models.loading", "hif8qat.artefacts"):
            try:
                __import__(module)
            except ImportError as err:
                messages[module] = str(err)
            else:
                messages[module] = None
        emit(messages)
    ''', cwd=tmp_path, block=("yaml", "pandas", "sentencepiece", "omegaconf", "hydra", "scipy", "transformers"))
    assert all(m is not None and "pip install 'hif8qat[pipeline]'" in m for m in result.values()), result
