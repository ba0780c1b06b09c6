// AMX for the block kernels (blocks.h), on Intel Xeon from Sapphire Rapids; built into the
// AVX-512 module only (the tile instructions run only where cpuid and Linux allow them).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "../blocks.h"

namespace qd {
inline namespace QD_ISA_NS {

// The same sums as blocks.h's tile() for up to 16 rows in one instruction.
//
// blocks.h's tile layout is already AMX's: a block's steps are the rows of a B tile (L/4 rows of
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
// memory (docs/benchmarks/archive/gguf-cost-by-rows-intel-amx); fewer rows stay on VNNI, whose per-row cost is lower there.
//
// The tile configuration is loaded once a thread a call (ldtilecfg) and released after: torch's
// oneDNN kernels configure their own.

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
  simd::F16 f[R];
  for (int j = 0; j < R; ++j) f[j] = simd::zero_f();
  alignas(64) uint8_t wb[2][F::STEPS * 64];  // blocks b and b + 1 unpacked: B tiles' bytes
  alignas(64) int32_t sums[2][16 * 16];       // C tiles: row j's 16 block sums at 16 j
  const int8_t* xq = x.q + m0 * K;
  simd::F16 d = simd::zero_f(), dmin = simd::zero_f();
  auto unpack = [&](int64_t b, uint8_t* to) {
    const uint8_t* p = block_at<KIND>(T, b);
    prefetch_block(p, F::BLOCK_BYTES, true);
    if constexpr (F::BITS < 8) {
      const Unpacked<KIND> u(p);
      for (int v = 0; v < u.HALF; ++v) {
        simd::B64 w0, w1;
        u.pair(v, w0, w1);
        simd::store_b(to + 64 * v, w0);
        simd::store_b(to + 64 * (v + u.HALF), w1);
      }
    }
  };
  auto finish = [&](int64_t b, const int32_t* s) {
    const uint8_t* p = block_at<KIND>(T, b);
    if constexpr (F::SUPER > 0) {
      if (b % F::SUPER == 0) {
        d = simd::half_to_f(p - F::SUPER_BYTES);
        if constexpr (F::MIN) dmin = simd::half_to_f(p - F::SUPER_BYTES + 32);
      }
    }
    simd::F16 ws, mn;
    block_scales<KIND>(p + F::VECTORS * 64, d, dmin, ws, mn);
    for (int j = 0; j < R; ++j) {
      const int64_t at = (m0 + j) * nb + b;
      simd::I16 sum = simd::load_i(s + 16 * j);
      if constexpr (F::OFFSET != 0) sum = simd::add_i(sum, simd::set1_i(x.init[at]));  // integers: as if added first
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
  const simd::F16 bv = bias ? simd::load_f(bias + n0) : simd::zero_f();
  for (int j = 0; j < R; ++j) y.store16((m0 + j) * N + n0, simd::add(f[j], bv));
}

// Passes whose blocks of rows reach AMX_MIN_ROWS, on a CPU that grants AMX, where it is wanted:
// the same static split of the tiles as run_tiles, each applied to equal blocks of up to 16 rows,
// the last one shorter. False where the pass stays on the VNNI tile.
template <int KIND>
bool run_amx(const Rows& rows, const Weights& w, int64_t M) {
  const int64_t blocks = (M + 15) / 16, per_block = (M + blocks - 1) / blocks;
  if (per_block < AMX_MIN_ROWS || !amx_wanted.load(std::memory_order_relaxed) || !amx_hardware()) return false;
#pragma omp parallel
  {
    configure_tiles<KIND>(per_block);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < w.first[w.count]; ++t) {
      const int i = w.of(t);
      const uint8_t* T = w.W[i] + (t - w.first[i]) * w.tile_bytes;
      const int64_t N = (w.first[i + 1] - w.first[i]) * LANES, n0 = (t - w.first[i]) * LANES;
      for (int64_t m0 = 0; m0 < M; m0 += per_block) {
        one_block<16>(std::min(per_block, M - m0), m0, [&](auto mb, int64_t m) {
          tile_amx<KIND, decltype(mb)::value>(rows, T, w.B[i], w.ys[i], N, m, n0);
        });
      }
    }
    _tile_release();
  }
  return true;
}

}  // namespace QD_ISA_NS
}  // namespace qd
