// y = x @ w.T (+ b) with w in a GGUF block format, repacked at load (models/ggml.py, where the
// layout is written and read back) and x quantized to int8 per block inside the call. The core
// on raw pointers; blocks.cpp binds it to torch (and adds AMX on CPUs that have it).
//
// Layout: the weight rows go in tiles of 16 (the last one padded with zero rows); lane l of
// every 64-byte vector of a tile belongs to its row l. A block is L weights (32; 16 for Q6_K,
// whose scales are per 16) with one scale; a tile is its blocks in k order, each block its
// values, then its 16 rows' scales. Step s of a block is its weights 4s..4s+3, 4 bytes a lane:
// one byte dot (simd::dot_us_bcast: vpdpbusd, two vpmaddubsw pairs, or sdot) multiplies a step
// of 16 rows by the same 4 bytes of x, broadcast, into 16 int32 lanes, and a lane's sum is its
// row's exact integer dot product with the block after L/4 steps. Only then does each lane meet
// float: one convert and one multiply-add by (weight scale x activation scale), stored at the end
// as 16 outputs without any horizontal sum. The values are unsigned: 4-bit (step s in the low
// nibble, s + L/8 in the high one: ggml's own Q4_0 order), 5- or 6-bit (the same nibbles, then
// one vector of every step's high bits: step s's at bits s (Q5_0) or 2s, 2s + 1 (Q6_K) of each
// byte) or 8-bit, stored as q + offset; the offset is taken off in the integer domain (each lane
// starts at -offset * the block's sum of x).
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
// instruction, so a row of the pass costs one narrow load a byte dot.
//
// Batch invariant by construction: a block's integer sum is exact, and output (m, n) is one
// float lane that adds its blocks in k order, whatever the number of rows or where (m, n) falls.
// Every operation after the integer sums is a lane's own IEEE operation (simd.h), so the bits
// are also the same on every ISA.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "simd.h"
#include "tiles.h"

namespace qd {
inline namespace QD_ISA_NS {

// bytes ahead of a tile's stream to prefetch into L1: one row of a pass reads weights faster than
// the hardware prefetcher alone brings them from memory
constexpr int64_t PREFETCH = 4096;
// and, for a pass of several rows, further ahead into L2. Such a pass computes long enough a tile
// that the L1 prefetches alone keep too few lines in flight, and memory and arithmetic then take
// turns instead of overlapping; the L2's own queue holds more. Measured interleaved on the 1.5B's
// Q4_K ffn_gate (8960x1536) streamed from memory (AMD EPYC, AVX-512, 2 threads): 5 rows 0.43 ->
// 0.33 ms, 3 rows 0.29 -> 0.24, 8 rows 0.56 -> 0.50; one row slower with it (0.22 -> 0.25).
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
  // 8-bit values go through dot_ss, as signed bytes (q = stored - 128), where the ISA's unsigned
  // dot does not take every byte (simd::FULL_U8): the offset is then already taken off
  static constexpr bool SIGNED = BITS == 8 && !simd::FULL_U8;
  static constexpr int INIT_OFFSET = SIGNED ? OFFSET - 128 : OFFSET;
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
  void store16(int64_t idx, simd::F16 v) const {
    if (f32) {
      simd::store_f(static_cast<float*>(data) + idx, v);
    } else {
      simd::store_bf16(static_cast<uint16_t*>(data) + idx, v);
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

// q = round-half-even(x / s), s = amax / 127 per block of L; x [M, K] float32 or bfloat16 (T
// uint16_t), contiguous, read as it is
template <int KIND, typename T>
void quantize_rows(const T* X, int64_t M, int64_t K, int8_t* Q, float* XS, int32_t* INIT, float* QS) {
  using F = Format<KIND>;
  constexpr int L = F::L;
  const int64_t nb = K / L;
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = X + m * K + b * L;
      simd::F16 v[L / 16];
      simd::F16 amax = simd::zero_f();
      for (int h = 0; h < L / 16; ++h) {
        v[h] = simd::load_f(xb + 16 * h);
        amax = simd::max(amax, simd::abs(v[h]));
      }
      const float a = simd::reduce_max(amax);
      const float s = a > 0.0f ? a / 127.0f : 1.0f;
      const simd::F16 sv = simd::set1_f(s);
      simd::I16 sum = simd::zero_i();
      for (int h = 0; h < L / 16; ++h) {
        const simd::I16 qi = simd::round_i(simd::div(v[h], sv));
        simd::store_i8(Q + m * K + b * L + 16 * h, qi);
        sum = simd::add_i(sum, qi);
      }
      const int32_t total = simd::reduce_add_i(sum);
      XS[m * nb + b] = s;
      INIT[m * nb + b] = -F::INIT_OFFSET * total;
      QS[m * nb + b] = s * static_cast<float>(total);
    }
  }
}

// A block's 4-, 5- or 6-bit values at p unpacked to one byte a weight, two steps at a time: pair(v)
// gives steps v and v + STEPS/2 (the low and high nibbles of vector v, with their high bits).
template <int KIND>
struct Unpacked {
  using F = Format<KIND>;
  static constexpr int HALF = F::STEPS / 2;
  static constexpr int WIDTH = F::BITS - 4;
  const uint8_t* p;
  simd::B64 low = simd::set1_b(0x0f);
  // the high bits of every step (5- and 6-bit): step s's at bits WIDTH * s of each byte
  simd::B64 hb = F::BITS > 4 ? simd::load_b(p + 64 * HALF) : simd::set1_b(0);
  simd::B64 top = simd::set1_b(static_cast<uint8_t>(((1 << WIDTH) - 1) << 4));
  explicit Unpacked(const uint8_t* at) : p(at) {}
  simd::B64 high(int s) const { return simd::shift_mask(hb, 4 - WIDTH * s, top); }  // step s's high bits at bits 4..
  void pair(int v, simd::B64& w0, simd::B64& w1) const {
    const simd::B64 packed = simd::load_b(p + 64 * v);
    w0 = simd::and_b(packed, low);
    w1 = simd::shift_mask(packed, -4, low);
    if constexpr (F::BITS > 4) {
      w0 = simd::or_b(w0, high(v));
      w1 = simd::or_b(w1, high(v + HALF));
    }
  }
};

// A block's 16 weight scales and mins (ws, mn) from its fields after its values (sp), and the
// super-block's d and dmin (K-quants)
template <int KIND>
inline void block_scales(const uint8_t* sp, simd::F16 d, simd::F16 dmin, simd::F16& ws, simd::F16& mn) {
  mn = simd::zero_f();
  if constexpr (KIND == Q4_K) {
    ws = simd::mul(simd::u8_to_f(sp), d);
    mn = simd::mul(simd::u8_to_f(sp + 16), dmin);
  } else if constexpr (KIND == Q6_K) {
    ws = simd::mul(simd::i8_to_f(sp), d);
  } else {
    ws = simd::half_to_f(sp);
    if constexpr (Format<KIND>::MIN) mn = simd::half_to_f(sp + 32);
  }
}

// Each lane's exact block sum (offset included) meets float once: f += sum * (w scale x x scale)
// (- min x x scale x sum(q)). The one float sequence of every path and row count.
template <int KIND>
inline simd::F16 meet_float(simd::F16 f, simd::I16 sum, simd::F16 ws, simd::F16 mn, const Rows& x, int64_t at) {
  f = simd::fmadd(simd::to_f(sum), simd::mul(ws, simd::set1_f(x.xs[at])), f);
  if constexpr (Format<KIND>::MIN) f = simd::fnmadd(mn, simd::set1_f(x.qs[at]), f);
  return f;
}

inline void prefetch_block(const uint8_t* p, int64_t bytes, bool far) {
  for (int64_t o = 0; o < bytes; o += 64) simd::prefetch_l1(p + PREFETCH + o);
  if (far) {
    for (int64_t o = 0; o < bytes; o += 64) simd::prefetch_l2(p + PREFETCH_L2 + o);
  }
}

// acc += one step of 16 weight rows . 4 bytes of x
template <int KIND>
inline simd::I16 step(simd::I16 acc, simd::B64 w, const int32_t* x4) {
  if constexpr (Format<KIND>::SIGNED) {
    return simd::dot_ss_bcast(acc, simd::xor_b(w, simd::set1_b(0x80)), x4);
  } else {
    return simd::dot_us_bcast(acc, w, x4);
  }
}

// The tile of 16 weight rows at T against rows m0 .. m0 + MB - 1 of x -> y[m0.., n0 .. n0 + 15].
template <int KIND, int MB>
inline void tile(const Rows& x, const uint8_t* T, const float* bias, const Out& y, int64_t N, int64_t m0, int64_t n0) {
  using F = Format<KIND>;
  const int64_t K = x.K, nb = x.blocks;
  simd::F16 f[MB];
  for (int j = 0; j < MB; ++j) f[j] = simd::zero_f();
  const int32_t* xq[MB];  // each row's x, 4 bytes (one step) an element
  for (int j = 0; j < MB; ++j) xq[j] = reinterpret_cast<const int32_t*>(x.q + (m0 + j) * K);
  simd::F16 d = simd::zero_f(), dmin = simd::zero_f();
  const uint8_t* p = T;
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (F::SUPER > 0) {
      if (b % F::SUPER == 0) {
        d = simd::half_to_f(p);
        if constexpr (F::MIN) dmin = simd::half_to_f(p + 32);
        p += F::SUPER_BYTES;
      }
    }
    prefetch_block(p, F::BLOCK_BYTES, x.far);
    const int64_t s0 = b * F::STEPS;  // the block's first step in x
    simd::I16 acc[MB];
    if constexpr (F::BITS == 8) {
      for (int j = 0; j < MB; ++j) acc[j] = simd::set1_i(x.init[(m0 + j) * nb + b]);
      for (int s = 0; s < F::STEPS; ++s) {
        const simd::B64 w = simd::load_b(p + 64 * s);
        for (int j = 0; j < MB; ++j) acc[j] = step<KIND>(acc[j], w, xq[j] + s0 + s);
      }
    } else {  // two steps an unpacked vector, regrouped every GROUP steps (simd.h's partial sums)
      constexpr int GROUP = simd::group_steps((1 << F::BITS) - 1) / 2 * 2;
      static_assert(GROUP >= 2, "an unpacked vector's two steps fit a group");
      simd::Partial part[MB];
      for (int j = 0; j < MB; ++j) part[j] = simd::begin(F::INIT_OFFSET ? x.init[(m0 + j) * nb + b] : 0);
      const Unpacked<KIND> u(p);
#pragma GCC unroll 16  // whole: the regroup test below is then decided at compile time
      for (int v = 0; v < u.HALF; ++v) {
        simd::B64 w0, w1;
        u.pair(v, w0, w1);
        for (int j = 0; j < MB; ++j) {
          part[j] = simd::step_us(part[j], w0, xq[j] + s0 + v);
          part[j] = simd::step_us(part[j], w1, xq[j] + s0 + v + u.HALF);
          if ((2 * (v + 1)) % GROUP == 0 && v + 1 < u.HALF) part[j] = simd::regroup(part[j]);
        }
      }
      for (int j = 0; j < MB; ++j) acc[j] = simd::end(part[j]);
    }
    simd::F16 ws, mn;
    block_scales<KIND>(p + F::VECTORS * 64, d, dmin, ws, mn);
    for (int j = 0; j < MB; ++j) f[j] = meet_float<KIND>(f[j], acc[j], ws, mn, x, (m0 + j) * nb + b);
    p += F::BLOCK_BYTES;
  }
  const simd::F16 bv = bias ? simd::load_f(bias + n0) : simd::zero_f();
  for (int j = 0; j < MB; ++j) y.store16((m0 + j) * N + n0, simd::add(f[j], bv));
}

// rows a block of rows needs to go to AMX (docs/benchmarks/archive/gguf-cost-by-rows-intel-amx: the 1.5B's Q4_K ffn_gate streamed, 12
// rows tied with VNNI, 16 rows 0.59-0.64 ms against 0.73-0.77)
constexpr int AMX_MIN_ROWS = 12;

// Up to 4 weights of one format against the same x: weight i is W[i], its tiles first[i] ..
// first[i + 1] - 1 of the loop, its bias B[i] (null, or float32 [tiles * 16]), its output ys[i].
struct Weights {
  static constexpr int MAX = 4;
  const uint8_t* W[MAX];
  const float* B[MAX];
  Out ys[MAX];
  int64_t first[MAX + 1] = {0};
  int count = 0;
  int64_t tile_bytes = 0;
  int of(int64_t t) const {  // the weight that tile t of the loop belongs to
    int i = 0;
    while (t >= first[i + 1]) ++i;
    return i;
  }
};

// Tiles split statically over the threads: each thread streams one run of whole tiles, and
// applies each tile to blocks of up to simd::ROW_BLOCK rows of x (a pass of more rows reads the tile again,
// from cache: a tile of the 1.5B's widest matrix is 80 KB).
template <int KIND>
void run_tiles(const Rows& rows, const Weights& w, int64_t M) {
  over_tiles<1>(w.first[w.count], [&](auto, int64_t t) {
    const int i = w.of(t);
    const uint8_t* T = w.W[i] + (t - w.first[i]) * w.tile_bytes;
    const int64_t N = (w.first[i + 1] - w.first[i]) * LANES, n0 = (t - w.first[i]) * LANES;
    over_rows_whole<simd::ROW_BLOCK>(M, [&](auto mb, int64_t m0) { tile<KIND, decltype(mb)::value>(rows, T, w.B[i], w.ys[i], N, m0, n0); });
  });
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
    default: return run(std::integral_constant<int, -1>());
  }
}

// 64-byte integer dots a second on one core (vpdpbusd on AVX-512; two vpmaddubsw, vpmaddwd and
// vpaddd pairs on AVX2; four sdot on NEON), as fast as this machine runs them: 12 independent
// accumulators in runs of about a millisecond, the fastest of ``runs`` (a shared machine takes
// the core away in slices longer than that). Every row of a pass costs one per 64
// weight-times-x products, so this rate bounds a pass of many rows from below (bench/matrix.py).
inline double dot_rate(int64_t runs) {
  constexpr int64_t N = 1 << 20;
  simd::I16 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = simd::set1_i(i);
  simd::B64 w = simd::set1_b(0x05);
  const int32_t x = 0x01020304;
  double best = 1e30;
  for (int64_t r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t n = 0; n < N; n += 12) {
      for (int i = 0; i < 12; ++i) acc[i] = simd::dot_us_bcast(acc[i], w, &x);
      asm volatile("" : "+m"(w));  // w may have changed: the products are not hoisted out of the loop
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  int32_t sink = 0;
  for (int i = 0; i < 12; ++i) sink ^= simd::reduce_add_i(acc[i]);
  asm volatile("" : : "r"(sink));
  return static_cast<double>(N) / best;
}

}  // namespace QD_ISA_NS
}  // namespace qd
