/* A float32 linear through AMX, Intel's tile units (Sapphire Rapids and later), with every product exact:
   out[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]).

   AMX multiplies bfloat16 tiles and sums the products in float32. Two facts make that a float32 GEMM here:
   - Most float32 weights of a quantized or low-precision checkpoint are, in each block of 32 along a row,
     w = scale * v (+ offset) with v bfloat16 values: GGUF's Q8_0/Q5_0/Q4_0 blocks (an fp16 scale times
     small integers) and bfloat16 checkpoints (scale 1) without an offset, Q4_K/Q5_K blocks (a scale and a
     minimum) with one. `pack` finds each block's scale (and offset) and keeps the bfloat16 values, or says
     the weight has no such form (then the caller keeps its float32 path).
   - A float32 activation is exactly the sum of three bfloat16 parts (8 + 8 + 8 significant bits).
   So each block's sum is three tile products of exact bfloat16 x bfloat16 terms, summed in float32, then
   scaled (plus the offset times the block's sum of x) and added up across blocks with fused multiply-adds:
   the same rounding, term by term, as a float32 GEMM's sums, and measured closer to the float64 result than
   our FMA kernel (small_gemm.c) on the default model's shapes.

   The weights stream at 1 byte a value where every block's values are a power of two times integers in
   [-128, 127] (GGUF's integer blocks: the power goes into the scale), widened to bfloat16 in L1 as each block
   is used; else at 2 bytes, as bfloat16. The products and sums are the same either way, so the bits are (but
   where a bfloat16 value's products would be subnormal, which AMX flushes to zero: the integers keep them).

   A row's result depends on that row alone (the batch is cut into tiles of rows, padded with zero rows), so
   its bits are the same in any batch. They are not the bits of the float32 FMA kernels. Calls of up to FEW
   rows of a narrow weight run on the vector units instead (few_rows.c: integer products of the weights and
   each row's x in fixed point), on CPUs without AMX too (its only calls there; pack is plain C): their bits
   are the same in any such call and any build, but not those of AMX.

   Layout of a packed weight: rows in pairs of 16-row tiles; for each pair and each block of 32 along K, the
   two tiles' values as AMX wants them (pairs along K, [16 k-pairs][16 rows][2]), 1024 values; and the
   pair's 32 scales (and offsets) per block. Rows past N are zero. Narrow values go in k-quads instead
   ([8 k-quads][16 rows][4]), each plus 128 as an unsigned byte: what few_rows.c's byte products take; AMX's
   path turns each quad back into its two pairs as it widens them.

   Values of two bfloat16 parts (Q6_K's per-16 scales under a per-block one, float16 checkpoints) would be
   exact too, but they stream 4 bytes a value like float32 and cost twice the tile products: measured no
   faster on decode steps and 0.72-0.76x of oneDNN's float32 GEMM on 1024-row prefills, so not taken. Q6_K's
   blocks are integers under a scale per half block, though: packed so (`halves`, int8), they serve few_rows.c's
   calls only, at a third of the float32 bytes (12 of the default model's 24 down projections). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector.h"

#define BLOCK 32 /* k per block: one tile row of bfloat16 */
#define TILE 16  /* rows of a tile, and outputs of a weight tile */
#define PAIR 32  /* outputs of the two weight tiles multiplied together */
#define GROUP 4  /* blocks whose tile sums are scaled together */
#define TILES_PER_THREAD 4 /* row tiles per thread from which each thread splits its own (slotserve_amx_gemm) */

/* A packed weight (slotserve_amx_pack's buffers); offsets NULL where the blocks have none. */
typedef struct {
    const void *values; /* bfloat16 bits (uint16), or where `narrow` int8 values plus 128 (uint8, in k-quads) */
    const float *scales, *offsets;
    int narrow;
    int halves; /* each block's two halves of 16 have their own scale (and offset): GGUF's Q6_K; few rows only */
    /* The rows it takes (the caller's choice, kept here): from min_rows on, any of a narrow packing, none past
       max_rows (FEW without AMX); the float32 path takes the rest. */
    long min_rows, max_rows;
} slotserve_amx_weight;

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static uint32_t gcd(uint32_t a, uint32_t b) {
    while (b) {
        const uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static int normal_or_zero(float f) {
    const uint32_t e = (float_bits(f) >> 23) & 0xff;
    return f == 0.0f || (e != 0 && e != 0xff);
}

#if defined(__AVX512F__) && defined(__AVX512CD__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define WIDE_FIT 1 /* the fitting code runs 16 weights a vector */
#else
#define WIDE_FIT 0
#endif

#if WIDE_FIT /* vector.h brought in immintrin.h */
/* Lanes of x that are neither zero nor a normal number (AMX reads subnormals as 0). */
static __mmask16 abnormal(__m512 x) {
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 23), _mm512_set1_epi32(0xff));
    const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ);
    return (_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()) & ~zero) |
           _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0xff));
}

/* block_fit, 16 weights a vector: the same operations on each weight, so the same result, where it can
   decide; -1 where it cannot and block_fit's scalar loop must (a zero offset, whose sign the scalar order
   picks; values whose least odd significand part does not divide the others, where the greatest common
   divisor takes Euclid's loop), both rare in GGUF's blocks. With integer_fit's vectors, the default model
   packs in 1.56-1.69 s against 4.33-4.53 s (2 threads). */
static int block_fit_wide(const float *w, int len, int with_offset, float *scale, float *offset, float *v) {
    const int vectors = len / 16;
    __m512 x[BLOCK / 16] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __mmask16 bad = 0;
    for (int j = 0; j < vectors; j++) {
        x[j] = _mm512_loadu_ps(w + 16 * j);
        bad |= abnormal(x[j]);
    }
    if (bad)
        return 0;
    float o = 0.0f;
    if (with_offset) {
        o = _mm512_reduce_min_ps(vectors == 2 ? _mm512_min_ps(x[0], x[1]) : x[0]);
        if (o == 0.0f)
            return -1;
    }
    const __m512d od = _mm512_set1_pd(o);
    __m512i odd[BLOCK / 16];
    __mmask16 nonzero[BLOCK / 16];
    uint32_t least = UINT32_MAX;
    for (int j = 0; j < vectors; j++) {
        __m256 halves[2];
        for (int h = 0; h < 2; h++) { /* v = (float)((double)w - o), exactly */
            const __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(x[j], 1)
                                                                : _mm512_castps512_ps256(x[j])), od);
            halves[h] = _mm512_cvtpd_ps(d);
            if (_mm512_cmp_pd_mask(_mm512_cvtps_pd(halves[h]), d, _CMP_EQ_OQ) != 0xff)
                return 0;
        }
        x[j] = _mm512_insertf32x8(_mm512_castps256_ps512(halves[0]), halves[1], 1);
        if (abnormal(x[j]))
            return 0;
        nonzero[j] = _mm512_cmp_ps_mask(x[j], _mm512_setzero_ps(), _CMP_NEQ_UQ);
        const __m512i m = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(x[j]), _mm512_set1_epi32(0x7fffff)),
                                          _mm512_set1_epi32(0x800000));
        const __m512i lowest = _mm512_and_si512(m, _mm512_sub_epi32(_mm512_setzero_si512(), m));
        odd[j] = _mm512_srlv_epi32(m, _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(lowest)));
        const uint32_t mine = _mm512_mask_reduce_min_epu32(nonzero[j], odd[j]);
        least = mine < least ? mine : least;
    }
    const int any = least != UINT32_MAX;
    if (any) /* the least odd part is the greatest common divisor where it divides all (quotients in double: exact) */
        for (int j = 0; j < vectors; j++)
            for (int h = 0; h < 2; h++) {
                const __m512d q = _mm512_div_pd(
                    _mm512_cvtepu32_pd(h ? _mm512_extracti64x4_epi64(odd[j], 1) : _mm512_castsi512_si256(odd[j])),
                    _mm512_set1_pd((double)least));
                const __mmask8 whole = _mm512_cmp_pd_mask(q, _mm512_roundscale_pd(q, _MM_FROUND_TO_NEG_INF), _CMP_EQ_OQ);
                if ((__mmask8)(nonzero[j] >> (8 * h)) & ~whole)
                    return -1;
            }
    const float sf = any ? (float)least : 1.0f;
    const __m512 sv = _mm512_set1_ps(sf);
    for (int j = 0; j < vectors; j++) {
        const __m512 q = _mm512_div_ps(x[j], sv);
        const __mmask16 wide = _mm512_test_epi32_mask(_mm512_castps_si512(q), _mm512_set1_epi32(0xffff));
        if (wide || abnormal(q) || _mm512_cmp_ps_mask(_mm512_mul_ps(q, sv), x[j], _CMP_EQ_OQ) != 0xffff)
            return 0;
        _mm512_storeu_ps(v + 16 * j, q);
    }
    *scale = sf;
    *offset = o;
    return 1;
}
#endif

/* Fits one block of len weights (BLOCK, or half of it) as w[i] = *scale * v[i] + *offset exactly, each v[i]
   a bfloat16 (the offset is the block's least value where asked for, else 0). Returns 0 where there is no
   fit. The odd parts of the significands of w[i] - offset share their greatest common divisor g:
   (w[i] - offset) / g is exact, and a bfloat16 where its significand has at most 8 bits. */
static int block_fit(const float *w, int len, int with_offset, float *scale, float *offset, float *v) {
#if WIDE_FIT
    const int fit = block_fit_wide(w, len, with_offset, scale, offset, v);
    if (fit >= 0)
        return fit;
#endif
    float o = 0.0f;
    if (with_offset)
        for (int i = 0; i < len; i++) o = i == 0 || w[i] < o ? w[i] : o;
    uint32_t g = 0;
    for (int i = 0; i < len; i++) {
        const double d = (double)w[i] - o;
        v[i] = (float)d;
        if ((double)v[i] != d || !normal_or_zero(v[i]) || !normal_or_zero(w[i])) /* AMX reads subnormals as 0 */
            return 0;
        const uint32_t m = float_bits(v[i]) & 0x7fffff;
        if (v[i] == 0.0f)
            continue;
        const uint32_t odd = (m | 0x800000) >> __builtin_ctz(m | 0x800000);
        if (!g || odd % g)
            g = gcd(g, odd);
    }
    const float s = g ? (float)g : 1.0f;
    for (int i = 0; i < len; i++) {
        const float d = v[i];
        v[i] = d / s;
        if ((float_bits(v[i]) & 0xffff) || !normal_or_zero(v[i]) || v[i] * s != d)
            return 0;
    }
    *scale = s;
    *offset = o;
    return 1;
}

/* Rescales a fitted block's values v and its scale so the values are integers in [-128, 127], where they
   are a power of two times such integers. Returns 0 where they are not (or the scale would not be normal). */
static int integer_fit(float *v, int len, float *scale) {
    int low = INT32_MAX; /* the exponent of the lowest set bit of any value */
#if WIDE_FIT
    for (int j = 0; j < len; j += 16) {
        const __m512 x = _mm512_loadu_ps(v + j);
        const __m512i u = _mm512_castps_si512(x);
        const __m512i m = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffff)), _mm512_set1_epi32(0x800000));
        const __m512i ctz = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(_mm512_and_si512(
                                                 m, _mm512_sub_epi32(_mm512_setzero_si512(), m))));
        const __m512i e = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(0xff)),
                                           _mm512_sub_epi32(ctz, _mm512_set1_epi32(150)));
        const int mine = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ), e);
        low = mine < low ? mine : low;
    }
#else
    for (int i = 0; i < len; i++)
        if (v[i] != 0.0f) {
            const uint32_t u = float_bits(v[i]);
            const int e = (int)((u >> 23) & 0xff) - 150 + __builtin_ctz((u & 0x7fffff) | 0x800000);
            low = e < low ? e : low;
        }
#endif
    if (low == INT32_MAX)
        return 1;
    const double down = ldexp(1.0, -low); /* exact in double, where a float might overflow */
#if WIDE_FIT
    for (int j = 0; j < len; j += 8) {
        const __m256 x = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(v + j)), _mm512_set1_pd(down)));
        if (_mm256_cmp_ps_mask(x, _mm256_set1_ps(-128.0f), _CMP_GE_OQ) != 0xff ||
            _mm256_cmp_ps_mask(x, _mm256_set1_ps(127.0f), _CMP_LE_OQ) != 0xff)
            return 0;
        _mm256_storeu_ps(v + j, x);
    }
#else
    for (int i = 0; i < len; i++) {
        v[i] = (float)(v[i] * down);
        if (v[i] < -128.0f || v[i] > 127.0f)
            return 0;
    }
#endif
    const double s = ldexp(*scale, low);
    *scale = (float)s;
    return normal_or_zero(*scale) && (double)*scale == s;
}

/* Packs w [N][K] (K a multiple of BLOCK) as w = scale * v (+ offset) per block, or per half block where
   `halves` (int8 only: few_rows reads them), v bfloat16 (int8 where `narrow`, stored as v + 128 in k-quads),
   into `values` (pairs * K * PAIR of them), `scales` and, where `offsets` is not NULL, `offsets` (float,
   pairs * K / BLOCK * PAIR each, twice that with halves: [pair][block][half][PAIR]), pairs = ceil(N / PAIR).
   Returns 0; -1 where some block has no such form, -2 where all have but some not in int8 (nothing usable is
   left in the buffers then). */
int slotserve_amx_pack(const float *w, long N, long K, float *offsets, void *values, float *scales, int narrow,
                       int halves, int threads) {
    if (K % BLOCK || (halves && !narrow))
        return -1;
    const long blocks = K / BLOCK, pairs = (N + PAIR - 1) / PAIR;
    const int segments = halves ? 2 : 1, len = BLOCK / segments;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) reduction(| : bad)
    for (long p = 0; p < pairs; p++) {
        for (long b = 0; b < blocks && !bad; b++) {
            const long tiles = (p * blocks + b) * 2 * TILE * BLOCK, at = (p * blocks + b) * PAIR * segments;
            for (int r = 0; r < PAIR && !bad; r++) {
                const long n = p * PAIR + r;
                const int t = r / TILE, col = r % TILE;
                float v[BLOCK] = {0};
                for (int h = 0; h < segments; h++) {
                    float scale = 1.0f, offset = 0.0f;
                    if (n < N && !block_fit(w + n * K + b * BLOCK + h * len, len, offsets != NULL, &scale, &offset,
                                            v + h * len))
                        bad |= 1;
                    else if (n < N && narrow && !integer_fit(v + h * len, len, &scale))
                        bad |= 2;
                    if (bad)
                        break;
                    scales[at + h * PAIR + r] = scale;
                    if (offsets)
                        offsets[at + h * PAIR + r] = offset;
                }
                for (int kq = 0; kq < BLOCK / 4 && narrow && !bad; kq++) { /* a k-quad's values, plus 128 */
                    const float *f = v + 4 * kq;
                    const uint8_t quad[4] = {(uint8_t)((int)f[0] + 128), (uint8_t)((int)f[1] + 128),
                                             (uint8_t)((int)f[2] + 128), (uint8_t)((int)f[3] + 128)};
                    memcpy((uint8_t *)values + tiles + t * TILE * BLOCK + (kq * TILE + col) * 4, quad, sizeof quad);
                }
                for (int kp = 0; kp < BLOCK / 2 && !narrow && !bad; kp++) { /* a k-pair's two values */
                    const uint16_t pair[2] = {(uint16_t)(float_bits(v[2 * kp]) >> 16),
                                              (uint16_t)(float_bits(v[2 * kp + 1]) >> 16)};
                    memcpy((uint16_t *)values + tiles + t * TILE * BLOCK + (kp * TILE + col) * 2, pair, sizeof pair);
                }
            }
        }
    }
    return bad & 1 ? -1 : bad ? -2 : 0;
}

#include "few_rows.c"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks the kernel for the tile registers (Linux grants them per process). Returns 0 where AMX can run. */
int slotserve_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-1: float32 sums of rows 0-15 and 16-31 against the weight tile in 4; 6-7: those rows' activations. */
static void configure_tiles(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = TILE;
    }
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the config, not 64: without this
       barrier the stores to the rest may be dropped as dead (seen here: an inlined copy in an OpenMP region
       kept only the palette, and ldtilecfg faulted). */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* Rows m0..m0+31 of x [M][K] float32 into three bfloat16 parts whose sum is x exactly, laid out as the tiles
   read them: [K / BLOCK][3][PAIR][BLOCK] (rows past M zero); and, where sums is not NULL, each row's sum of x
   over each block, [PAIR][K / BLOCK], for the blocks' offsets. */
static void split_tile(const float *x, long M, long K, long m0, uint16_t *parts, float *sums) {
    const long blocks = K / BLOCK;
    for (long r = 0; r < PAIR; r++)
        for (long b = 0; b < blocks; b++) {
            const long m = m0 + r;
            uint16_t *dst = parts + b * 3 * PAIR * BLOCK + r * BLOCK;
            __m512 sum = _mm512_setzero_ps();
            for (int k = 0; k < BLOCK; k += 16) {
                __m512 v = m < M ? _mm512_loadu_ps(x + m * K + b * BLOCK + k) : _mm512_setzero_ps();
                sum = _mm512_add_ps(sum, v);
                for (int p = 0; p < 3; p++) {
                    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
                    _mm256_storeu_si256((__m256i *)(dst + p * PAIR * BLOCK + k), h);
                    v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
                }
            }
            if (sums)
                sums[r * blocks + b] = _mm512_reduce_add_ps(sum);
        }
}

/* Rows m0..m0+31 (m0..m0+15 where the rest are past M), split by split_tile into parts and xsums, against
   the weight pair p, all blocks; written to out where m < M and n < N. The tile sums of GROUP blocks are
   stored, then scaled and summed, and that part added to acc: summing block by block into acc erred up to
   2.1x a float32 GEMM's error against float64 on Q4_K-like weights (1.5x on Q5_0-like ones), the two
   levels at most 1.0x (1.2x).
   A block's two weight tiles take turns: a tile store holds up the products behind it unless other tiles
   have products to run, and the turns give them some (1.06-1.12x on 32 rows, the same on 512).
   Where `prefetch` is set (a call of one row tile: a decode step, whose weights come from DRAM once each)
   the next block's weights are fetched into L2 while this one multiplies: 1.03-1.05x beyond the turns on
   the default model's shapes, 24 layers' copies, 2 threads. With more row tiles the weights come from L3
   for all but the first, and the same prefetch measured 0.91-0.95x.
   A narrow block is widened into `wide` first (its k-quads as k-pairs, less 128): against its bfloat16
   packing, same run, 1.03-1.07x on 32 rows (six runs of 15 rounds, gate/up and down shapes, 24 copies),
   1.24x on one row, 0.97-1.02x on 512 (measured when narrow values were stored as pairs, before few_rows.c
   took quads; `bench kernels`' prefill and batched decode fractions held). */
static void pair_rows(const uint16_t *parts, const float *xsums, const slotserve_amx_weight *w, const float *bias,
                      float *out, long M, long N, long K, long p, long m0, int prefetch) {
    const long blocks = K / BLOCK;
    const int rows = M - m0 > TILE ? PAIR : TILE;
    float sums[GROUP][4 * TILE * TILE] __attribute__((aligned(64)));
    float acc[2][PAIR][TILE] __attribute__((aligned(64)));
    uint16_t wide[2 * TILE * BLOCK] __attribute__((aligned(64))); /* a narrow block as bfloat16 */
    const long size = w->narrow ? 1 : 2;                            /* bytes a value */
    uint8_t order[64]; /* a k-quad's 64 bytes (16 rows' 4 values) as its two k-pairs' 32 each */
    for (int j = 0; j < 64; j++) order[j] = (uint8_t)(j % 32 / 2 * 4 + j / 32 * 2 + j % 2);
    const __m512i quad_pairs = _mm512_loadu_si512(order);
    memset(acc, 0, sizeof acc);
    for (long g0 = 0; g0 < blocks; g0 += GROUP) {
        const int group = blocks - g0 < GROUP ? blocks - g0 : GROUP;
        for (int g = 0; g < group; g++) {
            const long b = g0 + g;
            const long at = (p * blocks + b) * 2 * TILE * BLOCK; /* in values */
            const uint16_t *wb = wide, *xb = parts + b * 3 * PAIR * BLOCK;
            if (prefetch && b + 1 < blocks)
                for (long i = 0; i < 2 * TILE * BLOCK * size; i += 64)
                    _mm_prefetch((const char *)w->values + (at + 2 * TILE * BLOCK) * size + i, _MM_HINT_T1);
            if (w->narrow) {
                const int8_t *q = (const int8_t *)w->values + at;
                for (int i = 0; i < 2 * TILE * BLOCK; i += 64) { /* a k-quad: two k-pairs, less 128 */
                    const __m512i quad = _mm512_loadu_si512(q + i);
                    const __m512i pairs = _mm512_xor_si512(_mm512_permutexvar_epi8(quad_pairs, quad),
                                                           _mm512_set1_epi8((char)0x80));
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = h ? _mm512_extracti64x4_epi64(pairs, 1) : _mm512_castsi512_si256(pairs);
                        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
                        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
                        _mm512_store_si512((__m512i *)(wide + i + 32 * h), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                    }
                }
            } else
                wb = (const uint16_t *)w->values + at;
            /* One weight tile at a time: its sums are stored while the other one's products run. */
            for (int t = 0; t < 2; t++) {
                _tile_loadd(4, wb + t * TILE * BLOCK, 64);
                _tile_zero(0);
                _tile_zero(1);
                for (int part = 0; part < 3; part++) {
                    const uint16_t *a = xb + part * PAIR * BLOCK;
                    _tile_loadd(6, a, 64);
                    _tile_dpbf16ps(0, 6, 4);
                    if (rows == PAIR) {
                        _tile_loadd(7, a + TILE * BLOCK, 64);
                        _tile_dpbf16ps(1, 7, 4);
                    }
                }
                /* sums[g]: [t][m][16], m the row */
                _tile_stored(0, sums[g] + t * PAIR * TILE, 64);
                if (rows == PAIR)
                    _tile_stored(1, sums[g] + t * PAIR * TILE + TILE * TILE, 64);
            }
        }
        for (int t = 0; t < 2; t++) {
            __m512 scale[GROUP], offset[GROUP];
            for (int g = 0; g < group; g++) {
                const long at = (p * blocks + g0 + g) * PAIR + t * TILE;
                scale[g] = _mm512_loadu_ps(w->scales + at);
                offset[g] = w->offsets ? _mm512_loadu_ps(w->offsets + at) : _mm512_setzero_ps();
            }
            for (int m = 0; m < rows; m++) {
                __m512 a = _mm512_setzero_ps(); /* the group's part: added to acc once, not block by block */
                for (int g = 0; g < group; g++) {
                    a = _mm512_fmadd_ps(_mm512_load_ps(sums[g] + (t * PAIR + m) * TILE), scale[g], a);
                    if (w->offsets)
                        a = _mm512_fmadd_ps(_mm512_set1_ps(xsums[m * blocks + g0 + g]), offset[g], a);
                }
                _mm512_store_ps(acc[t][m], _mm512_add_ps(_mm512_load_ps(acc[t][m]), a));
            }
        }
    }
    for (int t = 0; t < 2; t++) {
        const long n0 = p * PAIR + t * TILE;
        if (n0 >= N)
            break;
        const __mmask16 lanes = N - n0 >= TILE ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(lanes, bias + n0) : _mm512_setzero_ps();
        for (int m = 0; m < rows && m0 + m < M; m++)
            _mm512_mask_storeu_ps(out + (m0 + m) * N + n0, lanes, _mm512_add_ps(_mm512_load_ps(acc[t][m]), add));
    }
}

/* out = x @ w^T + bias on AMX (slotserve_amx_gemm's calls of more than FEW rows, or of a bfloat16 packing).
   Returns 0, or -1 where the scratch buffers could not be allocated. Rows go outermost: a thread's 32 rows
   stay in its cache while the weight streams past them. A call of at least TILES_PER_THREAD row tiles a
   thread (a prefill) gives each thread whole row tiles, split where they are used, in its own L2; fewer (a
   decode step) are split first and the threads share out the weight pairs of each. Against a pass that
   splits every row first (through DRAM), same bits, 512 rows of the default model's shapes, 2 threads: down
   1.18-1.24x, qkv 1.14x, gate/up 0.97-1.15x. */
static int tile_gemm(const float *x, const slotserve_amx_weight *w, const float *bias, float *out, long M, long N,
                     long K, int threads) {
    const long tiles = (M + PAIR - 1) / PAIR, pairs = (N + PAIR - 1) / PAIR, blocks = K / BLOCK;
    const int by_tile = tiles >= TILES_PER_THREAD * threads;
    const long parts_stride = 3 * PAIR * K, sums_stride = PAIR * blocks; /* a row tile's; 64-byte multiples */
    const long buffers = by_tile ? threads : tiles; /* one per thread, or one per row tile */
    uint16_t *parts = aligned_alloc(64, (size_t)(parts_stride * buffers) * sizeof(uint16_t));
    float *xsums = w->offsets ? malloc((size_t)(sums_stride * buffers) * sizeof(float)) : NULL;
    if (!parts || (w->offsets && !xsums)) {
        free(parts);
        free(xsums);
        return -1;
    }
    if (!by_tile) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long t = 0; t < tiles; t++)
            split_tile(x, M, K, t * PAIR, parts + t * parts_stride, xsums ? xsums + t * sums_stride : NULL);
    }
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        if (by_tile) {
            uint16_t *mine = parts + omp_get_thread_num() * parts_stride;
            float *my_sums = xsums ? xsums + omp_get_thread_num() * sums_stride : NULL;
#pragma omp for schedule(dynamic, 1)
            for (long t = 0; t < tiles; t++) {
                split_tile(x, M, K, t * PAIR, mine, my_sums);
                for (long p = 0; p < pairs; p++) pair_rows(mine, my_sums, w, bias, out, M, N, K, p, t * PAIR, 0);
            }
        } else {
#pragma omp for schedule(dynamic, 2) collapse(2)
            for (long t = 0; t < tiles; t++)
                for (long p = 0; p < pairs; p++)
                    pair_rows(parts + t * parts_stride, xsums ? xsums + t * sums_stride : NULL, w, bias, out, M, N,
                              K, p, t * PAIR, tiles == 1);
        }
        _tile_release();
    }
    free(parts);
    free(xsums);
    return 0;
}
#else
int slotserve_amx_init(void) { return -1; }

static int tile_gemm(const float *x, const slotserve_amx_weight *w, const float *bias, float *out, long M, long N,
                     long K, int threads) {
    (void)x, (void)w, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return -2;
}
#endif

/* out = x @ w^T + bias with w packed by slotserve_amx_pack; bias may be NULL: a narrow packing's 1..FEW rows
   on the vector units, other calls on AMX. Returns 0; -1 where a scratch buffer could not be allocated, -2 for
   a call only AMX runs where it is not, or for more than FEW rows of a packing in halves (AMX sums whole blocks). */
int slotserve_amx_gemm(const float *x, const slotserve_amx_weight *w, const float *bias, float *out, long M, long N,
                       long K, int threads) {
    if (M <= 0)
        return 0;
    if (w->narrow && M <= FEW)
        return few_rows_gemm(x, w, bias, out, M, N, K, threads);
    return w->halves ? -2 : tile_gemm(x, w, bias, out, M, N, K, threads);
}
