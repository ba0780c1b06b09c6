// simd.h on x86 AVX2 with FMA and F16C (Haswell and later, AMD Zen 1-3): each type is two 256-bit
// registers, lanes 0..7 in the first. Without VNNI a byte dot is vpmaddubsw (pairs of u8 x s8 into
// saturating int16) and vpmaddwd by ones (pairs of int16 into int32): exact while a pair stays
// within int16, which holds for unsigned bytes up to 127 (2 x 127 x 127) and, through the sign
// trick, for signed ones (FULL_U8 false: simd.h).
//
// With AVX-VNNI (QD_ISA_AVX2_VNNI: Intel Alder Lake and later, AMD Zen 5) the byte dot is one
// vpdpbusd on 256 bits, u8 x s8 four at a time straight into int32 lanes, exact for every byte
// (FULL_U8 true): one instruction where the other path takes three, and simd.h's plain partial
// sums. QD_EMULATE_AVX_VNNI renders vpdpbusd with AVX2 instructions, exactly, so that this path's
// kernels are tested on CPUs without it (tests/models/test_native_kernels.py).
#pragma once

#if !defined(QD_ISA_AVX2_VNNI)
#define QD_ISA_OWN_PARTIAL 1  // its own partial sums (below), not simd.h's
#endif

#include <immintrin.h>

#if defined(QD_ISA_AVX2_VNNI)
#define QD_AVX2_NS avx2_vnni
#else
#define QD_AVX2_NS avx2
#endif

namespace simd {
inline namespace QD_AVX2_NS {  // each ISA's names its own: several ISAs' builds may meet in one program

#if defined(QD_ISA_AVX2_VNNI)
constexpr const char* ISA = "avx2_vnni";
constexpr bool FULL_U8 = true;
#else
constexpr const char* ISA = "avx2";
constexpr bool FULL_U8 = false;
#endif

constexpr int F16_REGS = 8;  // F16 values the registers hold: 16 ymm
struct F16 { __m256 lo, hi; };
struct I16 { __m256i lo, hi; };
struct B64 { __m256i lo, hi; };
struct BH32 { F16 even, odd; };  // 32 bfloat16 values as float32: elements 2l and 2l + 1 of lane l

inline F16 zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1_f(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline F16 load_f(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline F16 load_f(const uint16_t* p) { return {bf8(p), bf8(p + 8)}; }
inline F16 load_f_part(const float* p, int n) {
  alignas(32) float t[16] = {};
  std::memcpy(t, p, sizeof(float) * n);
  return load_f(t);
}
inline void store_f(float* p, F16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
// 8 float32 -> bfloat16 as simd.h's to_bf16 (to nearest even, NaN -> 0x7fc0), in the low 16 bits of each lane
inline __m256i bf16_lanes(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
inline void store_bf16(uint16_t* p, F16 a) {
  // packus takes 128-bit lanes in turn: lo's 0-3, hi's 0-3, lo's 4-7, hi's 4-7; the permute puts them in order
  const __m256i w = _mm256_packus_epi32(bf16_lanes(a.lo), bf16_lanes(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(w, _MM_SHUFFLE(3, 1, 2, 0)));
}
inline F16 add(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 mul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 div(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 abs(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline float reduce_add(F16 a) {  // simd.h's tree: i + 8, then i + 4, i + 2, i + 1
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#define QD_ISA_OWN_REDUCE16 1  // simd.h's reduce_add16 a vector at a time; AVX2 transposes instead
// lane t = reduce_add(a[t]), the same tree (i + 8, i + 4, i + 2, i + 1) for 16 inputs at once: 58
// instructions against ~130 one at a time (attention reduces 16 scores so each block of keys)
inline F16 reduce_add16(const F16* a) {
  __m256 out[2];
  for (int g = 0; g < 2; ++g) {  // inputs 8g..8g+7 into lanes 0..7 of out[g]
    const F16* x = a + 8 * g;
    __m256 l2[4], l3[2];
    for (int i = 0; i < 4; ++i) {  // i + 8, then i + 4: [input i's 4 sums | input i + 4's]
      const __m256 s = _mm256_add_ps(x[i].lo, x[i].hi), t = _mm256_add_ps(x[i + 4].lo, x[i + 4].hi);
      l2[i] = _mm256_add_ps(_mm256_permute2f128_ps(s, t, 0x20), _mm256_permute2f128_ps(s, t, 0x31));
    }
    for (int i = 0; i < 2; ++i)  // i + 2: [2 of input 2i, 2 of 2i + 1 | the same of 2i + 4, 2i + 5]
      l3[i] = _mm256_add_ps(_mm256_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm256_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // i + 1: [inputs 0, 1, 2, 3 | 4, 5, 6, 7]
    out[g] = _mm256_add_ps(_mm256_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm256_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return {out[0], out[1]};
}
inline float reduce_max(F16 a) {
  const __m256 s8 = _mm256_max_ps(a.lo, a.hi);
  const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}
inline F16 half_to_f(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline F16 u8_to_f(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline F16 i8_to_f(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}

inline I16 zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 set1_i(int32_t a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
inline I16 load_i(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline I16 add_i(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline F16 to_f(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I16 round_i(F16 a) {  // the default rounding mode: to nearest, half to even
  return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)};
}
inline F16 pow2_f(I16 n) {
  const __m256i bias = _mm256_set1_epi32(127);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n.lo, bias), 23)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n.hi, bias), 23))};
}
inline void store_i8(int8_t* p, I16 a) {  // values within int8: the saturating packs keep them
  const __m256i w = _mm256_packs_epi32(a.lo, a.hi);  // lanes 0-3 8-11 | 4-7 12-15
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));  // 0-3 8-11 4-7 12-15
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(b, _MM_SHUFFLE(3, 1, 2, 0)));
}
inline int32_t reduce_add_i(I16 a) {
  const __m256i s8 = _mm256_add_epi32(a.lo, a.hi);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s4);
}

inline B64 load_b(const void* p) {
  const auto* q = static_cast<const uint8_t*>(p);
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))};
}
inline B64 load_b_part(const void* p, int n) {
  alignas(32) uint8_t t[64] = {};
  std::memcpy(t, p, n < 64 ? n : 64);
  return load_b(t);
}
inline void store_b(void* p, B64 a) {
  auto* q = static_cast<uint8_t*>(p);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), a.lo), _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), a.hi);
}
inline B64 set1_b(uint8_t a) { return {_mm256_set1_epi8(static_cast<char>(a)), _mm256_set1_epi8(static_cast<char>(a))}; }
inline B64 and_b(B64 a, B64 b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline B64 or_b(B64 a, B64 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline B64 xor_b(B64 a, B64 b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
inline B64 shift_mask(B64 a, int shift, B64 mask) {  // as isa_avx512.h: 16-bit shifts, then the mask
  if (shift >= 0) return and_b({_mm256_slli_epi16(a.lo, shift), _mm256_slli_epi16(a.hi, shift)}, mask);
  return and_b({_mm256_srli_epi16(a.lo, -shift), _mm256_srli_epi16(a.hi, -shift)}, mask);
}

#if defined(QD_ISA_AVX2_VNNI) && defined(QD_EMULATE_AVX_VNNI)
// 32 bytes: lane l += u[4l..4l+3] . s[4l..4l+3] for every u8 (vpdpbusd's sum), from AVX2: bytes 0
// and 2 of each lane as int16 (u zero-extended, s sign-extended), then bytes 1 and 3, each pair of
// products summed by vpmaddwd (at most 2 x 255 x 128: no int16 or int32 overflow)
inline __m256i dot32(__m256i acc, __m256i u, __m256i s) {
  const __m256i low = _mm256_set1_epi16(0x00ff);
  const __m256i even = _mm256_madd_epi16(_mm256_and_si256(u, low), _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8));
  const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(s, 8));
  return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
}
#elif defined(QD_ISA_AVX2_VNNI)
// 32 bytes: lane l += u[4l..4l+3] . s[4l..4l+3] for every u8, one vpdpbusd
inline __m256i dot32(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
// 32 bytes: lane l += u[4l..4l+3] . s[4l..4l+3], u <= 127 (vpmaddubsw's pairs stay within int16)
inline __m256i dot32(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
inline I16 dot_us(I16 acc, B64 u, B64 s) { return {dot32(acc.lo, u.lo, s.lo), dot32(acc.hi, u.hi, s.hi)}; }
inline __m256i dot32_ss(__m256i acc, __m256i a, __m256i b) {  // |a| unsigned, a's sign onto b
  return dot32(acc, _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
inline I16 dot_ss(I16 acc, B64 a, B64 b) { return {dot32_ss(acc.lo, a.lo, b.lo), dot32_ss(acc.hi, a.hi, b.hi)}; }
inline I16 dot_us_bcast(I16 acc, B64 u, const int32_t* p) {
  const __m256i s = _mm256_set1_epi32(*p);
  return {dot32(acc.lo, u.lo, s), dot32(acc.hi, u.hi, s)};
}
inline I16 dot_ss_bcast(I16 acc, B64 a, const int32_t* p) {
  const __m256i s = _mm256_set1_epi32(*p);
  return {dot32_ss(acc.lo, a.lo, s), dot32_ss(acc.hi, a.hi, s)};
}

inline BH32 load_bh(const uint16_t* p) {  // even elements: the low halves shifted up; odd: the high halves
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high))}};
}
inline BH32 load_bh_part(const uint16_t* p, int n) {
  alignas(32) uint16_t t[32] = {};
  std::memcpy(t, p, sizeof(uint16_t) * (n < 32 ? n : 32));
  return load_bh(t);
}
inline F16 dot_bf16(F16 acc, const BH32& x, const BH32& w) { return fmadd(x.odd, w.odd, fmadd(x.even, w.even, acc)); }

#if !defined(QD_ISA_AVX2_VNNI)
// A block's integer sum step by step (blocks.h; simd.h has the plain version the other ISAs take).
// vpmaddubsw's int16 pair sums are added in
// int16 for as many steps as cannot overflow it (group_steps: 8 steps of 4-bit values, 4 of 5-bit,
// 2 of 6-bit: each pair is at most 2 x wmax x 127), and only then widened by one vpmaddwd into
// the int32 lanes: two operations a 32 bytes a step instead of three. Exact either way.
struct Partial {
  I16 acc;
  __m256i lo, hi;  // int16 pair sums of lanes 0-7 and 8-15
};
constexpr int group_steps(int wmax) { return 32767 / (2 * wmax * 127) > 0 ? 32767 / (2 * wmax * 127) : 1; }
inline Partial begin(int32_t init) { return {set1_i(init), _mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Partial step_us(Partial p, B64 w, const int32_t* x4) {
  const __m256i x = _mm256_set1_epi32(*x4);
  p.lo = _mm256_add_epi16(p.lo, _mm256_maddubs_epi16(w.lo, x));
  p.hi = _mm256_add_epi16(p.hi, _mm256_maddubs_epi16(w.hi, x));
  // Each sum stays one chain of adds, in a register. Without this the compiler, free to
  // reassociate integer adds, computes a block's every product first and adds them as a tree,
  // whose leaves spill to the stack: 1.5x slower for 4-8 rows (interleaved, AMD EPYC Zen 4,
  // one thread, Q4_K tiles hot in cache). Costs no instruction.
  asm("" : "+x"(p.lo), "+x"(p.hi));
  return p;
}
inline Partial regroup(Partial p) {
  const __m256i ones = _mm256_set1_epi16(1);
  p.acc = {_mm256_add_epi32(p.acc.lo, _mm256_madd_epi16(p.lo, ones)), _mm256_add_epi32(p.acc.hi, _mm256_madd_epi16(p.hi, ones))};
  p.lo = p.hi = _mm256_setzero_si256();
  return p;
}
inline I16 end(Partial p) { return regroup(p).acc; }
// rows of x a weight tile is applied to at once: 8 rows' sums take the 16 ymm registers, so some
// spill, and cost about as much a row as 4 rows do, but a verification pass of 5-8 rows then
// unpacks each weight vector once
constexpr int ROW_BLOCK = 8;
#endif

inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace QD_AVX2_NS
}  // namespace simd
