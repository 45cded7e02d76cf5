"""The planner: from per-rank budgets to the two layouts (PP and TP) of the same ranks.

Owns: LayoutSpec (one RankShard per rank for one layout), LayoutPlan (both layouts and why they look the
way they do), plan_layouts, and the KV block arithmetic both views of a rank's KV region share
(kv_block_bytes, usable_blocks). Plain Python over ints and Fractions: it never imports torch, never
measures a device and never allocates; budgets come in as numbers.

Rounding: every proportional split is largest-remainder (Hamilton) with a floor of 1 per rank, computed
exactly with Fractions (a float budget is read as the decimal it prints as); a tie in remainder goes to
the lower rank index. The PP layer split is derived from the TP kv-head split (layers_r / num_layers ==
kv_r / num_kv_heads) so one block count fits both views of the KV region; where the counts cannot match
(5 layers over kv [1, 1] -> [3, 2], the tie going to rank 0) the plan is not `balanced` and says so.
"""
from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.shard import RankShard, Span, whole_experts

LAYOUT_NAMES = ("pp", "tp")


@dataclass(frozen=True)
class LayoutSpec:
    name: str                       # "pp" or "tp"
    shards: tuple[RankShard, ...]   # one per rank, in rank order

    def __post_init__(self):
        if self.name not in LAYOUT_NAMES:
            raise ValueError(f"unknown layout name {self.name!r}; expected one of {LAYOUT_NAMES}")
        if not self.shards:
            raise ValueError(f"layout {self.name!r} has no shards: one per rank is required")
        want_tp = self.world_size if self.name == "tp" else 1
        bad = [r for r, s in enumerate(self.shards) if s.tp_size != want_tp]
        if bad:
            raise ValueError(f"layout {self.name!r}: ranks {bad} have tp_size != {want_tp}")
        tiled = [s.layers for s in self.shards] if self.name == "pp" else [s.kv_heads for s in self.shards]
        if not _is_tiling(tiled):
            raise ValueError(f"layout {self.name!r}: shard spans {tiled} are not contiguous from 0")

    @property
    def world_size(self) -> int:
        return len(self.shards)

    @property
    def output_rank(self) -> int:
        """The rank that produces logits: the last PP stage, and where TP gathers them."""
        return self.world_size - 1


@dataclass(frozen=True)
class LayoutPlan:
    pp: LayoutSpec
    tp: LayoutSpec
    kv_heads: tuple[int, ...]   # TP KV heads per rank
    layers: tuple[int, ...]     # PP layers per rank
    balanced: bool              # every rank's layer fraction == its kv-head fraction
    notes: tuple[str, ...] = ()  # human-readable reasons (e.g. why fractions differ)

    def __post_init__(self):
        if (self.pp.name, self.tp.name) != LAYOUT_NAMES:
            raise ValueError(f"LayoutPlan wants a 'pp' and a 'tp' layout, got {self.pp.name!r}, {self.tp.name!r}")
        if self.pp.world_size != self.tp.world_size:
            raise ValueError(f"pp has {self.pp.world_size} ranks but tp has {self.tp.world_size}")
        if self.kv_heads != tuple(s.kv_heads.count for s in self.tp.shards):
            raise ValueError(f"kv_heads={self.kv_heads} disagrees with the tp shards")
        if self.layers != tuple(s.layers.count for s in self.pp.shards):
            raise ValueError(f"layers={self.layers} disagrees with the pp shards")
        matched = all(l * sum(self.kv_heads) == k * sum(self.layers) for k, l in zip(self.kv_heads, self.layers))
        if self.balanced != matched:
            raise ValueError(f"balanced={self.balanced} but layers={self.layers} vs kv_heads={self.kv_heads} "
                             f"says {matched}")

    @property
    def world_size(self) -> int:
        return self.pp.world_size

    def spec(self, name: str) -> LayoutSpec:
        if name not in LAYOUT_NAMES:
            raise ValueError(f"unknown layout {name!r}; layouts are {', '.join(LAYOUT_NAMES)}")
        return self.pp if name == "pp" else self.tp


def proportional_split(total: int, weights: Sequence[numbers.Real], what: str) -> tuple[int, ...]:
    """Split `total` units over len(weights) ranks in proportion to weights, each rank >= 1.

    Largest remainder: each rank first gets max(1, floor(quota)); leftover units go one each to the
    largest quota - count, ties to the lower rank index. If the floor of 1 over-commits (a tiny
    quota), every rank restarts at 1 and units go one at a time to the largest quota - count.
    """
    n = len(weights)
    if total < n:
        raise ValueError(f"{total} {what} cannot be split over {n} ranks (each needs >= 1)")
    weights = [_exact(w) for w in weights]
    weight_sum = sum(weights)
    quotas = [total * w / weight_sum for w in weights]
    counts = [max(1, math.floor(q)) for q in quotas]
    if sum(counts) > total:
        counts = [1] * n
    heap = [(-(q - c), r) for r, (q, c) in enumerate(zip(quotas, counts))]
    heapq.heapify(heap)
    for _ in range(total - sum(counts)):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (-(quotas[r] - counts[r]), r))
    return tuple(counts)


def plan_layouts(cfg: ModelConfig, budgets: Sequence[float], *, pp_split: Sequence[int] | None = None,
                 tp_kv_split: Sequence[int] | None = None,
                 column_units: tuple[int, int] = (1, 1)) -> LayoutPlan:
    """Both layouts of len(budgets) ranks; explicit splits override the budget-derived ones.
    column_units: the values a TP split of a row of o_proj and of down_proj must keep together (their GGUF
    blocks: 32 or 256; 1 for floats)."""
    weights = _check_budgets(budgets)
    n = len(weights)
    _check_fits(cfg, n)
    layers = _check_split(pp_split, n, cfg.num_layers, "pp_split", "num_layers")
    kv = _check_split(tp_kv_split, n, cfg.num_kv_heads, "tp_kv_split", "num_kv_heads")
    notes: list[str] = []
    if kv is None and layers is not None:
        kv = proportional_split(cfg.num_kv_heads, layers, "KV heads")
    elif kv is None:
        kv = proportional_split(cfg.num_kv_heads, weights, "KV heads")
        notes += _budget_note(cfg.num_kv_heads, weights, kv)
    if layers is None:
        layers = proportional_split(cfg.num_layers, kv, "layers")
    mismatch = _fraction_mismatch(cfg, kv, layers)
    if mismatch:
        notes.append(f"layer fraction != kv-head fraction on {'; '.join(mismatch)}: the usable KV block "
                     f"count will be the minimum over ranks and views (see usable_blocks)")
    return LayoutPlan(pp=_pp_layout(cfg, layers), tp=_tp_layout(cfg, kv, column_units), kv_heads=kv, layers=layers,
                      balanced=not mismatch, notes=tuple(notes))


def kv_block_bytes(cfg: ModelConfig, shard_pp: RankShard, shard_tp: RankShard, block_size: int,
                   dtype_bytes: int) -> tuple[int, int]:
    """Bytes of one KV block (K and V) of one rank: (PP view: its layers x its kv heads, TP view: same)."""
    if block_size < 1 or dtype_bytes < 1:
        raise ValueError(f"block_size={block_size} and dtype_bytes={dtype_bytes} must both be >= 1")
    per_layer_head = 2 * block_size * cfg.head_dim * dtype_bytes  # K and V
    return (shard_pp.layers.count * shard_pp.kv_heads.count * per_layer_head,
            shard_tp.layers.count * shard_tp.kv_heads.count * per_layer_head)


def usable_blocks(region_bytes_per_rank: Sequence[int], plan: LayoutPlan, cfg: ModelConfig, block_size: int,
                  dtype_bytes: int) -> tuple[int, list[dict]]:
    """The block count every rank can hold in both views, and per rank what it costs.

    Each row: rank, pp_blocks / tp_blocks (what this rank's region alone fits in each view), usable (the
    global count, the same on every row), unusable_bytes_pp / _tp (region bytes left over at that count).
    """
    if len(region_bytes_per_rank) != plan.world_size:
        raise ValueError(f"region_bytes_per_rank has {len(region_bytes_per_rank)} entries but the plan "
                         f"has {plan.world_size} ranks")
    block_bytes = [kv_block_bytes(cfg, pp, tp, block_size, dtype_bytes)
                   for pp, tp in zip(plan.pp.shards, plan.tp.shards)]
    for r, region in enumerate(region_bytes_per_rank):
        if region < 0:
            raise ValueError(f"region bytes of rank {r} is {region}; must be >= 0")
    usable = min(region // b for region, pair in zip(region_bytes_per_rank, block_bytes) for b in pair)
    rows = [{"rank": r, "pp_blocks": region // pp_b, "tp_blocks": region // tp_b, "usable": usable,
             "unusable_bytes_pp": region - usable * pp_b, "unusable_bytes_tp": region - usable * tp_b}
            for r, (region, (pp_b, tp_b)) in enumerate(zip(region_bytes_per_rank, block_bytes))]
    return usable, rows


def _check_budgets(budgets: Sequence[float]) -> list[Fraction]:
    if len(budgets) == 0:
        raise ValueError("budgets is empty: give one positive budget per rank")
    out = []
    for r, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) or b <= 0:
            raise ValueError(f"budget of rank {r} is {b!r}; every budget must be a finite number > 0")
        out.append(_exact(b))
    return out


def _exact(x: numbers.Real) -> Fraction:
    """A float as the decimal it prints as (0.6 -> 3/5), so budgets a person sees tie do tie."""
    return Fraction(x) if isinstance(x, numbers.Rational) else Fraction(repr(float(x)))


def _check_fits(cfg: ModelConfig, n: int) -> None:
    if cfg.num_kv_heads < n:
        raise ValueError(f"{cfg.num_kv_heads} KV heads cannot be split over {n} tensor-parallel ranks; "
                         f"use world_size <= {cfg.num_kv_heads} for now")
    if cfg.num_layers < n:
        raise ValueError(f"{cfg.num_layers} layers cannot be split over {n} pipeline stages (each needs "
                         f">= 1 layer); use world_size <= {cfg.num_layers}")


def _check_split(split: Sequence[int] | None, n: int, total: int, name: str, field: str) -> tuple[int, ...] | None:
    if split is None:
        return None
    split = tuple(split)
    if len(split) != n:
        raise ValueError(f"{name}={list(split)} has {len(split)} entries but world_size is {n}")
    for r, c in enumerate(split):
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"{name}[{r}]={c!r} must be an int >= 1")
    if sum(split) != total:
        raise ValueError(f"{name}={list(split)} sums to {sum(split)} but must sum to {field}={total}")
    return split


def _budget_note(total: int, weights: Sequence[Fraction], kv: tuple[int, ...]) -> list[str]:
    weight_sum = sum(weights)
    quotas = [total * w / weight_sum for w in weights]
    if all(q == c for q, c in zip(quotas, kv)):
        return []
    exact = ", ".join(f"{float(q):.3g}" for q in quotas)
    return [f"{total} KV heads rounded to {list(kv)} from budget shares [{exact}] "
            f"(largest remainder, >= 1 each, ties to the lower rank)"]


def _fraction_mismatch(cfg: ModelConfig, kv: tuple[int, ...], layers: tuple[int, ...]) -> list[str]:
    return [f"rank {r} ({l}/{cfg.num_layers} layers vs {k}/{cfg.num_kv_heads} kv heads)"
            for r, (k, l) in enumerate(zip(kv, layers)) if l * cfg.num_kv_heads != k * cfg.num_layers]


def _spans(counts: Sequence[int]) -> list[Span]:
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    return [Span(s, c) for s, c in zip(starts, counts)]


def _is_tiling(spans: Sequence[Span]) -> bool:
    return spans[0].start == 0 and all(a.stop == b.start for a, b in zip(spans, spans[1:]))


def _pp_layout(cfg: ModelConfig, layers: tuple[int, ...]) -> LayoutSpec:
    last = len(layers) - 1
    shards = tuple(RankShard(layers=span, kv_heads=Span(0, cfg.num_kv_heads), mlp=Span(0, cfg.intermediate_size),
                             vocab=Span(0, cfg.vocab_size), has_embed=r == 0, has_head=r == last, tp_size=1,
                             **whole_experts(cfg))
                   for r, span in enumerate(_spans(layers)))
    return LayoutSpec("pp", shards)


def _tp_layout(cfg: ModelConfig, kv: tuple[int, ...], column_units: tuple[int, int] = (1, 1)) -> LayoutSpec:
    """TP: each rank its KV heads (and their query heads), an MLP share in proportion, in whole
    column units (o_proj's and down_proj's: each of their rows is cut there), and a vocab share."""
    attention_unit, mlp_unit = column_units if len(kv) > 1 else (1, 1)   # one rank cuts nothing
    if cfg.head_dim % attention_unit:
        raise ValueError(f"a TP layout cuts each row of o_proj at head boundaries ({cfg.head_dim} values), which "
                         f"its {attention_unit}-value blocks cannot follow; serve this model with layouts=('pp',)")
    if cfg.intermediate_size % mlp_unit:
        raise ValueError(f"a TP layout cuts each row of down_proj within the MLP's {cfg.intermediate_size} "
                         f"columns, which its {mlp_unit}-value blocks cannot follow; serve this model with "
                         "layouts=('pp',)")
    mlp = _spans([c * mlp_unit for c in proportional_split(cfg.intermediate_size // mlp_unit, kv,
                                                             "MLP intermediate columns")])
    vocab = _spans(proportional_split(cfg.vocab_size, kv, "vocab rows"))
    experts = _expert_spans(cfg, kv)
    shards = tuple(RankShard(layers=Span(0, cfg.num_layers), kv_heads=h, mlp=m, vocab=v,
                             has_embed=True, has_head=True, tp_size=len(kv), **e)
                   for h, m, v, e in zip(_spans(kv), mlp, vocab, experts))
    return LayoutSpec("tp", shards)


def _expert_spans(cfg: ModelConfig, kv: tuple[int, ...]) -> list[dict[str, Span]]:
    """Each TP rank's share of every expert's intermediate columns and of the shared expert's, in
    proportion like the dense MLP's (an expert's FFN is sharded like it)."""
    m = cfg.moe
    if m is None:
        return [{}] * len(kv)
    experts = _spans(proportional_split(m.expert_intermediate_size, kv, "expert intermediate columns"))
    shared = (_spans(proportional_split(m.shared_intermediate_size, kv, "shared expert columns"))
              if m.shared_intermediate_size else [Span(0, 0)] * len(kv))
    return [dict(expert_mlp=e, shared_mlp=s) for e, s in zip(experts, shared)]
