// The C++ library of optax4bit's XLA CPU kernels (built by setup.py as
// optax4bit/cpu/_kernels; Python side: optax4bit/cpu/ffi.py and codec.py).
// It holds what every kernel shares: the ISA paths (the row kernels of
// isa_path_rows.h compiled once per path, the path a call runs), the
// splitting of a leaf's rows over XLA's threads (row_splitter.h), the checks
// of the calls' inputs, and the library's C functions (its jaxlib version and
// ISA paths). The FFI handlers of each step live in a header of their own,
// included at the end: adam_4bit_ffi.h, adam_8bit_ffi.h, first_moment_ffi.h
// and codec_ffi.h.
//
// The fused step of 4-bit Adam runs one leaf of two axes or more (run as
// its rows: the leading axes' product) whose last axis is a multiple of 128,
// for both of optax4bit's recipes (optax4bit/recipes.py) and any pairing of
// their quantizers:
//   first moment  B128/DE or B128/NF (signed, 128-element blocks of the last
//                 axis), rounded to the nearest entry, stochastically or by
//                 the stall rule (stochastically where the nearest code is
//                 the stored one: QuantSpec stall_only);
//   second moment Rank-1/Linear, Rank-1/SqrtDE-0 or Rank-1/SqrtLinear (unsigned,
//                 scales min(row max, column max)), rounded the same ways.
// The default recipe is B128/NF stochastic + Rank-1/SqrtLinear, the paper's
// B128/DE + Rank-1/Linear, both nearest. One set of row kernels
// (adam_4bit_rows.h) serves all:
// the maps' entries and thresholds come in as the `tables` input, the
// rounding as attributes, stochastic rounding's per-leaf seeds as `seeds`.
// Two FFI calls per leaf:
//   1. Adam4bitStats: the row and column maxima of the new second moment
//      (it needs the whole leaf before any element can be encoded);
//   2. Adam4bitApply: per row, one loop decodes both moments, runs the
//      float32 Adam step and writes the update over the gradient, a second
//      re-encodes both moments in place.
// No float32 moment is stored: a row's moments live in per-thread scratch.
// The loops that stream a gradient from memory prefetch it 4 KiB ahead.
// The steps whose only quantized moment is the first, heavy-ball momentum
// (sgdm_4bit) and Adam with a factored second moment (adamw_4bit_factor,
// whose float32 factors come in as inputs), are one call,
// Optax4bitFirstMomentApply (first_moment_ffi.h, its rows in
// first_moment_rows.h), that runs the same row kernels for the first moment
// (decode, encode, rounding).
// 8-bit Adam (optax4bit.adamw_8bit: both moments B256/DE, 8 bits, nearest)
// is one call, Adam8bitApply: its block scales need no statistics pass.
// The row kernels are compiled once per ISA path (on x86-64 with GCC: AVX-512,
// AVX2 and baseline x86-64; on aarch64 NEON code as its baseline; elsewhere
// the compiler's baseline). Calls run the
// best path this CPU runs unless Optax4bitUseCpuIsa picks another.
//
// The arithmetic is that of the jnp reference as XLA (jaxlib 0.10) compiles
// it for a leaf the jnp path splits into chunks (every leaf of two rows or
// more): the same operation order; the multiply-adds XLA's CPU backend fuses
// into FMAs fused here too (explicitly: the library is built with
// -ffp-contract=off), all others not; divisions by the bias corrections
// where XLA keeps them; subnormals flushed to zero as XLA's CPU backend does;
// non-finite values excluded from maxima and NaN normalized to 0; the first
// moment restarts from 0 where the new second moment is +inf
// (optax4bit._steps.restart_overflowed: RestartOverflowed). Stochastic
// rounding draws optax4bit.quant.maps.hashed_uniform's numbers: a hash of the
// seed and of the element's flat index in the whole leaf, so the codes do
// not depend on chunking. The stall rule compares the nearest code with the
// element's old code, read from the codes the new ones overwrite in place
// (each byte before it is written). tests/test_cpu_kernel.py checks codes,
// scales and updates bit for bit against the jnp path. Python side:
// optax4bit/cpu/ffi.py.

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#define OPTAX4BIT_HAS_MXCSR 1
#endif

// x86-64 with GCC or Clang: the row kernels compiled for AVX-512 and AVX2
// besides the baseline, one binary for any x86-64 machine. A path's functions
// get its target by `#pragma GCC target` (GCC) or `#pragma clang attribute`
// (Clang, which has no GCC target pragma).
#if defined(__x86_64__) && defined(__GNUC__)
#define OPTAX4BIT_X86_PATHS 1
#include <cpuid.h>
#include <immintrin.h>
#ifdef __clang__
#define OPTAX4BIT_TARGET_PUSH(spec)                                        \
  _Pragma(OPTAX4BIT_STRING(clang attribute push(__attribute__((target(spec))), \
                                                apply_to = function)))
#define OPTAX4BIT_TARGET_POP _Pragma("clang attribute pop")
#else
#define OPTAX4BIT_TARGET_PUSH(spec) \
  _Pragma("GCC push_options") _Pragma(OPTAX4BIT_STRING(GCC target(spec)))
#define OPTAX4BIT_TARGET_POP _Pragma("GCC pop_options")
#endif
#define OPTAX4BIT_STRING(x) #x
#endif

// aarch64: the baseline path is NEON code, with 4-lane vectors and table
// lookups by TBL (GCC lowers the 16-lane vectors' lookups lane by lane).
#if defined(__aarch64__) && defined(__ARM_NEON)
#define OPTAX4BIT_NEON 1
#include <arm_neon.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockBytes = 64;     // B128: 128 codes, two per byte
constexpr int64_t kTableSize = 16;      // entries of a 4-bit map
constexpr int64_t kCoefSize = 12;       // see optax4bit.cpu.ffi._coefficients
constexpr int64_t kGrainElements = 1 << 16;

inline float FromBits(uint32_t u) { return __builtin_bit_cast(float, u); }

// 4 / s (0 for s == 0), as optax4bit.quant.normalize.inverse_times_4.
inline float InverseTimes4(float s) {
  float r = 4.0f / (s > 0.0f ? s : 1.0f);
  r = r < FLT_MAX ? r : FLT_MAX;
  return s > 0.0f ? r : 0.0f;
}

// XLA's CPU backend computes with subnormals flushed to zero: on x86 the
// MXCSR's FTZ and DAZ bits, on aarch64 the FPCR's FZ bit (inputs and results).
class FlushDenormals {
 public:
#ifdef OPTAX4BIT_HAS_MXCSR
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  FlushDenormals() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_ | (uint64_t{1} << 24)));
  }
  ~FlushDenormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

// c1, c2, c1_next: the bias corrections 1 - b1^t, 1 - b2^t, 1 - b1^(t + 1).
struct Coefficients {
  float b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, c1, inv_c2, inv_c1, inv_c1_next, c2,
      c1_next;
};

Coefficients ReadCoefficients(const float* c) {
  return Coefficients{c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11]};
}

// tables: the quantizers' tables, kTablesSize floats: the first moment's 16
// entries and 15 midpoint thresholds, then the second moment's.
constexpr int64_t kTablesSize = 4 * kTableSize - 2;

// What the rows of Adam4bitStats read and write; see StatsImpl.
struct StatsRowsArgs {
  int64_t h;  // half the row length
  const float *g, *row_scales, *col_even, *col_odd, *v_table;
  const uint8_t* codes;
  Coefficients c;
  float* new_rows;
};

// What the rows of Adam4bitApply read and write; see ApplyImpl.
struct ApplyRowsArgs {
  int64_t h;
  const float *g, *m_scales, *row_scales, *new_row_scales, *col_even, *col_odd, *inv_col_even,
      *inv_col_odd, *m_table, *v_table, *v_thresholds4;
  const uint8_t *m_codes, *v_codes;
  const uint32_t* row_base;
  uint32_t m_seed, v_seed;
  float inverse_factor;
  Coefficients c;
  bool nesterov, m_stochastic, v_stochastic, v_linear;
  // The stall rule (with m_stochastic, v_stochastic) against the old codes
  // m_codes, v_codes, which m_out, v_out overwrite.
  bool m_stall, v_stall;
  float* out;
  uint8_t *m_out, *v_out;
  float* m_scales_out;
};

// What the rows of the 4-bit codecs (Decode4bit, EncodeBlock4bit,
// EncodeRank14bit) read and write; see those calls. codes: the codes to
// decode, or the stored codes of an encode's stall rule (stall).
struct CodecRowsArgs {
  int64_t h;
  bool rank1, stochastic, linear, stall;
  const uint8_t* codes;
  const float *block_scales, *row_scales, *col_scales, *table, *x, *thresholds4, *inv_col_even,
      *inv_col_odd;
  const uint32_t* row_base;
  uint32_t seed;
  float inverse_factor;
  float *out, *block_scales_out;
  uint8_t* codes_out;
};

// The steps whose only quantized moment is the first (see FirstMomentImpl).
enum class FirstMomentStep { kMomentum, kMomentumNesterov, kFactored };

// What the rows of Optax4bitFirstMomentApply read and write.
struct FirstMomentRowsArgs {
  int64_t h;
  FirstMomentStep step;
  const float *g, *m_scales, *m_table;
  const uint8_t* m_codes;
  const uint32_t* row_base;
  uint32_t m_seed;
  bool m_stochastic;
  bool m_stall;  // the stall rule (with m_stochastic) against m_codes
  float momentum;  // momentum steps
  // Factored: the Adam coefficients, the row factor, the column factor's
  // even and odd elements, whether the mean of the row factor is positive
  // and its reciprocal.
  Coefficients c;
  const float *factor_rows, *col_even, *col_odd;
  bool factor_positive;
  float factor_inverse;
  float* out;
  uint8_t* m_out;
  float* m_scales_out;
};

// 8-bit Adam (Adam8bitApply): blocks of 256 elements of a row, and the
// buckets of NearestCodes256 (adam_8bit_rows.h; optax4bit.cpu.ffi._buckets
// builds their tables with the same constants): |n| clamped to [2**-23, 1],
// 128 buckets per octave, for each sign.
constexpr int64_t kBlock8 = 256;
constexpr int32_t kBucketLowBits = (127 - 23) << 23;
constexpr int32_t kBucketHighBits = 127 << 23;
constexpr int kBucketShift = 23 - 7;
constexpr int32_t kBuckets8 = ((kBucketHighBits - kBucketLowBits) >> kBucketShift) + 1;
constexpr int64_t kBucketTableSize = 2 * kBuckets8;  // per moment
constexpr int64_t kTables8Size = 2 * 256;  // the 256 entries of each moment's map

// What the rows of Adam8bitApply read and write; see Apply8bitImpl.
struct Apply8bitRowsArgs {
  int64_t h;  // half the row length
  const float *g, *m_scales, *v_scales, *m_table, *v_table;
  const uint8_t *m_codes, *v_codes;
  const int32_t *m_buckets, *v_buckets;
  Coefficients c;
  bool nesterov;
  float* out;
  uint8_t *m_out, *v_out;
  float *m_scales_out, *v_scales_out;
};

// The row kernels of each ISA path, in a namespace of its own (their vectors
// as wide as the path's registers).
#ifdef OPTAX4BIT_X86_PATHS
OPTAX4BIT_TARGET_PUSH("arch=x86-64-v4")
namespace avx512 {
#define OPTAX4BIT_ROWS_AVX512 1
#define OPTAX4BIT_ROWS_AVX2 0
#define OPTAX4BIT_ROWS_NEON 0
#include "isa_path_rows.h"
#undef OPTAX4BIT_CPU_ISA_PATH_ROWS_H_
#undef OPTAX4BIT_ROWS_NEON
#undef OPTAX4BIT_ROWS_AVX512
#undef OPTAX4BIT_ROWS_AVX2
}  // namespace avx512
OPTAX4BIT_TARGET_POP
OPTAX4BIT_TARGET_PUSH("arch=x86-64-v3")
namespace avx2 {
#define OPTAX4BIT_ROWS_AVX512 0
#define OPTAX4BIT_ROWS_AVX2 1
#define OPTAX4BIT_ROWS_NEON 0
#include "isa_path_rows.h"
#undef OPTAX4BIT_CPU_ISA_PATH_ROWS_H_
#undef OPTAX4BIT_ROWS_NEON
#undef OPTAX4BIT_ROWS_AVX512
#undef OPTAX4BIT_ROWS_AVX2
}  // namespace avx2
OPTAX4BIT_TARGET_POP
#endif
namespace baseline {
#define OPTAX4BIT_ROWS_AVX512 0
#define OPTAX4BIT_ROWS_AVX2 0
#ifdef OPTAX4BIT_NEON
#define OPTAX4BIT_ROWS_NEON 1
#else
#define OPTAX4BIT_ROWS_NEON 0
#endif
#include "isa_path_rows.h"
#undef OPTAX4BIT_CPU_ISA_PATH_ROWS_H_
#undef OPTAX4BIT_ROWS_NEON
#undef OPTAX4BIT_ROWS_AVX512
#undef OPTAX4BIT_ROWS_AVX2
}  // namespace baseline

// An ISA path: its name, whether this CPU runs it and its row kernels.
struct IsaPath {
  const char* name;
  bool (*runs)();
  void (*stats_rows)(const StatsRowsArgs&, int64_t, int64_t, float*, uint32_t*);
  void (*apply_rows)(const ApplyRowsArgs&, int64_t, int64_t, float*);
  void (*first_moment_rows)(const FirstMomentRowsArgs&, int64_t, int64_t, float*);
  void (*apply_8bit_rows)(const Apply8bitRowsArgs&, int64_t, int64_t, float*);
};

#ifdef OPTAX4BIT_X86_PATHS
// F16C by CPUID (leaf 1, ECX bit 29): Clang 14's __builtin_cpu_supports does
// not know the name.
bool HasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx >> 29 & 1);
}

bool RunsAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && HasF16c();
}

bool RunsAvx512() {
  return RunsAvx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

// Best first.
constexpr IsaPath kIsaPaths[] = {
#ifdef OPTAX4BIT_X86_PATHS
    {"avx512", RunsAvx512, avx512::StatsRows, avx512::ApplyRows, avx512::FirstMomentRows,
     avx512::Apply8bitRows},
    {"avx2", RunsAvx2, avx2::StatsRows, avx2::ApplyRows, avx2::FirstMomentRows,
     avx2::Apply8bitRows},
#endif
    {"baseline", [] { return true; }, baseline::StatsRows, baseline::ApplyRows,
     baseline::FirstMomentRows, baseline::Apply8bitRows},
};

// The path the calls run: the best this CPU runs unless set otherwise.
std::atomic<const IsaPath*>& CurrentIsaPath() {
  static std::atomic<const IsaPath*> path{[] {
    const IsaPath* best = &kIsaPaths[0];
    while (!best->runs()) ++best;  // baseline runs everywhere
    return best;
  }()};
  return path;
}

#include "row_splitter.h"

// The even and odd elements of a row of d = 2h values.
void SplitEvenOdd(int64_t h, const float* x, std::vector<float>& even, std::vector<float>& odd) {
  even.resize(h);
  odd.resize(h);
  for (int64_t j = 0; j < h; ++j) {
    even[j] = x[2 * j];
    odd[j] = x[2 * j + 1];
  }
}

// A leaf of two axes or more runs as its rows: rows is the product of the
// leading axes, d the last axis, a multiple of `multiple`. False otherwise.
template <typename Dims>
bool RowsOf(const Dims& dims, int64_t multiple, int64_t& rows, int64_t& d) {
  if (dims.size() < 2 || dims[dims.size() - 1] % multiple != 0) return false;
  rows = 1;
  for (size_t k = 0; k + 1 < dims.size(); ++k) rows *= dims[k];
  d = dims[dims.size() - 1];
  return true;
}

ffi::Error CheckTables(const ffi::Buffer<ffi::F32>& tables) {
  if ((int64_t)tables.element_count() != kTablesSize) {
    return ffi::Error::InvalidArgument(
        "tables must hold 16 entries and 15 thresholds of each moment's map");
  }
  return ffi::Error::Success();
}

// What a rank-1 encoder (EncodeSecondMoment) takes besides the values: 4 t
// for its 15 thresholds t (normal, in (0, 1]; Linear's are unused) and the
// inverses of the column scales, split even/odd, times 16 for Linear and 4
// otherwise (inverse_factor 4 or 1 times InverseTimes4). Call with
// subnormals flushed, as XLA computes the reciprocals.
struct Rank1Encoder {
  float thresholds4[kTableSize - 1];
  float inverse_factor;
  std::vector<float> inv_col_even, inv_col_odd;
};

ffi::Error MakeRank1Encoder(const float* thresholds, const float* col_scales, int64_t h,
                            bool linear, Rank1Encoder& out) {
  for (int k = 0; k < kTableSize - 1; ++k) {
    if (!linear && !(thresholds[k] >= FLT_MIN && thresholds[k] <= 1.0f)) {
      return ffi::Error::InvalidArgument("second-moment thresholds must be normal, in (0, 1]");
    }
    out.thresholds4[k] = 4.0f * thresholds[k];
  }
  out.inverse_factor = linear ? 4.0f : 1.0f;
  SplitEvenOdd(h, col_scales, out.inv_col_even, out.inv_col_odd);
  for (int64_t j = 0; j < h; ++j) {
    out.inv_col_even[j] = InverseTimes4(out.inv_col_even[j]) * out.inverse_factor;
    out.inv_col_odd[j] = InverseTimes4(out.inv_col_odd[j]) * out.inverse_factor;
  }
  return ffi::Error::Success();
}

// The fused step of 4-bit Adam.
#include "adam_4bit_ffi.h"

#ifndef OPTAX4BIT_JAXLIB_VERSION
#define OPTAX4BIT_JAXLIB_VERSION "unknown"
#endif

// The jaxlib whose FFI headers this library was built against: XLA runs
// handlers built against older headers, not newer ones.
extern "C" const char* Optax4bitBuildJaxlibVersion() { return OPTAX4BIT_JAXLIB_VERSION; }

// The ISA paths this CPU runs, best first, comma-separated
// ("avx512,avx2,baseline" on an AVX-512 x86-64 machine).
extern "C" const char* Optax4bitCpuIsas() {
  static const std::string names = [] {
    std::string r;
    for (const IsaPath& path : kIsaPaths) {
      if (path.runs()) r += (r.empty() ? "" : ",") + std::string(path.name);
    }
    return r;
  }();
  return names.c_str();
}

// The ISA path the calls run.
extern "C" const char* Optax4bitCpuIsa() { return CurrentIsaPath().load()->name; }

// Makes later calls run the ISA path `name` (for tests and benchmarks);
// returns 0 and changes nothing where this CPU does not run it.
extern "C" int Optax4bitUseCpuIsa(const char* name) {
  for (const IsaPath& path : kIsaPaths) {
    if (std::strcmp(path.name, name) == 0 && path.runs()) {
      CurrentIsaPath().store(&path);
      return 1;
    }
  }
  return 0;
}

}  // namespace

// The fused step of 8-bit Adam.
#include "adam_8bit_ffi.h"

// The fused step of momentum and factored Adam.
#include "first_moment_ffi.h"

// The 4-bit codecs.
#include "codec_ffi.h"
