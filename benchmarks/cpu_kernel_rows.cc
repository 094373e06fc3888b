// Single-thread time of the C++ CPU kernel's row functions on one 2048x2048
// float32 leaf (optax4bit/cpu/adam_4bit_rows.h), in the order the kernel runs
// them: the stats pass (new v and its maxima for every row), then the apply
// pass (new m, new v, update written over the gradient row, m and v encodes),
// for the paper's recipe and the default one, on each ISA path this CPU runs
// (or those named as arguments: avx512, avx2, baseline).
// Prints the minimum over 14 passes of each (the machine is shared and noisy).
//
// Build and run from the repository root (jaxlib's FFI headers are needed
// only because the kernel source includes them):
//   g++ -O3 -ffp-contract=off -fno-math-errno -fno-trapping-math -std=c++17 \
//     -I"$(python -c 'import jaxlib, os; print(os.path.dirname(jaxlib.__file__))')/include" \
//     benchmarks/cpu_kernel_rows.cc -o /tmp/cpu_kernel_rows -lpthread && /tmp/cpu_kernel_rows [isa...]

#include "../optax4bit/cpu/adam_4bit.cc"

#include <chrono>
#include <cstdio>
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
    using FirstMomentRounding = ns::FirstMomentRounding;                \
    using Bounds = ns::Bounds;                                          \
    static constexpr auto MakeBounds = ns::MakeBounds;                  \
    static constexpr auto NewFirstMoment = ns::NewFirstMoment;          \
    static constexpr auto NewSecondMoment = ns::NewSecondMoment;        \
    static constexpr auto SecondMomentMaxima = ns::SecondMomentMaxima;  \
    static constexpr auto Update = ns::Update;                          \
    static constexpr auto EncodeFirstMoment = ns::EncodeFirstMoment;    \
    static constexpr auto EncodeSecondMoment = ns::EncodeSecondMoment;  \
  };
#ifdef OPTAX4BIT_X86_PATHS
OPTAX4BIT_ISA_ROWS(avx512)
OPTAX4BIT_ISA_ROWS(avx2)
#endif
OPTAX4BIT_ISA_ROWS(baseline)

}  // namespace

// One recipe's row functions over the leaf: the minimum over 14 passes.
template <typename R>
void Run(const char* isa, const char* recipe, bool m_stochastic, bool v_linear) {
  const int64_t rows = 2048, d = 2048, h = d / 2, blocks = h / kBlockBytes;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> g(rows * d), m_scales(rows * blocks, 0.01f), v_rows(rows, 1e-4f);
  for (float& x : g) x = normal(rng);
  std::vector<uint8_t> m_codes(rows * h), v_codes(rows * h);
  for (uint8_t& x : m_codes) x = rng() & 255;
  for (uint8_t& x : v_codes) x = rng() & 255;
  // Sorted tables and their midpoints: a signed one for m, an unsigned one
  // (squares, as SqrtDE-0's) for v.
  float tables[kTablesSize];
  float* m_table = tables;
  float* v_table = tables + 2 * kTableSize - 1;
  for (int k = 0; k < kTableSize; ++k) {
    m_table[k] = (k - 7.5f) / 8;
    v_table[k] = (k + 1.0f) * (k + 1.0f) / 256;
  }
  for (int k = 0; k + 1 < kTableSize; ++k) {
    m_table[kTableSize + k] = (m_table[k] + m_table[k + 1]) / 2;
    v_table[kTableSize + k] = (v_table[k] + v_table[k + 1]) / 2;
  }
  const typename R::FirstMomentRounding m_rounding(m_table, m_table + kTableSize, 12345u);
  float v_thresholds4[kTableSize - 1];
  for (int k = 0; k + 1 < kTableSize; ++k) v_thresholds4[k] = 4 * v_table[kTableSize + k];
  const typename R::Bounds v_thresholds = R::MakeBounds(v_thresholds4);
  const float inverse = v_linear ? 16e4f : 4e4f;
  const std::vector<float> col(h, 1e-4f), col_inverse(h, inverse);
  std::vector<float> m(d), v(d), new_m_scales(rows * blocks);
  std::vector<uint32_t> col_max(d);
  float row_max;
  const Coefficients c{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.0f, 0.1f,
                       1000.0f, 10.0f, 5.0f, 0.001f, 0.19f};
  FlushDenormals flush;
  const char* names[] = {"stats pass", "apply pass", "  new m", "  new v", "  update",
                         "  m encode", "  v encode"};
  double best[7];
  for (double& b : best) b = 1e9;
  for (int pass = 0; pass < 15; ++pass) {
    double t[7] = {0};
    const auto stats_start = Clock::now();
    for (int64_t i = 0; i < rows; ++i) {
      R::NewSecondMoment(h, g.data() + i * d, v_codes.data() + i * h, v_rows[i],
                      col.data(), col.data(), v_table, c.b2, c.one_minus_b2, v.data());
      R::SecondMomentMaxima(h, v.data(), &row_max, col_max.data(), col_max.data() + h);
    }
    const auto apply_start = Clock::now();
    t[0] = Seconds(stats_start, apply_start);
    for (int64_t i = 0; i < rows; ++i) {
      float* g_row = g.data() + i * d;  // the update overwrites it, as in the kernel
      const auto t0 = Clock::now();
      R::NewFirstMoment(h, g_row, m_codes.data() + i * h, m_scales.data() + i * blocks, m_table,
                     c.b1, c.one_minus_b1, m.data());
      const auto t1 = Clock::now();
      R::NewSecondMoment(h, g_row, v_codes.data() + i * h, v_rows[i], col.data(),
                      col.data(), v_table, c.b2, c.one_minus_b2, v.data());
      const auto t2 = Clock::now();
      R::Update(h, m.data(), v.data(), c, g_row);
      const auto t3 = Clock::now();
      R::EncodeFirstMoment(m_stochastic, h, m.data(), m_rounding, (uint32_t)(i * d),
                        new_m_scales.data() + i * blocks, m_codes.data() + i * h);
      const auto t4 = Clock::now();
      R::EncodeSecondMoment(v_linear, h, v.data(), inverse, col_inverse.data(), col_inverse.data(),
                         v_thresholds, v_codes.data() + i * h);
      const auto t5 = Clock::now();
      t[2] += Seconds(t0, t1);
      t[3] += Seconds(t1, t2);
      t[4] += Seconds(t2, t3);
      t[5] += Seconds(t3, t4);
      t[6] += Seconds(t4, t5);
    }
    t[1] = Seconds(apply_start, Clock::now());
    if (pass > 0) {  // the first pass faults pages in
      for (int k = 0; k < 7; ++k) best[k] = std::min(best[k], t[k]);
    }
  }
  std::printf("%s, %s: ms per 2048x2048 leaf, one thread (min of 14 passes)\n", isa, recipe);
  for (int k = 0; k < 7; ++k) std::printf("%-12s %6.3f\n", names[k], best[k] * 1e3);
}

template <typename R>
void RunRecipes(const char* isa) {
  Run<R>(isa, "paper (B128/DE nearest, Rank-1/Linear)", false, true);
  Run<R>(isa, "default (B128/NF stochastic, Rank-1/SqrtDE-0)", true, false);
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
