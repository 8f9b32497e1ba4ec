"""lm-eval's HF model, with each multiple-choice context forwarded once for all of its continuations.

lm-eval's :class:`~lm_eval.models.huggingface.HFLM` forwards ``context + continuation[:-1]`` once per request
and shares work only between one-token continuations of one context, so a multiple-choice item (HellaSwag
endings, ARC answers, MMLU cloze answers: several tokens each) pays for its shared context once per choice.
:class:`SharedContextLM` scores the same requests, tokenized exactly as HFLM tokenizes them, forwarding each
distinct context once: with its continuations packed after it in one row (a 4-D attention mask keeps them
apart), or, for a model that takes no such mask, scoring every continuation from its cached prefix. Its outputs
are HFLM's (the sum of the continuation's log-probabilities, whether every token is the argmax), in request
order, equal up to float rounding (``tests/evaluate/test_prefix_lm.py`` gives the tolerance). Under torchrun
every rank scores its share of the context groups (:mod:`hif8qat.evaluate.ranks`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from hif8qat.evaluate.packed_rows import scoring_of, segment_mask
from hif8qat.evaluate.ranks import Ranks, deal, gather_answers

Request = tuple[Any, list[int], list[int]]  # (cache key or None, context_enc, continuation_enc)


class SharedContextLM(HFLM):
    """:class:`HFLM` whose ``_loglikelihood_tokens`` forwards each distinct context once:

    * requests are grouped by identical context tokens (``context_enc`` and ``continuation_enc`` from lm-eval's
      ``_encode_pair``);
    * packed (transformers' own decoders with SDPA or eager attention,
      :func:`~hif8qat.evaluate.packed_rows.scoring_of`): a group is one row, its context followed by each
      continuation but its last token, every continuation a segment that attends to the context and to itself
      (a 4-D attention mask) at the positions it would have after the context alone; one forward per batch of
      rows scores every request of the batch, with no cache copied per continuation (0.58-0.66x the time of the
      cached way on the mini profile's evaluation, ``benchmarks/bench_eval.py``);
    * cached (any other model): a group's context is forwarded once with the KV cache on, the logits of its last
      token score every continuation's first token; the context's cache row is then copied for each of its
      continuations and ``continuation[:-1]`` is forwarded from the cached prefix (padding of the batched
      prefixes masked out, positions continued), scoring the remaining tokens; a request whose context is shared
      with no other is forwarded whole (``context + continuation[:-1]``), batched with the contexts;
    * rows (contexts, and per batch of contexts, continuations) are sorted by length and cut into batches of at
      most ``batch_size`` rows in which no row is shorter than ``min_fill`` (0.8) of the longest, so padding
      stays small; only the scored positions go through the output layer (the model's trunk runs, then its
      output layer on the scored rows alone: public API that every supported transformers version has);
    * requests that HFLM would truncate to ``max_length`` (and every request when ``batch_size="auto"``)
      go through HFLM's own path unchanged.

    Both ways compute what HFLM computes for each request, up to float rounding. Every model call (the
    shared-context paths, HFLM's own path, generation) runs inside ``numerics()``: the one place where the
    evaluation's compute numerics (e.g. bf16 autocast) are applied. ``token_counts`` accumulates, over every
    ``loglikelihood`` call and for this rank's share under ``ranks``, the tokens HFLM would forward
    (``per_request``: the sum of each request's input length) and the tokens this model forwards (``forwarded``:
    real tokens, padding excluded; ``forwarded_padded``: positions including padding; ``forward_calls``: model
    calls of the shared-context paths).

    Args:
        *args: HFLM's.
        numerics: a zero-argument callable returning the context manager every forward runs under (default:
            HFLM's ``mixed_precision_dtype`` autocast, or none).
        ranks: evaluate data-parallel over these ranks (every rank runs lm-eval whole and makes the same calls,
            each scores its share of each call's context groups, all get every answer).
        scoring: ``auto`` (packed where the model takes the mask, else cached), or one way: ``cached`` for any
            model, ``packed`` only where the model takes the mask (comparing the two ways on one model).
        **kwargs: HFLM's.

    Raises:
        ValueError: an unknown ``scoring``, or ``packed`` for a model that takes no 4-D mask.
    """

    def __init__(self, *args, numerics: Callable[[], contextlib.AbstractContextManager] | None = None,
                 ranks: Ranks | None = None, scoring: str = "auto", **kwargs):
        if scoring not in ("auto", "packed", "cached"):
            raise ValueError(f"scoring {scoring!r}; allowed: auto, packed, cached")
        amp = kwargs.pop("mixed_precision_dtype", None)
        # HFLM's own autocast stays off: numerics are applied in _forward only
        super().__init__(*args, mixed_precision_dtype=None, **kwargs)
        if numerics is None:
            amp_dtype = getattr(torch, amp) if isinstance(amp, str) else amp
            device_type = self.device.type

            def numerics():
                if amp_dtype is None:
                    return contextlib.nullcontext()
                return torch.autocast(device_type=device_type, dtype=amp_dtype)
        self._numerics = numerics
        if scoring == "packed" and scoring_of(self.model) != "packed":
            raise ValueError("scoring 'packed' needs a transformers decoder with SDPA or eager attention (a 4-D "
                             "mask); allowed for this model: auto, cached")
        self._scoring = scoring
        self._ranks = ranks if ranks is not None and ranks.world_size > 1 else None
        self.token_counts = {"requests": 0, "per_request": 0, "forwarded": 0, "forwarded_padded": 0,
                             "forward_calls": 0}

    # ------------------------------------------------------------------------------ the model calls
    def _forward(self, *args, module: torch.nn.Module | None = None, **kwargs):
        """The one place a model forward runs (the model's, or ``module``'s: its trunk or output layer): under
        ``numerics()``, without gradients."""
        with torch.no_grad(), self._numerics():
            return (self.model if module is None else module)(*args, **kwargs)

    def _model_call(self, inps, attn_mask=None, labels=None):
        if attn_mask is not None or labels is not None:  # seq2seq: HFLM's call, under the same numerics
            return self._forward(input_ids=inps, attention_mask=attn_mask, labels=labels).logits
        return self._forward(input_ids=inps).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        with self._numerics():
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _scored_logits(self, keep: torch.Tensor, cache=None, **kwargs):
        """Forward and return (logits at the ``True`` positions of ``keep`` in row-major order, output);
        ``cache``: a KV cache to continue from, passed under the keyword the model takes."""
        parts = self._trunk_and_head()
        called = parts[0] if parts else self.model
        if cache is not None:
            kwargs[self._cache_keyword(called)] = cache
        if parts is None:
            out = self._forward(**kwargs)
            return out.logits[keep], out
        trunk, head = parts
        out = self._forward(module=trunk, **kwargs)
        return self._forward(out.last_hidden_state[keep], module=head), out

    def _trunk_and_head(self):
        """(base model, output layer) when the model's logits are exactly ``head(trunk(...).last_hidden_state)``,
        else None (then whole logits are computed and the scored rows picked from them).

        Not ``logits_to_keep``: a 2-D mask is accepted by recent transformers releases and indexes the wrong
        axis in earlier ones, so the rows are selected here, from the public ``base_model`` and
        ``get_output_embeddings()``. Looked up per call: quantization swaps modules after construction."""
        model = self.model
        trunk = getattr(model, "base_model", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        config = getattr(model, "config", None)
        # heads that rescale or cap their logits after the matmul keep the model's own forward
        rescaled = any(getattr(config, k, None) not in (None, 1, 1.0)
                       for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
        # a forward replaced on the instance (a wrapper adding autocast, hooks) is the model's: it runs whole
        if trunk is None or trunk is model or head is None or rescaled or "forward" in vars(model):
            return None
        return trunk, head

    @staticmethod
    def _cache_keyword(module: torch.nn.Module) -> str:
        """The name under which ``module.forward`` takes a KV cache: ``cache`` in recent transformers
        releases, ``past_key_values`` before."""
        return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"

    # ---------------------------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        if self._ranks is None:
            return self._score_requests(requests, disable_tqdm, override_bs)
        # this rank's share: whole context groups, balanced by the tokens a request forwards
        shares = deal([tuple(c) for _, c, _ in requests], [len(c) + len(k) for _, c, k in requests],
                      self._ranks.world_size)
        mine = shares[self._ranks.rank]
        answers = self._score_requests([requests[i] for i in mine], disable_tqdm or self._ranks.rank != 0,
                                       override_bs)
        return gather_answers(self._ranks, len(requests), mine, answers)

    def _score_requests(self, requests: list[Request], disable_tqdm: bool = False,
                        override_bs: int | None = None) -> list[tuple[float, bool]]:
        counts = self.token_counts
        counts["requests"] += len(requests)
        counts["per_request"] += sum(min(len(c) + len(k) - 1, self.max_length) for _, c, k in requests)
        bs = override_bs or self.batch_size
        if self.backend != "causal" or not isinstance(bs, int):
            stock = [min(len(c) + len(k) - 1, self.max_length) for _, c, k in requests]
            counts["forwarded"] += sum(stock)
            counts["forwarded_padded"] += sum(stock)
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)

        res: list[tuple[float, bool] | None] = [None] * len(requests)
        # HFLM truncates from the left when context + continuation exceeds max_length + 1: its path
        truncated = [i for i, (_, c, k) in enumerate(requests) if len(c) + len(k) > self.max_length + 1]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            if len(ctx) + len(cont) <= self.max_length + 1:
                groups.setdefault(tuple(ctx), []).append(i)
        pbar = tqdm(total=len(requests) - len(truncated), disable=disable_tqdm or self.rank != 0,
                    desc="Running loglikelihood requests (shared contexts)")
        # packed: batches of rows (no continuation sub-batches); cached: batches of units with their sub-batches
        plan = ([(batch, None) for batch in self._packed_plan(groups, requests, bs)] if self.scoring == "packed"
                else self._plan(groups, requests, bs))
        for batch, subs in plan:
            self._count(batch, subs, requests)
            for i, answer in self._score(batch, subs, requests):
                res[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(1)
        pbar.close()

        if truncated:
            stock = super()._loglikelihood_tokens([requests[i] for i in truncated], True, override_bs)
            for i, answer in zip(truncated, stock, strict=True):
                res[i] = answer
            n = sum(self.max_length for _ in truncated)
            counts["forwarded"] += n
            counts["forwarded_padded"] += n
        return res

    #: a row joins a batch only while it is at least this fraction of the batch's longest row, so padding
    #: stays under 1 - min_fill of a batch (more, shorter forwards instead)
    min_fill = 0.8

    def _spans(self, lengths: list[int], bs: int) -> list[tuple[int, int]]:
        """Batches ``[start, end)`` over rows sorted by decreasing length: at most ``bs`` rows, little padding."""
        spans, start = [], 0
        while start < len(lengths):
            end = start + 1
            while end < len(lengths) and end - start < bs and lengths[end] >= self.min_fill * lengths[start]:
                end += 1
            spans.append((start, end))
            start = end
        return spans

    def _plan(self, groups: dict[tuple[int, ...], list[int]], requests, bs: int) -> list:
        """Batches of units, each with the sub-batches of its continuations forwarded from cached contexts.

        A unit is ``(prefix tokens, members, shared)``: a context shared by several requests (scored from its
        last position, then its continuations from the cache), or one request forwarded whole. Units are
        sorted longest first (as HFLM: a memory error shows at once), continuation rows likewise per batch.
        """
        units = []
        for ctx, members in groups.items():
            if len(members) == 1:
                _, c, k = requests[members[0]]
                units.append((c + k[:-1], members, False))
            else:
                units.append((list(ctx), members, True))
        units.sort(key=lambda u: (-len(u[0]), u[0]))
        plan = []
        for s, e in self._spans([len(u[0]) for u in units], bs):
            batch = units[s:e]
            rows = sorted(((b, i) for b, (_, members, shared) in enumerate(batch) if shared
                           for i in members if len(requests[i][2]) > 1),
                          key=lambda r: -len(requests[r[1]][2]))
            subs = [rows[a:z] for a, z in self._spans([len(requests[i][2]) - 1 for _, i in rows], bs)]
            plan.append((batch, subs))
        return plan

    # ------------------------------------------------------------------- packed: one forward per batch
    @property
    def scoring(self) -> str:
        """How this model's shared contexts are scored: ``packed`` or ``cached`` (the class doc); recorded with
        every evaluation, as the two round differently. Under ``auto`` looked up per call: quantization swaps
        modules after construction."""
        return scoring_of(self.model) if self._scoring == "auto" else self._scoring

    def _packed_plan(self, groups: dict[tuple[int, ...], list[int]], requests, bs: int) -> list[list]:
        """Batches of packed rows ``(tokens, positions, segments, scored)``: a context, then each of its
        continuations but the last token as a segment of its own.

        A segment attends to the context and to itself (causally), its positions continue from the context's end:
        the tokens, positions and attention of ``context + continuation[:-1]`` forwarded alone. ``scored`` maps each
        request to the row positions whose logits score its continuation: the context's last, then its segment's.
        A group whose row would pass ``max_length`` is cut into several rows, each with the context. Rows are
        sorted longest first and batched as :meth:`_spans` cuts them."""
        rows = []
        for ctx, members in groups.items():
            row = None
            for i in members:
                seg = requests[i][2][:-1]
                if row is None or len(row[0]) + len(seg) > self.max_length:
                    row = (list(ctx), list(range(len(ctx))), [0] * len(ctx), [])
                    rows.append(row)
                tokens, positions, segments, scored = row
                scored.append((i, [len(ctx) - 1] + list(range(len(tokens), len(tokens) + len(seg)))))
                segments.extend([len(scored)] * len(seg))
                positions.extend(range(len(ctx), len(ctx) + len(seg)))
                tokens.extend(seg)
        rows.sort(key=lambda r: (-len(r[0]), r[0]))
        return [rows[s:e] for s, e in self._spans([len(r[0]) for r in rows], bs)]

    def _score_packed(self, batch, requests):
        """Forward a batch of packed rows once; yield each request's answer."""
        dev = self.device
        width = max(len(r[0]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        positions = torch.zeros(len(batch), width, dtype=torch.long)
        segments = -1 - torch.arange(width).repeat(len(batch), 1)  # padding: a segment per position
        keep = torch.zeros(len(batch), width, dtype=torch.bool)
        for b, (tokens, pos, seg, scored) in enumerate(batch):
            n = len(tokens)
            ids[b, :n], positions[b, :n], segments[b, :n] = torch.tensor(tokens), torch.tensor(pos), torch.tensor(seg)
            for _, at in scored:
                keep[b, at] = True
        mask = segment_mask(segments, self.model)
        logits, _ = self._scored_logits(keep.to(dev), input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                        position_ids=positions.to(dev), use_cache=False)
        row_of = keep.flatten().cumsum(0).view(keep.shape) - 1  # position -> its row in ``logits``
        for b, (_, _, _, scored) in enumerate(batch):
            for i, at in scored:
                yield i, self._answer(logits[row_of[b, at]], requests[i][2])

    def _score(self, batch, subs, requests):
        """Score a batch of the plan: packed rows (``subs`` None) or cached units with their sub-batches; yield
        ``(request, answer)``."""
        return self._score_packed(batch, requests) if subs is None else self._score_batch(batch, subs, requests)

    def _count(self, batch, subs, requests) -> None:
        """Add a batch's tokens: its rows (packed rows, or cached units' prefixes), then the continuations it
        forwards from cached contexts."""
        lens = [len(row[0]) for row in batch]
        forwarded, padded = sum(lens), len(lens) * max(lens)
        for sub in subs or []:
            n = [len(requests[i][2]) - 1 for _, i in sub]
            forwarded += sum(n)
            padded += len(n) * max(n)
        self.token_counts["forwarded"] += forwarded
        self.token_counts["forwarded_padded"] += padded
        self.token_counts["forward_calls"] += 1 + len(subs or [])

    def _score_batch(self, batch, subs, requests):
        """Forward a batch of units, then each sub-batch of continuations from the cached contexts."""
        dev = self.device
        lens = [len(p) for p, _, _ in batch]
        width = max(lens)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        keep = torch.zeros(len(batch), width, dtype=torch.bool)
        first = []  # row of ``logits`` holding each unit's first scored position
        n_scored = 0
        for b, (prefix, members, shared) in enumerate(batch):
            ids[b, :len(prefix)] = torch.tensor(prefix)
            # a shared context's last position scores every continuation's first token; a whole request's
            # last len(continuation) positions score its continuation
            n = 1 if shared else len(requests[members[0]][2])
            keep[b, len(prefix) - n:len(prefix)] = True
            first.append(n_scored)
            n_scored += n
        logits, out = self._scored_logits(keep.to(dev), input_ids=ids.to(dev), use_cache=bool(subs))

        rest: dict[int, torch.Tensor] = {}  # request -> logits of its continuation tokens 2..n
        if subs:
            from transformers import DynamicCache

            layers = list(out.cache if hasattr(out, "cache") else out.past_key_values)
            for sub in subs:
                rows = torch.tensor([b for b, _ in sub])
                # each continuation gets a copy of its context's cache row
                cache = DynamicCache([(k[rows.to(k.device)], v[rows.to(v.device)]) for k, v, *_ in layers],
                                     config=self.model.config)
                s_len = max(len(requests[i][2]) - 1 for _, i in sub)
                s_ids = torch.zeros(len(sub), s_len, dtype=torch.long)
                s_keep = torch.zeros(len(sub), s_len, dtype=torch.bool)
                # the cache holds each context's tokens, then right padding up to ``width``: masked out
                mask = torch.zeros(len(sub), width + s_len, dtype=torch.long)
                mask[:, width:] = 1
                for r, (b, i) in enumerate(sub):
                    cont = requests[i][2][:-1]
                    s_ids[r, :len(cont)] = torch.tensor(cont)
                    s_keep[r, :len(cont)] = True
                    mask[r, :lens[b]] = 1
                positions = torch.tensor(lens)[rows].unsqueeze(1) + torch.arange(s_len)
                s_logits, _ = self._scored_logits(s_keep.to(dev), input_ids=s_ids.to(dev),
                                                  attention_mask=mask.to(dev), position_ids=positions.to(dev),
                                                  cache=cache, use_cache=True)
                pos = 0
                for _, i in sub:
                    n = len(requests[i][2]) - 1
                    rest[i] = s_logits[pos:pos + n]
                    pos += n

        for b, (_, members, shared) in enumerate(batch):
            for i in members:
                cont = requests[i][2]
                scored = logits[first[b]:first[b] + (1 if shared else len(cont))]
                if i in rest:
                    scored = torch.cat([scored, rest[i]])
                yield i, self._answer(scored, cont)

    def _answer(self, logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
        """HFLM's answer from the continuation's logits [len(cont), vocab], with HFLM's dtypes and ops."""
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
        greedy = bool((logprobs.argmax(dim=-1) == target).all())
        return float(torch.gather(logprobs, 1, target.unsqueeze(-1)).sum()), greedy
