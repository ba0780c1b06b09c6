// RMSNorm and rotary embedding, row by row, in one call each. Written by hand because at one to a
// few rows a decoding step's time outside the matrices is torch's per-op overhead: the decoder's
// torch versions take 5 and 6 small ops (~18 and ~27 us a call on a 2-core EPYC), these a few
// microseconds. Each row's result depends on that row alone, in a fixed order (batch invariant).
#include <torch/extension.h>
#include <cmath>

namespace {

template <typename T>
void rms_rows(const T* X, const T* W, T* Y, int64_t n, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (n > 8)
  for (int64_t r = 0; r < n; ++r) {
    const T* x = X + r * h;
    float lanes[16] = {0};
    for (int64_t i = 0; i < h; ++i) {
      const float v = static_cast<float>(x[i]);
      lanes[i % 16] += v * v;
    }
    float ss = 0.0f;
    for (float l : lanes) ss += l;
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    // as Hugging Face's RMSNorm: normalized in float32, rounded to x's dtype, times the weight
    for (int64_t i = 0; i < h; ++i) {
      const T normed = static_cast<T>(static_cast<float>(x[i]) * inv);
      Y[r * h + i] = static_cast<T>(static_cast<float>(W[i]) * static_cast<float>(normed));
    }
  }
}

// rotate-half rotary: y = x * cos + rotate_half(x) * sin, in float32, rounded to x's dtype
template <typename T>
void rotary_rows(const T* X, const float* C, const float* S, const int64_t* P, T* Y, int64_t n, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float* c = C + P[r] * d;
    const float* s = S + P[r] * d;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = X + (r * heads + h) * d;
      T* y = Y + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
        y[i] = static_cast<T>(a * c[i] - b * s[i]);
        y[i + half] = static_cast<T>(b * c[i + half] + a * s[i + half]);
      }
    }
  }
}

}  // namespace

// x [n, h], weight [h] of x's dtype (float32 or bfloat16) -> y [n, h], contiguous, of x's dtype
// (written in place: forward.cpp's workspace; y may not overlap x)
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x [n, h], weight [h]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight of one dtype");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.sizes() == x.sizes(), "y like x, contiguous");
  auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t n = xc.size(0), h = xc.size(1);
  if (x.scalar_type() == torch::kFloat32) {
    rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), n, h, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
    rms_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), n, h, static_cast<float>(eps));
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
    rotary_rows(xc.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), pc.data_ptr<int64_t>(), y.data_ptr<float>(), n, heads, d);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
    rotary_rows(xc.data_ptr<at::BFloat16>(), cc.data_ptr<float>(), sc.data_ptr<float>(), pc.data_ptr<int64_t>(),
                y.data_ptr<at::BFloat16>(), n, heads, d);
  }
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  auto y = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  rotary_into(x, cos, sin, positions, y);
  return y;
}
