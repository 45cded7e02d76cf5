"""Tiny random HF checkpoints (and their tokenizer) for the test suite, plus the HF greedy reference.

Owns: building small Llama/Mistral/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3 models and Mixtral/Qwen2-MoE/Qwen3-MoE
mixtures with transformers, saving them as an HF model
directory (config.json, *.safetensors [+ index], tokenizer.json, tokenizer_config.json), running HF fp32
greedy decoding on them, and comparing an engine's greedy tokens with that reference (vLLM's
check_logprobs_close convention: a divergence is forgiven only where the reference's top-2 gap is a tie).

Example:
    model_dir = make_tiny_model("qwen2", tmp_path / "qwen2", sharded=True)
    ref = hf_greedy(model_dir, [[5, 17, 42]], max_new_tokens=8)      # [(ids, top2_gaps)]
    ok, num_ties, msg = compare_greedy(our_ids, ref)                  # our_ids: [[...]] per prompt
    assert ok, msg

transformers is imported lazily so that importing this module costs nothing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

KINDS = ("llama", "qwen2", "qwen3", "mistral", "llama3rope", "linearrope", "yarnrope", "phi3", "mixtral", "qwen2moe",
         "qwen3moe", "mistralwindow", "qwen2window", "gemma2", "gemma3", "dynamicrope", "phi3longrope")
MOE_KINDS = ("mixtral", "qwen2moe", "qwen3moe")
WINDOW_KINDS = ("mistralwindow", "qwen2window")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 384
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
How vexingly quick daft zebras jump; the five boxing wizards jump quickly. Sphinx of black quartz,
judge my vow. A large language model predicts the next token given the previous ones: it reads the
prompt, fills a cache of keys and values, and then decodes one token at a time. Pipeline parallel
stages hold layers; tensor parallel shares hold heads. What is 2 + 2? It is 4. Numbers 0123456789,
punctuation ()[]{}<>/\\|@#$%^&*-_=+'"`~ and a tab\tand newlines\n are all text too. Hello, world!"""

# Shared shapes: GQA (4 query heads over 2 KV heads), head_dim 16, so every kind exercises grouping.
_BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
_KIND = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # head_dim 32 != hidden/heads = 16: q_proj is [128, 64], o_proj [64, 128].
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "llama3rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=512,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "linearrope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),   # fused qkv_proj and gate_up_proj
    "yarnrope": ("Qwen2Config", "Qwen2ForCausalLM", dict(   # Qwen2.5's long-context recipe
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    # mixtures of experts, top-2: Mixtral renormalises the two weights; Qwen2-MoE does not and adds a gated
    # shared expert; Qwen3-MoE renormalises and keeps layer 1 dense (mlp_only_layers)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            intermediate_size=48, sliding_window=None)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False)),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # sliding windows shorter than most parity prompts: every layer (Mistral), layers 1 and 2 (Qwen2)
    "mistralwindow": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen2window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=20,
                                                            max_window_layers=1)),
    # served within max_position_embeddings (dynamic NTK) and the original context (LongRoPE's short factors)
    "dynamicrope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(rope_type="dynamic", factor=4.0,
                                                                                 rope_theta=10000.0))),
    "phi3longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, max_position_embeddings=1024, original_max_position_embeddings=128,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=128,
                             short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.0],
                             long_factor=[2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0]))),
    # Gemma: sliding layers 0 and 2, caps low enough to bend the scores and logits of these weights; Gemma 3
    # with its q/k norms, its own rope on the sliding layers and a linear-scaled one on the full layer
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=24, sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
}
WEIGHT_STD = 0.08   # large enough that greedy top-2 gaps are rarely near-ties
EMBED_STD = 0.5


def make_tokenizer(out_dir: str | Path, *, add_bos_token: bool | None = None) -> Path:
    """A byte-level BPE tokenizer (vocab 384) trained on a fixed corpus, saved with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|im_start|>", eos_token="<|im_end|>",
               unk_token="<|endoftext|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
               model_max_length=512, chat_template=CHATML_TEMPLATE)
    if add_bos_token is not None:
        cfg["add_bos_token"] = add_bos_token
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def make_tiny_model(kind: str, out_dir: str | Path, *, num_layers: int = 3, tie: bool = False,
                    sharded: bool = False, seed: int = 0, **overrides) -> Path:
    """Build, randomise and save a tiny fp32 model of `kind` (see KINDS) with the test tokenizer."""
    import torch
    import transformers
    if kind not in _KIND:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out_dir = make_tokenizer(out_dir)
    config_cls, model_cls, extra = _KIND[kind]
    kwargs = {**_BASE, **extra, "vocab_size": TOKENIZER_VOCAB_SIZE, "num_hidden_layers": num_layers,
              "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **overrides}
    if "rope_parameters" in kwargs:
        kwargs.pop("rope_theta")
    else:
        kwargs["rope_parameters"] = dict(rope_type="default", rope_theta=kwargs.pop("rope_theta"))
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    _randomise(model, seed * len(KINDS) + KINDS.index(kind))  # llama and mistral get different weights
    model.save_pretrained(out_dir, max_shard_size="100KB" if sharded else "2GB")
    return out_dir


def _randomise(model, seed: int) -> None:
    """Random everything: norms around 1 (not exactly 1), non-zero biases, matrices std WEIGHT_STD."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(torch.empty(param.shape).uniform_(0.6, 1.4, generator=gen))
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * EMBED_STD)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)


def edited_model(src: str | Path, out_dir: str | Path, **changes) -> Path:
    """A copy of the model directory src at out_dir/model, its config.json fields changed (None: removed)."""
    import shutil
    d = Path(shutil.copytree(src, Path(out_dir) / "model"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update({k: v for k, v in changes.items() if v is not None})
    for k in [k for k, v in changes.items() if v is None]:
        cfg.pop(k, None)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# (the model's files, a prompt) -> the longest greedy run of it hf_greedy computed in this process
_HF_RUNS: dict[tuple, tuple[list[int], list[float]]] = {}


def hf_greedy(model_dir: str | Path, prompts_token_ids: list[list[int]], max_new_tokens: int,
              stop_token_ids: Sequence[int] = ()) -> list[tuple[list[int], list[float]]]:
    """HF fp32 greedy, one prompt at a time (no padding): per prompt (generated ids, top-2 logprob gaps).
    A run with no stop tokens is kept for the session: a prompt asked again of the same files (the same
    names, sizes and mtimes) for as many tokens or fewer gets its prefix, which is what a shorter run
    computes (each step sees the prompt and the tokens before it only)."""
    if stop_token_ids:
        return _hf_greedy(model_dir, prompts_token_ids, max_new_tokens, stop_token_ids)
    files = _files_of(model_dir)
    missing = [p for p in prompts_token_ids if len(_HF_RUNS.get((files, tuple(p)), ((),))[0]) < max_new_tokens]
    for p, run in zip(missing, _hf_greedy(model_dir, missing, max_new_tokens) if missing else ()):
        _HF_RUNS[(files, tuple(p))] = run
    return [tuple(part[:max_new_tokens] for part in _HF_RUNS[(files, tuple(p))]) for p in prompts_token_ids]


def _files_of(model_dir: str | Path) -> tuple:
    root = Path(model_dir).resolve()
    return str(root), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                            for f in sorted(root.iterdir()) if f.is_file())


def _hf_greedy(model_dir: str | Path, prompts_token_ids: list[list[int]], max_new_tokens: int,
               stop_token_ids: Sequence[int] = ()) -> list[tuple[list[int], list[float]]]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts_token_ids:
            ids, gaps = [], []
            for _ in range(max_new_tokens):
                # Full recompute each step: no cache semantics in the reference, and tiny models make it cheap.
                logits = model(input_ids=torch.tensor([list(prompt) + ids]), use_cache=False).logits
                top2 = torch.log_softmax(logits[0, -1].float(), dim=-1).topk(2)
                ids.append(int(top2.indices[0]))
                gaps.append(float(top2.values[0] - top2.values[1]))
                if ids[-1] in stop_token_ids:
                    break
            results.append((ids, gaps))
    return results


def compare_greedy(ours: list[list[int]], ref: list[tuple[list[int], list[float]]],
                   tol: float = 1e-4) -> tuple[bool, int, str]:
    """(ok, num_tie_divergences, message): ok when every sequence is identical, or first diverges where
    the reference's top-2 gap is < tol (a tie: either token is a correct greedy choice)."""
    if len(ours) != len(ref):
        return False, 0, f"{len(ours)} sequences, reference has {len(ref)}"
    num_ties, problems = 0, []
    for i, (seq, (ref_ids, gaps)) in enumerate(zip(ours, ref)):
        seq = list(seq)
        pos = next((p for p, (a, b) in enumerate(zip(seq, ref_ids)) if a != b), min(len(seq), len(ref_ids)))
        if seq == ref_ids:
            continue
        if pos < len(gaps) and gaps[pos] < tol:
            num_ties += 1
            continue
        gap = f"{gaps[pos]:.3g}" if pos < len(gaps) else "n/a"
        problems.append(f"seq {i}: first mismatch at position {pos} (reference top-2 gap {gap}): "
                        f"ours {seq[pos:pos + 5]} vs reference {ref_ids[pos:pos + 5]}")
    if problems:
        return False, num_ties, "; ".join(problems)
    return True, num_ties, f"match ({num_ties} tie divergences)"


SMOLLM_TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "1, 2, 3, 4,", "The quick brown fox", "Water boils at",
                "A short poem about the moon:\n", "Photosynthesis is the process " * 12)


def hf_generate_greedy(model_dir, prompts_token_ids, max_new_tokens: int):
    """HF generate with its KV cache, fp32 greedy, no EOS stop: [(ids, top2_gaps)] per prompt. For real
    models, where hf_greedy's full recompute per token would take minutes on 2 cores. The prompts go as
    one left-padded batch with their attention mask (HF's batched generation: max_new_tokens steps in
    all, not for each prompt)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts_token_ids)
    pads = [width - len(p) for p in prompts_token_ids]
    ids = torch.tensor([[0] * n + list(p) for n, p in zip(pads, prompts_token_ids)])
    mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pads, prompts_token_ids)])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                           eos_token_id=None, pad_token_id=0)
    top2 = [torch.log_softmax(logits.float(), -1).topk(2).values for logits in g.logits]   # [B, 2] a step
    return [(g.sequences[i, width:].tolist(), [float(t[i, 0] - t[i, 1]) for t in top2])
            for i in range(len(prompts_token_ids))]
