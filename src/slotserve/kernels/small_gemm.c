/* A float32 GEMM for the few rows of a CPU decode step: out[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]).

   With 4..64 rows, BLAS libraries copy ("pack") every weight into their own panel layout on each call
   and then read it again: three passes over weights that do not fit in any cache, where one would do.
   This file reads each weight once, straight from the row-major [N][K] layout of a checkpoint, in one
   of two ways; the threads split the weight rows, each streaming its own contiguous share.

   - Few rows (M <= DOT_ROWS): dot products. A tile of weight rows and batch rows keeps one vector
     accumulator per pair, each step loads a vector of every weight row and of every batch row, and the
     lanes are summed at the end. Each weight row is one sequential stream: as fast as MKL's
     matrix-vector product at one row, and 1.8x its GEMM at 8.
   - More rows: broadcasts. x is transposed once per call into xt[K][Mp] (Mp: M rounded up to the vector
     width, zero-padded) so that one vector holds one k for VW consecutive batch rows; a tile of NB
     weight rows x MV such vectors keeps NB*MV accumulators, and for each k broadcasts NB weights, one
     fused multiply-add per accumulator. Fewer instructions per weight than dot products from ~12 rows
     on (measured: 172 vs 240 ms for the default model's weights at 32 rows).

   Either way an output element's sum runs in an order fixed by K alone, whatever M is and wherever the
   row sits in the batch: a row's result is bitwise the same in any batch of 1..DOT_ROWS rows, and in
   any batch of DOT_ROWS+1..64.

   Tile shapes follow the vector width (vector.h): 32 registers with AVX-512, else 16. */

#include <stdlib.h>
#include <string.h>

#include "vector.h"

#if defined(__AVX512F__)
#define ACC 24 /* accumulators a tile may hold: 32 registers less the operands in flight */
#define DOT_NB 4
#define DOT_MB 6
#else
#define ACC 12
#define DOT_NB 3
#define DOT_MB 4
#endif
#define MV_MAX 4
#define DOT_ROWS 11 /* the crossover measured on the default model's weights: 12 rows ran even */

/* ---- few rows: dot products ---- */

/* out[m0..m0+mb][n0..n0+nb], each a dot product over K: vector lanes, then the lanes and the tail. */
static inline __attribute__((always_inline)) void dot_tile(const int nb, const int mb, const float *restrict x,
                                                           const float *restrict w, const float *restrict bias,
                                                           float *restrict out, long N, long K, long m0, long n0) {
    vf acc[DOT_NB * DOT_MB];
#pragma GCC unroll 24
    for (int a = 0; a < nb * mb; a++) acc[a] = (vf){0};
    const long kv = K / VW * VW;
    const float *wn = w + n0 * K, *xm = x + m0 * K;
    for (long k = 0; k < kv; k += VW) {
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

/* One tile: rows n0..n0+nb of w against the mv batch vectors of xt starting at column m0. Called with
   constant nb and mv, so the compiler unrolls both loops and keeps `acc` in registers. */
static inline __attribute__((always_inline)) void tile(const int nb, const int mv, const float *restrict w,
                                                       long K, const float *restrict xt, long Mp, long m0,
                                                       const float *restrict bias, float *restrict out,
                                                       long M, long N, long n0) {
    vf acc[ACC];
#pragma GCC unroll 24
    for (int a = 0; a < nb * mv; a++) acc[a] = (vf){0};
    const float *wr = w + n0 * K;
    const float *xk = xt + m0;
    const float *next = wr + nb * K; /* the next tile's rows: contiguous, fetched into L2 meanwhile */
    for (long k = 0; k < K; k++, xk += Mp) {
        __builtin_prefetch(next + k * nb, 0, 2);
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
    for (int i = 0; i < nb; i++) {
        const float b = bias ? bias[n0 + i] : 0.0f;
        for (int j = 0; j < mv; j++)
            for (int l = 0; l < VW; l++) {
                const long m = m0 + j * VW + l;
                if (m < M) out[m * N + n0 + i] = acc[i * mv + j][l] + b;
            }
    }
}

/* The weight rows per tile for mv batch vectors: as many accumulators as the registers allow. */
static int rows_per_tile(int mv) { return ACC / mv; }

#define TILES_FOR(MV)                                                                                  \
    static void tiles_##MV(const float *w, long K, const float *xt, long Mp, long m0, const float *bias, \
                           float *out, long M, long N, long block) {                                   \
        const int nb = ACC / MV;                                                                       \
        const long n0 = block * nb;                                                                    \
        if (n0 + nb <= N) {                                                                            \
            tile(ACC / MV, MV, w, K, xt, Mp, m0, bias, out, M, N, n0);                                 \
        } else {                                                                                       \
            for (long n = n0; n < N; n++) tile(1, MV, w, K, xt, Mp, m0, bias, out, M, N, n);           \
        }                                                                                              \
    }
TILES_FOR(1)
TILES_FOR(2)
TILES_FOR(3)
TILES_FOR(4)

typedef void (*tiles_fn)(const float *, long, const float *, long, long, const float *, float *, long, long, long);
static const tiles_fn TILES[MV_MAX + 1] = {0, tiles_1, tiles_2, tiles_3, tiles_4};

/* out[M][N] = x[M][K] @ w[N][K]^T + bias (bias may be NULL); all row-major and contiguous. Returns 0,
   or -1 if the scratch buffer could not be allocated. */
int slotserve_small_gemm(const float *x, const float *w, const float *bias, float *out, long M, long N, long K,
                         int threads) {
    if (M <= DOT_ROWS) {
        const long blocks = (N + DOT_NB - 1) / DOT_NB;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long block = 0; block < blocks; block++) dot_block(x, w, bias, out, M, N, K, block);
        return 0;
    }
    const long Mp = (M + VW - 1) / VW * VW;
    const size_t bytes = (size_t)(K * Mp) * sizeof(float);
    float *xt = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!xt) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long k = 0; k < K; k++) {
            float *row = xt + k * Mp;
            for (long m = 0; m < M; m++) row[m] = x[m * K + k];
            for (long m = M; m < Mp; m++) row[m] = 0.0f;
        }
        for (long m0 = 0; m0 < Mp; m0 += MV_MAX * VW) {
            const int mv = (Mp - m0) / VW < MV_MAX ? (int)((Mp - m0) / VW) : MV_MAX;
            const long nb = rows_per_tile(mv);
            const long blocks = (N + nb - 1) / nb;
#pragma omp for schedule(static)
            for (long block = 0; block < blocks; block++) TILES[mv](w, K, xt, Mp, m0, bias, out, M, N, block);
        }
    }
    free(xt);
    return 0;
}
