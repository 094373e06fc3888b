// Vectors, loads and stores, table lookups and fused multiply-adds of one ISA
// path, shared by its row kernels (encode_rows.h and the files after it).
// isa_path_rows.h includes this file once per ISA path, inside that path's
// namespace and under its `#pragma GCC target` (no include guard).
// OPTAX4BIT_ROWS_AVX512 is 1 in the AVX-512 path, OPTAX4BIT_ROWS_AVX2 in the
// AVX2 path, OPTAX4BIT_ROWS_NEON in the baseline path on aarch64.
#ifndef OPTAX4BIT_CPU_VECTOR_OPS_H_  // once per ISA path: isa_path_rows.h resets it
#define OPTAX4BIT_CPU_VECTOR_OPS_H_

// Vectors of kLanes floats or ints (GCC/Clang vector extensions), as wide as
// the path's registers: 16 lanes with AVX-512, where a 16-entry table lookup is
// one permute (vpermps); 8 with AVX2, where it is two and a blend (wider
// vectors than the registers GCC keeps in memory and permutes element by
// element). NEON has 4, where a 16-entry lookup is one TBL of four
// registers. The x86 baseline path takes 16 lanes, as GCC lowers them.
#if OPTAX4BIT_ROWS_AVX2
constexpr int kLanes = 8;
#elif OPTAX4BIT_ROWS_NEON
constexpr int kLanes = 4;
#else
constexpr int kLanes = 16;
#endif
typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));
typedef uint32_t VU __attribute__((vector_size(4 * kLanes)));
typedef uint16_t VW __attribute__((vector_size(2 * kLanes)));
typedef uint8_t VB __attribute__((vector_size(kLanes)));

inline VF LoadV(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreV(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }

// Constant shuffles of two vectors a, b: lane k of the result is lane
// kLane(k) of a's kLanes lanes followed by b's (GCC's __builtin_shuffle takes
// the lanes as a vector, Clang's __builtin_shufflevector as constants).
template <int (*kLane)(int), int... k>
constexpr VI LaneVector(std::integer_sequence<int, k...>) {
  return VI{kLane(k)...};
}
template <int (*kLane)(int), typename V, int... k>
inline V ShuffleLanes(V a, V b, std::integer_sequence<int, k...> lanes) {
#ifdef __clang__
  return __builtin_shufflevector(a, b, kLane(k)...);
#else
  return __builtin_shuffle(a, b, LaneVector<kLane>(lanes));
#endif
}
constexpr int EvenLane(int k) { return 2 * k; }
constexpr int OddLane(int k) { return 2 * k + 1; }
// Even elements e and odd elements o back in order: the first kLanes, then
// the next kLanes.
constexpr int LowInterleavedLane(int k) { return k % 2 * kLanes + k / 2; }
constexpr int HighInterleavedLane(int k) { return k % 2 * kLanes + kLanes / 2 + k / 2; }

// The even and odd elements of a then b.
template <typename V>
inline V EvenOf(V a, V b) {
  return ShuffleLanes<EvenLane>(a, b, std::make_integer_sequence<int, kLanes>());
}
template <typename V>
inline V OddOf(V a, V b) {
  return ShuffleLanes<OddLane>(a, b, std::make_integer_sequence<int, kLanes>());
}

// Stores the even elements e and odd elements o of 2 kLanes values in order.
inline void StoreInterleaved(float* out, VF e, VF o) {
  StoreV(out, ShuffleLanes<LowInterleavedLane>(e, o, std::make_integer_sequence<int, kLanes>()));
  StoreV(out + kLanes,
         ShuffleLanes<HighInterleavedLane>(e, o, std::make_integer_sequence<int, kLanes>()));
}
// kLanes code bytes widened to ints: one vpmovzxbd where the path has it (GCC
// turns a direct uint8 -> int32 conversion into scalar code, and the one
// through uint16 below into a chain of nine instructions on AVX-512).
inline VI LoadCodes(const uint8_t* p) {
#if OPTAX4BIT_ROWS_AVX512
  return (VI)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif OPTAX4BIT_ROWS_AVX2
  return (VI)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#elif OPTAX4BIT_ROWS_NEON
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return (VI)vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word)))));
#else
  VB v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(__builtin_convertvector(v, VW), VI);
#endif
}
inline void StoreCodes(uint8_t* p, VI codes) {
#if OPTAX4BIT_ROWS_NEON
  // Two narrowing moves (GCC extracts and inserts lane by lane).
  const uint16x4_t halves = vmovn_u32((uint32x4_t)codes);
  const uint8x8_t bytes = vmovn_u16(vcombine_u16(halves, halves));
  const uint32_t word = vget_lane_u32(vreinterpret_u32_u8(bytes), 0);
  std::memcpy(p, &word, sizeof(word));
#elif OPTAX4BIT_ROWS_AVX2
  // The low bytes gathered by a byte shuffle per 128-bit lane and a permute
  // (GCC lowers the conversion below to one vpextrd, shift and or per lane).
  const __m256i low_bytes = _mm256_shuffle_epi8(
      (__m256i)codes, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                       0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i packed = _mm256_permutevar8x32_epi32(low_bytes, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64((__m128i*)p, _mm256_castsi256_si128(packed));
#else
  const VB v = __builtin_convertvector(codes, VB);
  std::memcpy(p, &v, sizeof(v));
#endif
}

// A 16-entry table in registers (a map's entries or thresholds) and a
// 32-entry one of ints.
#if OPTAX4BIT_ROWS_NEON
struct Table {
  uint8x16x4_t bytes;  // the four registers TBL reads
};
#else
struct Table {
  VF part[16 / kLanes];
};
#endif
struct IntTable32 {
  VI part[32 / kLanes];
#if OPTAX4BIT_ROWS_AVX2
  __m256i bytes[2];  // the low bytes of entries [0, 16) and [16, 32), in both lanes
#elif OPTAX4BIT_ROWS_NEON
  uint8x16x2_t bytes;  // the low bytes of the 32 entries
#endif
};

inline Table LoadTable(const float* p) {
  Table t;
#if OPTAX4BIT_ROWS_NEON
  t.bytes = vld1q_u8_x4(reinterpret_cast<const uint8_t*>(p));
#else
  std::memcpy(t.part, p, sizeof(t.part));
#endif
  return t;
}

// t[index], index in [0, 16) (in [0, 32) for IntTable32).
#if OPTAX4BIT_ROWS_AVX2
// Two 8-entry permutes, blended on the index's bit 3 (moved to the sign bit).
inline __m256 Lookup8x2(__m256 lo, __m256 hi, __m256i index) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, index),
                          _mm256_permutevar8x32_ps(hi, index),
                          _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}

inline VF Lookup(const Table& t, VI index) {
  return (VF)Lookup8x2((__m256)t.part[0], (__m256)t.part[1], (__m256i)index);
}

inline VI Lookup(const IntTable32& t, VI index) {
  // Entries in [0, 256): byte shuffles of the entries' low bytes (both
  // 128-bit lanes hold the same 16), a blend on bit 4 and the low byte kept.
  const __m256i i = (__m256i)index;
  const __m256i lo = _mm256_shuffle_epi8(t.bytes[0], i);
  const __m256i hi = _mm256_shuffle_epi8(t.bytes[1], i);
  const __m256i r = _mm256_blendv_epi8(lo, hi, _mm256_cmpgt_epi32(i, _mm256_set1_epi32(15)));
  return (VI)_mm256_and_si256(r, _mm256_set1_epi32(0xFF));
}
#elif OPTAX4BIT_ROWS_NEON
inline VF Lookup(const Table& t, VI index) {
  // The bytes 4 index + (0, 1, 2, 3) of the 64-byte table, by one TBL.
  const uint32x4_t offsets =
      vmlaq_n_u32(vdupq_n_u32(0x03020100u), (uint32x4_t)index, 0x04040404u);
  return (VF)vreinterpretq_f32_u8(vqtbl4q_u8(t.bytes, vreinterpretq_u8_u32(offsets)));
}

inline VI Lookup(const IntTable32& t, VI index) {
  // Entries in [0, 256): the low byte by TBL; the index's upper bytes set to
  // 0xFF are out of range, so TBL writes 0 there.
  const uint32x4_t bytes = vorrq_u32((uint32x4_t)index, vdupq_n_u32(0xFFFFFF00u));
  return (VI)vreinterpretq_u32_u8(vqtbl2q_u8(t.bytes, vreinterpretq_u8_u32(bytes)));
}
#elif OPTAX4BIT_ROWS_AVX512
// One permute (GCC's __builtin_shuffle compiles to the same; Clang has no
// shuffle by a run-time lane order).
inline VF Lookup(const Table& t, VI index) {
  return (VF)_mm512_permutexvar_ps((__m512i)index, (__m512)t.part[0]);
}
inline VI Lookup(const IntTable32& t, VI index) {
  return (VI)_mm512_permutex2var_epi32((__m512i)t.part[0], (__m512i)index, (__m512i)t.part[1]);
}
#elif defined(__clang__)
// Lane by lane: Clang has no shuffle by a run-time lane order ("auto" does
// not run the x86 baseline path).
inline VF Lookup(const Table& t, VI index) {
  VF r;
  for (int k = 0; k < kLanes; ++k) r[k] = t.part[0][index[k]];
  return r;
}
inline VI Lookup(const IntTable32& t, VI index) {
  VI r;
  for (int k = 0; k < kLanes; ++k) r[k] = t.part[index[k] / kLanes][index[k] % kLanes];
  return r;
}
#else
inline VF Lookup(const Table& t, VI index) { return __builtin_shuffle(t.part[0], index); }
inline VI Lookup(const IntTable32& t, VI index) {
  return __builtin_shuffle(t.part[0], t.part[1], index);
}
#endif

// a * b + c rounded once, as XLA's CPU backend contracts a multiply feeding an
// add (LLVM fuses the add's first operand when both are products). GCC
// vectorizes these into FMA instructions in the ISA paths that have them.
inline float MulAdd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline VF MulAddV(VF a, VF b, VF c) {
  // By intrinsics: GCC's vectorizing of a lane loop (the baseline's way) is
  // fragile and falls back to scalar code in some callers.
#if OPTAX4BIT_ROWS_AVX512
  return (VF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif OPTAX4BIT_ROWS_AVX2
  return (VF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif OPTAX4BIT_ROWS_NEON
  return (VF)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  float x[kLanes], y[kLanes], z[kLanes];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  std::memcpy(z, &c, sizeof(z));
  for (int k = 0; k < kLanes; ++k) x[k] = __builtin_fmaf(x[k], y[k], z[k]);
  return LoadV(x);
#endif
}

// Asks for the cache lines 4 KiB after the 2 kLanes floats at p, which a
// row loop reads about a thousand cycles later. The hardware prefetchers
// alone leave the loops that stream a gradient from memory waiting on it: the
// fused 4-bit Adam step took 19 ms instead of 14.5 on one core (SPEC tree).
constexpr int kPrefetchBytes = 4096;
inline void PrefetchAhead(const float* p) {
  const char* q = (const char*)p + kPrefetchBytes;
  for (int k = 0; k < 8 * kLanes; k += 64) __builtin_prefetch(q + k);
}

// Correctly rounded square roots, lane by lane (as XLA's sqrt).
inline VF SqrtV(VF x) {
#if OPTAX4BIT_ROWS_AVX512
  return (VF)_mm512_sqrt_ps((__m512)x);
#elif OPTAX4BIT_ROWS_AVX2
  return (VF)_mm256_sqrt_ps((__m256)x);
#elif OPTAX4BIT_ROWS_NEON
  return (VF)vsqrtq_f32((float32x4_t)x);
#else
  float y[kLanes];
  std::memcpy(y, &x, sizeof(y));
  for (int k = 0; k < kLanes; ++k) y[k] = __builtin_sqrtf(y[k]);
  return LoadV(y);
#endif
}

// |x| as bits, 0 where x is not finite, lane by lane: non-negative floats
// order like their bits.
inline VU FiniteAbsBits(VF x) {
  const VU u = (VU)x & 0x7fffffffu;
  return u < 0x7f800000u ? u : 0u;
}

inline VU MaxV(VU a, VU b) { return a > b ? a : b; }

inline uint32_t HorizontalMax(VU x) {
  uint32_t r = 0;
  for (int k = 0; k < kLanes; ++k) r = x[k] > r ? x[k] : r;
  return r;
}

#endif  // OPTAX4BIT_CPU_VECTOR_OPS_H_
