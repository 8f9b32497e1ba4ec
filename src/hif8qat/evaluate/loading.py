"""Loading an export folder for evaluation, and what its quantized mode runs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError

from hif8qat.artefacts import CorruptArtefact, verify_folder_manifest
from hif8qat.compute_dtype import keeping_weight_casts
from hif8qat.config.eval_tasks import MODES
from hif8qat.models.loading import load_causal_lm
from hif8qat.models.quant_files import load_quant_export, read_quant_export
from hif8qat.quant.gemm import reusing_frozen_weights
from hif8qat.quant.linear import freeze_scales, quant_modules, scaler_banks

EXPORT_REDO = ("Delete that export/ folder and rerun the run with stage=all: it writes the export again from the "
               "run's final checkpoint (or retrain it with force=true)")


def load_for_eval(export_dir: str | Path, mode: str, *, device: str = "cpu", trust_remote_code: bool | None = None):
    """Load an exported model folder for evaluation in ``mode``, FP32 weights on ``device`` (module doc).

    Args:
        export_dir: a save_pretrained folder (with the hif8qat files for ``hif8``).
        mode: one of MODES.
        device: where the weights go.
        trust_remote_code: the run's model.trust_remote_code; an export of a remote-code model (openPangu) keeps its
            ``auto_map`` and modeling file, and loads only with the opt-in its training had.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError: an unknown mode.
        FileNotFoundError: not a save_pretrained folder, or no quant export for ``hif8``.
        CorruptArtefact: a folder that fails its manifest or does not load."""

    if mode not in MODES:
        raise ValueError(f"eval mode {mode!r}; allowed: {MODES}")
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").exists():
        raise FileNotFoundError(f"{export_dir} is not a save_pretrained folder (no config.json)")
    verify_folder_manifest(export_dir, EXPORT_REDO)  # one without a whole manifest: refused unless trusted
    try:
        model, tok = load_causal_lm(str(export_dir), dtype=torch.float32, trust_remote_code=trust_remote_code)
        if mode == "hif8":
            quant_json = export_dir / "hif8qat_quant.json"
            if not quant_json.exists():
                raise FileNotFoundError(f"mode hif8 needs {quant_json} (written by save_quant_export)")

            load_quant_export(model, export_dir)
            freeze_scales(model, True)
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, OSError) as err:
        # a file of the export that its loader cannot parse (one without recorded hashes, or edited with them);
        # transformers says an unparsable config.json with an OSError of no errno. A disk's errors stay theirs.
        if isinstance(err, OSError) and (err.errno is not None or isinstance(err, FileNotFoundError)):
            raise
        raise CorruptArtefact(export_dir, f"{type(err).__name__}: {str(err)[:300]}", EXPORT_REDO) from None
    model.to(device=device)
    model.eval()
    return model, tok


def quant_eval_meta(model, export_dir: str | Path) -> dict:
    """What a quantized evaluation of ``export_dir`` runs: the format per role and how scales are chosen.

    Args:
        model: the loaded quantized model.
        export_dir: its export folder.

    Returns:
        ``{format, element_formats, margin, algo, scales}``."""

    doc = read_quant_export(export_dir)
    cfg = doc["config"]
    jit = any(mod.bank.just_in_time for _, mod in quant_modules(model))
    return {"format": cfg["format"], "element_formats": doc["element_formats"], "margin": cfg["margin"],
            "algo": cfg["algo"],
            "scales": "just-in-time (each tensor's own amax)" if jit else "frozen (final training scales)"}


@contextlib.contextmanager
def weights_cast_once(model: torch.nn.Module) -> Iterator[None]:
    """Within it, the forwards of an evaluation cast and quantize each weight once instead of at every forward.

    The weights do not change during an evaluation, but each forward would redo two passes over all of them:
    autocast's cast of each FP32 weight to BF16 (:func:`hif8qat.compute_dtype.keeping_weight_casts`) and, in hif8
    mode, the quantized layers' Q(W) (:func:`hif8qat.quant.gemm.reusing_frozen_weights`, frozen scales). The
    results are bit for bit those of casting and quantizing at every forward; the cost is one BF16 copy of the
    weights held for the evaluation. Autocast keeps no cast in inference mode: run the forwards under ``no_grad``.

    Args:
        model: the evaluated model.

    Yields:
        Nothing.
    """
    with reusing_frozen_weights(scaler_banks(model)), keeping_weight_casts():
        yield
