// RMSNorm, rotary embedding and the layer's elementwise steps, row by row, in one call each.
// Written by hand because at one to a few rows a decoding step's time outside the matrices is
// torch's per-op overhead: the decoder's torch versions of the first two take 5 and 6 small ops
// (~18 and ~27 us a call on a 2-core EPYC), these a few microseconds; and each of the layer's
// torch adds, multiplies and copies cost 1-4 us of dispatch a call where its work is well under
// one. Each row's result depends on that row alone, in a fixed order (batch invariant).
#include <torch/extension.h>

#include <cstring>
#include <omp.h>

#include "rowwise.h"

namespace {

const uint16_t* bf16(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bf16_out(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// op(a, b, out, count) on float32 or bfloat16 pointers
template <typename Op>
void binary_into(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out, Op op) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && out.is_contiguous() && a.sizes() == b.sizes() && a.sizes() == out.sizes(),
              "a, b and out alike, contiguous");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == out.scalar_type(), "a, b and out of one dtype");
  if (a.scalar_type() == torch::kFloat32) {
    op(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel());
  } else {
    TORCH_CHECK(a.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    op(bf16(a), bf16(b), bf16_out(out), a.numel());
  }
}

}  // namespace

// out = a + b, elementwise (out may be a or b)
void add_into(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out) {
  binary_into(a, b, out, [](auto* x, auto* y, auto* o, int64_t count) { qd::add_values(x, y, o, count); });
}

// out = a * b, elementwise (out may be a or b)
void mul_into(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out) {
  binary_into(a, b, out, [](auto* x, auto* y, auto* o, int64_t count) { qd::mul_values(x, y, o, count); });
}

// silu(gate) * up, elementwise, rounded after each step (rowwise.h's silu_mul_values) -> a new
// contiguous tensor of gate's dtype
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  auto out = torch::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  binary_into(gate.contiguous(), up.contiguous(), out,
              [](auto* g, auto* u, auto* o, int64_t count) { qd::silu_mul_values(g, u, o, count); });
  return out;
}

// act(gate) * up, elementwise, act 0 SiLU or 1 GELU-tanh (rowwise.h's act_mul_values) -> a new
// contiguous tensor of gate's dtype
torch::Tensor act_mul(torch::Tensor gate, torch::Tensor up, int64_t act) {
  TORCH_CHECK(act == qd::SILU || act == qd::GELU_TANH, "activation 0 (SiLU) or 1 (GELU-tanh)");
  auto out = torch::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  binary_into(gate.contiguous(), up.contiguous(), out,
              [act](auto* g, auto* u, auto* o, int64_t count) { qd::act_mul_values(act, g, u, o, count); });
  return out;
}

// dst = src in dst's dtype (float32 <-> bfloat16, rounded to nearest even as torch's copy_), both
// contiguous and of one size
void convert_into(const torch::Tensor& src, const torch::Tensor& dst) {
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous() && src.numel() == dst.numel(), "src and dst contiguous, of one size");
  const auto from = src.scalar_type(), to = dst.scalar_type();
  if (from == torch::kBFloat16 && to == torch::kFloat32) {
    qd::convert_values(bf16(src), dst.data_ptr<float>(), src.numel());
  } else if (from == torch::kFloat32 && to == torch::kBFloat16) {
    qd::convert_values(src.data_ptr<float>(), bf16_out(dst), src.numel());
  } else {
    TORCH_CHECK(from == to, "float32 <-> bfloat16, or one dtype");
    std::memcpy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size());
  }
}

// rows [len, kv_heads, d] (contiguous) into cache [kv_heads, >= at + len, d] at positions at..at+len-1
// (rows of d contiguous values: a KV cache slot), of one dtype
void write_cache(const torch::Tensor& rows, const torch::Tensor& cache, int64_t at) {
  TORCH_CHECK(rows.dim() == 3 && rows.is_contiguous() && cache.dim() == 3 && cache.size(0) == rows.size(1) &&
                  cache.size(2) == rows.size(2) && cache.stride(2) == 1 && cache.scalar_type() == rows.scalar_type(),
              "rows [len, kv_heads, d] contiguous, cache [kv_heads, L, d] of their dtype");
  const int64_t len = rows.size(0), heads = rows.size(1), d = rows.size(2);
  TORCH_CHECK(at >= 0 && at + len <= cache.size(1), "positions ", at, "..", at + len, " past the cache's ", cache.size(1));
  const int64_t size = rows.element_size();
  qd::write_rows(rows.data_ptr(), cache.data_ptr(), cache.stride(0) * size, cache.stride(1) * size, at, len, heads, d * size);
}

// x [n, h], weight [h] of x's dtype or float32 (rowwise.h's rms_rows: Gemma's rule) -> y [n, h],
// contiguous, of x's dtype (written in place: forward.cpp's workspace; y may not overlap x)
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x [n, h], weight [h]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || weight.scalar_type() == torch::kFloat32, "a weight of x's dtype or float32");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.sizes() == x.sizes(), "y like x, contiguous");
  auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t n = xc.size(0), h = xc.size(1);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    qd::rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), n, h, e);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
    if (wc.scalar_type() == torch::kFloat32) {
      qd::rms_rows(bf16(xc), wc.data_ptr<float>(), bf16_out(y), n, h, e);
    } else {
      qd::rms_rows(bf16(xc), bf16(wc), bf16_out(y), n, h, e);
    }
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto y = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  rms_norm_into(x, weight, eps, y);
  return y;
}

// x [n, heads, d] float32 or bfloat16; cos, sin [positions, d] float32; positions [n] int64 -> y
// like x, contiguous (written in place; y may be x itself: each pair of values is read before it
// is written)
void rotary_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                 const torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x [n, heads, d], d even");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.size(1) == x.size(2),
              "cos, sin [positions, d] float32");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == x.size(0), "positions [n] int64");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.sizes() == x.sizes(), "y like x, contiguous");
  auto xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous(), pc = positions.contiguous();
  for (int64_t r = 0; r < pc.numel(); ++r) {
    const int64_t p = pc.data_ptr<int64_t>()[r];
    TORCH_CHECK(p >= 0 && p < cc.size(0), "position ", p, " is past the rotary table's ", cc.size(0));
  }
  const int64_t n = xc.size(0), heads = xc.size(1), d = xc.size(2);
  if (x.scalar_type() == torch::kFloat32) {
    qd::rotary_rows(xc.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), pc.data_ptr<int64_t>(), y.data_ptr<float>(), n, heads,
                    d);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
    qd::rotary_rows(bf16(xc), cc.data_ptr<float>(), sc.data_ptr<float>(), pc.data_ptr<int64_t>(), bf16_out(y), n, heads, d);
  }
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  auto y = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  rotary_into(x, cos, sin, positions, y);
  return y;
}
