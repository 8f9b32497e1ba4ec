"""The deployable 8-bit export: its codes decode bit for bit to the weights the ``hif8`` evaluation mode quantizes
to, a model built from it evaluates as that mode does, it is the expected fraction of BF16, compressed-tensors loads
its FP8 layout, and stage=export refuses runs it cannot store before touching anything."""

from __future__ import annotations

import hashlib
import json

import en_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_reliability import assert_user_error, cli

from hif8qat.artefacts import FOLDER_MANIFEST, write_folder_manifest
from hif8qat.evaluate.heldout import stream_token_stats
from hif8qat.evaluate.loading import load_for_eval
from hif8qat.evaluate.runner import evaluate_model
from hif8qat.models import eight_bit
from hif8qat.models.loading import build_tiny_llama
from hif8qat.models.quant_files import save_quant_export
from hif8qat.quant import linear as qlinear
from hif8qat.scaling.bank import RECORD_NO_GRAD
from hif8qat.scaling.settings import ScalingConfig


def _export(folder, fmt: str, scope: str = "attn_mlp", *, algo: str = "max", vocab_heavy: bool = False):
    """A tiny Llama saved as a run's export whose scalers ran a few forwards (delayed scales, not cold starts)."""
    model, tok = build_tiny_llama(num_layers=3, hidden_size=64 if vocab_heavy else 128,
                                  intermediate_size=128 if vocab_heavy else 512, seed=5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    qlinear._convert_model(model, scope, [0] if scope == "mlp" else None,
                          ScalingConfig(algo=algo, history_len=4, format=fmt))
    qlinear.set_quantization(model, True)
    with torch.no_grad():
        for seed in range(3):
            model(torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(seed)))
    save_quant_export(model, folder, {"step": 3})
    write_folder_manifest(folder)  # last, as a run's export records its files
    return folder


def _frozen_weights(export):
    """What the hif8 mode's weight quantizer returns for each quantized layer (the module's own quantization)."""
    model, _ = load_for_eval(export, "hif8")
    return model, {f"{name}.weight": layer.bank.quantize(layer.weight.detach(), layer.scaler_w.row, RECORD_NO_GRAD)
                   for name, layer in qlinear.quant_linears(model)}


@pytest.mark.parametrize("fmt,scope,algo", [("hif8", "mlp", "max"), ("hif8", "attn_mlp", "current"),
                                            ("hybrid", "attn_mlp", "max")])
def test_codes_decode_bit_for_bit_to_the_hif8_modes_weights(tmp_path, fmt, scope, algo):
    export = _export(tmp_path / "export", fmt, scope, algo=algo)
    out = tmp_path / "export_8bit"
    eight_bit.write_8bit_export(export, out)
    model, expected = _frozen_weights(export)
    decoded = eight_bit.decoded_state_dict(out)
    record = json.loads((out / eight_bit.EIGHT_BIT_JSON).read_text())
    assert sorted(record["layers"]) == sorted(k[: -len(".weight")] for k in expected) and expected
    stored = "uint8" if fmt == "hif8" else "float8_e4m3fn"
    with safe_open(str(out / eight_bit.WEIGHTS_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, want in expected.items():
        assert torch.equal(decoded[key].view(torch.int32), want.view(torch.int32)), key  # bit for bit
        assert str(tensors[key].dtype) == f"torch.{stored}"
        layer = key[: -len(".weight")]
        s = record["layers"][layer]["weight_quant_scale"]
        # the stored scale is the dequantization multiplier 1/s (compressed-tensors' convention), one float32
        assert tensors[f"{layer}.weight_scale"].dtype == torch.float32
        assert tensors[f"{layer}.weight_scale"].tolist() == [float(np.float32(1.0 / np.float64(s)))]
        assert (f"{layer}.input_scale" in tensors) == (algo != "current")  # just in time: no fixed input scale
        if fmt == "hif8":  # an independent decoder of the byte codes (en_dtypes' HiF8) reads the same values
            values = tensors[key].numpy().view(en_dtypes.hifloat8).astype(np.float32)
            assert np.array_equal((values / np.float32(s)).view(np.int32), want.numpy().view(np.int32))
    rest = [k for k in tensors if k not in expected and not k.endswith("_scale")]
    assert rest and all(tensors[k].dtype == torch.bfloat16 for k in rest)
    assert record["activations"] == ("dynamic" if algo == "current" else "static")
    # the source export's manifest, named by its sha256 (hashlib here, not the writer's helper)
    assert record["source"]["manifest_sha256"] == hashlib.sha256((export / FOLDER_MANIFEST).read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_model_from_the_codes_evaluates_as_the_hif8_mode(tmp_path):
    """Kept at the export's precision, the other tensors change nothing: logits, scores and held-out numbers are
    those of the hif8 mode exactly; in BF16 (the deployable file) the difference is their BF16 rounding only."""
    export = _export(tmp_path / "export", "hif8", "mlp")
    exact, deploy = tmp_path / "fp32_rest", tmp_path / "bf16_rest"
    eight_bit.write_8bit_export(export, exact, rest_dtype=torch.float32)
    eight_bit.write_8bit_export(export, deploy)
    ref, tok = load_for_eval(export, "hif8")
    codes, _ = eight_bit.load_8bit_export(exact)
    bf16, _ = eight_bit.load_8bit_export(deploy)
    plain, _ = eight_bit.load_8bit_export(exact, quantize=False)
    windows = torch.randint(3, 250, (4, 33), generator=torch.Generator().manual_seed(1))
    stats = stream_token_stats({"hif8": ref, "codes": codes, "bf16": bf16, "plain": plain},
                               [("hif8", "codes"), ("hif8", "bf16"), ("hif8", "plain")], windows)
    assert np.array_equal(stats["nll_codes"], stats["nll_hif8"])
    assert not stats["kl_codes_vs_hif8"].any() and stats["top1_codes_vs_hif8"].all()
    # the activations are quantized too: without their quantizers the model is farther from the hif8 mode than
    # the BF16 rounding of the unquantized tensors takes it
    kl_bf16, kl_plain = stats["kl_bf16_vs_hif8"].mean(), stats["kl_plain_vs_hif8"].mean()
    assert 0 < kl_bf16 < kl_plain, (kl_bf16, kl_plain)
    kw = dict(tasks=["mini_arc", "mini_hellaswag"], limit=6, batch_size=8, device="cpu")
    a, b = evaluate_model(ref, tok, mode="hif8", **kw), evaluate_model(codes, tok, mode="hif8", **kw)
    for task in ("mini_arc", "mini_hellaswag"):
        assert a[task] == b[task], task


def test_fp8_export_loads_in_compressed_tensors_with_our_logits(tmp_path):
    """compressed-tensors (the layout vLLM reads) builds the model from our config and tensors. Its dequantized
    weights are ours to one float32 rounding (it multiplies by 1/s where we divide by s), so without activation
    quantization its logits are ours to float32 rounding; its activation quantizer with our input scales gives
    our quantized activations but where that one rounding moves a value across an E4M3 rounding boundary, so with
    it (the deployed model) the logits differ by such rare flips only, far less than the activation quantization
    itself changes them."""
    import compressed_tensors as ct  # pinned in requirements.txt (the test's oracle)
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle import disable_quantization, forward_quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    export = _export(tmp_path / "export", "hybrid", "attn_mlp")
    out = tmp_path / "export_8bit"
    eight_bit.write_8bit_export(export, out)
    config = json.loads((out / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(config["quantization_config"])
    hf_config = AutoConfig.from_pretrained(str(out))
    del hf_config.quantization_config
    theirs = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    apply_quantization_config(theirs, qcfg)
    compressor = ModelCompressor(quantization_config=qcfg)
    compressor.compress_model(theirs)
    missing, unexpected = theirs.load_state_dict(load_file(str(out / eight_bit.WEIGHTS_FILE)), strict=False)
    assert not missing and not unexpected, (missing, unexpected, ct.__version__)
    compressor.decompress_model(theirs)
    theirs.eval()

    ours, _ = eight_bit.load_8bit_export(out)
    plain, _ = eight_bit.load_8bit_export(out, quantize=False)
    mine = eight_bit.decoded_state_dict(out)
    sd = theirs.state_dict()
    record = json.loads((out / eight_bit.EIGHT_BIT_JSON).read_text())
    ours_layers = dict(qlinear.quant_linears(ours))
    assert sorted(ours_layers) == sorted(record["layers"])
    gen = torch.Generator().manual_seed(3)
    for layer in record["layers"]:
        w, want = sd[f"{layer}.weight"], mine[f"{layer}.weight"]
        ulp = torch.nextafter(want.abs(), torch.tensor(float("inf"))) - want.abs()
        assert w.dtype == torch.float32 and ((w - want).abs() <= ulp).all(), layer
        # activations: the same input through their quantizer and ours (the whole E4M3 range, by our scale)
        s_a = record["layers"][layer]["input_quant_scale"]
        x = torch.randn(64, w.shape[1], generator=gen) * (100.0 / s_a)
        mod, q = theirs.get_submodule(layer), ours_layers[layer]
        theirs_q = forward_quantize(mod, x, "input", mod.quantization_scheme.input_activations)
        ours_q = q.bank.quantize(x, q.scaler_a.row, RECORD_NO_GRAD)
        gap = (theirs_q - ours_q).abs()
        differ = gap > 2 * (torch.nextafter(ours_q.abs(), torch.tensor(float("inf"))) - ours_q.abs())
        assert differ.float().mean() < 1e-3, (layer, differ.float().mean())  # beyond float32 rounding: rare
        assert (gap <= 0.13 * ours_q.abs())[differ].all()  # and one E4M3 step at most
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b, c = ours(ids).logits, theirs(ids).logits, plain(ids).logits
        theirs.apply(disable_quantization)
        d = theirs(ids).logits
    assert (c - d).abs().max() < 1e-5 * c.abs().max()  # the weights alone: float32 rounding
    activation_effect = (a - c).abs().mean()
    assert activation_effect > 0 and (a - b).abs().mean() < 0.25 * activation_effect, ((a - b).abs().mean(),
                                                                                         activation_effect)


def test_the_file_is_the_expected_fraction_of_bf16(tmp_path):
    """One byte per quantized weight and two per other value: when the quantized linears hold most of the
    parameters the file is about half the BF16 one."""
    export = _export(tmp_path / "export", "hybrid", "attn_mlp")
    sizes = eight_bit.write_8bit_export(export, tmp_path / "export_8bit")
    model, _ = load_for_eval(export, "hif8")
    quantized = sum(layer.weight.numel() for _, layer in qlinear.quant_linears(model))
    total = sum(t.numel() for t in model.state_dict().values())
    assert quantized / total > 0.8
    expected = (quantized + 2 * (total - quantized)) / (2 * total)
    ratio = sizes["bytes"] / sizes["bf16_bytes"]
    assert abs(ratio - expected) < 0.02 and ratio < 0.6, (ratio, expected)
    assert sizes["bytes"] == (tmp_path / "export_8bit" / eight_bit.WEIGHTS_FILE).stat().st_size
    assert eight_bit.size_line(sizes).startswith(f"8-bit export: {sizes['bytes'] / 2 ** 20:.2f} MiB (BF16: ")


def test_the_8bit_export_is_verified_against_its_manifest(tmp_path):
    export = _export(tmp_path / "export", "hif8", "mlp")
    out = tmp_path / "export_8bit"
    eight_bit.write_8bit_export(export, out)
    with open(out / eight_bit.WEIGHTS_FILE, "r+b") as f:  # one byte of the codes changed on disk
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    from hif8qat.artefacts import CorruptArtefact

    with pytest.raises(CorruptArtefact, match="model.safetensors"):
        eight_bit.decoded_state_dict(out)


@pytest.mark.parametrize("args,needles", [
    (["experiment=exp7"], ["stage='export'", "quant.enabled=false"]),
    (["experiment=exp10", "quant.format=e5m2"], ["stage='export'", "e5m2", "HiF8 or E4M3"]),
    (["experiment=exp8"], ["has no export/", "stage=all"]),
])
def test_stage_export_refuses_before_any_folder_is_made(tmp_path, args, needles):
    out = cli([*args, "stage=export", "profile=smoke"], tmp_path / "runs")
    assert_user_error(out, *needles)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))
