// y = x @ w.T (+ b) with w in a GGUF block format, repacked at load (models/ggml.py, where the
// layout is written and read back) and x quantized to int8 per block inside the call.
//
// Layout: the weight rows go in tiles of 16 (the last one padded with zero rows); lane l of
// every 64-byte vector of a tile belongs to its row l. A block is L weights (32; 16 for Q6_K,
// whose scales are per 16) with one scale; a tile is its blocks in k order, each block its
// values, then its 16 rows' scales. Step s of a block is its weights 4s..4s+3, 4 bytes a lane:
// one vpdpbusd multiplies a step of 16 rows by the same 4 bytes of x, broadcast, into 16 int32
// lanes, and a lane's sum is its row's exact integer dot product with the block after L/4 steps.
// Only then does each lane meet float: one convert and one multiply-add by (weight scale x
// activation scale), stored at the end as 16 outputs without any horizontal sum. The values are
// unsigned: 4-bit (step s in the low nibble, s + L/8 in the high one: ggml's own Q4_0 order),
// 5- or 6-bit (the same nibbles, then one vector of every step's high bits: step s's at bits
// s (Q5_0) or 2s, 2s + 1 (Q6_K) of each byte) or 8-bit, stored as q + offset; the offset is
// taken off in the integer domain (each lane starts at -offset * the block's sum of x).
// The scales stay as compact as the file's:
//   F16 (Q4_0, Q4_1, Q8_0, Q5_0): a float16 scale a block (Q4_1: and a float16 min), per lane;
//   Q4_K: a 6-bit scale and min a block (a byte each), after 16 float16 d and 16 dmin before
//   each super-block of 8 blocks;
//   Q6_K: an int8 scale a block, after 16 float16 d before each super-block of 16 blocks.
// Bits a weight: Q4_0 4.5, Q4_1 5, Q4_K 4.625 (the file: 4.5), Q5_0 5.5, Q6_K 6.5625, Q8_0 8.5.
//
// Written by hand because decoding reads every weight once per step: each weight vector is
// loaded and unpacked once and used for every row of the pass (llama.cpp and torch's int4 path
// unpack again every row or every 4 rows), and x comes as 4 bytes broadcast into the
// instruction, so a row of the pass costs one narrow load a vpdpbusd. (The layout before this
// one put 16 blocks of one row in the lanes: x then had to be loaded 64 bytes a vpdpbusd, and
// those loads, not the arithmetic, bound a pass of several rows: README, "What bounds a pass".)
//
// Batch invariant by construction: a block's integer sum is exact, and output (m, n) is one
// float lane that adds its blocks in k order, whatever the number of rows or where (m, n) falls.
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "tiles.h"

namespace {

// bytes ahead of a tile's stream to prefetch into L1: one row of a pass reads weights faster than
// the hardware prefetcher alone brings them from memory
constexpr int64_t PREFETCH = 4096;
// and, for a pass of several rows, further ahead into L2. Such a pass computes long enough a tile
// that the L1 prefetches alone keep too few lines in flight, and memory and arithmetic then take
// turns instead of overlapping; the L2's own queue holds more. Measured interleaved on the 1.5B's
// Q4_K ffn_gate (8960x1536) streamed from memory (AMD EPYC, 2 threads): 5 rows 0.43 -> 0.33 ms,
// 3 rows 0.29 -> 0.24, 8 rows 0.56 -> 0.50; one row slower with it (0.22 -> 0.25), so not there.
constexpr int64_t PREFETCH_L2 = 16384;
constexpr int LANES = 16;  // weight rows a tile

// The formats (the same numbers as models/ggml.py's FORMATS).
enum Kind { Q4_0 = 0, Q4_1 = 1, Q4_K = 2, Q8_0 = 3, Q5_0 = 4, Q6_K = 5 };

template <int KIND>
struct Format {
  static constexpr int L = KIND == Q6_K ? 16 : 32;  // weights a block
  static constexpr int STEPS = L / 4;               // 4-weight steps a block
  static constexpr int BITS = KIND <= Q4_K ? 4 : KIND == Q8_0 ? 8 : KIND == Q5_0 ? 5 : 6;
  static constexpr int OFFSET = KIND == Q4_0 ? 8 : KIND == Q8_0 ? 128 : KIND == Q5_0 ? 16 : KIND == Q6_K ? 32 : 0;
  static constexpr bool MIN = KIND == Q4_1 || KIND == Q4_K;  // a float min a block
  static constexpr int SUPER = KIND == Q4_K ? 8 : KIND == Q6_K ? 16 : 0;  // blocks a super-block
  static constexpr int VECTORS = BITS == 8 ? STEPS : STEPS / 2 + (BITS > 4);  // 64-byte vectors of values
  static constexpr int64_t FIELDS = KIND == Q4_K ? 2 : KIND == Q6_K ? 1 : MIN ? 4 : 2;  // bytes a lane after a block's values
  static constexpr int64_t BLOCK_BYTES = VECTORS * 64 + LANES * FIELDS;
  static constexpr int64_t SUPER_BYTES = KIND == Q4_K ? 64 : KIND == Q6_K ? 32 : 0;
  static constexpr int64_t tile_bytes(int64_t blocks) { return blocks * BLOCK_BYTES + (SUPER ? blocks / SUPER * SUPER_BYTES : 0); }
};

struct Out {  // y [M, N], float32 or bfloat16 (x's dtype)
  void* data;
  bool f32;
  void store16(int64_t idx, __m512 v) const {
    if (f32) {
      _mm512_storeu_ps(static_cast<float*>(data) + idx, v);
    } else {
      alignas(64) float t[16];
      _mm512_store_ps(t, v);
      at::BFloat16* p = static_cast<at::BFloat16*>(data) + idx;
      for (int i = 0; i < 16; ++i) p[i] = at::BFloat16(t[i]);
    }
  }
};

// x quantized per block: the int8 values in x's own order, and per block: its scale, its starting
// integer sum (-offset * sum(q)) and, for formats with a min, scale * sum(q)
struct Rows {
  const int8_t* q;      // [M, K]
  const float* xs;      // [M, blocks]
  const int32_t* init;  // [M, blocks]
  const float* qs;      // [M, blocks]
  int64_t K, blocks;
  bool far;  // prefetch PREFETCH_L2 ahead too (a pass of several rows)
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// q = round-half-even(x / s), s = amax / 127 per block of L; x [M, K] contiguous, read as it is
template <int KIND, typename T>
void quantize_rows(const T* X, int64_t M, int64_t K, int8_t* Q, float* XS, int32_t* INIT, float* QS) {
  using F = Format<KIND>;
  constexpr int L = F::L;
  const int64_t nb = K / L;
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
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
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < L / 16; ++h) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v[h], sv), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(Q + m * K + b * L + 16 * h), _mm512_cvtepi32_epi8(qi));
        sum = _mm512_add_epi32(sum, qi);
      }
      const int32_t total = _mm512_reduce_add_epi32(sum);
      XS[m * nb + b] = s;
      INIT[m * nb + b] = -F::OFFSET * total;
      QS[m * nb + b] = s * static_cast<float>(total);
    }
  }
}

template <int KIND>
void quantize(const torch::Tensor& x, int8_t* Q, float* XS, int32_t* INIT, float* QS) {
  if (x.scalar_type() == torch::kFloat32) {
    quantize_rows<KIND>(x.data_ptr<float>(), x.size(0), x.size(1), Q, XS, INIT, QS);
  } else {
    quantize_rows<KIND>(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), Q, XS, INIT, QS);
  }
}

// per-thread scratch for x's quantized rows and block figures: a call allocates nothing but its
// output (at one row, five allocations were a good part of a small matrix's ~10 us)
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// acc += w (unsigned bytes) . x (signed bytes), x's 4 bytes at p broadcast inside the instruction
// ({1to16}). GCC 12 does not fold _mm512_set1_epi32(*p) into vpdpbusd: a separate vpbroadcastd a
// vpdpbusd took a vector slot (L3-resident Q4_K 8960x1536, 16 rows: 0.95 -> 0.90 ms, the same bits)
inline __m512i dot_broadcast(__m512i acc, __m512i w, const int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
  return acc;
}

inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The tile of 16 weight rows at T against rows m0 .. m0 + MB - 1 of x -> y[m0.., n0 .. n0 + 15].
template <int KIND, int MB>
inline void tile(const Rows& x, const uint8_t* T, const float* bias, const Out& y, int64_t N, int64_t m0, int64_t n0) {
  using F = Format<KIND>;
  const int64_t K = x.K, nb = x.blocks;
  __m512 f[MB];
  for (int j = 0; j < MB; ++j) f[j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  const int32_t* xq[MB];  // each row's x, 4 bytes (one step) an element
  for (int j = 0; j < MB; ++j) xq[j] = reinterpret_cast<const int32_t*>(x.q + (m0 + j) * K);
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  const uint8_t* p = T;
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (F::SUPER > 0) {
      if (b % F::SUPER == 0) {
        d = half16(p);
        if constexpr (F::MIN) dmin = half16(p + 32);
        p += F::SUPER_BYTES;
      }
    }
    for (int64_t o = 0; o < F::BLOCK_BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + o), _MM_HINT_T0);
    if (x.far) {
      for (int64_t o = 0; o < F::BLOCK_BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_L2 + o), _MM_HINT_T1);
    }
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = F::OFFSET ? _mm512_set1_epi32(x.init[(m0 + j) * nb + b]) : _mm512_setzero_si512();
    const int64_t s0 = b * F::STEPS;  // the block's first step in x
    constexpr int HALF = F::STEPS / 2;
    if constexpr (F::BITS == 8) {
      for (int s = 0; s < F::STEPS; ++s) {
        const __m512i w = _mm512_loadu_si512(p + 64 * s);
        for (int j = 0; j < MB; ++j) acc[j] = dot_broadcast(acc[j], w, xq[j] + s0 + s);
      }
    } else {
      // the high bits of every step (5- and 6-bit): step s's at bits WIDTH * s of each byte
      constexpr int WIDTH = F::BITS - 4;
      const __m512i hb = F::BITS > 4 ? _mm512_loadu_si512(p + 64 * HALF) : _mm512_setzero_si512();
      const __m512i top = _mm512_set1_epi8(static_cast<char>(((1 << WIDTH) - 1) << 4));
      auto high = [&](int s) {  // step s's high bits at bits 4.. of each byte (16-bit shifts: each byte's bits stay its own after the mask)
        const int shift = 4 - WIDTH * s;
        const __m512i v = shift >= 0 ? _mm512_slli_epi16(hb, shift) : _mm512_srli_epi16(hb, -shift);
        return _mm512_and_si512(v, top);
      };
      for (int v = 0; v < HALF; ++v) {
        const __m512i packed = _mm512_loadu_si512(p + 64 * v);
        __m512i w0 = _mm512_and_si512(packed, low), w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        if constexpr (F::BITS > 4) {
          w0 = _mm512_or_si512(w0, high(v));
          w1 = _mm512_or_si512(w1, high(v + HALF));
        }
        for (int j = 0; j < MB; ++j) {
          acc[j] = dot_broadcast(acc[j], w0, xq[j] + s0 + v);
          acc[j] = dot_broadcast(acc[j], w1, xq[j] + s0 + v + HALF);
        }
      }
    }
    // each lane's exact block sum meets float once: f += sum * (w scale * x scale) (- min * x scale * sum(q))
    const uint8_t* sp = p + F::VECTORS * 64;
    __m512 ws, mn = _mm512_setzero_ps();
    if constexpr (KIND == Q4_K) {
      ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)))), d);
      mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)))), dmin);
    } else if constexpr (KIND == Q6_K) {
      ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)))), d);
    } else {
      ws = half16(sp);
      if constexpr (F::MIN) mn = half16(sp + 32);
    }
    for (int j = 0; j < MB; ++j) {
      const int64_t at = (m0 + j) * nb + b;
      f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), _mm512_mul_ps(ws, _mm512_set1_ps(x.xs[at])), f[j]);
      if constexpr (F::MIN) f[j] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(x.qs[at]), f[j]);
    }
    p += F::BLOCK_BYTES;
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int j = 0; j < MB; ++j) y.store16((m0 + j) * N + n0, _mm512_add_ps(f[j], bv));
}

template <int KIND>
std::vector<torch::Tensor> run(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, int64_t K,
                               const std::vector<c10::optional<torch::Tensor>>& biases) {
  using F = Format<KIND>;
  constexpr int MAX_WEIGHTS = 4;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % F::L == 0, "x [M, K] with K a multiple of the block");
  TORCH_CHECK(!F::SUPER || K % (F::L * F::SUPER) == 0, "K a multiple of the super-block");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous(), "x contiguous");
  TORCH_CHECK(!ws.empty() && ws.size() <= MAX_WEIGHTS && biases.size() == ws.size(), "1 to 4 weights, a bias (or None) each");
  const int64_t M = x.size(0), nb = K / F::L, tile_bytes = F::tile_bytes(nb);
  const int count = static_cast<int>(ws.size());
  const uint8_t* W[MAX_WEIGHTS];
  const float* B[MAX_WEIGHTS];
  int64_t first[MAX_WEIGHTS + 1] = {0};  // weight i's tiles are first[i] .. first[i + 1] - 1 of the loop
  std::vector<torch::Tensor> outs, b32(count);
  std::vector<Out> ys;
  for (int i = 0; i < count; ++i) {
    const torch::Tensor& w = ws[i];
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 tiles [N / 16, bytes]");
    TORCH_CHECK(w.size(1) == tile_bytes, "w: ", w.size(1), " bytes a tile, the layout needs ", tile_bytes);
    const int64_t N = w.size(0) * LANES;  // the padded rows too: the caller drops them
    W[i] = w.data_ptr<uint8_t>();
    B[i] = nullptr;
    if (biases[i].has_value()) {
      const torch::Tensor& bias = *biases[i];
      const int64_t n = bias.numel();
      TORCH_CHECK(n <= N && n > N - LANES, "a bias of ", n, " values for ", w.size(0), " tiles of 16 rows");
      if (n == N && bias.scalar_type() == torch::kFloat32 && bias.is_contiguous()) {
        B[i] = bias.data_ptr<float>();  // as the tiles read it (decoder.py's fused layers keep theirs so)
      } else {  // three small torch operations a bias: ~10 us a call at one row
        b32[i] = torch::zeros({N}, x.options().dtype(torch::kFloat32));
        b32[i].narrow(0, 0, n).copy_(bias.reshape({n}));
        B[i] = b32[i].data_ptr<float>();
      }
    }
    first[i + 1] = first[i] + w.size(0);
    outs.push_back(torch::empty({M, N}, x.options()));
    ys.push_back(Out{outs.back().data_ptr(), x.scalar_type() == torch::kFloat32});
  }
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> xsbuf, qsbuf;
  thread_local std::vector<int32_t> initbuf;
  int8_t* q = scratch(qbuf, M * K);
  float* xs = scratch(xsbuf, M * nb);
  int32_t* init = scratch(initbuf, M * nb);
  float* qs = scratch(qsbuf, M * nb);
  quantize<KIND>(x, q, xs, init, qs);
  const Rows rows{q, xs, init, qs, K, nb, M > 1};
  // Tiles split statically over the threads: each thread streams one run of whole tiles, and
  // applies each tile to blocks of up to 8 rows of x (a pass of more rows reads the tile again,
  // from cache: a tile of the 1.5B's widest matrix is 80 KB).
  over_tiles<1>(first[count], [&](auto, int64_t t) {
    int i = 0;
    while (t >= first[i + 1]) ++i;
    const uint8_t* T = W[i] + (t - first[i]) * tile_bytes;
    const int64_t N = (first[i + 1] - first[i]) * LANES, n0 = (t - first[i]) * LANES;
    over_rows_whole<8>(M, [&](auto mb, int64_t m0) { tile<KIND, decltype(mb)::value>(rows, T, B[i], ys[i], N, m0, n0); });
  });
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

// x [M, K] float32 or bfloat16, w [tiles, bytes] uint8 in ``kind``'s layout -> [M, tiles * 16] in x's
// dtype (the rows that pad the last tile are the caller's to drop)
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t K, c10::optional<torch::Tensor> bias) {
  return by_kind(kind, [&](auto k) { return run<decltype(k)::value>(x, {w}, K, {bias})[0]; });
}

// the same for up to 4 weights of one format against the same x -> one output each
std::vector<torch::Tensor> linear_blocks_many(torch::Tensor x, std::vector<torch::Tensor> ws, int64_t kind, int64_t K,
                                              std::vector<c10::optional<torch::Tensor>> biases) {
  return by_kind(kind, [&](auto k) { return run<decltype(k)::value>(x, ws, K, biases); });
}

// 512-bit vpdpbusd a second on one core, as fast as this machine runs them: 12 independent
// accumulators (more than the latency times the rate) in runs of about a millisecond, the
// fastest of ``runs`` (a shared machine takes the core away in slices longer than that). Every
// row of a pass costs one per 64 weight-times-x products, whatever the layout, so this rate
// bounds a pass of many rows from below (bench/matrix.py prints that floor beside its figures).
double vnni_rate(int64_t runs) {
  constexpr int64_t N = 1 << 20;
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi32(0x05060708);
  const __m512i x = _mm512_set1_epi32(0x01020304);
  double best = 1e30;
  for (int64_t r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t n = 0; n < N; n += 12) {
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
      asm volatile("" : "+v"(w));  // w may have changed: the products are not hoisted out of the loop
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  int32_t sink = 0;
  for (int i = 0; i < 12; ++i) sink ^= _mm512_reduce_add_epi32(acc[i]);
  asm volatile("" : : "r"(sink));
  return static_cast<double>(N) / best;
}
