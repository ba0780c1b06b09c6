// How the kernels walk an output [M, N]: tiles of NB weight rows, split statically over the OpenMP
// threads, each tile applied to blocks of MB rows of x. Shared by linear.cpp and blocks.cpp.
// The walk decides only which loads are shared; a kernel's sums for output (m, n) are the same
// sequence whatever tile or block (m, n) falls in, which is what keeps the kernels batch invariant.
#pragma once

#include <cstdint>
#include <type_traits>

template <int NB, typename Tile>
void over_tiles(int64_t N, Tile tile) {
  const int64_t full = N / NB * NB;
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < full; n0 += NB) tile(std::integral_constant<int, NB>(), n0);
  for (int64_t n0 = full; n0 < N; ++n0) tile(std::integral_constant<int, 1>(), n0);
}

template <int MAX_MB, typename Block>
void over_rows(int64_t M, Block block) {
  int64_t m0 = 0;
  if constexpr (MAX_MB >= 8) {
    for (; m0 + 8 <= M; m0 += 8) block(std::integral_constant<int, 8>(), m0);
  }
  for (; m0 + 4 <= M; m0 += 4) block(std::integral_constant<int, 4>(), m0);
  switch (M - m0) {
    case 3: block(std::integral_constant<int, 3>(), m0); break;
    case 2: block(std::integral_constant<int, 2>(), m0); break;
    case 1: block(std::integral_constant<int, 1>(), m0); break;
    default: break;
  }
}

// Blocks of MAX rows, then the rest as one block of M % MAX rows (blocks.cpp: a pass of 5 rows
// reads each weight vector once, not once for 4 rows and again for 1).
template <int R, typename Block>
void one_block(int64_t rows, int64_t m0, Block block) {
  if constexpr (R >= 1) {
    if (rows == R) {
      block(std::integral_constant<int, R>(), m0);
    } else {
      one_block<R - 1>(rows, m0, block);
    }
  }
}

template <int MAX, typename Block>
void over_rows_whole(int64_t M, Block block) {
  int64_t m0 = 0;
  for (; m0 + MAX <= M; m0 += MAX) block(std::integral_constant<int, MAX>(), m0);
  one_block<MAX - 1>(M - m0, m0, block);
}
