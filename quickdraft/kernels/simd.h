// The vector layer every kernel is written against: 16 float32 lanes (F16), 16 int32 lanes
// (I16) and 64 bytes (B64, byte 4l..4l+3 belonging to lane l), with the operations the kernels
// use. One header per instruction set implements it (arch/: isa_avx512.h, isa_avx2.h with and
// without AVX-VNNI, isa_neon.h, isa_portable.h), chosen when the module is compiled (QD_ISA_*, set by kernels/__init__.py);
// adding an instruction set is adding a header. The kernels never name an intrinsic.
//
// The contract that keeps the kernels batch invariant and, where it can, equal across ISAs:
// - every lane operation is the IEEE operation on that lane alone (fmadd and fnmadd fused,
//   exactly one rounding), so a lane's bits do not depend on the ISA;
// - reduce_add is one fixed tree: lanes i and i + 8, then i and i + 4, i + 2, i + 1 (what
//   _mm512_reduce_add_ps does), on every ISA; reduce_add16 is that tree for 16 vectors at once;
// - the integer dots are exact: dot_us(acc, u, s) adds to lane l the sum of its 4 byte products
//   u8 x s8 for every u8 when FULL_U8 is true, and for u8 <= 127 otherwise (AVX2's vpmaddubsw
//   saturates past that: callers with wider unsigned values use dot_ss, ggml's sign trick);
//   dot_ss(acc, a, b) is exact for signed a, and b in -127..127.
// - pow2_f(n) is 2^n exactly for n in -126..127 (n + 127 shifted into the exponent field);
// - exp_neg (below) is written with these lane operations only, so its bits too are the same on
//   every ISA;
// - dot_bf16 is the one operation whose rounding is the ISA's own (AVX512-BF16's vdpbf16ps
//   against two FMAs elsewhere): a bfloat16 linear's bits differ across ISAs, and within one
//   ISA they are still one fixed sequence per output.
#pragma once

#include <cstdint>
#include <cstring>

namespace simd {

// float -> bfloat16, round to nearest even as torch does (NaN -> a quiet NaN)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace simd

// QD_ISA_NS: an inline namespace that the kernels' own names (linear.h, blocks.h) go in too, so
// that two ISAs' builds of one template never meet under one symbol
#if defined(QD_ISA_AVX512)
#include "arch/isa_avx512.h"
#define QD_ISA_NS avx512
#elif defined(QD_ISA_AVX2)
#include "arch/isa_avx2.h"
#define QD_ISA_NS avx2
#elif defined(QD_ISA_AVX2_VNNI)
#include "arch/isa_avx2.h"
#define QD_ISA_NS avx2_vnni
#elif defined(QD_ISA_NEON)
#include "arch/isa_neon.h"
#define QD_ISA_NS neon
#elif defined(QD_ISA_PORTABLE)
#include "arch/isa_portable.h"
#define QD_ISA_NS portable
#else
#error "define one of QD_ISA_AVX512, QD_ISA_AVX2, QD_ISA_AVX2_VNNI, QD_ISA_NEON, QD_ISA_PORTABLE"
#endif

// A block's integer sum step by step (blocks.h): begin at the block's starting value, add steps
// of unsigned values up to `wmax`, regroup every group_steps(wmax) steps, end with the sum. An ISA
// whose byte dot adds straight into int32 lanes (all but AVX2, which defines its own: isa_avx2.h)
// takes these, where a group is the whole block.
#if !defined(QD_ISA_OWN_PARTIAL)
namespace simd {
inline namespace QD_ISA_NS {
using Partial = I16;
constexpr int group_steps(int) { return 1 << 20; }
inline Partial begin(int32_t init) { return set1_i(init); }
inline Partial step_us(Partial p, B64 w, const int32_t* x4) { return dot_us_bcast(p, w, x4); }
inline Partial regroup(Partial p) { return p; }
inline I16 end(Partial p) { return p; }
constexpr int ROW_BLOCK = 8;  // rows of x a weight tile is applied to at once (blocks.h)
}  // namespace QD_ISA_NS
}  // namespace simd
#endif

namespace simd {
inline namespace QD_ISA_NS {

#if !defined(QD_ISA_OWN_REDUCE16)
// lane t = reduce_add(a[t]): sixteen reductions at once, one at a time (isa_avx512.h has its own)
inline F16 reduce_add16(const F16* a) {
  alignas(64) float s[16];
  for (int t = 0; t < 16; ++t) s[t] = reduce_add(a[t]);
  return load_f(s);
}
#endif

// e^x lane by lane for x <= 0 (softmax's exponents, the row's max subtracted), from lane
// operations only, so the same bits on every ISA: x = n ln 2 + r, |r| <= ln 2 / 2, with
// n = round(x log2 e) and r by Cody and Waite's two-part ln 2; e^r by Cephes' expf polynomial;
// then times 2^n. Within 2 ulp of e^x (tests/native/kernels_test.cpp). x is
// clamped to -87 first, so that 2^n stays a normal float: e^-87 ~ 1.6e-38 stands for any smaller
// value, a weight no sum of softmax terms (the largest is 1) can tell from 0. max's operands in
// this order keep a NaN a NaN on every ISA (x86's max returns its second operand where one is NaN).
inline F16 exp_neg(F16 x) {
  x = max(set1_f(-87.0f), x);
  const I16 n = round_i(mul(x, set1_f(1.44269504088896341f)));
  const F16 nf = to_f(n);
  F16 r = fnmadd(nf, set1_f(0.693359375f), x);  // ln 2's first 9 bits: nf times it is exact
  r = fnmadd(nf, set1_f(-2.12194440e-4f), r);
  F16 p = set1_f(1.9875691500e-4f);
  p = fmadd(p, r, set1_f(1.3981999507e-3f));
  p = fmadd(p, r, set1_f(8.3334519073e-3f));
  p = fmadd(p, r, set1_f(4.1665795894e-2f));
  p = fmadd(p, r, set1_f(1.6666665459e-1f));
  p = fmadd(p, r, set1_f(5.0000001201e-1f));
  const F16 e = add(fmadd(p, mul(r, r), r), set1_f(1.0f));  // 1 + r + r^2 p(r)
  return mul(e, pow2_f(n));
}

}  // namespace QD_ISA_NS
}  // namespace simd
