/* The few-row kernel: calls of a narrow packing (1..FEW rows at a time) (packed_linear.h: int8 values under a scale,
   and an offset or not, per block of 32, or per half block: `halves`) on the vector units, on any CPU.

   At batch 1 a step streams every weight once, and how many vector operations a cache line costs bounds it
   here: the fewer, the closer the stream comes to the machine's read rate. So the products are integers, and
   the weights stay bytes: each 4 * VW bytes (VW outputs' values at 4 consecutive k, `quads`, stored plus 128
   as unsigned bytes) meet x's digits in four byte multiply-adds (VNNI's `vpdpbusd`), one per signed byte of
   x, where the 16-bit pair products (the build without VNNI) cost two widenings and four `vpdpwssd` a line.

   - Each row's x is written, per block of 32, as integers times a power of two, X = x * 2^q, q the largest
     that keeps every |X| within 2^X_BITS: exact where the block's values lie within 5 binary orders of its
     largest, else rounded to the nearest integer (2^-29 of that largest); X = hi * 2^15 + lo, each within
     2^14, and each of those two signed bytes (lo = 256 * lo1 + lo0).
   - Per block (or half block) and output, H and L = the sums of v * hi and of v * lo, exact in 32-bit
     integers: with byte digits, sum (v + 128) * digit over k and digits (256 apart), less 128 times the sum
     of hi (of lo), which split_block counts once per row; without VNNI, 16-bit pair products of the widened
     (v + 128) and of hi and lo (`pmaddwd`), less the same. S = float(H) * 2^15 + float(L); the block's
     scale * S (+ offset * the sum of X) times 2^-q is added to a sum of GROUP_BLOCKS blocks, and those sums
     to the output. Against float64, on the default model's shapes (Q5_0-, Q4_K- and Q6_K-like weights, 1 and
     4 rows): 0.24-0.78x a float32 GEMM's largest error, as with 2^30 and 16-bit products.

   Where AMX runs, calls of the packing's tile_rows or more take the same integer sums on its int8 tiles
   (tile_rows below: the four digit rows of each x row against a weight tile's k-quads, one TDPBSUD per block and
   4 rows), where each row beyond the first costs a block a fraction of its vpdpbusd's: the rows a step verifies
   for speculative decoding then cost far less than as many steps.

   A block with an infinite or NaN x gives NaN, as float32 arithmetic would; one whose largest |x| is under
   2^-98 keeps fewer bits (2^-q must stay a normal float). H and L are exact integers, the same in every
   build, and the rest the same float operations lane by lane, so every build (AVX-512, AVX2 with or without
   VNNI, plain C with fused multiply-adds) gives the same bits, and a row's bits do not depend on the other
   rows of its call. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "packed_linear.h"
#include "vector.h"

#define FEW_AHEAD 16384 /* bytes: how far ahead few_rows fetches its weights */
#define OUT_VECTORS (TILE / VW) /* vectors of one weight tile's outputs */
#define X_BITS 29 /* |X| <= 2^X_BITS: hi and lo within 2^14, so in 16 bits and in two signed bytes each */
#define HALF_BITS 15 /* X = hi * 2^HALF_BITS + lo */
/* integer sums a pass over the blocks keeps in registers (4 per row and output vector): AVX2 has 16 in all */
#define SUMS_AT_ONCE (VW == 16 ? 16 : 8)
#define GROUP_BLOCKS 8 /* blocks summed apart before they join the output's sum: fewer roundings in a row */
#if (VW == 16 && defined(__AVX512VNNI__)) || (VW == 8 && defined(__AVXVNNI__))
#define BYTE_DIGITS 1 /* x's halves as signed bytes against the weights' bytes (vpdpbusd) */
#else
#define BYTE_DIGITS 0 /* x's halves as 16 bits against the widened weights (pmaddwd) */
#endif

/* A row's x as integers (split_block): its digits, and per block of 32 the unit 2^-q, and over each half and
   the whole block 128 times the sums of hi and of lo ([blocks][3][2]) and the sums of X ([blocks][3], as
   floats, for offsets). */
typedef struct {
#if BYTE_DIGITS
    int8_t *digits; /* [4][K]: lo's low and high byte, hi's low and high byte */
#else
    int16_t *hi, *lo; /* [K] each */
#endif
    int32_t *bias;
    float *unit, *sums;
} split_x;

typedef short vs __attribute__((vector_size(VW * sizeof(short))));
typedef signed char vb __attribute__((vector_size(VW)));

/* Each lane rounded to the nearest integer (ties to even, the default rounding mode), as int32. */
static inline vi round_ints(vf v) {
#if VW == 16
    return (vi)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX__)
    return (vi)_mm256_cvtps_epi32((__m256)v);
#else
    vi r;
    for (int i = 0; i < VW; i++) r[i] = (int)lrintf(v[i]);
    return r;
#endif
}

/* The largest lane, and the sum of the lanes (which must not overflow). */
static inline int max_lane(vi v) {
#if VW == 16
    return _mm512_reduce_max_epi32((__m512i)v);
#else
    int m = v[0];
    for (int i = 1; i < VW; i++) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

static inline int sum_lanes(vi v) {
#if VW == 16
    return _mm512_reduce_add_epi32((__m512i)v);
#else
    int s = 0;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
#endif
}

static float power_of_two(int e) { /* 2^e for e in [-126, 127] */
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* hi and lo of k .. k + VW - 1 into s: as two signed bytes each, or as 16 bits. */
static inline void store_halves(split_x s, long K, long k, vi hi, vi lo) {
#if BYTE_DIGITS
    const vi halves[2] = {lo, hi};
    for (int h = 0; h < 2; h++) {
        const vi low = (halves[h] << 24) >> 24; /* the low byte, as a signed one */
        const vb digits[2] = {__builtin_convertvector(low, vb), __builtin_convertvector((halves[h] - low) >> 8, vb)};
        memcpy(s.digits + (2 * h) * K + k, &digits[0], sizeof digits[0]);
        memcpy(s.digits + (2 * h + 1) * K + k, &digits[1], sizeof digits[1]);
    }
#else
    (void)K;
    const vs h = __builtin_convertvector(hi, vs), l = __builtin_convertvector(lo, vs);
    memcpy(s.hi + k, &h, sizeof h);
    memcpy(s.lo + k, &l, sizeof l);
#endif
}

/* Block b of x's K values into s, for weights kept plus `zero`; the sums of X only `with_sums` (offsets need
   them). */
static void split_block(const float *x, long K, long b, split_x s, int zero, int with_sums) {
    const float *xb = x + b * BLOCK;
    vi most = {0}; /* |x| as bits, lane by lane: integers compare as the floats do */
    for (int j = 0; j < BLOCK; j += VW) {
        const vi a = (vi)load(xb + j) & 0x7fffffff;
        const vi gt = a > most;
        most = (a & gt) | (most & ~gt);
    }
    const int largest = max_lane(most), finite = largest < 0x7f800000;
    int q = X_BITS - 1 - ((largest >> 23) - 127); /* largest < 2^(e + 1): |X| <= 2^X_BITS */
    q = q > 126 ? 126 : q;
    const vf up = splat(finite ? power_of_two(q) : 0.0f);
    s.unit[b] = finite ? power_of_two(-q) : NAN;
    vi his[2] = {{0}}, los[2] = {{0}}; /* each half's hi and lo, summed lane by lane (under 2^19) */
    for (int j = 0; j < BLOCK; j += VW) {
        const vi X = round_ints(load(xb + j) * up);
        const vi hi = (X + (1 << (HALF_BITS - 1))) >> HALF_BITS, lo = X - hi * (1 << HALF_BITS);
        store_halves(s, K, b * BLOCK + j, hi, lo);
        his[j / (BLOCK / 2)] += hi;
        los[j / (BLOCK / 2)] += lo;
    }
    const int hi_sums[2] = {sum_lanes(his[0]), sum_lanes(his[1])}, lo_sums[2] = {sum_lanes(los[0]), sum_lanes(los[1])};
    for (int part = 0; part < 3; part++) { /* each half, then the whole */
        s.bias[6 * b + 2 * part] = zero * (part < 2 ? hi_sums[part] : hi_sums[0] + hi_sums[1]);
        s.bias[6 * b + 2 * part + 1] = zero * (part < 2 ? lo_sums[part] : lo_sums[0] + lo_sums[1]);
    }
    if (with_sums) {
        const long long half[2] = {(long long)hi_sums[0] * (1 << HALF_BITS) + lo_sums[0],
                                   (long long)hi_sums[1] * (1 << HALF_BITS) + lo_sums[1]};
        s.sums[3 * b] = (float)half[0];
        s.sums[3 * b + 1] = (float)half[1];
        s.sums[3 * b + 2] = (float)(half[0] + half[1]);
    }
}

#if BYTE_DIGITS
/* acc + per lane the sum of its 4 weight bytes (unsigned: v + 128) times the 4 signed digits at x. */
static inline vi dot_quads(vi acc, vi w, const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, sizeof quad);
#if VW == 16
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(quad));
#else
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(quad));
#endif
}
#else
/* Half h of a line's weight bytes (VW / 2 outputs' quads) widened to 16 bits: each 32-bit lane a pair of one
   output's quad, its first pair in even lanes, its second in odd ones. */
static inline vi widen_quads(vi line, int h) {
#if VW == 16
    return (vi)_mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64((__m512i)line, 1) : _mm512_castsi512_si256((__m512i)line));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi16(h ? _mm256_extracti128_si256((__m256i)line, 1) : _mm256_castsi256_si128((__m256i)line));
#else
    uint8_t bytes[4 * VW];
    memcpy(bytes, &line, sizeof bytes);
    int16_t wide[2 * VW];
    for (int i = 0; i < 2 * VW; i++) wide[i] = bytes[h * 2 * VW + i];
    vi v;
    memcpy(&v, wide, sizeof v);
    return v;
#endif
}

/* acc + each lane's pair of 16-bit weights times x's pair, x[0..1] in even lanes and x[2..3] in odd ones. */
static inline vi dot_pairs(vi acc, vi w, const int16_t *x) {
    long long four;
    memcpy(&four, x, sizeof four);
#if VW == 16
    return acc + (vi)_mm512_madd_epi16((__m512i)w, _mm512_set1_epi64(four));
#elif defined(__AVX2__)
    return acc + (vi)_mm256_madd_epi16((__m256i)w, _mm256_set1_epi64x(four));
#else
    (void)four;
    for (int i = 0; i < VW; i++)
        acc[i] += (int16_t)(w[i] & 0xffff) * x[i % 2 * 2] + (int16_t)((uint32_t)w[i] >> 16) * x[i % 2 * 2 + 1];
    return acc;
#endif
}

/* Each output's two pair sums added, a's VW / 2 outputs then b's. */
static inline vi pair_sums(vi a, vi b) {
#if VW == 16
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}
#endif

/* group + one block's (or half block's) part of row x's sum: H and L from their sums with the weights kept plus
   zero (less zero times the sums of hi, of lo), S = H * 2^15 + L, weighed by the block's scale (and offset) and
   x's unit. Both ways of taking the products (the vector units', the tiles') end here: the same bits. */
static inline __attribute__((always_inline)) vf add_block(vf group, vi h_plus, vi l_plus, const split_x *x, long b,
                                                          int part, vf scale, vf offset, int offsets) {
    const int32_t *bias_of = x->bias + 2 * (3 * b + part); /* zero * the sums of hi, lo */
    const vi h = h_plus - bias_of[0], l = l_plus - bias_of[1];
    const vf s = fmadd(__builtin_convertvector(h, vf), splat((float)(1 << HALF_BITS)), __builtin_convertvector(l, vf));
    if (offsets) {
        const vf r = fmadd(s, scale, offset * splat(x->sums[3 * b + part]));
        return fmadd(r, splat(x->unit[b]), group);
    }
    return fmadd(s, scale * splat(x->unit[b]), group);
}

/* The rows of x (split: xs) against pair p of a narrow weight: its 2 * OUT_VECTORS output vectors, at_once of
   them a pass over the blocks (a pass reads their share of each cache line; the next finds the rest in L2).
   Inlined into each case of slotserve_few_rows_gemm's switch, so that its row and segment counts (and bits a
   value) are constants: GCC left the segments a variable otherwise (its loops' bounds a division at run time),
   1.01-1.02x slower. */
static inline __attribute__((always_inline)) void few_rows(const split_x *xs, const slotserve_packed_weight *w,
                                                            const float *bias, float *out, long N, long K, long p,
                                                            const int rows, const int segments, const int bits) {
    const long blocks = K / BLOCK, chunk = chunk_bytes(bits);
    const int quads = BLOCK / 4 / segments; /* k-quads under one scale */
    const int vectors = 2 * OUT_VECTORS, fit = SUMS_AT_ONCE / (4 * rows);
    const int at_once = fit < 1 ? 1 : fit > vectors ? vectors : fit;
    for (int v0 = 0; v0 < vectors; v0 += at_once) {
        vf acc[FEW][2 * OUT_VECTORS], group[FEW][2 * OUT_VECTORS];
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < at_once; v++) acc[m][v] = group[m][v] = splat(0.0f);
        for (long b = 0; b < blocks; b++) {
            const uint8_t *q = (const uint8_t *)w->values + (p * blocks + b) * chunk;
            for (int seg = 0; seg < segments; seg++) {
                const int part = segments > 1 ? seg : 2; /* which of split_x's sums */
                vi d[FEW][2 * OUT_VECTORS][4]; /* per digit (or per half of hi's, of lo's pairs) */
                for (int m = 0; m < rows; m++)
                    for (int v = 0; v < at_once; v++)
                        for (int j = 0; j < 4; j++) d[m][v][j] = (vi){0};
                for (int kq = seg * quads; kq < (seg + 1) * quads; kq++) {
                    if (v0 == 0) /* this quad's share of the block's lines, FEW_AHEAD on */
                        for (int t = 0; t < 2; t++)
                            __builtin_prefetch(q + FEW_AHEAD + (t * BLOCK / 4 + kq) * (chunk / (BLOCK / 2)), 0, 2);
                    for (int v = 0; v < at_once; v++) {
                        const int t = (v0 + v) / OUT_VECTORS, o = (v0 + v) % OUT_VECTORS;
                        const vi wv = quad_line(q, bits, t, kq, o);
                        const long k = b * BLOCK + 4 * kq;
#if BYTE_DIGITS
                        for (int m = 0; m < rows; m++)
                            for (int j = 0; j < 4; j++)
                                d[m][v][j] = dot_quads(d[m][v][j], wv, xs[m].digits + j * K + k);
#else
                        const vi wa = widen_quads(wv, 0), wb = widen_quads(wv, 1);
                        for (int m = 0; m < rows; m++) {
                            d[m][v][0] = dot_pairs(d[m][v][0], wa, xs[m].hi + k);
                            d[m][v][1] = dot_pairs(d[m][v][1], wb, xs[m].hi + k);
                            d[m][v][2] = dot_pairs(d[m][v][2], wa, xs[m].lo + k);
                            d[m][v][3] = dot_pairs(d[m][v][3], wb, xs[m].lo + k);
                        }
#endif
                    }
                }
                for (int v = 0; v < at_once; v++) {
                    const int col = (v0 + v) / OUT_VECTORS * TILE + (v0 + v) % OUT_VECTORS * VW; /* in the pair */
                    const vf scale = weight_scales(w, p, blocks, b, segments, seg, col);
                    const vf offset = w->offsets ? weight_offsets(w, p, blocks, b, segments, seg, col) : splat(0.0f);
                    for (int m = 0; m < rows; m++)
#if BYTE_DIGITS
                        group[m][v] = add_block(group[m][v], d[m][v][3] * 256 + d[m][v][2],
                                                d[m][v][1] * 256 + d[m][v][0], xs + m, b, part, scale, offset,
                                                w->offsets != NULL);
#else
                        group[m][v] = add_block(group[m][v], pair_sums(d[m][v][0], d[m][v][1]),
                                                pair_sums(d[m][v][2], d[m][v][3]), xs + m, b, part, scale, offset,
                                                w->offsets != NULL);
#endif
                }
            }
            if (b % GROUP_BLOCKS == GROUP_BLOCKS - 1 || b == blocks - 1)
                for (int m = 0; m < rows; m++)
                    for (int v = 0; v < at_once; v++) {
                        acc[m][v] += group[m][v];
                        group[m][v] = splat(0.0f);
                    }
        }
        for (int v = 0; v < at_once; v++) {
            const long n0 = p * PAIR + (v0 + v) / OUT_VECTORS * TILE + (v0 + v) % OUT_VECTORS * VW;
            const long n = N - n0 < VW ? N - n0 : VW; /* outputs here */
            for (int m = 0; m < rows && n > 0; m++)
                for (long i = 0; i < n; i++) out[m * N + n0 + i] = acc[m][v][i] + (bias ? bias[n0 + i] : 0.0f);
        }
    }
}

#if VW == 16 && BYTE_DIGITS && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TILE_PRODUCTS 1
#define TILE_MOST 32 /* rows whose sums one pass of tile_rows keeps */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} digit_tiles;

/* Tiles 0-1: 4 rows' digit sums (16 digit rows, int32) against weight tiles 4 and 5 (a segment's k-quads of the
   pair's two tiles, `quads` lines each); 6: those digit rows over the segment. */
static void configure_digit_tiles(int quads) {
    digit_tiles c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) c.colsb[i] = 64, c.rows[i] = TILE;
    for (int i = 4; i < 6; i++) c.colsb[i] = 64, c.rows[i] = (uint8_t)quads;
    c.colsb[6] = (uint16_t)(4 * quads), c.rows[6] = TILE;
    __asm__ volatile("" : : "r"(&c) : "memory"); /* as amx_gemm.c's configure_tiles: the stores must stay */
    _tile_loadconfig(&c);
}

/* A block (or half block) whose tile sums are stored and wait for add_block: its scales, offsets and place. */
typedef struct {
    long b;
    int seg;
    vf scale[2], offset[2];
} stored_block;

/* Rows m0 .. m0 + count - 1's stored sums of `block` ([weight tile][digit row][output]) into their group sums. */
static inline void add_stored(const stored_block *block, int32_t (*sums)[TILE * TILE], const split_x *xs,
                              vf (*group)[2], int m0, int count, int segments, int offsets) {
    const int part = segments > 1 ? block->seg : 2;
    for (int m = m0; m < m0 + count; m++)
        for (int t = 0; t < 2; t++) {
            vi d[4];
            memcpy(d, sums[t] + 4 * (m - m0) * TILE, sizeof d);
            group[m][t] = add_block(group[m][t], d[3] * 256 + d[2], d[1] * 256 + d[0], xs + m, block->b, part,
                                    block->scale[t], block->offset[t], offsets);
        }
}

/* The group sums into acc after every GROUP_BLOCKS blocks' last segment, as few_rows does. */
static inline void add_groups(const stored_block *block, vf (*group)[2], vf (*acc)[2], int rows, long blocks,
                              int segments) {
    const long b = block->b;
    if (block->seg == segments - 1 && (b % GROUP_BLOCKS == GROUP_BLOCKS - 1 || b == blocks - 1))
        for (int m = 0; m < rows; m++)
            for (int t = 0; t < 2; t++) {
                acc[m][t] += group[m][t];
                group[m][t] = splat(0.0f);
            }
}

/* Block b of a pair of fewer bits a value (`chunk` at q) in the 8-bit layout, the tiles' k-quad lines. */
static inline void widen_block(const uint8_t *q, int bits, uint8_t *wide) {
    for (int t = 0; t < 2; t++)
        for (int kq = 0; kq < BLOCK / 4; kq++) {
            const vi u = quad_line(q, bits, t, kq, 0);
            memcpy(wide + t * TILE * BLOCK + kq * 64, &u, sizeof u);
        }
}

/* few_rows on AMX's int8 tiles: `rows` rows of x (split: xs, their digits [4 * rows][K] from `digits` on, padded
   to whole tiles) against pair p. Per block (or half block) and 4 rows, one TDPBSUD a weight tile takes the 16
   digit rows (signed) times the weights kept plus zero (unsigned, already in the tiles' k-quad layout): the same
   exact sums as vpdpbusd's, and add_block the same float operations, so the bits of the vector units'.
   The tile units and the vector units wait on each other's memory: a block of fewer bits is widened one block
   ahead of the tile loads that read it, and a block's sums meet add_block after the next block's tile products
   are under way (1.2-1.4x at 1-16 rows on the default model's gate/up). */
static void tile_rows(const split_x *xs, const int8_t *digits, const slotserve_packed_weight *w, const float *bias,
                      float *out, long N, long K, long p, int rows) {
    const long blocks = K / BLOCK, chunk = chunk_bytes(w->bits);
    const int segments = w->halves ? 2 : 1, quads = BLOCK / 4 / segments, offsets = w->offsets != NULL;
    const int whole = rows / 4, groups = (rows + 3) / 4;
    vf acc[TILE_MOST][2], group[TILE_MOST][2];
    /* [4-row group][turn][weight tile][digit row][output]: a group's two turns 2 KB apart, so that reading one
       while the other's tile stores are pending aliases none of them (addresses 4 KB apart look alike) */
    int32_t sums[TILE_MOST / 4][2][2][TILE * TILE] __attribute__((aligned(64)));
    uint8_t wide[2][2 * TILE * BLOCK] __attribute__((aligned(64))); /* by turns */
    stored_block stored[2];
    int turn = 0, waiting = 0;
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = group[m][0] = group[m][1] = splat(0.0f);
    const uint8_t *values = (const uint8_t *)w->values + p * blocks * chunk;
    if (w->bits != 8)
        widen_block(values, w->bits, wide[0]);
    for (long b = 0; b < blocks; b++) {
        const uint8_t *q = values + b * chunk, *lines = w->bits == 8 ? q : wide[b % 2];
        for (long i = 0; i < chunk; i += 64) __builtin_prefetch(q + FEW_AHEAD + i, 0, 2);
        if (w->bits != 8 && b + 1 < blocks)
            widen_block(q + chunk, w->bits, wide[(b + 1) % 2]);
        for (int seg = 0; seg < segments; seg++) {
            stored_block *now = &stored[turn];
            now->b = b, now->seg = seg;
            for (int t = 0; t < 2; t++) {
                now->scale[t] = weight_scales(w, p, blocks, b, segments, seg, t * TILE);
                now->offset[t] = offsets ? weight_offsets(w, p, blocks, b, segments, seg, t * TILE) : splat(0.0f);
            }
            _tile_loadd(4, lines + seg * quads * 64, 64);
            _tile_loadd(5, lines + TILE * BLOCK + seg * quads * 64, 64);
            for (int g = 0; g < groups; g++) {
                _tile_loadd(6, digits + 16 * g * K + b * BLOCK + seg * quads * 4, K);
                _tile_zero(0);
                _tile_zero(1);
                _tile_dpbsud(0, 6, 4);
                _tile_dpbsud(1, 6, 5);
                _tile_stored(0, sums[g][turn][0], 64);
                _tile_stored(1, sums[g][turn][1], 64);
                if (waiting) /* the previous block's sums of these rows, their stores long done */
                    add_stored(&stored[turn ^ 1], sums[g][turn ^ 1], xs, group, 4 * g, g < whole ? 4 : rows % 4,
                               segments, offsets);
            }
            if (waiting)
                add_groups(&stored[turn ^ 1], group, acc, rows, blocks, segments);
            waiting = 1, turn ^= 1;
        }
    }
    for (int g = 0; g < groups; g++)
        add_stored(&stored[turn ^ 1], sums[g][turn ^ 1], xs, group, 4 * g, g < whole ? 4 : rows % 4, segments,
                   offsets);
    add_groups(&stored[turn ^ 1], group, acc, rows, blocks, segments);
    for (int t = 0; t < 2; t++) {
        const long n0 = p * PAIR + t * TILE, n = N - n0 < VW ? N - n0 : VW;
        for (int m = 0; m < rows && n > 0; m++)
            for (long i = 0; i < n; i++) out[m * N + n0 + i] = acc[m][t][i] + (bias ? bias[n0 + i] : 0.0f);
    }
}
#else
#define TILE_PRODUCTS 0
#endif

/* Whether this build can take products on AMX's int8 tiles (packed_linear.h's tile_rows). */
int slotserve_few_rows_tiles(void) { return TILE_PRODUCTS; }

/* One thread's run of pairs, [lo, hi) as lo | hi << 32: its owner takes pairs from the front, the other
   threads (their own runs done) from the back. */
typedef struct {
    unsigned long long bounds;
} __attribute__((aligned(64))) pair_run;

/* A pair of the run, from its front or its back; -1 once the run is empty. */
static long take_pair(pair_run *run, int back) {
    unsigned long long now = __atomic_load_n(&run->bounds, __ATOMIC_RELAXED), next;
    long lo, hi;
    do {
        lo = (long)(now & 0xffffffffu), hi = (long)(now >> 32);
        if (lo >= hi)
            return -1;
        next = back ? (unsigned long long)lo | (unsigned long long)(hi - 1) << 32
                    : (unsigned long long)(lo + 1) | (unsigned long long)hi << 32;
    } while (!__atomic_compare_exchange_n(&run->bounds, &now, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return back ? hi - 1 : lo;
}

/* Room for M rows' split x of K columns (padded rows of digits, zero past M: the tiles read 4 rows at a time), xs
   pointed into it: each row's digits (4 bytes a value), then its biases, units and sums (10 words a block). NULL
   without memory; the caller frees it. */
static int8_t *split_room(long M, long padded, long K, split_x *xs) {
    const long blocks = K / BLOCK;
    int8_t *rows = malloc((size_t)(4 * padded * K) + (size_t)(10 * M * blocks) * sizeof(float));
    if (!rows)
        return NULL;
    memset(rows + 4 * M * K, 0, (size_t)(4 * (padded - M) * K));
    int32_t *biases = (int32_t *)(rows + 4 * padded * K);
    float *units = (float *)(biases + 6 * M * blocks), *sums = units + M * blocks;
    for (long m = 0; m < M; m++) {
#if BYTE_DIGITS
        xs[m].digits = rows + 4 * m * K;
#else
        xs[m].hi = (int16_t *)(rows + 4 * m * K);
        xs[m].lo = xs[m].hi + K;
#endif
        xs[m].bias = biases + 6 * m * blocks;
        xs[m].unit = units + m * blocks;
        xs[m].sums = sums + 3 * m * blocks;
    }
    return rows;
}

/* out = x @ w^T + bias for a narrow weight and at most FEW rows, where this beats AMX's fixed work per tile
   of rows (a tile of 16 rows however few are real), and where there is no AMX. One thread's loads alone
   keep too few lines in flight to stream DRAM: fetching each block FEW_AHEAD bytes ahead into L2 measured
   1.8x on the default model's narrow linears, and fetching a line at a time beside the loads, not a block's
   16 lines at its start, keeps the stream steadier. x is split into digits in the same parallel region, not
   first by the caller alone, which would leave the other threads waiting meanwhile.
   Each thread streams one contiguous run of the pairs, and takes the others' last pairs once it is done
   (`take_pair`), so the thread held up (by the other tenants' memory traffic, say) is waited for a pair at
   most. A static or guided schedule waits at each call's end for the thread whose chunk ran slow, and
   dynamic runs of a few pairs lose their prefetches to pairs the other thread takes; these runs leave the
   threads the least time waiting. A pair's bits are the same on any thread.
   More than FEW rows go through each pair FEW at a time, the pair's weights found in L2 after the first: the
   bits of a row are the same in a call of any size. From w->tile_rows rows on (where set), each pair takes all
   the rows' products on the tiles instead, TILE_MOST rows a pass. Returns 0; -1 without memory for the split
   rows; -2 for a packing that is not narrow (the caller's other paths take those). */
/* The switch's cases for `rows` rows: without halves, then with, each in 8, 6, 5 and 4 bits a value. */
#define FEW_CASE(rows, segments, bits, at) \
    case at: few_rows(x0, w, bias, o0, N, K, p, rows, segments, bits); break;
#define FEW_SEGMENTS(rows, segments, at) \
    FEW_CASE(rows, segments, 8, at) FEW_CASE(rows, segments, 6, at + 1) FEW_CASE(rows, segments, 5, at + 2) \
    FEW_CASE(rows, segments, 4, at + 3)
#define FEW_CASES(rows) FEW_SEGMENTS(rows, 1, (rows - 1) * 8) FEW_SEGMENTS(rows, 2, (rows - 1) * 8 + 4)

/* Pair p of a narrow weight against all M split rows, FEW at a time (out: [M][N]). */
static void few_pair(const split_x *xs, const slotserve_packed_weight *w, const float *bias, float *out, long M,
                     long N, long K, long p) {
    for (long m0 = 0; m0 < M; m0 += FEW) {
        const split_x *x0 = xs + m0;
        float *o0 = out + m0 * N;
        const int rows = M - m0 < FEW ? (int)(M - m0) : FEW;
        switch (((rows - 1) * 2 + w->halves) * 4 + (w->bits == 8 ? 0 : 7 - w->bits)) {
            FEW_CASES(1) FEW_CASES(2) FEW_CASES(3) FEW_CASES(4) /* constant counts: registers */
        }
    }
}

int slotserve_few_rows_gemm(const float *x, const slotserve_packed_weight *w, const float *bias, float *out, long M,
                            long N, long K, int threads) {
    if (M <= 0)
        return 0;
    if (!w->narrow)
        return -2;
    const long pairs = (N + PAIR - 1) / PAIR, blocks = K / BLOCK;
    const int tiles = TILE_PRODUCTS && w->tile_rows > 0 && M >= w->tile_rows;
    const long padded = tiles ? (M + 3) / 4 * 4 : M; /* the tiles read 4 rows' digits at a time */
    split_x *xs = malloc((size_t)M * sizeof *xs);
    int8_t *rows = xs ? split_room(M, padded, K, xs) : NULL;
    if (!rows) {
        free(xs);
        return -1;
    }
    const int with_sums = w->offsets != NULL;
    pair_run runs[threads];
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        const unsigned long long lo = pairs * me / team, hi = pairs * (me + 1) / team;
        runs[me].bounds = lo | hi << 32;
#pragma omp for schedule(static)
        for (long i = 0; i < M * blocks; i++) /* its barrier publishes the runs too */
            split_block(x + i / blocks * K, K, i % blocks, xs[i / blocks], w->zero, with_sums);
#if TILE_PRODUCTS
        if (tiles) {
            configure_digit_tiles(w->halves ? BLOCK / 8 : BLOCK / 4);
            for (int other = 0; other < team; other++)
                for (long p; (p = take_pair(&runs[(me + other) % team], other > 0)) >= 0;)
                    for (long m0 = 0; m0 < M; m0 += TILE_MOST)
                        tile_rows(xs + m0, rows + 4 * m0 * K, w, bias, out + m0 * N, N, K, p,
                                  M - m0 < TILE_MOST ? (int)(M - m0) : TILE_MOST);
            _tile_release();
        } else
#endif
        for (int other = 0; other < team; other++) /* its own run first (other = 0), then the others' */
            for (long p; (p = take_pair(&runs[(me + other) % team], other > 0)) >= 0;)
                few_pair(xs, w, bias, out, M, N, K, p);
    }
    free(xs);
    free(rows);
    return 0;
}

/* The index of the last of `count` ascending starts at or below i. */
static long job_of(const long *starts, long count, long i) {
    long lo = 0, hi = count - 1;
    while (lo < hi) {
        const long mid = (lo + hi + 1) / 2;
        if (starts[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Several few-row products in one parallel region, as slotserve_few_rows_gemm computes each on the vector units
   (the same bits; no bias, no tiles): a mixture of experts' chosen experts at decode, a few MB of weights each,
   whose regions (and the stream's restart at each) one per expert cost a 30B-A3B-shaped model 1.08x its batch-1
   decode here. The jobs' pairs are one run the threads share as in slotserve_few_rows_gemm. Returns 0; -1 without memory; -2 for a packing that is not
   narrow. */
int slotserve_few_rows_jobs(const slotserve_few_rows_job *jobs, long count, int threads) {
    if (count <= 0)
        return 0;
    long pair_starts[count], item_starts[count], pairs = 0, items = 0;
    split_x *xs[count];
    int8_t *room[count];
    int failed = 0;
    for (long j = 0; j < count; j++) {
        const slotserve_few_rows_job *job = jobs + j;
        if (!job->w->narrow)
            return -2;
        pair_starts[j] = pairs, item_starts[j] = items;
        if (job->M > 0)
            pairs += (job->N + PAIR - 1) / PAIR, items += job->M * (job->K / BLOCK);
        xs[j] = job->M > 0 ? malloc((size_t)job->M * sizeof(split_x)) : NULL;
        room[j] = xs[j] ? split_room(job->M, job->M, job->K, xs[j]) : NULL;
        failed |= job->M > 0 && !room[j];
    }
    pair_run runs[threads];
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            const int me = omp_get_thread_num(), team = omp_get_num_threads();
            const unsigned long long lo = pairs * me / team, hi = pairs * (me + 1) / team;
            runs[me].bounds = lo | hi << 32;
#pragma omp for schedule(static)
            for (long i = 0; i < items; i++) { /* its barrier publishes the runs too */
                const long j = job_of(item_starts, count, i), at = i - item_starts[j], blocks = jobs[j].K / BLOCK;
                split_block(jobs[j].x + at / blocks * jobs[j].K, jobs[j].K, at % blocks, xs[j][at / blocks],
                            jobs[j].w->zero, jobs[j].w->offsets != NULL);
            }
            for (int other = 0; other < team; other++)
                for (long g; (g = take_pair(&runs[(me + other) % team], other > 0)) >= 0;) {
                    const long j = job_of(pair_starts, count, g);
                    few_pair(xs[j], jobs[j].w, NULL, jobs[j].out, jobs[j].M, jobs[j].N, jobs[j].K, g - pair_starts[j]);
                }
        }
    }
    for (long j = 0; j < count; j++) {
        free(room[j]);
        free(xs[j]);
    }
    return failed ? -1 : 0;
}
