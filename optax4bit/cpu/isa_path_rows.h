// Every row kernel of one ISA path. adam_4bit.cc includes this file once per
// path, inside the path's namespace and under its `#pragma GCC target`, with
// OPTAX4BIT_ROWS_AVX512 / OPTAX4BIT_ROWS_AVX2 set for it (no include guard).
#include "vector_ops.h"
#include "encode_rows.h"
#include "adam_4bit_rows.h"
#include "first_moment_rows.h"
#include "adam_8bit_rows.h"
#include "codec_rows.h"
