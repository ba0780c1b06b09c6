// y = x @ w.T (+ b) with w in a GGUF block format, repacked at load (models/ggml.py, where the
// layout is written and read back) and x quantized to int8 per block inside the call.
//
// Layout: each weight row is a run of records, one per group of 16 blocks (the last group may
// have fewer, g). A block is L weights (32; 16 for Q6_K, whose scales are per 16) with one scale.
// In a record, lane l of every 64-byte vector belongs to block l of the group: step s holds that
// block's weights 4s..4s+3 (4 bytes a lane, 4g bytes a vector). So one vpdpbusd adds 4 products
// of each of 16 blocks into 16 int32 lanes, and a lane's sum is its block's exact integer dot
// product after L/4 steps. Only then does each lane meet float: one convert and one multiply-add
// by (weight scale x activation scale) per group of 16 blocks, where a per-block float scale
// costs that on every 64 weights. The values are unsigned: 4-bit (two steps a byte: step 2p in
// the low nibble, 2p+1 in the high one), 5- or 6-bit (Q5_0, Q6_K, below) or 8-bit, stored as q + offset; the
// offset is taken off in the integer domain (each lane starts at -offset * its block's sum of x).
// After the values, the record holds the group's scales, as compact as the file's:
//   F16 (Q4_0, Q4_1, Q8_0, Q5_0): a float16 scale a block (Q4_1: and a float16 min);
//   Q4_K: a 6-bit scale and min a block (one byte each), then d and dmin a super-block (float);
//   Q6_K: an int8 scale a block, then d (float) for the group (a group is one super-block).
// Q6_K's 6-bit values take 3 vectors for its 4 steps: the low nibbles of steps 0 and 1, of 2 and
// 3, then the high 2 bits of all four; Q5_0's 5-bit ones 5 for its 8: 4 of nibbles, then the high
// bit of all eight. Bits a weight: Q4_0 4.5, Q4_1 5, Q4_K 4.75, Q5_0 5.5, Q6_K 6.625 (as the file
// but for Q4_K's 4.5 and Q6_K's 6.5625), Q8_0 8.5.
//
// Written by hand because decoding reads every weight once per step: each weight vector is
// loaded and unpacked once and used for every row of the pass (llama.cpp and torch's int4 path
// unpack again every row or every 4 rows).
//
// Batch invariant by construction: a block's integer sum is exact, and for output (m, n) the
// groups are added into 16 float lanes in k order, then summed the same way, whatever the number
// of rows or where (m, n) falls in a tile.
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

#include "tiles.h"

namespace {

// bytes ahead of each weight row's stream to prefetch: one row of a pass reads weights faster than
// the hardware prefetcher alone brings them from memory (one row over the 1.5B's 28 gate
// projections, AMD EPYC, in the previous layout: 14.5 GB/s without, 22 GB/s with 4 KiB ahead)
constexpr int64_t PREFETCH = 4096;

// The formats (the same numbers as models/ggml.py's FORMATS).
enum Kind { Q4_0 = 0, Q4_1 = 1, Q4_K = 2, Q8_0 = 3, Q5_0 = 4, Q6_K = 5 };

template <int KIND>
struct Format {
  static constexpr int L = KIND == Q6_K ? 16 : 32;                     // weights a block
  static constexpr bool NIBBLES = KIND <= Q4_K;                        // 4-bit values
  static constexpr bool SIX = KIND == Q6_K;                            // 6-bit values (see tile)
  static constexpr bool FIVE = KIND == Q5_0;                           // 5-bit values (see tile)
  static constexpr int OFFSET = KIND == Q4_0 ? 8 : KIND == Q8_0 ? 128 : KIND == Q5_0 ? 16 : KIND == Q6_K ? 32 : 0;
  static constexpr bool MIN = KIND == Q4_1 || KIND == Q4_K;            // a float min a block
  static constexpr int VECTORS = NIBBLES ? L / 8 : SIX ? 3 : FIVE ? 5 : L / 4;  // 4g-byte vectors of values
  // bytes of a record of g blocks
  static constexpr int64_t values(int g) { return int64_t(VECTORS) * 4 * g; }
  static constexpr int64_t record(int g) {
    if (KIND == Q4_K) return values(g) + 2 * g + 2 * 4 * (g / 8);
    if (KIND == Q6_K) return values(g) + g + 4;
    return values(g) + 2 * g * (MIN ? 2 : 1);
  }
};

// The 16 lanes' scales (and mins) of a record of g blocks, as floats; lanes >= g are 0.
template <int KIND>
inline void scales(const uint8_t* rec, int g, __mmask16 mask, __m512& ws, __m512& mn) {
  using F = Format<KIND>;
  const uint8_t* s = rec + F::values(g);
  if constexpr (KIND == Q4_K) {
    // lanes 0..7 take super-block 0's d (and dmin), lanes 8..15 super-block 1's
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask8 two = g > 8 ? 3 : 1;
    const float* d = reinterpret_cast<const float*>(s + 2 * g);
    const __m512 dv = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(two, d)));
    const __m512 mv = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(two, d + g / 8)));
    ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, s))), dv);
    mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, s + g))), mv);
  } else if constexpr (KIND == Q6_K) {
    const float d = *reinterpret_cast<const float*>(s + g);
    ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, s))), _mm512_set1_ps(d));
  } else {
    ws = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s));
    if constexpr (F::MIN) mn = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s + 2 * g));
  }
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

// x quantized in the weights' block order: per row, per group, the same vectors as a record's
// values (8-bit, unpacked); and per group 16 lanes of: the block's scale, its starting integer
// sum (-offset * sum(q)) and, for formats with a min, scale * sum(q).
struct Rows {
  const int8_t* q;      // [M, K] (+64 bytes of slack: a tail group's vectors are read whole)
  const float* xs;      // [M, G, 16]
  const int32_t* init;  // [M, G, 16]
  const float* qs;      // [M, G, 16]
  int64_t K, G;
};

inline int lanes(int64_t blocks, int64_t group) { return static_cast<int>(std::min<int64_t>(16, blocks - group * 16)); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// q = round-half-even(x / s), s = amax / 127 per block of L; x [M, K] contiguous, read as it is
template <int KIND, typename T>
void quantize_rows(const T* X, int64_t M, int64_t K, int8_t* Q, float* XS, int32_t* INIT, float* QS, int64_t G) {
  using F = Format<KIND>;
  constexpr int L = F::L;
  const int64_t nb = K / L;
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    std::memset(XS + m * G * 16, 0, G * 16 * sizeof(float));
    std::memset(INIT + m * G * 16, 0, G * 16 * sizeof(int32_t));
    std::memset(QS + m * G * 16, 0, G * 16 * sizeof(float));
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = X + m * K + b * L;
      __m512 v[L / 16];
      __m512 amax = _mm512_setzero_ps();
      for (int h = 0; h < L / 16; ++h) {
        v[h] = load16(xb + 16 * h);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[h]));
      }
      const float a = _mm512_reduce_max_ps(amax);
      const float s = a > 0.0f ? a / 127.0f : 1.0f;
      const __m512 sv = _mm512_set1_ps(s);
      alignas(64) int8_t q[L];
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < L / 16; ++h) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v[h], sv), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
        sum = _mm512_add_epi32(sum, qi);
      }
      const int64_t group = b / 16, lane = b % 16, g = lanes(nb, group);
      int8_t* dst = Q + m * K + group * 16 * L + 4 * lane;
      for (int step = 0; step < L / 4; ++step) std::memcpy(dst + step * 4 * g, q + 4 * step, 4);
      const int32_t total = _mm512_reduce_add_epi32(sum);
      XS[(m * G + group) * 16 + lane] = s;
      INIT[(m * G + group) * 16 + lane] = -F::OFFSET * total;
      QS[(m * G + group) * 16 + lane] = s * static_cast<float>(total);
    }
  }
}

template <int KIND>
void quantize(const torch::Tensor& x, int8_t* Q, float* XS, int32_t* INIT, float* QS, int64_t G) {
  if (x.scalar_type() == torch::kFloat32) {
    quantize_rows<KIND>(x.data_ptr<float>(), x.size(0), x.size(1), Q, XS, INIT, QS, G);
  } else {
    quantize_rows<KIND>(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), Q, XS, INIT, QS, G);
  }
}

// per-thread scratch for x's quantized rows and block figures: a call allocates nothing but its
// output (at one row, five allocations were a good part of a small matrix's ~10 us)
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Weight row n against rows m0 .. m0 + MB - 1 of x. One weight row at a time: tiles of 2 or 4
// interleaved weight rows would share each x vector over more weights, but read memory 2-3x
// slower (see run).
template <int KIND, int MB>
inline void tile(const Rows& x, const uint8_t* W, int64_t row_bytes, const float* B, const Out& y, int64_t N,
                 int64_t m0, int64_t n) {
  using F = Format<KIND>;
  const int64_t K = x.K, G = x.G, nb = K / F::L;
  __m512 f[MB];
  for (int j = 0; j < MB; ++j) f[j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t gi = 0; gi < G; ++gi) {
    const int g = lanes(nb, gi);
    const __mmask16 mask = static_cast<__mmask16>((1u << g) - 1);
    const int64_t stride = 4 * g;  // bytes a vector
    const uint8_t* rec = W + n * row_bytes + gi * F::record(16);
    const int8_t* xq[MB];
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) {
      xq[j] = x.q + (m0 + j) * K + gi * 16 * F::L;
      acc[j] = _mm512_loadu_si512(x.init + ((m0 + j) * G + gi) * 16);
    }
    // the values: each vector loaded (and its nibbles split) once, then used for every row
    if constexpr (F::SIX) {
      // 6-bit values in 3 vectors: steps 0 and 1 as nibbles, then 2 and 3, then the high 2 bits
      // of all 4 steps (step s in bits 2s, 2s + 1 of each byte)
      for (int v = 0; v < 3; ++v) _mm_prefetch(reinterpret_cast<const char*>(rec + v * stride + PREFETCH), _MM_HINT_T0);
      const __m512i n01 = _mm512_maskz_loadu_epi32(mask, rec), n23 = _mm512_maskz_loadu_epi32(mask, rec + stride);
      const __m512i hb = _mm512_maskz_loadu_epi32(mask, rec + 2 * stride), two = _mm512_set1_epi8(0x30);
      const __m512i w6[4] = {
          _mm512_or_si512(_mm512_and_si512(n01, low), _mm512_and_si512(_mm512_slli_epi16(hb, 4), two)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n01, 4), low), _mm512_and_si512(_mm512_slli_epi16(hb, 2), two)),
          _mm512_or_si512(_mm512_and_si512(n23, low), _mm512_and_si512(hb, two)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n23, 4), low), _mm512_and_si512(_mm512_srli_epi16(hb, 2), two))};
      for (int j = 0; j < MB; ++j)
        for (int s = 0; s < 4; ++s) acc[j] = _mm512_dpbusd_epi32(acc[j], w6[s], _mm512_loadu_si512(xq[j] + s * stride));
    }
    if constexpr (F::FIVE) {
      // 5-bit values in 5 vectors: steps 2p and 2p + 1 as nibbles (p = 0..3), then the high bit
      // of all 8 steps (step s in bit s of each byte)
      const __m512i hb = _mm512_maskz_loadu_epi32(mask, rec + 4 * stride), bit = _mm512_set1_epi8(0x10);
      _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * stride + PREFETCH), _MM_HINT_T0);
      const __m512i high[8] = {_mm512_slli_epi16(hb, 4), _mm512_slli_epi16(hb, 3), _mm512_slli_epi16(hb, 2),
                               _mm512_slli_epi16(hb, 1), hb, _mm512_srli_epi16(hb, 1), _mm512_srli_epi16(hb, 2),
                               _mm512_srli_epi16(hb, 3)};
      for (int p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(rec + p * stride + PREFETCH), _MM_HINT_T0);
        const __m512i packed = _mm512_maskz_loadu_epi32(mask, rec + p * stride);
        const __m512i w0 = _mm512_or_si512(_mm512_and_si512(packed, low), _mm512_and_si512(high[2 * p], bit));
        const __m512i w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low),
                                           _mm512_and_si512(high[2 * p + 1], bit));
        for (int j = 0; j < MB; ++j) {
          acc[j] = _mm512_dpbusd_epi32(acc[j], w0, _mm512_loadu_si512(xq[j] + 2 * p * stride));
          acc[j] = _mm512_dpbusd_epi32(acc[j], w1, _mm512_loadu_si512(xq[j] + (2 * p + 1) * stride));
        }
      }
    }
    for (int v = 0; v < (F::SIX || F::FIVE ? 0 : F::VECTORS); ++v) {
      const uint8_t* at = rec + v * stride;
      _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH), _MM_HINT_T0);
      const __m512i packed = _mm512_maskz_loadu_epi32(mask, at);
      if constexpr (F::NIBBLES) {  // steps 2v and 2v + 1
        const __m512i w0 = _mm512_and_si512(packed, low), w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        for (int j = 0; j < MB; ++j)
          acc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[j], w0, _mm512_loadu_si512(xq[j] + 2 * v * stride)), w1,
                                       _mm512_loadu_si512(xq[j] + (2 * v + 1) * stride));
      } else {
        for (int j = 0; j < MB; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], packed, _mm512_loadu_si512(xq[j] + v * stride));
      }
    }
    // each lane's exact block sum meets float once: f += sum * (w scale * x scale) (- min * x scale * sum(q))
    __m512 ws, mn;
    _mm_prefetch(reinterpret_cast<const char*>(rec + F::values(g) + PREFETCH), _MM_HINT_T0);
    scales<KIND>(rec, g, mask, ws, mn);
    for (int j = 0; j < MB; ++j) {
      const __m512 xs = _mm512_loadu_ps(x.xs + ((m0 + j) * G + gi) * 16);
      f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), _mm512_mul_ps(ws, xs), f[j]);
      if constexpr (F::MIN) f[j] = _mm512_fnmadd_ps(mn, _mm512_loadu_ps(x.qs + ((m0 + j) * G + gi) * 16), f[j]);
    }
  }
  for (int j = 0; j < MB; ++j) y.store((m0 + j) * N + n, _mm512_reduce_add_ps(f[j]) + (B ? B[n] : 0.0f));
}

template <int KIND>
std::vector<torch::Tensor> run(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, int64_t K,
                               const std::vector<c10::optional<torch::Tensor>>& biases) {
  using F = Format<KIND>;
  constexpr int MAX_WEIGHTS = 4;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % F::L == 0, "x [M, K] with K a multiple of the block");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous(), "x contiguous");
  TORCH_CHECK(!ws.empty() && ws.size() <= MAX_WEIGHTS && biases.size() == ws.size(), "1 to 4 weights, a bias (or None) each");
  const int64_t M = x.size(0), nb = K / F::L, G = (nb + 15) / 16;
  const int64_t row_bytes = (G - 1) * F::record(16) + F::record(lanes(nb, G - 1));
  const int count = static_cast<int>(ws.size());
  const uint8_t* W[MAX_WEIGHTS];
  const float* B[MAX_WEIGHTS];
  int64_t first[MAX_WEIGHTS + 1] = {0};  // weight i's rows are first[i] .. first[i + 1] - 1 of the loop
  std::vector<torch::Tensor> outs, b32(count);
  std::vector<Out> ys;
  for (int i = 0; i < count; ++i) {
    const torch::Tensor& w = ws[i];
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 records [N, bytes]");
    TORCH_CHECK(w.size(1) == row_bytes, "w: ", w.size(1), " bytes a row, the layout needs ", row_bytes);
    W[i] = w.data_ptr<uint8_t>();
    B[i] = nullptr;
    if (biases[i].has_value()) {
      b32[i] = biases[i]->to(torch::kFloat32).contiguous();
      TORCH_CHECK(b32[i].numel() == w.size(0), "a bias of ", w.size(0), " values");
      B[i] = b32[i].data_ptr<float>();
    }
    first[i + 1] = first[i] + w.size(0);
    outs.push_back(torch::empty({M, w.size(0)}, x.options()));
    ys.push_back(Out{outs.back().data_ptr(), x.scalar_type() == torch::kFloat32});
  }
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> xsbuf, qsbuf;
  thread_local std::vector<int32_t> initbuf;
  int8_t* q = scratch(qbuf, M * K + 64);
  float* xs = scratch(xsbuf, M * G * 16);
  int32_t* init = scratch(initbuf, M * G * 16);
  float* qs = scratch(qsbuf, M * G * 16);
  quantize<KIND>(x, q, xs, init, qs, G);
  const Rows rows{q, xs, init, qs, K, G};
  auto block = [&](auto mb, int64_t m0, int64_t n) {
    int i = 0;
    while (n >= first[i + 1]) ++i;
    tile<KIND, decltype(mb)::value>(rows, W[i], row_bytes, B[i], ys[i], first[i + 1] - first[i], m0, n - first[i]);
  };
  // One weight row at a time, a purely sequential stream, over blocks of 8 rows of x and one of the
  // rest. Tiles of 2 or 4 interleaved weight rows would share each x vector over more weights, but
  // read memory 2-3x slower (the 1.5B's Q4_K gate projection, one row of x, one thread, AMD EPYC:
  // 9 GB/s with 4-row tiles against 26 with one row; 2-row tiles measured again: 1.4-1.9x slower
  // for 1 to 3 rows of x, 0.9x at 8).
  over_tiles<1>(first[count], [&](auto, int64_t n) { over_rows_whole<8>(M, [&](auto mb, int64_t m0) { block(mb, m0, n); }); });
  return outs;
}

template <typename Run>
auto by_kind(int64_t kind, Run run) {
  switch (kind) {
    case Q4_0: return run(std::integral_constant<int, Q4_0>());
    case Q4_1: return run(std::integral_constant<int, Q4_1>());
    case Q4_K: return run(std::integral_constant<int, Q4_K>());
    case Q8_0: return run(std::integral_constant<int, Q8_0>());
    case Q5_0: return run(std::integral_constant<int, Q5_0>());
    case Q6_K: return run(std::integral_constant<int, Q6_K>());
    default: break;
  }
  TORCH_CHECK(false, "unknown block format ", kind);
  return run(std::integral_constant<int, Q4_0>());  // not reached
}

}  // namespace

// x [M, K] float32 or bfloat16, w [N, bytes] uint8 in ``kind``'s layout -> [M, N] in x's dtype
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t K, c10::optional<torch::Tensor> bias) {
  return by_kind(kind, [&](auto k) { return run<decltype(k)::value>(x, {w}, K, {bias})[0]; });
}

// the same for up to 4 weights of one format against the same x -> one output each
std::vector<torch::Tensor> linear_blocks_many(torch::Tensor x, std::vector<torch::Tensor> ws, int64_t kind, int64_t K,
                                              std::vector<c10::optional<torch::Tensor>> biases) {
  return by_kind(kind, [&](auto k) { return run<decltype(k)::value>(x, ws, K, biases); });
}
