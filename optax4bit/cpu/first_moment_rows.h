// Row kernels of the fused steps whose only quantized moment is the first,
// heavy-ball momentum and Adam with a factored second moment
// (first_moment_ffi.h: Optax4bitFirstMomentApply). isa_path_rows.h includes this file after
// encode_rows.h and adam_4bit_rows.h in each ISA path's namespace: these rows
// run their first-moment kernels (decode, EncodeFirstMoment,
// TableRounding) and Adam's update (UpdateV, UpdateT).
#ifndef OPTAX4BIT_CPU_FIRST_MOMENT_ROWS_H_  // once per ISA path: isa_path_rows.h resets it
#define OPTAX4BIT_CPU_FIRST_MOMENT_ROWS_H_

// The trace g + momentum t of one row (t decoded by table permutes) and the
// update: the trace, or g + momentum * trace with Nesterov. XLA fuses each
// multiply by the momentum into its add (fma(t, momentum, g)). out may alias
// g: each vector of g is read before out's is written.
template <bool kNesterov>
__attribute__((always_inline)) inline void MomentumT(
    int64_t h, const float* g, const uint8_t* __restrict codes,
    const float* __restrict block_scales, const float* __restrict t_table, float momentum,
    float* __restrict t, float* out) {
  const Table table = LoadTable(t_table);
  const VF mu = VF{} + momentum;
  for (int64_t b = 0; b < h / kBlockBytes; ++b) {
    const float s = block_scales[b];
    for (int64_t j = b * kBlockBytes; j < (b + 1) * kBlockBytes; j += kLanes) {
      const VI byte = LoadCodes(codes + j);
      PrefetchAhead(g + 2 * j);
      const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
      const VF ge = EvenOf(ga, gb), go = OddOf(ga, gb);
      const VF te = MulAddV(Lookup(table, byte & 15) * s, mu, ge);
      const VF to = MulAddV(Lookup(table, byte >> 4) * s, mu, go);
      StoreV(t + j, te);
      StoreV(t + h + j, to);
      const VF ue = kNesterov ? MulAddV(mu, te, ge) : te;
      const VF uo = kNesterov ? MulAddV(mu, to, go) : to;
      StoreInterleaved(out + 2 * j, ue, uo);
    }
  }
}

void Momentum(bool nesterov, int64_t h, const float* g, const uint8_t* __restrict codes,
              const float* __restrict block_scales, const float* __restrict t_table,
              float momentum, float* __restrict t, float* out) {
  if (nesterov) {
    MomentumT<true>(h, g, codes, block_scales, t_table, momentum, t, out);
  } else {
    MomentumT<false>(h, g, codes, block_scales, t_table, momentum, t, out);
  }
}

// The second moment rebuilt from its Adafactor factors, (row * col) / mean
// as XLA computes it: (row * col) * inverse, inverse = 1 / mean (XLA turns
// the division by a broadcast scalar into a multiplication by its
// reciprocal); 0 everywhere where the mean is not positive.
void FactoredSecondMoment(int64_t h, float row, const float* __restrict col_even,
                          const float* __restrict col_odd, bool positive, float inverse,
                          float* __restrict v) {
  if (!positive) {
    std::memset(v, 0, 2 * h * sizeof(float));
    return;
  }
  const VF r = VF{} + row;
  for (int64_t j = 0; j < h; j += kLanes) {
    StoreV(v + j, (r * LoadV(col_even + j)) * inverse);
    StoreV(v + h + j, (r * LoadV(col_odd + j)) * inverse);
  }
}

// optax4bit._steps.restart_factored_overflow: where g * g is +inf the update
// is 0 * g and the first moment restarts from 0.
void RestartFactoredOverflow(int64_t h, const float* __restrict g, float* __restrict out,
                             float* __restrict m) {
  for (int64_t j = 0; j < h; j += kLanes) {
    const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
    const VF ge = EvenOf(ga, gb), go = OddOf(ga, gb);
    StoreV(out + 2 * j, ga * ga == INFINITY ? ga * 0.0f : LoadV(out + 2 * j));
    StoreV(out + 2 * j + kLanes, gb * gb == INFINITY ? gb * 0.0f : LoadV(out + 2 * j + kLanes));
    StoreV(m + j, ge * ge == INFINITY ? VF{} : LoadV(m + j));
    StoreV(m + h + j, go * go == INFINITY ? VF{} : LoadV(m + h + j));
  }
}

// The first loop of a factored Adam row, fused as the Adam step's
// MomentsAndUpdate: the new first moment (1 - b1) g + b1 m, the second
// rebuilt from its factors (FactoredSecondMoment's), the update
// written over the gradient (out may alias g), then where g * g is +inf the
// update 0 * g and the first moment 0 (RestartFactoredOverflow); the first
// moment as stored into m, its block maxima into new_block_scales (which may
// alias the old ones, each read first) and the gradient into g_copy, for a
// row that divides after all. Returns whether Markstein's quotient may not
// be XLA's somewhere in the row.
bool FactoredMomentsAndUpdate(const FirstMomentRowsArgs& a, int64_t i, const Table& m_table,
                              VF r, float* __restrict m, float* __restrict g_copy) {
  const int64_t h = a.h, blocks = h / kBlockBytes;
  const Coefficients& c = a.c;
  const float* g = a.g + i * 2 * h;
  float* out = a.out + i * 2 * h;
  const uint8_t* codes = a.m_codes + i * h;
  const float* block_scales = a.m_scales + i * blocks;
  float* new_block_scales = a.m_scales_out + i * blocks;
  const VF row = VF{} + a.factor_rows[i];
  const bool positive = a.factor_positive;
  const float inverse = a.factor_inverse;
  VI unsafe = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = block_scales[b];
    VU block_max = {};
    for (int64_t j = b * kBlockBytes; j < (b + 1) * kBlockBytes; j += kLanes) {
      const VI byte = LoadCodes(codes + j);
      PrefetchAhead(g + 2 * j);
      const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
      StoreV(g_copy + 2 * j, ga);
      StoreV(g_copy + 2 * j + kLanes, gb);
      const VF ge = EvenOf(ga, gb), go = OddOf(ga, gb);
      VF me = MulAddV(VF{} + c.one_minus_b1, ge, c.b1 * (Lookup(m_table, byte & 15) * s));
      VF mo = MulAddV(VF{} + c.one_minus_b1, go, c.b1 * (Lookup(m_table, byte >> 4) * s));
      const VF ve = positive ? (row * LoadV(a.col_even + j)) * inverse : VF{};
      const VF vo = positive ? (row * LoadV(a.col_odd + j)) * inverse : VF{};
      VF ue = UpdateV<false>(ge, me, ve, c, r, unsafe);
      VF uo = UpdateV<false>(go, mo, vo, c, r, unsafe);
      const VI overflow_e = ge * ge == INFINITY, overflow_o = go * go == INFINITY;
      ue = overflow_e ? ge * 0.0f : ue;
      uo = overflow_o ? go * 0.0f : uo;
      me = overflow_e ? VF{} : me;
      mo = overflow_o ? VF{} : mo;
      StoreInterleaved(out + 2 * j, ue, uo);
      StoreV(m + j, me);
      StoreV(m + h + j, mo);
      block_max = MaxV(block_max, MaxV(FiniteAbsBits(me), FiniteAbsBits(mo)));
    }
    new_block_scales[b] = FromBits(HorizontalMax(block_max));
  }
  for (int k = 0; k < kLanes; ++k) {
    if (unsafe[k]) return true;
  }
  return false;
}

// Rows [lo, hi) of Optax4bitFirstMomentApply; scratch: 3d floats.
void FirstMomentRows(const FirstMomentRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, d = 2 * h, blocks = h / kBlockBytes;
  const TableRounding rounding(a.m_table, a.m_table + kTableSize, a.m_seed);
  const Table m_table = LoadTable(a.m_table);
  const float r = 1.0f / a.c.c2;
  float* m = scratch;
  float* v = m + d;
  float* g_copy = v + d;
  for (int64_t i = lo; i < hi; ++i) {
    // The update overwrites the gradient row (aliased).
    const float* g_row = a.g + i * d;
    float* out = a.out + i * d;
    const uint8_t* codes = a.m_codes + i * h;
    const float* scales = a.m_scales + i * blocks;
    // The stall rule's stored codes: a copy of the old ones (the encoders'
    // codes are __restrict), in v's scratch, free once the update is written.
    const uint8_t* stall_codes = nullptr;
    if (a.step == FirstMomentStep::kFactored) {
      if (FactoredMomentsAndUpdate(a, i, m_table, VF{} + r, m, g_copy) ||
          !C2AllowsMarkstein(a.c.c2)) {
        // m holds the moment before the restart wherever it did not restart.
        FactoredSecondMoment(h, a.factor_rows[i], a.col_even, a.col_odd, a.factor_positive,
                             a.factor_inverse, v);
        UpdateT<true>(h, m, v, a.c, r, out);
        RestartFactoredOverflow(h, g_copy, out, m);
      }
      if (a.m_stall) stall_codes = (const uint8_t*)std::memcpy(v, codes, h);
      EncodeFirstMomentScaled(a.m_stochastic, h, m, rounding, a.row_base[i],
                              a.m_scales_out + i * blocks, a.m_out + i * h, stall_codes);
    } else {
      Momentum(a.step == FirstMomentStep::kMomentumNesterov, h, g_row, codes, scales,
               a.m_table, a.momentum, m, out);
      if (a.m_stall) stall_codes = (const uint8_t*)std::memcpy(v, codes, h);
      EncodeFirstMoment(a.m_stochastic, h, m, rounding, a.row_base[i],
                        a.m_scales_out + i * blocks, a.m_out + i * h, stall_codes);
    }
  }
}

#endif  // OPTAX4BIT_CPU_FIRST_MOMENT_ROWS_H_
