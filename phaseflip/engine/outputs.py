"""What a request hands back: its whole RequestOutput at the end, or the pieces a stream delivers.

Owns: building vLLM-shaped RequestOutputs from a request's sequences (one CompletionOutput per
sample), and `TextStream`, the text of one running sequence decoded a few tokens at a time (the
window technique of vLLM's and TGI's detokenizers: each step decodes only the tokens since the last
emitted piece, from one token earlier, so a character split across tokens is never emitted half).
A stream holds back the last characters a stop string could still claim, and its final piece is cut
from `final_text`, so the pieces of a stream joined are exactly the text of the whole output.
"""
from __future__ import annotations

from phaseflip.engine.requests import CompletionOutput, RequestMetrics, RequestOutput, Sequence
from phaseflip.engine.stopping import REPLACEMENT_CHAR, final_text


def completion(seq: Sequence, index: int, tokenizer) -> CompletionOutput:
    """The whole output of one sample."""
    return CompletionOutput(
        index=index, text=final_text(seq, tokenizer), token_ids=list(seq.output_token_ids),
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=seq.logprobs,
        cumulative_logprob=(sum(d[t] for d, t in zip(seq.logprobs, seq.output_token_ids))
                            if seq.logprobs else None))


def metrics(seq: Sequence) -> RequestMetrics:
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    return RequestMetrics(arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                          finished_time=seq.arrival_time + seq.token_times[-1] if seq.token_times else None,
                          time_to_first_token=ttft, token_times=tuple(seq.token_times),
                          num_preemptions=seq.num_preemptions)


def request_output(request_id: str, seqs: list[Sequence], tokenizer) -> RequestOutput:
    """The finished request: its samples in index order; metrics are the first sample's."""
    first = seqs[0]
    return RequestOutput(request_id, first.prompt_text, list(first.prompt_token_ids),
                         [completion(s, i, tokenizer) for i, s in enumerate(seqs)],
                         all(s.is_finished for s in seqs), metrics(first),
                         next((s.prompt_logprobs for s in seqs if s.prompt_logprobs is not None), None))


class TextStream:
    """The pieces of one sample's output as it grows: `next_piece` after each of its steps."""

    def __init__(self, seq: Sequence, index: int, tokenizer):
        self.seq, self.index, self.tokenizer = seq, index, tokenizer
        self.hold = max((len(s) for s in seq.params.stop), default=1) - 1   # a stop string may still come
        self.text = ""            # decoded so far (through read_offset)
        self.sent_chars = 0
        self.sent_tokens = 0
        self.prefix_offset = 0    # the window starts one emitted piece back
        self.read_offset = 0      # tokens decoded into self.text
        self.ended = False        # the piece with the finish reason was given

    def next_piece(self) -> CompletionOutput | None:
        """What is new since the last piece: tokens, text, logprobs, and the finish reason at the end
        (once); None when nothing is (a step that only held text back still sends its tokens)."""
        seq = self.seq
        if self.ended:
            return None
        ids = seq.output_token_ids
        if seq.is_finished:
            text = final_text(seq, self.tokenizer)[self.sent_chars:]
        else:
            self._decode(ids)
            text = self.text[self.sent_chars:max(self.sent_chars, len(self.text) - self.hold)]
        new_ids = ids[self.sent_tokens:]
        if not new_ids and not text and not seq.is_finished:
            return None
        logprobs = seq.logprobs[self.sent_tokens:] if seq.logprobs is not None else None
        self.sent_chars += len(text)
        self.sent_tokens = len(ids)
        self.ended = seq.is_finished
        return CompletionOutput(index=self.index, text=text, token_ids=list(new_ids),
                                finish_reason=seq.finish_reason if seq.is_finished else None,
                                stop_reason=seq.stop_reason, logprobs=logprobs)

    def _decode(self, ids: list[int]) -> None:
        skip = self.seq.params.skip_special_tokens
        before = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        window = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(window) > len(before) and not window.endswith(REPLACEMENT_CHAR):
            self.text += window[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
