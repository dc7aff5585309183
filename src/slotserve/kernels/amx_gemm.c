/* A float32 linear through AMX, Intel's tile units (Sapphire Rapids and later), with every product exact:
   out[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]), w packed by packed_linear.c (packed_linear.h's layout).

   AMX multiplies bfloat16 tiles and sums the products in float32. Two facts make that a float32 GEMM here:
   - the packed weight is, in each block of 32 along a row, w = scale * v (+ offset) with v bfloat16 values
     (or integers, widened to bfloat16 in L1 as each block is used);
   - a float32 activation is exactly the sum of three bfloat16 parts (8 + 8 + 8 significant bits).
   So each block's sum is three tile products of exact bfloat16 x bfloat16 terms, summed in float32, then
   scaled (plus the offset times the block's sum of x) and added up across blocks with fused multiply-adds:
   the same rounding, term by term, as a float32 GEMM's sums, and measured closer to the float64 result than
   our FMA kernel (small_gemm.c) on the default model's shapes. A narrow packing's integers give the same
   products and sums as their bfloat16 values, so the same bits (but where a bfloat16 value's products would
   be subnormal, which AMX flushes to zero: the integers keep them).

   A row's result depends on that row alone (the batch is cut into tiles of rows, padded with zero rows), so
   its bits are the same in any batch. They are not the bits of the float32 FMA kernels, nor those of
   few_rows.c, which takes a narrow packing's calls of up to FEW rows instead. Built without AMX, the calls
   answer -2 (and slotserve_amx_init -1). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed_linear.h"
#include "vector.h"

#define GROUP 4 /* blocks whose tile sums are scaled together */
#define TILES_PER_THREAD 4 /* row tiles per thread from which each thread splits its own (tile_gemm) */

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
   twice a float32 GEMM's error against float64, where the two levels stay near a float32 GEMM's.
   A block's two weight tiles take turns: a tile store holds up the products behind it unless other tiles
   have products to run, and the turns give them some (1.06-1.12x on 32 rows).
   Where `prefetch` is set (a call of one row tile: a decode step, whose weights come from DRAM once each)
   the next block's weights are fetched into L2 while this one multiplies. With more row tiles the weights
   come from L3 for all but the first, where the same prefetch only costs time, so it is off there.
   A narrow block is widened into `wide` first (its k-quads as k-pairs, less zero): it streams fewer bytes
   than its bfloat16 packing would and runs at least as fast at every row count. */
static void pair_rows(const uint16_t *parts, const float *xsums, const slotserve_packed_weight *w, const float *bias,
                      float *out, long M, long N, long K, long p, long m0, int prefetch) {
    const long blocks = K / BLOCK;
    const int rows = M - m0 > TILE ? PAIR : TILE;
    float sums[GROUP][4 * TILE * TILE] __attribute__((aligned(64)));
    float acc[2][PAIR][TILE] __attribute__((aligned(64)));
    uint16_t wide[2 * TILE * BLOCK] __attribute__((aligned(64))); /* a narrow block as bfloat16 */
    const long chunk = w->narrow ? chunk_bytes(w->bits) : 2 * TILE * BLOCK * 2; /* bytes of a pair's block */
    uint8_t order[64]; /* a k-quad's 64 bytes (16 rows' 4 values) as its two k-pairs' 32 each */
    for (int j = 0; j < 64; j++) order[j] = (uint8_t)(j % 32 / 2 * 4 + j / 32 * 2 + j % 2);
    const __m512i quad_pairs = _mm512_loadu_si512(order);
    memset(acc, 0, sizeof acc);
    for (long g0 = 0; g0 < blocks; g0 += GROUP) {
        const int group = blocks - g0 < GROUP ? blocks - g0 : GROUP;
        for (int g = 0; g < group; g++) {
            const long b = g0 + g;
            const uint8_t *q = (const uint8_t *)w->values + (p * blocks + b) * chunk;
            const uint16_t *wb = wide, *xb = parts + b * 3 * PAIR * BLOCK;
            if (prefetch && b + 1 < blocks)
                for (long i = 0; i < chunk; i += 64) _mm_prefetch((const char *)q + chunk + i, _MM_HINT_T1);
            if (w->narrow) {
                for (int i = 0; i < 2 * TILE * BLOCK; i += 64) { /* a k-quad: two k-pairs, less zero */
                    const __m512i quad = (__m512i)quad_line(q, w->bits, i / (TILE * BLOCK), i % (TILE * BLOCK) / 64, 0);
                    const __m512i pairs = _mm512_sub_epi8(_mm512_permutexvar_epi8(quad_pairs, quad),
                                                          _mm512_set1_epi8((char)w->zero));
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = h ? _mm512_extracti64x4_epi64(pairs, 1) : _mm512_castsi512_si256(pairs);
                        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
                        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
                        _mm512_store_si512((__m512i *)(wide + i + 32 * h), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                    }
                }
            } else
                wb = (const uint16_t *)q;
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
                scale[g] = (__m512)weight_scales(w, p, blocks, g0 + g, 1, 0, t * TILE);
                offset[g] = w->offsets ? (__m512)weight_offsets(w, p, blocks, g0 + g, 1, 0, t * TILE)
                                       : _mm512_setzero_ps();
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

/* out = x @ w^T + bias on AMX. Returns 0, or -1 where the scratch buffers could not be allocated. Rows go
   outermost: a thread's 32 rows stay in its cache while the weight streams past them. A call of at least TILES_PER_THREAD row tiles a
   thread (a prefill) gives each thread whole row tiles, split where they are used, in its own L2; fewer (a
   decode step) are split first and the threads share out the weight pairs of each. Against a pass that
   splits every row first (through DRAM) this gives the same bits, up to 1.24x faster on 512 rows. */
static int tile_gemm(const float *x, const slotserve_packed_weight *w, const float *bias, float *out, long M, long N,
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

static int tile_gemm(const float *x, const slotserve_packed_weight *w, const float *bias, float *out, long M, long N,
                     long K, int threads) {
    (void)x, (void)w, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return -2;
}
#endif

/* out = x @ w^T + bias on AMX, w packed by slotserve_pack_weight, bias may be NULL. Returns 0; -1 where a
   scratch buffer could not be allocated; -2 where AMX does not run here, or for a packing in halves (AMX sums
   whole blocks). */
int slotserve_amx_gemm(const float *x, const slotserve_packed_weight *w, const float *bias, float *out, long M,
                       long N, long K, int threads) {
    if (M <= 0)
        return 0;
    return w->halves ? -2 : tile_gemm(x, w, bias, out, M, N, K, threads);
}
