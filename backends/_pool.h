/* One pool of threads for the CPU device's C kernels and for OpenBLAS's products (Note [one
 * pool for kernels and products] in backends/threads.py says why and what it measured).
 *
 * The caller is executor 0; workers 1..started-1 each wait on a mailbox of their own: a job is
 * (task, ctx, part, parts), posted by the caller, run, and acknowledged through `pending`. A
 * worker spins on its mailbox for `spin_ns` after its last job, then sleeps on its condition
 * variable; the caller wakes a sleeping one. One job runs at a time (`lock`): a kernel that
 * finds the pool busy (another thread's kernel) runs all its parts itself, on its own thread,
 * with the same results, since a kernel's parts never depend on how many run at once.
 *
 * OpenBLAS (a pthreads build, 0.3.28 and later) lets its caller run its threads' jobs
 * (`openblas_set_threads_callback_function`): `pool_blas_jobs` runs job i on executor i. Its
 * level-3 jobs wait for each other (they share packed panels), so they must all run at once:
 * the pool starts as many workers as OpenBLAS asks for and waits for the lock, never running
 * them one after another. OpenBLAS splits a product the same way whoever runs its jobs, so
 * the bits are those of its own threads.
 *
 * After a fork the child has no workers (POSIX keeps only the forking thread): `pool_forked`
 * forgets them, and the next job starts new ones. */
#ifndef BLOCKRT_POOL_H
#define BLOCKRT_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_MAX 64

typedef void (*pool_task)(void *ctx, Py_ssize_t part, Py_ssize_t parts);

typedef struct {
    pthread_t thread;
    pthread_cond_t wake;
    atomic_int ready;     /* a job is posted */
    atomic_int sleeping;  /* waiting on `wake` */
    pool_task task;
    void *ctx;
    Py_ssize_t part, parts;
} pool_worker;

static struct {
    pthread_mutex_t lock;        /* held by the caller of a job, for its whole length */
    pthread_mutex_t sleep_lock;  /* guards the workers' sleeping and waking */
    int threads;                 /* executors a kernel splits over, the caller included */
    int started;                 /* executors running: the caller and started - 1 workers */
    long long spin_ns;           /* how long an idle worker spins before it sleeps */
    Py_ssize_t grain;            /* the fewest items of memory-bound work a part takes */
    atomic_int pending;          /* posted parts not finished */
    pool_worker workers[POOL_MAX];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 1, 1, 100000, 65536};

static inline void
pool_pause(void)
{
#if HAVE_X86
    _mm_pause();
#endif
}

static long long
pool_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *
pool_main(void *arg)
{
    pool_worker *self = arg;
    for (;;) {
        long long until = pool_now_ns() + pool.spin_ns;
        for (unsigned spins = 0; !atomic_load(&self->ready); spins++) {
            pool_pause();
            if ((spins & 255) == 255 && pool_now_ns() > until) {
                pthread_mutex_lock(&pool.sleep_lock);
                atomic_store(&self->sleeping, 1);
                while (!atomic_load(&self->ready)) {
                    pthread_cond_wait(&self->wake, &pool.sleep_lock);
                }
                atomic_store(&self->sleeping, 0);
                pthread_mutex_unlock(&pool.sleep_lock);
                break;
            }
        }
        self->task(self->ctx, self->part, self->parts);
        atomic_store(&self->ready, 0);
        atomic_fetch_sub(&pool.pending, 1);
    }
    return NULL;
}

/* Start workers until `want` executors run (the pool's lock held); the number running. */
static int
pool_start(int want)
{
    want = want < POOL_MAX ? want : POOL_MAX;
    while (pool.started < want) {
        pool_worker *w = &pool.workers[pool.started];
        atomic_store(&w->ready, 0);
        atomic_store(&w->sleeping, 0);
        pthread_cond_init(&w->wake, NULL);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&w->thread, &attr, pool_main, w);
        pthread_attr_destroy(&attr);
        if (failed) {
            break;
        }
        pool.started++;
    }
    return pool.started;
}

/* Run task(ctx, p, parts) for p in [0, parts), part 0 on this thread (the lock held). */
static void
pool_post(pool_task task, void *ctx, Py_ssize_t parts)
{
    atomic_store(&pool.pending, (int)(parts - 1));
    for (Py_ssize_t p = 1; p < parts; p++) {
        pool_worker *w = &pool.workers[p];
        w->task = task;
        w->ctx = ctx;
        w->part = p;
        w->parts = parts;
        atomic_store(&w->ready, 1);
        if (atomic_load(&w->sleeping)) {
            pthread_mutex_lock(&pool.sleep_lock);
            pthread_cond_signal(&w->wake);
            pthread_mutex_unlock(&pool.sleep_lock);
        }
    }
    task(ctx, 0, parts);
    for (unsigned spins = 0; atomic_load(&pool.pending) > 0; spins++) {
        pool_pause();
        if ((spins & 1023) == 1023) {
            sched_yield();
        }
    }
}

/* Run task over `parts` parts: on the pool where it is free and has more than one executor,
 * else every part on this thread, in order. The caller must not hold the GIL's state in
 * the task (it runs on other threads). */
static void
pool_run(pool_task task, void *ctx, Py_ssize_t parts)
{
    if (parts > 1 && pool.threads > 1 && pthread_mutex_trylock(&pool.lock) == 0) {
        Py_ssize_t most = pool_start(pool.threads);
        if (parts > most) {
            parts = most;
        }
        pool_post(task, ctx, parts);
        pthread_mutex_unlock(&pool.lock);
        return;
    }
    for (Py_ssize_t p = 0; p < parts; p++) {
        task(ctx, p, parts);
    }
}

/* How many parts a kernel over `items` splits into: one per executor, each of at least
 * `grain` items, and at most `most` (the rows, channels or planes it splits). */
static Py_ssize_t
pool_parts(Py_ssize_t items, Py_ssize_t grain, Py_ssize_t most)
{
    Py_ssize_t parts = grain > 0 ? items / grain : items;
    parts = parts < pool.threads ? parts : pool.threads;
    parts = parts < most ? parts : most;
    return parts < 1 ? 1 : parts;
}

/* The range [begin, end) of part p of n items split in `parts`, in whole multiples of
 * `align` (the last part takes the rest). */
static void
pool_range(Py_ssize_t n, Py_ssize_t p, Py_ssize_t parts, Py_ssize_t align, Py_ssize_t *begin,
           Py_ssize_t *end)
{
    Py_ssize_t units = (n + align - 1) / align;
    Py_ssize_t b = units * p / parts * align, e = units * (p + 1) / parts * align;
    *begin = b < n ? b : n;
    *end = p == parts - 1 || e > n ? n : e;
}

/* OpenBLAS's threading callback: job i of `count` (each `size` bytes at `jobs`) runs as
 * dojob(i, job, data), all of them at once. */
typedef void (*pool_dojob)(int thread, void *job, int data);

typedef struct {
    pool_dojob dojob;
    char *jobs;
    size_t size;
    int data;
} pool_blas_ctx;

static void
pool_blas_part(void *ctx, Py_ssize_t part, Py_ssize_t parts)
{
    pool_blas_ctx *c = ctx;
    c->dojob((int)part, c->jobs + (size_t)part * c->size, c->data);
}

static void
pool_blas_jobs(int sync, pool_dojob dojob, int count, size_t size, void *jobs, int data)
{
    (void)sync;
    pool_blas_ctx ctx = {dojob, jobs, size, data};
    if (count <= 1) {
        if (count == 1) {
            dojob(0, jobs, data);
        }
        return;
    }
    pthread_mutex_lock(&pool.lock);  /* NOTE: never one after another: the jobs wait on each other */
    if (pool_start(count) < count) {
        /* NOTE: a thread could not be started: OpenBLAS's jobs cannot run one by one */
        pthread_mutex_unlock(&pool.lock);
        fprintf(stderr, "blockrt: could not start %d threads for OpenBLAS's jobs\n", count);
        abort();
    }
    pool_post(pool_blas_part, &ctx, count);
    pthread_mutex_unlock(&pool.lock);
}

static void
pool_forked(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pool.started = 1;
}

#endif
