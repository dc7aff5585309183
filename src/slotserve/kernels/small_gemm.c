/* A float32 GEMM for the few rows of a CPU decode step: out[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]).

   With 4..64 rows, BLAS libraries copy ("pack") every weight into their own panel layout on each call
   and then read it again: three passes over weights that do not fit in any cache, where one would do.
   This file reads each weight once, straight from the row-major [N][K] layout of a checkpoint, in one
   of two ways. The threads take the weight rows ~48 at a time as they come free: on a shared machine one
   core often runs slower than the other, and a static split waits for it at every call. Which thread
   computes a row changes none of its bits.

   - Few rows (M <= DOT_ROWS): dot products. A tile of weight rows and batch rows keeps one vector
     accumulator per pair, each step loads a vector of every weight row and of every batch row, and the
     lanes are summed at the end. Each weight row is one sequential stream.
   - More rows: broadcasts. x is transposed once per call into xt[K][Mp] (Mp: M rounded up to the vector
     width, zero-padded) so that one vector holds one k for VW consecutive batch rows; a tile of nb
     weight rows x mv such vectors keeps nb*mv accumulators, and for each k broadcasts nb weights, one
     fused multiply-add per accumulator: fewer instructions per weight than dot products from DOT_ROWS + 1
     rows on. Where the batch has more vectors than a tile holds, a tile's rows meet them block by block,
     streamed from memory for the first block and read from L1 or L2 for the others.

   Either way an output element's sum runs in an order fixed by K alone, whatever M is and wherever the
   row sits in the batch: a row's result is bitwise the same in any batch of 1..DOT_ROWS rows, and in
   any batch of DOT_ROWS+1..64.

   Tile shapes follow the vector width (vector.h): 32 registers with AVX-512, else 16. */

#include <stdlib.h>
#include <string.h>

#include "vector.h"

/* A broadcast tile of nb weight rows and mv batch vectors holds nb * mv accumulators (at most ACC), the mv
   batch vectors and one broadcast weight in registers: at most 16 with AVX2 (12 + 3 + 1) and 32 with
   AVX-512 (24 + 4 + 1). One register more and GCC reads the batch vectors from memory in every multiply-
   add instead (seen with 12 + 4 + 1 on AVX2: 1.15-1.25x slower at 32 rows). */
#if defined(__AVX512F__)
#define ACC 24
#define MV_MAX 4
#define DOT_NB 4
#define DOT_MB 6
#else
#define ACC 12
#define MV_MAX 3
#define DOT_NB 3
#define DOT_MB 4
#endif
#define XT_BLOCK 65536 /* floats of xt per block of K */
#define DOT_ROWS 11 /* the crossover measured on the default model's weights: 12 rows ran even */

/* ---- few rows: dot products ---- */

/* out[m0..m0+mb][n0..n0+nb], each a dot product over K: vector lanes, then the lanes and the tail. The
   next block's rows (contiguous with these) are fetched into L2 meanwhile: the hardware alone left the
   weight streams waiting on memory (with the fetches, up to 1.31x faster on the default model's weights). */
static inline __attribute__((always_inline)) void dot_tile(const int nb, const int mb, const float *restrict x,
                                                           const float *restrict w, const float *restrict bias,
                                                           float *restrict out, long N, long K, long m0, long n0) {
    vf acc[DOT_NB * DOT_MB];
#pragma GCC unroll 24
    for (int a = 0; a < nb * mb; a++) acc[a] = (vf){0};
    const long kv = K / VW * VW;
    const float *wn = w + n0 * K, *xm = x + m0 * K, *next = wn + nb * K;
    for (long k = 0; k < kv; k += VW) {
        __builtin_prefetch(next + k * nb, 0, 2);
        __builtin_prefetch(next + k * nb + 16, 0, 2);
        vf wv[DOT_NB];
#pragma GCC unroll 8
        for (int i = 0; i < nb; i++) wv[i] = load(wn + i * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) {
            const vf xv = load(xm + j * K + k);
#pragma GCC unroll 8
            for (int i = 0; i < nb; i++) acc[i * mb + j] = fmadd(wv[i], xv, acc[i * mb + j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float sum = hsum(acc[i * mb + j]);
            for (long k = kv; k < K; k++) sum += wn[i * K + k] * xm[j * K + k];
            out[(m0 + j) * N + n0 + i] = sum + (bias ? bias[n0 + i] : 0.0f);
        }
}

/* All batch rows against the weight rows of one block (the last block may be short). */
#define DOT_ROWS_CASE(MB)                                                                           \
    case MB:                                                                                        \
        if (full)                                                                                   \
            dot_tile(DOT_NB, MB, x, w, bias, out, N, K, m0, n0);                                    \
        else                                                                                        \
            for (long n = n0; n < N; n++) dot_tile(1, MB, x, w, bias, out, N, K, m0, n);            \
        break;

static void dot_block(const float *x, const float *w, const float *bias, float *out, long M, long N, long K,
                      long block) {
    const long n0 = block * DOT_NB;
    const int full = n0 + DOT_NB <= N;
    for (long m0 = 0; m0 < M; m0 += DOT_MB) {
        switch (M - m0 < DOT_MB ? M - m0 : DOT_MB) {
            DOT_ROWS_CASE(1)
            DOT_ROWS_CASE(2)
            DOT_ROWS_CASE(3)
            DOT_ROWS_CASE(4)
#if DOT_MB > 4
            DOT_ROWS_CASE(5)
            DOT_ROWS_CASE(6)
#endif
        }
    }
}

/* ---- more rows: broadcasts ---- */

/* One product of the broadcast form: xt is x transposed ([K][Mp]); part holds [N][Mp] partial sums
   between blocks of K. */
typedef struct {
    const float *w, *xt, *bias;
    float *out, *part;
    long M, Mp, N, K;
} Gemm;

/* One tile: rows n0..n0+nb of w against the mv batch vectors of xt from column m0, over k in [k0, k1).
   The accumulators start from the partial sums of the blocks before (zero in the first) and go back
   there, or with the bias into `out` after the last block: stored and reloaded as float32, each sum
   still runs k = 0, 1, ..., K-1 in one accumulator, so blocking K changes no bits. Called with constant
   nb and mv, so the compiler unrolls both loops and keeps `acc` in registers. Each step fetches the line
   at pf into L2 and moves pf on by pstep bytes (rows() aims it at the next tile's rows). A per-step
   computed row and column instead measured 1.1x slower: the integer work competes with the loop's own. */
static inline __attribute__((always_inline)) void tile(const int nb, const int mv, const Gemm *g, long n0,
                                                       long m0, long k0, long k1, const char *pf, long pstep) {
    const long K = g->K, Mp = g->Mp;
    vf acc[ACC];
    float *part = g->part + n0 * Mp + m0;
#pragma GCC unroll 24
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 4
        for (int j = 0; j < mv; j++) acc[i * mv + j] = k0 ? load(part + i * Mp + j * VW) : (vf){0};
    const float *restrict wr = g->w + n0 * K;
    const float *restrict xk = g->xt + k0 * Mp + m0;
    for (long k = k0; k < k1; k++, xk += Mp, pf += pstep) {
        __builtin_prefetch(pf, 0, 2);
        vf xv[MV_MAX];
#pragma GCC unroll 4
        for (int j = 0; j < mv; j++) xv[j] = load(xk + j * VW);
#pragma GCC unroll 24
        for (int i = 0; i < nb; i++) {
            const vf wb = splat(wr[i * K + k]);
#pragma GCC unroll 4
            for (int j = 0; j < mv; j++) acc[i * mv + j] = fmadd(wb, xv[j], acc[i * mv + j]);
        }
    }
    if (k1 < K) {
#pragma GCC unroll 24
        for (int i = 0; i < nb; i++)
#pragma GCC unroll 4
            for (int j = 0; j < mv; j++) store(part + i * Mp + j * VW, acc[i * mv + j]);
        return;
    }
    for (int i = 0; i < nb; i++) {
        const float b = g->bias ? g->bias[n0 + i] : 0.0f;
        for (int j = 0; j < mv; j++)
            for (int l = 0; l < VW; l++) {
                const long m = m0 + j * VW + l;
                if (m < g->M) g->out[m * g->N + n0 + i] = acc[i * mv + j][l] + b;
            }
    }
}

/* The batch's vectors in blocks: all in one block up to MV_MAX, else blocks of two after a first block of
   three where the count is odd. A tile's weight rows come from memory for the first block and from L1 or
   L2 for the others. */
static int first_block(long vectors) { return vectors <= MV_MAX ? (int)vectors : vectors % 2 ? 3 : 2; }

/* nb weight rows from n0 against every block of batch vectors, over k in [k0, k1). Meanwhile the next
   tile's rows are fetched, as much memory as this block of K spans in each of nb rows (all of those rows
   where K is one block), a share in each batch block. All of it in the first block measured slower (32
   rows, the default model's weights, 2-vCPU AMD EPYC: a decode step's GEMMs at best 227-248 vs 244-277
   ms in 4 runs): the first block's fetches then came at twice the rate, and two cores at once asked
   for more than the memory gives. */
static inline __attribute__((always_inline)) void rows(const int nb, const Gemm *g, long n0, long k0, long k1) {
    const long vectors = g->Mp / VW, f = first_block(vectors), blocks = 1 + (vectors - f) / 2;
    const long share = (k1 - k0) * nb * (long)sizeof(float) / blocks, pstep = nb * (long)sizeof(float) / blocks;
    const char *pf = (const char *)(g->w + (n0 + nb) * g->K + k0);
    for (long m0 = 0; m0 < g->Mp; pf += share) {
        const int mv = m0 ? 2 : (int)f;
#define TILE_CASE(MV)                                                   \
    case MV:                                                            \
        if (nb * MV <= ACC) tile(nb, MV, g, n0, m0, k0, k1, pf, pstep); \
        break;
        switch (mv) {
            TILE_CASE(1)
            TILE_CASE(2)
            TILE_CASE(3)
#if MV_MAX > 3
            TILE_CASE(4)
#endif
        }
#undef TILE_CASE
        m0 += mv * VW;
    }
}

/* The block-th group of nb weight rows (the last group may be short: one row at a time). */
#define ROW_BLOCK(NB)                                                                        \
    static void row_block_##NB(const Gemm *g, long block, long k0, long k1) {                \
        const long n0 = block * NB;                                                          \
        if (n0 + NB <= g->N)                                                                 \
            rows(NB, g, n0, k0, k1);                                                         \
        else                                                                                 \
            for (long n = n0; n < g->N; n++) rows(1, g, n, k0, k1);                          \
    }
typedef void (*row_block_fn)(const Gemm *, long, long, long);

/* By the first block's width mv: ACC / mv weight rows per tile, as many as the accumulators allow. */
#if ACC == 24
ROW_BLOCK(24)
ROW_BLOCK(12)
ROW_BLOCK(8)
ROW_BLOCK(6)
static const row_block_fn ROW_BLOCKS[MV_MAX + 1] = {0, row_block_24, row_block_12, row_block_8, row_block_6};
#else
ROW_BLOCK(12)
ROW_BLOCK(6)
ROW_BLOCK(4)
static const row_block_fn ROW_BLOCKS[MV_MAX + 1] = {0, row_block_12, row_block_6, row_block_4};
#endif

/* out[M][N] = x[M][K] @ w[N][K]^T + bias (bias may be NULL); all row-major and contiguous. Returns 0,
   or -1 if the scratch buffer could not be allocated. */
int slotserve_small_gemm(const float *x, const float *w, const float *bias, float *out, long M, long N, long K,
                         int threads) {
    if (M <= DOT_ROWS) {
        const long blocks = (N + DOT_NB - 1) / DOT_NB;
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
        for (long block = 0; block < blocks; block++) dot_block(x, w, bias, out, M, N, K, block);
        return 0;
    }
    const long Mp = (M + VW - 1) / VW * VW;
    /* K in blocks whose part of xt fits in half of L2 (256 KB); one block for the default model's K of
       896 up to 64 rows, 3 for its 4864 at 32 rows: xt whole would come from L3 for every tile. */
    const long kc = (XT_BLOCK / Mp + 15) / 16 * 16;
    float *xt = aligned_alloc(64, ((size_t)(K * Mp) * sizeof(float) + 63) / 64 * 64);
    float *part = kc < K ? aligned_alloc(64, ((size_t)(N * Mp) * sizeof(float) + 63) / 64 * 64) : NULL;
    if (!xt || (kc < K && !part)) {
        free(xt);
        free(part);
        return -1;
    }
    const Gemm g = {w, xt, bias, out, part, M, Mp, N, K};
    const int mv = first_block(Mp / VW), nb = ACC / mv;
    const row_block_fn row_block = ROW_BLOCKS[mv];
    const long blocks = (N + nb - 1) / nb;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long k = 0; k < K; k++) {
            float *row = xt + k * Mp;
            for (long m = 0; m < M; m++) row[m] = x[m * K + k];
            for (long m = M; m < Mp; m++) row[m] = 0.0f;
        }
        /* a barrier between blocks of K: the next block's tiles continue partial sums other threads wrote */
        for (long k0 = 0; k0 < K; k0 += kc) {
#pragma omp for schedule(dynamic, 8)
            for (long b = 0; b < blocks; b++) row_block(&g, b, k0, k0 + kc < K ? k0 + kc : K);
        }
    }
    free(xt);
    free(part);
    return 0;
}
