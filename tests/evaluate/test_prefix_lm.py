"""SharedContextLM against lm-eval's own HFLM (the oracle): the same log-likelihoods up to float rounding,
the same is_greedy and the same choice per item, on hand-made token requests (shared and unshared contexts,
one-token and greedy continuations, groups larger than a batch, truncation to max_length) and on the smoke
profile's evaluation (the mini tasks, 8 items each, batch 8) in fp32, bf16 autocast and the hif8 mode with
frozen scales; the token counts against arithmetic on the requests' lengths.

Tolerances (|delta| <= abs + rel |ll|). The two paths run the same model on the same tokens, but the
matmuls have other shapes (a context once instead of once per choice, only the scored positions through
the output layer, padding masked out of the cached prefix), so summation orders may differ. fp32: 1e-4 +
1e-5 |ll|, FP32 rounding (~1e-7 relative) over a sum of at most a few hundred log-probabilities (measured
on the smoke evaluation: at most 4e-6). bf16 autocast: 1e-3 + 4e-3 |ll|, one bf16 rounding step (2^-8
relative) of each log-probability (measured: identical). hif8 with frozen scales quantizes every element
with a scale fixed in advance, so the paths differ only where FP32 rounding moves an element across a HiF8
rounding boundary: 1e-3 + 1e-4 |ll| (measured: at most 8e-6). Masking the prefix padding wrongly moves
log-likelihoods by more than these bounds on this model.

On SmolLM2-135M (73 items of the mini profile's tasks, 0-shot) fp32 agreed to 6e-5 (2.5e-6 relative) with
the same choices. Under bf16 autocast the logits and (here, as in HFLM's default) log-probabilities are bf16,
so a 30-layer model differs by up to 0.5 nats (3.3 % relative) and one near-tied item of 73 picked another
choice; lm-eval's own model differs from itself by as much when only its batch size changes (32 vs 7: 0.5
nats, 4.0 %). The bf16 bound here holds for the tiny model only. The evaluator itself sums fp32
log-probabilities (test_evaluate).
"""

import functools
import json
import random

import pytest
import torch
from conftest import smollm2_weights_missing
from lm_eval.models.huggingface import HFLM

from hif8qat.compute_dtype import forward_context
from hif8qat.config import eval_tasks
from hif8qat.evaluate import loading, runner
from hif8qat.evaluate.packed_rows import scoring_of
from hif8qat.evaluate.prefix_lm import SharedContextLM
from hif8qat.models.loading import build_tiny_llama

TOL = {"fp32": (1e-4, 1e-5), "bf16": (1e-3, 4e-3), "hif8": (1e-3, 1e-4)}


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=3)


@pytest.fixture(scope="module")
def tiny_hif8(tmp_path_factory):
    """The tiny model as the hif8 evaluation mode loads it: attention and MLP linears quantized, frozen scales."""
    from conftest import write_quantized_export

    from hif8qat.quant import linear as qlinear

    export = write_quantized_export(tmp_path_factory.mktemp("export"), scope="attn_mlp", seed=4)
    loaded, tok = loading.load_for_eval(export, "hif8")
    assert len(list(qlinear.quant_linears(loaded))) == 14  # q/k/v/o + gate/up/down, 2 blocks
    return loaded, tok


def _pair(tok_model, numerics, way="packed", **kw):
    model, tok = tok_model
    amp = torch.bfloat16 if numerics == "bf16" else None
    stock = HFLM(pretrained=model, tokenizer=tok, device="cpu", mixed_precision_dtype=amp, **kw)
    compute = {"fp32": "none", "hif8": "none"}.get(numerics, numerics)  # hif8: the quantized model in fp32
    assert scoring_of(model) == "packed"  # a transformers Llama with eager or SDPA attention: auto packs it
    new = SharedContextLM(pretrained=model, tokenizer=tok, device="cpu",  # cached: as models without a 4-D mask
                          numerics=functools.partial(forward_context, compute, "cpu"), scoring=way, **kw)
    return stock, new


def _assert_same(a, b, numerics):
    abs_tol, rel_tol = TOL[numerics]
    assert len(a) == len(b)
    for i, ((la, ga), (lb, gb)) in enumerate(zip(a, b)):
        assert abs(la - lb) <= abs_tol + rel_tol * abs(la), (i, la, lb)
        assert ga == gb, i


def _greedy(model, ctx, n):
    """The model's greedy continuation of ``ctx`` (a plain full forward per token)."""
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(ctx):]


def _requests(model):
    rng = random.Random(0)

    def toks(n):
        return [rng.randrange(3, 259) for _ in range(n)]

    a, b, c, d, e = toks(40), toks(25), toks(60), toks(3), toks(90)
    g = _greedy(model, a, 5)
    groups = [
        (a, [g, g[:-1] + [(g[-1] + 1) % 256 + 3], g[:1], toks(7), toks(1)]),  # 5 choices, greedy ones among them
        (b, [toks(4), toks(9)]),
        (c, [toks(4)]),  # a context shared with no other request
        (d, [_greedy(model, d, 3)]),
        (e, [toks(6), toks(2), toks(11)]),  # 96-106 tokens: truncated when max_length is 64
    ]
    reqs = [((None, None), ctx, cont) for ctx, conts in groups for cont in conts]
    rng.shuffle(reqs)  # members of a group are not adjacent in lm-eval's request list either
    return reqs


@pytest.mark.parametrize("way", ["packed", "cached"])
@pytest.mark.parametrize("batch_size,max_length", [(16, None), (2, None), (4, 64), (4, 48)])
def test_token_requests_match_hflm(tiny, batch_size, max_length, way):
    model, _ = tiny
    reqs = _requests(model)
    stock, new = _pair(tiny, "fp32", way, batch_size=batch_size, max_length=max_length)
    a, b = stock._loglikelihood_tokens(reqs), new._loglikelihood_tokens(reqs)
    _assert_same(a, b, "fp32")
    assert new.scoring == way
    assert any(greedy for _, greedy in a) and not all(greedy for _, greedy in a)  # not a vacuous comparison
    n = new.token_counts
    assert n["requests"] == len(reqs)
    limit = new.max_length
    assert n["per_request"] == sum(min(len(c) + len(k) - 1, limit) for _, c, k in reqs)
    if max_length is None:  # no truncation: every context once, every continuation but its last token
        contexts = {}
        for _, c, k in reqs:
            contexts.setdefault(tuple(c), []).append(k)
        expected = sum(len(c) + sum(len(k) - 1 for k in ks) if len(ks) > 1 else len(c) + len(ks[0]) - 1
                       for c, ks in contexts.items())
        assert n["forwarded"] == expected
        assert n["forwarded_padded"] >= n["forwarded"]
    assert n["forwarded"] < n["per_request"]


@pytest.mark.parametrize("way", ["packed", "cached"])
def test_the_token_counts_are_made_by_the_plan_not_the_forwards(tiny, way):
    """benchmarks/eval_tokens.py counts an evaluation's tokens with the scoring stubbed out (no forward): the
    counts must come out as a real scoring's."""
    reqs = _requests(tiny[0])
    _, real = _pair(tiny, "fp32", way, batch_size=2)
    _, stubbed = _pair(tiny, "fp32", way, batch_size=2)
    real._loglikelihood_tokens(reqs)

    def no_forward(batch, subs, requests):
        for row in batch:
            for i in ([i for i, _ in row[3]] if subs is None else row[1]):
                yield i, (0.0, False)

    stubbed._score = no_forward
    assert all(answer == (0.0, False) for answer, (_, c, k) in zip(stubbed._loglikelihood_tokens(reqs), reqs)
               if len(c) + len(k) <= stubbed.max_length + 1)
    assert stubbed.token_counts == real.token_counts and real.token_counts["forward_calls"] > 0


def test_a_packed_row_stays_within_max_length(tiny):
    """The 40-token context with five continuations packs into 54 positions: past a max_length of 48 its group is
    cut into rows that each repeat the context, and still matches HFLM (test above)."""
    model, _ = tiny
    reqs = _requests(model)
    _, new = _pair(tiny, "fp32", batch_size=4, max_length=48)
    groups: dict[tuple, list[int]] = {}
    for i, (_, ctx, cont) in enumerate(reqs):
        if len(ctx) + len(cont) <= 49:
            groups.setdefault(tuple(ctx), []).append(i)
    rows = [row for batch in new._packed_plan(groups, reqs, 4) for row in batch]
    assert max(len(tokens) for tokens, *_ in rows) <= 48
    longest = max(groups, key=lambda c: len(groups[c]))
    cut = [row for row in rows if tuple(row[0][:len(longest)]) == longest]
    assert len(cut) > 1 and sorted(i for row in cut for i, _ in row[3]) == sorted(groups[longest])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_rows_match_hflm_under_each_attention(attn):
    """eager adds a float mask to the scores, SDPA takes a boolean one: both keep the segments apart."""
    model, tok = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=3)
    model.set_attn_implementation(attn)
    reqs = _requests(model)
    stock, new = _pair((model, tok), "fp32", batch_size=3)
    a = stock._loglikelihood_tokens(reqs)
    calls = []
    hook = model.model.register_forward_pre_hook(
        lambda _, args, kw: calls.append((kw["attention_mask"].dim(), kw.get("cache"), kw["use_cache"])),
        with_kwargs=True)
    try:
        b = new._loglikelihood_tokens(reqs)
    finally:
        hook.remove()
    _assert_same(a, b, "fp32")
    # one forward per batch of rows, each with its 4-D mask and no KV cache
    assert calls and all(c == (4, None, False) for c in calls)
    assert len(calls) == new.token_counts["forward_calls"] < len({tuple(c) for _, c, _ in reqs})


def test_models_that_take_no_custom_mask_are_scored_from_the_cache(tiny):
    """Packing needs transformers' own mask handling and an attention that takes a 4-D mask: a class of remote
    code, or another attention implementation, is scored the cached way, and matches HFLM there too."""
    from transformers import LlamaForCausalLM

    class RemoteCodeLlama(LlamaForCausalLM):  # defined outside transformers, as trust_remote_code classes are
        pass

    model, tok = tiny
    remote = RemoteCodeLlama(model.config)
    remote.load_state_dict(model.state_dict())
    remote.eval()
    reqs = _requests(model)
    stock, new = (HFLM(pretrained=remote, tokenizer=tok, device="cpu", batch_size=4),
                  SharedContextLM(pretrained=remote, tokenizer=tok, device="cpu", batch_size=4))
    assert new.scoring == "cached"
    _assert_same(stock._loglikelihood_tokens(reqs), new._loglikelihood_tokens(reqs), "fp32")
    with pytest.raises(ValueError, match="allowed for this model: auto, cached"):
        SharedContextLM(pretrained=remote, tokenizer=tok, device="cpu", batch_size=4, scoring="packed")
    with pytest.raises(ValueError, match="allowed: auto, packed, cached"):
        SharedContextLM(pretrained=remote, tokenizer=tok, device="cpu", batch_size=4, scoring="kv")
    _, lm = _pair(tiny, "fp32", "auto", batch_size=4)  # looked up per call
    for impl, way in (("flash_attention_2", "cached"), ("flex_attention", "cached"), ("sdpa", "packed")):
        lm.model.config._attn_implementation = impl  # read only, not run
        try:
            assert lm.scoring == way, impl
        finally:
            lm.model.config._attn_implementation = "eager"


def _mini_instances():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=[str(eval_tasks.MINITASK_DIR)], include_defaults=False)
    tasks = tm.load(["mini_mmlu", "mini_hellaswag", "mini_arc"])["tasks"]
    out = []
    for task in tasks.values():  # the smoke profile's evaluation: 8 items per task, the YAMLs' 1 shot
        task.build_all_requests(limit=8)
        out.extend(task.instances)
    return out


@pytest.mark.parametrize("way", ["packed", "cached"])
@pytest.mark.parametrize("numerics", ["fp32", "bf16", "hif8"])
def test_smoke_evaluation_matches_hflm(tiny, tiny_hif8, numerics, way):
    lm_model = tiny_hif8 if numerics == "hif8" else tiny
    instances = _mini_instances()
    stock, new = _pair(lm_model, numerics, way, batch_size=8)
    with torch.inference_mode():
        a = stock.loglikelihood(instances, disable_tqdm=True)
        b = new.loglikelihood(instances, disable_tqdm=True)
    _assert_same(a, b, numerics)
    items: dict[tuple, list] = {}
    for inst, ra, rb in zip(instances, a, b):
        items.setdefault((inst.task_name, inst.doc_id), []).append((ra[0], rb[0], len(inst.args[1])))
    assert len(items) == 24 and all(len(v) >= 3 for v in items.values())
    for key, choices in items.items():
        for norm in (False, True):  # acc and acc_norm (log-likelihood per character) pick the same choice
            def pick(j, choices=choices, norm=norm):
                return max(range(len(choices)), key=lambda i: choices[i][j] / (choices[i][2] if norm else 1))
            assert pick(0) == pick(1), (key, norm)
    n = new.token_counts
    assert n["forwarded"] < n["per_request"] / 2  # 1-shot contexts dominate: most of the work is shared


def test_results_json_records_the_token_counts(tiny, tmp_path, capsys):
    model, tok = tiny
    res = runner.evaluate_model(model, tok, "mini_arc", out_dir=tmp_path / "out", limit=3, batch_size=4)
    tokens = json.loads((tmp_path / "out" / "results.json").read_text())["_meta"]["eval_tokens"]
    assert tokens == res["_meta"]["eval_tokens"]
    assert res["_meta"]["scoring"] == "packed"  # the tiny Llama takes the 4-D mask
    assert tokens["requests"] >= 9 and 0 < tokens["forwarded"] < tokens["per_request"]
    assert f"{tokens['per_request']} as lm-eval's HFLM forwards them" in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_matches_hflm():
    """The real model (SDPA attention, grouped-query heads, BPE tokenizer) on a few multiple-choice items."""
    from hif8qat.models.loading import load_causal_lm

    reason = smollm2_weights_missing()
    if reason:
        pytest.skip(reason)
    model, tok = load_causal_lm("smollm2_135m", dtype=torch.float32)
    model.eval()
    items = [
        ("Question: Which gas do plants take in from the air to make food?\nAnswer:",
         [" carbon dioxide", " oxygen", " nitrogen gas from the soil", " water vapour"]),
        ("The chef cracked two eggs into a bowl. She", [" whisked them with a fork.", " ate the bowl.",
                                                       " put the bowl in the garden and went to sleep.", " cried."]),
        ("Question: What is 7 times 8?\nAnswer:", [" 56", " 54", " 64", " 48"]),
        ("A single context that no other request shares, so it is forwarded whole:", [" like this one."]),
    ]
    stock, new = _pair((model, tok), "fp32", batch_size=4)
    reqs = [((ctx, c), *stock._encode_pair(ctx, c)) for ctx, conts in items for c in conts]
    a, b = stock._loglikelihood_tokens(reqs), new._loglikelihood_tokens(reqs)
    _assert_same(a, b, "fp32")
    assert new.token_counts["forwarded"] < new.token_counts["per_request"]
