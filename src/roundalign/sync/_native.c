/* Fair Cast's CPU kernels: stochastic rounding and error feedback to bf16 and fp16, one pass over the weights each.
 *
 * Compiled at first use by roundalign/sync/_native.py with the machine's C compiler (the compiler the fused ops
 * already need) and called through ctypes, which releases the GIL so that threads export disjoint ranges at once.
 * Each kernel is the same arithmetic as the torch formulas in roundalign/sync/noise.py and export.py (which run where
 * no compiler is found, and on GPUs); tests/test_sync_noise.py checks them bitwise against each other and against
 * Threefry's published known answers. Integer arithmetic is unsigned 32-bit (wrapping is defined); the only float
 * operations are error feedback's fp32 add and subtract, compiled without contraction (-ffp-contract=off).
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

/* Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC'11;
 * JAX's default generator): a keyed bijection of a 64-bit counter, so any word of the stream is computed from its
 * index alone, and a shard of a tensor draws exactly the noise the whole tensor would give it. */
static inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

#define MIX(r) x0 += x1; x1 = rotl(x1, r); x1 ^= x0;
#define INJECT(a, b, i) x0 += a; x1 += b + (uint32_t)(i);

static inline __attribute__((always_inline)) void threefry(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1, uint32_t *o0, uint32_t *o1) {
    uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
    uint32_t x0 = c0 + k0, x1 = c1 + k1;
    MIX(13) MIX(15) MIX(26) MIX(6)  INJECT(k1, k2, 1)
    MIX(17) MIX(29) MIX(16) MIX(24) INJECT(k2, k0, 2)
    MIX(13) MIX(15) MIX(26) MIX(6)  INJECT(k0, k1, 3)
    MIX(17) MIX(29) MIX(16) MIX(24) INJECT(k1, k2, 4)
    MIX(13) MIX(15) MIX(26) MIX(6)  INJECT(k2, k0, 5)
    *o0 = x0;
    *o1 = x1;
}

/* bf16 stochastic rounding of fp32 bits. The noise of element g (its index in the whole tensor: first + i) is 16
 * bits of one Threefry block, laid out so that 32 consecutive elements take 8 consecutive blocks, lane by lane:
 * block 8 * (g >> 5) + (g & 7), part (g >> 3) & 3 of (x0 low, x0 high, x1 low, x1 high). Eight blocks fill one
 * 256-bit vector, and each part is then 8 consecutive elements: the loop vectorises without shuffles.
 * served = (bits + noise) >> 16. Returns how many elements were not finite (the caller serves them as the plain
 * cast does: NaN payload + noise could carry into the exponent). */
/* NaN is served as torch's CPU cast serves it (0xFFFF): its payload + noise could otherwise carry into the exponent. */
static inline uint16_t nan_or(uint32_t bits, uint32_t served) {
    return (uint16_t)(((bits & 0x7FFFFFFFu) > 0x7F800000u) ? 0xFFFFu : served);
}

static inline uint32_t noise16(uint32_t k0, uint32_t k1, uint32_t c1, uint64_t g) {
    uint32_t x0, x1;
    threefry(k0, k1, (uint32_t)(8 * (g >> 5) + (g & 7)), c1, &x0, &x1);
    uint32_t word = (g & 16) ? x1 : x0;
    return (g & 8) ? (word >> 16) : (word & 0xFFFFu);
}

/* The same Threefry on vectors of 8 counters, U vectors at a time: each round depends on the last, so one vector's
 * 20 rounds are a chain of latencies; U independent chains keep the vector units busy. GCC's vector extensions
 * compile to AVX2 (or whatever the CPU has) without intrinsics. */
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef float v8f32 __attribute__((vector_size(32)));
#ifdef __AVX512VL__
enum { U = 8 }; /* 32 vector registers hold 8 chains' state; 16 (AVX2) hold 4 */
#else
enum { U = 4 };
#endif

static inline v8u32 vrotl(v8u32 x, int r) { return (x << r) | (x >> (32 - r)); }

#define VMIX(r) for (int u = 0; u < U; u++) { x0[u] += x1[u]; x1[u] = vrotl(x1[u], r); x1[u] ^= x0[u]; }
#define VINJECT(a, b, i) for (int u = 0; u < U; u++) { x0[u] += a; x1[u] += b + (uint32_t)(i); }

static inline __attribute__((always_inline)) void vthreefry(uint32_t k0, uint32_t k1, v8u32 *c0, uint32_t c1, v8u32 *x0, v8u32 *x1) {
    uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
    for (int u = 0; u < U; u++) { x0[u] = c0[u] + k0; x1[u] = (v8u32){0} + (c1 + k1); }
    VMIX(13) VMIX(15) VMIX(26) VMIX(6)  VINJECT(k1, k2, 1)
    VMIX(17) VMIX(29) VMIX(16) VMIX(24) VINJECT(k2, k0, 2)
    VMIX(13) VMIX(15) VMIX(26) VMIX(6)  VINJECT(k0, k1, 3)
    VMIX(17) VMIX(29) VMIX(16) VMIX(24) VINJECT(k1, k2, 4)
    VMIX(13) VMIX(15) VMIX(26) VMIX(6)  VINJECT(k2, k0, 5)
}

static inline v8u32 load8(const uint32_t *p) { v8u32 v; memcpy(&v, p, sizeof v); return v; }

/* Eight served values. `stream` (a large export, _native.py's STREAM_BYTES) writes them around the cache: a served
 * copy larger than the cache is not read again here, and a plain store would first read each line it fills from
 * memory (2 bytes of traffic an element on top of the 2 it writes; error feedback then moves 14 bytes an element,
 * not 16). Where the 16 bytes are not aligned (a shard's odd offset) the plain store does it; the bits are the same. */
static inline void put16(uint16_t *p, v8u16 h, int stream) {
#ifdef __SSE2__
    if (stream && !((uintptr_t)p & 15)) {
        __m128i x;
        memcpy(&x, &h, sizeof x);
        _mm_stream_si128((__m128i *)p, x);
        return;
    }
#endif
    memcpy(p, &h, sizeof h);
}

static inline void fence(int stream) { /* streamed stores are weakly ordered: done before the call returns */
#ifdef __SSE2__
    if (stream) _mm_sfence();
#endif
}

static inline void store8(uint16_t *p, v8u32 v, int stream) { put16(p, __builtin_convertvector(v, v8u16), stream); }

static inline void sr_one(const uint32_t *bits, uint16_t *out, uint64_t g, uint32_t k0, uint32_t k1, uint32_t c1) {
    *out = nan_or(*bits, (*bits + noise16(k0, k1, c1, g)) >> 16); /* the rounding point: add, truncate */
}

/* bf16 SR of n fp32 values (as bits) that are elements first .. first + n - 1 of their tensor. inf + noise stays inf
 * (the noise is below the exponent); a finite value may round up to inf, with the probability it would round up. */
static void sr_bf16(const uint32_t *restrict bits, uint16_t *restrict out, int64_t n, uint64_t first, uint32_t k0,
                    uint32_t k1, uint32_t c1, int stream) {
    int64_t i = 0;
    for (; i < n && ((first + (uint64_t)i) & 31); i++) sr_one(bits + i, out + i, first + i, k0, k1, c1); /* head */
    const v8u32 lanes = {0, 1, 2, 3, 4, 5, 6, 7}, low = (v8u32){0} + 0xFFFFu, abs = (v8u32){0} + 0x7FFFFFFFu;
    const v8u32 inf = (v8u32){0} + 0x7F800000u;
    int64_t rounds = (n - i) / (32 * U);
    uint32_t base = (uint32_t)(8 * ((first + (uint64_t)i) >> 5));
    for (int64_t q = 0; q < rounds; q++) { /* U groups of 32 elements: 8 * U blocks */
        v8u32 c0[U], x0[U], x1[U];
        for (int u = 0; u < U; u++) c0[u] = lanes + (base + 8 * (uint32_t)(U * q + u));
        vthreefry(k0, k1, c0, c1, x0, x1);
        for (int u = 0; u < U; u++) {
            const uint32_t *b = bits + i + 32 * (U * q + u);
            uint16_t *o = out + i + 32 * (U * q + u);
            v8u32 parts[4] = {x0[u] & low, x0[u] >> 16, x1[u] & low, x1[u] >> 16};
            for (int p = 0; p < 4; p++) {
                v8u32 v = load8(b + 8 * p);
                v8u32 nan = (v8u32)((v & abs) > inf); /* all ones where v is NaN: served 0xFFFF */
                store8(o + 8 * p, ((v + parts[p]) >> 16) | nan, stream); /* the rounding point: add below bf16's last bit */
            }
        }
    }
    for (i += 32 * U * rounds; i < n; i++) sr_one(bits + i, out + i, first + i, k0, k1, c1); /* the tail */
}

/* One tensor, through the cache: what tests/test_sync_noise.py checks against the documented stream. */
void roundalign_sr_bf16(const uint32_t *restrict bits, uint16_t *restrict out, int64_t n, uint64_t first, uint32_t k0,
                        uint32_t k1, uint32_t c1) {
    sr_bf16(bits, out, n, first, k0, k1, c1, 0);
}

/* The first word (x0) of Threefry blocks first .. first + n - 1 under counter high word c1: the uniform 32-bit word
 * of each element a stochastic export onto a quantization grid draws (grid.py compares it with p * 2^32). */
void roundalign_words(uint32_t *restrict out, int64_t n, uint64_t first, uint32_t k0, uint32_t k1, uint32_t c1) {
    const v8u32 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    int64_t rounds = n / (8 * U), i = 0;
    for (int64_t q = 0; q < rounds; q++) {
        v8u32 c0[U], x0[U], x1[U];
        for (int u = 0; u < U; u++) c0[u] = lanes + (uint32_t)(first + (uint64_t)(8 * (U * q + u)));
        vthreefry(k0, k1, c0, c1, x0, x1);
        for (int u = 0; u < U; u++) memcpy(out + 8 * (U * q + u), &x0[u], sizeof x0[u]);
    }
    for (i = 8 * U * rounds; i < n; i++) {
        uint32_t x0, x1;
        threefry(k0, k1, (uint32_t)(first + (uint64_t)i), c1, &x0, &x1);
        out[i] = x0;
    }
}

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* fp16. Written without branches: every candidate is computed and one is picked by a mask (sel), which GCC
 * vectorises where it leaves a ?: as control flow. */
static inline uint32_t sel(uint32_t c, uint32_t a, uint32_t b) { /* c ? a : b, for c in {0, 1} */
    uint32_t m = 0u - c;
    return (a & m) | (b & ~m);
}

static inline uint32_t clamp_u(uint32_t x, uint32_t lo, uint32_t hi) { return sel(x < lo, lo, sel(x > hi, hi, x)); }

/* RNE fp32 bits -> fp16 bits, as torch's cast: overflow from 65520 up to inf, subnormals, and NaN as torch's CPU cast
 * writes it (the payload's top bits kept, the quiet bit set). Normal range: rebias and round half to even at fp16's
 * last bit in integers. Below 2^-14: adding 0.5 makes the fp32 sum's last bit 2^-24, so the FPU's own RNE rounds to
 * fp16's subnormal grid, and the sum's low bits are the fp16 bits (F. Giesen's float_to_half_fast3_rtne). A value
 * already on fp16's grid maps to its exact bits. */
static inline uint32_t fp16_rne(uint32_t u) {
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    uint32_t nan = 0x7E00u | ((a & 0x7FFFFFu) >> 13);
    uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13; /* 65520 and up carry into inf */
    uint32_t sub = as_bits(as_float(a) + 0.5f) - 0x3F000000u;               /* the rounding point, below 2^-14 */
    uint32_t h = sel(a < 0x38800000u, sub, normal);
    h = sel(a >= 0x47800000u, 0x7C00u, h); /* 2^16 and up (and inf): inf */
    return sign | sel(a > 0x7F800000u, nan, h);
}

static inline float fp16_value(uint32_t h) { /* exact fp16 bits -> fp32 */
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t wide = sel(e == 31u, 0x7F800000u | (m << 13), ((e + 112u) << 23) | (m << 13));
    uint32_t sub = as_bits((float)(int32_t)m * 5.9604644775390625e-08f); /* m * 2^-24, exact */
    return as_float(sign | sel(e != 0u, wide, sub));
}

/* fp16 SR's rounding point on fp32 bits: the low d bits of `word` are added below fp16's grid point and truncated,
 * d = 13 in fp16's normal range and up to 23 below 2^-14 (export.py's _stochastic_fp16). The result is on fp16's grid
 * (or 2^16 and up, or inf/NaN passed through): its conversion to fp16 is exact. */
static inline uint32_t sr_fp16_grid(uint32_t u, uint32_t word) {
    uint32_t e = (u >> 23) & 0xFFu;
    uint32_t low = (0x2000u << (10u - clamp_u(e, 103u, 113u) + 103u)) - 1u; /* 2^d - 1, d = 13 + (113 - e) */
    uint32_t t = (u + (word & low)) & ~low; /* the rounding point: add noise, truncate */
    return sel(e == 255u, u, t);
}

/* The exact conversion of an fp32 on fp16's grid: F16C's where the CPU has it (the instruction torch's cast uses),
 * else the integer RNE above; both give the same bits (NaN included: quiet bit set, the payload's top bits kept). */
static inline uint16_t to_fp16(uint32_t t) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(as_float(t), _MM_FROUND_TO_NEAREST_INT);
#else
    return (uint16_t)fp16_rne(t);
#endif
}

static inline void store8_fp16(uint16_t *p, v8u32 t, int stream) {
    v8u16 h;
#ifdef __F16C__
    __m128i x = _mm256_cvtps_ph((__m256)t, _MM_FROUND_TO_NEAREST_INT);
    memcpy(&h, &x, sizeof h);
#else
    for (int k = 0; k < 8; k++) h[k] = (uint16_t)fp16_rne(t[k]);
#endif
    put16(p, h, stream);
}

static inline v8u32 vsel(v8u32 m, v8u32 a, v8u32 b) { return (a & m) | (b & ~m); } /* m ? a : b, m all ones or 0 */

static inline int any8(v8u32 m) { /* any lane set */
#ifdef __AVX__
    return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
    uint32_t any = 0;
    for (int k = 0; k < 8; k++) any |= m[k];
    return any != 0;
#endif
}

static inline v8u32 vmin(v8u32 a, v8u32 b) { /* unsigned; GCC does not see a min in the select form */
#ifdef __AVX2__
    return (v8u32)_mm256_min_epu32((__m256i)a, (__m256i)b);
#else
    return vsel((v8u32)(a < b), a, b);
#endif
}

static inline v8u32 sr_fp16_grid8(v8u32 u, v8u32 word) { /* sr_fp16_grid on 8 lanes, in fewer operations */
    const v8u32 top = (v8u32){0} + 113u, ten = (v8u32){0} + 10u, one = (v8u32){0} + 1u;
    v8u32 e = (u >> 23) & 0xFFu;
    v8u32 low = ((((v8u32){0} + 0x2000u) << vmin(top - vmin(e, top), ten)) - one); /* clamp(e, 103, 113) again */
    v8u32 t = (u + (word & low)) & ~low; /* the rounding point: add noise, truncate */
    return vsel((v8u32)(e == 255u), u, t);
}

static inline int64_t is_tiny(uint32_t u) { return ((u - 1u) & 0x7FFFFFFFu) < 0x337FFFFFu; }  /* 0 < |x| < 2^-24 */
static inline int64_t is_small(uint32_t u) { return ((u - 1u) & 0x7FFFFFFFu) < 0x36FFFFFFu; } /* 0 < |x| < 2^-17 */

/* fp16 below 2^-24 (0 < |x| < 2^-24): the neighbours are 0 and 2^-24, and p = |x| * 2^24 = M * 2^(E - 24) (M the
 * 24-bit mantissa, E <= 0) can have ~125 fraction bits. An exact Bernoulli(p): Bernoulli(M / 2^24) from the low 24
 * bits of one word, AND -E fair coin flips all 0 from the low 31 bits of four more (noise.py's bernoulli_dyadic).
 * Element g's five words: (x0, x1) of block g in streams 1 and 2, x0 in stream 3. */
static uint16_t sr_fp16_tiny(uint32_t u, uint64_t g, uint32_t k0, uint32_t k1, uint32_t c1) {
    uint32_t w[6];
    for (uint32_t s = 1; s <= 3; s++) threefry(k0, k1, (uint32_t)g, c1 + s, &w[2 * s - 2], &w[2 * s - 1]);
    uint32_t y = as_bits(as_float(u & 0x7FFFFFFFu) * 16777216.0f); /* |x| * 2^24: exact, a normal fp32 */
    uint32_t m = (y & 0x7FFFFFu) | 0x800000u, flips = 126u - (y >> 23);
    int up = (w[0] & 0xFFFFFFu) < m;
    for (int j = 1; j <= 4; j++) {
        uint32_t take = flips < 31u ? flips : 31u;
        up &= ((w[j] & 0x7FFFFFFFu) >> (31u - take)) == 0u; /* the top `take` bits of the word are all zero */
        flips -= take;
    }
    return (uint16_t)(((u >> 16) & 0x8000u) | (uint32_t)up); /* +-2^-24 or +-0 */
}

/* fp16 SR's noise is bf16's 16-bit part (noise16, the same layout): enough down to 2^-17, where fp16's grid drops
 * at most 16 fp32 bits. From 2^-24 to 2^-17 (up to 23 bits) element g's part is extended by x1 of block g in
 * stream 3 (the word its tiny-value draws leave unused) as bits 16 and up; below 2^-24 sr_fp16_tiny draws. Both
 * are rare in weights, so the vector loop below rounds every element with its 16-bit part and redoes them. */
static inline uint16_t sr_fp16_scalar(uint32_t u, uint64_t g, uint32_t k0, uint32_t k1, uint32_t c1) {
    if (is_tiny(u)) return sr_fp16_tiny(u, g, k0, k1, c1);
    uint32_t word = noise16(k0, k1, c1, g);
    if (is_small(u)) {
        uint32_t x0, x1;
        threefry(k0, k1, (uint32_t)g, c1 + 3, &x0, &x1);
        word |= x1 << 16;
    }
    return to_fp16(sr_fp16_grid(u, word));
}

static void sr_fp16(const uint32_t *restrict bits, uint16_t *restrict out, int64_t n, uint64_t first, uint32_t k0,
                    uint32_t k1, uint32_t c1, int stream) {
    int64_t i = 0;
    for (; i < n && ((first + (uint64_t)i) & 31); i++) out[i] = sr_fp16_scalar(bits[i], first + i, k0, k1, c1);
    const v8u32 lanes = {0, 1, 2, 3, 4, 5, 6, 7}, low = (v8u32){0} + 0xFFFFu, abs = (v8u32){0} + 0x7FFFFFFFu;
    const v8u32 one = (v8u32){0} + 1u, small = (v8u32){0} + 0x36FFFFFFu;
    const v8u32 normal = (v8u32){0} + 0x38800000u, span = (v8u32){0} + (0x7F800000u - 0x38800000u); /* 2^-14 .. inf */
    const v8u32 grid = (v8u32){0} + 0x1FFFu;
    int64_t rounds = (n - i) / (32 * U);
    uint32_t base = (uint32_t)(8 * ((first + (uint64_t)i) >> 5));
    for (int64_t q = 0; q < rounds; q++) { /* U groups of 32 elements: 8 * U blocks, bf16's layout */
        v8u32 c0[U], x0[U], x1[U];
        int small_seen = 0; /* values 0 < |x| < 2^-17 in this round */
        for (int u = 0; u < U; u++) c0[u] = lanes + (base + 8 * (uint32_t)(U * q + u));
        vthreefry(k0, k1, c0, c1, x0, x1);
        for (int u = 0; u < U; u++) {
            const uint32_t *b = bits + i + 32 * (U * q + u);
            uint16_t *o = out + i + 32 * (U * q + u);
            v8u32 parts[4] = {x0[u] & low, x0[u] >> 16, x1[u] & low, x1[u] >> 16};
            for (int p = 0; p < 4; p++) {
                v8u32 v = load8(b + 8 * p);
                /* fp16's normal range and up to inf, nearly every weight: 13 noise bits, sr_fp16_grid's d at every
                 * exponent from 2^-14; eight values with one below 2^-14 (zeros too) or a NaN take the general form */
                v8u32 t = (v + (parts[p] & grid)) & ~grid; /* the rounding point: add noise, truncate */
                if (__builtin_expect(any8((v8u32)(((v & abs) - normal) > span)), 0)) {
                    t = sr_fp16_grid8(v, parts[p]);
                    small_seen |= any8((v8u32)(((v - one) & abs) < small)); /* 0 < |x| < 2^-17 */
                }
                store8_fp16(o + 8 * p, t, stream);
            }
        }
        if (small_seen) /* rare: values 0 < |x| < 2^-17 in this round, redone with their whole word */
            for (int64_t j = i + 32 * U * q; j < i + 32 * U * (q + 1); j += 8) {
                v8u32 redo = (v8u32)(((load8(bits + j) - one) & abs) < small);
                if (any8(redo))
                    for (int k = 0; k < 8; k++)
                        if (redo[k]) out[j + k] = sr_fp16_scalar(bits[j + k], first + j + k, k0, k1, c1);
            }
    }
    for (i += 32 * U * rounds; i < n; i++) out[i] = sr_fp16_scalar(bits[i], first + i, k0, k1, c1); /* the tail */
}

/* RNE fp32 bits -> bf16 bits: add 0x7FFF plus the kept part's lowest bit, truncate; NaN as torch's vectorised CPU
 * cast writes it (0xFFFF). */
static inline uint32_t bf16_rne(uint32_t u) {
    uint32_t nan = 0u - ((u & 0x7FFFFFFFu) > 0x7F800000u);
    return (((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) | nan) & 0xFFFFu;
}

/* Error feedback: v = fl32(master + residual) (or master when fresh), served = RNE(v), residual = v - served (exact:
 * Sterbenz). Where v or the served value is not finite, no finite residual carries the difference: the residual
 * restarts at +0. fresh and fp16 are constants at each call below, so each instantiation is one branch-free loop. */
static inline v8f32 ef_sum8(const float *master, const float *residual, int fresh) { /* v, 8 at a time */
    v8f32 v, w;
    memcpy(&v, master, sizeof v);
    if (fresh) return v;
    memcpy(&w, residual, sizeof w);
    return v + w; /* EF's one rounding of the sum (fp32) */
}

static inline __attribute__((always_inline)) void ef(const float *restrict master, float *restrict residual,
                                                     uint16_t *restrict out, int64_t n, int fresh, int fp16, int stream) {
    uint32_t *r = (uint32_t *)residual;
    int64_t i = 0;
#ifdef __F16C__
    if (fp16) /* 8 at a time with F16C's conversions both ways; the scalar loop below does the rest, the same bits */
        for (; i + 8 <= n; i += 8) {
            v8f32 v = ef_sum8(master + i, residual + i, fresh);
            __m128i s = _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT); /* the rounding point */
            v8f32 served = (v8f32)_mm256_cvtph_ps(s);
            v8u16 h;
            memcpy(&h, &s, sizeof h);
            put16(out + i, h, stream);
            v8u32 u = (v8u32)v, hs = __builtin_convertvector(h, v8u32);
            v8u32 keep = (v8u32)((u & 0x7F800000u) != 0x7F800000u) & (v8u32)((hs & 0x7C00u) != 0x7C00u);
            v8u32 rest = (v8u32)(v - served) & keep; /* residual = v - served, exact; else +0 */
            memcpy(r + i, &rest, sizeof rest);
        }
#endif
    if (!fp16) /* bf16_rne below, 8 at a time */
        for (; i + 8 <= n; i += 8) {
            v8f32 v = ef_sum8(master + i, residual + i, fresh);
            v8u32 u = (v8u32)v, nan = (v8u32)((u & 0x7FFFFFFFu) > 0x7F800000u);
            v8u32 s = (((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) | nan) & 0xFFFFu; /* the rounding point */
            store8(out + i, s, stream);
            v8u32 keep = (v8u32)((u & 0x7F800000u) != 0x7F800000u) & (v8u32)((s & 0x7F80u) != 0x7F80u);
            v8u32 rest = (v8u32)(v - (v8f32)(s << 16)) & keep; /* residual = v - served, exact; else +0 */
            memcpy(r + i, &rest, sizeof rest);
        }
    for (; i < n; i++) {
        float v = fresh ? master[i] : master[i] + residual[i]; /* EF's one rounding of the sum (fp32) */
        uint32_t u = as_bits(v);
        uint32_t s = fp16 ? fp16_rne(u) : bf16_rne(u); /* the rounding point */
        float served = fp16 ? fp16_value(s) : as_float(s << 16);
        uint32_t inf = fp16 ? 0x7C00u : 0x7F80u; /* the served dtype's exponent field */
        uint32_t keep = 0u - (((u & 0x7F800000u) != 0x7F800000u) & ((s & inf) != inf)); /* both finite */
        out[i] = (uint16_t)s;
        r[i] = as_bits(v - served) & keep; /* residual = v - served, exact; else +0 */
    }
}

/* Many tensors in one call (Exporter.export: a whole state_dict, no per-tensor Python). desc holds count rows of
 * int64: SR [bits, out, n, first, k0, k1, c1]; EF [master, residual, out, n, fresh]. */
static void sr_many(int fp16, int64_t count, const int64_t *desc, int stream) {
    for (int64_t t = 0; t < count; t++, desc += 7)
        (fp16 ? sr_fp16 : sr_bf16)((const uint32_t *)(intptr_t)desc[0], (uint16_t *)(intptr_t)desc[1], desc[2],
                                   (uint64_t)desc[3], (uint32_t)desc[4], (uint32_t)desc[5], (uint32_t)desc[6], stream);
    fence(stream);
}

static void ef_many(int fp16, int64_t count, const int64_t *desc, int stream) {
    for (int64_t t = 0; t < count; t++, desc += 5) {
        const float *master = (const float *)(intptr_t)desc[0];
        float *residual = (float *)(intptr_t)desc[1];
        uint16_t *out = (uint16_t *)(intptr_t)desc[2];
        int64_t n = desc[3];
        if (fp16 && desc[4]) ef(master, residual, out, n, 1, 1, stream);
        else if (fp16) ef(master, residual, out, n, 0, 1, stream);
        else if (desc[4]) ef(master, residual, out, n, 1, 0, stream);
        else ef(master, residual, out, n, 0, 0, stream);
    }
    fence(stream);
}

/* runs + 1 offsets into desc's rows: run r is rows starts[r] .. starts[r + 1] - 1, one thread each. With OpenMP the
 * threads are torch's own pool (_native.py links the libgomp torch loaded): no second pool spinning against it, and
 * no Python thread hand-off. Without it, _native.py calls one run at a time from its own threads. */
static void runs(int sr, int fp16, int64_t count, const int64_t *starts, const int64_t *desc, int64_t stream) {
    int64_t cols = sr ? 7 : 5;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)count) schedule(static, 1) if (count > 1)
#endif
    for (int64_t k = 0; k < count; k++) {
        if (sr) sr_many(fp16, starts[k + 1] - starts[k], desc + cols * starts[k], (int)stream);
        else ef_many(fp16, starts[k + 1] - starts[k], desc + cols * starts[k], (int)stream);
    }
}

int roundalign_sync_threads(void) { /* 1 where the runs go on OpenMP threads, 0 where the caller's threads run them */
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void roundalign_sr_bf16_runs(int64_t count, const int64_t *starts, const int64_t *desc, int64_t stream) {
    runs(1, 0, count, starts, desc, stream);
}

void roundalign_sr_fp16_runs(int64_t count, const int64_t *starts, const int64_t *desc, int64_t stream) {
    runs(1, 1, count, starts, desc, stream);
}

void roundalign_ef_bf16_runs(int64_t count, const int64_t *starts, const int64_t *desc, int64_t stream) {
    runs(0, 0, count, starts, desc, stream);
}

void roundalign_ef_fp16_runs(int64_t count, const int64_t *starts, const int64_t *desc, int64_t stream) {
    runs(0, 1, count, starts, desc, stream);
}
