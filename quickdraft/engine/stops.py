"""When a sequence is done: the stop rules, applied to each token as it is appended, in plain
decoding's order (end of sequence, the grammar, stop strings, a complete grammar, length)."""

from __future__ import annotations

from quickdraft.engine.sequence import Sequence


class StopRules:
    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int) -> bool:
        """Add one token and apply the stop rules; True = finished (an end of sequence is not added)."""
        p = seq.params
        if token in self.eos_token_ids and not p.ignore_eos:
            seq.finish("stop")
            return True
        seq.append(token)
        if seq.grammar is not None and not seq.grammar.advance(token):
            seq.finish("error", f"the output left its grammar: {seq.grammar.error}")
            return True
        if p.stop and self._hit_stop(seq):
            seq.finish("stop")
            return True
        if seq.grammar is not None and seq.grammar.terminated:  # complete: nothing may follow
            seq.finish("stop")
            return True
        if len(seq.output_token_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish("length")
            return True
        return False

    @staticmethod
    def _hit_stop(seq: Sequence) -> bool:
        """Whether the output now holds one of the request's stop strings; if so, its text is cut
        before the first. Only the text that changed is searched, from as far back as the longest
        stop string reaches into the text that did not: earlier text held none (it was searched
        token by token), so the first occurrence is found as in the whole text."""
        stops = seq.params.stop
        unchanged = seq.detokenizer.update()
        seq.text = text = seq.detokenizer.text
        start = max(0, unchanged - max(map(len, stops)) + 1)
        hit = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
        if hit >= 0:
            seq.text = text[:hit]
        return hit >= 0
