// Single-thread time of the C++ CPU kernel's row passes over the SPEC tree's
// four 2048x2048 float32 leaves, run as one (4, 2048, 2048) leaf of 8192 rows
// (64 MiB of gradient, more than this machine's 32 MiB L3, as in a real step):
// the stats pass (StatsRows: new v and its maxima) and the apply pass
// (ApplyRows: new moments, update written over the gradient, both encodes)
// of optax4bit/cpu/adam_4bit_rows.h, for the paper's recipe, the default
// one, each of the default's two changes alone and the default with m, v or
// both rounded by the stall rule (QuantSpec stall_only), on each ISA path this CPU
// runs (or those named as arguments: avx512, avx2, baseline). Then three row
// functions, each timed alone: new v (the stats pass's), m encode (the
// momentum step's and the codecs') and v encode (the codecs').
// Prints ms per 2048x2048 leaf, the minimum over 9 passes (the machine is
// shared and noisy).
//
// Build and run from the repository root (jaxlib's FFI headers are needed
// only because the kernel source includes them):
//   g++ -O3 -ffp-contract=off -fno-math-errno -fno-trapping-math -std=c++17 \
//     -I"$(python -c 'import jaxlib, os; print(os.path.dirname(jaxlib.__file__))')/include" \
//     benchmarks/cpu_kernel_rows.cc -o /tmp/cpu_kernel_rows -lpthread && /tmp/cpu_kernel_rows [isa...]

#include "../optax4bit/cpu/kernels.cc"
#include "row_pass_args.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// One ISA path's row functions.
#define OPTAX4BIT_ISA_ROWS(ns)                                          \
  struct ns##_rows {                                                    \
    using TableRounding = ns::TableRounding;                \
    using Bounds = ns::Bounds;                                          \
    static constexpr auto MakeBounds = ns::MakeBounds;                  \
    static constexpr auto NewSecondMoment = ns::NewSecondMoment;        \
    static constexpr auto SecondMomentMaxima = ns::SecondMomentMaxima;  \
    static constexpr auto EncodeFirstMoment = ns::EncodeFirstMoment;    \
    static constexpr auto EncodeSecondMoment = ns::EncodeSecondMoment;  \
    static constexpr auto StatsRows = ns::StatsRows;                    \
    static constexpr auto ApplyRows = ns::ApplyRows;                    \
  };
#ifdef OPTAX4BIT_X86_PATHS
OPTAX4BIT_ISA_ROWS(avx512)
OPTAX4BIT_ISA_ROWS(avx2)
#endif
OPTAX4BIT_ISA_ROWS(baseline)

}  // namespace

// One recipe's row passes and row functions over the leaf.
template <typename R>
void Run(const char* isa, const char* recipe, bool m_stochastic, bool v_linear,
         bool v_stochastic = false, bool m_stall = false, bool v_stall = false) {
  constexpr int kLeaves = 4, kPasses = 10;
  const int64_t rows = kLeaves * 2048, d = 2048, h = d / 2, blocks = h / kBlockBytes;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> g(rows * d), m_scales(rows * blocks, 0.01f), v_rows(rows, 1e-4f);
  for (float& x : g) x = normal(rng);
  std::vector<uint8_t> m_codes(rows * h), v_codes(rows * h);
  for (uint8_t& x : m_codes) x = rng() & 255;
  for (uint8_t& x : v_codes) x = rng() & 255;
  RowPassArgs args(rows, h, v_linear);
  const float* m_table = args.m_table();
  const float* v_table = args.v_table();
  const Coefficients& c = args.c;
  const typename R::TableRounding m_rounding(m_table, m_table + kTableSize, 12345u);
  const typename R::Bounds v_thresholds = R::MakeBounds(args.v_thresholds4);
  std::vector<float> m(d), v(d), scratch(3 * d), new_rows(rows);
  std::vector<uint8_t> stored(h);
  std::vector<uint32_t> col_max(d);
  const StatsRowsArgs stats = args.Stats(g.data(), v_rows.data(), v_codes.data(), new_rows.data());
  // The block scales too are written in place.
  ApplyRowsArgs apply = args.Apply(g.data(), v_rows.data(), m_codes.data(), v_codes.data(),
                                   m_scales.data(), m_scales.data(), m_stochastic, v_stochastic);
  apply.m_stall = m_stall;
  apply.v_stall = v_stall;
  FlushDenormals flush;
  const char* names[] = {"stats pass", "apply pass", "  new v", "  m encode", "  v encode"};
  constexpr int kTimes = 5;
  double best[kTimes];
  for (double& b : best) b = 1e9;
  for (int pass = 0; pass < kPasses; ++pass) {
    double t[kTimes] = {0};
    const auto stats_start = Clock::now();
    R::StatsRows(stats, 0, rows, v.data(), col_max.data());
    const auto apply_start = Clock::now();
    R::ApplyRows(apply, 0, rows, scratch.data());
    const auto rows_start = Clock::now();
    t[0] = Seconds(stats_start, apply_start);
    t[1] = Seconds(apply_start, rows_start);
    for (int64_t i = 0; i < rows; ++i) {
      float* g_row = g.data() + i * d;
      // The gradient row (the apply pass's updates) stands in for m.
      std::memcpy(m.data(), g_row, d * sizeof(float));
      std::memcpy(stored.data(), m_codes.data() + i * h, h);  // the stall rule's old codes
      const auto t0 = Clock::now();
      R::NewSecondMoment(h, g_row, v_codes.data() + i * h, v_rows[i], args.col.data(),
                         args.col.data(), v_table, c.b2, c.one_minus_b2, v.data());
      const auto t1 = Clock::now();
      R::EncodeFirstMoment(m_stochastic, h, m.data(), m_rounding, args.row_base[i],
                           m_scales.data() + i * blocks, m_codes.data() + i * h,
                           m_stall ? stored.data() : nullptr);
      const auto t2 = Clock::now();
      R::EncodeSecondMoment(v_linear, h, v.data(), args.inverse, args.col_inverse.data(),
                            args.col_inverse.data(), v_thresholds, v_codes.data() + i * h);
      const auto t3 = Clock::now();
      t[2] += Seconds(t0, t1);
      t[3] += Seconds(t1, t2);
      t[4] += Seconds(t2, t3);
    }
    if (pass > 0) {  // the first pass faults pages in
      for (int k = 0; k < kTimes; ++k) best[k] = std::min(best[k], t[k] / kLeaves);
    }
  }
  std::printf("%s, %s: ms per 2048x2048 leaf, one thread (min of %d passes)\n", isa, recipe,
              kPasses - 1);
  for (int k = 0; k < kTimes; ++k) {
    if (k == 2) std::printf("row functions alone:\n");
    std::printf("%-12s %6.3f\n", names[k], best[k] * 1e3);
  }
}

template <typename R>
void RunRecipes(const char* isa) {
  Run<R>(isa, "paper (B128/DE nearest, Rank-1/Linear)", false, true);
  Run<R>(isa, "default (B128 stochastic, Rank-1 table stochastic)", true, false, true);
  // The default's changes one at a time, to split its extra time.
  Run<R>(isa, "m stochastic, v table nearest (B128 stochastic, Rank-1/SqrtDE-0)", true, false);
  Run<R>(isa, "m stochastic only (B128 stochastic, Rank-1/Linear)", true, true);
  Run<R>(isa, "v table only (B128 nearest, Rank-1/SqrtDE-0)", false, false);
  // Issue 50's stall rule on the default's moments.
  Run<R>(isa, "default, m stall", true, false, true, true, false);
  Run<R>(isa, "default, v stall", true, false, true, false, true);
  Run<R>(isa, "default, m+v stall", true, false, true, true, true);
}

int main(int argc, char** argv) {
  std::vector<std::string> isas(argv + 1, argv + argc);
  if (isas.empty()) {
    std::stringstream runs(Optax4bitCpuIsas());
    for (std::string name; std::getline(runs, name, ',');) isas.push_back(name);
  }
  for (const std::string& isa : isas) {
#ifdef OPTAX4BIT_X86_PATHS
    if (isa == "avx512") RunRecipes<avx512_rows>("avx512");
    if (isa == "avx2") RunRecipes<avx2_rows>("avx2");
#endif
    if (isa == "baseline") RunRecipes<baseline_rows>("baseline");
  }
  return 0;
}
