/* The few-row kernel: calls of 1..FEW rows of a narrow packing (amx_gemm.c's int8 values under a scale, and
   an offset or not, per block of 32, or per half block: `halves`) on the vector units, on any CPU.

   At batch 1 a step streams every weight once, and how many cache lines each core keeps in flight bounds
   it: the fewer vector operations a line costs, the more are in flight (the float32 kernel spends one
   multiply-add a line and streams at 0.93 of the machine's read rate). Converting every int8 weight to
   float and multiplying it (3 operations per 16 weights and row) made 0.68-0.74 of it. Here the products
   are integers: the weights widened to 16 bits once for all rows, then two 16-bit pair multiply-adds
   (AVX512-VNNI's `vpdpwssd`; `vpmaddwd` and an add without it) per 32 weights and row: 1.6x the rate from
   L2 and 0.74-0.80 of the read rate in `bench kernels` (alternated with the conversion: 0.70-0.73).

   - Each row's x is written, per block of 32, as integers times a power of two, X = x * 2^q, q the largest
     that keeps every |X| within 2^30: exact where the block's values lie within 6 binary orders of its
     largest, else rounded to the nearest integer (2^-30 of that largest); X = hi * 2^16 + lo, each 16 bits.
   - Per block (or half block) and output, S = the sum of v * X, exact in 32-bit integers (|v| <= 128), is
     made float as hi's sum * 2^16 + lo's; the block's scale * S (+ offset * the sum of X) times 2^-q is
     added to a sum of GROUP_BLOCKS blocks, and those sums to the output. Against float64, on the default
     model's shapes: 0.33-0.82x a float32 GEMM's largest error (the converting kernel: 0.57-1.2x).

   A block with an infinite or NaN x gives NaN, as float32 arithmetic would; one whose largest |x| is under
   2^-97 keeps fewer bits (2^-q must stay a normal float). The sums of products are integers and the rest
   the same float operations lane by lane, so every build (AVX-512, AVX2, plain C) gives the same bits, and
   a row's bits do not depend on the other rows of its call. */

#include <stdint.h>
#include <stdlib.h>

#include "vector.h"

#define FEW 4 /* the most rows few_rows takes: its accumulators stay in registers */
#define FEW_AHEAD 16384 /* bytes: how far ahead few_rows fetches its weights */
#define OUT_VECTORS (TILE / VW) /* vectors of one weight tile's outputs */
#define TILES_AT_ONCE (VW == 16 ? 2 : 1) /* weight tiles a pass over the blocks takes: AVX2's 16 registers hold one */
#define X_BITS 30                        /* |X| <= 2^X_BITS */
/* Sums of one row kept side by side (every other k-pair): a single row's multiply-adds would otherwise
   wait on each other's latency; more rows are independent sums already. */
#define CHAINS 2
#define GROUP_BLOCKS 8 /* blocks summed apart before they join the output's sum: fewer roundings in a row */

/* A row's x as integers (split_row): hi and lo [K] (X = hi * 2^16 + lo), and per block of 32 the unit
   2^-q and the sums of X over each half and over the whole block ([blocks][3], as floats). */
typedef struct {
    int16_t *hi, *lo;
    float *unit, *sums;
} split_x;

typedef short vs __attribute__((vector_size(VW * sizeof(short))));

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

/* x's K values (K a multiple of BLOCK) into s; the sums of X only `with_sums` (offsets need them). */
static void split_row(const float *x, long K, split_x s, int with_sums) {
    for (long b = 0; b < K / BLOCK; b++) {
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
        vi his[2] = {{0}}, los[2] = {{0}}; /* each half's hi and lo, summed lane by lane (under 2^20) */
        for (int j = 0; j < BLOCK; j += VW) {
            const vi X = round_ints(load(xb + j) * up);
            const vi hi = (X + 32768) >> 16, lo = X - (hi << 16);
            const vs h = __builtin_convertvector(hi, vs), l = __builtin_convertvector(lo, vs);
            memcpy(s.hi + b * BLOCK + j, &h, sizeof h);
            memcpy(s.lo + b * BLOCK + j, &l, sizeof l);
            his[j / (BLOCK / 2)] += hi;
            los[j / (BLOCK / 2)] += lo;
        }
        if (with_sums) {
            const long long half[2] = {(long long)sum_lanes(his[0]) * 65536 + sum_lanes(los[0]),
                                       (long long)sum_lanes(his[1]) * 65536 + sum_lanes(los[1])};
            s.sums[3 * b] = (float)half[0];
            s.sums[3 * b + 1] = (float)half[1];
            s.sums[3 * b + 2] = (float)(half[0] + half[1]);
        }
    }
}

/* VW outputs' two int8 weights of one k-pair (2 * VW bytes at p, the tiles' layout), widened to 16 bits:
   each 32-bit lane one output's pair. */
static inline vi widen_pairs(const int8_t *p) {
#if VW == 16
    return (vi)_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
#else
    int16_t wide[2 * VW];
    for (int i = 0; i < 2 * VW; i++) wide[i] = p[i];
    vi v;
    memcpy(&v, wide, sizeof v);
    return v;
#endif
}

/* acc + each lane's pair of 16-bit weights times the pair of 16-bit x halves at x (exact in 32 bits). */
static inline vi dot_pairs(vi acc, vi w, const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
#if VW == 16 && defined(__AVX512VNNI__)
    return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(pair));
#elif VW == 16
    return acc + (vi)_mm512_madd_epi16((__m512i)w, _mm512_set1_epi32(pair));
#elif defined(__AVXVNNI__)
    return (vi)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(pair));
#elif defined(__AVX2__)
    return acc + (vi)_mm256_madd_epi16((__m256i)w, _mm256_set1_epi32(pair));
#else
    for (int i = 0; i < VW; i++)
        acc[i] += (int16_t)(w[i] & 0xffff) * x[0] + (int16_t)((uint32_t)w[i] >> 16) * x[1];
    return acc;
#endif
}

/* The rows of x (split: xs) against pair p of a narrow weight. */
static inline void few_rows(const split_x *xs, const slotserve_amx_weight *w, const float *bias, float *out, long N,
                            long K, long p, const int rows, const int segments) {
    const long blocks = K / BLOCK;
    const int pairs_per_segment = BLOCK / 2 / segments; /* k-pairs under one scale */
    for (int t0 = 0; t0 < 2; t0 += TILES_AT_ONCE) {
        vf acc[FEW][TILES_AT_ONCE][OUT_VECTORS], group[FEW][TILES_AT_ONCE][OUT_VECTORS];
        for (int m = 0; m < rows; m++)
            for (int t = 0; t < TILES_AT_ONCE; t++)
                for (int o = 0; o < OUT_VECTORS; o++) acc[m][t][o] = group[m][t][o] = splat(0.0f);
        for (long b = 0; b < blocks; b++) {
            const int8_t *q = (const int8_t *)w->values + (p * blocks + b) * 2 * TILE * BLOCK;
            for (int i = 0; i < 2 * TILE * BLOCK; i += 64) __builtin_prefetch(q + FEW_AHEAD + i, 0, 2);
            for (int seg = 0; seg < segments; seg++) {
                vi hi[FEW][TILES_AT_ONCE][OUT_VECTORS][CHAINS], lo[FEW][TILES_AT_ONCE][OUT_VECTORS][CHAINS];
                for (int m = 0; m < rows; m++)
                    for (int t = 0; t < TILES_AT_ONCE; t++)
                        for (int o = 0; o < OUT_VECTORS; o++)
                            for (int c = 0; c < CHAINS; c++) hi[m][t][o][c] = lo[m][t][o][c] = (vi){0};
                for (int kp0 = seg * pairs_per_segment; kp0 < (seg + 1) * pairs_per_segment; kp0 += CHAINS)
#pragma GCC unroll 2
                    for (int chain = 0; chain < CHAINS; chain++) {
                        const int kp = kp0 + chain, c = rows == 1 ? chain : 0;
                        for (int t = 0; t < TILES_AT_ONCE; t++)
                            for (int o = 0; o < OUT_VECTORS; o++) {
                                const vi wv = widen_pairs(q + (t0 + t) * TILE * BLOCK + kp * 2 * TILE + o * 2 * VW);
                                for (int m = 0; m < rows; m++) {
                                    const long k = b * BLOCK + 2 * kp;
                                    hi[m][t][o][c] = dot_pairs(hi[m][t][o][c], wv, xs[m].hi + k);
                                    lo[m][t][o][c] = dot_pairs(lo[m][t][o][c], wv, xs[m].lo + k);
                                }
                            }
                    }
                const long at = ((p * blocks + b) * segments + seg) * PAIR;
                const int part = segments > 1 ? seg : 2; /* which of split_x's sums */
                for (int t = 0; t < TILES_AT_ONCE; t++)
                    for (int o = 0; o < OUT_VECTORS; o++) {
                        const long col = at + (t0 + t) * TILE + o * VW; /* of the first output's scale */
                        const vf scale = load(w->scales + col);
                        for (int m = 0; m < rows; m++) {
                            vi h = hi[m][t][o][0], l = lo[m][t][o][0];
                            for (int ch = 1; ch < (rows == 1 ? CHAINS : 1); ch++)
                                h += hi[m][t][o][ch], l += lo[m][t][o][ch];
                            const vf s = fmadd(__builtin_convertvector(h, vf), splat(65536.0f),
                                               __builtin_convertvector(l, vf));
                            if (w->offsets) {
                                const vf sum_x = splat(xs[m].sums[3 * b + part]);
                                const vf r = fmadd(s, scale, load(w->offsets + col) * sum_x);
                                group[m][t][o] = fmadd(r, splat(xs[m].unit[b]), group[m][t][o]);
                            } else {
                                group[m][t][o] = fmadd(s, scale * splat(xs[m].unit[b]), group[m][t][o]);
                            }
                        }
                    }
            }
            if (b % GROUP_BLOCKS == GROUP_BLOCKS - 1 || b == blocks - 1)
                for (int m = 0; m < rows; m++)
                    for (int t = 0; t < TILES_AT_ONCE; t++)
                        for (int o = 0; o < OUT_VECTORS; o++) {
                            acc[m][t][o] += group[m][t][o];
                            group[m][t][o] = splat(0.0f);
                        }
        }
        for (int t = 0; t < TILES_AT_ONCE; t++)
            for (int o = 0; o < OUT_VECTORS; o++) {
                const long n0 = p * PAIR + (t0 + t) * TILE + o * VW;
                const long n = N - n0 < VW ? N - n0 : VW; /* outputs here */
                for (int m = 0; m < rows && n > 0; m++)
                    for (long i = 0; i < n; i++) out[m * N + n0 + i] = acc[m][t][o][i] + (bias ? bias[n0 + i] : 0.0f);
            }
    }
}

/* out = x @ w^T + bias for a narrow weight and at most FEW rows, where this beats AMX's fixed work per tile
   of rows (a tile of 16 rows however few are real), and where there is no AMX. One thread's byte loads
   alone keep too few lines in flight to stream DRAM: fetching each block FEW_AHEAD bytes ahead into L2
   measured 1.6-1.7x on 1 row and 1.3x on 4 with the converting kernel (4-32 KB ahead alike; 8-64 KB alike
   with this one). Guided: each thread streams long runs of
   pairs first, then shrinking ones, so the thread held up (by the other tenants' memory traffic, say) is
   not waited for at the end: batch-1 decode steps 1.00-1.05x against a static split (median 1.01, steps
   interleaved); dynamic runs of 4-16 pairs 0.89-1.01x (each run's prefetches fall in the next pairs, which
   the other thread may take). A pair's bits are the same on any thread. Returns 0, or -1 without memory for
   the split rows. */
static int few_rows_gemm(const float *x, const slotserve_amx_weight *w, const float *bias, float *out, long M,
                         long N, long K, int threads) {
    const long pairs = (N + PAIR - 1) / PAIR, blocks = K / BLOCK;
    /* each row's hi and lo halves, then its units and sums (4 floats a block): 4-byte aligned throughout */
    int16_t *halves = malloc((size_t)(2 * M * K) * sizeof(int16_t) + (size_t)(4 * M * blocks) * sizeof(float));
    if (!halves)
        return -1;
    float *units = (float *)(halves + 2 * M * K), *sums = units + M * blocks;
    split_x xs[FEW];
    for (long m = 0; m < M; m++) {
        xs[m] = (split_x){halves + 2 * m * K, halves + (2 * m + 1) * K, units + m * blocks, sums + 3 * m * blocks};
        split_row(x + m * K, K, xs[m], w->offsets != NULL);
    }
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (long p = 0; p < pairs; p++)
        switch (M * 2 + w->halves) { /* constant row and segment counts: the accumulators stay in registers */
        case 2: few_rows(xs, w, bias, out, N, K, p, 1, 1); break;
        case 3: few_rows(xs, w, bias, out, N, K, p, 1, 2); break;
        case 4: few_rows(xs, w, bias, out, N, K, p, 2, 1); break;
        case 5: few_rows(xs, w, bias, out, N, K, p, 2, 2); break;
        case 6: few_rows(xs, w, bias, out, N, K, p, 3, 1); break;
        case 7: few_rows(xs, w, bias, out, N, K, p, 3, 2); break;
        case 8: few_rows(xs, w, bias, out, N, K, p, FEW, 1); break;
        default: few_rows(xs, w, bias, out, N, K, p, FEW, 2);
        }
    free(halves);
    return 0;
}
