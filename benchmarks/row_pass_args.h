// The arguments of the C++ kernel's row passes over a leaf of `rows` rows of
// 2h floats, with fixed tables, coefficients and column scales: Adam's two
// (StatsRows, ApplyRows) with a signed uniform table for m, squares
// (SqrtLinear's entries) for v, and their midpoints; the first-moment steps'
// (FirstMomentRows) and 8-bit Adam's (Apply8bitRows). Shared by the row
// harness (benchmarks/cpu_kernel_rows.cc), the instruction counts
// (benchmarks/row_instruction_counts.cc) and the aarch64 row check of
// tests/test_packaging.py; include after optax4bit/cpu/kernels.cc.

#include <cstdio>
#include <vector>

namespace {  // as the kernel's types

// 8-bit Adam's tables and buckets from a file that holds them as the
// kernel's inputs (float32 tables, then int32 buckets); false if it cannot.
bool ReadTables8(const char* path, std::vector<float>& tables8, std::vector<int32_t>& buckets) {
  tables8.resize(kTables8Size);
  buckets.resize(2 * kBucketTableSize);
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) return false;
  const bool read = std::fread(tables8.data(), 4, tables8.size(), f) == tables8.size() &&
                    std::fread(buckets.data(), 4, buckets.size(), f) == buckets.size();
  std::fclose(f);
  return read;
}

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
                      const float* m_scales, float* m_scales_out, bool m_stochastic,
                      bool v_stochastic = false) {
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
    a.v_seed = 54321u;
    a.inverse_factor = v_linear ? 4.0f : 1.0f;
    a.c = c;
    a.m_stochastic = m_stochastic;
    a.v_stochastic = v_stochastic;
    a.v_linear = v_linear;
    return a;
  }

  // A first-moment step (FirstMomentRows) with momentum 0.9, the m table and,
  // for the factored step, a positive row factor and column factor.
  FirstMomentRowsArgs FirstMoment(FirstMomentStep step, float* g, const float* m_scales,
                                  float* m_scales_out, uint8_t* m_codes, bool m_stochastic) {
    factor_rows.assign(row_base.size(), 2e-4f);
    factor_cols.assign(h, 5e-5f);
    FirstMomentRowsArgs a{};
    a.h = h;
    a.step = step;
    a.g = a.out = g;
    a.m_scales = m_scales;
    a.m_scales_out = m_scales_out;
    a.m_table = m_table();
    a.m_codes = a.m_out = m_codes;
    a.row_base = row_base.data();
    a.m_seed = 777u;
    a.m_stochastic = m_stochastic;
    a.momentum = 0.9f;
    a.c = c;
    a.factor_rows = factor_rows.data();
    a.col_even = a.col_odd = factor_cols.data();
    a.factor_positive = true;
    a.factor_inverse = 1.0f / 2e-4f;
    return a;
  }

  // 8-bit Adam (Apply8bitRows) in place, with the 256-entry tables and the
  // buckets of both moments (tables8: kTables8Size floats, buckets:
  // 2 kBucketTableSize ints, as the kernel's inputs).
  Apply8bitRowsArgs Apply8bit(float* g, float* m_scales, float* v_scales, uint8_t* m_codes,
                              uint8_t* v_codes, const float* tables8, const int32_t* buckets) {
    Apply8bitRowsArgs a{};
    a.h = h;
    a.g = a.out = g;
    a.m_scales = a.m_scales_out = m_scales;
    a.v_scales = a.v_scales_out = v_scales;
    a.m_table = tables8;
    a.v_table = tables8 + 256;
    a.m_codes = a.m_out = m_codes;
    a.v_codes = a.v_out = v_codes;
    a.m_buckets = buckets;
    a.v_buckets = buckets + kBucketTableSize;
    a.c = c;
    return a;
  }

 private:
  std::vector<float> factor_rows, factor_cols;
};

}  // namespace
