/* C restatements of two ATen CPU kernels, for a compiled model's opaque ops (roundalign/ops/_aten.py): they read
   the stored 16-bit tensors in one pass where ATen's calls need fp32 copies, and give ATen's bits.

   1. Row sums in ATen's summation order (RMSNorm's variance and its backward's row sum).
   2. SiLU's backward, ATen's arithmetic element for element (SwiGLU's gate gradient).

   Built with -ffp-contract=off: no product is fused into an add unless written as fmaf. */

/* --- 1. Row sums ---------------------------------------------------------------------------------------------

Row reductions of RMSNorm in ATen's summation order, read straight from the stored 16-bit tensors.

   ATen sums a contiguous fp32 row (SumKernel.cpp, cascade_sum -> vectorized_inner_sum) as W-lane vectors
   (W = Vectorized<float>::size(): 16 under its AVX512 kernels, 8 under AVX2 and the default ones): the row's whole
   vectors are summed in four interleaved accumulators, each a cascade of four levels that closes every 16 (or more)
   vectors (multi_row_sum), the four are added in order, then the leftover elements are summed from 0 and the W lanes
   of the vector sum added to that, lane by lane. Every fp32 add below is one of those adds, in that order, so the
   result is ATen's bit for bit; the element values are the ones ATen's eager formula sums (x*x, or the backward's
   grad_normed*x), each one fp32 product. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

enum { BF16, FP16, FP32 }; /* the stored format of x and g */

INLINE float widen(const void *p, int64_t i, int fmt) { /* exact */
    if (fmt == FP32) return ((const float *)p)[i];
    if (fmt == FP16) { _Float16 h; memcpy(&h, (const uint16_t *)p + i, 2); return (float)h; }
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16; float f; memcpy(&f, &u, 4); return f;
}

INLINE float round16(float v, int fmt) { /* r(v): to the 16-bit format, nearest even, and back */
    if (fmt == FP16) return (float)(_Float16)v;
    uint32_t u; memcpy(&u, &v, 4);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    r = (u & 0x7FFFFFFFu) > 0x7F800000u ? u : r; /* NaN stays NaN */
    float f; memcpy(&f, &r, 4); return f;
}

/* One row: x and g in the stored format, w fp32. The summed element at position i is x^2 (kind 0) or
   grad_normed * x (kind 1), where grad_normed is r(g * w) when round_product, else g * w, all in fp32. */
typedef struct { const char *x, *g; const float *w; } row_t;

INLINE float element(const row_t *r, int64_t i, int kind, int fmt, int round_product) {
    float xv = widen(r->x, i, fmt);
    if (kind == 0) return xv * xv;
    float gn = widen(r->g, i, fmt) * r->w[i];
    if (round_product) gn = round16(gn, fmt);
    return gn * xv;
}

static int64_t ceil_log2(int64_t x) { /* ATen's utils::CeilLog2 */
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((uint64_t)(x - 1));
}

/* row_sum<Vectorized<float>> of vectorized_inner_sum with W lanes (W = 1: scalar_inner_sum's row_sum). */
INLINE float row_sum(const row_t *r, int64_t n, const int W, int kind, int fmt, int rp) {
    const int64_t vec_size = n / W, size_ilp = vec_size / 4;
    float acc0[4][W]; /* multi_row_sum's level 0: [interleaved row k][lane] */
    for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc0[k][l] = 0.0f;
    int64_t i = 0;
    const int64_t power = ceil_log2(size_ilp) / 4 > 4 ? ceil_log2(size_ilp) / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    if (size_ilp >= step) { /* a row long enough for the cascade's upper levels (rarely: 16 x 4 x W elements) */
        float up[3][4][W]; /* levels 1-3 */
        for (int j = 0; j < 3; ++j)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) up[j][k][l] = 0.0f;
        for (; i + step <= size_ilp;) { /* multi_row_sum over 4 rows of vectors: vector 4 i + k is row k's i-th */
            for (int64_t j = 0; j < step; ++j, ++i)
                for (int k = 0; k < 4; ++k)
                    for (int l = 0; l < W; ++l) acc0[k][l] += element(r, (4 * i + k) * W + l, kind, fmt, rp);
            for (int j = 1; j < 4; ++j) { /* level j takes level j - 1, closing every step^j vectors */
                float (*below)[W] = j == 1 ? acc0 : up[j - 2];
                for (int k = 0; k < 4; ++k)
                    for (int l = 0; l < W; ++l) { up[j - 1][k][l] += below[k][l]; below[k][l] = 0.0f; }
                if ((i & (mask << (j * power))) != 0) break;
            }
        }
        for (; i < size_ilp; ++i)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) acc0[k][l] += element(r, (4 * i + k) * W + l, kind, fmt, rp);
        for (int j = 0; j < 3; ++j)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) acc0[k][l] += up[j][k][l];
    } else {
        for (; i < size_ilp; ++i)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) acc0[k][l] += element(r, (4 * i + k) * W + l, kind, fmt, rp);
        for (int j = 0; j < 3; ++j) /* the empty upper levels are added all the same: -0 + 0 is +0 */
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) acc0[k][l] += 0.0f;
    }
    for (int64_t v = size_ilp * 4; v < vec_size; ++v) /* row_sum: the vectors past the last group of 4 */
        for (int l = 0; l < W; ++l) acc0[0][l] += element(r, v * W + l, kind, fmt, rp);
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc0[0][l] += acc0[k][l];
    if (W == 1) return acc0[0][0];
    float total = 0.0f; /* vectorized_inner_sum: the leftover elements from 0, then the lanes in order */
    for (int64_t e = vec_size * W; e < n; ++e) total += element(r, e, kind, fmt, rp);
    for (int l = 0; l < W; ++l) total += acc0[0][l];
    return total;
}

typedef struct { int kind, fmt, round_product, width; const char *x, *g; const float *w; float *out; int64_t n; } job_t;

INLINE void rows_of(const job_t *a, int64_t rows, const int W, int kind, int fmt, int rp) {
    const int64_t bytes = (fmt == FP32 ? 4 : 2) * a->n; /* one row */
    for (int64_t j = 0; j < rows; ++j) {
        row_t r = {a->x + j * bytes, a->g ? a->g + j * bytes : 0, a->w};
        /* A row shorter than one vector is summed by scalar_inner_sum: the same cascade on single elements. */
        float s = a->n < W ? row_sum(&r, a->n, 1, kind, fmt, rp) : row_sum(&r, a->n, W, kind, fmt, rp);
        a->out[j] = 0.0f + s; /* ATen fills the output with 0 and adds the row's sum to it */
    }
}

/* out[j] for rows j in [0, rows): the row sums of kind 0 (x^2) or 1 (grad_normed * x, from g and w), as ATen's
   sum computes them with `width` lanes (8 or 16). x, g: rows of n values stored as fmt (0 bf16, 1 fp16, 2 fp32),
   contiguous; w: n fp32 values. One thread: at two threads this is already faster than ATen's sum of the widened
   tensor, and a thread hand-off costs about as much as a narrow model's whole call. */
void roundalign_row_sums(int kind, const void *x, const void *g, const float *w, float *out, int64_t rows, int64_t n,
                         int width, int fmt, int round_product) {
    const job_t a = {kind, fmt, kind == 1 && fmt != FP32 && round_product, width, x, g, w, out, n};
#define CASE(W_, K_, F_, R_) \
    if (a.width == W_ && a.kind == K_ && a.fmt == F_ && a.round_product == R_) { rows_of(&a, rows, W_, K_, F_, R_); return; }
#define WIDTH(W_) \
    CASE(W_, 0, BF16, 0) CASE(W_, 0, FP16, 0) CASE(W_, 0, FP32, 0) CASE(W_, 1, FP32, 0) \
    CASE(W_, 1, BF16, 0) CASE(W_, 1, BF16, 1) CASE(W_, 1, FP16, 0) CASE(W_, 1, FP16, 1)
    WIDTH(8) WIDTH(16)
#undef WIDTH
#undef CASE
}

/* --- 2. SiLU's backward --------------------------------------------------------------------------------------

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

INLINE void run(const uint16_t *g, const uint16_t *u, const uint16_t *x, void *out, int64_t begin, int64_t end,
                int64_t vector_end, int fmt, int out_fp32) {
#define AT(i, vector) silu_backward(widen(g, i, fmt) * widen(u, i, fmt), widen(x, i, fmt), vector)
    if (out_fp32) { /* the unrounded results: what the probe compares */
        for (int64_t i = begin; i < vector_end; ++i) ((float *)out)[i] = AT(i, 1);
        for (int64_t i = vector_end; i < end; ++i) ((float *)out)[i] = AT(i, 0);
        return;
    }
    uint16_t *o = out;
    for (int64_t i = begin; i < vector_end; ++i) o[i] = narrow(AT(i, 1), fmt);
    for (int64_t i = vector_end; i < end; ++i) o[i] = narrow(AT(i, 0), fmt);
#undef AT
}

/* out = r(silu_backward(g * u, x)) over n elements, as ATen computes it on the whole tensor with `threads` threads
   and `width` lanes; g, u, x in the 16-bit format fmt (0 bf16, 1 fp16), contiguous; out in fmt, or fp32 and not
   rounded (out_fp32). */
void roundalign_silu_backward_of_product(const uint16_t *g, const uint16_t *u, const uint16_t *x, void *out,
                                         int64_t n, int threads, int width, int fmt, int out_fp32) {
    const int64_t grain = 32768;
    int64_t ranges = 1;
    if (n > grain && threads > 1) {
        ranges = (n + grain - 1) / grain;
        if (ranges > threads) ranges = threads;
    }
    const int64_t size = (n + ranges - 1) / ranges, step = 2 * (int64_t)width;
    for (int64_t begin = 0; begin < n; begin += size) {
        const int64_t end = begin + size < n ? begin + size : n;
        const int64_t vector_end = begin + (end - begin) / step * step;
        if (fmt == FP16) run(g, u, x, out, begin, end, vector_end, FP16, out_fp32);
        else run(g, u, x, out, begin, end, vector_end, BF16, out_fp32);
    }
}
