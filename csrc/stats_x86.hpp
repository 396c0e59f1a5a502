// Hand-written x86-64 chunk loops for bfloat16 in AVX2+FMA and AVX-512. They do what
// GenericLoop (stats_kernel.hpp) does lane for lane and in the same order, so their results are
// the generic code's bits; only the checksum's lane split differs, and that sum is exact
// whatever the split.
//
// Why by hand: the generic code widens bfloat16 with a zero-extension and a shift per 8
// elements; splitting each 32-bit word into its even and odd element takes one operation per 8
// and needs no widening, but puts logical lanes 0, 2, 4, ... in one vector and 1, 3, 5, ... in
// another, which generic vectors cannot express without shuffles. Each function carries its own
// target attribute, so the file builds without -march and the caller picks a copy at run time.
//
// Two choices measured on Zen 4 (a KVM guest), per 8 elements in cache: the old generic AVX2
// loop 5.4 cycles, these 5.2 (AVX2) and 4.2 (AVX-512):
// * s + d is computed as fma(d, 1, s), the same bits (d * 1 is exact, one rounding): the adds
//   then run on the FMA pipes instead of sharing the add pipes with the conversions.
// * The AVX2 loop sums the checksum in a second pass over the block (it is in L1): min, max and
//   the float64 sums already take 12 of AVX2's 16 registers, and spilling cost 40%.
#pragma once

// gcc 12 flags its own _mm512_undefined_pd() (used by _mm512_cvtps_pd) as maybe-uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "stats_kernel.hpp"

namespace tracecmp {

#define TC_AVX2 __attribute__((always_inline, target("avx2,fma"))) inline
// The loops themselves are called once per block (not inlined: a caller without the target
// may not inline them), so the call costs nothing measurable.
#define TC_AVX2_LOOP __attribute__((target("avx2,fma")))
#define TC_AVX512_LOOP __attribute__((target("avx512f,avx512vl,avx2,fma")))

// Checksum lanes of 16-bit bits, 16 per chunk of 16: two per 32-bit word, S sums words mod 2^32
// and O their high halves. The low halves' sum is S - (O << 16) mod 2^32, exact because it is
// below 2^32 (at most 256 chunks: Q <= 65535 * 256 * 257 / 2 < 2^32, see kBlock).
struct Halves16x16 {
  __m256i S, O, QS, QO;
  TC_AVX2 void init() { S = O = QS = QO = _mm256_setzero_si256(); }
  TC_AVX2 void add(__m256i x) {
    S = _mm256_add_epi32(S, x);
    O = _mm256_add_epi32(O, _mm256_srli_epi32(x, 16));
    QS = _mm256_add_epi32(QS, S);
    QO = _mm256_add_epi32(QO, O);
  }
  TC_AVX2 uint64_t checksum(int64_t chunks, uint64_t start) const {
    uint32_t s[8], o[8], qs[8], qo[8];
    uint64_t P[16], Q[16];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s), S);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), O);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), QS);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qo), QO);
    for (int j = 0; j < 8; ++j) {
      P[2 * j] = static_cast<uint32_t>(s[j] - (o[j] << 16)), P[2 * j + 1] = o[j];
      Q[2 * j] = static_cast<uint32_t>(qs[j] - (qo[j] << 16)), Q[2 * j + 1] = qo[j];
    }
    return chunk_checksum(P, Q, 16, chunks, start);
  }
};

// bfloat16 -> float32 of a chunk of 16 without widening: the even elements are the low halves
// of the 32-bit words shifted up, the odd ones the high halves with the low bits cleared. Lane k
// of `even` is logical lane 2k, of `odd` lane 2k + 1; the sums keep that split and un-shuffle at
// the end.
TC_AVX2 void bf16_split(__m256i x, __m256* even, __m256* odd) {
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Logical lanes of the lane vectors even[0..n) and odd[0..n): lane k of the concatenation goes to
// 2k (even) and 2k + 1 (odd).
template <class E>
TC_INLINE void interleave(const E* even, const E* odd, E* out, int n) {
  for (int k = 0; k < n; ++k) out[2 * k] = even[k], out[2 * k + 1] = odd[k];
}

struct Avx2Loop {
  template <class T>
  static TC_AVX2_LOOP void run(const typename T::Raw* __restrict p, int64_t chunks,
                               uint64_t start, BlockLanes<T>& b) {
    static_assert(std::is_same_v<T, BF16>, "written for bfloat16 (16 lanes)");
    __m256 lo[2], hi[2];  // even, odd lanes
    alignas(32) float lanes[2][8];
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 8; ++k) lanes[h][k] = b.lo[2 * k + h];
      lo[h] = _mm256_load_ps(lanes[h]);
      for (int k = 0; k < 8; ++k) lanes[h][k] = b.hi[2 * k + h];
      hi[h] = _mm256_load_ps(lanes[h]);
    }
    // s[h][i]: the 4 doubles of half h (even, odd), piece i (lanes 0-3 or 4-7 of the half).
    __m256d s[2][2], q[2][2];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 2; ++i) s[h][i] = q[h][i] = _mm256_setzero_pd();
    const __m256d one = _mm256_set1_pd(1.0);
    for (int64_t c = 0; c < chunks; ++c) {
      prefetch_ahead<uint16_t, 16>(p + c * 16, c);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 16));
      __m256 v[2];
      bf16_split(x, &v[0], &v[1]);
      for (int h = 0; h < 2; ++h) {
        // min(v, lo) is v < lo ? v : lo: a NaN v is skipped, as in the generic loop.
        lo[h] = _mm256_min_ps(v[h], lo[h]);
        hi[h] = _mm256_max_ps(v[h], hi[h]);
        const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v[h]));
        const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v[h], 1));
        s[h][0] = _mm256_fmadd_pd(d0, one, s[h][0]), s[h][1] = _mm256_fmadd_pd(d1, one, s[h][1]);
        q[h][0] = _mm256_fmadd_pd(d0, d0, q[h][0]), q[h][1] = _mm256_fmadd_pd(d1, d1, q[h][1]);
      }
    }
    Halves16x16 sums;
    sums.init();
    for (int64_t c = 0; c < chunks; ++c)
      sums.add(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 16)));
    float l[2][8], u[2][8];
    double sd[2][8], qd[2][8];
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(l[h], lo[h]), _mm256_storeu_ps(u[h], hi[h]);
      for (int i = 0; i < 2; ++i) _mm256_storeu_pd(sd[h] + 4 * i, s[h][i]), _mm256_storeu_pd(qd[h] + 4 * i, q[h][i]);
    }
    interleave(l[0], l[1], b.lo, 8), interleave(u[0], u[1], b.hi, 8);
    interleave(sd[0], sd[1], b.s, 8), interleave(qd[0], qd[1], b.q, 8);
    b.checksum = sums.checksum(chunks, start);
  }
};

struct Avx512Loop {
  template <class T>
  static TC_AVX512_LOOP void run(const typename T::Raw* __restrict p, int64_t chunks,
                                 uint64_t start, BlockLanes<T>& b) {
    static_assert(std::is_same_v<T, BF16>, "written for bfloat16 (16 lanes)");
    __m256 lo[2], hi[2];  // even, odd lanes
    alignas(32) float lanes[2][8];
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 8; ++k) lanes[h][k] = b.lo[2 * k + h];
      lo[h] = _mm256_load_ps(lanes[h]);
      for (int k = 0; k < 8; ++k) lanes[h][k] = b.hi[2 * k + h];
      hi[h] = _mm256_load_ps(lanes[h]);
    }
    __m512d s[2], q[2];
    s[0] = s[1] = q[0] = q[1] = _mm512_setzero_pd();
    const __m512d one = _mm512_set1_pd(1.0);
    Halves16x16 sums;
    sums.init();
    for (int64_t c = 0; c < chunks; ++c) {
      prefetch_ahead<uint16_t, 16>(p + c * 16, c);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 16));
      __m256 v[2];
      bf16_split(x, &v[0], &v[1]);
      for (int h = 0; h < 2; ++h) {
        lo[h] = _mm256_min_ps(v[h], lo[h]);
        hi[h] = _mm256_max_ps(v[h], hi[h]);
        const __m512d d = _mm512_cvtps_pd(v[h]);
        s[h] = _mm512_fmadd_pd(d, one, s[h]);
        q[h] = _mm512_fmadd_pd(d, d, q[h]);
      }
      sums.add(x);
    }
    float l[2][8], u[2][8];
    double sd[2][8], qd[2][8];
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(l[h], lo[h]), _mm256_storeu_ps(u[h], hi[h]);
      _mm512_storeu_pd(sd[h], s[h]), _mm512_storeu_pd(qd[h], q[h]);
    }
    interleave(l[0], l[1], b.lo, 8), interleave(u[0], u[1], b.hi, 8);
    interleave(sd[0], sd[1], b.s, 8), interleave(qd[0], qd[1], b.q, 8);
    b.checksum = sums.checksum(chunks, start);
  }
};

#undef TC_AVX2
#undef TC_AVX2_LOOP
#undef TC_AVX512_LOOP

}  // namespace tracecmp
