// Row kernels of the 4-bit codecs (codec_ffi.h): decode and encode of one
// quantized array, for quantize_state's chunks (optax4bit.quant.array.decode
// / encode). Included once per ISA path by isa_path_rows.h, after
// vector_ops.h and encode_rows.h, whose vectors, lookups and encoders they
// share (no include guard, as those files).
//
// Rows hold d = 2h values in their natural order; codes pack element 2j in
// the low nibble of byte j and element 2j + 1 in the high one.
#ifndef OPTAX4BIT_CPU_CODEC_ROWS_H_  // once per ISA path: isa_path_rows.h resets it
#define OPTAX4BIT_CPU_CODEC_ROWS_H_


// Splits a row of 2h values into its even (x[0, h)) and odd (x[h, 2h)) ones.
void SplitRow(int64_t h, const float* __restrict row, float* __restrict x) {
  for (int64_t j = 0; j < h; j += kLanes) {
    PrefetchAhead(row + 2 * j);
    const VF a = LoadV(row + 2 * j), b = LoadV(row + 2 * j + kLanes);
    StoreV(x + j, EvenOf(a, b));
    StoreV(x + h + j, OddOf(a, b));
  }
}

// table[code] * scale, the scale per 128-element block (block_scales, h / 64
// of them) or, with col_scales, min(row scale, column scale).
void DecodeRow(int64_t h, const uint8_t* __restrict codes, const float* __restrict scales,
               const float* __restrict col_scales, const float* __restrict table_values,
               float* __restrict out) {
  const Table table = LoadTable(table_values);
  for (int64_t j = 0; j < h; j += kLanes) {
    const VI byte = LoadCodes(codes + j);
    VF se, so;
    if (col_scales == nullptr) {
      se = so = VF{} + scales[j / kBlockBytes];
    } else {
      const VF row = VF{} + scales[0];
      const VF ca = LoadV(col_scales + 2 * j), cb = LoadV(col_scales + 2 * j + kLanes);
      const VF ce = EvenOf(ca, cb), co = OddOf(ca, cb);
      se = row < ce ? row : ce;
      so = row < co ? row : co;
    }
    StoreInterleaved(out + 2 * j, Lookup(table, byte & 15) * se, Lookup(table, byte >> 4) * so);
  }
}

// Rows [lo, hi) of Decode4bit.
void DecodeRows(const CodecRowsArgs& a, int64_t lo, int64_t hi, float* /*scratch*/) {
  const int64_t h = a.h, blocks = h / kBlockBytes;
  for (int64_t i = lo; i < hi; ++i) {
    DecodeRow(h, a.codes + i * h, a.rank1 ? a.row_scales + i : a.block_scales + i * blocks,
              a.rank1 ? a.col_scales : nullptr, a.table, a.out + i * 2 * h);
  }
}

// Rows [lo, hi) of EncodeBlock4bit: block maxima and codes (scratch: 2h);
// with stall (and stochastic), the stall rule against the stored codes a.codes.
void EncodeBlockRows(const CodecRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h, blocks = h / kBlockBytes;
  const TableRounding rounding(a.table, a.table + kTableSize, a.seed);
  for (int64_t i = lo; i < hi; ++i) {
    SplitRow(h, a.x + i * 2 * h, scratch);
    EncodeFirstMoment(a.stochastic, h, scratch, rounding, a.row_base[i],
                      a.block_scales_out + i * blocks, a.codes_out + i * h,
                      a.stall ? a.codes + i * h : nullptr);
  }
}

// Rows [lo, hi) of EncodeRank14bit under given scales (scratch: 2h); stall
// as EncodeBlockRows'.
void EncodeRank1Rows(const CodecRowsArgs& a, int64_t lo, int64_t hi, float* scratch) {
  const int64_t h = a.h;
  const Bounds thresholds4 = MakeBounds(a.thresholds4);
  const TableRounding rounding(a.table, a.table + kTableSize, a.seed);
  for (int64_t i = lo; i < hi; ++i) {
    SplitRow(h, a.x + i * 2 * h, scratch);
    const float row_inverse = InverseTimes4(a.row_scales[i]) * a.inverse_factor;
    uint8_t* codes = a.codes_out + i * h;
    if (!a.stochastic) {
      EncodeSecondMoment(a.linear, h, scratch, row_inverse, a.inv_col_even, a.inv_col_odd,
                         thresholds4, codes);
    } else if (a.stall) {
      const uint8_t* stored = a.codes + i * h;
      if (rounding.fast) {
        EncodeSecondMomentStochasticT<true, true>(h, scratch, row_inverse, a.inv_col_even,
                                                  a.inv_col_odd, rounding, a.row_base[i], codes,
                                                  stored);
      } else {
        EncodeSecondMomentStochasticT<false, true>(h, scratch, row_inverse, a.inv_col_even,
                                                   a.inv_col_odd, rounding, a.row_base[i], codes,
                                                   stored);
      }
    } else if (rounding.fast) {
      EncodeSecondMomentStochasticT<true>(h, scratch, row_inverse, a.inv_col_even,
                                          a.inv_col_odd, rounding, a.row_base[i], codes);
    } else {
      EncodeSecondMomentStochasticT<false>(h, scratch, row_inverse, a.inv_col_even,
                                           a.inv_col_odd, rounding, a.row_base[i], codes);
    }
  }
}

#endif  // OPTAX4BIT_CPU_CODEC_ROWS_H_
