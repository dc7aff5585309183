/* A sum over the ranks of one host, through a shared-memory segment they all map, in rounds of at most
   a slot each (distributed/shm_all_reduce.py creates the segment and describes the protocol).

   Segment layout, for `world` ranks and slots of `stride` bytes:
     [0, data)   flag r, an int64 at r * FLAG_STRIDE: the last round rank r has written; beside it its
                 pid and, per buffer set, when it published its round there (data: the flags' bytes
                 rounded up to a page)
     [data, data + 2 * world * stride)   two sets of `world` slots; round k uses set k % 2

   A round: copy this rank's part into its slot of the round's set, publish the round number in its flag
   (release: the slot's bytes are visible to whoever sees the number), wait until every flag has reached
   the round (acquire), then sum the slots in rank order 0..world-1. Every rank adds the same numbers in
   the same order, so every rank gets the same bits.

   Waiting spins with `pause` for a while, then yields the core at each look: ranks can outnumber the
   cores (4 ranks on 2), and a rank spinning on a core keeps off it the rank it waits for. The clock is
   read after each yield (a yield can hand the core over for a whole time slice); past the deadline the
   round gives up and reports the flags it saw. Every LIVENESS_S it also looks whether the process of the
   rank it waits for is still there (its pid is beside its flag), so a rank that died fails the round at
   once instead of at the deadline.

   The ranks' constants travel in one struct: ctypes converts each argument of a call anew, each costing
   about a tenth of a whole round of 896 floats between two ranks. */

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* 128 bytes between flags: Intel's L2 prefetcher fetches lines in pairs, and two ranks' flags in one
   pair would bounce between the cores as if they shared a line. */
#define FLAG_STRIDE 128
#define DATA_ALIGN 4096
/* Pauses for about a round's time when every rank has a core. Where ranks outnumber the cores, longer
   spinning keeps the rank waited for off its core (with 4 ranks on 2 cores, 500 spins made a round over
   twice as slow as 64). */
#define SPINS_BEFORE_YIELD 64
#define BLOCK 2048 /* elements summed together: the partial sums stay in L1 across the ranks' slots */
#define LIVENESS_S 0.05 /* how often a waiting rank looks for the process it waits for (~10 us a look) */

enum { F32 = 0, BF16 = 1 };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static _Atomic int64_t *flag(void *segment, int r) {
    return (_Atomic int64_t *)((char *)segment + (long)r * FLAG_STRIDE);
}

static char *slot(void *segment, int world, long stride, int64_t round, int r) {
    const long data = ((long)world * FLAG_STRIDE + DATA_ALIGN - 1) / DATA_ALIGN * DATA_ALIGN;
    return (char *)segment + data + ((round % 2) * world + r) * stride;
}

/* The pid of rank r's process, which it wrote beside its flag. */
static int64_t *pid_of(void *segment, int r) {
    return (int64_t *)((char *)segment + (long)r * FLAG_STRIDE + sizeof(int64_t));
}

/* When rank r published its last round of set `round % 2` (CLOCK_MONOTONIC seconds): the round's
   communication ended when its last rank published. A rank writes set k % 2 again only after every rank
   has arrived at round k + 1, so after each has read these times of round k. */
static double *published_at(void *segment, int r, int64_t round) {
    return (double *)((char *)segment + (long)r * FLAG_STRIDE + (2 + round % 2) * sizeof(int64_t));
}

/* Whether a process runs: it has a /proc entry and is not a zombie (a child no one has reaped yet). */
static int process_runs(int64_t pid) {
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')'); /* the state follows the command name, which may hold spaces */
    return !end || (end[1] == ' ' && end[2] != 'Z' && end[2] != 'X');
}

/* 1 when every rank has written `round`; 0 past `deadline`, 2 when the process of the rank waited for is gone
   (*gone: that rank). Where not 1, seen[r] is each rank's last round. */
static int wait_all(void *segment, int world, int64_t round, double deadline, int64_t *seen, int *gone) {
    double next_look = now() + LIVENESS_S;
    for (int r = 0; r < world; r++) {
        _Atomic int64_t *f = flag(segment, r);
        for (long looks = 0; atomic_load_explicit(f, memory_order_acquire) < round; looks++) {
            if (looks < SPINS_BEFORE_YIELD) {
                cpu_relax();
                continue;
            }
            sched_yield();
            const double t = now();
            int status = -1;
            if (t > deadline) status = 0;
            else if (t > next_look) {
                next_look = t + LIVENESS_S;
                if (atomic_load_explicit(f, memory_order_acquire) < round && !process_runs(*pid_of(segment, r))) {
                    *gone = r;
                    status = 2;
                }
            }
            if (status >= 0) {
                for (int q = 0; q < world; q++) seen[q] = atomic_load_explicit(flag(segment, q), memory_order_acquire);
                return status;
            }
        }
    }
    return 1;
}

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 does; a NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

static void sum_f32(void *segment, int world, long stride, int64_t round, float *restrict out, long n) {
    for (long b = 0; b < n; b += BLOCK) {
        const long m = n - b < BLOCK ? n - b : BLOCK;
        float *restrict o = out + b;
        memcpy(o, (const float *)slot(segment, world, stride, round, 0) + b, m * sizeof(float));
        for (int r = 1; r < world; r++) {
            const float *restrict s = (const float *)slot(segment, world, stride, round, r) + b;
            for (long i = 0; i < m; i++) o[i] += s[i];
        }
    }
}

/* bfloat16 is summed in float32 and rounded once at the end: as exact as the float32 sum, in one order. */
static void sum_bf16(void *segment, int world, long stride, int64_t round, uint16_t *restrict out, long n) {
    float acc[BLOCK];
    for (long b = 0; b < n; b += BLOCK) {
        const long m = n - b < BLOCK ? n - b : BLOCK;
        const uint16_t *s0 = (const uint16_t *)slot(segment, world, stride, round, 0) + b;
        for (long i = 0; i < m; i++) acc[i] = bf16_to_f32(s0[i]);
        for (int r = 1; r < world; r++) {
            const uint16_t *restrict s = (const uint16_t *)slot(segment, world, stride, round, r) + b;
            for (long i = 0; i < m; i++) acc[i] += bf16_to_f32(s[i]);
        }
        for (long i = 0; i < m; i++) out[b + i] = f32_to_bf16(acc[i]);
    }
}

/* One rank's view of the segment, shared with Python (a ctypes.Structure mirrors it). */
struct shm_all_reduce {
    void *segment;
    long capacity; /* bytes of a round's part: a slot, less its alignment */
    long stride;   /* bytes from one slot to the next */
    int world, rank;
    double timeout_s; /* per round */
    int64_t round;    /* the last round this rank has written: the same on every rank between calls */
    int64_t *seen;    /* [world]: where a round failed, the last round each rank had written */
    int gone;         /* where a round failed because a rank's process is gone: that rank */
};

/* The first half of a round: this rank's n elements into its slot of the next round, published. */
static void publish(struct shm_all_reduce *g, const char *data, long n, int dtype) {
    const int64_t round = ++g->round;
    memcpy(slot(g->segment, g->world, g->stride, round, g->rank), data, n * (dtype == BF16 ? 2 : 4));
    *published_at(g->segment, g->rank, round) = now();
    atomic_store_explicit(flag(g->segment, g->rank), round, memory_order_release);
}

/* The second half: waits for every rank's part of the round this rank published last, sums them into data. */
static int collect(struct shm_all_reduce *g, char *data, long n, int dtype) {
    const int64_t round = g->round;
    const int arrived = wait_all(g->segment, g->world, round, now() + g->timeout_s, g->seen, &g->gone);
    if (arrived != 1) return arrived ? 2 : 1;
    if (dtype == BF16)
        sum_bf16(g->segment, g->world, g->stride, round, (uint16_t *)data, n);
    else
        sum_f32(g->segment, g->world, g->stride, round, (float *)data, n);
    return 0;
}

/* data[0..n) (float32 or bfloat16) becomes the sum over the ranks of their data, a round per capacity
   bytes. 0: done; 1: not every rank arrived within timeout_s of a round; 2: the process of rank g->gone
   is gone. Where not 0, g->round is the failed round and g->seen holds the round each rank had written. */
int slotserve_shm_all_reduce(struct shm_all_reduce *g, void *data, long n, int dtype) {
    const int size = dtype == BF16 ? 2 : 4;
    const long chunk = g->capacity / size;
    for (long start = 0; start < n; start += chunk) {
        const long m = n - start < chunk ? n - start : chunk;
        publish(g, (char *)data + start * size, m, dtype);
        const int status = collect(g, (char *)data + start * size, m, dtype);
        if (status) return status;
    }
    return 0;
}

/* A round in two calls, so that the caller computes between them (micro-batch overlap): publish data[0..n)
   (n elements of at most capacity bytes), then, later, collect the sum into the same memory (0, 1, 2 as
   above). Between the two, no other round of this group may start. */
int slotserve_shm_publish(struct shm_all_reduce *g, void *data, long n, int dtype) {
    publish(g, (const char *)data, n, dtype);
    return 0;
}

int slotserve_shm_collect(struct shm_all_reduce *g, void *data, long n, int dtype) {
    return collect(g, (char *)data, n, dtype);
}

/* When the last rank published the round this rank published last (CLOCK_MONOTONIC seconds), once collected. */
int slotserve_shm_completed_at(struct shm_all_reduce *g, double *out) {
    double last = 0;
    for (int r = 0; r < g->world; r++) {
        const double t = *published_at(g->segment, r, g->round);
        if (t > last) last = t;
    }
    *out = last;
    return 0;
}
