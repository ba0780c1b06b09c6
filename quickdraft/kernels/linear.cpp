// linear.h's products bound to torch tensors (bindings.cpp registers them with Python).
#include <torch/extension.h>

#include "entry.h"
#include "linear.h"

namespace {

// the bias as float32 (or null), kept alive by `keep`
const float* bias_f32(const c10::optional<torch::Tensor>& bias, torch::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  keep = bias->to(torch::kFloat32).contiguous();
  return keep.data_ptr<float>();
}

}  // namespace

// y [M, N] contiguous, of x's dtype: written in place (forward.cpp's workspace); the entry points
// below allocate it
void linear_bf16_into(const torch::Tensor& x0, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, const torch::Tensor& y) {
  TORCH_CHECK(x0.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x0.dim() == 2 && w.dim() == 2 && x0.size(1) == w.size(1), "x [M, K] and w [N, K]");
  const torch::Tensor x = x0.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.size(0) == M && y.size(1) == N,
              "y [M, N] contiguous, of x's dtype");
  torch::Tensor b32;
  qd::linear_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                  bias_f32(bias, b32), reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N);
}

void linear_f32_into(const torch::Tensor& x0, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, const torch::Tensor& y) {
  TORCH_CHECK(x0.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x0.dim() == 2 && w.dim() == 2 && x0.size(1) == w.size(1), "x [M, K] and w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const torch::Tensor x = x0.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.size(0) == M && y.size(1) == N,
              "y [M, N] contiguous, of x's dtype");
  torch::Tensor b32;
  qd::linear_f32(x.data_ptr<float>(), w.data_ptr<float>(), bias_f32(bias, b32), y.data_ptr<float>(), M, K, N);
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [M, K] and w [N, K]");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_bf16_into(x, w, bias, y);
  return y;
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [M, K] and w [N, K]");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_f32_into(x, w, bias, y);
  return y;
}

torch::Tensor linear_w8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor wsum,
                        c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kInt8 && scale.dtype() == torch::kFloat32 &&
                  wsum.dtype() == torch::kInt32, "x bfloat16, w int8, scale float32, wsum int32");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && wsum.is_contiguous(), "contiguous weights");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kUInt8));
  auto xs = torch::empty({M}, x.options().dtype(torch::kFloat32));
  qd::quantize_rows_w8(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  qd::linear_w8(xq.data_ptr<uint8_t>(), xs.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                wsum.data_ptr<int32_t>(), bias_f32(bias, b32), reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N);
  return y;
}
