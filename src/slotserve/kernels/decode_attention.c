/* Decode attention straight from the paged KV cache: one new query token per sequence, float32.

   torch's path copies every sequence's keys and values out of their blocks into one padded batch and
   then runs SDPA over it, whose kernel handles a one-row query per (sequence, head) poorly. Here each
   sequence is one task (or, with too few sequences for the threads, each of its kv heads) that walks
   its block table and reads the cache in place: for every kv head, the scores of its whole query group
   (GQA) against each key, a softmax, then the weighted sum of the values. Keys are visited in position
   order whatever blocks hold them, and a head's arithmetic is the same however the tasks are cut, so a
   row's result is bitwise the same alone or batched, with its blocks consecutive or scattered.

   Layouts: q and out [tokens][heads][head_dim]; caches [entries][kv_heads][head_dim] with entry =
   block * block_size + offset; block_tables [seqs][table_width] (int32); lens [seqs] (int32, keys to
   attend, the new token's included); rows [seqs] (int64, the sequence's query row in q and out). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "vector.h"

static float dot(const float *a, const float *b, long n) {
    vf acc = {0};
    long d = 0;
    for (; d + VW <= n; d += VW) acc = fmadd(load(a + d), load(b + d), acc);
    float s = hsum(acc);
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* Lane j of the result: hsum(acc[j]), the same additions in the same order (fold the halves, then again,
   then (b0 + b2) + (b1 + b3)), done for VW vectors at once: each fold's adds serve two vectors, and no lane
   is summed alone. Against a dot per key it gives the same bits, about 1.2x faster on one sequence's
   decode attention. */
static inline vf lane_sums(vf *acc) {
    for (int n = VW / 2; n >= 1; n /= 2) /* each level halves the vectors: n left, each of VW / n keys */
        for (int i = 0; i < n; i++) {
            const vf a = acc[2 * i], c = acc[2 * i + 1];
            vf lo, hi;
#if VW == 16
            if (n == 8) {
                lo = __builtin_shufflevector(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
                hi = __builtin_shufflevector(a, c, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
            } else if (n == 4) {
                lo = __builtin_shufflevector(a, c, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
                hi = __builtin_shufflevector(a, c, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
            } else if (n == 2) {
                lo = __builtin_shufflevector(a, c, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
                hi = __builtin_shufflevector(a, c, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
            } else {
                lo = __builtin_shufflevector(a, c, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                hi = __builtin_shufflevector(a, c, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            }
#else
            if (n == 4) {
                lo = __builtin_shufflevector(a, c, 0, 1, 2, 3, 8, 9, 10, 11);
                hi = __builtin_shufflevector(a, c, 4, 5, 6, 7, 12, 13, 14, 15);
            } else if (n == 2) {
                lo = __builtin_shufflevector(a, c, 0, 1, 4, 5, 8, 9, 12, 13);
                hi = __builtin_shufflevector(a, c, 2, 3, 6, 7, 10, 11, 14, 15);
            } else {
                lo = __builtin_shufflevector(a, c, 0, 2, 4, 6, 8, 10, 12, 14);
                hi = __builtin_shufflevector(a, c, 1, 3, 5, 7, 9, 11, 13, 15);
            }
#endif
            acc[i] = lo + hi;
        }
    return acc[0];
}

/* out += sum of p[j] * v[j] over n floats, for KEYS rows v[j]: one load and store of out per KEYS keys */
#define KEYS 4
static inline void axpy(float *out, const float *p, const float *const *v, long n) {
    long d = 0;
    for (; d + VW <= n; d += VW) {
        vf acc = load(out + d);
        for (int j = 0; j < KEYS; j++) acc = fmadd(splat(p[j]), load(v[j] + d), acc);
        store(out + d, acc);
    }
    for (; d < n; d++)
        for (int j = 0; j < KEYS; j++) out[d] += p[j] * v[j][d];
}

static inline vf vmax(vf a, vf b) {
    const vi gt = b > a;
    return (vf)(((vi)a & ~gt) | ((vi)b & gt));
}

/* Asks for a row of the cache ahead of its use: the rows of a sequence lie in blocks all over the cache,
   and without this each key and value waits on memory (measured: 2x slower in a decode step). */
#define AHEAD 8
static inline void prefetch_row(const float *row, long floats) {
    for (long f = 0; f < floats; f += 64 / sizeof(float)) __builtin_prefetch(row + f, 0, 3);
}

/* The cache offset (in floats) of each of a sequence's first len positions, computed once per task
   rather than with a division per key and pass. */
static void offsets_of(long *offsets, const int *table, long len, long block_size, long stride) {
    for (long pos = 0, block = 0; pos < len; block++)
        for (long i = 0; i < block_size && pos < len; i++, pos++)
            offsets[pos] = ((long)table[block] * block_size + i) * stride;
}

/* One task: kv heads [h0, h1) of one sequence, each with its `group` query heads, over the sequence's `len`
   keys. A key's rows for all of the task's kv heads lie side by side in the cache, so visiting the heads
   inside the loop over keys reads each block front to back. q, out: the sequence's row; scores: scratch
   of (h1 - h0) * group * padded floats (padded: len rounded up to the vector width); offsets: each
   key's entry in the cache, in floats. */
static void attend(const float *q, float *out, const float *k_cache, const float *v_cache, const long *offsets,
                   long len, long padded, long h0, long h1, long group, long head_dim, float scale,
                   float *scores) {
    const long heads = (h1 - h0) * group, span = (h1 - h0) * head_dim;
    q += h0 * group * head_dim;
    out += h0 * group * head_dim;
    for (long pos = 0; pos < len;) {
        if (pos + VW <= len && head_dim % VW == 0) { /* VW keys at once, each summed as dot sums it */
            for (long j = pos + VW; j < pos + 2 * VW && j < len; j++) { /* the next VW keys */
                prefetch_row(k_cache + offsets[j] + h0 * head_dim, span);
                prefetch_row(v_cache + offsets[j] + h0 * head_dim, span); /* for the weighted sum */
            }
            for (long h = 0; h < h1 - h0; h++) {
                const float *keys[VW];
                for (int j = 0; j < VW; j++) keys[j] = k_cache + offsets[pos + j] + (h0 + h) * head_dim;
                for (long g = 0; g < group; g++) {
                    const long i = h * group + g;
                    vf acc[VW];
                    for (int j = 0; j < VW; j++) acc[j] = splat(0.0f);
                    for (long d = 0; d < head_dim; d += VW) {
                        const vf qd = load(q + i * head_dim + d);
                        for (int j = 0; j < VW; j++) acc[j] = fmadd(qd, load(keys[j] + d), acc[j]);
                    }
                    store(scores + i * padded + pos, lane_sums(acc) * splat(scale));
                }
            }
            pos += VW;
            continue;
        }
        if (pos + AHEAD < len) {
            prefetch_row(k_cache + offsets[pos + AHEAD] + h0 * head_dim, span);
            prefetch_row(v_cache + offsets[pos + AHEAD] + h0 * head_dim, span);
        }
        for (long h = 0; h < h1 - h0; h++) {
            const float *key = k_cache + offsets[pos] + (h0 + h) * head_dim;
            for (long g = 0; g < group; g++) {
                const long i = h * group + g;
                scores[i * padded + pos] = dot(q + i * head_dim, key, head_dim) * scale;
            }
        }
        pos++;
    }
    for (long i = 0; i < heads; i++) {
        float *s = scores + i * padded;
        for (long pos = len; pos < padded; pos++) s[pos] = -INFINITY; /* exp: 0 */
        vf lanes = splat(-INFINITY);
        for (long pos = 0; pos < padded; pos += VW) lanes = vmax(lanes, load(s + pos));
        float max = -INFINITY;
        for (int l = 0; l < VW; l++) max = lanes[l] > max ? lanes[l] : max;
        vf total = {0};
        for (long pos = 0; pos < padded; pos += VW) {
            const vf e = vexp(load(s + pos) - splat(max));
            store(s + pos, e);
            total += e;
        }
        const float inv = 1.0f / hsum(total);
        for (long pos = 0; pos < padded; pos++) s[pos] *= inv;
    }
    memset(out, 0, (size_t)(heads * head_dim) * sizeof(float));
    for (long pos = 0; pos < padded; pos += KEYS) {
        /* past len: weight 0 (the padding's exp) on a real row, which leaves the sum as it is */
        const float *values[KEYS];
        for (long h = 0; h < h1 - h0; h++) {
            for (int j = 0; j < KEYS; j++)
                values[j] = v_cache + offsets[pos + j < len ? pos + j : 0] + (h0 + h) * head_dim;
            for (long g = 0; g < group; g++) {
                const long i = h * group + g;
                axpy(out + i * head_dim, scores + i * padded + pos, values, head_dim);
            }
        }
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int slotserve_decode_attention(const float *q, float *out, const long *rows, const float *k_cache,
                               const float *v_cache, const int *block_tables, long table_width, const int *lens,
                               long seqs, long heads, long kv_heads, long head_dim, long block_size, float scale,
                               int threads) {
    const long group = heads / kv_heads;
    long max_len = 0;
    for (long b = 0; b < seqs; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const long padded = (max_len + VW - 1) / VW * VW;
    /* A task per sequence; with too few sequences to share out among the threads, a task per kv head. */
    const long splits = seqs >= 2 * threads ? 1 : kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((size_t)(heads / splits * padded) * sizeof(float));
        long *offsets = malloc((size_t)padded * sizeof(long));
        if (!scores || !offsets) {
#pragma omp atomic write
            failed = 1;
        }
        long offsets_of_seq = -1; /* whose offsets are in `offsets`: a sequence's kv heads come in turn */
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < seqs * splits; task++) {
            if (!scores || !offsets) continue;
            const long b = task / splits, part = task % splits;
            const long len = lens[b];
            if (offsets_of_seq != b) {
                offsets_of(offsets, block_tables + b * table_width, len, block_size, kv_heads * head_dim);
                offsets_of_seq = b;
            }
            const long row = rows[b] * heads * head_dim;
            attend(q + row, out + row, k_cache, v_cache, offsets, len, (len + VW - 1) / VW * VW,
                   part * kv_heads / splits, (part + 1) * kv_heads / splits, group, head_dim, scale, scores);
        }
        free(scores);
        free(offsets);
    }
    return failed ? -1 : 0;
}
