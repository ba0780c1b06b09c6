// One decoder layer (models/decoder.py's Decoder._block) for chains or token trees of new tokens, in one call.
//
// Written by hand because at one row a decoding step is dozens of small operations a layer, each
// a trip through the Python interpreter and torch's dispatcher. Measured against the Python path,
// interleaved in one process (AMD EPYC, stored Q4_K_M blocks, 200 tokens of context): the 0.5B
// draft's one-row step 17.6 -> 16.0 ms, the 1.5B's 40.4 -> 39.5 and 40.5 -> 36.9 ms (two runs).
// This is the same sequence of the same kernels (linear.cpp, blocks.cpp, rowwise.cpp,
// attention.cpp) and of the same torch operations (silu, mul, add), in the same order, so its
// output is bit for bit that of the Python path, which stays for long prefills, the
// int8 draft format, CUDA and CPUs without the kernels (tests/models/test_fused_layer.py).
#include <torch/extension.h>

#include <vector>

#include "entry.h"  // the kernels it strings together

namespace {

constexpr int64_t DENSE = -1;  // a projection's kind: a dense weight of x's dtype; >= 0: a GGUF block format

torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, int64_t kind, const c10::optional<torch::Tensor>& bias) {
  if (kind != DENSE) return linear_blocks(x, w, kind, x.size(1), bias);
  return x.scalar_type() == torch::kFloat32 ? linear_f32(x, w, bias) : linear_bf16(x, w, bias);
}

// x times each of the ``count`` weights w[at..] of formats kinds[kat..]: runs of one block format
// go in one call (blocks.cpp's linear_blocks_many), the same bits as one call each
std::vector<torch::Tensor> project_all(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at,
                                       const std::vector<int64_t>& kinds, size_t kat, size_t count,
                                       const std::vector<c10::optional<torch::Tensor>>& biases) {
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < count;) {
    const int64_t kind = kinds[kat + i];
    size_t end = i + 1;
    while (kind != DENSE && end < count && kinds[kat + end] == kind) ++end;
    if (end - i == 1) {
      out.push_back(project(x, w[at + i], kind, biases[i]));
    } else {
      std::vector<torch::Tensor> ws(w.begin() + at + i, w.begin() + at + end);
      std::vector<c10::optional<torch::Tensor>> bs(biases.begin() + i, biases.begin() + end);
      for (auto& y : linear_blocks_many(x, ws, kind, x.size(1), bs)) out.push_back(y);
    }
    i = end;
  }
  return out;
}

}  // namespace

// x [n, hidden]; positions [n]; w: input norm, q, k, v, o, post-attention norm, gate, up, down;
// kinds: the 7 projections' (DENSE or a block format); biases: q, k, v's; kcache, vcache: this
// layer's [slots, kv_heads, max_len, d]; sequence i's query_lens[i] rows are its new tokens at
// positions context_lens[i].. of slot slots[i]: a causal chain, or where tree_starts[i] and
// tree_paths[i] are given a token tree (row j sees the tree tokens tree_paths[i][start[j] ..
// start[j + 1]], hidden nodes of earlier passes included: attention.cpp's attend_tree) -> x after the layer
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> w, std::vector<int64_t> kinds,
                            std::vector<c10::optional<torch::Tensor>> biases, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kcache, torch::Tensor vcache, std::vector<int64_t> slots,
                            std::vector<int64_t> context_lens, std::vector<int64_t> query_lens,
                            std::vector<c10::optional<torch::Tensor>> tree_starts, std::vector<c10::optional<torch::Tensor>> tree_paths,
                            int64_t heads, int64_t kv_heads, double eps, double scale) {
  TORCH_CHECK(w.size() == 9 && kinds.size() == 7 && biases.size() == 3, "9 weights, 7 kinds, 3 biases");
  TORCH_CHECK(slots.size() == context_lens.size() && slots.size() == query_lens.size() && slots.size() == tree_starts.size() &&
                  slots.size() == tree_paths.size(),
              "one slot, context, length and tree (or None) a sequence");
  TORCH_CHECK(kcache.dim() == 4 && kcache.sizes() == vcache.sizes(), "caches [slots, kv_heads, max_len, d]");
  const int64_t n = x.size(0), d = kcache.size(3);
  int64_t rows = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    TORCH_CHECK(context_lens[i] + query_lens[i] <= kcache.size(2), "sequence ", i, " runs past the cache's ", kcache.size(2), " positions");
    rows += query_lens[i];
  }
  TORCH_CHECK(rows == n, "the query lengths add up to ", rows, ", x has ", n, " rows");

  const torch::Tensor h = rms_norm(x, w[0], eps);
  const std::vector<torch::Tensor> qkv = project_all(h, w, 1, kinds, 0, 3, biases);
  const torch::Tensor q = rotary(qkv[0].view({n, heads, d}), cos, sin, positions);
  const torch::Tensor k = rotary(qkv[1].view({n, kv_heads, d}), cos, sin, positions);
  const torch::Tensor v = qkv[2].view({n, kv_heads, d});
  std::vector<torch::Tensor> out;
  out.reserve(slots.size());
  int64_t start = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t ctx = context_lens[i], len = query_lens[i];
    const torch::Tensor keys = kcache.select(0, slots[i]), values = vcache.select(0, slots[i]);  // [kv_heads, max_len, d]
    keys.narrow(1, ctx, len).copy_(k.narrow(0, start, len).transpose(0, 1));
    values.narrow(1, ctx, len).copy_(v.narrow(0, start, len).transpose(0, 1));
    const torch::Tensor qi = q.narrow(0, start, len).to(torch::kFloat32);
    const torch::Tensor ki = keys.narrow(1, 0, ctx + len), vi = values.narrow(1, 0, ctx + len);
    if (tree_starts[i].has_value()) {
      TORCH_CHECK(tree_paths[i].has_value(), "sequence ", i, ": a tree's starts without its paths");
      out.push_back(attend_tree(qi, ki, vi, ctx, *tree_starts[i], *tree_paths[i], scale));
    } else {
      out.push_back(attend_chain(qi, ki, vi, ctx, scale));
    }
    start += len;
  }
  const torch::Tensor attn = (out.size() == 1 ? out[0] : torch::cat(out)).to(x.scalar_type());
  const torch::Tensor mid = x + project(attn, w[4], kinds[3], c10::nullopt);
  const torch::Tensor h2 = rms_norm(mid, w[5], eps);
  const std::vector<torch::Tensor> gate_up = project_all(h2, w, 6, kinds, 4, 2, {c10::nullopt, c10::nullopt});
  return mid + project(at::silu(gate_up[0]) * gate_up[1], w[8], kinds[6], c10::nullopt);
}
