// One instruction set's kernels (the cores on raw pointers: linear.h, blocks.h, attention.h, rowwise.h) behind C names
// prefixed by the ISA, so that kernels_test.cpp links several ISAs into one program and compares
// them. Compiled once per ISA with -DQD_ISA_<NAME> -DQD_PREFIX=<name>.
#include <cstring>
#include <vector>

#include "../../quickdraft/kernels/attention.h"
#include "../../quickdraft/kernels/blocks.h"
#include "../../quickdraft/kernels/linear.h"
#include "../../quickdraft/kernels/rowwise.h"

#define QD_CAT2(a, b) a##_##b
#define QD_CAT(a, b) QD_CAT2(a, b)
#define QD_NAME(f) QD_CAT(QD_PREFIX, f)

extern "C" {

const char* QD_NAME(isa)() { return simd::ISA; }

void QD_NAME(linear_f32)(const float* X, const float* W, const float* B, float* Y, int64_t M, int64_t K, int64_t N) {
  qd::linear_f32(X, W, B, Y, M, K, N);
}

void QD_NAME(linear_bf16)(const uint16_t* X, const uint16_t* W, const float* B, uint16_t* Y, int64_t M, int64_t K, int64_t N) {
  qd::linear_bf16(X, W, B, Y, M, K, N);
}

void QD_NAME(linear_w8)(const uint16_t* X, const int8_t* W, const float* WS, const int32_t* WSUM, uint16_t* Y, int64_t M,
                        int64_t K, int64_t N) {
  std::vector<uint8_t> q(M * K);
  std::vector<float> s(M);
  qd::quantize_rows_w8(X, M, K, q.data(), s.data());
  qd::linear_w8(q.data(), s.data(), W, WS, WSUM, nullptr, Y, M, K, N);
}

// x [M, K] float32 times one weight of `tiles` tiles of GGUF format `kind` -> y [M, tiles * 16] float32
int QD_NAME(linear_blocks)(int kind, const float* X, int64_t M, int64_t K, const uint8_t* tiles, int64_t count, float* Y) {
  return qd::by_kind(kind, [&](auto k) {
    constexpr int KIND = decltype(k)::value;
    if constexpr (KIND < 0) {
      return 1;
    } else {
      using F = qd::Format<KIND>;
      const int64_t nb = K / F::L;
      std::vector<int8_t> q(M * K);
      std::vector<float> xs(M * nb), qs(M * nb);
      std::vector<int32_t> init(M * nb);
      qd::quantize_rows<KIND>(X, M, K, q.data(), xs.data(), init.data(), qs.data());
      const qd::Rows rows{q.data(), xs.data(), init.data(), qs.data(), K, nb, M > 1};
      qd::Weights w;
      w.count = 1;
      w.tile_bytes = F::tile_bytes(nb);
      w.W[0] = tiles;
      w.B[0] = nullptr;
      w.first[1] = count;
      w.ys[0] = qd::Out{Y, true};
      qd::run_tiles<KIND>(rows, w, M);
      return 0;
    }
  });
}

}  // extern "C"

namespace {

// a float16 of magnitude 2^-10 .. 2^-3 with the sign and mantissa bits already there
void sane_half(uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  h = static_cast<uint16_t>((h & 0x83ff) | ((5 + (h & 7)) << 10));
  std::memcpy(p, &h, 2);
}

}  // namespace

extern "C" {

// random tiles made sane: every float16 field (scales, mins, super-block d and dmin) a small
// finite number; the values and the integer scales stay as random as they came
int QD_NAME(sanitize)(int kind, uint8_t* tiles, int64_t count, int64_t K) {
  return qd::by_kind(kind, [&](auto k) {
    constexpr int KIND = decltype(k)::value;
    if constexpr (KIND < 0) {
      return 1;
    } else {
      using F = qd::Format<KIND>;
      const int64_t nb = K / F::L, halves = F::MIN ? 32 : 16;
      for (int64_t t = 0; t < count; ++t) {
        uint8_t* p = tiles + t * F::tile_bytes(nb);
        for (int64_t b = 0; b < nb; ++b) {
          if (F::SUPER > 0 && b % F::SUPER == 0) {
            for (int64_t i = 0; i < halves; ++i) sane_half(p + 2 * i);
            p += F::SUPER_BYTES;
          }
          if (F::SUPER == 0) {
            for (int64_t i = 0; i < halves; ++i) sane_half(p + F::VECTORS * 64 + 2 * i);
          }
          p += F::BLOCK_BYTES;
        }
      }
      return 0;
    }
  });
}

int64_t QD_NAME(tile_bytes)(int kind, int64_t K) {
  return qd::by_kind(kind, [&](auto k) -> int64_t {
    constexpr int KIND = decltype(k)::value;
    if constexpr (KIND < 0) {
      return -1;
    } else {
      return qd::Format<KIND>::tile_bytes(K / qd::Format<KIND>::L);
    }
  });
}

// attention.h: a chain (start null: row j over keys 0..ctx+j) or a tree (attend_tree's start,
// path, hidden) over K, V [Hkv, L, d], float32 (bf16 = 0) or bfloat16
void QD_NAME(attend)(int bf16, const float* Q, const void* K, const void* V, int64_t L, float* O, int64_t m, int64_t H,
                     int64_t Hkv, int64_t d, int64_t ctx, int64_t hidden, const int64_t* start, const int64_t* path, float scale,
                     int64_t window) {
  auto run = [&](auto* k, auto* v) {
    if (start == nullptr) {
      qd::attend_chain(Q, k, v, L * d, d, O, m, H, Hkv, d, ctx, scale, window);
    } else {
      qd::attend_tree(Q, k, v, L * d, d, O, m, H, Hkv, d, ctx, hidden, start, path, scale, window);
    }
  };
  if (bf16) {
    run(static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V));
  } else {
    run(static_cast<const float*>(K), static_cast<const float*>(V));
  }
}

// simd.h's exp_neg over x[0..n), n a multiple of 16
void QD_NAME(exp_neg)(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) simd::store_f(y + i, simd::exp_neg(simd::load_f(x + i)));
}

// simd::store_bf16 over x[0..n), n a multiple of 16
void QD_NAME(store_bf16)(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) simd::store_bf16(y + i, simd::load_f(x + i));
}

// rowwise.h on float32 (bf16 = 0) or bfloat16 values: op 0 RMSNorm of rows [n, h] (b: the weight
// [h]), 1 a + b, 2 a * b, 3 a converted to the other dtype (y: float32 from bfloat16, or
// bfloat16 from float32), 4 silu(a) * b, over count = n * h values; 5 each row's argmax_row of a
// [n, h] into y as int64 pairs (its index, whether the row is finite); 6 each row's sample_one of a
// [n, h] at temperature 0.7 (row 0: 0, greedy) with u = (r + 0.5) / n: q into y [n, h] float32,
// then the n tokens as floats; 7 as 6 at temperature 0.7 with each row's filters: row r % 4 = 0
// top-k 20, 1 top-p 0.9, 2 min-p 0.05, 3 all three (top-k 50, top-p 0.8, min-p 0.02); 8
// gelu_tanh(a) * b (Gemma's MLP); 9 RMSNorm of rows [n, h] with a float32 weight b (Gemma's)
void QD_NAME(rowwise)(int op, int bf16, const void* a, const void* b, void* y, int64_t n, int64_t h) {
  auto run = [&](auto* A, auto* B, auto* Y) {
    if (op == 0) qd::rms_rows(A, B, Y, n, h, 1e-6f);
    if (op == 1) qd::add_values(A, B, Y, n * h);
    if (op == 2) qd::mul_values(A, B, Y, n * h);
    if (op == 4) qd::silu_mul_values(A, B, Y, n * h);
    if (op == 8) qd::act_mul_values(qd::GELU_TANH, A, B, Y, n * h);
    if (op == 9) qd::rms_rows(A, static_cast<const float*>(b), Y, n, h, 1e-6f);
  };
  if (op == 6 || op == 7) {
    auto* q = static_cast<float*>(y);
    for (int64_t r = 0; r < n; ++r) {
      const float t = r == 0 && op == 6 ? 0.0f : 0.7f;
      const double u = (r + 0.5) / static_cast<double>(n);
      qd::Filters f;
      if (op == 7) {
        const int64_t kind = r % 4;
        f.top_k = kind == 0 ? 20 : kind == 3 ? 50 : 0;
        f.top_p = kind == 1 ? 0.9 : kind == 3 ? 0.8 : 1.0;
        f.min_p = kind == 2 ? 0.05f : kind == 3 ? 0.02f : 0.0f;
      }
      q[n * h + r] = static_cast<float>(bf16 ? qd::sample_one(static_cast<const uint16_t*>(a) + r * h, h, t, u, q + r * h, f)
                                             : qd::sample_one(static_cast<const float*>(a) + r * h, h, t, u, q + r * h, f));
    }
    return;
  }
  if (op == 5) {
    auto* out = static_cast<int64_t*>(y);
    for (int64_t r = 0; r < n; ++r) {
      bool finite = false;
      out[2 * r] = bf16 ? qd::argmax_row(static_cast<const uint16_t*>(a) + r * h, h, &finite)
                        : qd::argmax_row(static_cast<const float*>(a) + r * h, h, &finite);
      out[2 * r + 1] = finite;
    }
    return;
  }
  if (op == 3) {
    if (bf16) qd::convert_values(static_cast<const uint16_t*>(a), static_cast<float*>(y), n * h);
    else qd::convert_values(static_cast<const float*>(a), static_cast<uint16_t*>(y), n * h);
  } else if (bf16) {
    run(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), static_cast<uint16_t*>(y));
  } else {
    run(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(y));
  }
}

}  // extern "C"
