/* Where a step's time goes (bench/decode_roofline.py).
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- where a step's time goes, as thread 0 sees it (bench/decode_roofline.py; off unless asked) ---- */

enum { PH_MATMUL, PH_ATTENTION, PH_WAIT, PH_STEP, PH_COUNT };
static int profiling;
static double phase_s[PH_COUNT];

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define PHASE(tid, ph, ...)                           \
    do {                                              \
        if (profiling && (tid) == 0) {                \
            const double t0_ = now_s();               \
            __VA_ARGS__;                              \
            phase_s[ph] += now_s() - t0_;             \
        } else {                                      \
            __VA_ARGS__;                              \
        }                                             \
    } while (0)

void sluice_profile(int on) { profiling = on; }

/* Seconds since the last read in matmuls, attention, waits at barriers, and whole steps; then zeroed. */
void sluice_profile_read(double *out) {
    for (int i = 0; i < PH_COUNT; i++) out[i] = phase_s[i], phase_s[i] = 0;
}

