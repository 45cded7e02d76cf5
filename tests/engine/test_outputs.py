"""A sequence's text streamed in pieces (engine/outputs.TextStream): joined, the pieces are exactly the
final text however the sequence ends (length, EOS, a stop token, a stop string cut from the text,
multi-byte characters split across tokens), and no piece ever shows text the final one takes back."""
import pytest

from phaseflip.engine import stopping
from phaseflip.engine.outputs import TextStream
from phaseflip.engine.requests import Sequence, SeqStatus
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.engine.checkpoint.tokenizer import load_tokenizer

TEXT = "Le café était fermé — past the 東京 station 🚉 — until the rain stopped. Then: halt here? The end. "


def stream_out(tok, ids, params, eos=frozenset()):
    """Grow a sequence token by token as the engine does; return the pieces and the final text."""
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[1], params=params)
    stream, pieces = TextStream(seq, 0, tok), []
    for t in ids:
        seq.output_token_ids.append(t)
        decision = stopping.check_stop(seq, tok, eos, 10**6)
        if decision is not None:
            seq.status, seq.finish_reason, seq.stop_reason = SeqStatus.FINISHED, decision.finish_reason, \
                decision.stop_reason
        piece = stream.next_piece()
        if piece is not None:
            pieces.append(piece)
        if decision is not None:
            break
    return pieces, stopping.final_text(seq, tok), seq


@pytest.mark.parametrize("stop", [None, "rain", "東京 st", "🚉", "e"])
def test_pieces_join_to_the_final_text_and_never_take_text_back(default_model_dir, stop):
    tok = load_tokenizer(default_model_dir)
    ids = tok.encode(TEXT * 3, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids) - 3, stop=stop, ignore_eos=True)
    pieces, final, seq = stream_out(tok, ids, params)
    assert "".join(p.text for p in pieces) == final
    shown = ""
    for p in pieces:
        shown += p.text
        assert final.startswith(shown)          # nothing shown that the end takes back
        assert "\ufffd" not in p.text           # no half character
    assert [t for p in pieces for t in p.token_ids] == seq.output_token_ids
    assert pieces[-1].finish_reason == ("length" if stop is None else "stop")
    assert all(p.finish_reason is None for p in pieces[:-1])
    if stop is not None:
        assert stop not in final and final == tok.decode(seq.output_token_ids).split(stop)[0]


def test_a_stop_token_or_eos_is_not_in_the_text(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    for params, eos in ((SamplingParams(max_tokens=None, stop_token_ids=[ids[10]]), frozenset()),
                        (SamplingParams(max_tokens=None), frozenset({ids[10]}))):
        pieces, final, seq = stream_out(tok, ids, params, eos)
        assert "".join(p.text for p in pieces) == final == tok.decode(ids[:10])
        assert seq.output_token_ids == ids[:11] and pieces[-1].finish_reason == "stop"


def test_a_character_cut_by_the_length_is_left_out_as_vllm_does(default_model_dir):
    """max_tokens ending inside a multi-byte character: the text ends before it (vLLM's detokenizer
    holds back an incomplete character and never emits it), streamed or not; the tokens are all kept."""
    tok = load_tokenizer(default_model_dir)
    whole = tok.encode("rain 🚉", add_special_tokens=False)
    cut = next(n for n in range(1, len(whole)) if tok.decode(whole[:n]).endswith("\ufffd"))
    pieces, final, seq = stream_out(tok, whole, SamplingParams(max_tokens=cut, ignore_eos=True))
    assert final == "".join(p.text for p in pieces) == tok.decode(whole[:cut]).rstrip("\ufffd") == "rain "
    assert seq.output_token_ids == whole[:cut] and pieces[-1].finish_reason == "length"
