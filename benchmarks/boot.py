"""Boot benchmark (not a test): first and second boot with compiled steps.

The first boot runs with an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR); the second reuses
it. Steps saved and choices recorded under the phaseflip cache (~/.cache/phaseflip/steps, records) by
an earlier boot of the same key serve both: empty those for a cold first boot. Usage: python benchmarks/boot.py [--model DIR] [--world-size 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
from phaseflip import LLM
t0 = time.perf_counter()
with LLM(model=sys.argv[1] or None, world_size=int(sys.argv[2]), compile="on") as llm:
    total = (time.perf_counter() - t0) * 1e3
    m = llm.inspect()
print(json.dumps({"total_ms": total, "rank0": m["ranks"][0]["boot_ms"], "compile": m["ranks"][0]["compile"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--world-size", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        runs = []
        for label in ("first boot (empty inductor cache)", "second boot (warm cache)"):
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.world_size)], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs.append((label, json.loads(out)))
    for label, r in runs:
        phases = ", ".join(f"{k} {v:.0f}" for k, v in r["rank0"].items())
        print(f"{label}: total {r['total_ms']:.0f} ms; rank 0: {phases}")
        for layout, roles in r["compile"].items():
            for role, c in roles.items():
                if "choice" not in c:   # the record's summary: where the choices came from
                    print(f"    {layout} {role}: {c}")
                    continue
                print(f"    {layout} {role}: {c['choice']} (compile {c.get('compile_ms', 0):.0f} ms, "
                      f"compiled {c.get('compiled_ms', 0):.1f} ms vs eager {c.get('eager_ms', 0):.1f} ms)")


if __name__ == "__main__":
    main()
