// attention.h's kernels bound to torch: the shape checks, then one call on raw pointers.
#include <torch/extension.h>

#include <array>

#include "attention.h"
#include "entry.h"

namespace {

// the checks both entry points share; (m, H, d, Hkv)
std::array<int64_t, 4> check(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t ctx) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q [m, heads, d] float32");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.strides() == values.strides(), "keys, values [kv_heads, L, d] alike");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values of one dtype");
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 || keys.scalar_type() == torch::kBFloat16, "keys float32 or bfloat16");
  const int64_t m = q.size(0), H = q.size(1), d = q.size(2), Hkv = keys.size(0);
  TORCH_CHECK(d % 16 == 0 && keys.size(2) == d && keys.stride(2) == 1, "head_dim a multiple of 16, contiguous");
  TORCH_CHECK(H % Hkv == 0 && keys.size(1) >= ctx + m, "heads a multiple of kv heads; the cache holds ctx + m keys");
  return {m, H, d, Hkv};
}

// run(Q, K, V, head stride, key stride, O) with the keys' element type, O = out [m, H * d] float32
template <typename Run>
void with_dtype(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& out, Run run) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) * q.size(2),
              "out [m, heads * d] float32, contiguous");
  auto qc = q.contiguous();
  const int64_t hs = keys.stride(0), ks = keys.stride(1);
  if (keys.scalar_type() == torch::kFloat32) {
    run(qc.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), hs, ks, out.data_ptr<float>());
  } else {
    run(qc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(keys.data_ptr()), reinterpret_cast<const uint16_t*>(values.data_ptr()), hs,
        ks, out.data_ptr<float>());
  }
}

torch::Tensor output_for(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 3, "q [m, heads, d]");
  return torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
}

}  // namespace

// q [m, H, d] float32; keys, values [Hkv, >= ctx + m, d] (float32 or bfloat16, rows contiguous);
// row j attends over keys 0..ctx+j (the last `window` of them where window > 0: a sliding window)
// -> out [m, H * d] float32 (written in place: forward.cpp's workspace)
void attend_chain_into(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t ctx, double scale,
                       const torch::Tensor& out, int64_t window) {
  const auto [m, H, d, Hkv] = check(q, keys, values, ctx);
  with_dtype(q, keys, values, out, [&](const float* Q, auto K, auto V, int64_t hs, int64_t ks, float* O) {
    qd::attend_chain(Q, K, V, hs, ks, O, m, H, Hkv, d, ctx, static_cast<float>(scale), window);
  });
}

torch::Tensor attend_chain(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t ctx, double scale, int64_t window) {
  auto out = output_for(q);
  attend_chain_into(q, keys, values, ctx, scale, out, window);
  return out;
}

// q [m, H, d] float32; keys, values [Hkv, >= ctx + m, d]; the new tokens (keys ctx..ctx+m-1) form a
// tree whose row j attends over keys 0..base-1 and then base + path[start[j]..start[j + 1]) (start
// [m + 1], path: each row's ancestors in the tree and itself, in order), where base = ctx - hidden:
// the hidden keys base..ctx-1 are tree nodes an earlier pass wrote, seen only through paths (0
// where the tree is all new; row 0's path ends at itself, hidden + 0, which gives hidden)
// -> out [m, H * d] float32, each row with the bits attend_chain gives the same history laid out as a chain
void attend_tree_into(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t ctx,
                      const torch::Tensor& start, const torch::Tensor& path, double scale, const torch::Tensor& out, int64_t window) {
  const auto [m, H, d, Hkv] = check(q, keys, values, ctx);
  TORCH_CHECK(start.scalar_type() == torch::kInt64 && start.dim() == 1 && start.size(0) == m + 1, "start [m + 1] int64");
  TORCH_CHECK(path.scalar_type() == torch::kInt64 && path.dim() == 1, "path int64");
  auto st = start.contiguous(), pt = path.contiguous();
  const int64_t* s = st.data_ptr<int64_t>();
  const int64_t* a = pt.data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0 && s[m] == path.size(0) && m > 0, "start runs from 0 to path's length");
  // row 0's path ends at its own key, after the hidden nodes of earlier passes
  const int64_t hidden = s[1] > s[0] ? a[s[1] - 1] : -1;
  TORCH_CHECK(hidden >= 0 && hidden <= ctx, "row 0's path ends at itself, at most ctx tokens past the shared context");
  for (int64_t j = 0; j < m; ++j) {
    TORCH_CHECK(s[j + 1] > s[j] && s[j + 1] - s[j] <= hidden + m, "row ", j, " attends to 1 to hidden + m tree tokens");
    for (int64_t i = s[j]; i < s[j + 1]; ++i) TORCH_CHECK(a[i] >= 0 && a[i] <= hidden + j, "row ", j, "'s path holds earlier keys only");
    TORCH_CHECK(a[s[j + 1] - 1] == hidden + j, "row ", j, "'s path ends at itself");
  }
  with_dtype(q, keys, values, out, [&](const float* Q, auto K, auto V, int64_t hs, int64_t ks, float* O) {
    qd::attend_tree(Q, K, V, hs, ks, O, m, H, Hkv, d, ctx, hidden, s, a, static_cast<float>(scale), window);
  });
}

torch::Tensor attend_tree(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t ctx, torch::Tensor start,
                          torch::Tensor path, double scale, int64_t window) {
  auto out = output_for(q);
  attend_tree_into(q, keys, values, ctx, start, path, scale, out, window);
  return out;
}
