"""ModelRunner: a model plus its preallocated slot KV cache, keyed by sequence id.

The cache is *soft state*: each slot remembers which token ids it holds. A caller always sends the
full, authoritative token list of a sequence; the runner keeps the longest common prefix with what
the slot holds and (re)computes the rest. That one rule gives

- rollback of rejected drafts for free (they fall outside the common prefix and get overwritten),
- rebuild after eviction or a replica restart (nothing is cached, so everything is recomputed),
- idempotent retries (the same request twice computes the same thing).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.models.llama import BatchIndex, Transformer


class ContextLengthError(ValueError):
    """A sequence would not fit in the model's context window."""


@dataclass
class Slot:
    index: int  # row of the cache tensors
    tokens: list[int] = field(default_factory=list)  # token ids whose K/V the slot holds, in order


class ModelRunner:
    def __init__(self, model: Transformer, max_seqs: int = 8, max_len: int = 2048, prefill_chunk: int = 512):
        self.model = model
        a = model.args
        self.max_seqs = max_seqs
        self.max_len = min(max_len, a.max_position)
        self.prefill_chunk = prefill_chunk
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # one extra position per slot: the trash row that padded queries write to
        shape = (max_seqs, a.n_kv_heads, self.max_len + 1, a.head_dim)
        self.caches = [
            (torch.zeros(shape, device=self.device, dtype=self.dtype), torch.zeros(shape, device=self.device, dtype=self.dtype))
            for _ in range(a.n_layers)
        ]
        self.slots: OrderedDict[str, Slot] = OrderedDict()  # LRU order: oldest first
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.evictions = 0

    # -- bookkeeping -------------------------------------------------------------------------
    def free(self, seq_id: str) -> bool:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot.index)
        return slot is not None

    def _slot(self, seq_id: str, pinned: set[str]) -> Slot:
        slot = self.slots.get(seq_id)
        if slot is None:
            if not self.free_slots:  # evict the least recently used sequence not in this batch
                victim = next((s for s in self.slots if s not in pinned), None)
                if victim is None:
                    raise RuntimeError(f"batch of {len(pinned)} sequences exceeds max_seqs={self.max_seqs}")
                self.free(victim)
                self.evictions += 1
            slot = Slot(self.free_slots.pop())
            self.slots[seq_id] = slot
        self.slots.move_to_end(seq_id)
        return slot

    def sync(self, seq_ids: list[str], token_lists: list[list[int]], extra: list[int]) -> list[list[int]]:
        """Align each slot with its sequence and return the tokens still to be fed. At least the
        last token is always pending, so the next forward yields the logits after it. `extra`
        is how many more positions the caller will write (drafts); we check the fit here."""
        pinned = set(seq_ids)
        pending = []
        for sid, toks, n_extra in zip(seq_ids, token_lists, extra):
            if len(toks) + n_extra > self.max_len:
                raise ContextLengthError(f"sequence of {len(toks) + n_extra} tokens exceeds the context of {self.max_len}")
            if not toks:
                raise ValueError("empty token list")
            slot = self._slot(sid, pinned)
            n = _common_prefix(slot.tokens, toks)
            n = min(n, len(toks) - 1)
            del slot.tokens[n:]
            pending.append(toks[n:])
        return pending

    # -- compute -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seq_ids: list[str], inputs: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Feed `inputs[i]` after what slot i holds, in one ragged batch.
        Returns hidden states [B, T, dim] and the validity mask [B, T]."""
        slots = [self.slots[s] for s in seq_ids]
        lengths = [len(x) for x in inputs]
        T = max(lengths)
        tok = torch.zeros(len(inputs), T, dtype=torch.long)
        for i, x in enumerate(inputs):
            tok[i, : len(x)] = torch.tensor(x)
        batch = BatchIndex([s.index for s in slots], [len(s.tokens) for s in slots], lengths, self.max_len, self.device)
        hidden = self.model(tok.to(self.device), batch, self.caches)
        for s, x in zip(slots, inputs):
            s.tokens.extend(x)
        return hidden, batch.valid

    def prefill(self, seq_ids: list[str], inputs: list[list[int]]) -> None:
        """Feed long inputs whose logits nobody needs, one sequence and chunk at a time so that a
        long prompt is not padded against short ones."""
        for sid, x in zip(seq_ids, inputs):
            for i in range(0, len(x), self.prefill_chunk):
                self.forward([sid], [x[i : i + self.prefill_chunk]])

    def last_logits(self, seq_ids: list[str], inputs: list[list[int]]) -> Tensor:
        """Feed inputs and return the logits after each sequence's last input token: [B, V]."""
        hidden, _ = self.forward(seq_ids, inputs)
        last = torch.tensor([len(x) - 1 for x in inputs], device=hidden.device)
        return self.model.logits(hidden[torch.arange(len(inputs), device=hidden.device), last])

    def catch_up(self, seq_ids: list[str], token_lists: list[list[int]], extra: list[int]) -> list[int]:
        """sync + prefill everything but each sequence's last pending token, which is returned."""
        pending = self.sync(seq_ids, token_lists, extra)
        long = [(s, p[:-1]) for s, p in zip(seq_ids, pending) if len(p) > 1]
        if long:
            self.prefill([s for s, _ in long], [p for _, p in long])
        return [p[-1] for p in pending]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one C-level comparison
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
