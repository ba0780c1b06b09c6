// y = x @ w.T (+ b) for a few rows of x against a weight [N, K], on CPUs with AVX512 (BF16, VNNI):
// bfloat16, float32, and int8 weights with int8 rows (W8A8, draft models). Written by hand because
// decoding is one such product per weight matrix per step, and torch's oneDNN path reaches only
// ~15-20 GB/s of this machine's ~32 GB/s for it: these kernels stream each weight row once, with
// every row of x applied to it while it is in cache.
//
// Batch invariance by construction (ARCHITECTURE.md point 11): the output (m, n) is always the
// same sequence of instructions over k (the last step masked, never a scalar tail) followed by the
// same horizontal sum, whatever M is and wherever row m sits in the call, so a row's result never
// depends on the other rows. The 4-row blocks only share loads of w; they never share sums.
#include <torch/extension.h>
#include <immintrin.h>
#include <cstring>

#include "entry.h"
#include "tiles.h"

namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

template <int MB, int NB>
inline void block(const uint16_t* X, const uint16_t* W, const float* B, uint16_t* Y, int64_t K, int64_t N,
                  int64_t m0, int64_t n0) {
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  // the last step loads K % 32 values and zeros (a mask, not a copy): any K, one code path
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (K - k)) - 1);
    __m512bh xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, X + (m0 + j) * K + k);
    for (int i = 0; i < NB; ++i) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, W + (n0 + i) * K + k);
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[j], wv);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]) + (B ? B[n0 + i] : 0.0f);
      Y[(m0 + j) * N + n0 + i] = to_bf16(s);
    }
}

// int8 weights (one scale per output row) times int8 activations (one scale per row of x), for
// draft models: a quarter of float32's bytes, half of bfloat16's, and one vpdpbusd per 64 weights
// (widening int8 weights to float32 in registers instead was measured compute-bound at ~14 GB/s).
// vpdpbusd multiplies unsigned by signed bytes, so x is stored as q + 128 and the 128 * sum(w)
// it adds is taken off at the end.
template <int MB, int NB>
inline void block_w8(const uint8_t* X, const int8_t* W, const float* XS, const float* WS, const int32_t* WSUM,
                     const float* B, uint16_t* Y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512i acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_si512();
  // masked-off lanes load a zero weight, so they add nothing whatever x holds there
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = K - k >= 64 ? ~__mmask64(0) : static_cast<__mmask64>((1ull << (K - k)) - 1);
    __m512i xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = _mm512_maskz_loadu_epi8(m, X + (m0 + j) * K + k);
    for (int i = 0; i < NB; ++i) {
      __m512i wv = _mm512_maskz_loadu_epi8(m, W + (n0 + i) * K + k);
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv[j], wv);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      int32_t dot = _mm512_reduce_add_epi32(acc[i][j]) - 128 * WSUM[n0 + i];
      float s = static_cast<float>(dot) * XS[m0 + j] * WS[n0 + i] + (B ? B[n0 + i] : 0.0f);
      Y[(m0 + j) * N + n0 + i] = to_bf16(s);
    }
}

// float32 x [M, K] times float32 w [N, K], for float32 models (the exact-comparison dtype of the
// losslessness tests). torch's float32 matmul is not batch invariant and how it fails depends on
// the CPU: MKL picks another kernel for rows 13 and up on an Intel Xeon with AMX, and for 1..3
// tail rows on an AMD EPYC. Here every output (m, n) is the same chain of 16-lane FMAs over k
// (the last one masked when K % 16 != 0), then the same horizontal sum, whatever M is and wherever the row
// sits in the call: invariant by construction, on every CPU with AVX512F.
template <int MB, int NB>
inline void block_f32(const float* X, const float* W, const float* B, float* Y, int64_t K, int64_t N, int64_t m0,
                      int64_t n0) {
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = _mm512_maskz_loadu_ps(m, X + (m0 + j) * K + k);
    for (int i = 0; i < NB; ++i) {
      __m512 wv = _mm512_maskz_loadu_ps(m, W + (n0 + i) * K + k);
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_fmadd_ps(xv[j], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) Y[(m0 + j) * N + n0 + i] = _mm512_reduce_add_ps(acc[i][j]) + (B ? B[n0 + i] : 0.0f);
}

// x [M, K] bfloat16 -> q + 128 as bytes, with one symmetric scale per row.
void quantize_rows(const uint16_t* X, int64_t M, int64_t K, uint8_t* Q, float* S) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      uint32_t u = static_cast<uint32_t>(X[m * K + k]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      amax = std::max(amax, std::fabs(f));
    }
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    S[m] = scale;
    for (int64_t k = 0; k < K; ++k) {
      uint32_t u = static_cast<uint32_t>(X[m * K + k]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      Q[m * K + k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(f / scale)) + 128);
    }
  }
}

}  // namespace

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  if (bias.has_value()) b32 = bias->to(torch::kFloat32).contiguous();
  const float* B = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* W = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  over_tiles<4>(N, [&](auto nb, int64_t n0) {
    over_rows<4>(M, [&](auto mb, int64_t m0) { block<decltype(mb)::value, decltype(nb)::value>(X, W, B, Y, K, N, m0, n0); });
  });
  return y;
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  if (bias.has_value()) b32 = bias->to(torch::kFloat32).contiguous();
  const float* B = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  over_tiles<4>(N, [&](auto nb, int64_t n0) {
    over_rows<4>(M, [&](auto mb, int64_t m0) {
      block_f32<decltype(mb)::value, decltype(nb)::value>(X, W, B, Y, K, N, m0, n0);
    });
  });
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
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  if (bias.has_value()) b32 = bias->to(torch::kFloat32).contiguous();
  const float* B = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  const uint8_t* X = xq.data_ptr<uint8_t>();
  const float* XS = xs.data_ptr<float>();
  const int8_t* W = w.data_ptr<int8_t>();
  const float* WS = scale.data_ptr<float>();
  const int32_t* WSUM = wsum.data_ptr<int32_t>();
  auto* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  over_tiles<4>(N, [&](auto nb, int64_t n0) {
    over_rows<4>(M, [&](auto mb, int64_t m0) {
      block_w8<decltype(mb)::value, decltype(nb)::value>(X, W, XS, WS, WSUM, B, Y, K, N, m0, n0);
    });
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "x @ w.T + b in bfloat16");
  m.def("linear_f32", &linear_f32, "x @ w.T + b in float32, batch invariant");
  m.def("linear_blocks", &linear_blocks, "x @ w.T + b: w in a GGUF block format as repacked by models/ggml.py, x quantized per block");
  m.def("linear_blocks_many", &linear_blocks_many, "linear_blocks for several weights of one format against one x, in one pass");
  m.def("amx_active", &amx_active, "whether passes of several rows run on AMX (the CPU has it, Linux grants it, QUICKDRAFT_AMX is not 0)");
  m.def("amx_min_rows", &amx_min_rows, "the rows from which a pass goes to AMX");
  m.def("use_amx", &use_amx, "switch the AMX path on or off; returns the previous setting");
  m.def("vnni_rate", &vnni_rate, "512-bit vpdpbusd a second on one core: the fastest of runs of about a millisecond");
  m.def("attend_chain", &attend_chain, "row j of q attends over keys 0..ctx+j, batch invariant");
  m.def("attend_tree", &attend_tree, "row j of q attends over the context and its own path of new tokens, as a chain would");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, as Hugging Face's");
  m.def("rotary", &rotary, "rotate-half rotary embedding of each row");
  m.def("linear_w8", &linear_w8, "x @ (w * scale).T + b: int8 weights and int8-quantized rows of x");
  m.def("decoder_layer", &decoder_layer, "one decoder layer for chains or token trees of new tokens: the Python path's kernels in one call");
}
