/* Fused elementwise steps of a decoder layer on the CPU, float32 and bfloat16.
 *
 * Each replaces a chain of small torch ops. On a decode step those tensors are tiny
 * ([batch, 576] for SmolLM2), so the cost of a torch op is its dispatch, allocation
 * and thread fork/join, not its arithmetic; one pass in C per step of the layer
 * removes most of that (and reads the activations once instead of several times).
 *
 * Rows are independent and each row's arithmetic order is fixed, so results do not
 * depend on the batch. Rows run in parallel on torch's OpenMP threads once there
 * is enough work to pay for the fork.
 *
 * The steps are written once, in fused_ops_steps.h, and included for each element type.
 * bfloat16 tensors hold bfloat16 bits; their steps round to bfloat16 exactly where the
 * torch form of the step (kernels/fused.py) does and compute in float32 between the
 * roundings, so they give the torch form's result except where a float32 reduction or
 * expf differs in its last bit and that difference crosses a bfloat16 rounding boundary.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "silu.h"

#define PARALLEL_MIN_ELEMENTS 16384
/* Compiled for 512-bit vectors where the CPU has them: GCC 12's -march=native tunes Sapphire Rapids
 * for 256-bit ones, and with 512 the bf16 steps on 2,048 rows of SmolLM2 ran faster (an AMX Xeon, 2
 * threads): add_rms_norm 1.44x, rotary 1.14x, silu_and_mul 1.59x (benchmarks/README.md). Elsewhere
 * the preference changes nothing; clang has no such setting. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

static inline float bf16_to_float(uint16_t x)
{
    const uint32_t wide = (uint32_t)x << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* Round to nearest, ties to even (as torch rounds); NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* float32: add_rms_norm, silu_and_mul, rotary. */
#define ELEM_T float
#define TO_F(x) (x)
#define FROM_F(x) (x)
#define ROUND(x) (x)
#define STEP_NAME(n) n
#include "fused_ops_steps.h"
#undef ELEM_T
#undef TO_F
#undef FROM_F
#undef ROUND
#undef STEP_NAME

/* bfloat16: add_rms_norm_bf16, silu_and_mul_bf16, rotary_bf16 (tables in bfloat16 too). */
#define ELEM_T uint16_t
#define TO_F(x) bf16_to_float(x)
#define FROM_F(x) float_to_bf16(x)
#define ROUND(x) bf16_to_float(float_to_bf16(x))
#define STEP_NAME(n) n##_bf16
#include "fused_ops_steps.h"
