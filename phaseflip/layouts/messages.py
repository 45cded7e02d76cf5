"""Typed messages between the controller and the rank processes (besides StepPlan in plan.py).

Owns: the commands a rank executes (boot, run a step in a layout, flip, arm a fault, stats, shutdown)
and its replies. Plain picklable dataclasses: a command is a type, never a method name in a string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from phaseflip.layouts.plan import SampledToken, StepPlan

if TYPE_CHECKING:  # annotations only: runner.py imports torch, and messages stay plain data
    from phaseflip.layouts.planner import LayoutPlan
    from phaseflip.layouts.runner import StepShapes

FLIP_STAGES = ("read", "exchange", "refill", "write", "cutover")
CHUNKED_STAGES = ("read", "exchange", "write")   # run once per chunk of live blocks
# "step": the next RunStep raises on that rank; "capture": the rank's boot raises as it starts capturing
FAULT_STAGES = FLIP_STAGES + ("step", "capture")


@dataclass(frozen=True)
class RankBoot:
    model_dir: str
    dtype: str                 # torch dtype name, e.g. "float32"
    device: str                # "cpu" | "cuda" (a rank uses cuda:<rank>)
    layout_plan: LayoutPlan
    layouts: tuple[str, ...]   # captured layouts, the first is active after boot
    shapes: StepShapes
    num_kv_blocks: int | None  # None: each rank sizes it by kv_utilization (layouts/kv_sizing.py)
    max_model_len: int
    park: str                  # "auto" | "always" | "never"
    seed: int
    capture: bool
    num_threads: int | None = None
    compile: str = "auto"                                # auto | on | off (engine/config.py)
    compile_cache_dir: str | None = None                 # inductor's and Triton's caches live below
    budgets_bytes: tuple[int, ...] | None = None         # memory budget per rank, for the ledger
    flip_staging_bytes: int | None = None                # the flip's send + receive buffers; None: default
    faults: tuple["ArmFault", ...] = ()                  # test hook: faults armed before boot starts
    kv_utilization: float | None = None                  # gpu_memory_utilization, when num_kv_blocks is None


@dataclass(frozen=True)
class RunStep:
    layout: str                # the layout the controller believes is active: checked by the rank
    plan: StepPlan


@dataclass(frozen=True)
class FlipCommand:
    target: str
    live_blocks: tuple[int, ...]


@dataclass(frozen=True)
class ArmFault:
    """Test hook: make the next flip fail at `stage` (or the next step raise) on `rank` (None: all);
    for read, exchange and write, at the given chunk of live blocks (None: the first it reaches)."""
    stage: str
    rank: int | None = None
    chunk: int | None = None

    def __post_init__(self):
        if self.stage not in FAULT_STAGES:
            raise ValueError(f"fault stage {self.stage!r} is unknown; stages: {', '.join(FAULT_STAGES)}")
        if self.chunk is not None and (self.stage not in CHUNKED_STAGES or self.chunk < 0):
            raise ValueError(f"fault chunk={self.chunk} is invalid for stage {self.stage!r}: a chunk >= 0 "
                             f"is given only for {', '.join(CHUNKED_STAGES)}")


@dataclass(frozen=True)
class ForgetRequests:
    """The controller finished these sequences: drop their sampling state (sent when no step follows)."""
    seq_ids: tuple[int, ...]


@dataclass(frozen=True)
class LiveStateQuery:
    """How much per-request state a rank still holds (leak checks)."""


@dataclass(frozen=True)
class FenceRebuild:
    """Test hook: make every build entry point raise from now on (layouts/fence.py)."""


@dataclass(frozen=True)
class PoisonArena:
    """Test hook: overwrite the whole weight arena with garbage (a refill must restore it)."""


@dataclass(frozen=True)
class StatsQuery:
    pass


@dataclass(frozen=True)
class ManifestQuery:
    """What a rank captured and where its memory went (for the boot manifest and `inspect`)."""


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RankReady:
    rank: int
    boot_ms: dict[str, float]
    captures_at_boot: int
    arena_bytes: int
    shard_bytes: dict[str, int]       # layout -> bytes of this rank's weights in that layout
    kv_bytes: int
    pid: int
    num_kv_blocks: int                # what the rank allocated (all ranks agree)
    kv_sizing: dict | None = None     # how gpu_memory_utilization sized it (kv_sizing.fit_blocks)


@dataclass(frozen=True)
class RankProgress:
    """Sent by a booting rank after each boot phase, before RankReady."""
    rank: int
    phase: str
    ms: float


@dataclass(frozen=True)
class StepReply:
    rank: int
    sampled: tuple[SampledToken, ...] | None   # the output rank's tokens; None elsewhere


@dataclass(frozen=True)
class FlipReport:
    rank: int
    source: str
    target: str
    ok: bool
    failed_stage: str | None = None
    failed_chunk: int | None = None   # the chunk of live blocks a read/exchange/write failed on
    error: str | None = None
    ms: dict[str, float] = field(default_factory=dict)   # read, exchange, write (summed over chunks),
                                                         # refill, cutover, rollback (if any), total
    kv_bytes: int = 0        # KV bytes this rank sent to other ranks
    weight_bytes: int = 0    # bytes this rank copied into its arena
    chunks: int = 0          # chunks the live blocks moved in
    staging_bytes: int = 0   # the send + receive buffers they moved through


@dataclass(frozen=True)
class RankStats:
    rank: int
    active_layout: str
    captures_at_boot: int
    captures_after_boot: int
    eager_fallbacks: dict[str, int]
    chunked_runs: dict[str, int]       # "layout:phase" -> batches run as chunks of the largest bucket
    arena_ptr: int
    arena_bytes: int


@dataclass(frozen=True)
class RankLiveState:
    rank: int
    num_sampler_seqs: int     # sequences whose sampling state this rank keeps


@dataclass(frozen=True)
class RankManifest:
    rank: int
    pid: int
    device: str
    active_layout: str
    boot_ms: dict[str, float]
    ledger: dict[str, dict]            # layout -> ledger terms (layouts/ledger.py)
    steps: list[dict]                  # every captured step
    compile: dict[str, dict]           # layout -> role -> choice and measurements
    memory: dict                       # what was measured at the end of boot
    eager_fallbacks: dict[str, int]
    chunked_runs: dict[str, int]


@dataclass(frozen=True)
class RankFailure:
    rank: int
    error: str
    traceback: str
