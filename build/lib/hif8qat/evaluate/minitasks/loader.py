"""Dataset loader used by the mini-task YAMLs (``custom_dataset: !function loader.load_local_json``).

lm-eval hands ``dataset_kwargs`` to this function. ``datasets`` would resolve the relative
``data_files`` in the YAML against the current working directory; here they are resolved against this
folder instead, so the tasks work from any directory and from an installed package.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def resolve_data_files(data_files: dict[str, str]) -> dict[str, str]:
    out = {}
    for split, rel in data_files.items():
        p = Path(rel)
        p = p if p.is_absolute() else HERE / p
        if not p.exists():
            raise FileNotFoundError(
                f"mini-task data file {p} is missing; regenerate it with `python -m hif8qat.evaluate.minitasks.generate`"
            )
        out[split] = str(p)
    return out


def load_local_json(data_files: dict[str, str] | None = None, **_ignored):
    import datasets

    if not data_files:
        raise ValueError("mini task YAML must set dataset_kwargs.data_files")
    return datasets.load_dataset("json", data_files=resolve_data_files(data_files))
