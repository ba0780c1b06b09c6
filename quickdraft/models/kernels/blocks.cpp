// y = x @ w.T (+ b) with w in a GGUF block format, repacked at load (models/ggml.py) into one of
// two layouts, and x quantized to int8 in blocks of 32 (one scale per block, as ggml's Q8_0):
//
//   u4: 4-bit unsigned values, two per byte, one float scale and one float min per 32 weights:
//       w = scale * q - min. Holds Q4_0, Q4_1 and Q4_K exactly (the K-quant's 6-bit sub-block
//       scales are multiplied out at load, as ggml's own dequantization does).
//       Each 64-weight chunk is 32 bytes: byte j = w[j] | w[j + 32] << 4.
//   i8: int8 values, one float scale per 16 weights: w = scale * q. Holds Q8_0, Q6_K and Q5_0.
//
// Written by hand because decoding reads every weight once per step: each weight tile is
// unpacked once (nibbles split, scales broadcast) and used for every row of the pass, so 8 rows
// cost little more than one (llama.cpp and torch's int4 path unpack again every row or 4 rows).
//
// Batch invariant by construction: a 32-block's integer dot product is exact (vpdpbusd), and the
// blocks are combined into 16 float lanes in k order, then summed the same way, for every row
// count: the result of (m, n) never depends on the other rows.
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

#include "tiles.h"

namespace {

// bytes ahead of each weight row's stream to prefetch: one row of a pass reads weights faster than
// the hardware prefetcher alone brings them from memory (one row over the 1.5B's 28 gate
// projections, AMD EPYC: 14.5 GB/s without, 22 GB/s with 4 KiB ahead, of ~45 GB/s)
constexpr int64_t PREFETCH = 4096;

// x [M, K] (float32 or bfloat16) -> int8 q [M, K], per 64-chunk the two block scales spread over
// 16 lanes as the kernels use them [M, K/64, 16], and per block the float xs * sum(q) (for the u4
// layout's min term) [M, K/32]. q = round-half-even(x / s) with s = amax / 127, per block of 32.
// ``odd``: the factor on the second block's spread scale (1/16 for u4, whose high nibbles are
// multiplied unshifted, i.e. by 16; a power of two, so the product is exact).
void quantize_blocks(const torch::Tensor& x, int8_t* Q, float* XH, float* QS, float odd) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  auto xf = x.to(torch::kFloat32).contiguous();
  const float* X = xf.data_ptr<float>();
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = X + m * K + b * 32;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      const __m512 sv = _mm512_set1_ps(s);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(lo, sv), _MM_FROUND_TO_NEAREST_INT));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(hi, sv), _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(Q + m * K + b * 32), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(Q + m * K + b * 32 + 16), _mm512_cvtepi32_epi8(qhi));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      float* h = XH + (m * nb + b) * 8;  // [m][chunk b / 2][lanes 8 * (b % 2) ..]
      const float spread = b % 2 ? s * odd : s;
      for (int t = 0; t < 8; ++t) h[t] = spread;
      QS[m * nb + b] = s * static_cast<float>(sum);
    }
  }
}

// two floats, each over 8 lanes: the scales of the two 32-blocks of a 64-weight chunk (one load,
// one permute)
inline __m512 halves(const float* s) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s)));
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(pair));
}

// four floats, each over 4 lanes: the scales of the four 16-blocks of a 64-weight chunk
inline __m512 quarters(const float* s) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(s)));
}

struct Out {  // y [M, N], float32 or bfloat16 (x's dtype)
  void* data;
  bool f32;
  void store(int64_t idx, float v) const {
    if (f32) {
      static_cast<float*>(data)[idx] = v;
    } else {
      static_cast<at::BFloat16*>(data)[idx] = at::BFloat16(v);
    }
  }
};

struct Rows {
  const int8_t* q;  // [M, K]
  const float* xh;  // [M, K/64, 16]: each chunk's two block scales, 8 lanes each
  const float* qs;  // [M, K/32]
  int64_t K;
};

template <int MB, int NB>
inline void block_u4(const Rows& x, const uint8_t* W, const float* WS, const float* WM, const float* B,
                     const Out& y, int64_t N, int64_t m0, int64_t n0) {
  const int64_t K = x.K, nb = K / 32;
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi8(static_cast<char>(0xf0));
  // per chunk: unpack the NB weight tiles once (nibbles split, scales spread), then every row
  for (int64_t c = 0; c < K / 64; ++c) {
    __m512i w[NB];
    __m512 ws[NB];
    for (int i = 0; i < NB; ++i) {
      const int64_t n = n0 + i;
      const uint8_t* at = W + n * (K / 2) + c * 32;
      _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH), _MM_HINT_T0);
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      // the high nibbles stay in place, worth 16x: x's spread scale for them carries the 1/16
      w[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low)),
                                _mm256_and_si256(packed, high), 1);
      ws[i] = halves(WS + n * nb + c * 2);
    }
    for (int j = 0; j < MB; ++j) {
      const __m512i xv = _mm512_loadu_si512(x.q + (m0 + j) * K + c * 64);
      const __m512 xs = _mm512_loadu_ps(x.xh + (m0 + j) * K / 4 + c * 16);
      for (int i = 0; i < NB; ++i) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], xv);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[i], xs), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NB; ++i) {
    const int64_t n = n0 + i;
    for (int j = 0; j < MB; ++j) {
      // the min term, sum over blocks of min * xs * sum(q), in the same 16-lane order
      __m512 mins = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (nb - b)) - 1);
        mins = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, WM + n * nb + b),
                               _mm512_maskz_loadu_ps(k, x.qs + (m0 + j) * nb + b), mins);
      }
      y.store((m0 + j) * N + n, _mm512_reduce_add_ps(acc[i][j]) - _mm512_reduce_add_ps(mins) + (B ? B[n] : 0.0f));
    }
  }
}

template <int MB, int NB>
inline void block_i8(const Rows& x, const int8_t* W, const float* WS, const float* B, const Out& y,
                     int64_t N, int64_t m0, int64_t n0) {
  const int64_t K = x.K, nb = K / 32;
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  // vpdpbusd multiplies unsigned by signed bytes: x goes in as q + 128, and each lane starts from
  // -128 * (the sum of its four weights), computed once per weight tile
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < K / 64; ++c) {
    __m512i w[NB], start[NB];
    __m512 ws[NB];
    for (int i = 0; i < NB; ++i) {
      const int64_t n = n0 + i;
      _mm_prefetch(reinterpret_cast<const char*>(W + n * K + c * 64 + PREFETCH), _MM_HINT_T0);
      w[i] = _mm512_loadu_si512(W + n * K + c * 64);
      start[i] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, w[i]));
      ws[i] = quarters(WS + n * (K / 16) + c * 4);
    }
    for (int j = 0; j < MB; ++j) {
      const __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(x.q + (m0 + j) * K + c * 64), flip);
      const __m512 xs = _mm512_loadu_ps(x.xh + (m0 + j) * K / 4 + c * 16);
      for (int i = 0; i < NB; ++i) {
        const __m512i d = _mm512_dpbusd_epi32(start[i], xv, w[i]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[i], xs), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j)
      y.store((m0 + j) * N + n0 + i, _mm512_reduce_add_ps(acc[i][j]) + (B ? B[n0 + i] : 0.0f));
}

// 8 rows of x at a time share one unpacking of a 2-row weight tile; fewer rows take 4-row tiles
template <typename Tile>
void dispatch(int64_t M, int64_t N, Tile tile) {
  if (M >= 8) {
    over_tiles<2>(N, tile);
  } else {
    over_tiles<4>(N, tile);
  }
}

// What both block linears set up for a call: x quantized (``odd``: see quantize_blocks), the output
// in x's dtype, the bias in float32. The tensors own the memory the pointers read.
struct Pass {
  torch::Tensor q, xh, qs, out, b32;
  Rows rows;
  Out y;
  const float* B;
  int64_t M;
};

Pass begin(const torch::Tensor& x, int64_t K, int64_t N, float odd, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % 64 == 0, "x [M, K] with K a multiple of 64");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
  Pass p;
  p.M = x.size(0);
  p.q = torch::empty({p.M, K}, x.options().dtype(torch::kInt8));
  p.xh = torch::empty({p.M, K / 4}, x.options().dtype(torch::kFloat32));
  p.qs = torch::empty({p.M, K / 32}, x.options().dtype(torch::kFloat32));
  quantize_blocks(x, p.q.data_ptr<int8_t>(), p.xh.data_ptr<float>(), p.qs.data_ptr<float>(), odd);
  p.out = torch::empty({p.M, N}, x.options());
  p.rows = Rows{p.q.data_ptr<int8_t>(), p.xh.data_ptr<float>(), p.qs.data_ptr<float>(), K};
  p.y = Out{p.out.data_ptr(), x.scalar_type() == torch::kFloat32};
  p.B = nullptr;
  if (bias.has_value()) {
    p.b32 = bias->to(torch::kFloat32).contiguous();
    p.B = p.b32.data_ptr<float>();
  }
  return p;
}

// block(mb, nb, m0, n0) over every row block and weight tile of the pass
template <typename Block>
void run(const Pass& p, int64_t N, Block block) {
  dispatch(p.M, N, [&](auto nb, int64_t n0) { over_rows<8>(p.M, [&](auto mb, int64_t m0) { block(mb, nb, m0, n0); }); });
}

}  // namespace

torch::Tensor linear_u4(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor min,
                        c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && scale.scalar_type() == torch::kFloat32 &&
                  min.scalar_type() == torch::kFloat32, "w uint8, scale and min float32");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && min.is_contiguous(), "contiguous weights");
  const int64_t N = w.size(0), K = w.size(1) * 2;
  const Pass p = begin(x, K, N, 1.0f / 16, bias);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* WS = scale.data_ptr<float>();
  const float* WM = min.data_ptr<float>();
  run(p, N, [&](auto mb, auto nb, int64_t m0, int64_t n0) {
    block_u4<decltype(mb)::value, decltype(nb)::value>(p.rows, W, WS, WM, p.B, p.y, N, m0, n0);
  });
  return p.out;
}

torch::Tensor linear_i8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && scale.scalar_type() == torch::kFloat32, "w int8, scale float32");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "contiguous weights");
  const int64_t N = w.size(0), K = w.size(1);
  const Pass p = begin(x, K, N, 1.0f, bias);
  const int8_t* W = w.data_ptr<int8_t>();
  const float* WS = scale.data_ptr<float>();
  run(p, N, [&](auto mb, auto nb, int64_t m0, int64_t n0) {
    block_i8<decltype(mb)::value, decltype(nb)::value>(p.rows, W, WS, p.B, p.y, N, m0, n0);
  });
  return p.out;
}
