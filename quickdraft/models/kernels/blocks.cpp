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
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
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

// A block's 4-, 5- or 6-bit values at p unpacked to one byte a weight, two steps at a time: pair(v)
// gives steps v and v + STEPS/2 (the low and high nibbles of vector v, with their high bits).
template <int KIND>
struct Unpacked {
  using F = Format<KIND>;
  static constexpr int HALF = F::STEPS / 2;
  static constexpr int WIDTH = F::BITS - 4;
  const uint8_t* p;
  __m512i low = _mm512_set1_epi8(0x0f);
  // the high bits of every step (5- and 6-bit): step s's at bits WIDTH * s of each byte
  __m512i hb = F::BITS > 4 ? _mm512_loadu_si512(p + 64 * HALF) : _mm512_setzero_si512();
  __m512i top = _mm512_set1_epi8(static_cast<char>(((1 << WIDTH) - 1) << 4));
  explicit Unpacked(const uint8_t* at) : p(at) {}
  __m512i high(int s) const {  // step s's high bits at bits 4.. of each byte (16-bit shifts: each byte's bits stay its own after the mask)
    const int shift = 4 - WIDTH * s;
    const __m512i v = shift >= 0 ? _mm512_slli_epi16(hb, shift) : _mm512_srli_epi16(hb, -shift);
    return _mm512_and_si512(v, top);
  }
  void pair(int v, __m512i& w0, __m512i& w1) const {
    const __m512i packed = _mm512_loadu_si512(p + 64 * v);
    w0 = _mm512_and_si512(packed, low);
    w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    if constexpr (F::BITS > 4) {
      w0 = _mm512_or_si512(w0, high(v));
      w1 = _mm512_or_si512(w1, high(v + HALF));
    }
  }
};

// A block's 16 weight scales and mins (ws, mn) from its fields after its values (sp), and the
// super-block's d and dmin (K-quants)
template <int KIND>
inline void block_scales(const uint8_t* sp, __m512 d, __m512 dmin, __m512& ws, __m512& mn) {
  mn = _mm512_setzero_ps();
  if constexpr (KIND == Q4_K) {
    ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)))), d);
    mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)))), dmin);
  } else if constexpr (KIND == Q6_K) {
    ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)))), d);
  } else {
    ws = half16(sp);
    if constexpr (Format<KIND>::MIN) mn = half16(sp + 32);
  }
}

// Each lane's exact block sum (offset included) meets float once: f += sum * (w scale x x scale)
// (- min x x scale x sum(q)). The one float sequence of every path and row count.
template <int KIND>
inline __m512 meet_float(__m512 f, __m512i sum, __m512 ws, __m512 mn, const Rows& x, int64_t at) {
  f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ws, _mm512_set1_ps(x.xs[at])), f);
  if constexpr (Format<KIND>::MIN) f = _mm512_fnmadd_ps(mn, _mm512_set1_ps(x.qs[at]), f);
  return f;
}

inline void prefetch_block(const uint8_t* p, int64_t bytes, bool far) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + o), _MM_HINT_T0);
  if (far) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_L2 + o), _MM_HINT_T1);
  }
}

// The tile of 16 weight rows at T against rows m0 .. m0 + MB - 1 of x -> y[m0.., n0 .. n0 + 15].
template <int KIND, int MB>
inline void tile(const Rows& x, const uint8_t* T, const float* bias, const Out& y, int64_t N, int64_t m0, int64_t n0) {
  using F = Format<KIND>;
  const int64_t K = x.K, nb = x.blocks;
  __m512 f[MB];
  for (int j = 0; j < MB; ++j) f[j] = _mm512_setzero_ps();
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
    prefetch_block(p, F::BLOCK_BYTES, x.far);
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = F::OFFSET ? _mm512_set1_epi32(x.init[(m0 + j) * nb + b]) : _mm512_setzero_si512();
    const int64_t s0 = b * F::STEPS;  // the block's first step in x
    if constexpr (F::BITS == 8) {
      for (int s = 0; s < F::STEPS; ++s) {
        const __m512i w = _mm512_loadu_si512(p + 64 * s);
        for (int j = 0; j < MB; ++j) acc[j] = dot_broadcast(acc[j], w, xq[j] + s0 + s);
      }
    } else {
      const Unpacked<KIND> u(p);
      for (int v = 0; v < u.HALF; ++v) {
        __m512i w0, w1;
        u.pair(v, w0, w1);
        for (int j = 0; j < MB; ++j) {
          acc[j] = dot_broadcast(acc[j], w0, xq[j] + s0 + v);
          acc[j] = dot_broadcast(acc[j], w1, xq[j] + s0 + v + u.HALF);
        }
      }
    }
    __m512 ws, mn;
    block_scales<KIND>(p + F::VECTORS * 64, d, dmin, ws, mn);
    for (int j = 0; j < MB; ++j) f[j] = meet_float<KIND>(f[j], acc[j], ws, mn, x, (m0 + j) * nb + b);
    p += F::BLOCK_BYTES;
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int j = 0; j < MB; ++j) y.store16((m0 + j) * N + n0, _mm512_add_ps(f[j], bv));
}

// ---- AMX (Intel Xeon from Sapphire Rapids): the same sums for up to 16 rows in one instruction ----
//
// The tile layout above is already AMX's: a block's steps are the rows of a B tile (L/4 rows of
// 16 weight rows x 4 bytes), and x's block for up to 16 rows is an A tile (a row of L bytes each).
// One tdpbsud (signed x, unsigned weights: the same operands as vpdpbusd's) gives every row's
// exact integer block sum at once, where the VNNI tile spends L/4 vpdpbusd a row. The sums leave
// the unit through memory, one 64-byte row each, and meet float exactly as in tile() (the offset
// added after the products instead of before: integers, so the same sum; then the same convert,
// scale and multiply-add), so a row's bits are those of the VNNI path and of any other row count.
//
// What it gains is bounded, because a block has 32 weights (16 for Q6_K) with a float scale of
// its own: each tdpbsud does half the products it could (K = 32 of 64), and each block's sums
// must be stored and turned into floats row by row (4 or 5 vector operations a row, as on VNNI).
// Measured hot in L2 on an Intel Xeon (Q4_K, 2 threads, ns per 512 weights at 16 rows): 34 in
// all, 24 without the tile operations, 23 without the float epilogue, 15 without both (x's
// quantization and the call): the tile operations and the epilogue did not overlap, whatever
// the lag between a block's product and its epilogue (1 to 3 blocks tried). So AMX runs only
// passes whose blocks of rows reach AMX_MIN_ROWS, where it beat the VNNI tile streamed from
// memory (README, "AMX"); fewer rows stay on VNNI, whose per-row cost is lower there.
//
// The tile configuration is loaded once a thread a call (ldtilecfg) and released after: torch's
// oneDNN kernels configure their own.

// rows a block of rows needs to go to AMX (README, "AMX": the 1.5B's Q4_K ffn_gate streamed, 12
// rows tied with VNNI, 16 rows 0.59-0.64 ms against 0.73-0.77)
constexpr int AMX_MIN_ROWS = 12;

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// the CPU has AMX-INT8 and Linux lets this process use it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA: tile state is off by default for a process, and the first tile instruction without
// it is a SIGILL)
bool amx_hardware() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), int8 = d & (1u << 25);
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return tile && int8 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// on unless QUICKDRAFT_AMX=0, or use_amx(false) (the tests compare the two paths bit for bit)
std::atomic<bool> amx_wanted{[] {
  const char* e = std::getenv("QUICKDRAFT_AMX");
  return !(e && std::string(e) == "0");
}()};

// Tile registers: two sets (sums, x, weights) = (0, 1, 2) and (3, 4, 5), used by alternate blocks
// so that one block's products run while the one before leaves the unit. A pass's rows go in
// equal blocks of up to 16 (20 rows: 10 and 10), all of one tile shape, configured once a call; x's
// scratch has rows up to whole blocks, and the last block ignores the sums of the rows past M.
template <int SET>
inline void block_sums(const uint8_t* w, const int8_t* xa, int64_t K, int32_t* sums) {
  if constexpr (SET == 0) {  // the intrinsics take tile numbers as literals
    _tile_loadd(2, w, 64);
    _tile_loadd(1, xa, K);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, sums, 64);
  } else {
    _tile_loadd(5, w, 64);
    _tile_loadd(4, xa, K);
    _tile_zero(3);
    _tile_dpbsud(3, 4, 5);
    _tile_stored(3, sums, 64);
  }
}

// tiles of `rows` rows of x (at most 16): a tile's loads, products and stores take time by its rows
template <int KIND>
void configure_tiles(int64_t rows) {
  using F = Format<KIND>;
  TileConfig cfg;
  for (int set = 0; set < 2; ++set) {
    const int t = 3 * set;
    cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;            // sums: rows x 16 int32
    cfg.rows[t + 1] = static_cast<uint8_t>(rows), cfg.colsb[t + 1] = F::L;  // x: rows x a block
    cfg.rows[t + 2] = F::STEPS, cfg.colsb[t + 2] = 64;  // weights: a block's steps x 16 rows x 4 bytes
  }
  // GCC 12's _tile_loadconfig does not tell the optimizer that it reads the 64 bytes: it dropped
  // the stores of rows and colsb above, and ldtilecfg then faulted. The "m" operand says so.
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// where block b of a tile starts (K-quants: after its super-block's d and dmin)
template <int KIND>
inline const uint8_t* block_at(const uint8_t* T, int64_t b) {
  using F = Format<KIND>;
  if constexpr (F::SUPER > 0) {
    return T + b / F::SUPER * (F::SUPER_BYTES + F::SUPER * F::BLOCK_BYTES) + F::SUPER_BYTES + b % F::SUPER * F::BLOCK_BYTES;
  } else {
    return T + b * F::BLOCK_BYTES;
  }
}

// The tile of 16 weight rows at T against rows m0 .. m0 + R - 1 of x on AMX, as tile<KIND, R>.
// Software-pipelined by one block at each stage, so that no stage waits on the one before it:
// iteration b unpacks block b + 1 into a B tile's bytes, multiplies block b, and turns block
// b - 1's sums into floats. (One block at a time, each waiting for its bytes to reach the unit
// and its sums to come back, cost more: hot, 16 rows, 29.7 against 25.4 ns per 512 weights.)
template <int KIND, int R>
inline void tile_amx(const Rows& x, const uint8_t* T, const float* bias, const Out& y, int64_t N, int64_t m0, int64_t n0) {
  using F = Format<KIND>;
  const int64_t K = x.K, nb = x.blocks;
  __m512 f[R];
  for (int j = 0; j < R; ++j) f[j] = _mm512_setzero_ps();
  alignas(64) uint8_t wb[2][F::STEPS * 64];  // blocks b and b + 1 unpacked: B tiles' bytes
  alignas(64) int32_t sums[2][16 * 16];       // C tiles: row j's 16 block sums at 16 j
  const int8_t* xq = x.q + m0 * K;
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  auto unpack = [&](int64_t b, uint8_t* to) {
    const uint8_t* p = block_at<KIND>(T, b);
    prefetch_block(p, F::BLOCK_BYTES, true);
    if constexpr (F::BITS < 8) {
      const Unpacked<KIND> u(p);
      for (int v = 0; v < u.HALF; ++v) {
        __m512i w0, w1;
        u.pair(v, w0, w1);
        _mm512_store_si512(to + 64 * v, w0);
        _mm512_store_si512(to + 64 * (v + u.HALF), w1);
      }
    }
  };
  auto finish = [&](int64_t b, const int32_t* s) {
    const uint8_t* p = block_at<KIND>(T, b);
    if constexpr (F::SUPER > 0) {
      if (b % F::SUPER == 0) {
        d = half16(p - F::SUPER_BYTES);
        if constexpr (F::MIN) dmin = half16(p - F::SUPER_BYTES + 32);
      }
    }
    __m512 ws, mn;
    block_scales<KIND>(p + F::VECTORS * 64, d, dmin, ws, mn);
    for (int j = 0; j < R; ++j) {
      const int64_t at = (m0 + j) * nb + b;
      __m512i sum = _mm512_load_si512(s + 16 * j);
      if constexpr (F::OFFSET != 0) sum = _mm512_add_epi32(sum, _mm512_set1_epi32(x.init[at]));  // integers: as if added first
      f[j] = meet_float<KIND>(f[j], sum, ws, mn, x, at);
    }
  };
  // the weights as the B tile reads them: unpacked, or (8-bit) the block as stored
  auto weights = [&](int64_t b, int set) -> const uint8_t* { return F::BITS == 8 ? block_at<KIND>(T, b) : wb[set]; };
  auto stage = [&](auto set, int64_t b) {  // set == b % 2
    constexpr int S = decltype(set)::value;
    if (b + 1 < nb) unpack(b + 1, wb[1 - S]);
    if (b < nb) block_sums<S>(weights(b, S), xq + b * F::L, K, sums[S]);
    if (b >= 1 && b - 1 < nb) finish(b - 1, sums[1 - S]);
  };
  unpack(0, wb[0]);
  for (int64_t b = 0; b <= nb; b += 2) {
    stage(std::integral_constant<int, 0>(), b);
    stage(std::integral_constant<int, 1>(), b + 1);
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int j = 0; j < R; ++j) y.store16((m0 + j) * N + n0, _mm512_add_ps(f[j], bv));
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
  const int64_t amx_blocks = (M + 15) / 16, per_block = (M + amx_blocks - 1) / amx_blocks;  // AMX: rows in blocks of per_block
  int8_t* q = scratch(qbuf, amx_blocks * per_block * K);  // whole AMX tiles (the rows past M: never read back)
  float* xs = scratch(xsbuf, M * nb);
  int32_t* init = scratch(initbuf, M * nb);
  float* qs = scratch(qsbuf, M * nb);
  quantize<KIND>(x, q, xs, init, qs);
  const Rows rows{q, xs, init, qs, K, nb, M > 1};
  auto weight_of = [&](int64_t t) {  // tile t of the loop: its weight, and where it lies
    int i = 0;
    while (t >= first[i + 1]) ++i;
    return i;
  };
  if (per_block >= AMX_MIN_ROWS && amx_wanted.load(std::memory_order_relaxed) && amx_hardware()) {
    // The same static split of the tiles, each applied to blocks of 16 rows, the last one shorter.
#pragma omp parallel
    {
      configure_tiles<KIND>(per_block);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < first[count]; ++t) {
        const int i = weight_of(t);
        const uint8_t* T = W[i] + (t - first[i]) * tile_bytes;
        const int64_t N = (first[i + 1] - first[i]) * LANES, n0 = (t - first[i]) * LANES;
        for (int64_t m0 = 0; m0 < M; m0 += per_block) {
          one_block<16>(std::min(per_block, M - m0), m0, [&](auto mb, int64_t m) {
            tile_amx<KIND, decltype(mb)::value>(rows, T, B[i], ys[i], N, m, n0);
          });
        }
      }
      _tile_release();
    }
    return outs;
  }
  // Tiles split statically over the threads: each thread streams one run of whole tiles, and
  // applies each tile to blocks of up to 8 rows of x (a pass of more rows reads the tile again,
  // from cache: a tile of the 1.5B's widest matrix is 80 KB).
  over_tiles<1>(first[count], [&](auto, int64_t t) {
    const int i = weight_of(t);
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

// whether the block kernels run passes of AMX_MIN_ROWS rows or more on AMX: the CPU has it, Linux
// grants it, and it is wanted
bool amx_active() { return amx_hardware() && amx_wanted.load(); }

// switch the AMX path on or off (off: every pass on the VNNI tile); returns the previous setting
bool use_amx(bool on) { return amx_wanted.exchange(on); }

int64_t amx_min_rows() { return AMX_MIN_ROWS; }
