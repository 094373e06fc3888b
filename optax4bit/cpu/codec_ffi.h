// The 4-bit codecs' FFI calls (optax4bit/cpu/codec.py): decode and encode
// of one quantized array on the row kernels of codec_rows.h. Included once
// at the end of kernels.cc, whose ISA paths, thread splitting and checks
// they share.
#ifndef OPTAX4BIT_CPU_CODEC_FFI_H_
#define OPTAX4BIT_CPU_CODEC_FFI_H_

namespace {

// The codecs' row kernels of each ISA path, in the order of kIsaPaths.
struct CodecPath {
  void (*decode_rows)(const CodecRowsArgs&, int64_t, int64_t, float*);
  void (*encode_block_rows)(const CodecRowsArgs&, int64_t, int64_t, float*);
  void (*encode_rank1_rows)(const CodecRowsArgs&, int64_t, int64_t, float*);
};

constexpr CodecPath kCodecPaths[] = {
#ifdef OPTAX4BIT_X86_PATHS
    {avx512::DecodeRows, avx512::EncodeBlockRows, avx512::EncodeRank1Rows},
    {avx2::DecodeRows, avx2::EncodeBlockRows, avx2::EncodeRank1Rows},
#endif
    {baseline::DecodeRows, baseline::EncodeBlockRows, baseline::EncodeRank1Rows},
};
static_assert(sizeof(kCodecPaths) / sizeof(kCodecPaths[0]) ==
              sizeof(kIsaPaths) / sizeof(kIsaPaths[0]));

const CodecPath& CurrentCodecPath() { return kCodecPaths[CurrentIsaPath().load() - kIsaPaths]; }

// Rows and row length of a codec's float array: 2-D, a multiple of 128 columns.
ffi::Error CodecGeometry(ffi::Span<const int64_t> dims, int64_t& rows, int64_t& d) {
  if (dims.size() != 2 || dims[1] % (2 * kBlockBytes) != 0) {
    return ffi::Error::InvalidArgument("values must be 2-D with a multiple of 128 columns");
  }
  rows = dims[0];
  d = dims[1];
  return ffi::Error::Success();
}

// optax4bit.quant.array.decode of 4-bit codes (rows, d / 2): table[code] *
// scale, the scales per 128-element block (rows, d / 128) or, if rank1, the
// row (rows, 1) and column (1, d) maxima, min of the two.
ffi::Error Decode4bitImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes,
                          ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> col_scales,
                          ffi::Buffer<ffi::F32> table, bool rank1,
                          ffi::ResultBuffer<ffi::F32> out) {
  int64_t rows, d;
  if (ffi::Error error = CodecGeometry(out->dimensions(), rows, d); error.failure()) return error;
  const int64_t h = d / 2;
  if ((int64_t)codes.element_count() != rows * h ||
      (int64_t)scales.element_count() != (rank1 ? rows : rows * h / kBlockBytes) ||
      (rank1 && (int64_t)col_scales.element_count() != d) ||
      (int64_t)table.element_count() != kTableSize) {
    return ffi::Error::InvalidArgument("codes, scales or table do not match the values");
  }
  CodecRowsArgs args{};
  args.h = h;
  args.rank1 = rank1;
  args.codes = codes.typed_data();
  args.block_scales = args.row_scales = scales.typed_data();
  args.col_scales = col_scales.typed_data();
  args.table = table.typed_data();
  args.out = out->typed_data();
  RunRows(pool, rows, d, 1, args, CurrentCodecPath().decode_rows);
  return ffi::Error::Success();
}

// An encode's stall rule: it rounds stochastically and reads `count` stored
// code bytes; without it, stored is empty.
ffi::Error CheckStall(const ffi::Buffer<ffi::U8>& stored, int64_t count, bool stochastic,
                      bool stall) {
  if (stall && !stochastic) {
    return ffi::Error::InvalidArgument("the stall rule rounds stochastically");
  }
  if ((int64_t)stored.element_count() != (stall ? count : 0)) {
    return ffi::Error::InvalidArgument(
        "stored codes must match the codes with stall, and be empty without");
  }
  return ffi::Error::Success();
}

// optax4bit.quant.array.encode of float32 values (rows, d) with 128-element
// block scales (their finite maxima, also returned): a signed 16-entry map
// (tables: entries, then midpoint thresholds), rounded to the nearest entry
// or stochastically (the draws of maps.hashed_uniform under seeds[0], the
// rows' flat indices in the whole array in row_bases), with stall by the stall
// rule against stored (the codes the values replace, (rows, d / 2); empty
// without stall).
ffi::Error EncodeBlock4bitImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> tables, ffi::Buffer<ffi::U32> seeds,
                               ffi::Buffer<ffi::U32> row_bases, ffi::Buffer<ffi::U8> stored,
                               bool stochastic, bool stall, ffi::ResultBuffer<ffi::U8> codes,
                               ffi::ResultBuffer<ffi::F32> block_scales) {
  int64_t rows, d;
  if (ffi::Error error = CodecGeometry(x.dimensions(), rows, d); error.failure()) return error;
  const int64_t h = d / 2;
  if ((int64_t)codes->element_count() != rows * h ||
      (int64_t)block_scales->element_count() != rows * h / kBlockBytes ||
      (int64_t)tables.element_count() != 2 * kTableSize - 1 || seeds.element_count() != 1 ||
      (int64_t)row_bases.element_count() != rows) {
    return ffi::Error::InvalidArgument("codes, scales, tables, seeds or row_bases do not match");
  }
  if (ffi::Error error = CheckStall(stored, rows * h, stochastic, stall); error.failure()) {
    return error;
  }
  CodecRowsArgs args{};
  args.h = h;
  args.stochastic = stochastic;
  args.stall = stall;
  args.codes = stored.typed_data();
  args.table = tables.typed_data();
  args.x = x.typed_data();
  args.row_base = row_bases.typed_data();
  args.seed = seeds.typed_data()[0];
  args.codes_out = codes->typed_data();
  args.block_scales_out = block_scales->typed_data();
  RunRows(pool, rows, d, 1, args, CurrentCodecPath().encode_block_rows);
  return ffi::Error::Success();
}

// optax4bit.quant.array.encode of float32 values (rows, d) under given rank-1
// scales (row maxima (rows, 1), column maxima (1, d)): an unsigned 16-entry
// map (tables: entries, then midpoint thresholds, normal, in (0, 1]), to the
// nearest entry (Linear, linear: by its closed form; others by their
// thresholds) or stochastically (the draws of maps.hashed_uniform under
// seeds[0], the rows' flat indices in the whole array in row_bases), with
// stall by the stall rule against stored (as EncodeBlock4bitImpl's).
ffi::Error EncodeRank14bitImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> row_scales, ffi::Buffer<ffi::F32> col_scales,
                               ffi::Buffer<ffi::F32> tables, ffi::Buffer<ffi::U32> seeds,
                               ffi::Buffer<ffi::U32> row_bases, ffi::Buffer<ffi::U8> stored,
                               bool linear, bool stochastic, bool stall,
                               ffi::ResultBuffer<ffi::U8> codes) {
  int64_t rows, d;
  if (ffi::Error error = CodecGeometry(x.dimensions(), rows, d); error.failure()) return error;
  const int64_t h = d / 2;
  if ((int64_t)codes->element_count() != rows * h ||
      (int64_t)row_scales.element_count() != rows ||
      (int64_t)col_scales.element_count() != d ||
      (int64_t)tables.element_count() != 2 * kTableSize - 1 || seeds.element_count() != 1 ||
      (int64_t)row_bases.element_count() != rows) {
    return ffi::Error::InvalidArgument("codes, scales, tables, seeds or row_bases do not match");
  }
  if (linear && stochastic) {
    return ffi::Error::InvalidArgument("linear is for rounding to the nearest entry");
  }
  if (ffi::Error error = CheckStall(stored, rows * h, stochastic, stall); error.failure()) {
    return error;
  }
  FlushDenormals flush;  // for the scale reciprocals
  Rank1Encoder encoder;
  if (ffi::Error error = MakeRank1Encoder(tables.typed_data() + kTableSize,
                                          col_scales.typed_data(), h, linear, encoder);
      error.failure()) {
    return error;
  }
  CodecRowsArgs args{};
  args.h = h;
  args.linear = linear;
  args.stochastic = stochastic;
  args.stall = stall;
  args.codes = stored.typed_data();
  args.table = tables.typed_data();
  args.row_base = row_bases.typed_data();
  args.seed = seeds.typed_data()[0];
  args.x = x.typed_data();
  args.row_scales = row_scales.typed_data();
  args.thresholds4 = encoder.thresholds4;
  args.inv_col_even = encoder.inv_col_even.data();
  args.inv_col_odd = encoder.inv_col_odd.data();
  args.inverse_factor = encoder.inverse_factor;
  args.codes_out = codes->typed_data();
  RunRows(pool, rows, d, 1, args, CurrentCodecPath().encode_rank1_rows);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitDecode4bit, Decode4bitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes (rows, d / 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // block or row scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // column scales (rank1)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table (16,)
                                  .Attr<bool>("rank1")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // values (rows, d)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitEncodeBlock4bit, EncodeBlock4bitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values (rows, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // entries and thresholds (31,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // rounding seed (1,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // row hash bases (rows,)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // stored codes, or (0,)
                                  .Attr<bool>("stochastic")
                                  .Attr<bool>("stall")
                                  .Ret<ffi::Buffer<ffi::U8>>()   // codes (rows, d / 2)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // block scales (rows, d / 128)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Optax4bitEncodeRank14bit, EncodeRank14bitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values (rows, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row scales (rows, 1)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // column scales (1, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // entries and thresholds (31,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // rounding seed (1,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // row hash bases (rows,)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // stored codes, or (0,)
                                  .Attr<bool>("linear")
                                  .Attr<bool>("stochastic")
                                  .Attr<bool>("stall")
                                  .Ret<ffi::Buffer<ffi::U8>>()   // codes (rows, d / 2)
);

#endif  // OPTAX4BIT_CPU_CODEC_FFI_H_
