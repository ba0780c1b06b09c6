"""Self-distillation texts (``quickdraft train generate``): prompts from installed packages'
functions, the target's greedy answers written as JSONL texts that `train data --texts` reads,
and a rerun that resumes instead of answering again."""

from __future__ import annotations

import json

from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams
from quickdraft.train import generate
from quickdraft.train.data import user_texts

SOURCE = '''
import os

@staticmethod
def helper(x):
    """Short."""
    return x

class Box:
    def area(self, scale: float = 1.0) -> float:
        """Return the area of the box, multiplied by ``scale``."""
        w = self.w * scale
        return w * self.h * scale

    def stub(self):
        """A docstring long enough, but no body to write after it."""
'''


def test_function_prompts_keep_the_def_and_docstring_dedented():
    got = list(generate._function_prompts(SOURCE))
    assert got == ['def area(self, scale: float = 1.0) -> float:\n'
                   '    """Return the area of the box, multiplied by ``scale``."""\n']
    assert list(generate._function_prompts("def broken(:\n")) == []


def test_answers_are_the_targets_greedy_text_and_a_rerun_resumes(smollm2_path, tmp_path):
    prompts = [{"prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"},
               {"messages": [{"role": "user", "content": "Name a prime number."}]}]
    out = tmp_path / "answers.jsonl"
    with LLM("smollm2-135m-instruct", max_num_seqs=2) as llm:
        made = generate.generate(llm, prompts, out, max_tokens=8, batch=2, progress=False)
        assert 0 < made <= 16
        texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
        assert texts[0].startswith(prompts[0]["prompt"]) and "<|im_start|>user" in texts[1]
        plain = llm.generate(prompts[0]["prompt"], SamplingParams(max_tokens=8, temperature=0))[0]
        assert texts[0] == prompts[0]["prompt"] + llm.tokenizer.decode(plain.token_ids, skip_special_tokens=False)
        assert generate.generate(llm, prompts, out, max_tokens=8, batch=2, progress=False) == 0  # resumed: all done
    assert list(user_texts(out)) == texts
