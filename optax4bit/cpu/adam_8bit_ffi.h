// The fused step of 8-bit Adam (optax4bit.adamw_8bit): one FFI call per
// leaf, on the row kernels of adam_8bit_rows.h. Included once at the end of
// kernels.cc, whose ISA paths, thread splitting and checks it shares.
#ifndef OPTAX4BIT_CPU_ADAM_8BIT_FFI_H_
#define OPTAX4BIT_CPU_ADAM_8BIT_FFI_H_

namespace {

// One step of 8-bit Adam (optax4bit.adamw_8bit) for one leaf, in one call:
// per row, decode both moments (256-entry tables), run the float32 Adam step,
// write the update over the gradient and re-encode both moments in place,
// block by block (each block's scale is the maximum of its new values; no
// statistics of the whole leaf are needed). tables: each moment's 256
// entries; buckets: each moment's kBucketTableSize bucket entries.
ffi::Error Apply8bitImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad,
                         ffi::Buffer<ffi::U8> m_codes, ffi::Buffer<ffi::F32> m_scales,
                         ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_scales,
                         ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::F32> tables,
                         ffi::Buffer<ffi::S32> buckets, bool nesterov,
                         ffi::ResultBuffer<ffi::F32> update,
                         ffi::ResultBuffer<ffi::U8> m_codes_out,
                         ffi::ResultBuffer<ffi::F32> m_scales_out,
                         ffi::ResultBuffer<ffi::U8> v_codes_out,
                         ffi::ResultBuffer<ffi::F32> v_scales_out) {
  int64_t rows, d;
  if (!RowsOf(grad.dimensions(), kBlock8, rows, d)) {
    return ffi::Error::InvalidArgument(
        "grad must have two axes or more, the last a multiple of 256");
  }
  const int64_t blocks = d / kBlock8;
  for (const auto* codes : {&m_codes, &v_codes}) {
    if ((int64_t)codes->element_count() != rows * d) {
      return ffi::Error::InvalidArgument("codes do not match grad");
    }
  }
  for (const auto* scales : {&m_scales, &v_scales}) {
    if ((int64_t)scales->element_count() != rows * blocks) {
      return ffi::Error::InvalidArgument("block scales do not match grad");
    }
  }
  if ((int64_t)coef.element_count() != kCoefSize) {
    return ffi::Error::InvalidArgument("coef must hold 12 Adam coefficients");
  }
  if ((int64_t)tables.element_count() != kTables8Size ||
      (int64_t)buckets.element_count() != 2 * kBucketTableSize) {
    return ffi::Error::InvalidArgument("tables or buckets do not have the 8-bit sizes");
  }
  Apply8bitRowsArgs args;
  args.h = d / 2;
  args.g = grad.typed_data();
  args.m_scales = m_scales.typed_data();
  args.v_scales = v_scales.typed_data();
  args.m_table = tables.typed_data();
  args.v_table = args.m_table + 256;
  args.m_codes = m_codes.typed_data();
  args.v_codes = v_codes.typed_data();
  args.m_buckets = buckets.typed_data();
  args.v_buckets = args.m_buckets + kBucketTableSize;
  args.c = ReadCoefficients(coef.typed_data());
  args.nesterov = nesterov;
  args.out = update->typed_data();
  args.m_out = m_codes_out->typed_data();
  args.v_out = v_codes_out->typed_data();
  args.m_scales_out = m_scales_out->typed_data();
  args.v_scales_out = v_scales_out->typed_data();
  const IsaPath& isa = *CurrentIsaPath().load();
  RunRows(pool, rows, d, 3, args, isa.apply_8bit_rows);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitAdam8bitApply, Apply8bitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // grad (rows, d)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // m codes (rows, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m block scales
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v codes (rows, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v block scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients (12,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tables (512,)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // buckets
                                  .Attr<bool>("nesterov")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update (aliases grad)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // m codes (in place)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m block scales (in place)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v codes (in place)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v block scales (in place)
);

#endif  // OPTAX4BIT_CPU_ADAM_8BIT_FFI_H_
