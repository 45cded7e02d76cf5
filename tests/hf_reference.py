"""`python -m tests.hf_reference MODEL_DIR NEW_TOKENS`: HF transformers' greedy continuation of SmolLM2's
test prompts (tests/models.py's SMOLLM_TEXTS) as JSON on stdout: {"prompts": [ids], "reference":
[[ids, top2_gaps]]}. A process of its own so that the suite can run it beside its other tests
(tests/background.py)."""
from __future__ import annotations

import json
import sys


def main(model_dir: str, new_tokens: int) -> dict:
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    from tests.models import SMOLLM_TEXTS, hf_generate_greedy
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode(t) for t in SMOLLM_TEXTS]
    return {"prompts": prompts, "reference": hf_generate_greedy(model_dir, prompts, new_tokens)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
