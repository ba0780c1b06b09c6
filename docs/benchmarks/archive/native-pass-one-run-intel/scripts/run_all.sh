#!/bin/bash
# Every measure of the run, one after another, from the repository's root: bash run_all.sh OUT_DIR
set -u
OUT=${1:-native-pass-out}; mkdir -p "$OUT"
A=docs/benchmarks/archive
date -u > "$OUT/started.txt"; lscpu > "$OUT/lscpu.txt"; git rev-parse HEAD > "$OUT/commit.txt"
export GOMP_SPINCOUNT=300000 OMP_WAIT_POLICY=active
quickdraft profile --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
    --num-speculative-tokens 4 > "$OUT/profile-1.txt" 2>&1
python $A/attention-grouped-heads-amd/long_generation.py qwen2.5-coder-1.5b-instruct 4096 > "$OUT/long-generation-1.txt" 2>&1
quickdraft bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
    --methods none,draft_model,suffix --num-speculative-tokens 4 \
    --datasets humaneval,examples/code_prompts.jsonl --num-prompts 6 --max-tokens 128 \
    --peers llama_cpp --result-dir "$OUT/bench" > "$OUT/bench.log" 2>&1
quickdraft profile --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
    --num-speculative-tokens 4 > "$OUT/profile-2.txt" 2>&1
unset GOMP_SPINCOUNT OMP_WAIT_POLICY  # quickdraft's own defaults beside a busy process
python $A/shared-cores-threads-amd/shared_cores.py qwen2.5-coder-1.5b-instruct on > "$OUT/shared-cores.txt" 2>&1
date -u > "$OUT/finished.txt"
