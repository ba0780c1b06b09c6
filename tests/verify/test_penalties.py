"""Penalties, logit bias and min_tokens under speculation (verify/penalties.py): row j of a
verification pass is shaped by the text up to it, draft tokens before j included, so the output is
plain decoding's with the same rules, token for token."""

from __future__ import annotations

import pytest
import torch

from quickdraft.errors import ConfigError
from quickdraft.sampling import SamplingParams
from quickdraft.verify.penalties import shape_rows, shapes_logits


def test_each_row_sees_the_drafts_before_it():
    rows = torch.zeros(3, 8)
    p = SamplingParams(max_tokens=8, frequency_penalty=1.0, presence_penalty=0.5)
    shape_rows(rows, p, prompt=[7], output=[1], drafts=[2, 2], eos_ids=[0])
    assert rows[0].tolist() == [0, -1.5, 0, 0, 0, 0, 0, 0]  # the prompt's 7 is not output: no penalty
    assert rows[1].tolist() == [0, -1.5, -1.5, 0, 0, 0, 0, 0]
    assert rows[2].tolist() == [0, -1.5, -2.5, 0, 0, 0, 0, 0]


def test_repetition_bias_and_min_tokens():
    rows = torch.tensor([[2.0, -2.0, 2.0, 1.0], [2.0, -2.0, 2.0, 1.0], [2.0, -2.0, 2.0, 1.0]])
    p = SamplingParams(max_tokens=8, repetition_penalty=2.0, logit_bias={3: 5.0}, min_tokens=3)
    shape_rows(rows, p, prompt=[1], output=[2], drafts=[3, 0], eos_ids=[0])
    inf = float("-inf")
    assert rows[0].tolist() == [inf, -4.0, 1.0, 6.0]  # 1 (prompt) and 2 (output) seen; 1 output token: no eos
    assert rows[1].tolist() == [inf, -4.0, 1.0, 5.5]  # the draft 3 is seen now: (1 / 2) + 5
    assert rows[2].tolist() == [1.0, -4.0, 1.0, 5.5]  # 3 tokens out by then: eos allowed, and 0 seen (2 / 2)
    assert shapes_logits(p) and not shapes_logits(SamplingParams())


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(repetition_penalty=0.0), dict(logit_bias={1: 101}),
                                 dict(min_tokens=20, max_tokens=10)])
def test_bad_values_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)
