// Row kernels of the fused 4-bit Adam step (adam_4bit.cc), which includes
// this file once per ISA path, each time inside a namespace of its own and
// under a `#pragma GCC target` for it (no include guard; what it uses is
// included and defined before). OPTAX4BIT_ROWS_AVX2 is 1 in the AVX2 path.

// 16-lane vectors (GCC/Clang vector extensions): table lookups become one
// permute per 16 elements (vpermps on AVX-512) instead of a select tree.
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t UI16 __attribute__((vector_size(64)));
typedef uint16_t W16 __attribute__((vector_size(32)));
typedef uint8_t U16 __attribute__((vector_size(16)));
constexpr I16 kEven = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
constexpr I16 kOdd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

inline F16 LoadF16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreF16(float* p, F16 v) { std::memcpy(p, &v, sizeof(v)); }
inline I16 LoadCodes16(const uint8_t* p) {
  U16 v;
  std::memcpy(&v, p, sizeof(v));
  // Widened in two steps: GCC turns a direct uint8 -> int32 conversion into
  // scalar code, this into vpmovzx instructions.
  return __builtin_convertvector(__builtin_convertvector(v, W16), I16);
}
inline void StoreCodes16(uint8_t* p, I16 codes) {
  const U16 v = __builtin_convertvector(codes, U16);
  std::memcpy(p, &v, sizeof(v));
}

// a * b + c rounded once, as XLA's CPU backend contracts a multiply feeding an
// add (LLVM fuses the add's first operand when both are products). GCC
// vectorizes these into FMA instructions in the ISA paths that have them.
inline float MulAdd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline F16 MulAdd16(F16 a, F16 b, F16 c) {
  // Through arrays: a loop GCC vectorizes at any vector width (lane by lane
  // on a vector type wider than the target's, it calls fmaf per element).
  float x[16], y[16], z[16];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  std::memcpy(z, &c, sizeof(z));
  for (int k = 0; k < 16; ++k) x[k] = __builtin_fmaf(x[k], y[k], z[k]);
  return LoadF16(x);
}

// Row kernels. A row of d = 2h elements is split into its even and odd
// elements (the low and high nibbles of the packed code bytes): x[0, h) holds
// the even elements, x[h, 2h) the odd ones.

// New first moment (1 - b1) g + b1 m of one row; entries by table permutes.
void NewFirstMoment(int64_t h, const float* __restrict g,
                                  const uint8_t* __restrict codes,
                                  const float* __restrict block_scales,
                                  const float* __restrict m_table, float b1, float one_minus_b1,
                                  float* __restrict m) {
  const F16 table = LoadF16(m_table);
  for (int64_t b = 0; b < h / kBlockBytes; ++b) {
    const float s = block_scales[b];
    for (int64_t j = b * kBlockBytes; j < (b + 1) * kBlockBytes; j += 16) {
      const I16 byte = LoadCodes16(codes + j);
      const F16 ga = LoadF16(g + 2 * j), gb = LoadF16(g + 2 * j + 16);
      const F16 ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
      const F16 de_even = __builtin_shuffle(table, byte & 15);
      const F16 de_odd = __builtin_shuffle(table, byte >> 4);
      StoreF16(m + j, MulAdd16(F16{} + one_minus_b1, ge, b1 * (de_even * s)));
      StoreF16(m + h + j, MulAdd16(F16{} + one_minus_b1, go, b1 * (de_odd * s)));
    }
  }
}

// New second moment (1 - b2) g^2 + b2 v of one row; the rank-1 scale is
// min(row max, column max). Linear decodes code k to (k + 1) / 16 (a closed
// form, bit-identical to its table entry), other maps by a table permute.
template <bool kLinear>
__attribute__((always_inline)) inline void NewSecondMomentT(
    int64_t h, const float* __restrict g, const uint8_t* __restrict codes, float row_scale,
    const float* __restrict col_even, const float* __restrict col_odd,
    const float* __restrict v_table, float b2, float one_minus_b2, float* __restrict v) {
  if constexpr (kLinear) {
    // A scalar loop: GCC vectorizes it (64 codes per iteration) a little
    // faster than 16-lane vector code.
    for (int64_t j = 0; j < h; ++j) {
      const int byte = codes[j];
      const float ge = g[2 * j], go = g[2 * j + 1];
      const float se = row_scale < col_even[j] ? row_scale : col_even[j];
      const float so = row_scale < col_odd[j] ? row_scale : col_odd[j];
      v[j] = MulAdd(one_minus_b2, ge * ge, b2 * (((float)(byte & 15) + 1.0f) * 0.0625f * se));
      v[h + j] = MulAdd(one_minus_b2, go * go, b2 * (((float)(byte >> 4) + 1.0f) * 0.0625f * so));
    }
  } else {
    const F16 table = LoadF16(v_table);
    const F16 row = F16{} + row_scale;
    for (int64_t j = 0; j < h; j += 16) {
      const I16 byte = LoadCodes16(codes + j);
      const F16 ga = LoadF16(g + 2 * j), gb = LoadF16(g + 2 * j + 16);
      const F16 ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
      const F16 ce = LoadF16(col_even + j), co = LoadF16(col_odd + j);
      const F16 se = row < ce ? row : ce, so = row < co ? row : co;
      const F16 c = F16{} + one_minus_b2;
      StoreF16(v + j, MulAdd16(c, ge * ge, b2 * (__builtin_shuffle(table, byte & 15) * se)));
      StoreF16(v + h + j, MulAdd16(c, go * go, b2 * (__builtin_shuffle(table, byte >> 4) * so)));
    }
  }
}

void NewSecondMoment(bool linear, int64_t h, const float* __restrict g,
                                   const uint8_t* __restrict codes, float row_scale,
                                   const float* __restrict col_even,
                                   const float* __restrict col_odd,
                                   const float* __restrict v_table, float b2, float one_minus_b2,
                                   float* __restrict v) {
  if (linear) {
    NewSecondMomentT<true>(h, g, codes, row_scale, col_even, col_odd, v_table, b2, one_minus_b2,
                           v);
  } else {
    NewSecondMomentT<false>(h, g, codes, row_scale, col_even, col_odd, v_table, b2,
                            one_minus_b2, v);
  }
}

// |x| as bits, 0 where x is not finite, for 16 lanes: non-negative floats
// order like their bits.
inline UI16 FiniteAbsBits16(F16 x) {
  const UI16 u = (UI16)x & 0x7fffffffu;
  return u < 0x7f800000u ? u : 0u;
}

inline UI16 Max16(UI16 a, UI16 b) { return a > b ? a : b; }

inline uint32_t HorizontalMax(UI16 x) {
  uint32_t r = 0;
  for (int k = 0; k < 16; ++k) r = x[k] > r ? x[k] : r;
  return r;
}

// Maxima of finite |v| of one row into the row scale and the running column
// maxima (as bits).
void SecondMomentMaxima(int64_t h, const float* __restrict v, float* __restrict row,
                                      uint32_t* __restrict col_even,
                                      uint32_t* __restrict col_odd) {
  UI16 r = {};
  for (int64_t j = 0; j < h; j += 16) {
    const UI16 e = FiniteAbsBits16(LoadF16(v + j)), o = FiniteAbsBits16(LoadF16(v + h + j));
    r = Max16(r, Max16(e, o));
    UI16 ce, co;
    std::memcpy(&ce, col_even + j, sizeof(ce));
    std::memcpy(&co, col_odd + j, sizeof(co));
    ce = Max16(ce, e);
    co = Max16(co, o);
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

// Binary search over 15 sorted bounds b[0..14]: the number of bounds below x
// (x > b, or x >= b if kInclusive), by 4 compares whose bounds are picked by
// permutes, as optax4bit.quant.maps.count_above (b[15] = +inf is never
// selected).
struct Bounds {
  F16 b, b_plus1, b_plus3;  // b_plus1[k] = b[k + 1], b_plus3[k] = b[k + 3]: no index adds
  F16 b7;
};

inline Bounds MakeBounds(const float* bounds) {
  Bounds r;
  for (int k = 0; k < kTableSize; ++k) {
    r.b[k] = k < kTableSize - 1 ? bounds[k] : INFINITY;
    r.b_plus1[k] = k + 1 < kTableSize - 1 ? bounds[k + 1] : INFINITY;
    r.b_plus3[k] = k + 3 < kTableSize - 1 ? bounds[k + 3] : INFINITY;
  }
  r.b7 = F16{} + bounds[7];
  return r;
}

template <bool kInclusive>
__attribute__((always_inline)) inline I16 CountAbove(const Bounds& t, F16 x) {
  auto above = [](F16 x, F16 b) { return kInclusive ? x >= b : x > b; };
  I16 c = above(x, t.b7) ? I16{} + 8 : I16{};
  c = above(x, __builtin_shuffle(t.b_plus3, c)) ? c + 4 : c;
  c = above(x, __builtin_shuffle(t.b_plus1, c)) ? c + 2 : c;
  return above(x, __builtin_shuffle(t.b, c)) ? c + 1 : c;
}

// optax4bit.quant.maps.mix32 on 16 lanes (uint32 multiplies wrap).
inline UI16 Mix32(UI16 x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

constexpr UI16 kEvenIndex = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};

// The U[0, 1) draws of maps.hashed_uniform for 16 elements with flat indices
// index (mod 2**32), times 2**24: mix32(index ^ seed) >> 8, exact in float32.
inline F16 HashedUniform16Times2p24(UI16 index, uint32_t seed) {
  return __builtin_convertvector((I16)(Mix32(index ^ seed) >> 8), F16);
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
  F16 table;
  // gap[k] = table[k + 1] - table[k] where that is > 0, else 1 (then n -
  // table[k] is 0: only n = table[15] is left there by the clip).
  F16 gap;
  F16 gap_2m24;                       // gap 2**-24
  F16 next;                           // table[k + 1], +inf for k = 15
  I16 cell_lower_lo, cell_lower_hi;   // cell_lower[0..15], cell_lower[16..31]
  float cell_scale, cell_offset;      // n's cell: trunc(n * cell_scale + cell_offset)
  bool fast;                          // the faster stochastic path applies
  float lowest, highest;
  uint32_t seed;

  FirstMomentRounding(const float* values, const float* midpoints, uint32_t seed_)
      : thresholds(MakeBounds(midpoints)), entries(MakeBounds(values + 1)),
        table(LoadF16(values)), lowest(values[0]), highest(values[kTableSize - 1]),
        seed(seed_) {
    for (int k = 0; k < kTableSize; ++k) {
      const float gap_k = values[std::min<int>(k + 1, kTableSize - 1)] - values[k];
      gap[k] = gap_k > 0.0f ? gap_k : 1.0f;
      gap_2m24[k] = gap[k] * 0x1p-24f;
      next[k] = k + 1 < kTableSize ? values[k + 1] : INFINITY;
    }
    cell_scale = (kCells - 0.5f) / (highest - lowest);
    cell_offset = -lowest * cell_scale;
    // Every clipped n lands in [0, kCells), each cell holds one entry at most.
    fast = std::isfinite(cell_scale) && cell_scale > 0.0f && Cell(lowest) > -1.0f &&
           Cell(highest) < kCells;
    for (int k = 0; k < kTableSize; ++k) fast &= gap[k] >= 0x1p-100f && gap[k] <= 1.0f;
    int count = 0;
    for (int c = 0; c < kCells && fast; ++c) {
      const int lower = count;
      while (count < kTableSize - 1 && (int)Cell(values[count + 1]) <= c) ++count;
      fast = count - lower <= 1;
      (c < 16 ? cell_lower_lo[c] : cell_lower_hi[c - 16]) = lower;
    }
  }

  float Cell(float n) const { return MulAdd(n, cell_scale, cell_offset); }

  template <bool kStochastic, bool kFast>
  __attribute__((always_inline)) I16 Codes(F16 n, UI16 index) const {
    if constexpr (!kStochastic) {
      return CountAbove<false>(thresholds, n);
    } else {
      n = n > lowest ? n : lowest;
      n = n < highest ? n : highest;
      const F16 u_2p24 = HashedUniform16Times2p24(index, seed);
      if constexpr (kFast) {
        const I16 cell = __builtin_convertvector(
            MulAdd16(n, F16{} + cell_scale, F16{} + cell_offset), I16);
        I16 lower = __builtin_shuffle(cell_lower_lo, cell_lower_hi, cell);
        lower = n >= __builtin_shuffle(next, lower) ? lower + 1 : lower;
        const F16 p_2p24 =
            (n - __builtin_shuffle(table, lower)) / __builtin_shuffle(gap_2m24, lower);
        return u_2p24 < p_2p24 ? lower + 1 : lower;
      } else {
        const I16 lower = CountAbove<true>(entries, n);
        const F16 probability =
            (n - __builtin_shuffle(table, lower)) / __builtin_shuffle(gap, lower);
        return u_2p24 * 0x1p-24f < probability ? lower + 1 : lower;
      }
    }
  }
};

// B128 codes of one row of m: block maxima, then the codes of the normalized
// values. row_index: the flat index (mod 2**32) of the row's first element
// in the leaf, for stochastic rounding's draws.
template <bool kStochastic, bool kFast>
__attribute__((always_inline)) inline void EncodeFirstMomentT(
    int64_t h, const float* __restrict m, const FirstMomentRounding& shared_rounding,
    uint32_t row_index, float* __restrict block_scales, uint8_t* __restrict codes) {
  // Blocks in groups of 16: the maxima, then their reciprocals, then the
  // codes, so that no block waits on its own division.
  constexpr int64_t kGroup = 16;
  // A copy the code stores cannot alias: it stays in registers.
  const FirstMomentRounding rounding = shared_rounding;
  const int64_t blocks = h / kBlockBytes;
  for (int64_t b0 = 0; b0 < blocks; b0 += kGroup) {
    const int64_t n = std::min(kGroup, blocks - b0);
    float inverse[kGroup];
    for (int64_t b = 0; b < n; ++b) {
      const float* mb = m + (b0 + b) * kBlockBytes;
      UI16 s = {};
      for (int64_t j = 0; j < kBlockBytes; j += 16) {
        s = Max16(s, Max16(FiniteAbsBits16(LoadF16(mb + j)), FiniteAbsBits16(LoadF16(mb + h + j))));
      }
      block_scales[b0 + b] = FromBits(HorizontalMax(s));
    }
    for (int64_t b = 0; b < n; ++b) inverse[b] = InverseTimes4(block_scales[b0 + b]);
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t j = (b0 + b) * kBlockBytes; j < (b0 + b + 1) * kBlockBytes; j += 16) {
        F16 xe = (LoadF16(m + j) * inverse[b]) * 0.25f;
        F16 xo = (LoadF16(m + h + j) * inverse[b]) * 0.25f;
        xe = xe == xe ? xe : 0.0f;
        xo = xo == xo ? xo : 0.0f;
        const UI16 even_index = (row_index + 2 * (uint32_t)j) + kEvenIndex;
        StoreCodes16(codes + j, rounding.Codes<kStochastic, kFast>(xe, even_index) |
                                    (rounding.Codes<kStochastic, kFast>(xo, even_index + 1)
                                     << 4));
      }
    }
  }
}

void EncodeFirstMoment(bool stochastic, int64_t h, const float* __restrict m,
                                     const FirstMomentRounding& rounding, uint32_t row_index,
                                     float* __restrict block_scales, uint8_t* __restrict codes) {
  if (!stochastic) {
    EncodeFirstMomentT<false, false>(h, m, rounding, row_index, block_scales, codes);
  } else if (rounding.fast) {
    EncodeFirstMomentT<true, true>(h, m, rounding, row_index, block_scales, codes);
  } else {
    EncodeFirstMomentT<true, false>(h, m, rounding, row_index, block_scales, codes);
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
__attribute__((always_inline)) inline void EncodeSecondMomentT(
    int64_t h, const float* __restrict v, float row_inverse, const float* __restrict col_even,
    const float* __restrict col_odd, const Bounds& thresholds4, uint8_t* __restrict codes) {
  auto levels = [row_inverse, &thresholds4](F16 x, F16 col_inverse) {
    const F16 inverse = col_inverse > row_inverse ? col_inverse : row_inverse;
    if constexpr (kLinear) {
      F16 y = x * inverse - 1.5f;
      y = y > 0.0f ? y : 0.0f;
      y = y < 15.0f ? y : 15.0f;
      const I16 t = __builtin_convertvector(y, I16);
      return t + ((__builtin_convertvector(t, F16) < y) & 1);
    } else {
      return CountAbove<false>(thresholds4, x * inverse);
    }
  };
  for (int64_t j = 0; j < h; j += 16) {
    const I16 even = levels(LoadF16(v + j), LoadF16(col_even + j));
    const I16 odd = levels(LoadF16(v + h + j), LoadF16(col_odd + j));
    StoreCodes16(codes + j, even | (odd << 4));
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
    NewSecondMoment(a.v_linear, h, a.g + i * d, a.codes + i * h, a.row_scales[i], a.col_even,
                    a.col_odd, a.v_table, a.c.b2, a.c.one_minus_b2, v);
    SecondMomentMaxima(h, v, a.new_rows + i, col_max, col_max + h);
  }
}

// Rows [lo, hi) of Adam4bitApply; scratch: 3d floats.
void ApplyRows(const ApplyRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, d = 2 * h, blocks = h / kBlockBytes;
  const Coefficients& c = a.c;
  const FirstMomentRounding m_rounding(a.m_table, a.m_table + kTableSize, a.m_seed);
  const Bounds v_thresholds4 = MakeBounds(a.v_thresholds4);
  float* m = scratch;
  float* v = m + d;
  float* work = v + d;
  for (int64_t i = lo; i < hi; ++i) {
    // The update overwrites the gradient row (aliased): read it first.
    const float* g_row = a.g + i * d;
    float* out = a.out + i * d;
    NewFirstMoment(h, g_row, a.m_codes + i * h, a.m_scales + i * blocks, a.m_table, c.b1,
                   c.one_minus_b1, m);
    NewSecondMoment(a.v_linear, h, g_row, a.v_codes + i * h, a.row_scales[i], a.col_even,
                    a.col_odd, a.v_table, c.b2, c.one_minus_b2, v);
    if (a.nesterov) {
      std::memcpy(work, g_row, d * sizeof(float));
      NesterovUpdate(h, work, m, v, c, out);
    } else {
      Update(h, m, v, c, out);
    }
    // Flat element indices wrap modulo 2**32, as maps.hashed_uniform's.
    EncodeFirstMoment(a.m_stochastic, h, m, m_rounding, a.row_base[i],
                      a.m_scales_out + i * blocks, a.m_out + i * h);
    EncodeSecondMoment(a.v_linear, h, v, InverseTimes4(a.new_row_scales[i]) * a.inverse_factor,
                       a.inv_col_even, a.inv_col_odd, v_thresholds4, a.v_out + i * h);
  }
}
