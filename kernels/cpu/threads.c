/* The thread pool: wakes once per step, meets at spin barriers inside it; each thread's share.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- threads: a pool that wakes once per step and meets at spin barriers inside it ---- */

#define MAX_THREADS 64

typedef void (*job_fn)(void *arg, int tid);

typedef struct {
    pthread_mutex_t lock; /* guards generation, fn, arg */
    pthread_cond_t wake;
    int nthreads; /* workers started, plus the caller */
    int generation; /* bumped per job */
    job_fn fn;
    void *arg;
    atomic_int arrived, barrier_gen, done;
} pool_t;

static pool_t pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, NULL, NULL, 0, 0, 0};
static pthread_t workers[MAX_THREADS];
static pthread_mutex_t step_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time per process */
static int worker_ids[MAX_THREADS];

/* One round of waiting for another thread: a short spin (the other thread is normally a few
 * microseconds away), then yielding the core. Without the yield a waiting thread burns whole
 * scheduler slices while the thread it waits for is descheduled, which happens as soon as anything
 * else wants these cores (other processes, the event loop, a second engine): each barrier of a step
 * could then cost milliseconds, and one step a hundred times its time. */
#define SPIN_BEFORE_YIELD 4096
static inline void spin_wait(int *spins) {
    if (*spins < SPIN_BEFORE_YIELD) {
        ++*spins;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

static void barrier(int n) {
    if (n <= 1) return;
    int gen = atomic_load_explicit(&pool.barrier_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.barrier_gen, 1, memory_order_acq_rel);
    } else {
        for (int spins = 0; atomic_load_explicit(&pool.barrier_gen, memory_order_acquire) == gen;) spin_wait(&spins);
    }
}

static void *worker_main(void *arg) {
    int tid = *(int *)arg, seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        job_fn fn = pool.fn;
        void *arg = pool.arg;
        pthread_mutex_unlock(&pool.lock);
        fn(arg, tid); /* returns at once for tids past the job's thread count */
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_acq_rel);
    }
    return NULL;
}

static int ensure_workers(int n) {
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (pool.nthreads < n) {
        int tid = pool.nthreads;
        worker_ids[tid] = tid;
        if (pthread_create(&workers[tid], NULL, worker_main, &worker_ids[tid]) != 0) break;
        pthread_detach(workers[tid]);
        pool.nthreads++;
    }
    return n < pool.nthreads ? n : pool.nthreads;
}

/* Runs fn(arg, tid) on the caller (tid 0) and the workers; returns once every worker has left it. */
static void run_parallel(job_fn fn, void *arg, int nthreads) {
    if (nthreads > 1) {
        atomic_store(&pool.done, 0);
        pthread_mutex_lock(&pool.lock);
        pool.fn = fn;
        pool.arg = arg;
        pool.generation++;
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    fn(arg, 0);
    if (nthreads > 1)
        for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < pool.nthreads - 1;)
            spin_wait(&spins);
}

/* [lo, hi): this thread's share of n items. */
static inline void span(int n, int tid, int nt, int *lo, int *hi) {
    int per = (n + nt - 1) / nt;
    *lo = tid * per < n ? tid * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}
