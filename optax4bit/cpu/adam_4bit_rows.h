// Row kernels of the fused 4-bit steps of adam_4bit.cc (Adam; at the end,
// momentum and factored Adam, which share Adam's first-moment kernels).
// isa_path_rows.h includes this file once per ISA path, after vector_ops.h,
// each time inside the path's namespace and under its `#pragma GCC target`
// (no include guard).

// Row kernels. A row of d = 2h elements is split into its even and odd
// elements (the low and high nibbles of the packed code bytes): x[0, h) holds
// the even elements, x[h, 2h) the odd ones.

// New first moment (1 - b1) g + b1 m of one row; entries by table permutes.
void NewFirstMoment(int64_t h, const float* __restrict g,
                    const uint8_t* __restrict codes,
                    const float* __restrict block_scales,
                    const float* __restrict m_table, float b1, float one_minus_b1,
                    float* __restrict m) {
  const Table table = LoadTable(m_table);
  for (int64_t b = 0; b < h / kBlockBytes; ++b) {
    const float s = block_scales[b];
    for (int64_t j = b * kBlockBytes; j < (b + 1) * kBlockBytes; j += kLanes) {
      const VI byte = LoadCodes(codes + j);
      PrefetchAhead(g + 2 * j);
      const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
      const VF ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
      const VF de_even = Lookup(table, byte & 15);
      const VF de_odd = Lookup(table, byte >> 4);
      StoreV(m + j, MulAddV(VF{} + one_minus_b1, ge, b1 * (de_even * s)));
      StoreV(m + h + j, MulAddV(VF{} + one_minus_b1, go, b1 * (de_odd * s)));
    }
  }
}

// New second moment (1 - b2) g^2 + b2 v of one row; the rank-1 scale is
// min(row max, column max); entries by table permutes (Linear's too: its
// entries (k + 1) / 16 are exact, and the permutes beat GCC's vectorizing of
// the closed form).
void NewSecondMoment(int64_t h, const float* __restrict g, const uint8_t* __restrict codes,
                     float row_scale, const float* __restrict col_even,
                     const float* __restrict col_odd, const float* __restrict v_table, float b2,
                     float one_minus_b2, float* __restrict v) {
  const Table table = LoadTable(v_table);
  const VF row = VF{} + row_scale;
  for (int64_t j = 0; j < h; j += kLanes) {
    const VI byte = LoadCodes(codes + j);
    PrefetchAhead(g + 2 * j);
    const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
    const VF ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
    const VF ce = LoadV(col_even + j), co = LoadV(col_odd + j);
    const VF se = row < ce ? row : ce, so = row < co ? row : co;
    const VF c = VF{} + one_minus_b2;
    StoreV(v + j, MulAddV(c, ge * ge, b2 * (Lookup(table, byte & 15) * se)));
    StoreV(v + h + j, MulAddV(c, go * go, b2 * (Lookup(table, byte >> 4) * so)));
  }
}

// Maxima of finite |v| of one row into the row scale and the running column
// maxima (as bits).
void SecondMomentMaxima(int64_t h, const float* __restrict v, float* __restrict row,
                        uint32_t* __restrict col_even,
                        uint32_t* __restrict col_odd) {
  VU r = {};
  for (int64_t j = 0; j < h; j += kLanes) {
    const VU e = FiniteAbsBits(LoadV(v + j)), o = FiniteAbsBits(LoadV(v + h + j));
    r = MaxV(r, MaxV(e, o));
    VU ce, co;
    std::memcpy(&ce, col_even + j, sizeof(ce));
    std::memcpy(&co, col_odd + j, sizeof(co));
    ce = MaxV(ce, e);
    co = MaxV(co, o);
    std::memcpy(col_even + j, &ce, sizeof(ce));
    std::memcpy(col_odd + j, &co, sizeof(co));
  }
  *row = FromBits(HorizontalMax(r));
}

// v / c2, the correctly rounded quotient XLA's division gives, without a
// division (the update is bound by the divider): with r = RN(1 / c2) and
// q0 = RN(v r), Markstein's correction RN(q0 + (v - c2 q0) r), two FMAs, is
// RN(v / c2) when nothing underflows or overflows: for q0 in [2**-40, 2**100]
// or 0 and c2 >= 2**-40 (then v - c2 q0 is exact and normal or 0; checked
// against the division on all float32 significands for a dozen c2). Elsewhere
// `unsafe` is set and the caller divides.
inline float VOverC2(float v, float c2, float r, int& unsafe) {
  const float q0 = v * r;
  unsafe |= !((q0 >= 0x1p-40f && q0 <= 0x1p100f) || q0 == 0.0f);
  return __builtin_fmaf(__builtin_fmaf(-q0, c2, v), r, q0);
}

inline bool C2AllowsMarkstein(float c2) { return c2 >= 0x1p-40f && c2 <= 1.0f; }

// The Adam update m_hat / (sqrt(v_hat + eps_root) + eps), in the form XLA
// compiles the jnp reference to: m / (c1 * (sqrt(v / c2 + eps_root) + eps))
// (XLA's algebraic simplifier turns (a / b) / c into a / (b * c)).
template <bool kDivide>
__attribute__((always_inline)) inline int UpdateT(int64_t h, const float* __restrict m,
                                                  const float* __restrict v,
                                                  const Coefficients& c, float r,
                                                  float* __restrict out) {
  int unsafe = 0;
  for (int64_t j = 0; j < h; ++j) {
    const float ve = kDivide ? v[j] / c.c2 : VOverC2(v[j], c.c2, r, unsafe);
    const float vo = kDivide ? v[h + j] / c.c2 : VOverC2(v[h + j], c.c2, r, unsafe);
    out[2 * j] = m[j] / (c.c1 * (std::sqrt(ve + c.eps_root) + c.eps));
    out[2 * j + 1] = m[h + j] / (c.c1 * (std::sqrt(vo + c.eps_root) + c.eps));
  }
  return unsafe;
}

void Update(int64_t h, const float* __restrict m, const float* __restrict v,
            const Coefficients& c, float* __restrict out) {
  const float r = 1.0f / c.c2;
  if (!C2AllowsMarkstein(c.c2) || UpdateT<false>(h, m, v, c, r, out)) {
    UpdateT<true>(h, m, v, c, r, out);
  }
}

// Nesterov: (b1 m / c1_next + (1 - b1) g / c1) / (sqrt(v / c2 + eps_root) + eps),
// the first product fused into the add as XLA does.
template <bool kDivide>
__attribute__((always_inline)) inline int NesterovUpdateT(
    int64_t h, const float* __restrict g, const float* __restrict m, const float* __restrict v,
    const Coefficients& c, float r, float* __restrict out) {
  int unsafe = 0;
  for (int64_t j = 0; j < h; ++j) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t k = half * h + j, e = 2 * j + half;
      const float v_hat = kDivide ? v[k] / c.c2 : VOverC2(v[k], c.c2, r, unsafe);
      out[e] = MulAdd(c.one_minus_b1, g[e] / c.c1, c.b1 * (m[k] / c.c1_next)) /
               (std::sqrt(v_hat + c.eps_root) + c.eps);
    }
  }
  return unsafe;
}

void NesterovUpdate(int64_t h, const float* __restrict g, const float* __restrict m,
                    const float* __restrict v, const Coefficients& c,
                    float* __restrict out) {
  const float r = 1.0f / c.c2;
  if (!C2AllowsMarkstein(c.c2) || NesterovUpdateT<false>(h, g, m, v, c, r, out)) {
    NesterovUpdateT<true>(h, g, m, v, c, r, out);
  }
}

// UpdateT's (kNesterov: NesterovUpdateT's) update of kLanes elements g, m, v
// with Markstein's v / c2; unsafe: lanes set where that quotient may not be
// XLA's (the caller then divides).
template <bool kNesterov>
__attribute__((always_inline)) inline VF UpdateV(VF g, VF m, VF v, const Coefficients& c, VF r,
                                                 VI& unsafe) {
  const VF q0 = v * r;
  unsafe |= ~(((q0 >= 0x1p-40f) & (q0 <= 0x1p100f)) | (q0 == 0.0f));
  const VF v_hat = MulAddV(MulAddV(-q0, VF{} + c.c2, v), r, q0);
  if constexpr (kNesterov) {
    return MulAddV(VF{} + c.one_minus_b1, g / c.c1, c.b1 * (m / c.c1_next)) /
           (SqrtV(v_hat + c.eps_root) + c.eps);
  } else {
    return m / (c.c1 * (SqrtV(v_hat + c.eps_root) + c.eps));
  }
}

// Binary search over 15 sorted bounds b[0..14]: the number of bounds below x
// (x > b, or x >= b if kInclusive), by 4 compares, as
// optax4bit.quant.maps.count_above: with b[7], then b[3] or b[11] (a blend),
// then bounds picked by permutes (b[15] = +inf is never selected).
struct Bounds {
  Table b, b_plus1;  // b_plus1[k] = b[k + 1]: no index add
  VF b3, b7, b11;
};

inline Bounds MakeBounds(const float* bounds) {
  float b[2][kTableSize];
  for (int k = 0; k < kTableSize; ++k) {
    b[0][k] = k < kTableSize - 1 ? bounds[k] : INFINITY;
    b[1][k] = k + 1 < kTableSize - 1 ? bounds[k + 1] : INFINITY;
  }
  return Bounds{LoadTable(b[0]), LoadTable(b[1]), VF{} + bounds[3], VF{} + bounds[7],
                VF{} + bounds[11]};
}

template <bool kInclusive>
__attribute__((always_inline)) inline VI CountAbove(const Bounds& t, VF x) {
  auto above = [](VF x, VF b) { return kInclusive ? x >= b : x > b; };
  const auto upper = above(x, t.b7);
  VI c = upper ? VI{} + 8 : VI{};
  c = above(x, upper ? t.b11 : t.b3) ? c + 4 : c;
  c = above(x, Lookup(t.b_plus1, c)) ? c + 2 : c;
  return above(x, Lookup(t.b, c)) ? c + 1 : c;
}

// optax4bit.quant.maps.mix32 lane by lane (uint32 multiplies wrap).
inline VU Mix32(VU x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

constexpr VU kEvenIndex = (VU)kEven;

// The U[0, 1) draws of maps.hashed_uniform for the elements with flat indices
// index (mod 2**32), times 2**24: mix32(index ^ seed) >> 8, exact in float32.
inline VF HashedUniformTimes2p24(VU index, uint32_t seed) {
  return __builtin_convertvector((VI)(Mix32(index ^ seed) >> 8), VF);
}

// How a row of the first moment is rounded to codes: to the nearest entry
// (the count of midpoint thresholds below n), or stochastically as
// optax4bit.quant.maps.encode_stochastic (n clipped to the table; lower = the
// largest k with table[k] <= n; up by one where the draw u < (n - table[lower])
// / gap, gap = table[lower + 1] - table[lower], 0 at the top entry).
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
struct FirstMomentRounding {
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

  FirstMomentRounding(const float* values, const float* midpoints, uint32_t seed_)
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

  // The code bytes of kLanes even elements xe and the odd ones xo after them
  // at half-row offset j of a row whose first element has flat index
  // row_index (mod 2**32).
  template <bool kStochastic, bool kFast>
  __attribute__((always_inline)) VI CodeBytes(VF xe, VF xo, uint32_t row_index, int64_t j) const {
    const VU even_index = (row_index + 2 * (uint32_t)j) + kEvenIndex;
    return Codes<kStochastic, kFast>(xe, even_index) |
           (Codes<kStochastic, kFast>(xo, even_index + 1) << 4);
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
inline VF Normalized(VF x, float inverse) {
  x = (x * inverse) * 0.25f;
  return x == x ? x : 0.0f;
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
template <bool kStochastic, bool kFast>
__attribute__((always_inline)) inline void EncodeFirstMomentScaledT(
    int64_t h, const float* __restrict m, const FirstMomentRounding& shared_rounding,
    uint32_t row_index, const float* __restrict block_scales, uint8_t* __restrict codes) {
  // A copy the code stores cannot alias: it stays in registers.
  const FirstMomentRounding rounding = shared_rounding;
  ForBlockInverses<kBlockBytes>(h, block_scales, [&](int64_t j, float inverse) {
    StoreCodes(codes + j, rounding.CodeBytes<kStochastic, kFast>(
                              Normalized(LoadV(m + j), inverse),
                              Normalized(LoadV(m + h + j), inverse), row_index, j));
  });
}

void EncodeFirstMomentScaled(bool stochastic, int64_t h, const float* __restrict m,
                             const FirstMomentRounding& rounding, uint32_t row_index,
                             const float* __restrict block_scales, uint8_t* __restrict codes) {
  if (!stochastic) {
    EncodeFirstMomentScaledT<false, false>(h, m, rounding, row_index, block_scales, codes);
  } else if (rounding.fast) {
    EncodeFirstMomentScaledT<true, true>(h, m, rounding, row_index, block_scales, codes);
  } else {
    EncodeFirstMomentScaledT<true, false>(h, m, rounding, row_index, block_scales, codes);
  }
}

// B128 codes of one row of m: its block maxima into block_scales, then the
// codes.
void EncodeFirstMoment(bool stochastic, int64_t h, const float* __restrict m,
                       const FirstMomentRounding& rounding, uint32_t row_index,
                       float* __restrict block_scales, uint8_t* __restrict codes) {
  BlockMaxima<kBlockBytes>(h, m, block_scales);
  EncodeFirstMomentScaled(stochastic, h, m, rounding, row_index, block_scales, codes);
}

// optax4bit._steps.restart_overflowed: the first moment to store is 0 where
// the new second moment is +inf (g^2 overflowed, or g = +-inf), so that a
// second moment stored finite never meets the huge first moment again.
void RestartOverflowed(int64_t d, const float* __restrict v, float* __restrict m) {
  for (int64_t k = 0; k < d; k += kLanes) {
    const VF vk = LoadV(v + k);
    const VF mk = LoadV(m + k);
    StoreV(m + k, vk == INFINITY ? VF{} : mk);
  }
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

// Rows [lo, hi) of Adam4bitStats: the new second moment (in v, d floats of
// scratch) and its maxima, the column maxima as bits into col_max (d).
void StatsRows(const StatsRowsArgs& a, int64_t lo, int64_t hi, float* v, uint32_t* col_max) {
  const int64_t h = a.h, d = 2 * h;
  for (int64_t i = lo; i < hi; ++i) {
    NewSecondMoment(h, a.g + i * d, a.codes + i * h, a.row_scales[i], a.col_even,
                    a.col_odd, a.v_table, a.c.b2, a.c.one_minus_b2, v);
    SecondMomentMaxima(h, v, a.new_rows + i, col_max, col_max + h);
  }
}

// The first pass of an Adam row (Adam4bitApply), fused so that the gradient
// is read once and the divider works beside the other units: the new moments
// (NewFirstMoment's and NewSecondMoment's arithmetic) into m and v, the update
// (UpdateV) written over the gradient (out may alias g: each vector of g is
// read before out's is written) and the block maxima of the first moment as
// it is stored (0 where the new v is +inf, RestartOverflowed) into
// new_block_scales, which may alias block_scales (each block's scale is read
// before its new one is written). Returns whether Markstein's quotient may
// not be XLA's somewhere in the row.
template <bool kNesterov>
__attribute__((always_inline)) inline bool MomentsAndUpdate(const ApplyRowsArgs& a, int64_t i,
                                                            const Table& m_table,
                                                            const Table& v_table, VF r,
                                                            float* __restrict m,
                                                            float* __restrict v) {
  const int64_t h = a.h, blocks = h / kBlockBytes;
  const Coefficients& c = a.c;
  const float* g = a.g + i * 2 * h;
  float* out = a.out + i * 2 * h;
  const uint8_t* m_codes = a.m_codes + i * h;
  const uint8_t* v_codes = a.v_codes + i * h;
  const float* block_scales = a.m_scales + i * blocks;
  float* new_block_scales = a.m_scales_out + i * blocks;
  const VF row = VF{} + a.row_scales[i];
  VI unsafe = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = block_scales[b];
    VU block_max = {};
    for (int64_t j = b * kBlockBytes; j < (b + 1) * kBlockBytes; j += kLanes) {
      const VI m_byte = LoadCodes(m_codes + j), v_byte = LoadCodes(v_codes + j);
      PrefetchAhead(g + 2 * j);
      const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
      const VF ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
      const VF me = MulAddV(VF{} + c.one_minus_b1, ge, c.b1 * (Lookup(m_table, m_byte & 15) * s));
      const VF mo = MulAddV(VF{} + c.one_minus_b1, go, c.b1 * (Lookup(m_table, m_byte >> 4) * s));
      const VF ce = LoadV(a.col_even + j), co = LoadV(a.col_odd + j);
      const VF se = row < ce ? row : ce, so = row < co ? row : co;
      const VF ve =
          MulAddV(VF{} + c.one_minus_b2, ge * ge, c.b2 * (Lookup(v_table, v_byte & 15) * se));
      const VF vo =
          MulAddV(VF{} + c.one_minus_b2, go * go, c.b2 * (Lookup(v_table, v_byte >> 4) * so));
      StoreV(m + j, me);
      StoreV(m + h + j, mo);
      StoreV(v + j, ve);
      StoreV(v + h + j, vo);
      StoreInterleaved(out + 2 * j, UpdateV<kNesterov>(ge, me, ve, c, r, unsafe),
                       UpdateV<kNesterov>(go, mo, vo, c, r, unsafe));
      block_max = MaxV(block_max, MaxV(FiniteAbsBits(ve == INFINITY ? VF{} : me),
                                       FiniteAbsBits(vo == INFINITY ? VF{} : mo)));
    }
    new_block_scales[b] = FromBits(HorizontalMax(block_max));
  }
  for (int k = 0; k < kLanes; ++k) {
    if (unsafe[k]) return true;
  }
  return false;
}

// The second pass of an Adam row: the codes of m (restarted where v is +inf)
// under the new block scales and of v under the new rank-1 scales.
template <bool kStochastic, bool kFast, bool kLinear>
__attribute__((always_inline)) inline void EncodeMomentsT(
    const ApplyRowsArgs& a, int64_t i, const FirstMomentRounding& shared_rounding,
    const Bounds& v_thresholds4, const float* __restrict m, const float* __restrict v) {
  // A copy the code stores cannot alias: it stays in registers.
  const FirstMomentRounding rounding = shared_rounding;
  const int64_t h = a.h;
  const uint32_t row_index = a.row_base[i];
  const float row_inverse = InverseTimes4(a.new_row_scales[i]) * a.inverse_factor;
  uint8_t* m_out = a.m_out + i * h;
  uint8_t* v_out = a.v_out + i * h;
  ForBlockInverses<kBlockBytes>(h, a.m_scales_out + i * (h / kBlockBytes),
                                [&](int64_t j, float inverse) {
    const VF ve = LoadV(v + j), vo = LoadV(v + h + j);
    const VF me = ve == INFINITY ? VF{} : LoadV(m + j);
    const VF mo = vo == INFINITY ? VF{} : LoadV(m + h + j);
    StoreCodes(m_out + j, rounding.CodeBytes<kStochastic, kFast>(
                              Normalized(me, inverse), Normalized(mo, inverse), row_index, j));
    const VI even = SecondMomentLevels<kLinear>(ve, LoadV(a.inv_col_even + j), row_inverse,
                                                v_thresholds4);
    const VI odd = SecondMomentLevels<kLinear>(vo, LoadV(a.inv_col_odd + j), row_inverse,
                                               v_thresholds4);
    StoreCodes(v_out + j, even | (odd << 4));
  });
}

template <bool kLinear>
void EncodeMoments(const ApplyRowsArgs& a, int64_t i, const FirstMomentRounding& rounding,
                   const Bounds& v_thresholds4, const float* m, const float* v) {
  if (!a.m_stochastic) {
    EncodeMomentsT<false, false, kLinear>(a, i, rounding, v_thresholds4, m, v);
  } else if (rounding.fast) {
    EncodeMomentsT<true, true, kLinear>(a, i, rounding, v_thresholds4, m, v);
  } else {
    EncodeMomentsT<true, false, kLinear>(a, i, rounding, v_thresholds4, m, v);
  }
}

// Rows [lo, hi) of Adam4bitApply; scratch: 3d floats.
void ApplyRows(const ApplyRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, d = 2 * h;
  const Coefficients& c = a.c;
  const FirstMomentRounding m_rounding(a.m_table, a.m_table + kTableSize, a.m_seed);
  const Bounds v_thresholds4 = MakeBounds(a.v_thresholds4);
  const Table m_table = LoadTable(a.m_table), v_table = LoadTable(a.v_table);
  const float r = 1.0f / c.c2;
  float* m = scratch;
  float* v = m + d;
  float* g_copy = v + d;
  for (int64_t i = lo; i < hi; ++i) {
    const float* g_row = a.g + i * d;
    float* out = a.out + i * d;
    bool divide = !C2AllowsMarkstein(c.c2);
    if (a.nesterov) {
      // Dividing instead needs the gradient the update overwrites.
      std::memcpy(g_copy, g_row, d * sizeof(float));
      divide |= MomentsAndUpdate<true>(a, i, m_table, v_table, VF{} + r, m, v);
      if (divide) NesterovUpdateT<true>(h, g_copy, m, v, c, r, out);
    } else {
      divide |= MomentsAndUpdate<false>(a, i, m_table, v_table, VF{} + r, m, v);
      if (divide) UpdateT<true>(h, m, v, c, r, out);
    }
    if (a.v_linear) {
      EncodeMoments<true>(a, i, m_rounding, v_thresholds4, m, v);
    } else {
      EncodeMoments<false>(a, i, m_rounding, v_thresholds4, m, v);
    }
  }
}
