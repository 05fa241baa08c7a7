/* The row-major forms and the MoE entry again over float32 weights, input rows and outputs
 * (expert_rows_f32): the same sources, their units typed by AG_F32 (vec.h), in float32 FMAs. */
#define AG_F32 1
#include "matmul_tiles.c"
#include "matmul_wide.c"
#include "moe.c"
