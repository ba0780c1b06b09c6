"""One call of quickdraft.verify on real target-shaped logits: the 0.5B's rows of shape_rows.py,
five rows a sequence (K = 4) at temperature 0.7, its drafts drawn from a perturbed copy of the
rows; the median ms over 45 calls.

    python verify_once.py LABEL
"""
import statistics
import sys
import time

import torch

from quickdraft.sampling import BatchSampling, SamplingParams, logits_to_probs
from quickdraft.verify import verify
from shape_rows import real_logits  # this folder's, beside this script

logits = real_logits()
gen = torch.Generator().manual_seed(0)
batch = BatchSampling.from_params([SamplingParams(temperature=0.7)])
cases = []
for i in range(0, 100, 7):
    target = logits[i : i + 5].contiguous()
    noisy = logits[i + 1 : i + 5] + torch.randn(4, logits.shape[1], generator=gen) * 0.5
    q = logits_to_probs(noisy, torch.full((4,), 0.7), torch.zeros(4, dtype=torch.long), torch.ones(4), torch.zeros(4))
    cases.append((torch.multinomial(q, 1, generator=gen).squeeze(1), target, q))
seconds = []
for _ in range(3):
    for drafts, target, q in cases:
        uniforms = torch.rand(5, generator=gen, dtype=torch.float64)
        start = time.perf_counter()
        verify(drafts, [4], target, q, batch, uniforms)
        seconds.append(time.perf_counter() - start)
print(f"{sys.argv[1]}: verify median {statistics.median(seconds) * 1e3:.3f} ms over {len(seconds)} calls")
