/* A C restatement of one ATen CPU kernel, for a compiled model's opaque op (roundalign/ops/_aten.py): it reads
   the stored 16-bit tensors in one pass where ATen's call needs fp32 copies, and gives ATen's bits.

   SiLU's backward, ATen's arithmetic element for element (SwiGLU's gate gradient). (RMSNorm's row sums, once
   restated here too, are written as tensor ops that Inductor fuses: roundalign/ops/_cascade.py.)

   Built with -ffp-contract=off: no product is fused into an add unless written as fmaf. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

enum { BF16, FP16 }; /* the stored format of the operands */

INLINE float widen(const void *p, int64_t i, int fmt) { /* exact */
    if (fmt == FP16) { _Float16 h; memcpy(&h, (const uint16_t *)p + i, 2); return (float)h; }
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16; float f; memcpy(&f, &u, 4); return f;
}

/* --- SiLU's backward ------------------------------------------------------------------------------------------

   SwiGLU's gate gradient: r(silu_backward(grad * up, gate)) from the 16-bit tensors, one pass.

   ATen's silu_backward (Activation.cpp) computes dy * s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)), in fp32, the
   last sum one fused multiply-add (torch's build contracts it), with two exps: in its vector loop (2 W elements a
   step) Sleef's expf_u10, restated below (sleefsimdsp.c, xexpf, its fused multiply-adds included), and for the
   elements left over at the end of each thread's range, libm's expf. The two differ on about one gate value in 250,
   so which element takes which is part of the result: ATen splits n elements over T threads (parallel_for, grain
   32,768) into ranges of ceil(n / T') elements, T' = min(T, ceil(n / 32,768)) (one range if n <= 32,768), and the
   last (length mod 2 W) elements of each range are the scalar ones. The Python side checks every 16-bit gate value
   on both paths, and the ranges, against ATen before it uses this. */

INLINE uint16_t narrow(float v, int fmt) { /* round to nearest even */
    if (fmt == FP16) { _Float16 h = (_Float16)v; uint16_t b; memcpy(&b, &h, 2); return b; }
    uint32_t u; memcpy(&u, &v, 4);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : r); /* NaN: quiet, sign kept */
}

INLINE float pow2i(int32_t q) { uint32_t u = (uint32_t)(q + 0x7f) << 23; float f; memcpy(&f, &u, 4); return f; }

/* Sleef's expf_u10 (xexpf), written branch-free so that the compiler vectorises it. Outside [-104, 100] the result
   is replaced (0, infinity); there the argument is clamped first only to keep the float-to-int conversion defined.
   A NaN stays NaN through s. */
INLINE float sleef_expf_u10(float d) {
    const float R_LN2f = 1.442695040888963407359924681001892137426645954152985934135449406931f;
    const float L2Uf = 0.693145751953125f, L2Lf = 1.428606765330187045e-06f;
    float dc = d < -110.0f ? -110.0f : (d > 110.0f ? 110.0f : d);
    dc = d == d ? dc : 0.0f;
    int32_t q = (int32_t)__builtin_rintf(dc * R_LN2f); /* vrint_vi2_vf: cvtps2dq, nearest even */
    float fq = (float)q;
    float s = fmaf(fq, -L2Uf, d);
    s = fmaf(fq, -L2Lf, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1) * pow2i(q - (q >> 1)); /* vldexp2 */
    u = d < -104.0f ? 0.0f : u;
    return 100.0f < d ? INFINITY : u;
}

INLINE float silu_backward(float dy, float x, int vector) {
    float s = 1.0f / (1.0f + (vector ? sleef_expf_u10(-x) : expf(-x)));
    return dy * s * fmaf(x, 1.0f - s, 1.0f);
}

/* ATen's silu on fp32 (Activation.cpp): x / (1 + exp(-x)), with the same two exps, split as its backward's. */
INLINE float silu(float x, int vector) { return x / (1.0f + (vector ? sleef_expf_u10(-x) : expf(-x))); }

/* Elements [b, e) of one range, all on one exp path, through local blocks: the loops read g, u, x and write only
   the blocks, so they vectorise whatever out aliases (out may be g), and each block is copied out after. */
#define BLOCK 256
#define PATH(vector)                                                                                                \
    for (int64_t k = b; k < e; k += BLOCK) {                                                                         \
        const int64_t m = e - k < BLOCK ? e - k : BLOCK;                                                             \
        uint16_t bg[BLOCK], bu[BLOCK];                                                                               \
        float fg[BLOCK], fu[BLOCK];                                                                                  \
        if (out_fp32) {                                                                                              \
            for (int64_t j = 0; j < m; ++j) {                                                                        \
                const float gi = widen(g, k + j, fmt), xi = widen(x, k + j, fmt);                                    \
                fg[j] = silu_backward(gi * widen(u, k + j, fmt), xi, vector);                                        \
                fu[j] = gi * silu(xi, vector);                                                                       \
            }                                                                                                        \
            memcpy((float *)out + k, fg, m * 4);                                                                     \
            if (up_out) memcpy((float *)up_out + k, fu, m * 4);                                                      \
        } else if (up_out) {                                                                                         \
            for (int64_t j = 0; j < m; ++j) {                                                                        \
                const float gi = widen(g, k + j, fmt), xi = widen(x, k + j, fmt);                                    \
                bg[j] = narrow(silu_backward(gi * widen(u, k + j, fmt), xi, vector), fmt);                           \
                bu[j] = narrow(gi * silu(xi, vector), fmt);                                                          \
            }                                                                                                        \
            memcpy((uint16_t *)out + k, bg, m * 2);                                                                  \
            memcpy((uint16_t *)up_out + k, bu, m * 2);                                                               \
        } else {                                                                                                     \
            for (int64_t j = 0; j < m; ++j)                                                                          \
                bg[j] = narrow(silu_backward(widen(g, k + j, fmt) * widen(u, k + j, fmt), widen(x, k + j, fmt),      \
                                             vector), fmt);                                                          \
            memcpy((uint16_t *)out + k, bg, m * 2);                                                                  \
        }                                                                                                            \
    }

/* The gate gradient into out, and where up_out is given the up gradient r(g * silu(x)) (SwiGLU's other gradient,
   as eager computes it from grad32 and F.silu of the widened gate). */
INLINE void run(const uint16_t *g, const uint16_t *u, const uint16_t *x, void *out, void *up_out, int64_t begin,
                int64_t end, int64_t vector_end, int fmt, int out_fp32) {
    int64_t b = begin, e = vector_end;
    PATH(1)
    b = vector_end, e = end;
    PATH(0)
}
#undef PATH

/* out = r(silu_backward(g * u, x)) over n elements, as ATen computes it on the whole tensor with `threads` threads
   and `width` lanes; g, u, x in the 16-bit format fmt (0 bf16, 1 fp16), contiguous; out in fmt, or fp32 and not
   rounded (out_fp32). up_out, unless NULL: r(g * silu(x)) likewise. out may be g. */
void roundalign_silu_backward_of_product(const uint16_t *g, const uint16_t *u, const uint16_t *x, void *out,
                                         void *up_out, int64_t n, int threads, int width, int fmt, int out_fp32) {
    const int64_t grain = 32768;
    int64_t ranges = 1;
    if (n > grain && threads > 1) {
        ranges = (n + grain - 1) / grain;
        if (ranges > threads) ranges = threads;
    }
    const int64_t size = (n + ranges - 1) / ranges, step = 2 * (int64_t)width;
    /* each range on a thread of torch's own OpenMP pool (the library links the libgomp torch loaded), as ATen's
       parallel_for runs them; the ranges, not the threads, fix which elements take which exp */
#pragma omp parallel for num_threads(ranges) schedule(static, 1) if (ranges > 1)
    for (int64_t r = 0; r < ranges; ++r) {
        const int64_t begin = r * size;
        if (begin >= n) continue;
        const int64_t end = begin + size < n ? begin + size : n;
        const int64_t vector_end = begin + (end - begin) / step * step;
        if (fmt == FP16) run(g, u, x, out, up_out, begin, end, vector_end, FP16, out_fp32);
        else run(g, u, x, out, up_out, begin, end, vector_end, BF16, out_fp32);
    }
}
