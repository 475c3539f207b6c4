/* Fair Cast's CPU kernels: stochastic rounding and error feedback to bf16 and fp16, one pass over the weights each.
 *
 * Compiled at first use by roundalign/sync/_native.py with the machine's C compiler (the compiler the fused ops
 * already need) and called through ctypes, which releases the GIL so that threads export disjoint ranges at once.
 * Each kernel is the same arithmetic as the torch formulas in roundalign/sync/noise.py and export.py (which run where
 * no compiler is found, and on GPUs); tests/test_sync_native.py checks them bitwise against each other and against
 * Threefry's published known answers. Integer arithmetic is unsigned 32-bit (wrapping is defined); the only float
 * operations are error feedback's fp32 add and subtract, compiled without contraction (-ffp-contract=off).
 */
#include <stdint.h>
#include <string.h>

/* Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC'11;
 * JAX's default generator): a keyed bijection of a 64-bit counter, so any word of the stream is computed from its
 * index alone, and a shard of a tensor draws exactly the noise the whole tensor would give it. */
static inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

#define MIX(r) x0 += x1; x1 = rotl(x1, r); x1 ^= x0;
#define INJECT(a, b, i) x0 += a; x1 += b + (uint32_t)(i);

static inline void threefry(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1, uint32_t *o0, uint32_t *o1) {
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

/* The stream's 32-bit words: word w is x0 (w even) or x1 (w odd) of the block with counter (w >> 1, c1). */
void roundalign_words(uint32_t *out, int64_t n, uint64_t first, uint32_t k0, uint32_t k1, uint32_t c1) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t w = first + (uint64_t)i;
        uint32_t x0, x1;
        threefry(k0, k1, (uint32_t)(w >> 1), c1, &x0, &x1);
        out[i] = (w & 1) ? x1 : x0;
    }
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
enum { U = 4 };

static inline v8u32 vrotl(v8u32 x, int r) { return (x << r) | (x >> (32 - r)); }

#define VMIX(r) for (int u = 0; u < U; u++) { x0[u] += x1[u]; x1[u] = vrotl(x1[u], r); x1[u] ^= x0[u]; }
#define VINJECT(a, b, i) for (int u = 0; u < U; u++) { x0[u] += a; x1[u] += b + (uint32_t)(i); }

static inline void vthreefry(uint32_t k0, uint32_t k1, v8u32 *c0, uint32_t c1, v8u32 *x0, v8u32 *x1) {
    uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
    for (int u = 0; u < U; u++) { x0[u] = c0[u] + k0; x1[u] = (v8u32){0} + (c1 + k1); }
    VMIX(13) VMIX(15) VMIX(26) VMIX(6)  VINJECT(k1, k2, 1)
    VMIX(17) VMIX(29) VMIX(16) VMIX(24) VINJECT(k2, k0, 2)
    VMIX(13) VMIX(15) VMIX(26) VMIX(6)  VINJECT(k0, k1, 3)
    VMIX(17) VMIX(29) VMIX(16) VMIX(24) VINJECT(k1, k2, 4)
    VMIX(13) VMIX(15) VMIX(26) VMIX(6)  VINJECT(k2, k0, 5)
}

static inline v8u32 load8(const uint32_t *p) { v8u32 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(uint16_t *p, v8u32 v) { v8u16 h = __builtin_convertvector(v, v8u16); memcpy(p, &h, sizeof h); }

static inline void sr_one(const uint32_t *bits, uint16_t *out, uint64_t g, uint32_t k0, uint32_t k1, uint32_t c1) {
    *out = nan_or(*bits, (*bits + noise16(k0, k1, c1, g)) >> 16); /* the rounding point: add, truncate */
}

/* bf16 SR of n fp32 values (as bits) that are elements first .. first + n - 1 of their tensor. inf + noise stays inf
 * (the noise is below the exponent); a finite value may round up to inf, with the probability it would round up. */
void roundalign_sr_bf16(const uint32_t *restrict bits, uint16_t *restrict out, int64_t n, uint64_t first, uint32_t k0,
                        uint32_t k1, uint32_t c1) {
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
                store8(o + 8 * p, ((v + parts[p]) >> 16) | nan); /* the rounding point: add below bf16's last bit */
            }
        }
    }
    for (i += 32 * U * rounds; i < n; i++) sr_one(bits + i, out + i, first + i, k0, k1, c1); /* the tail */
}

/* bf16 error feedback: v = fl32(master + residual) (or master when fresh), served = RNE(v), residual = v - served
 * (exact: Sterbenz). Where v or the served value is not finite, no finite residual carries the difference: the
 * residual restarts at +0. NaN is served as torch's CPU cast serves it (0xFFFF), inf as inf. */
static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline void ef_bf16(const float *restrict master, float *restrict residual, uint16_t *restrict out, int64_t n,
                           int fresh) {
    uint32_t *r = (uint32_t *)residual;
    for (int64_t i = 0; i < n; i++) {
        float v = fresh ? master[i] : master[i] + residual[i]; /* EF's one rounding of the sum (fp32) */
        uint32_t u = as_bits(v);
        uint32_t finite = 0u - ((u & 0x7F800000u) != 0x7F800000u); /* all ones where v is finite */
        uint32_t nan = 0u - ((u & 0x7FFFFFFFu) > 0x7F800000u);     /* all ones where v is NaN: served 0xFFFF */
        /* RNE to bf16 (the rounding point): add 0x7FFF plus the kept part's lowest bit, truncate. */
        uint32_t s = (((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) | nan) & 0xFFFFu;
        uint32_t keep = finite & (0u - ((s & 0x7F80u) != 0x7F80u)); /* v and served both finite */
        out[i] = (uint16_t)s;
        r[i] = as_bits(v - as_float(s << 16)) & keep; /* residual = v - served, exact; else +0 */
    }
}

/* Two instantiations, so that neither loop carries the branch on ``fresh``. */
void roundalign_ef_bf16(const float *master, float *residual, uint16_t *out, int64_t n, int fresh) {
    if (fresh) ef_bf16(master, residual, out, n, 1);
    else ef_bf16(master, residual, out, n, 0);
}

/* fp16. fp32 bits -> fp16 bits for a value already on fp16's grid (or >= 2^16: inf), and NaN as torch's CPU cast
 * writes it (payload's top bits kept, quiet bit set). */
static inline uint16_t fp16_bits_exact(uint32_t t) {
    uint32_t sign = (t >> 16) & 0x8000u, a = t & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a & 0x7FFFFFu) >> 13)); /* NaN */
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7C00u);                          /* 2^16 and up, inf */
    if (a >= 0x38800000u) return (uint16_t)(sign | ((a - 0x38000000u) >> 13));        /* normal: rebias */
    if (a < 0x33000000u) return (uint16_t)sign;                                        /* below 2^-25: 0 */
    uint32_t e = a >> 23, mant = (a & 0x7FFFFFu) | 0x800000u;
    return (uint16_t)(sign | (mant >> (126 - e))); /* subnormal: a multiple of 2^-24, exactly */
}

/* fp16 SR (export.py's _stochastic_fp16, one pass): element g takes word g of stream c1 (roundalign_words' layout);
 * d low bits of it are added below fp16's grid point and truncated, d = 13 in fp16's normal range and up to 23
 * below 2^-14. Values with 0 < |x| < 2^-24 need an exact Bernoulli instead: the kernel leaves them to the caller
 * and returns how many there are. */
int64_t roundalign_sr_fp16(const uint32_t *restrict bits, uint16_t *restrict out, int64_t n, uint64_t first,
                           uint32_t k0, uint32_t k1, uint32_t c1) {
    int64_t tiny = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t w = first + (uint64_t)i;
        uint32_t x0, x1;
        threefry(k0, k1, (uint32_t)(w >> 1), c1, &x0, &x1);
        uint32_t u = bits[i], e = (u >> 23) & 0xFFu;
        uint32_t ec = e < 103u ? 103u : (e > 113u ? 113u : e);
        uint32_t low = (0x800000u >> (ec - 103u)) - 1u; /* the d low bits below fp16's grid point */
        uint32_t t = (u + (((w & 1) ? x1 : x0) & low)) & ~low; /* the rounding point: add noise, truncate */
        out[i] = fp16_bits_exact(e == 255u ? u : t);
        tiny += ((u - 1u) & 0x7FFFFFFFu) < 0x337FFFFFu; /* 0 < |x| < 2^-24 */
    }
    return tiny;
}

/* RNE fp32 -> fp16 bits, as torch's cast (overflow to inf, subnormals, NaN kept quiet with its payload's top). */
static inline uint16_t fp16_rne(uint32_t u) {
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a & 0x7FFFFFu) >> 13));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* from 65520 (the midpoint past 65504) up: inf */
    if (a >= 0x38800000u) {                                   /* normal */
        uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
    }
    if (a < 0x33000000u) return (uint16_t)sign; /* at most 2^-25 (a tie to even 0 at exactly 2^-25): 0 */
    uint32_t e = a >> 23, mant = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - e; /* 14 .. 24 */
    uint32_t half = 1u << (shift - 1), rest = mant & ((1u << shift) - 1u), q = mant >> shift;
    q += rest > half || (rest == half && (q & 1u)); /* round to nearest, ties to even (may carry into 2^-14) */
    return (uint16_t)(sign | q);
}

static inline float fp16_value(uint16_t h) { /* exact fp16 -> fp32 */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 31u) return as_float(sign | 0x7F800000u | (m << 13));
    if (e) return as_float(sign | ((e + 112u) << 23) | (m << 13));
    return (sign ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
}

/* fp16 error feedback, as ef_bf16 with fp16's RNE. */
void roundalign_ef_fp16(const float *restrict master, float *restrict residual, uint16_t *restrict out, int64_t n,
                        int fresh) {
    for (int64_t i = 0; i < n; i++) {
        float v = fresh ? master[i] : master[i] + residual[i]; /* EF's one rounding of the sum (fp32) */
        uint32_t u = as_bits(v);
        uint16_t s = fp16_rne(u); /* the rounding point */
        int keep = (u & 0x7F800000u) != 0x7F800000u && (s & 0x7C00u) != 0x7C00u;
        out[i] = s;
        residual[i] = keep ? v - fp16_value(s) : 0.0f; /* exact (Sterbenz); +0 where either is not finite */
    }
}

/* Many tensors in one call (Exporter.export: one call per thread for a whole state_dict, no per-tensor Python).
 * desc holds count rows of int64: SR [bits, out, n, first, k0, k1, c1]; EF [master, residual, out, n, fresh]. */
void roundalign_sr_bf16_many(int64_t count, const int64_t *desc) {
    for (int64_t t = 0; t < count; t++, desc += 7)
        roundalign_sr_bf16((const uint32_t *)(intptr_t)desc[0], (uint16_t *)(intptr_t)desc[1], desc[2],
                           (uint64_t)desc[3], (uint32_t)desc[4], (uint32_t)desc[5], (uint32_t)desc[6]);
}

void roundalign_sr_fp16_many(int64_t count, const int64_t *desc, int64_t *tiny) {
    for (int64_t t = 0; t < count; t++, desc += 7)
        tiny[t] = roundalign_sr_fp16((const uint32_t *)(intptr_t)desc[0], (uint16_t *)(intptr_t)desc[1], desc[2],
                                     (uint64_t)desc[3], (uint32_t)desc[4], (uint32_t)desc[5], (uint32_t)desc[6]);
}

void roundalign_ef_fp16_many(int64_t count, const int64_t *desc) {
    for (int64_t t = 0; t < count; t++, desc += 5)
        roundalign_ef_fp16((const float *)(intptr_t)desc[0], (float *)(intptr_t)desc[1], (uint16_t *)(intptr_t)desc[2],
                           desc[3], (int)desc[4]);
}

void roundalign_ef_bf16_many(int64_t count, const int64_t *desc) {
    for (int64_t t = 0; t < count; t++, desc += 5)
        roundalign_ef_bf16((const float *)(intptr_t)desc[0], (float *)(intptr_t)desc[1], (uint16_t *)(intptr_t)desc[2],
                           desc[3], (int)desc[4]);
}
