// Encoders of the 4-bit moments, shared by every step's row kernels and the
// codecs: the binary search over a map's thresholds, the first moment's
// rounding (nearest, or stochastic from hashed draws) under B128 block
// scales, and the second moment's rank-1 levels. isa_path_rows.h includes
// this file once per ISA path, after vector_ops.h, inside the path's
// namespace and under its `#pragma GCC target` (no include guard).
#ifndef OPTAX4BIT_CPU_ENCODE_ROWS_H_  // once per ISA path: isa_path_rows.h resets it
#define OPTAX4BIT_CPU_ENCODE_ROWS_H_

// Binary search over 15 sorted bounds b[0..14]: the number of bounds below x
// (x > b, or x >= b if kInclusive), by 4 compares, as
// optax4bit.quant.maps.count_above: with b[7], then b[3] or b[11] (a blend),
// then bounds picked by permutes (b[15] = +inf is never selected).
struct Bounds {
#if OPTAX4BIT_ROWS_AVX2
  // The third compare's bound b[c + 1], c in {0, 4, 8, 12}, at lane c / 4 and
  // the fourth's b[c], c even, at lane c / 2: one 8-lane permute each instead
  // of two and a blend.
  VF b_quarters_plus1, b_evens;
#else
  // One permute of a 16-entry table each, indexed by c itself: the 8-entry
  // layout's index shifts made the AVX-512 encodes 7-9% slower.
  Table b, b_plus1;  // b_plus1[k] = b[k + 1]: no index add
#endif
  VF b3, b7, b11;
};

inline Bounds MakeBounds(const float* bounds) {
  const VF b3 = VF{} + bounds[3], b7 = VF{} + bounds[7], b11 = VF{} + bounds[11];
#if OPTAX4BIT_ROWS_AVX2
  float quarters_plus1[kLanes] = {}, evens[kLanes];
  for (int k = 0; k < 4; ++k) quarters_plus1[k] = bounds[4 * k + 1];
  for (int k = 0; k < kLanes; ++k) evens[k] = bounds[2 * k];
  return Bounds{LoadV(quarters_plus1), LoadV(evens), b3, b7, b11};
#else
  float b[2][kTableSize];
  for (int k = 0; k < kTableSize; ++k) {
    b[0][k] = k < kTableSize - 1 ? bounds[k] : INFINITY;
    b[1][k] = k + 1 < kTableSize - 1 ? bounds[k + 1] : INFINITY;
  }
  return Bounds{LoadTable(b[0]), LoadTable(b[1]), b3, b7, b11};
#endif
}

template <bool kInclusive>
__attribute__((always_inline)) inline VI CountAbove(const Bounds& t, VF x) {
  auto above = [](VF x, VF b) { return kInclusive ? x >= b : x > b; };
  const auto upper = above(x, t.b7);
  VI c = upper ? VI{} + 8 : VI{};
  c = above(x, upper ? t.b11 : t.b3) ? c + 4 : c;
#if OPTAX4BIT_ROWS_AVX2
  auto permute = [](VF table, VI lane) {
    return (VF)_mm256_permutevar8x32_ps((__m256)table, (__m256i)lane);
  };
  c = above(x, permute(t.b_quarters_plus1, c >> 2)) ? c + 2 : c;
  return above(x, permute(t.b_evens, c >> 1)) ? c + 1 : c;
#else
  c = above(x, Lookup(t.b_plus1, c)) ? c + 2 : c;
  return above(x, Lookup(t.b, c)) ? c + 1 : c;
#endif
}

// optax4bit.quant.maps.mix32 lane by lane (uint32 multiplies wrap).
inline VU Mix32(VU x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

constexpr VU kEvenIndex = (VU)LaneVector<EvenLane>(std::make_integer_sequence<int, kLanes>());

// The U[0, 1) draws of maps.hashed_uniform for the elements with flat indices
// index (mod 2**32), times 2**24: mix32(index ^ seed) >> 8, exact in float32.
inline VF HashedUniformTimes2p24(VU index, uint32_t seed) {
  return __builtin_convertvector((VI)(Mix32(index ^ seed) >> 8), VF);
}

// The stall rule's codes (TableRounding::StallCodes) are inlined into the
// encoders where vectors are as wide as the registers. The x86 baseline path
// (16 lanes lowered lane by lane to SSE2, and not run by "auto") calls them:
// inlined into each pairing of the moments' roundings they added 0.8 MB to
// the library.
#undef OPTAX4BIT_STALL_INLINE
#if OPTAX4BIT_ROWS_AVX512 || OPTAX4BIT_ROWS_AVX2 || OPTAX4BIT_ROWS_NEON
#define OPTAX4BIT_STALL_INLINE __attribute__((always_inline))
#else
#define OPTAX4BIT_STALL_INLINE __attribute__((noinline))
#endif

// How a row of a moment is rounded to codes under a 16-entry table (the first
// moment's, signed, or the second moment's, unsigned): to the nearest entry
// (the count of midpoint thresholds below n), or stochastically as
// optax4bit.quant.maps.encode_stochastic (n clipped to the table; lower = the
// largest k with table[k] <= n; up by one where the draw u < (n - table[lower])
// / gap, gap = table[lower + 1] - table[lower], 0 at the top entry), or by the
// stall rule (QuantSpec stall_only, optax4bit.quant.array.encode with stored
// codes): the stochastic code where the nearest code is the element's stored
// one (its code before the step), the nearest code elsewhere.
//
// Stochastic rounding takes a faster path where the map allows (NF's entries
// do; DE's crowd near 0 and take the general one):
// * lower by one lookup: split [lowest, highest] into 32 cells by a monotone
//   function of n; where no cell holds two of table[1..15], cell_lower[c]
//   counts those in the cells below n's cell c and one compare with the next
//   entry settles the one c may hold;
// * u < p as u 2**24 < (n - table[lower]) / (gap 2**-24): scaling by powers of
//   two commutes with rounding where p is normal or 0, and it is for gaps in
//   [2**-100, 1] (n - table[lower] is 0 or normal, subnormals being flushed).
struct TableRounding {
  static constexpr int kCells = 32;
  Bounds thresholds;  // nearest: the 15 midpoint thresholds
  Bounds entries;     // stochastic, binary search: table[1..15]
  Table table;
  // gap[k] = table[k + 1] - table[k] where that is > 0, else 1 (then n -
  // table[k] is 0: only n = table[15] is left there by the clip).
  Table gap;
  Table gap_2m24;                  // gap 2**-24
  Table next;                      // table[k + 1], +inf for k = 15
  IntTable32 cell_lower;
  float cell_scale, cell_offset;   // n's cell: trunc(n * cell_scale + cell_offset)
  bool fast;                       // the faster stochastic path applies
  float lowest, highest;
  uint32_t seed;

  TableRounding(const float* values, const float* midpoints, uint32_t seed_)
      : thresholds(MakeBounds(midpoints)), entries(MakeBounds(values + 1)),
        table(LoadTable(values)), lowest(values[0]), highest(values[kTableSize - 1]),
        seed(seed_) {
    float gaps[kTableSize], gaps_2m24[kTableSize], nexts[kTableSize];
    for (int k = 0; k < kTableSize; ++k) {
      const float gap_k = values[std::min<int>(k + 1, kTableSize - 1)] - values[k];
      gaps[k] = gap_k > 0.0f ? gap_k : 1.0f;
      gaps_2m24[k] = gaps[k] * 0x1p-24f;
      nexts[k] = k + 1 < kTableSize ? values[k + 1] : INFINITY;
    }
    gap = LoadTable(gaps);
    gap_2m24 = LoadTable(gaps_2m24);
    next = LoadTable(nexts);
    cell_scale = (kCells - 0.5f) / (highest - lowest);
    cell_offset = -lowest * cell_scale;
    // Every clipped n lands in [0, kCells), each cell holds one entry at most.
    fast = std::isfinite(cell_scale) && cell_scale > 0.0f && Cell(lowest) > -1.0f &&
           Cell(highest) < kCells;
    for (int k = 0; k < kTableSize; ++k) fast &= gaps[k] >= 0x1p-100f && gaps[k] <= 1.0f;
    int32_t cell_lowers[kCells] = {};
    for (int c = 0, count = 0; c < kCells && fast; ++c) {
      cell_lowers[c] = count;
      while (count < kTableSize - 1 && (int)Cell(values[count + 1]) <= c) ++count;
      fast = count - cell_lowers[c] <= 1;
    }
    std::memcpy(cell_lower.part, cell_lowers, sizeof(cell_lowers));
#if OPTAX4BIT_ROWS_AVX2
    uint8_t low_bytes[2][32];
    for (int k = 0; k < kCells; ++k) low_bytes[k / 16][k % 16] = low_bytes[k / 16][k % 16 + 16] =
        (uint8_t)cell_lowers[k];
    std::memcpy(&cell_lower.bytes[0], low_bytes[0], 32);
    std::memcpy(&cell_lower.bytes[1], low_bytes[1], 32);
#elif OPTAX4BIT_ROWS_NEON
    uint8_t low_bytes[kCells];
    for (int k = 0; k < kCells; ++k) low_bytes[k] = (uint8_t)cell_lowers[k];
    cell_lower.bytes = vld1q_u8_x2(low_bytes);
#endif
  }

  float Cell(float n) const { return MulAdd(n, cell_scale, cell_offset); }

  template <bool kStochastic, bool kFast>
  __attribute__((always_inline)) VI Codes(VF n, VU index) const {
    if constexpr (!kStochastic) {
      return CountAbove<false>(thresholds, n);
    } else {
      n = n > lowest ? n : lowest;
      n = n < highest ? n : highest;
      const VF u_2p24 = HashedUniformTimes2p24(index, seed);
      if constexpr (kFast) {
        const VI cell = __builtin_convertvector(
            MulAddV(n, VF{} + cell_scale, VF{} + cell_offset), VI);
        VI lower = Lookup(cell_lower, cell);
        lower = n >= Lookup(next, lower) ? lower + 1 : lower;
        const VF p_2p24 =
            (n - Lookup(table, lower)) / Lookup(gap_2m24, lower);
        return u_2p24 < p_2p24 ? lower + 1 : lower;
      } else {
        const VI lower = CountAbove<true>(entries, n);
        const VF probability =
            (n - Lookup(table, lower)) / Lookup(gap, lower);
        return u_2p24 * 0x1p-24f < probability ? lower + 1 : lower;
      }
    }
  }

  // The stall rule: the stochastic code where the nearest one (the count of
  // midpoint thresholds below n, clipped or not) is `stored`, else the nearest.
  template <bool kFast>
  OPTAX4BIT_STALL_INLINE VI StallCodes(VF n, VU index, VI stored) const {
    const VI nearest = CountAbove<false>(thresholds, n);
    const VI stochastic = Codes<true, kFast>(n, index);
    return nearest == stored ? stochastic : nearest;
  }

  // The code bytes of kLanes even elements xe and the odd ones xo after them
  // at half-row offset j of a row whose first element has flat index
  // row_index (mod 2**32). kStall (with kStochastic): the stall rule, the
  // stored codes of the row's bytes at `stored` (read before the caller
  // writes the new byte j over it, where it codes in place).
  template <bool kStochastic, bool kFast, bool kStall = false>
  __attribute__((always_inline)) VI CodeBytes(VF xe, VF xo, uint32_t row_index, int64_t j,
                                              const uint8_t* stored = nullptr) const {
    static_assert(kStochastic || !kStall, "the stall rule rounds stochastically");
    const VU even_index = (row_index + 2 * (uint32_t)j) + kEvenIndex;
    if constexpr (kStall) {
      const VI old = LoadCodes(stored + j);
      return StallCodes<kFast>(xe, even_index, old & 15) |
             (StallCodes<kFast>(xo, even_index + 1, old >> 4) << 4);
    } else {
      return Codes<kStochastic, kFast>(xe, even_index) |
             (Codes<kStochastic, kFast>(xo, even_index + 1) << 4);
    }
  }
};

// Block maxima of finite |x| of one row (split even/odd) into block_scales,
// blocks of kHalfBlock elements of each half.
template <int64_t kHalfBlock>
__attribute__((always_inline)) inline void BlockMaxima(int64_t h, const float* __restrict x,
                                                       float* __restrict block_scales) {
  for (int64_t b = 0; b < h / kHalfBlock; ++b) {
    const float* xb = x + b * kHalfBlock;
    VU s = {};
    for (int64_t j = 0; j < kHalfBlock; j += kLanes) {
      s = MaxV(s, MaxV(FiniteAbsBits(LoadV(xb + j)), FiniteAbsBits(LoadV(xb + h + j))));
    }
    block_scales[b] = FromBits(HorizontalMax(s));
  }
}

// store(j, inverse) for every kLanes elements j of each half of a row, with
// inverse = 4 / the scale of j's block (InverseTimes4): the inverses of 16
// blocks, then their stores, so that no block waits on its own division.
template <int64_t kHalfBlock, typename Store>
__attribute__((always_inline)) inline void ForBlockInverses(int64_t h,
                                                            const float* block_scales,
                                                            Store store) {
  constexpr int64_t kGroup = 16;
  const int64_t blocks = h / kHalfBlock;
  for (int64_t b0 = 0; b0 < blocks; b0 += kGroup) {
    const int64_t n = std::min(kGroup, blocks - b0);
    float inverse[kGroup];
    for (int64_t b = 0; b < n; ++b) inverse[b] = InverseTimes4(block_scales[b0 + b]);
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t j = (b0 + b) * kHalfBlock; j < (b0 + b + 1) * kHalfBlock; j += kLanes) {
        store(j, inverse[b]);
      }
    }
  }
}

// x normalized by its block's inverse: (x * inverse) * 0.25, NaN read as 0
// (optax4bit.quant.normalize.normalize).
inline VF Normalized(VF x, VF inverse) {
  x = (x * inverse) * 0.25f;
  return x == x ? x : 0.0f;
}
inline VF Normalized(VF x, float inverse) { return Normalized(x, VF{} + inverse); }

// x normalized under rank-1 scales, from the inverses times 4 of its column's
// and its row's scale: 1 / min(scales) = max(1 / scales) exactly.
inline VF Rank1Normalized(VF x, VF col_inverse, VF row_inverse) {
  return Normalized(x, col_inverse > row_inverse ? col_inverse : row_inverse);
}

// Block maxima of one row (split even/odd) into block_scales, then
// store(j, xe, xo) for every kLanes elements j of each half, normalized.
template <int64_t kHalfBlock, typename Store>
__attribute__((always_inline)) inline void ForNormalizedBlocks(
    int64_t h, const float* __restrict x, float* __restrict block_scales, Store store) {
  BlockMaxima<kHalfBlock>(h, x, block_scales);
  ForBlockInverses<kHalfBlock>(h, block_scales, [&](int64_t j, float inverse) {
    store(j, Normalized(LoadV(x + j), inverse), Normalized(LoadV(x + h + j), inverse));
  });
}

// B128 codes of one row of m under its block scales (block_scales: the
// maxima of finite |m| per block). row_index: the flat index (mod 2**32) of
// the row's first element in the leaf, for stochastic rounding's draws.
// kStall: the stall rule against the row's stored codes (another buffer:
// codes is __restrict, which kept the momentum step 6% fewer instructions).
template <bool kStochastic, bool kFast, bool kStall>
__attribute__((always_inline)) inline void EncodeFirstMomentScaledT(
    int64_t h, const float* __restrict m, const TableRounding& shared_rounding,
    uint32_t row_index, const float* __restrict block_scales, uint8_t* __restrict codes,
    const uint8_t* __restrict stored) {
  // A copy the code stores cannot alias: it stays in registers.
  const TableRounding rounding = shared_rounding;
  ForBlockInverses<kBlockBytes>(h, block_scales, [&](int64_t j, float inverse) {
    StoreCodes(codes + j, rounding.CodeBytes<kStochastic, kFast, kStall>(
                              Normalized(LoadV(m + j), inverse),
                              Normalized(LoadV(m + h + j), inverse), row_index, j, stored));
  });
}

// stall_codes: the row's stored codes where the stall rule applies (with
// stochastic; not codes' buffer), else nullptr.
void EncodeFirstMomentScaled(bool stochastic, int64_t h, const float* __restrict m,
                             const TableRounding& rounding, uint32_t row_index,
                             const float* __restrict block_scales, uint8_t* __restrict codes,
                             const uint8_t* __restrict stall_codes = nullptr) {
  if (!stochastic) {
    EncodeFirstMomentScaledT<false, false, false>(h, m, rounding, row_index, block_scales, codes,
                                                  nullptr);
  } else if (stall_codes != nullptr) {
    if (rounding.fast) {
      EncodeFirstMomentScaledT<true, true, true>(h, m, rounding, row_index, block_scales, codes,
                                                 stall_codes);
    } else {
      EncodeFirstMomentScaledT<true, false, true>(h, m, rounding, row_index, block_scales, codes,
                                                  stall_codes);
    }
  } else if (rounding.fast) {
    EncodeFirstMomentScaledT<true, true, false>(h, m, rounding, row_index, block_scales, codes,
                                                nullptr);
  } else {
    EncodeFirstMomentScaledT<true, false, false>(h, m, rounding, row_index, block_scales, codes,
                                                 nullptr);
  }
}

// B128 codes of one row of m: its block maxima into block_scales, then the
// codes (stall_codes as EncodeFirstMomentScaled's).
void EncodeFirstMoment(bool stochastic, int64_t h, const float* __restrict m,
                       const TableRounding& rounding, uint32_t row_index,
                       float* __restrict block_scales, uint8_t* __restrict codes,
                       const uint8_t* __restrict stall_codes = nullptr) {
  BlockMaxima<kBlockBytes>(h, m, block_scales);
  EncodeFirstMomentScaled(stochastic, h, m, rounding, row_index, block_scales, codes,
                          stall_codes);
}

// Rank-1 codes of one row of v, nearest rounding.
//
// Linear (a closed form): ceil(16 n - 1.5) clamped to [0, 15], n = v *
// max(4 / row scale, 4 / column scale) / 4, NaN read as 0. The inverses come
// times 4 (inverse16): 16 n = v * inverse16 exactly, as scaling by a power of
// two commutes with rounding. NaN fails y > 0 and gets level 0 as 0 does.
// Clamping before the ceiling gives the same level and keeps the float -> int
// conversion in range; ceil(y) = trunc(y) + (trunc(y) < y).
//
// Other maps: n = (v * max(4 / row scale, 4 / column scale)) * 0.25 (the
// inverses come times 4: inverse4), NaN read as 0, then the number of the 15
// thresholds below n, all positive normal numbers: n > t exactly when y =
// v * inverse4 > 4 t (a NaN y, which n reads as 0, is above none of them,
// and a y whose quarter is subnormal is below all), so thresholds4 holds 4 t.
template <bool kLinear>
__attribute__((always_inline)) inline VI SecondMomentLevels(VF x, VF col_inverse,
                                                            float row_inverse,
                                                            const Bounds& thresholds4) {
  const VF inverse = col_inverse > row_inverse ? col_inverse : row_inverse;
  if constexpr (kLinear) {
    VF y = x * inverse - 1.5f;
    y = y > 0.0f ? y : 0.0f;
    y = y < 15.0f ? y : 15.0f;
    const VI t = __builtin_convertvector(y, VI);
    return t + ((__builtin_convertvector(t, VF) < y) & 1);
  } else {
    return CountAbove<false>(thresholds4, x * inverse);
  }
}

template <bool kLinear>
__attribute__((always_inline)) inline void EncodeSecondMomentT(
    int64_t h, const float* __restrict v, float row_inverse, const float* __restrict col_even,
    const float* __restrict col_odd, const Bounds& thresholds4, uint8_t* __restrict codes) {
  for (int64_t j = 0; j < h; j += kLanes) {
    const VI even = SecondMomentLevels<kLinear>(LoadV(v + j), LoadV(col_even + j), row_inverse,
                                                thresholds4);
    const VI odd = SecondMomentLevels<kLinear>(LoadV(v + h + j), LoadV(col_odd + j),
                                               row_inverse, thresholds4);
    StoreCodes(codes + j, even | (odd << 4));
  }
}

// row_inverse, col_*: inverse16 for Linear, inverse4 for the other maps.
void EncodeSecondMoment(bool linear, int64_t h, const float* __restrict v,
                        float row_inverse, const float* __restrict col_even,
                        const float* __restrict col_odd, const Bounds& thresholds4,
                        uint8_t* __restrict codes) {
  if (linear) {
    EncodeSecondMomentT<true>(h, v, row_inverse, col_even, col_odd, thresholds4, codes);
  } else {
    EncodeSecondMomentT<false>(h, v, row_inverse, col_even, col_odd, thresholds4, codes);
  }
}

// The codes of one row (split even/odd) of a second moment rounded
// stochastically (optax4bit.quant.maps.encode_stochastic) under rank-1
// inverses times 4; row_index: the flat index (mod 2**32) of the row's first
// element, for the draws. kStall: the stall rule against the row's stored
// codes (`stored`, another buffer: the codecs').
template <bool kFast, bool kStall = false>
__attribute__((always_inline)) inline void EncodeSecondMomentStochasticT(
    int64_t h, const float* __restrict v, float row_inverse, const float* __restrict col_even,
    const float* __restrict col_odd, const TableRounding& shared_rounding, uint32_t row_index,
    uint8_t* __restrict codes, const uint8_t* __restrict stored = nullptr) {
  const TableRounding rounding = shared_rounding;  // in registers, as EncodeFirstMomentScaledT's
  const VF row = VF{} + row_inverse;
  for (int64_t j = 0; j < h; j += kLanes) {
    StoreCodes(codes + j, rounding.CodeBytes<true, kFast, kStall>(
                              Rank1Normalized(LoadV(v + j), LoadV(col_even + j), row),
                              Rank1Normalized(LoadV(v + h + j), LoadV(col_odd + j), row),
                              row_index, j, stored));
  }
}

#endif  // OPTAX4BIT_CPU_ENCODE_ROWS_H_
