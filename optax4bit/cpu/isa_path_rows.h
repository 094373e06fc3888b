// Every row kernel of one ISA path. kernels.cc includes this file once per
// path, inside the path's namespace and under its `#pragma GCC target`, with
// OPTAX4BIT_ROWS_AVX512 / OPTAX4BIT_ROWS_AVX2 / OPTAX4BIT_ROWS_NEON set for
// it, and resets its guard after each path. The guards of the row headers
// are reset at the end, for the next path: each is included once per path.
#ifndef OPTAX4BIT_CPU_ISA_PATH_ROWS_H_
#define OPTAX4BIT_CPU_ISA_PATH_ROWS_H_

#if !defined(OPTAX4BIT_ROWS_AVX512) || !defined(OPTAX4BIT_ROWS_AVX2) || \
    !defined(OPTAX4BIT_ROWS_NEON)
#error "isa_path_rows.h is included by kernels.cc, once per ISA path"
#endif

#include "vector_ops.h"
#include "encode_rows.h"
#include "adam_4bit_rows.h"
#include "first_moment_rows.h"
#include "adam_8bit_rows.h"
#include "codec_rows.h"

#undef OPTAX4BIT_CPU_VECTOR_OPS_H_
#undef OPTAX4BIT_CPU_ENCODE_ROWS_H_
#undef OPTAX4BIT_CPU_ADAM_4BIT_ROWS_H_
#undef OPTAX4BIT_CPU_FIRST_MOMENT_ROWS_H_
#undef OPTAX4BIT_CPU_ADAM_8BIT_ROWS_H_
#undef OPTAX4BIT_CPU_CODEC_ROWS_H_

#endif  // OPTAX4BIT_CPU_ISA_PATH_ROWS_H_
