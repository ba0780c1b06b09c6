// linear.h's products bound to torch tensors, and the module's Python entry points.
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

std::string isa() { return simd::ISA; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set this module was built for (simd.h)");
  m.def("linear_bf16", &linear_bf16, "x @ w.T + b in bfloat16");
  m.def("linear_f32", &linear_f32, "x @ w.T + b in float32, batch invariant");
  m.def("linear_blocks", &linear_blocks, "x @ w.T + b: w in a GGUF block format as repacked by models/ggml.py, x quantized per block");
  m.def("linear_blocks_many", &linear_blocks_many, "linear_blocks for several weights of one format against one x, in one pass");
  m.def("amx_active", &amx_active, "whether passes of several rows run on AMX (the CPU has it, Linux grants it, QUICKDRAFT_AMX is not 0)");
  m.def("amx_min_rows", &amx_min_rows, "the rows from which a pass goes to AMX");
  m.def("use_amx", &use_amx, "switch the AMX path on or off; returns the previous setting");
  m.def("vnni_rate", &vnni_rate, "64-byte integer dots a second on one core: the fastest of runs of about a millisecond");
  m.def("attend_chain", &attend_chain, "row j of q attends over keys 0..ctx+j (the last `window` of them, where window > 0), batch invariant",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("ctx"), py::arg("scale"), py::arg("window") = 0);
  m.def("attend_tree", &attend_tree, "row j of q attends over the context and its own path of new tokens, as a chain would",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("ctx"), py::arg("start"), py::arg("path"), py::arg("scale"),
        py::arg("window") = 0);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, as Hugging Face's");
  m.def("rotary", &rotary, "rotate-half rotary embedding of each row");
  m.def("argmax_finite", &argmax_finite, "each row's argmax (the lowest index on ties, the first NaN) and whether it is finite, in one read");
  m.def("softmax_rows", &softmax_rows, "softmax(logits / t) of each row at its temperature (0: one-hot at the argmax), then its top-k, top-p and min-p where given",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k") = py::none(), py::arg("top_p") = py::none(),
        py::arg("min_p") = py::none());
  m.def("verify_chains", &verify_chains, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "speculative sampling's rule on draft chains: each sequence's accepted drafts and final token",
        py::arg("logits"), py::arg("q"), py::arg("drafts"), py::arg("num_draft"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("uniforms"), py::arg("q_columns") = py::none());
  m.def("sample_probs", &sample_probs, "a row drawn from each row of probs with its uniform: the first whose cumulative mass passes u x total");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, each step rounded to the dtype as torch rounds it");
  m.def("act_mul", &act_mul, "act(gate) * up, act 0 SiLU or 1 GELU-tanh, each step rounded to the dtype");
  m.def("linear_w8", &linear_w8, "x @ (w * scale).T + b: int8 weights and int8-quantized rows of x");
  m.def("decoder_layer", &decoder_layer, "one decoder layer for chains or token trees of new tokens: the Python path's kernels in one call");
  register_forward(m);  // forward.cpp: the whole decoder in one call
}
