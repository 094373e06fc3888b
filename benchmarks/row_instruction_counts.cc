// Runs `passes` passes of one step's row kernels of one ISA path over a
// leaf of 16 rows of 2048 float32 values, for benchmarks/
// row_instruction_counts.py, which counts the instructions they execute
// under qemu-user. ROWS_PATH names the path's namespace (avx2, baseline).
// Arguments: the step (0: 4-bit Adam, paper recipe; 1: 4-bit Adam, default
// recipe: both moments rounded stochastically; 2: 4-bit momentum, stochastic rounding; 3: 8-bit Adam, which reads
// its tables from the file named by the fourth argument; 4: step 1 with m
// rounded by the stall rule (QuantSpec stall_only); 5: step 1 with both
// moments by the stall rule) and the passes. Steps 4 and 5 exit with 4 for a
// kernel without the stall rule (--source of an older checkout).
#include "optax4bit/cpu/kernels.cc"  // -I the repository root
#include "benchmarks/row_pass_args.h"

#include <cstdlib>

// The stall rule of the Adam rows' moments, where the kernel has it.
template <typename Args>
auto SetStall(Args& a, bool m, bool v, int) -> decltype(a.m_stall = m, void()) {
  a.m_stall = m;
  a.v_stall = v;
}
template <typename Args>
void SetStall(Args&, bool, bool, long) {
  std::exit(4);
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const int step = std::atoi(argv[1]), passes = std::atoi(argv[2]);
  const int64_t rows = 16, d = 2048, h = d / 2, blocks = h / kBlockBytes;
  std::vector<float> g(rows * d), m_scales(rows * blocks, 0.01f), new_m_scales(rows * blocks),
      v_rows(rows, 1e-4f), row_max(rows), v(d), scratch(3 * d);
  for (int64_t i = 0; i < rows * d; ++i) g[i] = (float)((i * 2654435761u) % 1000) * 1e-5f - 5e-3f;
  std::vector<uint8_t> m_codes(rows * d), v_codes(rows * d);
  for (int64_t i = 0; i < rows * d; ++i) {
    m_codes[i] = (uint8_t)(i * 37);
    v_codes[i] = (uint8_t)(i * 91);
  }
  std::vector<uint32_t> col_max(d);
  RowPassArgs args(rows, h, step == 0);
  std::vector<float> tables8, m_scales8(rows * (d / kBlock8), 0.01f),
      v_scales8(rows * (d / kBlock8), 1e-4f);
  std::vector<int32_t> buckets;
  if (step == 3 && (argc < 4 || !ReadTables8(argv[3], tables8, buckets))) return 1;
  FlushDenormals flush;
  for (int pass = 0; pass < passes; ++pass) {
    if (step <= 1 || step >= 4) {
      ROWS_PATH::StatsRows(args.Stats(g.data(), v_rows.data(), v_codes.data(), row_max.data()),
                           0, rows, v.data(), col_max.data());
      ApplyRowsArgs apply = args.Apply(g.data(), v_rows.data(), m_codes.data(), v_codes.data(),
                                       m_scales.data(), new_m_scales.data(), step != 0,
                                       step != 0);
      if (step >= 4) SetStall(apply, true, step == 5, 0);
      ROWS_PATH::ApplyRows(apply, 0, rows, scratch.data());
    } else if (step == 2) {
      ROWS_PATH::FirstMomentRows(args.FirstMoment(FirstMomentStep::kMomentum, g.data(),
                                                  m_scales.data(), new_m_scales.data(),
                                                  m_codes.data(), true),
                                 0, rows, scratch.data());
    } else {
      ROWS_PATH::Apply8bitRows(args.Apply8bit(g.data(), m_scales8.data(), v_scales8.data(),
                                              m_codes.data(), v_codes.data(), tables8.data(),
                                              buckets.data()),
                               0, rows, scratch.data());
    }
  }
  std::printf("%.9g\n", g[5]);  // keeps the passes
  return 0;
}
