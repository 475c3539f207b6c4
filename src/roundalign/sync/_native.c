/* Fair Cast's CPU kernels: bf16 stochastic rounding and bf16 error feedback, one pass over the weights each.
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
