"""Fixed seeded subsets of a task's documents (``eval.subset``)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import numpy as np


def check_subset(subset: Mapping[str, int | None] | str | None, tasks: Iterable[str]) -> dict[str, int]:
    """Validate ``eval.subset``.

    Args:
        subset: ``full``, None, or task -> number of documents (None: that task in full).
        tasks: the tasks evaluated.

    Returns:
        ``{task: size}``, the tasks evaluated in full left out.

    Raises:
        ValueError: naming the setting."""
    if subset is None or subset == "full":
        return {}
    if not isinstance(subset, Mapping):
        raise ValueError(f"eval.subset={subset!r}: allowed 'full' or a mapping task -> number of documents")
    tasks = list(tasks)
    out = {}
    for task, n in subset.items():
        if task not in tasks:
            raise ValueError(f"eval.subset: task {task!r} is not evaluated; allowed: {tasks}")
        if n is None or n == "full":
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"eval.subset.{task}={n!r}: allowed a positive number of documents or 'full'")
        out[task] = int(n)
    return out


def subset_indices(sizes: Mapping[str, int], n: int, *, seed: int) -> dict[str, list[int]]:
    """A fixed, seeded subset of ``n`` documents over subtasks.

    Stratified: every subtask keeps at least one document and the rest of ``n`` is shared in proportion
    to the subtasks' sizes (largest remainder). Within a subtask the documents are the first ones of a
    permutation seeded by ``(seed, crc32(subtask name))``: independent of the model, the training seed and
    the other subtasks, and nested (a larger subset contains a smaller one where the allocation grows).

    Args:
        sizes: subtask -> its documents.
        n: documents to keep.
        seed: the subset's seed.

    Returns:
        Sorted indices per subtask (lm-eval's ``samples`` needs them sorted); all when ``n`` >= total.

    Raises:
        ValueError: an empty subtask, or fewer documents than subtasks."""


    leaves = sorted(sizes)
    total = sum(sizes.values())
    if any(sizes[leaf] < 1 for leaf in leaves):
        raise ValueError(f"subset: empty subtask in {dict(sizes)}")
    if n >= total:
        return {leaf: list(range(sizes[leaf])) for leaf in leaves}
    if n < len(leaves):
        raise ValueError(f"subset of {n} documents cannot cover {len(leaves)} subtasks (one each at least)")
    spare, pool = n - len(leaves), total - len(leaves)
    share = {leaf: spare * (sizes[leaf] - 1) / pool for leaf in leaves}
    alloc = {leaf: 1 + math.floor(share[leaf]) for leaf in leaves}
    rest = n - sum(alloc.values())
    for leaf in sorted(leaves, key=lambda x: (-(share[x] - math.floor(share[x])), x))[:rest]:
        alloc[leaf] += 1
    out = {}
    for leaf in leaves:
        rng = np.random.default_rng([seed, zlib.crc32(leaf.encode())])
        out[leaf] = sorted(int(i) for i in rng.permutation(sizes[leaf])[:alloc[leaf]])
    return out


def _limited(ix: list[int], limit: int | float | None) -> list[int]:
    if limit is None:
        return ix
    return ix[: int(limit) if limit >= 1 else max(1, math.ceil(limit * len(ix)))]
