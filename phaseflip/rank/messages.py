"""Typed messages between the controller and the ranks: what to run in a step and what came back, the
commands a rank executes and its replies.

Owns: StepBatch (one step's batch mixing prefill chunks and decodes), SeqChunk, NewRequest and
StepResult; the commands (boot, run a step in a layout, flip, arm a fault, stats, shutdown) and their
replies. Plain picklable dataclasses, no torch: a command is a type, never a method name in a string.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: runner.py imports torch, and messages stay plain data
    from phaseflip.rank.planner import LayoutPlan
    from phaseflip.rank.runner import StepShapes


# -- a step's batch and its result ---------------------------------------------------------------
class Phase(str, enum.Enum):
    PREFILL = "prefill"  # at least one chunk has more than one token or is a prompt chunk
    DECODE = "decode"    # every chunk is one generated token of a running sequence


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: tokens [start_pos, start_pos + len(token_ids)) of the sequence."""
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int             # == num_computed_tokens before the step
    block_ids: tuple[int, ...]  # the sequence's block table; covers start_pos + len(token_ids) tokens
    sample: bool               # the chunk reaches the sequence's last known token: sample the next one
    decode: bool               # one generated token of a running sequence (Scheduler.wants_decode)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of this sequence in the KV cache once the step has run."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class NewRequest:
    """Sent once, the first time a sequence is scheduled: the rank keeps its sampling state."""
    seq_id: int
    params: Any  # SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()   # only where the params' repetition penalty reads them


@dataclass(frozen=True)
class StepBatch:
    step_id: int
    phase: Phase
    chunks: tuple[SeqChunk, ...]
    new_requests: tuple[NewRequest, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()  # the rank may drop their sampling state

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None                    # of the sampled token, when logprobs were asked for
    top_logprobs: dict[int, float] | None = None    # top-N (+ the sampled token), when asked for


@dataclass(frozen=True)
class PromptLogprobs:
    """Of one chunk of a sequence that asked for its prompt's logprobs: logprobs[k] holds the prompt token
    at position start_pos + k + 1 and the top-N there ({token id: logprob}), given the tokens before it."""
    seq_id: int
    start_pos: int
    logprobs: tuple[dict[int, float], ...]


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: tuple[SampledToken, ...]  # one per chunk with sample=True, in chunk order
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


# -- rank commands and replies ---------------------------------------------------------------------
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
    num_kv_blocks: int | None  # None: each rank sizes it by kv_utilization (rank/kv_sizing.py)
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
    remeasure: bool = False                              # measure the boot's choices though a record has them
    block_products: str | None = None                    # "int8" | "exact": products on GGUF blocks (CPU)


@dataclass(frozen=True)
class RunStep:
    layout: str                # the layout the controller believes is active: checked by the rank
    batch: StepBatch


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
    """Test hook: make every build entry point raise from now on (rank/fence.py)."""


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
    """Sent by a booting rank as each boot phase starts (ms None) and after it ends, before RankReady."""
    rank: int
    phase: str
    ms: float | None


@dataclass(frozen=True)
class StepReply:
    rank: int
    sampled: tuple[SampledToken, ...] | None   # the output rank's tokens; None elsewhere
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()   # the output rank's, where a chunk asked


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
    micro_batched_runs: dict[str, int]  # "layout:phase" -> PP steps run as micro-batches
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
    ledger: dict[str, dict]            # layout -> ledger terms (rank/ledger.py)
    steps: list[dict]                  # every captured step
    compile: dict[str, dict]           # layout -> role -> choice and measurements
    memory: dict                       # what was measured at the end of boot
    eager_fallbacks: dict[str, int]
    chunked_runs: dict[str, int]
    micro_batched_runs: dict[str, int]
    weights: dict[str, dict] = field(default_factory=dict)   # layout -> arena.weight_report


@dataclass(frozen=True)
class RankFailure:
    rank: int
    error: str
    traceback: str
