// Row kernels of 8-bit Adam (adam_8bit_ffi.h: Optax4bitAdam8bitApply).
// isa_path_rows.h includes this file after adam_4bit_rows.h in each ISA path's
// namespace (no include guard): it shares vector_ops.h's vectors and that
// file's Update, NesterovUpdate and RestartOverflowed.
#ifndef OPTAX4BIT_CPU_ADAM_8BIT_ROWS_H_  // once per ISA path: isa_path_rows.h resets it
#define OPTAX4BIT_CPU_ADAM_8BIT_ROWS_H_

// 8-bit Adam (adamw_8bit): both moments block-wise, blocks of kBlock8
// elements of a row, 256-entry maps (a code a byte), nearest rounding. A row
// is split into its even and odd elements as in adam_4bit_rows.h, so that the Adam step
// helpers (Update, NesterovUpdate, RestartOverflowed) serve both kernels: a
// block is kBlock8 / 2 elements of each half.

constexpr int64_t kHalfBlock8 = kBlock8 / 2;

// table[index] by a gather where the path has one (a 256-entry table does not
// fit in the AVX2 path's registers).
inline VF Gather(const float* table, VI index) {
#if OPTAX4BIT_ROWS_AVX512
  return (VF)_mm512_i32gather_ps((__m512i)index, table, 4);
#elif OPTAX4BIT_ROWS_AVX2
  return (VF)_mm256_i32gather_ps(table, (__m256i)index, 4);
#else
  VF r;
  for (int k = 0; k < kLanes; ++k) r[k] = table[index[k]];
  return r;
#endif
}

inline VI Gather(const int32_t* table, VI index) {
#if OPTAX4BIT_ROWS_AVX512
  return (VI)_mm512_i32gather_epi32((__m512i)index, table, 4);
#elif OPTAX4BIT_ROWS_AVX2
  return (VI)_mm256_i32gather_epi32(table, (__m256i)index, 4);
#else
  VI r;
  for (int k = 0; k < kLanes; ++k) r[k] = table[index[k]];
  return r;
#endif
}

// The codes of 2 kLanes consecutive elements, split into even and odd ones.
inline void LoadCodes8(const uint8_t* p, VI& even, VI& odd) {
  const VI a = LoadCodes(p), b = LoadCodes(p + kLanes);
  even = EvenOf(a, b);
  odd = OddOf(a, b);
}

// Codes interleaved as 16-bit words even | odd << 8 (GCC turns a shuffle or
// a narrowing conversion of the ints into scalar code on some paths).
inline void StoreCodes8(uint8_t* p, VI even, VI odd) {
  const VI words = even | (odd << 8);
#if OPTAX4BIT_ROWS_AVX512
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)words));
#elif OPTAX4BIT_ROWS_AVX2
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128((__m256i)words),
                                                 _mm256_extracti128_si256((__m256i)words, 1)));
#else
  for (int k = 0; k < kLanes; ++k) {
    p[2 * k] = (uint8_t)words[k];
    p[2 * k + 1] = (uint8_t)(words[k] >> 8);
  }
#endif
}

// The entries of a 256-entry map for codes, by gathers.
struct GatheredTable {
  const float* table;

  explicit GatheredTable(const float* t) : table(t) {}
  VF operator()(VI code) const { return Gather(table, code); }
};

#if OPTAX4BIT_ROWS_AVX512
// The entries of a 256-entry map for codes, by permutes of the map held in
// registers: eight two-register permutes and a tree of blends, nearly three
// times as fast as a gather on Zen 4.
struct PermutedTable {
  __m512 part[16];

  explicit PermutedTable(const float* table) {
    for (int k = 0; k < 16; ++k) part[k] = _mm512_loadu_ps(table + 16 * k);
  }
  VF operator()(VI code) const {
    const __m512i c = (__m512i)code;
    const __mmask16 bit5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    const __mmask16 bit6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
    const __mmask16 bit7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
    __m512 half[2];
    for (int k = 0; k < 2; ++k) {
      const __m512* p = part + 8 * k;
      const __m512 low = _mm512_mask_blend_ps(bit5, _mm512_permutex2var_ps(p[0], c, p[1]),
                                              _mm512_permutex2var_ps(p[2], c, p[3]));
      const __m512 high = _mm512_mask_blend_ps(bit5, _mm512_permutex2var_ps(p[4], c, p[5]),
                                               _mm512_permutex2var_ps(p[6], c, p[7]));
      half[k] = _mm512_mask_blend_ps(bit6, low, high);
    }
    return (VF)_mm512_mask_blend_ps(bit7, half[0], half[1]);
  }
};
using Table256 = PermutedTable;
#else
using Table256 = GatheredTable;
#endif

// New moment (1 - b) x + b decode(codes) of one row, x = g or g^2 (kSquare).
template <bool kSquare>
void NewMoment8(int64_t h, const float* __restrict g, const uint8_t* __restrict codes,
                const float* __restrict block_scales, const float* __restrict entries, float b,
                float one_minus_b, float* __restrict x) {
  const Table256 table(entries);
  for (int64_t blk = 0; blk < h / kHalfBlock8; ++blk) {
    const float s = block_scales[blk];
    for (int64_t j = blk * kHalfBlock8; j < (blk + 1) * kHalfBlock8; j += kLanes) {
      VI ce, co;
      LoadCodes8(codes + 2 * j, ce, co);
      if constexpr (!kSquare) PrefetchAhead(g + 2 * j);  // g's first read
      const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
      VF ge = EvenOf(ga, gb), go = OddOf(ga, gb);
      if constexpr (kSquare) {
        ge = ge * ge;
        go = go * go;
      }
      const VF c = VF{} + one_minus_b;
      StoreV(x + j, MulAddV(c, ge, b * (table(ce) * s)));
      StoreV(x + h + j, MulAddV(c, go, b * (table(co) * s)));
    }
  }
}

// Nearest rounding to a 256-entry map: the number of its 255 sorted midpoint
// thresholds below n (optax4bit.quant.maps.count_above), by one table lookup
// instead of a binary search. n's bucket (kBuckets8 per sign: |n| clamped to
// [2**-23, 1], then its exponent and top 7 mantissa bits) holds at most one
// threshold, which shares those bits with n, and none where the clamp took n
// in (optax4bit.cpu.ffi._buckets checks the maps). A bucket's entry is
// (count of the thresholds below all its values) << 16 | key of its threshold,
// the key the low 16 bits of |t| (0xffff minus them for negative n, whose
// order they reverse; 0xffff where the bucket holds none): n is above the
// threshold exactly when its key is above the threshold's.
struct NearestCodes256 {
  const int32_t* buckets;  // 2 kBuckets8: positive n, then negative

  VI Codes(VF n) const {
    const VI u = (VI)n;
    VI a = u & 0x7fffffff;
    a = a > kBucketLowBits ? a : kBucketLowBits;
    a = a < kBucketHighBits ? a : kBucketHighBits;
    const VI negative = u < 0;
    const VI entry = Gather(buckets, ((a - kBucketLowBits) >> kBucketShift) +
                                         (negative & kBuckets8));
    const VI key = (u & 0xffff) ^ (negative & 0xffff);
    return (entry >> 16) - (key > (entry & 0xffff));
  }
};

// Block scales (maxima of finite |x|) and codes of one row of a moment.
void EncodeMoment8(int64_t h, const float* __restrict x, const NearestCodes256& rounding,
                   float* __restrict block_scales, uint8_t* __restrict codes) {
  ForNormalizedBlocks<kHalfBlock8>(h, x, block_scales, [&](int64_t j, VF xe, VF xo) {
    StoreCodes8(codes + 2 * j, rounding.Codes(xe), rounding.Codes(xo));
  });
}

// Rows [lo, hi) of Adam8bitApply; scratch: 3d floats.
void Apply8bitRows(const Apply8bitRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, d = 2 * h, blocks = d / kBlock8;
  const Coefficients& c = a.c;
  const NearestCodes256 m_rounding{a.m_buckets};
  const NearestCodes256 v_rounding{a.v_buckets};
  float* m = scratch;
  float* v = m + d;
  float* work = v + d;
  for (int64_t i = lo; i < hi; ++i) {
    // The update overwrites the gradient row (aliased): read it first.
    const float* g_row = a.g + i * d;
    float* out = a.out + i * d;
    NewMoment8<false>(h, g_row, a.m_codes + i * d, a.m_scales + i * blocks, a.m_table, c.b1,
                      c.one_minus_b1, m);
    NewMoment8<true>(h, g_row, a.v_codes + i * d, a.v_scales + i * blocks, a.v_table, c.b2,
                     c.one_minus_b2, v);
    if (a.nesterov) {
      std::memcpy(work, g_row, d * sizeof(float));
      NesterovUpdate(h, work, m, v, c, out);
    } else {
      Update(h, m, v, c, out);
    }
    RestartOverflowed(d, v, m);
    EncodeMoment8(h, m, m_rounding, a.m_scales_out + i * blocks, a.m_out + i * d);
    EncodeMoment8(h, v, v_rounding, a.v_scales_out + i * blocks, a.v_out + i * d);
  }
}

#endif  // OPTAX4BIT_CPU_ADAM_8BIT_ROWS_H_
