"""Where a model name points: a local folder or a Hugging Face hub id, and whether the hub's cache already holds
it. Shared by the loader (:mod:`hif8qat.models.loading`) and the checks made before a run starts
(:mod:`hif8qat.launch`), so both read a name the same way."""

from __future__ import annotations

import os

from huggingface_hub import try_to_load_from_cache


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a filesystem path (absolute, relative, ``~``, or more than one slash) rather
    than a hub id ``org/name``.

    Args:
        name: the model name as the user wrote it.

    Returns:
        True for a path, False for what may be a hub id.
    """
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep in name and name.count(
        os.sep) > 1


def hub_cached(repo_id: str, revision: str | None) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s ``config.json`` at ``revision`` (no network).

    Args:
        repo_id: the hub id ``org/name``.
        revision: the branch, tag or commit (None: the default branch).

    Returns:
        True when the file is cached; False otherwise, including when the lookup itself fails.
    """
    try:
        hit = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        return isinstance(hit, str)
    except Exception:  # noqa: BLE001 - any cache lookup failure means "not cached"
        return False
