"""What the layout policy measured, kept for the next boot of the same engine.

Owns: `PolicyRecord`: each layout's prefill rate and decode step seconds per batch, and each flip
direction's price, as the meters read them when an engine shuts down (Meters.seeds), under the phaseflip
cache's policy/<digest of the key>.json. The next boot with the same key starts its meters from them:
their provenance is "seed" until this run measures each, and every priced decision says so
(rates_provenance, round_trip_provenance). Without it every boot learns the other layout's decode rate
only by going there: two flips and their settle steps in the first burst. The key (the machine, the
sources, torch, the model, the dtype, the plan) is the caller's; this module imports no torch.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from phaseflip.cache import cache_dir, key_digest, read_record, write_record
from phaseflip.engine.policy.estimators import Meters

log = logging.getLogger("phaseflip")

KEEP_RECORDS = 64   # the most recently used policy records kept


@dataclasses.dataclass
class PolicyRecord:
    """One key's seeds; `seeds` is empty where nothing was recorded (or remeasure, or it was unreadable)."""
    key: dict
    path: Path
    seeds: dict = dataclasses.field(default_factory=dict)
    made_at: str | None = None
    used: bool = False       # the meters of this run started from it

    @classmethod
    def load(cls, key: dict, layouts: tuple[str, ...], remeasure: bool = False,
             root: Path | None = None) -> "PolicyRecord":
        path = (root or cache_dir() / "policy") / f"{key_digest(key)}.json"
        data = None if remeasure else read_record(path, key)
        if data is None:
            return cls(key, path)
        seeds = {"rates": data.get("rates", {}), "legs": data.get("legs", {})}
        try:
            Meters.seeded(layouts, 0.0, seeds)      # every value a meter would reject, rejected here
        except (ValueError, TypeError, AttributeError) as e:
            log.warning("policy record %s is not usable (%s): the policy measures again", path, e)
            return cls(key, path)
        return cls(key, path, seeds, data.get("made_at"), used=True)

    def save(self, seeds: dict) -> None:
        """Keep `seeds` (Meters.seeds of the run that is ending) under this key."""
        self.made_at = write_record(self.path, self.key, seeds, KEEP_RECORDS)
        self.seeds = seeds

    def summary(self) -> dict:
        """What the manifest (and `phaseflip inspect`) says about the record."""
        return {"path": str(self.path), "made_at": self.made_at, "used": self.used}
