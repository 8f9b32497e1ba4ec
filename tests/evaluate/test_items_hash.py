"""An evaluation's per-task item hash changes when any scored question or gold answer changes, and not with the
order in which lm-eval (or its ranks) handed the samples back."""

from __future__ import annotations

import copy
import hashlib

from hif8qat.config.eval_tasks import TaskSpec
from hif8qat.evaluate.outputs import items_sha256

SPEC = TaskSpec("mini_arc", 1, "acc_norm", mini=True)


def _samples():
    return {"mini_arc": [
        {"doc_id": i, "filter": "none", "doc": {"question": f"q{i}", "choices": ["a", "b"], "answerKey": "A"},
         "target": 0, "acc_norm": 1.0} for i in range(4)]}


def test_the_item_hash_follows_the_items_content_not_their_order():
    raw = _samples()
    digest = items_sha256(raw, SPEC, {})
    assert len(digest) == 64 and digest != hashlib.sha256(b"").hexdigest()
    shuffled = {"mini_arc": list(reversed(raw["mini_arc"]))}
    assert items_sha256(shuffled, SPEC, {}) == digest
    scores_changed = copy.deepcopy(raw)
    scores_changed["mini_arc"][0]["acc_norm"] = 0.0  # another model's answers: the same items
    assert items_sha256(scores_changed, SPEC, {}) == digest
    for edit in ("question", "answer", "dropped"):
        edited = copy.deepcopy(raw)
        if edit == "question":
            edited["mini_arc"][2]["doc"]["question"] = "q2 edited"
        elif edit == "answer":
            edited["mini_arc"][1]["target"] = 1
        else:
            edited["mini_arc"].pop()
        assert items_sha256(edited, SPEC, {}) != digest, edit
