// The FFI handler of the fused steps whose only quantized moment is the
// first (heavy-ball momentum, Adam with a factored second moment), included
// once at the end of kernels.cc: it runs FirstMomentRows (first_moment_rows.h)
// of the current ISA path over the rows, as ApplyImpl runs Adam's.
#ifndef OPTAX4BIT_CPU_FIRST_MOMENT_FFI_H_
#define OPTAX4BIT_CPU_FIRST_MOMENT_FFI_H_

namespace {

// One step of an optimizer whose only quantized moment is the first, B128 as
// Adam's (its codes, block scales, tables and seed as ApplyImpl's), in one
// call: rows are independent. step: "momentum" and "momentum_nesterov"
// (optax4bit._steps.momentum_step; coef: the momentum) or "factored"
// (optax4bit._steps.factored_step; coef: the 12 Adam coefficients,
// factor_rows (rows,), factor_cols (slices * d,) and factor_mean (slices,):
// the factored second moment's row and column factors and the mean of the row
// factor, per slice (leading index) of a leaf of more than two axes; empty
// for the momentum steps). m_stall: with m_stochastic, the stall rule
// (stochastic rounding only where the nearest code is the old one).
ffi::Error FirstMomentImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad,
                           ffi::Buffer<ffi::U8> m_codes, ffi::Buffer<ffi::F32> m_scales,
                           ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::F32> tables,
                           ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::U32> row_bases,
                           ffi::Buffer<ffi::F32> factor_rows, ffi::Buffer<ffi::F32> factor_cols,
                           ffi::Buffer<ffi::F32> factor_mean, std::string_view step,
                           bool m_stochastic, bool m_stall,
                           ffi::ResultBuffer<ffi::F32> update,
                           ffi::ResultBuffer<ffi::U8> m_codes_out,
                           ffi::ResultBuffer<ffi::F32> m_scales_out) {
  FirstMomentRowsArgs args;
  if (step == "momentum") {
    args.step = FirstMomentStep::kMomentum;
  } else if (step == "momentum_nesterov") {
    args.step = FirstMomentStep::kMomentumNesterov;
  } else if (step == "factored") {
    args.step = FirstMomentStep::kFactored;
  } else {
    return ffi::Error::InvalidArgument("step must be momentum, momentum_nesterov or factored");
  }
  const bool factored = args.step == FirstMomentStep::kFactored;
  int64_t rows, d;
  if (!RowsOf(grad.dimensions(), 2 * kBlockBytes, rows, d)) {
    return ffi::Error::InvalidArgument(
        "grad must have two axes or more, the last a multiple of 128");
  }
  const int64_t h = d / 2, blocks = h / kBlockBytes;
  if ((int64_t)m_codes.element_count() != rows * h ||
      (int64_t)m_scales.element_count() != rows * blocks) {
    return ffi::Error::InvalidArgument("first-moment codes or scales do not match grad");
  }
  if ((int64_t)coef.element_count() != (factored ? kCoefSize : 1)) {
    return ffi::Error::InvalidArgument(
        "coef must hold the momentum, or the 12 Adam coefficients of the factored step");
  }
  if ((int64_t)tables.element_count() != 2 * kTableSize - 1) {
    return ffi::Error::InvalidArgument("tables must hold 16 entries and 15 thresholds");
  }
  if (m_stall && !m_stochastic) {
    return ffi::Error::InvalidArgument("the stall rule rounds stochastically");
  }
  if (seed.element_count() != 1 || (int64_t)row_bases.element_count() != rows) {
    return ffi::Error::InvalidArgument("seed must hold one uint32, row_bases one per row");
  }
  // A leaf of more than two axes has factors per leading index (slice) of
  // its last two axes: factor_mean holds one mean per slice.
  const int64_t slices = factored ? (int64_t)factor_mean.element_count() : 1;
  if (factored && (slices < 1 || rows % slices != 0 ||
                   (int64_t)factor_rows.element_count() != rows ||
                   (int64_t)factor_cols.element_count() != slices * d)) {
    return ffi::Error::InvalidArgument("factors do not match grad");
  }
  FlushDenormals flush;  // also for the reciprocal of the mean below
  std::vector<float> col_even, col_odd;
  args.h = h;
  args.g = grad.typed_data();
  args.m_scales = m_scales.typed_data();
  args.m_table = tables.typed_data();
  args.m_codes = m_codes.typed_data();
  args.row_base = row_bases.typed_data();
  args.m_seed = seed.typed_data()[0];
  args.m_stochastic = m_stochastic;
  args.m_stall = m_stall;
  args.momentum = factored ? 0.0f : coef.typed_data()[0];
  args.c = factored ? ReadCoefficients(coef.typed_data()) : Coefficients{};
  args.factor_rows = nullptr;
  args.col_even = args.col_odd = nullptr;
  args.factor_positive = false;
  args.factor_inverse = 0.0f;
  args.out = update->typed_data();
  args.m_out = m_codes_out->typed_data();
  args.m_scales_out = m_scales_out->typed_data();
  const IsaPath& isa = *CurrentIsaPath().load();
  if (!factored) {
    RunRows(pool, rows, d, 3, args, isa.first_moment_rows);
    return ffi::Error::Success();
  }
  // Each slice's rows with its column factor and mean.
  const int64_t slice_rows = rows / slices;
  for (int64_t s = 0; s < slices; ++s) {
    FirstMomentRowsArgs slice = args;
    const int64_t r0 = s * slice_rows;
    SplitEvenOdd(h, factor_cols.typed_data() + s * d, col_even, col_odd);
    const float mean = factor_mean.typed_data()[s];
    slice.g += r0 * d;
    slice.m_scales += r0 * blocks;
    slice.m_codes += r0 * h;
    slice.row_base += r0;
    slice.factor_rows = factor_rows.typed_data() + r0;
    slice.col_even = col_even.data();
    slice.col_odd = col_odd.data();
    slice.factor_positive = mean > 0.0f;
    slice.factor_inverse = 1.0f / (slice.factor_positive ? mean : 1.0f);
    slice.out += r0 * d;
    slice.m_out += r0 * h;
    slice.m_scales_out += r0 * blocks;
    RunRows(pool, slice_rows, d, 3, slice, isa.first_moment_rows);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitFirstMomentApply, FirstMomentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // grad (rows, d)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // m codes (rows, d / 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m block scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m tables (31,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // rounding seed (1,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // row hash bases (rows,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row factor (rows,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // column factors (slices * d,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row factor means (slices,)
                                  .Attr<std::string_view>("step")
                                  .Attr<bool>("m_stochastic")
                                  .Attr<bool>("m_stall")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update (aliases grad)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // m codes (in place)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m block scales (in place)
);

#endif  // OPTAX4BIT_CPU_FIRST_MOMENT_FFI_H_
