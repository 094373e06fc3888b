// The fused step of 4-bit Adam: two FFI calls per leaf on the row kernels
// of adam_4bit_rows.h, Optax4bitAdam4bitStats (the new second moment's row
// and column maxima) and Optax4bitAdam4bitApply (the step, the update and
// both moments re-encoded in place). Included once by kernels.cc, inside its
// anonymous namespace, whose ISA paths, thread splitting and checks it shares.
#ifndef OPTAX4BIT_CPU_ADAM_4BIT_FFI_H_
#define OPTAX4BIT_CPU_ADAM_4BIT_FFI_H_

// Checks shared by both calls; sets the rows and the row length d.
ffi::Error LeafGeometry(const ffi::Buffer<ffi::F32>& grad, const ffi::Buffer<ffi::U8>& v_codes,
                        const ffi::Buffer<ffi::F32>& v_rows, const ffi::Buffer<ffi::F32>& v_cols,
                        const ffi::Buffer<ffi::F32>& coef, int64_t& rows, int64_t& d) {
  if (!RowsOf(grad.dimensions(), 2 * kBlockBytes, rows, d)) {
    return ffi::Error::InvalidArgument(
        "grad must have two axes or more, the last a multiple of 128");
  }
  if ((int64_t)v_codes.element_count() != rows * d / 2 ||
      (int64_t)v_rows.element_count() != rows || (int64_t)v_cols.element_count() != d) {
    return ffi::Error::InvalidArgument("second-moment codes or scales do not match grad");
  }
  if ((int64_t)coef.element_count() != kCoefSize) {
    return ffi::Error::InvalidArgument("coef must hold 12 Adam coefficients");
  }
  return ffi::Error::Success();
}

ffi::Error StatsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad,
                     ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_rows,
                     ffi::Buffer<ffi::F32> v_cols, ffi::Buffer<ffi::F32> coef,
                     ffi::Buffer<ffi::F32> tables, ffi::ResultBuffer<ffi::F32> new_rows,
                     ffi::ResultBuffer<ffi::F32> new_cols) {
  int64_t rows, d;
  if (ffi::Error error = LeafGeometry(grad, v_codes, v_rows, v_cols, coef, rows, d);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = CheckTables(tables); error.failure()) return error;
  const int64_t h = d / 2;
  std::vector<float> col_even, col_odd;
  SplitEvenOdd(h, v_cols.typed_data(), col_even, col_odd);
  StatsRowsArgs args;
  args.h = h;
  args.g = grad.typed_data();
  args.row_scales = v_rows.typed_data();
  args.col_even = col_even.data();
  args.col_odd = col_odd.data();
  args.v_table = tables.typed_data() + 2 * kTableSize - 1;
  args.codes = v_codes.typed_data();
  args.c = ReadCoefficients(coef.typed_data());
  args.new_rows = new_rows->typed_data();
  const IsaPath& isa = *CurrentIsaPath().load();
  RowSplitter splitter(pool, rows, d);
  std::vector<std::vector<uint32_t>> col_max(splitter.NumWorkers(), std::vector<uint32_t>(d, 0));
  std::vector<std::vector<float>> scratch(splitter.NumWorkers());
  splitter.Run([&](int64_t lo, int64_t hi, int64_t worker) {
    scratch[worker].resize(d);
    isa.stats_rows(args, lo, hi, scratch[worker].data(), col_max[worker].data());
  });
  float* out_cols = new_cols->typed_data();
  for (int64_t j = 0; j < h; ++j) {
    uint32_t e = 0, o = 0;
    for (const auto& cm : col_max) {
      e = std::max(e, cm[j]);
      o = std::max(o, cm[h + j]);
    }
    out_cols[2 * j] = FromBits(e);
    out_cols[2 * j + 1] = FromBits(o);
  }
  return ffi::Error::Success();
}

// seeds: (2,) uint32, the stochastic rounding seeds (maps.rounding_seed) of
// the first and second moments; row_bases: (rows,) uint32, the flat index in
// the whole leaf of each row's first element (maps.row_hash_bases: i * d for
// a whole leaf, global indices for a shard); m_stochastic: round the first moment
// stochastically (else to the nearest entry); v_stochastic: the same for the
// second moment; v_linear: the second moment's map is Linear and it is rounded
// to the nearest entry (encoded by a closed form, others by their thresholds);
// m_stall, v_stall: the moment rounded stochastically rounds by the stall rule
// (stochastically only where the nearest code is its old code).
ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad,
                     ffi::Buffer<ffi::U8> m_codes, ffi::Buffer<ffi::F32> m_scales,
                     ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_rows,
                     ffi::Buffer<ffi::F32> v_cols, ffi::Buffer<ffi::F32> new_v_rows,
                     ffi::Buffer<ffi::F32> new_v_cols, ffi::Buffer<ffi::F32> coef,
                     ffi::Buffer<ffi::F32> tables, ffi::Buffer<ffi::U32> seeds,
                     ffi::Buffer<ffi::U32> row_bases, bool nesterov,
                     bool m_stochastic, bool v_stochastic, bool v_linear, bool m_stall,
                     bool v_stall, ffi::ResultBuffer<ffi::F32> update, ffi::ResultBuffer<ffi::U8> m_codes_out,
                     ffi::ResultBuffer<ffi::F32> m_scales_out,
                     ffi::ResultBuffer<ffi::U8> v_codes_out) {
  int64_t rows, d;
  if (ffi::Error error = LeafGeometry(grad, v_codes, v_rows, v_cols, coef, rows, d);
      error.failure()) {
    return error;
  }
  const int64_t h = d / 2, blocks = h / kBlockBytes;
  if ((int64_t)m_codes.element_count() != rows * h ||
      (int64_t)m_scales.element_count() != rows * blocks ||
      (int64_t)new_v_rows.element_count() != rows || (int64_t)new_v_cols.element_count() != d) {
    return ffi::Error::InvalidArgument("first-moment codes or scales do not match grad");
  }
  if (ffi::Error error = CheckTables(tables); error.failure()) return error;
  if (v_linear && v_stochastic) {
    return ffi::Error::InvalidArgument("v_linear is for a second moment rounded to nearest");
  }
  if ((m_stall && !m_stochastic) || (v_stall && !v_stochastic)) {
    return ffi::Error::InvalidArgument("the stall rule rounds stochastically");
  }
  if (seeds.element_count() != 2) {
    return ffi::Error::InvalidArgument("seeds must hold one uint32 per moment");
  }
  if ((int64_t)row_bases.element_count() != rows) {
    return ffi::Error::InvalidArgument("row_bases must hold one uint32 per row");
  }
  FlushDenormals flush;  // also for the scale reciprocals below
  const float* m_table = tables.typed_data();
  const float* v_table = m_table + 2 * kTableSize - 1;
  // The encoder of the new v, under the new scales.
  Rank1Encoder v_encoder;
  if (ffi::Error error = MakeRank1Encoder(v_table + kTableSize, new_v_cols.typed_data(), h,
                                          v_linear, v_encoder);
      error.failure()) {
    return error;
  }
  std::vector<float> col_even, col_odd;
  SplitEvenOdd(h, v_cols.typed_data(), col_even, col_odd);
  ApplyRowsArgs args;
  args.h = h;
  args.g = grad.typed_data();
  args.m_scales = m_scales.typed_data();
  args.row_scales = v_rows.typed_data();
  args.new_row_scales = new_v_rows.typed_data();
  args.col_even = col_even.data();
  args.col_odd = col_odd.data();
  args.inv_col_even = v_encoder.inv_col_even.data();
  args.inv_col_odd = v_encoder.inv_col_odd.data();
  args.m_table = m_table;
  args.v_table = v_table;
  args.v_thresholds4 = v_encoder.thresholds4;
  args.m_codes = m_codes.typed_data();
  args.v_codes = v_codes.typed_data();
  args.row_base = row_bases.typed_data();
  args.m_seed = seeds.typed_data()[0];
  args.v_seed = seeds.typed_data()[1];
  args.inverse_factor = v_encoder.inverse_factor;
  args.c = ReadCoefficients(coef.typed_data());
  args.nesterov = nesterov;
  args.m_stochastic = m_stochastic;
  args.v_stochastic = v_stochastic;
  args.v_linear = v_linear;
  args.m_stall = m_stall;
  args.v_stall = v_stall;
  args.out = update->typed_data();
  args.m_out = m_codes_out->typed_data();
  args.v_out = v_codes_out->typed_data();
  args.m_scales_out = m_scales_out->typed_data();
  const IsaPath& isa = *CurrentIsaPath().load();
  RunRows(pool, rows, d, 3, args, isa.apply_rows);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitAdam4bitStats, StatsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // grad (rows, d)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v codes (rows, d / 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v row scales (rows, 1)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v column scales (1, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients (12,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tables (62,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new v row scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new v column scales
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitAdam4bitApply, ApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // grad (rows, d)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // m codes (rows, d / 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m block scales
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v codes (rows, d / 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v row scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v column scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new v row scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new v column scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients (12,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tables (62,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // rounding seeds (2,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // row hash bases (rows,)
                                  .Attr<bool>("nesterov")
                                  .Attr<bool>("m_stochastic")
                                  .Attr<bool>("v_stochastic")
                                  .Attr<bool>("v_linear")
                                  .Attr<bool>("m_stall")
                                  .Attr<bool>("v_stall")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update (aliases grad)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // m codes (in place)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m block scales (in place)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v codes (in place)
);

#endif  // OPTAX4BIT_CPU_ADAM_4BIT_FFI_H_
