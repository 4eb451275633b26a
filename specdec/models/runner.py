"""ModelRunner: a model plus its preallocated slot KV cache, keyed by sequence id.

The cache is *soft state*: each slot remembers which token ids it holds. A caller always sends the
full, authoritative token list of a sequence; the runner keeps the longest common prefix with what
the slot holds and (re)computes the rest. That one rule gives

- rollback of rejected drafts for free (they fall outside the common prefix and get overwritten),
- rebuild after eviction or a replica restart (nothing is cached, so everything is recomputed),
- idempotent retries (the same request twice computes the same thing).

Prefix caching (vLLM's automatic prefix caching, at slot granularity): a freed slot keeps its
tokens and K/V until the slot is reused, and a new sequence starts from the slot, live or freed,
that shares the longest prefix with it: a freed one is taken over in place, a live one's K/V rows
are copied. K/V at a position depend only on the tokens up to it, so this is the same computation;
every chat request shares the chat template's system prompt, and a multi-turn chat its history.
"""
from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from specdec.models.llama import BatchIndex, Transformer


class ContextLengthError(ValueError):
    """A sequence would not fit in the model's context window."""


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages are mapped only when first written. On CPU torch.zeros writes
    every byte up front: the default verifier's 3 GB of cache rows took 11-13 s of a Verifier
    replica's start on a fresh VM (each page's first touch), for rows few sequences ever reach.
    An anonymous mapping is zero and lazy; without huge pages, since with transparent huge pages
    ("always" here) writing a slot's first rows faulted in 2 MB per row block: 5 s for 4 new
    slots in the middle of serving. With 4 KB pages 4 slots' first 90 positions take ~12 ms."""
    if device.type != "cpu" or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return torch.zeros(shape, device=device, dtype=dtype)
    buf = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive


@dataclass
class Slot:
    index: int  # row of the cache tensors
    tokens: list[int] = field(default_factory=list)  # token ids whose K/V the slot holds, in order


class ModelRunner:
    def __init__(self, model: Transformer, max_seqs: int = 8, max_len: int = 2048, prefill_chunk: int = 512,
                 prefix_caching: bool = True):
        self.model = model
        self.prefix_caching = prefix_caching
        a = model.args
        self.max_seqs = max_seqs
        self.max_len = min(max_len, a.max_position)
        self.prefill_chunk = prefill_chunk
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # one extra position per slot: the trash row that padded queries write to
        shape = (max_seqs, a.n_kv_heads, self.max_len + 1, a.head_dim)
        self.caches = [(_zeros(shape, self.device, self.dtype), _zeros(shape, self.device, self.dtype))
                       for _ in range(a.n_layers)]
        self.slots: OrderedDict[str, Slot] = OrderedDict()  # LRU order: oldest first
        self.free_slots = list(range(max_seqs - 1, -1, -1))  # in the order freed (never-used ones first)
        self.cached: dict[int, list[int]] = {}  # free slot index -> tokens its K/V rows still hold
        self.evictions = 0
        self.prefix_hits = 0  # new sequences that started from a cached prefix
        self.prefix_tokens_reused = 0  # prompt tokens not recomputed thanks to them

    # -- bookkeeping -------------------------------------------------------------------------
    def free(self, seq_id: str) -> bool:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot.index)
            if self.prefix_caching:
                self.cached[slot.index] = slot.tokens
        return slot is not None

    def truncate(self, seq_id: str, n: int) -> None:
        """Keep the first n tokens' K/V: rejected drafts' rows are simply overwritten next."""
        del self.slots[seq_id].tokens[n:]

    def _slot(self, seq_id: str, pinned: set[str], toks: list[int], reuse: bool) -> Slot:
        slot = self.slots.get(seq_id)
        if slot is None:
            if not self.free_slots:  # evict the least recently used sequence not in this batch
                victim = next((s for s in self.slots if s not in pinned), None)
                if victim is None:
                    raise RuntimeError(f"batch of {len(pinned)} sequences exceeds max_seqs={self.max_seqs}")
                self.free(victim)
                self.evictions += 1
            slot = self._new_slot(toks) if reuse and self.prefix_caching else Slot(self.free_slots.pop())
            self.cached.pop(slot.index, None)
            self.slots[seq_id] = slot
        self.slots.move_to_end(seq_id)
        return slot

    def _new_slot(self, toks: list[int]) -> Slot:
        """A free slot for a new sequence, holding the longest cached prefix of `toks` there is."""
        limit = len(toks) - 1  # the last token is always fed again
        best_free, n_free = None, 0
        for i in reversed(self.free_slots):
            n = min(_common_prefix(self.cached.get(i, []), toks), limit)
            if n > n_free:
                best_free, n_free = i, n
        src, n_live = None, n_free
        for s in self.slots.values():
            n = min(_common_prefix(s.tokens, toks), limit)
            if n > n_live:
                src, n_live = s, n
        if n_free == 0:  # no prefix to take over: a never-used slot, else the longest-freed one
            unused = [i for i in self.free_slots if not self.cached.get(i)]
            best_free = unused[-1] if unused else self.free_slots[0]
        self.free_slots.remove(best_free)
        slot = Slot(best_free, self.cached.get(best_free, [])[:n_free])
        if src is not None:  # a live sequence shares more: copy its K/V rows
            for kc, vc in self.caches:
                kc[best_free, :, :n_live] = kc[src.index, :, :n_live]
                vc[best_free, :, :n_live] = vc[src.index, :, :n_live]
            slot.tokens = toks[:n_live]
        return slot

    def sync(self, seq_ids: list[str], token_lists: list[list[int]], extra: list[int],
             pinned: set[str] | None = None, reuse_prefix: bool = False) -> list[list[int]]:
        """Align each slot with its sequence and return the tokens still to be fed. At least the
        last token is always pending, so the next forward yields the logits after it. `extra`
        is how many more positions the caller will write (drafts); we check the fit here.
        With `reuse_prefix`, a new sequence may start from another slot's cached prefix
        (callers that feed the whole sequence after a sync leave it off)."""
        pinned = pinned or set(seq_ids)
        pending = []
        for sid, toks, n_extra in zip(seq_ids, token_lists, extra):
            if len(toks) + n_extra > self.max_len:
                raise ContextLengthError(f"sequence of {len(toks) + n_extra} tokens exceeds the context of {self.max_len}")
            if not toks:
                raise ValueError("empty token list")
            slot = self._slot(sid, pinned, toks, reuse_prefix)
            n = _common_prefix(slot.tokens, toks)
            n = min(n, len(toks) - 1)
            del slot.tokens[n:]
            pending.append(toks[n:])
        return pending

    # -- compute -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seq_ids: list[str], inputs: list[list[int]],
                trees: list[list[int] | None] | None = None) -> tuple[Tensor, Tensor]:
        """Feed `inputs[i]` after what slot i holds, in one ragged batch; trees[i] (None: a chain)
        makes them a token tree (layers.BatchIndex), which `keep_path` then cuts to one path.
        Returns hidden states [B, T, dim] and the validity mask [B, T]."""
        slots = [self.slots[s] for s in seq_ids]
        lengths = [len(x) for x in inputs]
        T = max(lengths)
        tok = torch.tensor([x + [0] * (T - len(x)) for x in inputs])  # [B, T], padded
        batch = BatchIndex([s.index for s in slots], [len(s.tokens) for s in slots], lengths, self.max_len, self.device,
                           trees)
        hidden = self.model(tok.to(self.device), batch, self.caches)
        for s, x in zip(slots, inputs):
            s.tokens.extend(x)
        return hidden, batch.valid

    def keep_path(self, seq_id: str, start: int, path: list[int]) -> None:
        """After a token tree fed at row `start`: keep the inputs at `path` (indices, root first)
        as the sequence's next tokens, their K/V moved to the rows of their positions."""
        slot = self.slots[seq_id]
        moves = [(start + j, start + i) for i, j in enumerate(path) if i != j]  # (from, to); to < from
        if moves:
            src = torch.tensor([m[0] for m in moves], device=self.device)
            dst = torch.tensor([m[1] for m in moves], device=self.device)
            for kc, vc in self.caches:
                kc[slot.index, :, dst] = kc[slot.index, :, src]
                vc[slot.index, :, dst] = vc[slot.index, :, src]
        slot.tokens[start:] = [slot.tokens[start + j] for j in path]

    def warm_up(self) -> None:
        """A compiled model compiles at its first pass: make that pass now, at start-up, rather
        than in a user's request (a 2-token pass in a scratch slot, which is then forgotten)."""
        if getattr(self.model.token_pass, "compiled", False):
            self.sync(["<warm-up>"], [[0, 0]], [0])
            self.forward(["<warm-up>"], [[0, 0]])
            slot = self.slots.pop("<warm-up>")
            self.free_slots.append(slot.index)

    def prefill(self, seq_ids: list[str], inputs: list[list[int]]) -> None:
        """Feed inputs whose logits nobody needs. Inputs of similar length share one padded
        forward (on a CPU a pass over a few rows costs little more than over one: the weights
        are read once), up to prefill_chunk rows; a long one goes alone, a chunk at a time."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            n = len(inputs[i])
            if g and n <= 1.25 * len(inputs[g[0]]) + 8 and n * (len(g) + 1) <= self.prefill_chunk:
                g.append(i)
            else:
                groups.append([i])
        for g in groups:
            if len(g) > 1:
                self.forward([seq_ids[i] for i in g], [inputs[i] for i in g])
                continue
            x = inputs[g[0]]
            for j in range(0, len(x), self.prefill_chunk):
                self.forward([seq_ids[g[0]]], [x[j : j + self.prefill_chunk]])

    def last_logits(self, seq_ids: list[str], inputs: list[list[int]]) -> Tensor:
        """Feed inputs and return the logits after each sequence's last input token: [B, V]."""
        hidden, _ = self.forward(seq_ids, inputs)
        last = torch.tensor([len(x) - 1 for x in inputs], device=hidden.device)
        return self.model.logits(hidden[torch.arange(len(inputs), device=hidden.device), last])

    def catch_up(self, seq_ids: list[str], token_lists: list[list[int]], extra: list[int]) -> list[int]:
        """sync + prefill everything but each sequence's last pending token, which is returned.
        New sequences of one batch (users who arrived together, with one system prompt) share
        prefixes too: a sequence that shares more with one still waiting to be prefilled has
        those prefilled first and then copies from them; the rest are prefilled together."""
        pinned, last = set(seq_ids), []
        queued: list[tuple[str, list[int], list[int]]] = []  # (seq id, tokens, pending to prefill)

        def flush() -> None:
            self.prefill([q[0] for q in queued], [q[2] for q in queued])
            queued.clear()

        for sid, toks, n_extra in zip(seq_ids, token_lists, extra):
            new = sid not in self.slots
            [p] = self.sync([sid], [toks], [n_extra], pinned, reuse_prefix=True)
            have = len(toks) - len(p)
            if self.prefix_caching and len(p) > 1 and any(_common_prefix(t[:-1], toks) > have for _, t, _ in queued):
                flush()
                self.free(sid)  # and start again from the prefix just computed
                [p] = self.sync([sid], [toks], [n_extra], pinned, reuse_prefix=True)
                have = len(toks) - len(p)
            if new and have and self.prefix_caching:
                self.prefix_hits += 1
                self.prefix_tokens_reused += have
            if len(p) > 1:
                queued.append((sid, toks, p[:-1]))
            last.append(p[-1])
        flush()
        return last


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one C-level comparison
        return n
    if n > 64:  # prefix-cache lookups compare whole prompts: vectorise
        return int(np.argmax(np.asarray(a[:n]) != np.asarray(b[:n])))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
