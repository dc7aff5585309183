/* A float32 GEMM for the few rows of a CPU decode step: out[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]).

   With 2..64 rows, BLAS libraries copy ("pack") every weight into their own panel layout on each call
   and then read it again: three passes over weights that do not fit in any cache, where one would do.
   This kernel reads each weight once, straight from the row-major [N][K] layout of a checkpoint:

   - x is transposed once per call into xt[K][Mp] (Mp: M rounded up to the vector width, zero-padded),
     so that one vector load holds one k for VW consecutive rows of the batch;
   - a tile of NB weight rows x MV vectors of batch rows keeps NB*MV accumulators in registers; for each
     k it loads MV vectors of xt and broadcasts NB weights, one fused multiply-add per accumulator;
   - the threads split the weight rows, each streaming its own contiguous share.

   Every output element is one accumulator lane summing k = 0..K-1 in order, whatever M is and wherever
   the row sits in the batch: a row's result is bitwise the same alone or batched.

   Vector width and tile shapes follow the instruction set the file is compiled for (-march=native):
   16 floats and 32 registers with AVX-512, else 8 floats and 16 registers (AVX2, or what the compiler
   makes of GCC's generic vectors elsewhere). */

#include <stdlib.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define ACC 24 /* accumulators a tile may hold: 32 registers less the xt vectors and a broadcast */
#else
#define VW 8
#define ACC 12
#endif
#define MV_MAX 4

typedef float vf __attribute__((vector_size(VW * sizeof(float))));

/* A vector of copies of s, as one broadcast from memory: GCC's generic forms (`(vf){0} + s`, a loop)
   compile to an add or a shuffle first, which shares a port with the multiply-adds. */
static inline __attribute__((always_inline)) vf splat(const float *s) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*s);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(*s);
#else
    return (vf){0} + *s;
#endif
}

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
        for (int j = 0; j < mv; j++) memcpy(&xv[j], xk + j * VW, sizeof(vf));
#pragma GCC unroll 24
        for (int i = 0; i < nb; i++) {
            const vf wb = splat(wr + i * K + k);
#pragma GCC unroll 4
            for (int j = 0; j < mv; j++) acc[i * mv + j] += wb * xv[j];
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

int slotserve_vector_width(void) { return VW; }

/* out[M][N] = x[M][K] @ w[N][K]^T + bias (bias may be NULL); all row-major and contiguous. Returns 0,
   or -1 if the scratch buffer could not be allocated. */
int slotserve_small_gemm(const float *x, const float *w, const float *bias, float *out, long M, long N, long K,
                         int threads) {
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
