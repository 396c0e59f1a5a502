// The fused statistics pass: pure C++17, no Python and no torch (see cstats.cpp for why).
//
// One read of the tensor yields min, max, the sum and the sum of squares of the finite elements,
// the NaN and Inf counts and the bitwise checksum, exactly as defined in
// tracecmp/capture/stats.py.
//
// Layout of the work, and why:
// * Elements are taken in blocks of kBlock in logical (row-major) order. A strided tensor is
//   gathered block by block into a small buffer, so one kernel serves every layout and the
//   numbers never depend on the layout.
// * Inside a block every statistic is kept in T::kLanes independent lanes (lane = logical index
//   mod kLanes), written with GCC/Clang generic vectors: branch-free, no intrinsics, no
//   -ffast-math, compiled for SSE2/NEON and, on x86-64, also for AVX2 (picked at run time);
//   bfloat16 also has hand-written AVX2 and AVX-512 loops (stats_x86.hpp) that do the same
//   operations lane for lane. kLanes is fixed per dtype and the compiler may not reassociate,
//   so the summation order (hence every bit of the result) is the same on every CPU, ISA and
//   thread count.
// * Sums are in double: per lane within a block (kBlock / kLanes terms, at most 256), then the
//   lanes by a fixed tree and the blocks by streaming pairwise summation. Every term is exact
//   in double (fp32 and narrower values and their squares), so the error of a sum over B
//   blocks is at most (kBlock / kLanes - 1 + log2(kLanes) + 2 ceil(log2 B)) * 2^-53 * sum |x_i|:
//   3.2e-14 * sum |x_i| for 100M fp32 elements (csrc/README.md).
// * NaN/Inf are rare, so the first pass over a block sums unmasked values; a non-finite block
//   sum proves the block holds a NaN/Inf (or, for fp64, overflowed) and only then the block is
//   summed again with masking and counting. For finite blocks both passes give the same bits.
// * The checksum sum_i u_i * (2i + 1) mod 2^64 needs no per-element multiply: each lane keeps a
//   running sum P of u and a running sum Q of P, and sum_c c * u_c = C * P - Q over C chunks.
//   Integer sums wrap associatively, so the checksum is exact for any split.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tracecmp {

// At most 256 chunks of lanes per block: keeps 32-bit P/Q lanes of 8- and 16-bit types from
// overflowing (Q <= 65535 * 256 * 257 / 2 < 2^32) and a gathered block of fp64 (16 KiB) in L1.
constexpr int64_t kBlock = 2048;
constexpr int kMaxDims = 64;

// Needs GCC or Clang (generic vectors); setup.py makes the build optional for other compilers.
#define TC_INLINE inline __attribute__((always_inline))

// Dtype codes shared with tracecmp/capture/stats.py (_NATIVE_CODES).
enum DType : int {
  kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kU8 = 4, kI8 = 5, kI16 = 6, kI32 = 7, kI64 = 8,
  kBool = 9, kNumDTypes = 10
};

template <class To, class From>
TC_INLINE To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// GCC/Clang generic vectors of G elements: plain C++ arithmetic the compiler maps to the
// target's SIMD (SSE2, AVX2, NEON) without intrinsics. Every vector is sized to one register of
// the ISA being compiled for (kWidth below), so kLanes logical lanes are kLanes / G vectors:
// wider generic vectors are split into scalars by gcc, and plain lane arrays left to the
// auto-vectorizer stayed in memory between iterations (both measured 3-10x slower).
template <class E, int G>
struct VecOf {
  typedef E type __attribute__((vector_size(sizeof(E) * G)));
};
template <class E, int G>
using Vec = typename VecOf<E, G>::type;

// Element-wise vector conversion: gcc 12 lowers __builtin_convertvector's widening casts to
// 128-bit halves; this loop becomes the single instruction (vcvtps2pd, vpmovzxdq, ...).
template <class To, class From>
TC_INLINE To convert(From x) {
  To r;
  for (int i = 0; i < static_cast<int>(sizeof(To) / sizeof(r[0])); ++i) r[i] = x[i];
  return r;
}

template <class V, class E>
TC_INLINE V load(const E* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// Per dtype: Raw = the stored bits (read as unsigned, which is also u_i of the checksum),
// Val = the type min/max are taken in, Lane = the type of the checksum's P/Q lanes; value()
// exists for one element and for a vector and both give the same (exact) values.
// kExactSquare: the square of every value is exact in double, so q + d * d may be fused.
// kLanes: the number of logical lanes (lane = logical index mod kLanes), part of the numbers'
// definition (the order of the float64 additions). 8 lets the generic vector code keep its
// accumulators in the 16 AVX2 registers. bfloat16 has 16: its x86 loops (stats_x86.hpp) split a
// chunk into even and odd elements, which needs 16 lanes to fill 256-bit vectors.
struct F32 {
  using Raw = uint32_t; using Val = float; using Lane = uint64_t;
  static constexpr bool kFloat = true, kExactSquare = true;
  static constexpr int64_t kLanes = 8;
  static TC_INLINE Val value(Raw r) { return bit_cast<float>(r); }
  template <int G>
  static TC_INLINE Vec<Val, G> value(Vec<Raw, G> r) { return bit_cast<Vec<Val, G>>(r); }
};

struct F64 {
  using Raw = uint64_t; using Val = double; using Lane = uint64_t;
  static constexpr bool kFloat = true, kExactSquare = false;
  static constexpr int64_t kLanes = 8;
  static TC_INLINE Val value(Raw r) { return bit_cast<double>(r); }
  template <int G>
  static TC_INLINE Vec<Val, G> value(Vec<Raw, G> r) { return bit_cast<Vec<Val, G>>(r); }
};

struct BF16 {
  using Raw = uint16_t; using Val = float; using Lane = uint32_t;
  static constexpr bool kFloat = true, kExactSquare = true;
  static constexpr int64_t kLanes = 16;
  static TC_INLINE Val value(Raw r) { return bit_cast<float>(static_cast<uint32_t>(r) << 16); }
  template <int G>
  static TC_INLINE Vec<Val, G> value(Vec<Raw, G> r) {
    return bit_cast<Vec<Val, G>>(convert<Vec<uint32_t, G>>(r) << 16);
  }
};

// Exact int32 -> float conversion of one value or a vector of them (F16 subnormals).
template <class F, class I>
TC_INLINE F to_float(I x) {
  if constexpr (std::is_arithmetic_v<I>) {
    return static_cast<F>(x);
  } else {
    return convert<F>(x);
  }
}

struct F16 {
  using Raw = uint16_t; using Val = float; using Lane = uint32_t;
  static constexpr bool kFloat = true, kExactSquare = true;
  static constexpr int64_t kLanes = 8;
  // Half bits (zero-extended to 32) -> float bits. Integer-only for normals/Inf/NaN and an
  // exact int->float scale for subnormals, so it is branch-free and unaffected by
  // flush-denormal CPU modes. U is uint32_t or a vector of them, I and F the matching int32
  // and float types.
  template <class U, class I, class F>
  static TC_INLINE U float_bits(U h) {
    const U sign = (h & 0x8000u) << 16;
    const U em = h & 0x7fffu;
    const U normal = (em << 13) + ((127u - 15u) << 23);
    const U special = (em << 13) | 0x7f800000u;
    const U sub = bit_cast<U>(to_float<F>(bit_cast<I>(em)) * 0x1p-24f);
    const U bits = em < 0x400u ? sub : normal;
    return (em >= 0x7c00u ? special : bits) | sign;
  }
  static TC_INLINE Val value(Raw r) { return bit_cast<float>(float_bits<uint32_t, int32_t, float>(r)); }
  template <int G>
  static TC_INLINE Vec<Val, G> value(Vec<Raw, G> r) {
    return bit_cast<Vec<Val, G>>(float_bits<Vec<uint32_t, G>, Vec<int32_t, G>, Vec<float, G>>(
        convert<Vec<uint32_t, G>>(r)));
  }
};

template <class RawT, class SignedT, class ValT, class LaneT>
struct IntBase {
  using Raw = RawT; using Val = ValT; using Lane = LaneT;
  static constexpr bool kFloat = false, kExactSquare = sizeof(RawT) <= 2;
  static constexpr int64_t kLanes = 8;
  static TC_INLINE Val value(Raw r) { return static_cast<SignedT>(r); }
  template <int G>
  static TC_INLINE Vec<Val, G> value(Vec<Raw, G> r) {
    if constexpr (std::is_same_v<SignedT, Val>) {
      return bit_cast<Vec<Val, G>>(r);
    } else {
      return convert<Vec<Val, G>>(bit_cast<Vec<SignedT, G>>(r));
    }
  }
};
struct U8 : IntBase<uint8_t, uint8_t, int32_t, uint32_t> {};
struct I8 : IntBase<uint8_t, int8_t, int32_t, uint32_t> {};
struct I16 : IntBase<uint16_t, int16_t, int32_t, uint32_t> {};
struct I32 : IntBase<uint32_t, int32_t, int32_t, uint64_t> {};
struct I64 : IntBase<uint64_t, int64_t, int64_t, uint64_t> {};
struct Bool : IntBase<uint8_t, uint8_t, int32_t, uint32_t> {
  // torch reads any non-zero byte as true.
  static TC_INLINE Val value(Raw r) { return r != 0; }
  template <int G>
  static TC_INLINE Vec<Val, G> value(Vec<Raw, G> r) {
    return convert<Vec<Val, G>>(r) != 0 ? Vec<Val, G>{} + 1 : Vec<Val, G>{};
  }
};

// Stops the compiler from fusing the multiply into the following add (FMA). The build allows
// contraction (-ffp-contract=fast) because for kExactSquare types fma(d, d, q) == q + d * d
// bit for bit; for the others it would make results depend on the CPU's ISA.
template <class V>
TC_INLINE void no_contract(V& x) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+v"(x));
#elif defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  __asm__("" : "+m"(x));
#endif
}

template <class T, class V>
TC_INLINE V add_square(V acc, V d) {
  V sq = d * d;
  if constexpr (!T::kExactSquare) no_contract(sq);
  return acc + sq;
}

// The k-th H-sized piece of vector v (compiles to a register extract).
template <class H, class V>
TC_INLINE H piece(V v, int k) {
  H h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + k * sizeof(H), sizeof(H));
  return h;
}

// Streaming pairwise summation of (sum, sum of squares) pairs: a binary counter of partial
// sums, so pushing the same sequence always gives the same bits, whoever pushes it.
struct Pairwise {
  double s[64], q[64];
  int top = 0;
  uint64_t count = 0;

  void push(double bs, double bq) {
    for (uint64_t n = count++; n & 1; n >>= 1) {
      --top;
      bs = s[top] + bs;
      bq = q[top] + bq;
    }
    s[top] = bs;
    q[top] = bq;
    ++top;
  }
  void total(double* sum, double* sumsq) const {
    double a = 0.0, b = 0.0;
    for (int i = top - 1; i >= 0; --i) {
      a = s[i] + a;
      b = q[i] + b;
    }
    *sum = a;
    *sumsq = b;
  }
};

// Everything but the moments, for a run of blocks; combining two is exact and associative.
template <class T>
struct Partial {
  using Val = typename T::Val;
  Val lo = std::numeric_limits<Val>::has_infinity ? std::numeric_limits<Val>::infinity()
                                                  : std::numeric_limits<Val>::max();
  Val hi = std::numeric_limits<Val>::has_infinity ? -std::numeric_limits<Val>::infinity()
                                                  : std::numeric_limits<Val>::lowest();
  int64_t nan = 0, inf = 0;
  uint64_t checksum = 0;

  void merge(const Partial& o) {
    lo = o.lo < lo ? o.lo : lo;
    hi = o.hi > hi ? o.hi : hi;
    nan += o.nan;
    inf += o.inf;
    checksum += o.checksum;
  }
};

template <class V, int64_t N>
TC_INLINE V tree_sum(const V* v) {
  V t[N];
  for (int64_t i = 0; i < N; ++i) t[i] = v[i];
  for (int64_t w = N / 2; w >= 1; w /= 2)
    for (int64_t i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}

// Lanes per vector of W bytes for element type E (at most L).
template <class E, int W, int64_t L>
constexpr int kWidth = static_cast<int>(sizeof(E)) * L <= W ? static_cast<int>(L) : W / sizeof(E);

// sum over chunks c < C and lanes l < L of u[c][l] * (2 * (start + c * L + l) + 1) mod 2^64,
// from P[l] = sum_c u[c][l] and Q[l] = sum_c (P[l] after chunk c): sum_c c * u[c][l] is
// C * P[l] - Q[l]. Any lane split gives the same value, so each loop picks its own.
TC_INLINE uint64_t chunk_checksum(const uint64_t* P, const uint64_t* Q, int64_t L, int64_t C,
                                  uint64_t start) {
  uint64_t checksum = 0;
  for (int64_t l = 0; l < L; ++l) {
    const uint64_t w = static_cast<uint64_t>(C) * P[l] - Q[l];
    checksum += (2 * (start + static_cast<uint64_t>(l)) + 1) * P[l] + 2 * static_cast<uint64_t>(L) * w;
  }
  return checksum;
}

// Per-lane running sums for the checksum: P[l] sums u over the chunks so far, Q[l] sums P.
// General case: each u zero-extended into its own T::Lane.
template <class T, int W, bool kPairs = sizeof(typename T::Raw) == 4>
struct ChecksumLanes {
  using Raw = typename T::Raw;
  using Lane = typename T::Lane;
  static constexpr int64_t L = T::kLanes;
  static constexpr int G = kWidth<Lane, W, L>;
  Vec<Lane, G> P[L / G] = {}, Q[L / G] = {};

  TC_INLINE void add(const Raw* __restrict r) {
#pragma GCC unroll 8
    for (int g = 0; g < L / G; ++g) {
      P[g] += convert<Vec<Lane, G>>(load<Vec<Raw, G>>(r + g * G));
      Q[g] += P[g];
    }
  }
  TC_INLINE void lanes(uint64_t* p, uint64_t* q) const {
    Lane a[L], b[L];
    std::memcpy(a, P, sizeof a);
    std::memcpy(b, Q, sizeof b);
    for (int l = 0; l < L; ++l) p[l] = a[l], q[l] = b[l];
  }
};

// 32-bit u: two per 64-bit word, no widening. S sums whole words and O their high halves;
// the low halves' sum is S - (O << 32) mod 2^64. One shift replaces two zero-extensions.
template <class T, int W>
struct ChecksumLanes<T, W, true> {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "element 2j is the low half");
  using Raw = typename T::Raw;
  static constexpr int kWords = T::kLanes / 2;
  static constexpr int G = W / 8 < kWords ? W / 8 : kWords;
  using V = Vec<uint64_t, G>;
  V S[kWords / G] = {}, O[kWords / G] = {}, QS[kWords / G] = {}, QO[kWords / G] = {};

  TC_INLINE void add(const Raw* __restrict r) {
#pragma GCC unroll 8
    for (int g = 0; g < kWords / G; ++g) {
      const V x = load<V>(r + 2 * g * G);
      S[g] += x;
      O[g] += x >> 32;
      QS[g] += S[g];
      QO[g] += O[g];
    }
  }
  TC_INLINE void lanes(uint64_t* p, uint64_t* q) const {
    uint64_t s[kWords], o[kWords], qs[kWords], qo[kWords];
    std::memcpy(s, S, sizeof s);
    std::memcpy(o, O, sizeof o);
    std::memcpy(qs, QS, sizeof qs);
    std::memcpy(qo, QO, sizeof qo);
    for (int j = 0; j < kWords; ++j) {
      p[2 * j] = s[j] - (o[j] << 32);
      p[2 * j + 1] = o[j];
      q[2 * j] = qs[j] - (qo[j] << 32);
      q[2 * j + 1] = qo[j];
    }
  }
};

// Second look at a block whose unmasked sum was not finite: count NaN/Inf and sum the finite
// elements. Lanes and order match the fast pass, so finite elements add up to the same bits.
// The tests run on the double value (d - d is 0 exactly when d is finite), so every dtype
// shares them.
template <class T, int W>
TC_INLINE void masked_moments(const typename T::Raw* __restrict p, int64_t n, double* bs,
                              double* bq, int64_t* nan, int64_t* inf) {
  using Raw = typename T::Raw;
  constexpr int64_t L = T::kLanes;
  constexpr int GD = kWidth<double, W, L>;
  using VD = Vec<double, GD>;
  using VI = Vec<int64_t, GD>;
  VD vs[L / GD] = {}, vq[L / GD] = {};
  VI vn[L / GD] = {}, vi[L / GD] = {};
  const int64_t chunks = n / L;
  for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 8
    for (int g = 0; g < L / GD; ++g) {
      const VD d = convert<VD>(T::template value<GD>(load<Vec<Raw, GD>>(p + c * L + g * GD)));
      const VI is_nan = d != d;
      const VI finite = d - d == VD{};
      vn[g] -= is_nan;              // masks are -1 where true
      vi[g] -= ~(finite | is_nan);
      const VD x = finite ? d : VD{};
      vs[g] += x;
      vq[g] = add_square<T>(vq[g], x);
    }
  }
  double s[L], q[L];
  int64_t cn[L], ci[L];
  std::memcpy(s, vs, sizeof s);
  std::memcpy(q, vq, sizeof q);
  std::memcpy(cn, vn, sizeof cn);
  std::memcpy(ci, vi, sizeof ci);
  for (int64_t k = chunks * L; k < n; ++k) {
    const int64_t l = k - chunks * L;
    const double d = static_cast<double>(T::value(p[k]));
    const bool is_nan = d != d, finite = d - d == 0.0;
    cn[l] += is_nan;
    ci[l] += !finite && !is_nan;
    const double x = finite ? d : 0.0;
    s[l] += x;
    q[l] = add_square<T>(q[l], x);
  }
  *bs = tree_sum<double, L>(s);
  *bq = tree_sum<double, L>(q);
  for (int64_t l = 0; l < L; ++l) *nan += cn[l], *inf += ci[l];
}

// How far ahead of the chunk loop to fetch memory. The loop is latency-bound (each lane's sum is
// one chain of float64 adds), so the core's reorder window holds only ~1 KB of loads ahead of it
// and, from DRAM or a busy L3, the hardware prefetchers alone left it at half the bandwidth a
// plain sum() reaches. 4 KB covers ~100 ns of memory latency at the loop's speed.
constexpr int64_t kPrefetchBytes = 4096;

// Chunk c of a chunk loop at r: one prefetch per 64-byte line, kPrefetchBytes ahead (a prefetch
// past the tensor's end is harmless: it never faults).
template <class Raw, int64_t L>
TC_INLINE void prefetch_ahead(const Raw* r, int64_t c) {
  constexpr int64_t kEvery = L * sizeof(Raw) >= 64 ? 1 : 64 / (L * sizeof(Raw));
  if (c % kEvery == 0) __builtin_prefetch(reinterpret_cast<const char*>(r) + kPrefetchBytes);
}

// The state of one block's lanes in logical lane order (lane l holds the elements whose index
// in the block is l mod T::kLanes), filled by a chunk loop: on entry lo/hi hold the running
// min/max, on exit also the lanes' sums and the checksum of the full chunks.
template <class T>
struct BlockLanes {
  static constexpr int64_t L = T::kLanes;
  typename T::Val lo[L], hi[L];
  double s[L], q[L];
  uint64_t checksum;
};

// The chunk loop in generic vectors of W bytes. Each statistic uses full-width vectors of its
// own type (8 floats but 4 doubles for AVX2), so every instruction does a register's worth of
// work. Hand-written loops (stats_x86.hpp) must give the same bits lane for lane.
template <int W>
struct GenericLoop {
  template <class T>
  static TC_INLINE void run(const typename T::Raw* __restrict p, int64_t chunks, uint64_t start,
                            BlockLanes<T>& b) {
    using Raw = typename T::Raw;
    using Val = typename T::Val;
    constexpr int64_t L = T::kLanes;
    constexpr int GV = kWidth<Val, W, L>, GD = kWidth<double, W, L>;
    using VV = Vec<Val, GV>;
    using VD = Vec<double, GD>;
    VV vlo[L / GV], vhi[L / GV];
    VD vs[L / GD] = {}, vq[L / GD] = {};
    ChecksumLanes<T, W> sums;
    std::memcpy(vlo, b.lo, sizeof vlo);
    std::memcpy(vhi, b.hi, sizeof vhi);
    for (int64_t c = 0; c < chunks; ++c) {
      const Raw* __restrict r = p + c * L;
      prefetch_ahead<Raw, L>(r, c);
      VV v[L / GV];
#pragma GCC unroll 8
      for (int g = 0; g < L / GV; ++g) {
        v[g] = T::template value<GV>(load<Vec<Raw, GV>>(r + g * GV));
        // a < b ? a : b skips a NaN a (the comparison is false), as the definition asks.
        vlo[g] = v[g] < vlo[g] ? v[g] : vlo[g];
        vhi[g] = v[g] > vhi[g] ? v[g] : vhi[g];
      }
#pragma GCC unroll 8
      for (int g = 0; g < L / GD; ++g) {
        // Same-width types convert straight from memory (cvtps2pd m128 is one instruction);
        // narrower ones reuse the converted values above.
        constexpr int kPieces = GV / GD;
        VD d;
        if constexpr (sizeof(Raw) == sizeof(Val)) {
          d = convert<VD>(T::template value<GD>(load<Vec<Raw, GD>>(r + g * GD)));
        } else {
          d = convert<VD>(piece<Vec<Val, GD>>(v[g / kPieces], g % kPieces));
        }
        vs[g] += d;
        vq[g] = add_square<T>(vq[g], d);
      }
      sums.add(r);
    }
    std::memcpy(b.lo, vlo, sizeof b.lo);
    std::memcpy(b.hi, vhi, sizeof b.hi);
    std::memcpy(b.s, vs, sizeof b.s);
    std::memcpy(b.q, vq, sizeof b.q);
    uint64_t P[L], Q[L];
    sums.lanes(P, Q);
    b.checksum = chunk_checksum(P, Q, L, chunks, start);
  }
};

// One block of n <= kBlock contiguous elements whose first logical index is `start`: the full
// chunks through Loop, then the tail (only in the tensor's last block) lane by lane.
template <class T, class Loop, int W>
TC_INLINE void block(const typename T::Raw* __restrict p, int64_t n, uint64_t start,
                     Partial<T>& part, Pairwise& pw) {
  using Val = typename T::Val;
  constexpr int64_t L = T::kLanes;
  BlockLanes<T> b;
  for (int64_t l = 0; l < L; ++l) b.lo[l] = part.lo, b.hi[l] = part.hi;
  const int64_t chunks = n / L;
  Loop::template run<T>(p, chunks, start, b);
  uint64_t checksum = b.checksum;
  // The tail goes to the lanes its index would use.
  for (int64_t k = chunks * L; k < n; ++k) {
    const int64_t l = k - chunks * L;
    const Val v = T::value(p[k]);
    b.lo[l] = v < b.lo[l] ? v : b.lo[l];
    b.hi[l] = v > b.hi[l] ? v : b.hi[l];
    const double d = static_cast<double>(v);
    b.s[l] += d;
    b.q[l] = add_square<T>(b.q[l], d);
    checksum += static_cast<uint64_t>(p[k]) * (2 * (start + k) + 1);
  }
  for (int64_t l = 0; l < L; ++l) {
    part.lo = b.lo[l] < part.lo ? b.lo[l] : part.lo;
    part.hi = b.hi[l] > part.hi ? b.hi[l] : part.hi;
  }
  part.checksum += checksum;
  double bs = tree_sum<double, L>(b.s);
  double bq = tree_sum<double, L>(b.q);
  if (T::kFloat && !std::isfinite(bs)) masked_moments<T, W>(p, n, &bs, &bq, &part.nan, &part.inf);
  pw.push(bs, bq);
}

// Logical-order reader of a strided tensor (element strides, dims already coalesced).
struct Cursor {
  int nd = 0;
  int64_t size[kMaxDims], stride[kMaxDims], idx[kMaxDims];
  int64_t offset = 0;

  void seek(int64_t linear) {
    offset = 0;
    for (int d = nd - 1; d >= 0; --d) {
      idx[d] = linear % size[d];
      linear /= size[d];
      offset += idx[d] * stride[d];
    }
  }
  // Copy the next `count` elements in logical order into buf.
  template <class Raw>
  void fill(const Raw* base, Raw* __restrict buf, int64_t count) {
    const int in = nd - 1;
    const int64_t st = stride[in];
    while (count > 0) {
      const int64_t run = std::min(count, size[in] - idx[in]);
      const Raw* src = base + offset;
      if (st == 1) {
        std::memcpy(buf, src, run * sizeof(Raw));
      } else {
        for (int64_t k = 0; k < run; ++k) buf[k] = src[k * st];
      }
      buf += run;
      count -= run;
      offset += run * st;
      idx[in] += run;
      if (idx[in] < size[in]) continue;
      offset -= size[in] * st;
      idx[in] = 0;
      for (int d = in - 1; d >= 0; --d) {
        offset += stride[d];
        if (++idx[d] < size[d]) break;
        offset -= size[d] * stride[d];
        idx[d] = 0;
      }
    }
  }
};

// Blocks [b0, b1) of a tensor of `numel` elements; contiguous when cur == nullptr.
// With sums == nullptr block moments go to pw, otherwise to sums[2b], sums[2b+1].
// Loop runs the full chunks; W is the vector width of the generic code around it.
template <class T, class Loop, int W>
TC_INLINE void run_blocks(const void* data, const Cursor* cur, int64_t numel, int64_t b0,
                          int64_t b1, Partial<T>& part, Pairwise& pw, double* sums) {
  using Raw = typename T::Raw;
  const Raw* base = static_cast<const Raw*>(data);
  Raw buf[kBlock];  // gather buffer for strided tensors (uninitialised: costs nothing)
  Cursor c;
  if (cur) {
    c = *cur;
    c.seek(b0 * kBlock);
  }
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * kBlock;
    const int64_t n = std::min(kBlock, numel - start);
    const Raw* p = base + start;
    if (cur) {
      c.fill(base, buf, n);
      p = buf;
    }
    if (sums) {
      Pairwise one;
      block<T, Loop, W>(p, n, static_cast<uint64_t>(start), part, one);
      sums[2 * b] = one.s[0];
      sums[2 * b + 1] = one.q[0];
    } else {
      block<T, Loop, W>(p, n, static_cast<uint64_t>(start), part, pw);
    }
  }
}

}  // namespace tracecmp
