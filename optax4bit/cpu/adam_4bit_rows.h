// Row kernels of the fused 4-bit Adam step of adam_4bit_ffi.h: the new moments,
// the update and the two row passes (StatsRows, ApplyRows), which code the
// moments with the encoders of encode_rows.h. isa_path_rows.h includes this
// file once per ISA path, after vector_ops.h and encode_rows.h, each time
// inside the path's namespace and under its `#pragma GCC target` (no include
// guard).
#ifndef OPTAX4BIT_CPU_ADAM_4BIT_ROWS_H_  // once per ISA path: isa_path_rows.h resets it
#define OPTAX4BIT_CPU_ADAM_4BIT_ROWS_H_

// Row kernels. A row of d = 2h elements is split into its even and odd
// elements (the low and high nibbles of the packed code bytes): x[0, h) holds
// the even elements, x[h, 2h) the odd ones.

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
    const VF ge = EvenOf(ga, gb), go = OddOf(ga, gb);
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
// ((1 - b1) g + b1 m and NewSecondMoment's v) into m and v, the update
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
      const VF ge = EvenOf(ga, gb), go = OddOf(ga, gb);
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
// under the new block scales and of v under the new rank-1 scales, v to the
// nearest entry (its thresholds, or Linear's closed form) or stochastically
// (kVStochastic: its TableRounding, inverses times 4). kStall, kVStall: m's,
// v's stall rule against the row's stored codes (a.m_codes, a.v_codes: the
// buffers the new codes overwrite, each byte read before it is written).
template <bool kStochastic, bool kFast, bool kStall, bool kLinear, bool kVStochastic,
          bool kVFast, bool kVStall>
__attribute__((always_inline)) inline void EncodeMomentsT(
    const ApplyRowsArgs& a, int64_t i, const TableRounding& shared_rounding,
    const TableRounding& shared_v_rounding, const Bounds& v_thresholds4,
    const float* __restrict m, const float* __restrict v) {
  // Copies the code stores cannot alias: they stay in registers.
  const TableRounding rounding = shared_rounding;
  const int64_t h = a.h;
  const uint32_t row_index = a.row_base[i];
  const float row_inverse = InverseTimes4(a.new_row_scales[i]) * a.inverse_factor;
  uint8_t* m_out = a.m_out + i * h;
  uint8_t* v_out = a.v_out + i * h;
  const uint8_t* m_stored = a.m_codes + i * h;
  const uint8_t* v_stored = a.v_codes + i * h;
  ForBlockInverses<kBlockBytes>(h, a.m_scales_out + i * (h / kBlockBytes),
                                [&](int64_t j, float inverse) {
    const VF ve = LoadV(v + j), vo = LoadV(v + h + j);
    const VF me = ve == INFINITY ? VF{} : LoadV(m + j);
    const VF mo = vo == INFINITY ? VF{} : LoadV(m + h + j);
    StoreCodes(m_out + j, rounding.CodeBytes<kStochastic, kFast, kStall>(
                              Normalized(me, inverse), Normalized(mo, inverse), row_index, j,
                              m_stored));
    const VF ie = LoadV(a.inv_col_even + j), io = LoadV(a.inv_col_odd + j);
    if constexpr (kVStochastic) {
      const VF row = VF{} + row_inverse;
      StoreCodes(v_out + j, shared_v_rounding.CodeBytes<true, kVFast, kVStall>(
                                Rank1Normalized(ve, ie, row), Rank1Normalized(vo, io, row),
                                row_index, j, v_stored));
    } else {
      const VI even = SecondMomentLevels<kLinear>(ve, ie, row_inverse, v_thresholds4);
      const VI odd = SecondMomentLevels<kLinear>(vo, io, row_inverse, v_thresholds4);
      StoreCodes(v_out + j, even | (odd << 4));
    }
  });
}

// EncodeMomentsT with m's rounding picked: nearest, stochastic or the stall
// rule, each stochastic one by the table's faster path where it applies.
template <bool kLinear, bool kVStochastic, bool kVFast, bool kVStall>
void EncodeMomentsV(const ApplyRowsArgs& a, int64_t i, const TableRounding& rounding,
                    const TableRounding& v_rounding, const Bounds& v_thresholds4,
                    const float* m, const float* v) {
  if (!a.m_stochastic) {
    EncodeMomentsT<false, false, false, kLinear, kVStochastic, kVFast, kVStall>(
        a, i, rounding, v_rounding, v_thresholds4, m, v);
  } else if (a.m_stall) {
    if (rounding.fast) {
      EncodeMomentsT<true, true, true, kLinear, kVStochastic, kVFast, kVStall>(
          a, i, rounding, v_rounding, v_thresholds4, m, v);
    } else {
      EncodeMomentsT<true, false, true, kLinear, kVStochastic, kVFast, kVStall>(
          a, i, rounding, v_rounding, v_thresholds4, m, v);
    }
  } else if (rounding.fast) {
    EncodeMomentsT<true, true, false, kLinear, kVStochastic, kVFast, kVStall>(
        a, i, rounding, v_rounding, v_thresholds4, m, v);
  } else {
    EncodeMomentsT<true, false, false, kLinear, kVStochastic, kVFast, kVStall>(
        a, i, rounding, v_rounding, v_thresholds4, m, v);
  }
}

// v's rounding picked: nearest (Linear's closed form or thresholds),
// stochastic or the stall rule (the table's faster path where it applies).
void EncodeMoments(const ApplyRowsArgs& a, int64_t i, const TableRounding& rounding,
                   const TableRounding& v_rounding, const Bounds& v_thresholds4,
                   const float* m, const float* v) {
  if (a.v_stochastic && a.v_stall) {
    if (v_rounding.fast) {
      EncodeMomentsV<false, true, true, true>(a, i, rounding, v_rounding, v_thresholds4, m, v);
    } else {
      EncodeMomentsV<false, true, false, true>(a, i, rounding, v_rounding, v_thresholds4, m, v);
    }
  } else if (a.v_stochastic) {
    if (v_rounding.fast) {
      EncodeMomentsV<false, true, true, false>(a, i, rounding, v_rounding, v_thresholds4, m, v);
    } else {
      EncodeMomentsV<false, true, false, false>(a, i, rounding, v_rounding, v_thresholds4, m, v);
    }
  } else if (a.v_linear) {
    EncodeMomentsV<true, false, false, false>(a, i, rounding, v_rounding, v_thresholds4, m, v);
  } else {
    EncodeMomentsV<false, false, false, false>(a, i, rounding, v_rounding, v_thresholds4, m, v);
  }
}

// Rows [lo, hi) of Adam4bitApply; scratch: 3d floats.
void ApplyRows(const ApplyRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, d = 2 * h;
  const Coefficients& c = a.c;
  const TableRounding m_rounding(a.m_table, a.m_table + kTableSize, a.m_seed);
  const TableRounding v_rounding(a.v_table, a.v_table + kTableSize, a.v_seed);
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
    EncodeMoments(a, i, m_rounding, v_rounding, v_thresholds4, m, v);
  }
}

#endif  // OPTAX4BIT_CPU_ADAM_4BIT_ROWS_H_
