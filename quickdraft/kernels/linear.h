// y = x @ w.T (+ b) for a few rows of x against a weight [N, K]: bfloat16, float32, and int8
// weights with int8 rows (W8A8, draft models), on raw pointers (linear.cpp binds them to torch).
// Written by hand because decoding is one such product per weight matrix per step, and torch's
// oneDNN path reaches only ~15-20 GB/s of a 2-core AMD EPYC's ~32 GB/s for it: these kernels
// stream each weight row once, with every row of x applied to it while it is in cache.
//
// Batch invariance by construction (ARCHITECTURE.md point 11): the output (m, n) is always the
// same sequence of vector operations over k (the last step zero-padded, never a scalar tail)
// followed by simd.h's one reduction tree, whatever M is and wherever row m sits in the call,
// so a row's result never depends on the other rows. The 4-row blocks only share loads of w;
// they never share sums.
#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"
#include "tiles.h"

namespace qd {
inline namespace QD_ISA_NS {

template <int MB, int NB>
inline void block_bf16(const uint16_t* X, const uint16_t* W, const float* B, uint16_t* Y, int64_t K, int64_t N,
                       int64_t m0, int64_t n0) {
  simd::F16 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = simd::zero_f();
  for (int64_t k = 0; k < K; k += 32) {
    const int n = K - k >= 32 ? 32 : static_cast<int>(K - k);
    simd::BH32 xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = n == 32 ? simd::load_bh(X + (m0 + j) * K + k) : simd::load_bh_part(X + (m0 + j) * K + k, n);
    for (int i = 0; i < NB; ++i) {
      const simd::BH32 wv = n == 32 ? simd::load_bh(W + (n0 + i) * K + k) : simd::load_bh_part(W + (n0 + i) * K + k, n);
      for (int j = 0; j < MB; ++j) acc[i][j] = simd::dot_bf16(acc[i][j], xv[j], wv);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) Y[(m0 + j) * N + n0 + i] = simd::to_bf16(simd::reduce_add(acc[i][j]) + (B ? B[n0 + i] : 0.0f));
}

// float32, the exact-comparison dtype of the losslessness tests. torch's float32 matmul is not
// batch invariant and how it fails depends on the CPU: MKL picks another kernel for rows 13 and
// up on an Intel Xeon with AMX, and for 1..3 tail rows on an AMD EPYC. Here every output is one
// chain of 16-lane FMAs over k, then the one reduction tree: the same bits on every ISA.
template <int MB, int NB>
inline void block_f32(const float* X, const float* W, const float* B, float* Y, int64_t K, int64_t N, int64_t m0,
                      int64_t n0) {
  simd::F16 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = simd::zero_f();
  for (int64_t k = 0; k < K; k += 16) {
    const int n = K - k >= 16 ? 16 : static_cast<int>(K - k);
    simd::F16 xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = n == 16 ? simd::load_f(X + (m0 + j) * K + k) : simd::load_f_part(X + (m0 + j) * K + k, n);
    for (int i = 0; i < NB; ++i) {
      const simd::F16 wv = n == 16 ? simd::load_f(W + (n0 + i) * K + k) : simd::load_f_part(W + (n0 + i) * K + k, n);
      for (int j = 0; j < MB; ++j) acc[i][j] = simd::fmadd(xv[j], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) Y[(m0 + j) * N + n0 + i] = simd::reduce_add(acc[i][j]) + (B ? B[n0 + i] : 0.0f);
}

// int8 weights (one scale per output row) times int8 activations (one scale per row of x), for
// draft models: a quarter of float32's bytes, half of bfloat16's, and one byte dot per 64 weights
// (widening int8 weights to float32 in registers instead was measured compute-bound at ~14 GB/s
// on AVX-512). Where the ISA multiplies unsigned by signed bytes at full range (simd::FULL_U8), x
// is stored as q + 128 and the 128 * sum(w) that adds is taken off at the end; elsewhere x stays
// signed (dot_ss). Either way the integer sum is exact, so the bits are the same on every ISA.
constexpr int X_OFFSET = simd::FULL_U8 ? 128 : 0;

template <int MB, int NB>
inline void block_w8(const uint8_t* X, const int8_t* W, const float* XS, const float* WS, const int32_t* WSUM,
                     const float* B, uint16_t* Y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  simd::I16 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = simd::zero_i();
  // the last step's bytes past K are zero weights, so they add nothing whatever x holds there
  for (int64_t k = 0; k < K; k += 64) {
    const int n = K - k >= 64 ? 64 : static_cast<int>(K - k);
    simd::B64 xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = n == 64 ? simd::load_b(X + (m0 + j) * K + k) : simd::load_b_part(X + (m0 + j) * K + k, n);
    for (int i = 0; i < NB; ++i) {
      const simd::B64 wv = n == 64 ? simd::load_b(W + (n0 + i) * K + k) : simd::load_b_part(W + (n0 + i) * K + k, n);
      for (int j = 0; j < MB; ++j) {
        if constexpr (simd::FULL_U8) {
          acc[i][j] = simd::dot_us(acc[i][j], xv[j], wv);
        } else {
          acc[i][j] = simd::dot_ss(acc[i][j], wv, xv[j]);
        }
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      const int32_t dot = simd::reduce_add_i(acc[i][j]) - X_OFFSET * WSUM[n0 + i];
      const float s = static_cast<float>(dot) * XS[m0 + j] * WS[n0 + i] + (B ? B[n0 + i] : 0.0f);
      Y[(m0 + j) * N + n0 + i] = simd::to_bf16(s);
    }
}

// x [M, K] bfloat16 -> q + X_OFFSET as bytes, with one symmetric scale per row.
inline void quantize_rows_w8(const uint16_t* X, int64_t M, int64_t K, uint8_t* Q, float* S) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(simd::from_bf16(X[m * K + k])));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    S[m] = scale;
    for (int64_t k = 0; k < K; ++k)
      Q[m * K + k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(simd::from_bf16(X[m * K + k]) / scale)) + X_OFFSET);
  }
}

// The three products over a whole [M, K] x [N, K] in the tile walk (tiles.h): 4 weight rows a
// tile, blocks of up to 4 rows of x.
inline void linear_bf16(const uint16_t* X, const uint16_t* W, const float* B, uint16_t* Y, int64_t M, int64_t K, int64_t N) {
  over_tiles<4>(N, [&](auto nb, int64_t n0) {
    over_rows<4>(M, [&](auto mb, int64_t m0) { block_bf16<decltype(mb)::value, decltype(nb)::value>(X, W, B, Y, K, N, m0, n0); });
  });
}

inline void linear_f32(const float* X, const float* W, const float* B, float* Y, int64_t M, int64_t K, int64_t N) {
  over_tiles<4>(N, [&](auto nb, int64_t n0) {
    over_rows<4>(M, [&](auto mb, int64_t m0) { block_f32<decltype(mb)::value, decltype(nb)::value>(X, W, B, Y, K, N, m0, n0); });
  });
}

// X: x quantized by quantize_rows_w8 (XS its scales)
inline void linear_w8(const uint8_t* X, const float* XS, const int8_t* W, const float* WS, const int32_t* WSUM,
                      const float* B, uint16_t* Y, int64_t M, int64_t K, int64_t N) {
  over_tiles<4>(N, [&](auto nb, int64_t n0) {
    over_rows<4>(M, [&](auto mb, int64_t m0) {
      block_w8<decltype(mb)::value, decltype(nb)::value>(X, W, XS, WS, WSUM, B, Y, K, N, m0, n0);
    });
  });
}

}  // namespace QD_ISA_NS
}  // namespace qd
