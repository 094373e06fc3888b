// Row kernels of the fused steps whose only quantized moment is the first,
// heavy-ball momentum and Adam with a factored second moment (adam_4bit.cc:
// Optax4bitFirstMomentApply). isa_path_rows.h includes this file after
// adam_4bit_rows.h in each ISA path's namespace: these rows run its
// first-moment kernels (decode, NewFirstMoment, EncodeFirstMoment,
// FirstMomentRounding) and Update.

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
      const VF ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
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

// Whether g * g is +inf anywhere in a row of d elements (rare: the restart
// below then runs on a copy of the row).
bool SquareOverflows(int64_t d, const float* __restrict g) {
  VI any = {};
  for (int64_t k = 0; k < d; k += kLanes) {
    const VF x = LoadV(g + k);
    any |= x * x == INFINITY;
  }
  for (int k = 0; k < kLanes; ++k) {
    if (any[k]) return true;
  }
  return false;
}

// optax4bit._steps.restart_factored_overflow: where g * g is +inf the update
// is 0 * g and the first moment restarts from 0.
void RestartFactoredOverflow(int64_t h, const float* __restrict g, float* __restrict out,
                             float* __restrict m) {
  for (int64_t j = 0; j < h; j += kLanes) {
    const VF ga = LoadV(g + 2 * j), gb = LoadV(g + 2 * j + kLanes);
    const VF ge = __builtin_shuffle(ga, gb, kEven), go = __builtin_shuffle(ga, gb, kOdd);
    StoreV(out + 2 * j, ga * ga == INFINITY ? ga * 0.0f : LoadV(out + 2 * j));
    StoreV(out + 2 * j + kLanes, gb * gb == INFINITY ? gb * 0.0f : LoadV(out + 2 * j + kLanes));
    StoreV(m + j, ge * ge == INFINITY ? VF{} : LoadV(m + j));
    StoreV(m + h + j, go * go == INFINITY ? VF{} : LoadV(m + h + j));
  }
}

// Rows [lo, hi) of Optax4bitFirstMomentApply; scratch: 3d floats.
void FirstMomentRows(const FirstMomentRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, d = 2 * h, blocks = h / kBlockBytes;
  const FirstMomentRounding rounding(a.m_table, a.m_table + kTableSize, a.m_seed);
  float* m = scratch;
  float* v = m + d;
  float* g_copy = v + d;
  for (int64_t i = lo; i < hi; ++i) {
    // The update overwrites the gradient row (aliased).
    const float* g_row = a.g + i * d;
    float* out = a.out + i * d;
    const uint8_t* codes = a.m_codes + i * h;
    const float* scales = a.m_scales + i * blocks;
    if (a.step == FirstMomentStep::kFactored) {
      const Coefficients& c = a.c;
      NewFirstMoment(h, g_row, codes, scales, a.m_table, c.b1, c.one_minus_b1, m);
      FactoredSecondMoment(h, a.factor_rows[i], a.col_even, a.col_odd, a.factor_positive,
                           a.factor_inverse, v);
      const bool overflows = SquareOverflows(d, g_row);
      if (overflows) std::memcpy(g_copy, g_row, d * sizeof(float));
      Update(h, m, v, c, out);
      if (overflows) RestartFactoredOverflow(h, g_copy, out, m);
    } else {
      Momentum(a.step == FirstMomentStep::kMomentumNesterov, h, g_row, codes, scales,
               a.m_table, a.momentum, m, out);
    }
    EncodeFirstMoment(a.m_stochastic, h, m, rounding, a.row_base[i],
                      a.m_scales_out + i * blocks, a.m_out + i * h);
  }
}
