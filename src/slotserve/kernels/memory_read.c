/* The machine's memory read rate: a sum over a buffer far larger than the caches, on every thread, as
   plain vector loads into independent accumulators. What bounds a decode step that streams its weights.

   torch's `sum` over the same buffer reads ~20 % slower, so it would understate the bound a kernel is held
   to. */

#include "vector.h"

#define CHAINS 4 /* vectors summed side by side: one add's latency does not pace the loads */

/* *sum = the sum of n floats at p, read once, on `threads` threads (each a contiguous share). Returns 0. */
int slotserve_read_sum(const float *p, long n, int threads, float *sum) {
    const long step = CHAINS * VW, whole = n / step * step;
    float total = 0.0f;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (long t = 0; t < threads; t++) {
        const long begin = whole / step * t / threads * step, end = whole / step * (t + 1) / threads * step;
        vf acc[CHAINS] = {{0}};
        for (long i = begin; i < end; i += step)
            for (int c = 0; c < CHAINS; c++) acc[c] += load(p + i + c * VW);
        for (int c = 0; c < CHAINS; c++) total += hsum(acc[c]);
    }
    for (long i = whole; i < n; i++) total += p[i];
    *sum = total;
    return 0;
}
