/* silu(g) = g / (1 + e^-g) in float32, shared by fused_ops.c's SiLU step and the GEMMs' SiLU
 * epilogue (silu_store.h), so that the two compute one formula. Their bits may still differ by one
 * bf16 step, rarely: GCC may vectorize the step's division as a reciprocal estimate plus a Newton
 * step, and each call site gets the vector math library's expf for its own vector width
 * (test_gemm_silu_epilogue.py allows that step).
 *
 * Under -ffast-math GCC may divide by a reciprocal estimate refined by one Newton step, which
 * turns 1 / inf into NaN: with e^-g overflowing (g below -88.72) the plain formula gave NaN where
 * torch gives 0. So those gates give 0 (as torch's g / inf does), and the exponent is capped
 * below the overflow in the lanes a vector computes and then discards.
 *
 * -ffast-math also lets GCC assume no NaN: it may rewrite the comparison so that a NaN gate takes
 * the 0 branch (it did, in float32, and in bf16 in the scalar tail only). So NaN gates are found by
 * their bits, an integer test that no float assumption removes, and give NaN as in torch. A -inf
 * gate gives NaN too, as torch's -inf * sigmoid(-inf) = -inf * 0 does: the same test catches it
 * (exponent all ones, other than +inf, whose silu inf the formula gives), at no extra cost. */
#ifndef REFENGINE_SILU_H
#define REFENGINE_SILU_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SILU_ZERO_BELOW -88.72284f
#define SILU_MAX_EXPONENT 88.0f
#define SILU_PLUS_INF_BITS 0x7f800000u
#define SILU_QUIET_NAN_BIT 0x00400000u

static inline float silu_of(float g)
{
    uint32_t bits;
    memcpy(&bits, &g, sizeof bits);
    float silu = g < SILU_ZERO_BELOW ? 0.0f : g / (1.0f + expf(fminf(-g, SILU_MAX_EXPONENT)));
    if ((bits & SILU_PLUS_INF_BITS) == SILU_PLUS_INF_BITS && bits != SILU_PLUS_INF_BITS) {
        bits |= SILU_QUIET_NAN_BIT; /* a NaN (quieted), or -inf made a NaN */
        memcpy(&silu, &bits, sizeof silu);
    }
    return silu;
}
#endif
