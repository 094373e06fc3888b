// Fused XLA CPU step of 4-bit Adam for one 2-D leaf whose last axis is a
// multiple of 128, for both of optax4bit's recipes (optax4bit/recipes.py) and
// any pairing of their quantizers:
//   first moment  B128/DE or B128/NF (signed, 128-element blocks of the last
//                 axis), rounded to the nearest entry or stochastically;
//   second moment Rank-1/Linear or Rank-1/SqrtDE-0 (unsigned, scales
//                 min(row max, column max)), rounded to the nearest entry.
// The default recipe is B128/NF stochastic + Rank-1/SqrtDE-0, the paper's
// B128/DE + Rank-1/Linear, both nearest. One set of row kernels serves all:
// the maps' entries and thresholds come in as the `tables` input, the
// rounding as attributes, stochastic rounding's per-leaf seeds as `seeds`.
// Two FFI calls per leaf:
//   1. Adam4bitStats: the row and column maxima of the new second moment
//      (it needs the whole leaf before any element can be encoded);
//   2. Adam4bitApply: per row, decode both moments, run the float32 Adam step,
//      write the update over the gradient and re-encode both moments in place.
// No float32 moment is stored: a row's moments live in per-thread scratch.
//
// The arithmetic is that of the jnp reference as XLA (jaxlib 0.10) compiles
// it for a leaf the jnp path splits into chunks (every leaf of two rows or
// more): the same operation order; the multiply-adds XLA's CPU backend fuses
// into FMAs fused here too (explicitly: the library is built with
// -ffp-contract=off), all others not; divisions by the bias corrections
// where XLA keeps them; subnormals flushed to zero as XLA's CPU backend does;
// non-finite values excluded from maxima and NaN normalized to 0. Stochastic
// rounding draws optax4bit.quant.maps.hashed_uniform's numbers: a hash of the
// seed and of the element's flat index in the whole leaf, so the codes do
// not depend on chunking. tests/test_cpu_kernel.py checks codes, scales and
// updates bit for bit against the jnp path. Python side: optax4bit/cpu/ffi.py.

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
#include <vector>

#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#define OPTAX4BIT_HAS_MXCSR 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// x86-64: clones for AVX-512 and AVX2 picked at load time (one binary for
// any x86-64 machine); elsewhere the compiler's baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OPTAX4BIT_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OPTAX4BIT_HOT
#endif

constexpr int64_t kBlockBytes = 64;     // B128: 128 codes, two per byte
constexpr int64_t kTableSize = 16;      // entries of a 4-bit map
constexpr int64_t kCoefSize = 12;       // see optax4bit.cpu.ffi._coefficients
constexpr int64_t kGrainElements = 1 << 16;

inline float FromBits(uint32_t u) { return __builtin_bit_cast(float, u); }

// 4 / s (0 for s == 0), as optax4bit.quant.normalize._inverse_times_4.
inline float InverseTimes4(float s) {
  float r = 4.0f / (s > 0.0f ? s : 1.0f);
  r = r < FLT_MAX ? r : FLT_MAX;
  return s > 0.0f ? r : 0.0f;
}

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

// XLA's CPU backend computes with subnormals flushed to zero.
class FlushDenormals {
 public:
#ifdef OPTAX4BIT_HAS_MXCSR
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
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

// a * b + c rounded once, as XLA's CPU backend contracts a multiply feeding an
// add (LLVM fuses the add's first operand when both are products). GCC
// vectorizes these into FMA instructions in the clones that have them.
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

// Process-wide worker threads, started on first use. XLA's intra-op pool
// (ffi::ThreadPool) is busy while a custom call runs on it: tasks scheduled
// there mostly start after the call has finished its rows alone.
class Workers {
 public:
  static Workers& Get() {
    static Workers* workers = new Workers();  // never destroyed: threads outlive main
    return *workers;
  }

  // Runs task(w) for w in [1, n) on worker threads; returns at once.
  void Launch(int64_t n, const std::function<void(int64_t)>& task) {
    std::lock_guard<std::mutex> lock(mu_);
    while ((int64_t)threads_ < n - 1) {
      std::thread([this] { Loop(); }).detach();
      ++threads_;
    }
    for (int64_t w = 1; w < n; ++w) queue_.push_back([task, w] { task(w); });
    cv_.notify_all();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  size_t threads_ = 0;
};

// Splits rows into chunks run by the caller and up to n - 1 worker threads,
// n = the size of XLA's intra-op pool; body(lo, hi, worker) with worker <
// NumWorkers(). The caller waits only for chunks some thread has claimed, so
// a worker that starts late (or never) cannot block it.
class RowSplitter {
 public:
  RowSplitter(ffi::ThreadPool& pool, int64_t rows, int64_t row_size) : rows_(rows) {
    grain_ = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_size, 1));
    chunks_ = (rows + grain_ - 1) / grain_;
    workers_ = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), chunks_));
  }

  int64_t NumWorkers() const { return workers_; }

  template <typename Body>
  void Run(const Body& body) {
    auto shared = std::make_shared<Shared>();
    const int64_t rows = rows_, grain = grain_, chunks = chunks_;
    const Body* body_ptr = &body;
    auto work = [shared, body_ptr, rows, grain, chunks](int64_t worker) {
      FlushDenormals flush;
      for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
        (*body_ptr)(c * grain, std::min(rows, (c + 1) * grain), worker);
        if (shared->done.fetch_add(1) + 1 == chunks) {
          std::lock_guard<std::mutex> lock(shared->mu);
          shared->cv.notify_all();
        }
      }
    };
    if (workers_ > 1) Workers::Get().Launch(workers_, work);
    work(0);
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load() == chunks; });
  }

 private:
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  int64_t rows_, grain_, chunks_, workers_;
};

// Row kernels. A row of d = 2h elements is split into its even and odd
// elements (the low and high nibbles of the packed code bytes): x[0, h) holds
// the even elements, x[h, 2h) the odd ones.

// New first moment (1 - b1) g + b1 m of one row; entries by table permutes.
OPTAX4BIT_HOT void NewFirstMoment(int64_t h, const float* __restrict g,
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

OPTAX4BIT_HOT void NewSecondMoment(bool linear, int64_t h, const float* __restrict g,
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
OPTAX4BIT_HOT void SecondMomentMaxima(int64_t h, const float* __restrict v, float* __restrict row,
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

OPTAX4BIT_HOT void Update(int64_t h, const float* __restrict m, const float* __restrict v,
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

OPTAX4BIT_HOT void NesterovUpdate(int64_t h, const float* __restrict g, const float* __restrict m,
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

OPTAX4BIT_HOT void EncodeFirstMoment(bool stochastic, int64_t h, const float* __restrict m,
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
OPTAX4BIT_HOT void EncodeSecondMoment(bool linear, int64_t h, const float* __restrict v,
                                      float row_inverse, const float* __restrict col_even,
                                      const float* __restrict col_odd, const Bounds& thresholds4,
                                      uint8_t* __restrict codes) {
  if (linear) {
    EncodeSecondMomentT<true>(h, v, row_inverse, col_even, col_odd, thresholds4, codes);
  } else {
    EncodeSecondMomentT<false>(h, v, row_inverse, col_even, col_odd, thresholds4, codes);
  }
}

// The even and odd elements of a row of d = 2h values.
void SplitEvenOdd(int64_t h, const float* x, std::vector<float>& even, std::vector<float>& odd) {
  even.resize(h);
  odd.resize(h);
  for (int64_t j = 0; j < h; ++j) {
    even[j] = x[2 * j];
    odd[j] = x[2 * j + 1];
  }
}

// Checks shared by both calls; sets the rows and the row length d.
ffi::Error LeafGeometry(const ffi::Buffer<ffi::F32>& grad, const ffi::Buffer<ffi::U8>& v_codes,
                        const ffi::Buffer<ffi::F32>& v_rows, const ffi::Buffer<ffi::F32>& v_cols,
                        const ffi::Buffer<ffi::F32>& coef, int64_t& rows, int64_t& d) {
  const auto dims = grad.dimensions();
  if (dims.size() != 2 || dims[1] % (2 * kBlockBytes) != 0) {
    return ffi::Error::InvalidArgument("grad must be 2-D with a multiple of 128 columns");
  }
  rows = dims[0];
  d = dims[1];
  if ((int64_t)v_codes.element_count() != rows * d / 2 ||
      (int64_t)v_rows.element_count() != rows || (int64_t)v_cols.element_count() != d) {
    return ffi::Error::InvalidArgument("second-moment codes or scales do not match grad");
  }
  if ((int64_t)coef.element_count() != kCoefSize) {
    return ffi::Error::InvalidArgument("coef must hold 12 Adam coefficients");
  }
  return ffi::Error::Success();
}

// tables: the quantizers' tables, kTablesSize floats: the first moment's 16
// entries and 15 midpoint thresholds, then the second moment's.
constexpr int64_t kTablesSize = 4 * kTableSize - 2;

ffi::Error CheckTables(const ffi::Buffer<ffi::F32>& tables) {
  if ((int64_t)tables.element_count() != kTablesSize) {
    return ffi::Error::InvalidArgument(
        "tables must hold 16 entries and 15 thresholds of each moment's map");
  }
  return ffi::Error::Success();
}

// v_linear: the second moment's map is Linear (else decoded by its table).
ffi::Error StatsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad,
                     ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_rows,
                     ffi::Buffer<ffi::F32> v_cols, ffi::Buffer<ffi::F32> coef,
                     ffi::Buffer<ffi::F32> tables, bool v_linear,
                     ffi::ResultBuffer<ffi::F32> new_rows, ffi::ResultBuffer<ffi::F32> new_cols) {
  int64_t rows, d;
  if (ffi::Error error = LeafGeometry(grad, v_codes, v_rows, v_cols, coef, rows, d);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = CheckTables(tables); error.failure()) return error;
  const int64_t h = d / 2;
  const Coefficients c = ReadCoefficients(coef.typed_data());
  const float* v_table = tables.typed_data() + 2 * kTableSize - 1;
  const float* g = grad.typed_data();
  const uint8_t* codes = v_codes.typed_data();
  const float* row_scales = v_rows.typed_data();
  const float* col_scales = v_cols.typed_data();
  std::vector<float> col_even, col_odd;
  SplitEvenOdd(h, col_scales, col_even, col_odd);
  float* out_rows = new_rows->typed_data();
  RowSplitter splitter(pool, rows, d);
  std::vector<std::vector<uint32_t>> col_max(splitter.NumWorkers(), std::vector<uint32_t>(d, 0));
  std::vector<std::vector<float>> scratch(splitter.NumWorkers());
  splitter.Run([&](int64_t lo, int64_t hi, int64_t worker) {
    std::vector<float>& v = scratch[worker];
    v.resize(d);
    uint32_t* cm = col_max[worker].data();
    for (int64_t i = lo; i < hi; ++i) {
      NewSecondMoment(v_linear, h, g + i * d, codes + i * h, row_scales[i], col_even.data(),
                      col_odd.data(), v_table, c.b2, c.one_minus_b2, v.data());
      SecondMomentMaxima(h, v.data(), out_rows + i, cm, cm + h);
    }
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
// stochastically (else to the nearest entry); v_linear: see StatsImpl.
ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad,
                     ffi::Buffer<ffi::U8> m_codes, ffi::Buffer<ffi::F32> m_scales,
                     ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_rows,
                     ffi::Buffer<ffi::F32> v_cols, ffi::Buffer<ffi::F32> new_v_rows,
                     ffi::Buffer<ffi::F32> new_v_cols, ffi::Buffer<ffi::F32> coef,
                     ffi::Buffer<ffi::F32> tables, ffi::Buffer<ffi::U32> seeds,
                     ffi::Buffer<ffi::U32> row_bases, bool nesterov,
                     bool m_stochastic, bool v_linear,
                     ffi::ResultBuffer<ffi::F32> update, ffi::ResultBuffer<ffi::U8> m_codes_out,
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
  if (seeds.element_count() != 2) {
    return ffi::Error::InvalidArgument("seeds must hold one uint32 per moment");
  }
  if ((int64_t)row_bases.element_count() != rows) {
    return ffi::Error::InvalidArgument("row_bases must hold one uint32 per row");
  }
  FlushDenormals flush;  // also for the scale reciprocals below
  const Coefficients c = ReadCoefficients(coef.typed_data());
  const float* m_table = tables.typed_data();
  const float* v_table = m_table + 2 * kTableSize - 1;
  const FirstMomentRounding m_rounding(m_table, m_table + kTableSize, seeds.typed_data()[0]);
  const uint32_t* row_base = row_bases.typed_data();
  float v_thresholds4[kTableSize - 1];
  for (int k = 0; k < kTableSize - 1; ++k) {
    const float t = v_table[kTableSize + k];
    if (!v_linear && !(t >= FLT_MIN && t <= 1.0f)) {
      return ffi::Error::InvalidArgument("second-moment thresholds must be normal, in (0, 1]");
    }
    v_thresholds4[k] = 4.0f * t;
  }
  const Bounds v_thresholds4_bounds = MakeBounds(v_thresholds4);
  const float* g = grad.typed_data();
  const uint8_t* old_m_codes = m_codes.typed_data();
  const float* old_m_scales = m_scales.typed_data();
  const uint8_t* old_v_codes = v_codes.typed_data();
  const float* row_scales = v_rows.typed_data();
  const float* new_row_scales = new_v_rows.typed_data();
  // Inverses of the new scales: times 16 for Linear, times 4 otherwise (see
  // EncodeSecondMoment).
  const float inverse_factor = v_linear ? 4.0f : 1.0f;
  std::vector<float> col_even, col_odd, inv_col_even, inv_col_odd;
  SplitEvenOdd(h, v_cols.typed_data(), col_even, col_odd);
  SplitEvenOdd(h, new_v_cols.typed_data(), inv_col_even, inv_col_odd);
  for (int64_t j = 0; j < h; ++j) {
    inv_col_even[j] = InverseTimes4(inv_col_even[j]) * inverse_factor;
    inv_col_odd[j] = InverseTimes4(inv_col_odd[j]) * inverse_factor;
  }
  float* out = update->typed_data();
  uint8_t* m_out = m_codes_out->typed_data();
  float* m_scales_new = m_scales_out->typed_data();
  uint8_t* v_out = v_codes_out->typed_data();
  RowSplitter splitter(pool, rows, d);
  std::vector<std::vector<float>> scratch(splitter.NumWorkers());
  splitter.Run([&](int64_t lo, int64_t hi, int64_t worker) {
    std::vector<float>& buffer = scratch[worker];
    buffer.resize(3 * d);
    float* m = buffer.data();
    float* v = m + d;
    float* work = v + d;
    for (int64_t i = lo; i < hi; ++i) {
      // The update overwrites the gradient row (aliased): read it first.
      const float* g_row = g + i * d;
      NewFirstMoment(h, g_row, old_m_codes + i * h, old_m_scales + i * blocks, m_table, c.b1,
                     c.one_minus_b1, m);
      NewSecondMoment(v_linear, h, g_row, old_v_codes + i * h, row_scales[i], col_even.data(),
                      col_odd.data(), v_table, c.b2, c.one_minus_b2, v);
      if (nesterov) {
        std::memcpy(work, g_row, d * sizeof(float));
        NesterovUpdate(h, work, m, v, c, out + i * d);
      } else {
        Update(h, m, v, c, out + i * d);
      }
      // Flat element indices wrap modulo 2**32, as maps.hashed_uniform's.
      EncodeFirstMoment(m_stochastic, h, m, m_rounding, row_base[i],
                        m_scales_new + i * blocks, m_out + i * h);
      EncodeSecondMoment(v_linear, h, v, InverseTimes4(new_row_scales[i]) * inverse_factor,
                         inv_col_even.data(), inv_col_odd.data(), v_thresholds4_bounds,
                         v_out + i * h);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#ifndef OPTAX4BIT_JAXLIB_VERSION
#define OPTAX4BIT_JAXLIB_VERSION "unknown"
#endif

// The jaxlib whose FFI headers this library was built against: XLA runs
// handlers built against older headers, not newer ones.
extern "C" const char* Optax4bitBuildJaxlibVersion() { return OPTAX4BIT_JAXLIB_VERSION; }

// Whether this CPU runs the x86-64-v4 (AVX-512) clone of the row kernels. The
// other clones lower the 16-lane table permutes element by element and are
// slower than XLA's code for the jnp path (issue 15), so "auto" skips them.
extern "C" int Optax4bitRunsAvx512Clone() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return 0;
#endif
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
                                  .Attr<bool>("v_linear")
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
                                  .Attr<bool>("v_linear")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update (aliases grad)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // m codes (in place)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m block scales (in place)
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v codes (in place)
);
