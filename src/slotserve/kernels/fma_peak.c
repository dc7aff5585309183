/* The hardware's float32 multiply-add rate: what no float32 GEMM on the vector units can beat on this
   machine (AMX's tile units, amx_gemm.c, are another matter), where a BLAS library's GEMM measures only what
   that library reaches (on a 2-vCPU Xeon with AVX-512, this loop ran at
   328 GFLOP/s and MKL's GEMM at the default model's prefill shapes at 188-262).

   Every thread runs CHAINS independent chains of vector multiply-adds on registers alone: enough chains to
   hide the instruction's latency (4-5 cycles) on two multiply-add ports, no memory traffic. */

#include "vector.h"

#define CHAINS 12

/* FLOPs of one iteration on one thread. */
int slotserve_fma_flops_per_iteration(void) { return 2 * CHAINS * VW; }

/* `iterations` rounds of CHAINS multiply-adds on each of `threads` threads; the chains' sum goes to *sum,
   so the compiler keeps the work. Returns 0. */
int slotserve_fma_loop(long iterations, int threads, float *sum) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vf acc[CHAINS];
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = splat(1e-3f * (float)c);
        const vf a = splat(0.9999f), b = splat(1e-4f);
        for (long i = 0; i < iterations; i++)
#pragma GCC unroll 12
            for (int c = 0; c < CHAINS; c++) acc[c] = fmadd(acc[c], a, b);
        for (int c = 0; c < CHAINS; c++) total += hsum(acc[c]);
    }
    *sum = total;
    return 0;
}
