"""Automatic prefix caching: which KV blocks hold which token prefix, so a prompt that starts like an
earlier one reuses its KV instead of computing it again.

Owns: the content keys of full blocks and the table from key to block id, plus the counters the stats
report. A full block's key is a SHA-256 chained over (the previous block's key, the block's token ids),
so equal keys mean equal whole prefixes (vLLM's block hashing; a Python hash() would make a 64-bit
collision a silent wrong answer). A sequence's keys are computed once per block and kept on the
Sequence (its tokens never change). Only full blocks whose every token's KV is computed are entered;
a block is never written while it is in the table (writes go to positions past a sequence's computed
tokens, which lie in blocks after its full ones).

A prompt whose next uncached block another running sequence is computing right now waits for it
(`computed_elsewhere`) instead of computing the same prefix beside it: in an offline batch of prompts
that share a system prompt, the first computes it and the rest reuse it a step later (vLLM computes it
once per request admitted in the same step; SGLang holds such requests back the same way).

Reference counts, the free list and eviction are the allocator's (engine/blocks.py): it asks here
whether a freed block is cached (it then stays cached and evictable) and tells here when it evicts
one. No torch.
"""
from __future__ import annotations

import hashlib
from array import array

from phaseflip.engine.requests import Sequence

_ROOT = b""


def _key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}     # key -> block id holding that prefix's last block
        self._key_of: dict[int, bytes] = {}       # the inverse, for cached blocks
        self._claims: dict[bytes, int] = {}       # key -> the running seq computing that block now
        self.queries = self.hit_blocks = self.evictions = 0
        self.prompt_tokens = self.reused_tokens = 0

    # -- keys --------------------------------------------------------------------------------------
    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of seq's first num_blocks full blocks (extending seq.block_keys as needed)."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(_key(keys[-1] if keys else _ROOT, seq.tokens_slice(i * bs, (i + 1) * bs)))
        return keys[:num_blocks]

    # -- lookup ------------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks of seq's longest cached prefix, leaving its last token to compute (its
        logits are needed)."""
        hits = []
        for key in self.keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def computed_elsewhere(self, seq: Sequence, hits: int) -> bool:
        """Another running sequence is computing the block after seq's cached prefix."""
        if hits >= (seq.num_tokens - 1) // self.block_size:
            return False
        owner = self._claims.get(self.keys(seq, hits + 1)[hits])
        return owner is not None and owner != seq.seq_id

    def admit(self, seq: Sequence, hits: int) -> None:
        """seq starts computing after its `hits` cached blocks: it claims the full blocks it will fill."""
        for key in self.keys(seq, seq.num_tokens // self.block_size)[hits:]:
            self._claims.setdefault(key, seq.seq_id)
        self.queries += 1
        self.hit_blocks += hits
        self.prompt_tokens += seq.num_tokens
        self.reused_tokens += hits * self.block_size

    # -- entering and leaving ----------------------------------------------------------------------
    def enter(self, seq: Sequence) -> None:
        """Enter seq's full, computed blocks not entered yet. A block whose prefix another block holds
        already stays out (a duplicate computed before the first was entered)."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if full <= seq.num_cached_blocks:
            return
        for i, key in enumerate(self.keys(seq, full)[seq.num_cached_blocks:], start=seq.num_cached_blocks):
            block = seq.block_ids[i]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key
            if self._claims.get(key) == seq.seq_id:
                del self._claims[key]
        seq.num_cached_blocks = full

    def release(self, seq: Sequence) -> None:
        """seq gave its blocks back (finished, preempted): it computes nothing any more."""
        for key in seq.block_keys:
            if self._claims.get(key) == seq.seq_id:
                del self._claims[key]

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def evict(self, block: int) -> None:
        """The allocator reuses this block: it no longer holds its prefix."""
        del self._block_of[self._key_of.pop(block)]
        self.evictions += 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    def stats(self) -> dict:
        computed = self.prompt_tokens - self.reused_tokens
        return {"enabled": True, "prompt_tokens_computed": computed, "prompt_tokens_reused": self.reused_tokens,
                "hit_rate": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None,
                "queries": self.queries, "hit_blocks": self.hit_blocks,
                "cached_blocks": self.num_cached_blocks, "evictions": self.evictions}
