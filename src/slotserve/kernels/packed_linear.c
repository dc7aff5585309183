/* Packs a float32 linear weight for the packed kernels (packed_linear.h: the forms and the layout), exactly:
   scale * v (+ offset) per block is the weight, bit for bit, or the weight does not pack.

   Most float32 weights of a quantized or low-precision checkpoint have such a form in each block of 32 along
   a row, with v bfloat16 values: GGUF's Q8_0/Q5_0/Q4_0 blocks (an fp16 scale times small integers) and
   bfloat16 checkpoints (scale 1) without an offset, Q4_K/Q5_K blocks (a scale and a minimum) with one. Where
   every block's values are a power of two times integers in [-128, 127] (GGUF's integer blocks: the power goes
   into the scale) they are kept in a byte each (`narrow`), else in 2, as bfloat16; the kernels' products and
   sums are the same either way.

   Values of two bfloat16 parts (Q6_K's per-16 scales under a per-block one, float16 checkpoints) would be
   exact too, but they stream 4 bytes a value like float32 and cost AMX twice the tile products: measured no
   faster on decode steps and 0.72-0.76x of oneDNN's float32 GEMM on 1024-row prefills, so not taken. Q6_K's
   blocks are integers under a scale per half block, though: packed so (`halves`, int8), they serve
   few_rows.c's calls only, at a third of the float32 bytes (12 of the default model's 24 down projections).

   Plain C (AVX-512 where it is there, for the fitting): it runs on any CPU the kernels build on. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed_linear.h"
#include "vector.h"

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
   divisor takes Euclid's loop), both rare in GGUF's blocks. With integer_fit's vectors the default model
   packs about 2.7x as fast as with the scalar loop alone. */
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
int slotserve_pack_weight(const float *w, long N, long K, float *offsets, void *values, float *scales, int narrow,
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

/* Row n's value at column k of block b of a narrow packing, plus its zero (packed_linear.h's layouts). */
static int narrow_value(const slotserve_packed_weight *w, long blocks, long n, long b, int k) {
    const uint8_t *chunk = (const uint8_t *)w->values + (n / PAIR * blocks + b) * chunk_bytes(w->bits);
    const int t = (int)(n % PAIR / TILE), col = (int)(n % TILE), kq = k / 4;
    const int at = t * TILE * BLOCK + (kq * TILE + col) * 4 + k % 4; /* its byte in the 8-bit layout */
    if (w->bits == 8)
        return chunk[at];
    const int nibble = chunk[t * TILE * BLOCK / 2 + (kq / 2 * TILE + col) * 4 + k % 4] >> (kq % 2 * 4) & 15;
    const uint8_t *plane = chunk + TILE * BLOCK;
    const int fifth = w->bits >= 5 ? (plane[at / 8] >> (at % 8) & 1) << 4 : 0;
    return nibble | fifth | (w->bits == 6 ? (plane[2 * TILE * BLOCK / 8 + at / 8] >> (at % 8) & 1) << 5 : 0);
}

/* out[i][k] = the weight's row ids[i], column k, as float32: the rows an embedding looks up. Narrow packings
   only (-2 else); ids must be within the weight's rows. Returns 0. */
int slotserve_unpack_rows(const slotserve_packed_weight *w, long K, const long *ids, long count, float *out,
                          int threads) {
    if (!w->narrow)
        return -2;
    const long blocks = K / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (count * K > 65536)
    for (long i = 0; i < count; i++)
        for (long b = 0; b < blocks; b++) {
            for (int h = 0; h < (w->halves ? 2 : 1); h++) {
                const long p = ids[i] / PAIR, segments = w->halves ? 2 : 1;
                const int col = (int)(ids[i] % PAIR);
                const float scale = block_scale(w->scales, w->scale_factors, w->scale_code_bytes, p, blocks, b,
                                                segments, h, col);
                const float offset = w->offsets ? block_scale(w->offsets, w->offset_factors, w->offset_code_bytes, p,
                                                              blocks, b, segments, h, col)
                                                : 0.0f;
                const int len = w->halves ? BLOCK / 2 : BLOCK;
                for (int k = h * len; k < (h + 1) * len; k++)
                    out[i * K + b * BLOCK + k] = fmaf(scale, (float)(narrow_value(w, blocks, ids[i], b, k) - w->zero),
                                                      offset);
            }
        }
    return 0;
}

/* Float32 bits to bfloat16 ones, rounded to the nearest (ties to even). */
static inline vi bf16_bits(vf f) {
    const vi u = (vi)f;
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

typedef unsigned short vu16 __attribute__((vector_size(VW * sizeof(unsigned short))));

/* The weight's pairs [first, first + count) transposed into a panel that x multiplies: out[k][j] = the weight's
   row first * PAIR + j, column k, ld values (float32, or bfloat16 where `bf16`) a row of out, ld >= count * PAIR;
   rows past N are zeros. scale * v + offset is each weight exactly (packed so), so a float32 panel holds the
   weights, a bfloat16 one the weights rounded to the nearest. Narrow packings only (-2 else). Returns 0. */
int slotserve_unpack_panel(const slotserve_packed_weight *w, long K, long first, long count, void *out, long ld,
                           int bf16, int threads) {
    if (!w->narrow)
        return -2;
    const long blocks = K / BLOCK;
    const int segments = w->halves ? 2 : 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (long p = first; p < first + count; p++)
        for (long b = 0; b < blocks; b++) {
            const uint8_t *chunk = (const uint8_t *)w->values + (p * blocks + b) * chunk_bytes(w->bits);
            for (int t = 0; t < 2; t++)
                for (int half = 0; half < TILE / VW; half++) { /* VW rows of the tile at a time */
                    const int row = t * TILE + half * VW; /* in the pair */
                    const long column = (p - first) * PAIR + row;
                    for (int kq = 0; kq < BLOCK / 4; kq++) {
                        const int seg = segments == 2 ? kq / 4 : 0;
                        const vf scale = weight_scales(w, p, blocks, b, segments, seg, row);
                        const vf offset = w->offsets ? weight_offsets(w, p, blocks, b, segments, seg, row)
                                                     : splat(0.0f);
                        const vi quads = quad_line(chunk, w->bits, t, kq, half); /* a lane: a row's 4 values */
                        for (int j = 0; j < 4; j++) {
                            const vf v = __builtin_convertvector(((quads >> (8 * j)) & 0xff) - w->zero, vf);
                            const vf x = fmadd(scale, v, offset);
                            const long k = b * BLOCK + 4 * kq + j;
                            if (bf16) {
                                const vu16 h = __builtin_convertvector(bf16_bits(x), vu16);
                                memcpy((uint16_t *)out + k * ld + column, &h, sizeof h);
                            } else {
                                memcpy((float *)out + k * ld + column, &x, sizeof x);
                            }
                        }
                    }
                }
        }
    return 0;
}
