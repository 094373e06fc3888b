// The arguments of the C++ kernel's two Adam row passes (StatsRows,
// ApplyRows) over a leaf of `rows` rows of 2h floats, with fixed tables,
// coefficients and column scales: a signed uniform table for m, squares (as
// SqrtDE-0's) for v, and their midpoints. Shared by the row harness
// (benchmarks/cpu_kernel_rows.cc) and the aarch64 row check of
// tests/test_packaging.py; include after optax4bit/cpu/adam_4bit.cc.

#include <vector>

namespace {  // as the kernel's types

struct RowPassArgs {
  int64_t h;
  bool v_linear;
  float tables[kTablesSize];
  float v_thresholds4[kTableSize - 1];
  float inverse;  // the column inverse: times 4 for Linear (inverse16), else inverse4
  std::vector<float> col, col_inverse;
  std::vector<uint32_t> row_base;  // each row's first flat index
  Coefficients c{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.0f, 0.1f,
                 1000.0f, 10.0f, 5.0f, 0.001f, 0.19f};

  RowPassArgs(int64_t rows, int64_t h_, bool v_linear_)
      : h(h_), v_linear(v_linear_), inverse(v_linear_ ? 16e4f : 4e4f), col(h_, 1e-4f),
        col_inverse(h_, inverse), row_base(rows) {
    for (int k = 0; k < kTableSize; ++k) {
      m_table()[k] = (k - 7.5f) / 8;
      v_table()[k] = (k + 1.0f) * (k + 1.0f) / 256;
    }
    for (int k = 0; k + 1 < kTableSize; ++k) {
      m_table()[kTableSize + k] = (m_table()[k] + m_table()[k + 1]) / 2;
      v_table()[kTableSize + k] = (v_table()[k] + v_table()[k + 1]) / 2;
      v_thresholds4[k] = 4 * v_table()[kTableSize + k];
    }
    for (int64_t i = 0; i < rows; ++i) row_base[i] = (uint32_t)(i * 2 * h);
  }
  RowPassArgs(const RowPassArgs&) = delete;  // the passes' arguments point into it

  float* m_table() { return tables; }
  float* v_table() { return tables + 2 * kTableSize - 1; }

  StatsRowsArgs Stats(const float* g, const float* v_rows, const uint8_t* v_codes,
                      float* new_rows) {
    return StatsRowsArgs{h, g, v_rows, col.data(), col.data(), v_table(), v_codes, c, new_rows};
  }

  // The update over g and the codes over the old ones, as the kernel's
  // aliased buffers; the new row scales are the old ones.
  ApplyRowsArgs Apply(float* g, float* v_rows, uint8_t* m_codes, uint8_t* v_codes,
                      const float* m_scales, float* m_scales_out, bool m_stochastic) {
    ApplyRowsArgs a{};
    a.h = h;
    a.g = a.out = g;
    a.m_scales = m_scales;
    a.m_scales_out = m_scales_out;
    a.row_scales = a.new_row_scales = v_rows;
    a.col_even = a.col_odd = col.data();
    a.inv_col_even = a.inv_col_odd = col_inverse.data();
    a.m_table = m_table();
    a.v_table = v_table();
    a.v_thresholds4 = v_thresholds4;
    a.m_codes = a.m_out = m_codes;
    a.v_codes = a.v_out = v_codes;
    a.row_base = row_base.data();
    a.m_seed = 12345u;
    a.inverse_factor = v_linear ? 4.0f : 1.0f;
    a.c = c;
    a.m_stochastic = m_stochastic;
    a.v_linear = v_linear;
    return a;
  }
};

}  // namespace
