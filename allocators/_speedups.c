/* allocators._speedups: the C hot path of blockrt's caching allocator.

   allocators/base.py and allocators/caching.py are the complete reference implementation. This
   module only makes their most common case fast, as CPython's _heapq or _bisect do for heapq and
   bisect: allocators/_core.py imports it when it is built (and BLOCKRT_PURE_PYTHON is not set)
   and defines the same names in Python otherwise.

   What it holds:
   - Lock: a plain non-reentrant lock (acquire, release, locked, a context manager). A blocking
     acquire releases the GIL while it waits. The Python path holds it around every change.
   - AllocationRecord, Block, PoolRecord: the fields of allocators.Allocation, of the caching
     allocator's blocks and of its pools, as C structs. Python reads and writes them through
     member descriptors, so C and Python share one state, not two copies.
   - AllocatorState: the base of allocators.Allocator: the counters (allocators.base.COUNTERS,
     as attributes named "_" + key), the serial counter, the live allocations, the lock, and the
     fields the caching hot path reads. Its methods _caching_allocate / _caching_free serve a
     request from the cache (best fit, split, coalesce) and call self._allocate_slow /
     self._free_slow, the Python implementation, for anything else: a size never rounded or
     never listed, a new segment, pruning, trimming, errors, or a lock held by someone else.

   The rules of the hot path are Note [the hot path runs no Python] in allocators/_core.py: it
   runs only while the allocator's lock is free, keeps the GIL, runs no Python code and creates
   no object that the garbage collector tracks from its first check to its last change, and
   makes every check that can fail before the first change. In C that means: the new Allocation
   is created before the checks; after them there are only dict operations on int and Block
   keys (whose hashing and equality are C), ints, and reference counts that cannot reach zero.

   Free-threaded builds are not supported: this relies on the GIL. (As a single-phase module
   with static types, it also declares no support for subinterpreters or for running without
   the GIL, so such builds turn the GIL on when they import it.)
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>

/* A pointer field that Python may have set to None, or that may still be NULL: both are none. */
#define IS_NONE(op) ((op) == NULL || (op) == Py_None)

static PyObject *str_allocate_slow;   /* "_allocate_slow" */
static PyObject *str_free_slow;       /* "_free_slow" */
static PyTypeObject *allocation_class; /* allocators.Allocation, see set_allocation_class() */


/* ------------------------------------------------------------------------------ Lock */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    char locked;  /* NOTE: kept by acquire/release, so release() can refuse an unlocked lock */
} LockObject;

static PyTypeObject LockType;

static PyObject *
lock_create(PyTypeObject *type)
{
    LockObject *self = (LockObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static PyObject *
lock_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
        return NULL;
    }
    return lock_create(type);
}

static void
lock_dealloc(LockObject *self)
{
    if (self->lock != NULL) {
        if (self->locked) {
            PyThread_release_lock(self->lock);
        }
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Take the lock if it is free; never blocks, never runs Python code. */
static inline int
lock_try(LockObject *self)
{
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        self->locked = 1;
        return 1;
    }
    return 0;
}

/* Whether the hot path may run: no thread holds the lock. `locked` is set once the lock is
   taken and before the taker runs any Python code, and cleared before it is given back, both
   with the GIL held; the hot path keeps the GIL from its first check to its last change and
   runs no Python code in between, so while it runs nobody can take the lock: checking that it
   is free is the same as taking and releasing it around the hot path, at no cost. */
static inline int
lock_is_free(PyObject *op)
{
    return op != NULL && Py_IS_TYPE(op, &LockType) && !((LockObject *)op)->locked;
}

static PyObject *
lock_acquire(LockObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", kwlist, &blocking, &timeout)) {
        return NULL;
    }
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (lock_try(self)) {
        Py_RETURN_TRUE;
    }
    if (!blocking || timeout == 0) {
        Py_RETURN_FALSE;
    }
    PY_TIMEOUT_T microseconds = -1;
    if (timeout > 0) {
        if (timeout * 1e6 >= (double)PY_TIMEOUT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
            return NULL;
        }
        microseconds = (PY_TIMEOUT_T)(timeout * 1e6);
    }
    PyLockStatus status;
    Py_BEGIN_ALLOW_THREADS
    status = PyThread_acquire_lock_timed(self->lock, microseconds, 0);
    Py_END_ALLOW_THREADS
    if (status != PY_LOCK_ACQUIRED) {
        Py_RETURN_FALSE;
    }
    self->locked = 1;
    Py_RETURN_TRUE;
}

static PyObject *
lock_release_method(LockObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->locked) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    self->locked = 0;
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

static PyObject *
lock_exit(LockObject *self, PyObject *Py_UNUSED(args))
{
    return lock_release_method(self, NULL);
}

static PyObject *
lock_locked(LockObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(self->locked);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))lock_acquire, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("acquire(blocking=True, timeout=-1) -> bool\n\n"
               "Take the lock, waiting (without the GIL) up to timeout seconds when blocking;\n"
               "-1 waits for as long as it takes. Returns whether it was taken.")},
    {"__enter__", (PyCFunction)(void (*)(void))lock_acquire, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("acquire(), for the with statement.")},
    {"release", (PyCFunction)lock_release_method, METH_NOARGS,
     PyDoc_STR("release()\n\nRelease the lock; RuntimeError if it is not held.")},
    {"__exit__", (PyCFunction)lock_exit, METH_VARARGS, PyDoc_STR("release().")},
    {"locked", (PyCFunction)lock_locked, METH_NOARGS,
     PyDoc_STR("locked() -> bool\n\nWhether some thread holds the lock.")},
    {NULL, NULL}
};

static PyObject *
lock_repr(LockObject *self)
{
    return PyUnicode_FromFormat("<%s %s object at %p>", self->locked ? "locked" : "unlocked",
                                Py_TYPE(self)->tp_name, self);
}

static PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.Lock",
    .tp_basicsize = sizeof(LockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Lock()\n--\n\n"
                        "A non-reentrant lock, like threading.Lock: acquire(blocking=True,\n"
                        "timeout=-1), release(), locked(), and a context manager."),
    .tp_new = lock_new,
    .tp_dealloc = (destructor)lock_dealloc,
    .tp_methods = lock_methods,
    .tp_repr = (reprfunc)lock_repr,
};


/* ------------------------------------------------------------------------------ AllocationRecord */

typedef struct {
    PyObject_HEAD
    PyObject *device;
    PyObject *raw;
    long long offset;
    long long nbytes;
    long long size;
    PyObject *owner;
    PyObject *serial;  /* NOTE: an int: the very object that keys the owner's live dict */
    char live;
    PyObject *upstream;
    PyObject *handle;  /* the owner's own record of it: the caching allocator's Block */
} AllocationRecord;

static PyTypeObject AllocationRecordType;

static int
record_init(AllocationRecord *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "raw", "offset", "nbytes", "size", "upstream", NULL};
    PyObject *device, *raw, *upstream = Py_None;
    long long offset, nbytes, size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLL|O:Allocation", kwlist, &device, &raw,
                                     &offset, &nbytes, &size, &upstream)) {
        return -1;
    }
    Py_XSETREF(self->device, Py_NewRef(device));
    Py_XSETREF(self->raw, Py_NewRef(raw));
    self->offset = offset;
    self->nbytes = nbytes;
    self->size = size;
    Py_XSETREF(self->upstream, Py_NewRef(upstream));
    Py_CLEAR(self->owner);
    Py_XSETREF(self->serial, PyLong_FromLong(0));
    self->live = 0;
    Py_CLEAR(self->handle);
    return 0;
}

static int
record_traverse(AllocationRecord *self, visitproc visit, void *arg)
{
    Py_VISIT(self->device);
    Py_VISIT(self->raw);
    Py_VISIT(self->owner);
    Py_VISIT(self->serial);
    Py_VISIT(self->upstream);
    Py_VISIT(self->handle);
    return 0;
}

static int
record_clear(AllocationRecord *self)
{
    Py_CLEAR(self->device);
    Py_CLEAR(self->raw);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->serial);
    Py_CLEAR(self->upstream);
    Py_CLEAR(self->handle);
    return 0;
}

static void
record_dealloc(AllocationRecord *self)
{
    PyObject_GC_UnTrack(self);
    record_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define RECORD_MEMBER(name, type) {#name, type, offsetof(AllocationRecord, name), 0, NULL}
static PyMemberDef record_members[] = {
    RECORD_MEMBER(device, T_OBJECT),
    RECORD_MEMBER(raw, T_OBJECT),
    RECORD_MEMBER(offset, T_LONGLONG),
    RECORD_MEMBER(nbytes, T_LONGLONG),
    RECORD_MEMBER(size, T_LONGLONG),
    RECORD_MEMBER(owner, T_OBJECT),
    RECORD_MEMBER(serial, T_OBJECT),
    RECORD_MEMBER(live, T_BOOL),
    RECORD_MEMBER(upstream, T_OBJECT),
    RECORD_MEMBER(handle, T_OBJECT),
    {NULL}
};

static PyTypeObject AllocationRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.AllocationRecord",
    .tp_basicsize = sizeof(AllocationRecord),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("AllocationRecord(device, raw, offset, nbytes, size, upstream=None)\n--\n\n"
                        "The fields of allocators.Allocation (see there)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)record_init,
    .tp_traverse = (traverseproc)record_traverse,
    .tp_clear = (inquiry)record_clear,
    .tp_dealloc = (destructor)record_dealloc,
    .tp_members = record_members,
};


/* ------------------------------------------------------------------------------ Block */

/* A run of bytes in a segment of the caching allocator (allocators/caching.py, _Block). Object
   fields hold strong references; a field that is NULL or None means "no block". */
typedef struct {
    PyObject_HEAD
    PyObject *raw;
    long long offset;
    long long size;
    PyObject *pool;
    char free;
    PyObject *prev;       /* neighbours by address in the segment */
    PyObject *next;
    PyObject *prev_free;  /* neighbours in the free list of its size, while free */
    PyObject *next_free;
} BlockObject;

static PyTypeObject BlockType;

static int
block_traverse(BlockObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->raw);
    Py_VISIT(self->pool);
    Py_VISIT(self->prev);
    Py_VISIT(self->next);
    Py_VISIT(self->prev_free);
    Py_VISIT(self->next_free);
    return 0;
}

static int
block_clear(BlockObject *self)
{
    Py_CLEAR(self->raw);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->prev);
    Py_CLEAR(self->next);
    Py_CLEAR(self->prev_free);
    Py_CLEAR(self->next_free);
    return 0;
}

static void
block_dealloc(BlockObject *self)
{
    PyObject_GC_UnTrack(self);
    /* NOTE: the trashcan bounds the recursion when a long chain of blocks goes at once */
    Py_TRASHCAN_BEGIN(self, block_dealloc)
    block_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
    Py_TRASHCAN_END
}

#define BLOCK_MEMBER(name, type) {#name, type, offsetof(BlockObject, name), 0, NULL}
static PyMemberDef block_members[] = {
    BLOCK_MEMBER(raw, T_OBJECT),
    BLOCK_MEMBER(offset, T_LONGLONG),
    BLOCK_MEMBER(size, T_LONGLONG),
    BLOCK_MEMBER(pool, T_OBJECT),
    BLOCK_MEMBER(free, T_BOOL),
    BLOCK_MEMBER(prev, T_OBJECT),
    BLOCK_MEMBER(next, T_OBJECT),
    BLOCK_MEMBER(prev_free, T_OBJECT),
    BLOCK_MEMBER(next_free, T_OBJECT),
    {NULL}
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("Block()\n--\n\n"
                        "A block of the caching allocator (allocators.caching._Block)."),
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)block_traverse,
    .tp_clear = (inquiry)block_clear,
    .tp_dealloc = (destructor)block_dealloc,
    .tp_members = block_members,
};

#define AS_BLOCK(op) ((BlockObject *)(op))
#define IS_BLOCK(op) ((op) != NULL && Py_IS_TYPE((op), &BlockType))


/* ------------------------------------------------------------------------------ PoolRecord */

typedef struct {
    PyObject_HEAD
    PyObject *name;
    long long min_split;
    PyObject *buckets;  /* dict: block size -> first free Block of that size, or None */
    PyObject *sizes;    /* sorted list of the keys of buckets */
} PoolRecord;

static PyTypeObject PoolRecordType;

static int
pool_traverse(PoolRecord *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->buckets);
    Py_VISIT(self->sizes);
    return 0;
}

static int
pool_clear(PoolRecord *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->buckets);
    Py_CLEAR(self->sizes);
    return 0;
}

static void
pool_dealloc(PoolRecord *self)
{
    PyObject_GC_UnTrack(self);
    pool_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define POOL_MEMBER(name, type) {#name, type, offsetof(PoolRecord, name), 0, NULL}
static PyMemberDef pool_members[] = {
    POOL_MEMBER(name, T_OBJECT),
    POOL_MEMBER(min_split, T_LONGLONG),
    POOL_MEMBER(buckets, T_OBJECT),
    POOL_MEMBER(sizes, T_OBJECT),
    {NULL}
};

static PyTypeObject PoolRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.PoolRecord",
    .tp_basicsize = sizeof(PoolRecord),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("PoolRecord()\n--\n\n"
                        "The fields of a pool of the caching allocator (caching._Pool)."),
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)pool_traverse,
    .tp_clear = (inquiry)pool_clear,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_members = pool_members,
};

#define IS_POOL(op) ((op) != NULL && PyObject_TypeCheck((op), &PoolRecordType))

/* Replace a strong-reference field. Under the allocator's lock, the old value must not reach
   refcount zero unless its deallocation runs no Python code (see the module comment). */
#define SET_FIELD(field, value) Py_XSETREF((field), Py_NewRef(value))
#define OR_NONE(op) (IS_NONE(op) ? Py_None : (op))

/* _Pool.remove: take the free `block` off its free list; `size_key` is its size, a key of
   `buckets`. A store to an existing key only replaces the value: it allocates nothing and
   cannot fail. The list's references on `block` go, so the caller must hold one. */
static void
freelist_remove(PyObject *buckets, PyObject *size_key, BlockObject *block)
{
    PyObject *before = OR_NONE(block->prev_free);  /* both held by `block` until the end */
    PyObject *after = OR_NONE(block->next_free);
    if (before == Py_None) {
        (void)PyDict_SetItem(buckets, size_key, after);  /* it was the first */
    }
    else {
        SET_FIELD(AS_BLOCK(before)->next_free, after);
    }
    if (after != Py_None) {
        SET_FIELD(AS_BLOCK(after)->prev_free, before);
    }
    SET_FIELD(block->prev_free, Py_None);
    SET_FIELD(block->next_free, Py_None);
}

/* _Pool.push: make the free `block` the first of its free list, whose current first is
   `first` (a Block or None); `size_key` is already a key of `buckets` (so nothing fails). */
static void
freelist_push(PyObject *buckets, PyObject *size_key, PyObject *first, BlockObject *block)
{
    SET_FIELD(block->prev_free, Py_None);
    SET_FIELD(block->next_free, first);
    if (first != Py_None) {
        SET_FIELD(AS_BLOCK(first)->prev_free, (PyObject *)block);
    }
    (void)PyDict_SetItem(buckets, size_key, (PyObject *)block);  /* `first` is held by block */
}

/* Must equal allocators.caching._PRUNE_AFTER (a test checks): a best-fit search that steps over
   more empty sizes than this prunes them, which the Python path does. */
#define PRUNE_AFTER 16

/* _Pool.take_best_fit without the taking: the first block of the smallest listed size >= size,
   its size key in *key_out (borrowed). NULL where the Python path must act: no block fits (a
   new segment), the search would prune, or the pool is not as expected. Changes nothing. */
static BlockObject *
best_fit(PoolRecord *pool, long long size, PyObject **key_out)
{
    PyObject *sizes = pool->sizes, *buckets = pool->buckets;
    if (sizes == NULL || !PyList_CheckExact(sizes)) {
        return NULL;
    }
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(sizes);
    while (lo < hi) {  /* bisect_left on the sorted sizes */
        Py_ssize_t mid = lo + (hi - lo) / 2;
        PyObject *item = PyList_GET_ITEM(sizes, mid);
        if (!PyLong_CheckExact(item)) {
            return NULL;
        }
        if (PyLong_AsLongLong(item) < size) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    Py_ssize_t end = PyList_GET_SIZE(sizes);
    for (Py_ssize_t index = lo; index < end && index - lo <= PRUNE_AFTER; index++) {
        PyObject *key = PyList_GET_ITEM(sizes, index);
        PyObject *first = PyDict_GetItemWithError(buckets, key);
        if (IS_BLOCK(first)) {
            *key_out = key;
            return AS_BLOCK(first);
        }
        if (first != Py_None) {
            return NULL;  /* a size without a bucket, or an error: the Python path tells */
        }
    }
    return NULL;
}


/* ------------------------------------------------------------------------------ AllocatorState */

typedef struct {
    PyObject_HEAD
    /* the counters of allocators.base.COUNTERS, as attributes "_" + key */
    long long allocated_bytes, peak_allocated_bytes, requested_bytes, peak_requested_bytes;
    long long reserved_bytes, peak_reserved_bytes, peak_cached_bytes;
    long long num_allocs, num_frees, cache_misses, num_ooms, num_device_allocs, num_device_frees;
    long long last_serial;  /* the serial of the last allocation handed out */
    PyObject *live;         /* dict: serial -> live Allocation */
    PyObject *lock;         /* Lock */
    PyObject *device;
    /* read by the caching hot path only; `hot` is false in every other allocator */
    char hot;
    /* whether allocations are recorded on other queues or pending (allocators.base: queue-
       ordered reuse); read by Python only, where a member is faster than a __dict__ entry */
    char ordered;
    PyObject *rounded;          /* dict: request bytes -> block bytes */
    PyObject *small;            /* PoolRecord of blocks <= small_size */
    PyObject *large;            /* PoolRecord of larger blocks */
    long long small_size;
    PyObject *idle;             /* dict: head Block of a whole free segment -> None, LRU order */
    PyObject *max_cached_bytes; /* None, or an int (then every free goes the Python way) */
    BlockObject *spare;         /* a Block made in advance for the next split, or NULL */
} AllocatorState;

static PyTypeObject AllocatorStateType;

static PyObject *
state_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    /* NOTE: arguments are the subclass's (Allocator(device)); the state starts empty */
    AllocatorState *self = (AllocatorState *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->live = PyDict_New();
    self->lock = lock_create(&LockType);
    if (self->live == NULL || self->lock == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
state_traverse(AllocatorState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->live);
    Py_VISIT(self->lock);
    Py_VISIT(self->device);
    Py_VISIT(self->rounded);
    Py_VISIT(self->small);
    Py_VISIT(self->large);
    Py_VISIT(self->idle);
    Py_VISIT(self->max_cached_bytes);
    Py_VISIT(self->spare);
    return 0;
}

static int
state_clear(AllocatorState *self)
{
    Py_CLEAR(self->live);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->device);
    Py_CLEAR(self->rounded);
    Py_CLEAR(self->small);
    Py_CLEAR(self->large);
    Py_CLEAR(self->idle);
    Py_CLEAR(self->max_cached_bytes);
    Py_CLEAR(self->spare);
    return 0;
}

static void
state_dealloc(AllocatorState *self)
{
    PyObject_GC_UnTrack(self);
    state_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
call_slow(PyObject *self, PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {self, arg};
    return PyObject_VectorcallMethod(name, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Whether the fields the hot path reads have the types it relies on. */
static int
state_is_hot(AllocatorState *self)
{
    return (self->hot && allocation_class != NULL && self->lock != NULL
            && Py_IS_TYPE(self->lock, &LockType) && self->live != NULL
            && PyDict_CheckExact(self->live) && self->rounded != NULL
            && PyDict_CheckExact(self->rounded) && self->idle != NULL
            && PyDict_CheckExact(self->idle) && IS_POOL(self->small) && IS_POOL(self->large));
}

PyDoc_STRVAR(caching_allocate_doc,
"allocate(nbytes) -> Allocation\n\n"
"Return an Allocation of at least `nbytes` bytes (0 is valid).\n\n"
"A request served from the cache (best fit, split when worth it) runs in C; every other\n"
"one goes through Allocator.allocate, the Python implementation (see CachingAllocator).\n\n"
"Raises:\n"
"    TypeError: nbytes is not an integer.\n"
"    ValueError: nbytes is negative.\n"
"    OutOfMemoryError: the memory cannot be had; says how much was asked, used and allowed.");

static PyObject *
state_caching_allocate(AllocatorState *self, PyObject *arg)
{
    if (!PyLong_CheckExact(arg) || !self->hot || allocation_class == NULL) {
        return call_slow((PyObject *)self, str_allocate_slow, arg);
    }
    int overflow;
    long long nbytes = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow || nbytes < 0) {
        return call_slow((PyObject *)self, str_allocate_slow, arg);  /* it raises */
    }
    /* Created before the lock: this may start a garbage collection (see the module comment). */
    AllocationRecord *allocation =
        (AllocationRecord *)allocation_class->tp_alloc(allocation_class, 0);
    if (allocation == NULL) {
        return NULL;
    }
    /* ---- from here on: no Python code, no tracked objects; checks first, changes after ---- */
    PyObject *rest_key = NULL;
    if (!lock_is_free(self->lock) || !state_is_hot(self)) {
        goto slow;  /* NOTE: checked after the allocation: a collection may run Python code */
    }
    /* CachingAllocator._allocate: the block size, remembered for this request size */
    PyObject *size_key = PyDict_GetItemWithError(self->rounded, arg);
    if (size_key == NULL || !PyLong_CheckExact(size_key)) {
        goto slow;  /* a size not rounded before: the size class policy is Python */
    }
    long long size = PyLong_AsLongLong(size_key);
    PoolRecord *pool = (PoolRecord *)(size <= self->small_size ? self->small : self->large);
    PyObject *buckets = pool->buckets;
    if (size <= 0 || buckets == NULL || !PyDict_CheckExact(buckets)) {
        goto slow;
    }
    /* the most recently freed block of exactly this size, else the best fit */
    PyObject *block_key = size_key;
    PyObject *found = PyDict_GetItemWithError(buckets, size_key);
    if (!IS_BLOCK(found)) {
        found = (PyObject *)best_fit(pool, size, &block_key);
        if (found == NULL) {
            goto slow;  /* a new segment, or a search that prunes */
        }
    }
    BlockObject *block = AS_BLOCK(found);
    if (!block->free || block->size < size) {
        goto slow;
    }
    /* _split: past min_split left over, the top `size` bytes become a block of their own (the
       spare one), and the rest stays free under its new size, which must be a listed size */
    long long rest = block->size - size;
    PyObject *rest_first = NULL;
    if (rest >= pool->min_split) {
        if (self->spare == NULL) {
            goto slow;
        }
        rest_key = PyLong_FromLongLong(rest);  /* an int: not tracked by the GC */
        if (rest_key == NULL) {
            goto error;
        }
        rest_first = PyDict_GetItemWithError(buckets, rest_key);
        if (rest_first == NULL || !(rest_first == Py_None || IS_BLOCK(rest_first))) {
            goto slow;  /* a size never listed in this pool: it needs a place in `sizes` */
        }
    }
    long long serial = self->last_serial + 1;
    PyObject *serial_key = PyLong_FromLongLong(serial);  /* an int: not tracked by the GC */
    if (serial_key == NULL) {
        goto error;
    }
    if (PyDict_SetItem(self->live, serial_key, (PyObject *)allocation) < 0) {
        Py_DECREF(serial_key);
        goto error;
    }
    /* ---- nothing below can fail ---- */
    self->last_serial = serial;
    Py_INCREF(block);  /* for the allocation's handle (or, after a split, for the time being) */
    freelist_remove(buckets, block_key, block);
    if (IS_NONE(block->prev) && IS_NONE(block->next)
            && PyDict_Contains(self->idle, (PyObject *)block) == 1) {
        (void)PyDict_DelItem(self->idle, (PyObject *)block);  /* a whole free segment in use */
    }
    BlockObject *used = block;
    if (rest_first != NULL) {
        used = self->spare;  /* its reference becomes the handle */
        self->spare = NULL;
        SET_FIELD(used->raw, OR_NONE(block->raw));
        used->offset = block->offset + block->size - size;
        used->size = size;
        SET_FIELD(used->pool, (PyObject *)pool);
        SET_FIELD(used->prev_free, Py_None);
        SET_FIELD(used->next_free, Py_None);
        PyObject *after = OR_NONE(block->next);
        SET_FIELD(used->next, after);
        if (after != Py_None) {
            SET_FIELD(AS_BLOCK(after)->prev, (PyObject *)used);
        }
        SET_FIELD(used->prev, (PyObject *)block);
        SET_FIELD(block->next, (PyObject *)used);
        block->size = rest;
        freelist_push(buckets, rest_key, rest_first, block);
        Py_DECREF(block);  /* held by `used` now */
    }
    used->free = 0;
    allocation->handle = (PyObject *)used;
    allocation->device = Py_NewRef(self->device != NULL ? self->device : Py_None);
    allocation->raw = Py_NewRef(OR_NONE(used->raw));
    allocation->offset = used->offset;
    allocation->nbytes = nbytes;
    /* NOTE: the block's size, not the request's: a block whose leftover is below min_split
       is handed out whole, larger than `size` (as in _allocate) */
    allocation->size = used->size;
    allocation->owner = Py_NewRef((PyObject *)self);
    allocation->serial = serial_key;  /* NOTE: the key object itself: free finds it by identity */
    allocation->live = 1;
    /* the accounting of Allocator.allocate, for a hit: no device allocation, so no miss */
    self->num_allocs += 1;
    self->allocated_bytes += allocation->size;
    self->requested_bytes += nbytes;
    if (self->allocated_bytes > self->peak_allocated_bytes) {
        self->peak_allocated_bytes = self->allocated_bytes;
    }
    if (self->requested_bytes > self->peak_requested_bytes) {
        self->peak_requested_bytes = self->requested_bytes;
    }
    if (self->reserved_bytes - self->allocated_bytes > self->peak_cached_bytes) {
        self->peak_cached_bytes = self->reserved_bytes - self->allocated_bytes;
    }
    Py_XDECREF(rest_key);
    if (self->spare == NULL) {  /* the next split's block, made after the changes */
        self->spare = (BlockObject *)BlockType.tp_alloc(&BlockType, 0);
        if (self->spare == NULL) {
            PyErr_Clear();  /* NOTE: no harm done: the next split goes the Python way */
        }
    }
    return (PyObject *)allocation;

slow:
    PyErr_Clear();
    Py_XDECREF(rest_key);
    Py_DECREF(allocation);
    if (self->spare == NULL) {
        self->spare = (BlockObject *)BlockType.tp_alloc(&BlockType, 0);
        if (self->spare == NULL) {
            return NULL;
        }
    }
    return call_slow((PyObject *)self, str_allocate_slow, arg);

error:
    Py_XDECREF(rest_key);
    Py_DECREF(allocation);
    return NULL;
}

PyDoc_STRVAR(caching_free_doc,
"free(allocation) -> None\n\n"
"Give `allocation` back. Raises InvalidFreeError on a double or foreign free.\n\n"
"A free that coalesces with free neighbours of listed sizes runs in C; every other one\n"
"(trimming past max_cached_bytes, a new free size) goes through Allocator.free, the Python\n"
"implementation (see CachingAllocator).");

static PyObject *
state_caching_free(AllocatorState *self, PyObject *arg)
{
    if (allocation_class == NULL || !Py_IS_TYPE(arg, allocation_class) || !self->hot
            || !IS_NONE(self->max_cached_bytes)) {
        return call_slow((PyObject *)self, str_free_slow, arg);
    }
    AllocationRecord *allocation = (AllocationRecord *)arg;
    PyObject *serial_key = allocation->serial;
    if (!allocation->live || allocation->owner != (PyObject *)self
            || !IS_BLOCK(allocation->handle) || serial_key == NULL
            || !PyLong_CheckExact(serial_key) || !lock_is_free(self->lock)
            || !state_is_hot(self)) {
        /* it raises InvalidFreeError, or waits for the lock */
        return call_slow((PyObject *)self, str_free_slow, arg);
    }
    /* ---- from here on: no Python code, no tracked objects; checks first, changes after ---- */
    BlockObject *block = AS_BLOCK(allocation->handle);
    PyObject *merged_key = NULL, *after_key = NULL, *before_key = NULL;
    if (!IS_POOL(block->pool) || block->free || block->size != allocation->size) {
        goto slow;
    }
    PyObject *buckets = ((PoolRecord *)block->pool)->buckets;
    if (buckets == NULL || !PyDict_CheckExact(buckets)
            || PyDict_GetItemWithError(self->live, serial_key) != arg) {
        goto slow;  /* not live here after all: the slow path says why */
    }
    /* _free: coalesce with a free next block, then with a free previous one */
    BlockObject *after = NULL, *before = NULL;
    long long merged = block->size;
    if (IS_BLOCK(block->next) && AS_BLOCK(block->next)->free) {
        after = AS_BLOCK(block->next);
        merged += after->size;
        after_key = PyLong_FromLongLong(after->size);
        if (after_key == NULL || PyDict_GetItemWithError(buckets, after_key) == NULL) {
            goto slow;
        }
    }
    if (IS_BLOCK(block->prev) && AS_BLOCK(block->prev)->free) {
        before = AS_BLOCK(block->prev);
        merged += before->size;
        before_key = PyLong_FromLongLong(before->size);
        if (before_key == NULL || PyDict_GetItemWithError(buckets, before_key) == NULL) {
            goto slow;
        }
    }
    merged_key = PyLong_FromLongLong(merged);
    if (merged_key == NULL) {
        goto slow;
    }
    /* NOTE: the merged size is larger than either neighbour's, so removing them below leaves
       the first of its free list as it is now */
    PyObject *merged_first = PyDict_GetItemWithError(buckets, merged_key);
    if (merged_first == NULL || !(merged_first == Py_None || IS_BLOCK(merged_first))) {
        goto slow;  /* a size never listed in this pool: it needs a place in `sizes` */
    }
    BlockObject *result = before != NULL ? before : block;
    PyObject *beyond = OR_NONE(after != NULL ? after->next : block->next);
    if (IS_NONE(result->prev) && beyond == Py_None) {
        /* the whole segment is free: newest in the LRU order (the one step that can fail, by
           running out of memory, so it comes before every other change) */
        if (PyDict_SetItem(self->idle, (PyObject *)result, Py_None) < 0) {
            goto error;
        }
    }
    /* ---- nothing below can fail ---- */
    (void)PyDict_DelItem(self->live, serial_key);  /* the caller still holds `allocation` */
    allocation->live = 0;
    /* NOTE: the handle, the raw memory and the merged-away record are released at the end */
    PyObject *handle = allocation->handle;
    allocation->handle = NULL;
    PyObject *raw = allocation->raw;  /* NOTE: a freed allocation must not keep its segment */
    allocation->raw = NULL;
    if (after != NULL) {
        Py_INCREF(after);  /* its record goes away, at the end */
        freelist_remove(buckets, after_key, after);
        block->size += after->size;
        SET_FIELD(block->next, beyond);
        if (beyond != Py_None) {
            SET_FIELD(AS_BLOCK(beyond)->prev, (PyObject *)block);
        }
    }
    if (before != NULL) {
        freelist_remove(buckets, before_key, before);  /* held by its own neighbours */
        before->size += block->size;
        SET_FIELD(before->next, beyond);
        if (beyond != Py_None) {
            SET_FIELD(AS_BLOCK(beyond)->prev, (PyObject *)before);
        }
    }
    else {
        block->free = 1;
    }
    freelist_push(buckets, merged_key, merged_first, result);
    /* the accounting of Allocator.free */
    self->num_frees += 1;
    self->allocated_bytes -= allocation->size;
    self->requested_bytes -= allocation->nbytes;
    if (self->reserved_bytes - self->allocated_bytes > self->peak_cached_bytes) {
        self->peak_cached_bytes = self->reserved_bytes - self->allocated_bytes;
    }
    Py_DECREF(merged_key);
    Py_XDECREF(after_key);
    Py_XDECREF(before_key);
    Py_XDECREF(after);
    Py_XDECREF(handle);
    Py_XDECREF(raw);
    Py_RETURN_NONE;

slow:
    PyErr_Clear();
    Py_XDECREF(merged_key);
    Py_XDECREF(after_key);
    Py_XDECREF(before_key);
    return call_slow((PyObject *)self, str_free_slow, arg);

error:
    Py_XDECREF(merged_key);
    Py_XDECREF(after_key);
    Py_XDECREF(before_key);
    return NULL;
}

static PyMethodDef state_methods[] = {
    {"_caching_allocate", (PyCFunction)state_caching_allocate, METH_O, caching_allocate_doc},
    {"_caching_free", (PyCFunction)state_caching_free, METH_O, caching_free_doc},
    {NULL, NULL}
};

#define STATE_MEMBER(name, field, type) {name, type, offsetof(AllocatorState, field), 0, NULL}
static PyMemberDef state_members[] = {
    STATE_MEMBER("_allocated_bytes", allocated_bytes, T_LONGLONG),
    STATE_MEMBER("_peak_allocated_bytes", peak_allocated_bytes, T_LONGLONG),
    STATE_MEMBER("_requested_bytes", requested_bytes, T_LONGLONG),
    STATE_MEMBER("_peak_requested_bytes", peak_requested_bytes, T_LONGLONG),
    STATE_MEMBER("_reserved_bytes", reserved_bytes, T_LONGLONG),
    STATE_MEMBER("_peak_reserved_bytes", peak_reserved_bytes, T_LONGLONG),
    STATE_MEMBER("_peak_cached_bytes", peak_cached_bytes, T_LONGLONG),
    STATE_MEMBER("_num_allocs", num_allocs, T_LONGLONG),
    STATE_MEMBER("_num_frees", num_frees, T_LONGLONG),
    STATE_MEMBER("_cache_misses", cache_misses, T_LONGLONG),
    STATE_MEMBER("_num_ooms", num_ooms, T_LONGLONG),
    STATE_MEMBER("_num_device_allocs", num_device_allocs, T_LONGLONG),
    STATE_MEMBER("_num_device_frees", num_device_frees, T_LONGLONG),
    STATE_MEMBER("_last_serial", last_serial, T_LONGLONG),
    STATE_MEMBER("_live", live, T_OBJECT),
    STATE_MEMBER("_lock", lock, T_OBJECT),
    STATE_MEMBER("device", device, T_OBJECT),
    STATE_MEMBER("_hot", hot, T_BOOL),
    STATE_MEMBER("_ordered", ordered, T_BOOL),
    STATE_MEMBER("_rounded", rounded, T_OBJECT),
    STATE_MEMBER("_small", small, T_OBJECT),
    STATE_MEMBER("_large", large, T_OBJECT),
    STATE_MEMBER("_small_size", small_size, T_LONGLONG),
    STATE_MEMBER("_idle", idle, T_OBJECT),
    STATE_MEMBER("_max_cached_bytes", max_cached_bytes, T_OBJECT),
    {NULL}
};

static PyTypeObject AllocatorStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.AllocatorState",
    .tp_basicsize = sizeof(AllocatorState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("AllocatorState()\n--\n\n"
                        "The state of an allocators.Allocator that C and Python share: counters,\n"
                        "serials, live allocations, the lock, and the caching hot path's fields."),
    .tp_new = state_new,
    .tp_traverse = (traverseproc)state_traverse,
    .tp_clear = (inquiry)state_clear,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_members = state_members,
    .tp_methods = state_methods,
};


/* ------------------------------------------------------------------------------ module */

static PyObject *
set_allocation_class(PyObject *Py_UNUSED(module), PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &AllocationRecordType)) {
        PyErr_SetString(PyExc_TypeError, "set_allocation_class() takes a subclass of "
                        "AllocationRecord");
        return NULL;
    }
    Py_XSETREF(allocation_class, (PyTypeObject *)Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_allocation_class", set_allocation_class, METH_O,
     PyDoc_STR("set_allocation_class(cls)\n--\n\n"
               "The class whose instances the hot path hands out (allocators.Allocation).")},
    {NULL, NULL}
};

static int
module_exec(PyObject *module)
{
    str_allocate_slow = PyUnicode_InternFromString("_allocate_slow");
    str_free_slow = PyUnicode_InternFromString("_free_slow");
    if (str_allocate_slow == NULL || str_free_slow == NULL) {
        return -1;
    }
    PyTypeObject *types[] = {&LockType, &AllocationRecordType, &BlockType, &PoolRecordType,
                             &AllocatorStateType};
    if (PyModule_AddIntConstant(module, "PRUNE_AFTER", PRUNE_AFTER) < 0) {
        return -1;
    }
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i]) < 0) {
            return -1;
        }
        const char *name = strrchr(types[i]->tp_name, '.') + 1;
        if (PyModule_AddObjectRef(module, name, (PyObject *)types[i]) < 0) {
            return -1;
        }
    }
    return 0;
}

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "allocators._speedups",
    .m_doc = "The C hot path of blockrt's caching allocator (see allocators/_speedups.c).",
    .m_size = -1,  /* NOTE: single-phase: static types and globals, one interpreter */
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *module = PyModule_Create(&speedups_module);
    if (module != NULL && module_exec(module) < 0) {
        Py_CLEAR(module);
    }
    return module;
}
