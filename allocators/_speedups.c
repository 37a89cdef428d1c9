/* allocators._speedups: the C hot path of blockrt's caching allocator.

   allocators/base.py and allocators/caching.py are the complete reference implementation. This
   module only makes their most common case fast, as CPython's _heapq or _bisect do for heapq and
   bisect: allocators/_core.py imports it when it is built (and BLOCKRT_PURE_PYTHON is not set)
   and defines the same names in Python otherwise.

   What it holds:
   - Lock: a plain non-reentrant lock (acquire, release, locked, a context manager). A blocking
     acquire releases the GIL while it waits. The Python path holds it around every change.
   - AllocationRecord, Block, FreeList, PoolRecord, IdleRecord: the fields of
     allocators.Allocation, of the caching allocator's blocks, free lists and pools and of its
     LRU list of whole free segments, as C structs. Python reads and writes them through member
     descriptors, so C and Python share one state, not two copies.
   - AllocatorState: the base of allocators.Allocator: the counters (allocators.base.COUNTERS,
     as attributes named "_" + key), the serial counter, the live allocations, the lock, and the
     fields the caching hot path reads. Its methods _caching_allocate / _caching_free serve a
     request from the cache (best fit, split, coalesce) and call self._allocate_slow /
     self._free_slow, the Python implementation, for anything else: a size never rounded or
     never listed, a new segment, pruning, trimming, errors, or a lock held by someone else.
     _book_allocation / _book_free keep the books of every allocator's Python path
     (allocators.base.Allocator.allocate / free), with the hot path's own code: from Python,
     a C counter costs a generic attribute lookup and a new int at every touch.

   What a hit costs: one lookup of the request size (the memo `_rounded`), one of the block size
   (the pool's `buckets`, which give its FreeList), and the live set's insertion; its free, the
   live set's lookup and deletion. A free list, the block's place on it (Block.free_list) and
   the LRU list are pointers the C code moves; a free looks a list up by size only when it
   merges, or when the list its block names was pruned.

   The rules of the hot path are Note [the hot path runs no Python] in allocators/_core.py: it
   runs only while the allocator's lock is free, keeps the GIL, runs no Python code and creates
   no object that the garbage collector tracks from its first check to its last change, and
   makes every check that can fail before the first change. In C that means: the new Allocation
   is created before the checks; after them there are only dict operations on int keys (whose
   hashing and equality are C), ints, pointer moves between records whose types were checked,
   and reference counts that cannot reach zero.

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

/* Wait for the lock without the GIL, up to `timeout` seconds (-1: for as long as it takes). */
static PyObject *
lock_wait(LockObject *self, double timeout)
{
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
    return lock_wait(self, timeout);
}

/* acquire() for the with statement: the Python path takes the lock this way in every allocate
   and free, so it parses no arguments. */
static PyObject *
lock_enter(LockObject *self, PyObject *Py_UNUSED(ignored))
{
    if (lock_try(self)) {
        Py_RETURN_TRUE;
    }
    return lock_wait(self, -1);
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
lock_exit(LockObject *self, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs))
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
    {"__enter__", (PyCFunction)lock_enter, METH_NOARGS,
     PyDoc_STR("acquire(), for the with statement.")},
    {"release", (PyCFunction)lock_release_method, METH_NOARGS,
     PyDoc_STR("release()\n\nRelease the lock; RuntimeError if it is not held.")},
    {"__exit__", (PyCFunction)(void (*)(void))lock_exit, METH_FASTCALL,
     PyDoc_STR("release().")},
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

/* The three ints of Allocation(device, raw, offset, nbytes, size) given by position, taken as
   PyArg_ParseTupleAndKeywords takes "L" (an int, or an object with __index__; a float is
   refused with the same TypeError); 0, or -1 with an exception set. */
static int
record_ints(PyObject *args, long long *offset, long long *nbytes, long long *size)
{
    long long *fields[3] = {offset, nbytes, size};
    for (int i = 0; i < 3; i++) {
        *fields[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args, i + 2));
        if (*fields[i] == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

static int
record_init(AllocationRecord *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "raw", "offset", "nbytes", "size", "upstream", NULL};
    PyObject *device, *raw, *upstream = Py_None;
    long long offset, nbytes, size;
    Py_ssize_t given = PyTuple_GET_SIZE(args);
    /* NOTE: allocators make one per allocation, by position: no argument parser for that */
    if ((kwds == NULL || PyDict_GET_SIZE(kwds) == 0) && (given == 5 || given == 6)) {
        if (record_ints(args, &offset, &nbytes, &size) < 0) {
            return -1;
        }
        device = PyTuple_GET_ITEM(args, 0);
        raw = PyTuple_GET_ITEM(args, 1);
        if (given == 6) {
            upstream = PyTuple_GET_ITEM(args, 5);
        }
    }
    else if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLL|O:Allocation", kwlist, &device,
                                          &raw, &offset, &nbytes, &size, &upstream)) {
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
    PyObject *free_list;  /* a FreeList of its size: the one it is on while free */
    PyObject *prev_idle;  /* neighbours in the LRU list, while the head of a whole free segment */
    PyObject *next_idle;
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
    Py_VISIT(self->free_list);
    Py_VISIT(self->prev_idle);
    Py_VISIT(self->next_idle);
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
    Py_CLEAR(self->free_list);
    Py_CLEAR(self->prev_idle);
    Py_CLEAR(self->next_idle);
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
    BLOCK_MEMBER(free_list, T_OBJECT),
    BLOCK_MEMBER(prev_idle, T_OBJECT),
    BLOCK_MEMBER(next_idle, T_OBJECT),
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
/* A link field that holds a Block or none: what the hot path checks before it follows one. */
#define IS_LINK(op) (IS_NONE(op) || IS_BLOCK(op))


/* ------------------------------------------------------------------------------ FreeList */

/* The free blocks of one size in one pool (allocators/_core.py, FreeList): `first`, then on
   through the blocks' next_free. `listed`: whether its pool's `buckets` holds it. */
typedef struct {
    PyObject_HEAD
    long long size;
    PyObject *first;
    char listed;
} FreeListObject;

static PyTypeObject FreeListType;

static int
free_list_init(FreeListObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"size", NULL};
    long long size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L:FreeList", kwlist, &size)) {
        return -1;
    }
    self->size = size;
    Py_XSETREF(self->first, Py_NewRef(Py_None));
    self->listed = 1;
    return 0;
}

static int
free_list_traverse(FreeListObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->first);
    return 0;
}

static int
free_list_clear(FreeListObject *self)
{
    Py_CLEAR(self->first);
    return 0;
}

static void
free_list_dealloc(FreeListObject *self)
{
    PyObject_GC_UnTrack(self);
    free_list_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define FREE_LIST_MEMBER(name, type) {#name, type, offsetof(FreeListObject, name), 0, NULL}
static PyMemberDef free_list_members[] = {
    FREE_LIST_MEMBER(size, T_LONGLONG),
    FREE_LIST_MEMBER(first, T_OBJECT),
    FREE_LIST_MEMBER(listed, T_BOOL),
    {NULL}
};

static PyTypeObject FreeListType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.FreeList",
    .tp_basicsize = sizeof(FreeListObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("FreeList(size)\n--\n\n"
                        "The free blocks of one size in one pool of the caching allocator\n"
                        "(allocators._core.FreeList)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)free_list_init,
    .tp_traverse = (traverseproc)free_list_traverse,
    .tp_clear = (inquiry)free_list_clear,
    .tp_dealloc = (destructor)free_list_dealloc,
    .tp_members = free_list_members,
};

#define AS_FREE_LIST(op) ((FreeListObject *)(op))
#define IS_FREE_LIST(op) ((op) != NULL && Py_IS_TYPE((op), &FreeListType))


/* ------------------------------------------------------------------------------ PoolRecord */

typedef struct {
    PyObject_HEAD
    PyObject *name;
    long long min_split;
    PyObject *buckets;  /* dict: block size -> FreeList of that size */
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



/* ------------------------------------------------------------------------------ IdleRecord */

/* The heads of whole free segments, least recently freed first, linked through their
   prev_idle / next_idle (allocators/caching.py, _Idle). */
typedef struct {
    PyObject_HEAD
    PyObject *oldest;
    PyObject *newest;
} IdleRecord;

static PyTypeObject IdleRecordType;

static int
idle_traverse(IdleRecord *self, visitproc visit, void *arg)
{
    Py_VISIT(self->oldest);
    Py_VISIT(self->newest);
    return 0;
}

static int
idle_clear(IdleRecord *self)
{
    Py_CLEAR(self->oldest);
    Py_CLEAR(self->newest);
    return 0;
}

static void
idle_dealloc(IdleRecord *self)
{
    PyObject_GC_UnTrack(self);
    idle_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define IDLE_MEMBER(name, type) {#name, type, offsetof(IdleRecord, name), 0, NULL}
static PyMemberDef idle_members[] = {
    IDLE_MEMBER(oldest, T_OBJECT),
    IDLE_MEMBER(newest, T_OBJECT),
    {NULL}
};

static PyTypeObject IdleRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "allocators._speedups.IdleRecord",
    .tp_basicsize = sizeof(IdleRecord),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("IdleRecord()\n--\n\n"
                        "The fields of the caching allocator's LRU list of whole free segments\n"
                        "(caching._Idle)."),
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)idle_traverse,
    .tp_clear = (inquiry)idle_clear,
    .tp_dealloc = (destructor)idle_dealloc,
    .tp_members = idle_members,
};


/* ------------------------------------------------------------------------------ lists */

/* Replace a strong-reference field. Under the allocator's lock, the old value must not reach
   refcount zero unless its deallocation runs no Python code (see the module comment). */
#define SET_FIELD(field, value) Py_XSETREF((field), Py_NewRef(value))
#define OR_NONE(op) (IS_NONE(op) ? Py_None : (op))

/* Whether `list` may take blocks: a FreeList its pool lists, whose first is a Block or none. */
static inline int
freelist_ready(PyObject *list)
{
    return IS_FREE_LIST(list) && AS_FREE_LIST(list)->listed && IS_LINK(AS_FREE_LIST(list)->first);
}

/* Whether the free `block` is on a free list the hot path can take it off: its `free_list`
   (listed, of its size), which starts with it when it has no free neighbour before it. */
static inline int
freelist_holds(BlockObject *block)
{
    PyObject *list = block->free_list;
    if (!freelist_ready(list) || AS_FREE_LIST(list)->size != block->size
            || !IS_LINK(block->prev_free) || !IS_LINK(block->next_free)) {
        return 0;
    }
    return !IS_NONE(block->prev_free) || AS_FREE_LIST(list)->first == (PyObject *)block;
}

/* _Pool.remove: take the free `block` off its free list (freelist_holds(block) said it may).
   The list's references on `block` go, so the caller must hold one; it keeps naming the list. */
static void
freelist_remove(BlockObject *block)
{
    PyObject *before = OR_NONE(block->prev_free);  /* both held by `block` until the end */
    PyObject *after = OR_NONE(block->next_free);
    if (before == Py_None) {
        SET_FIELD(AS_FREE_LIST(block->free_list)->first, after);  /* it was the first */
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

/* _Pool.push: make the free `block` the first of `list` (freelist_ready(list), of its size). */
static void
freelist_push(FreeListObject *list, BlockObject *block)
{
    PyObject *first = OR_NONE(list->first);
    SET_FIELD(block->prev_free, Py_None);
    SET_FIELD(block->next_free, first);
    if (first != Py_None) {
        SET_FIELD(AS_BLOCK(first)->prev_free, (PyObject *)block);
    }
    SET_FIELD(list->first, (PyObject *)block);  /* NOTE: the old first is held by `block` */
    SET_FIELD(block->free_list, (PyObject *)list);
}

/* _Idle.__contains__ for a head block, and whether its links and the list's ends are Blocks or
   none (what idle_remove / idle_append follow). */
static inline int
idle_ready(IdleRecord *idle, BlockObject *head)
{
    return IS_LINK(idle->oldest) && IS_LINK(idle->newest) && IS_LINK(head->prev_idle)
           && IS_LINK(head->next_idle);
}

static inline int
idle_contains(IdleRecord *idle, BlockObject *head)
{
    return !IS_NONE(head->prev_idle) || idle->oldest == (PyObject *)head;
}

/* _Idle.discard for a head that is in (idle_ready and idle_contains said so); the caller holds
   a reference on `head`, whose list references go. */
static void
idle_remove(IdleRecord *idle, BlockObject *head)
{
    PyObject *before = OR_NONE(head->prev_idle);  /* both held by `head` until the end */
    PyObject *after = OR_NONE(head->next_idle);
    if (before == Py_None) {
        SET_FIELD(idle->oldest, after);
    }
    else {
        SET_FIELD(AS_BLOCK(before)->next_idle, after);
    }
    if (after == Py_None) {
        SET_FIELD(idle->newest, before);
    }
    else {
        SET_FIELD(AS_BLOCK(after)->prev_idle, before);
    }
    SET_FIELD(head->prev_idle, Py_None);
    SET_FIELD(head->next_idle, Py_None);
}

/* _Idle.append: `head` (not in, idle_ready) becomes the newest. */
static void
idle_append(IdleRecord *idle, BlockObject *head)
{
    PyObject *last = OR_NONE(idle->newest);
    SET_FIELD(head->prev_idle, last);
    SET_FIELD(head->next_idle, Py_None);
    if (last == Py_None) {
        SET_FIELD(idle->oldest, (PyObject *)head);
    }
    else {
        SET_FIELD(AS_BLOCK(last)->next_idle, (PyObject *)head);
    }
    SET_FIELD(idle->newest, (PyObject *)head);
}

/* Must equal allocators.caching._PRUNE_AFTER (a test checks): a best-fit search that steps over
   more empty sizes than this prunes them, which the Python path does. */
#define PRUNE_AFTER 16

/* _Pool.take_best_fit without the taking: the free list of the smallest listed size >= size
   that has a block (borrowed). NULL where the Python path must act: no block fits (a new
   segment), the search would prune, or the pool is not as expected. Changes nothing. */
static FreeListObject *
best_fit(PoolRecord *pool, long long size)
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
        PyObject *list = PyDict_GetItemWithError(buckets, PyList_GET_ITEM(sizes, index));
        if (!freelist_ready(list)) {
            return NULL;  /* a size without a list, or an error: the Python path tells */
        }
        if (IS_BLOCK(AS_FREE_LIST(list)->first)) {
            return AS_FREE_LIST(list);
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
       ordered reuse): True or False; read by Python only, as a slot that CPython's specializing
       interpreter reads in a few instructions (it does so for object slots only) */
    PyObject *ordered;
    PyObject *rounded;          /* dict: request bytes -> block bytes */
    /* NOTE: small, large and idle are records of their kind or NULL: their setters check */
    PyObject *small;            /* PoolRecord of blocks <= small_size */
    PyObject *large;            /* PoolRecord of larger blocks */
    long long small_size;
    PyObject *idle;             /* IdleRecord: the heads of whole free segments, LRU order */
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
    self->ordered = Py_NewRef(Py_False);
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
    Py_VISIT(self->ordered);
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
    Py_CLEAR(self->ordered);
    return 0;
}

static void
state_dealloc(AllocatorState *self)
{
    PyObject_GC_UnTrack(self);
    state_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The counters of AllocatorState._book_allocation (allocators/_core.py): one allocation of
   `size` bytes for a request of `nbytes`, that needed a device allocation if `missed`. */
static inline void
count_allocation(AllocatorState *self, long long size, long long nbytes, int missed)
{
    self->num_allocs += 1;
    self->cache_misses += missed;
    self->allocated_bytes += size;
    self->requested_bytes += nbytes;
    if (self->allocated_bytes > self->peak_allocated_bytes) {
        self->peak_allocated_bytes = self->allocated_bytes;
    }
    if (self->requested_bytes > self->peak_requested_bytes) {
        self->peak_requested_bytes = self->requested_bytes;
    }
    /* NOTE: a new segment may leave some of itself cached */
    if (self->reserved_bytes - self->allocated_bytes > self->peak_cached_bytes) {
        self->peak_cached_bytes = self->reserved_bytes - self->allocated_bytes;
    }
}

/* The counters of AllocatorState._book_free: one allocation of `size` bytes given back. */
static inline void
count_free(AllocatorState *self, long long size, long long nbytes)
{
    self->num_frees += 1;
    self->allocated_bytes -= size;
    self->requested_bytes -= nbytes;
    if (self->reserved_bytes - self->allocated_bytes > self->peak_cached_bytes) {
        self->peak_cached_bytes = self->reserved_bytes - self->allocated_bytes;
    }
}

PyDoc_STRVAR(book_allocation_doc,
"_book_allocation(allocation, nbytes, device_allocs) -> None\n\n"
"Allocator.allocate's books for `allocation`, just made by `_allocate` for a request of\n"
"`nbytes` with the lock held: its owner, serial and live flag, the live set, and the counters\n"
"(a cache miss if `_num_device_allocs` moved from `device_allocs`). Changes nothing if it\n"
"raises.");

static PyObject *
state_book_allocation(AllocatorState *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyObject_TypeCheck(args[0], &AllocationRecordType)) {
        PyErr_SetString(PyExc_TypeError, "_book_allocation(allocation, nbytes, device_allocs)");
        return NULL;
    }
    AllocationRecord *allocation = (AllocationRecord *)args[0];
    long long nbytes = PyLong_AsLongLong(args[1]);
    long long device_allocs = nbytes == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (self->live == NULL || !PyDict_Check(self->live)) {
        PyErr_SetString(PyExc_TypeError, "_live is not a dict");
        return NULL;
    }
    long long serial = self->last_serial + 1;
    PyObject *serial_key = PyLong_FromLongLong(serial);
    if (serial_key == NULL || PyDict_SetItem(self->live, serial_key, args[0]) < 0) {
        Py_XDECREF(serial_key);
        return NULL;
    }
    self->last_serial = serial;
    Py_XSETREF(allocation->owner, Py_NewRef((PyObject *)self));
    Py_XSETREF(allocation->serial, serial_key);  /* NOTE: the live set's key object itself */
    allocation->live = 1;
    count_allocation(self, allocation->size, nbytes, self->num_device_allocs != device_allocs);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(book_free_doc,
"_book_free(allocation) -> None\n\n"
"Allocator.free's books for `allocation`, off the live set and given to `_free` with the lock\n"
"held: the counters.");

static PyObject *
state_book_free(AllocatorState *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &AllocationRecordType)) {
        PyErr_SetString(PyExc_TypeError, "_book_free(allocation)");
        return NULL;
    }
    AllocationRecord *allocation = (AllocationRecord *)arg;
    count_free(self, allocation->size, allocation->nbytes);
    Py_RETURN_NONE;
}

static PyObject *
call_slow(PyObject *self, PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {self, arg};
    return PyObject_VectorcallMethod(name, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* A field of the state that takes only instances of one record type (and cannot be deleted),
   so the hot path needs no subtype check: `_small`, `_large` (PoolRecord), `_idle` (IdleRecord). */
typedef struct {
    const char *name;
    size_t offset;
    PyTypeObject *type;
} RecordField;

static RecordField small_field = {"_small", offsetof(AllocatorState, small), &PoolRecordType};
static RecordField large_field = {"_large", offsetof(AllocatorState, large), &PoolRecordType};
static RecordField idle_field = {"_idle", offsetof(AllocatorState, idle), &IdleRecordType};

static PyObject *
state_get_record(AllocatorState *self, RecordField *field)
{
    PyObject *value = *(PyObject **)((char *)self + field->offset);
    return Py_NewRef(value != NULL ? value : Py_None);
}

static int
state_set_record(AllocatorState *self, PyObject *value, RecordField *field)
{
    if (value == NULL || !PyObject_TypeCheck(value, field->type)) {
        PyErr_Format(PyExc_TypeError, "%s takes a %s, not %s", field->name,
                     strrchr(field->type->tp_name, '.') + 1,
                     value == NULL ? "a deletion" : Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_XSETREF(*(PyObject **)((char *)self + field->offset), Py_NewRef(value));
    return 0;
}

/* Whether the fields the hot path reads have the types it relies on. */
static inline int
state_is_hot(AllocatorState *self)
{
    return (self->hot && allocation_class != NULL && self->lock != NULL
            && Py_IS_TYPE(self->lock, &LockType) && self->live != NULL
            && PyDict_CheckExact(self->live) && self->rounded != NULL
            && PyDict_CheckExact(self->rounded) && self->idle != NULL && self->small != NULL
            && self->large != NULL);
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
    PyObject *exact = PyDict_GetItemWithError(buckets, size_key);  /* its list, if listed */
    if (exact != NULL && (!freelist_ready(exact) || AS_FREE_LIST(exact)->size != size)) {
        goto slow;
    }
    FreeListObject *source = AS_FREE_LIST(exact);
    if (exact == NULL || !IS_BLOCK(source->first)) {
        source = best_fit(pool, size);
        if (source == NULL) {
            goto slow;  /* a new segment, or a search that prunes */
        }
    }
    BlockObject *block = AS_BLOCK(source->first);
    if (!block->free || block->size < size || block->pool != (PyObject *)pool
            || block->free_list != (PyObject *)source || !freelist_holds(block)
            || !IS_LINK(block->next)) {
        goto slow;
    }
    IdleRecord *idle = (IdleRecord *)self->idle;
    int whole_segment = IS_NONE(block->prev) && IS_NONE(block->next);
    if (whole_segment && !idle_ready(idle, block)) {
        goto slow;
    }
    /* _split: past min_split left over, the top `size` bytes become a block of their own (the
       spare one), and the rest stays free under its new size, which must be a listed size */
    long long rest = block->size - size;
    PyObject *rest_list = NULL;
    if (rest >= pool->min_split) {
        PyObject *rest_key = PyLong_FromLongLong(rest);  /* an int: not tracked by the GC */
        if (self->spare == NULL || rest_key == NULL) {
            Py_XDECREF(rest_key);
            goto slow;
        }
        rest_list = PyDict_GetItemWithError(buckets, rest_key);
        Py_DECREF(rest_key);
        if (!freelist_ready(rest_list) || AS_FREE_LIST(rest_list)->size != rest) {
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
    freelist_remove(block);
    if (whole_segment && idle_contains(idle, block)) {
        idle_remove(idle, block);  /* a whole free segment is in use again */
    }
    BlockObject *used = block;
    if (rest_list != NULL) {
        used = self->spare;  /* its reference becomes the handle */
        self->spare = NULL;
        SET_FIELD(used->raw, OR_NONE(block->raw));
        used->offset = block->offset + block->size - size;
        used->size = size;
        SET_FIELD(used->pool, (PyObject *)pool);
        SET_FIELD(used->prev_free, Py_None);
        SET_FIELD(used->next_free, Py_None);
        /* NOTE: as _allocate, the list its pool has for its size, if any */
        SET_FIELD(used->free_list, OR_NONE(exact));
        SET_FIELD(used->prev_idle, Py_None);
        SET_FIELD(used->next_idle, Py_None);
        PyObject *after = OR_NONE(block->next);
        SET_FIELD(used->next, after);
        if (after != Py_None) {
            SET_FIELD(AS_BLOCK(after)->prev, (PyObject *)used);
        }
        SET_FIELD(used->prev, (PyObject *)block);
        SET_FIELD(block->next, (PyObject *)used);
        block->size = rest;
        freelist_push(AS_FREE_LIST(rest_list), block);
        Py_DECREF(block);  /* held by `used` now */
    }
    /* NOTE: a block handed out whole keeps naming `source`, the list of its size */
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
    count_allocation(self, allocation->size, nbytes, 0);  /* a hit: no device allocation */
    if (self->spare == NULL) {  /* the next split's block, made after the changes */
        self->spare = (BlockObject *)BlockType.tp_alloc(&BlockType, 0);
        if (self->spare == NULL) {
            PyErr_Clear();  /* NOTE: no harm done: the next split goes the Python way */
        }
    }
    return (PyObject *)allocation;

slow:
    PyErr_Clear();
    Py_DECREF(allocation);
    if (self->spare == NULL) {
        self->spare = (BlockObject *)BlockType.tp_alloc(&BlockType, 0);
        if (self->spare == NULL) {
            return NULL;
        }
    }
    return call_slow((PyObject *)self, str_allocate_slow, arg);

error:
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
    PyObject *pool = block->pool;
    if ((pool != self->small && pool != self->large) || block->free
            || block->size != allocation->size || !IS_LINK(block->prev)
            || !IS_LINK(block->next)) {
        goto slow;
    }
    PyObject *buckets = ((PoolRecord *)pool)->buckets;
    if (buckets == NULL || !PyDict_CheckExact(buckets)
            || PyDict_GetItemWithError(self->live, serial_key) != arg) {
        goto slow;  /* not live here after all: the slow path says why */
    }
    /* _free: coalesce with a free next block, then with a free previous one */
    BlockObject *after = NULL, *before = NULL;
    long long merged = block->size;
    if (!IS_NONE(block->next) && AS_BLOCK(block->next)->free) {
        after = AS_BLOCK(block->next);
        merged += after->size;
        if (!freelist_holds(after) || !IS_LINK(after->next)) {
            goto slow;
        }
    }
    if (!IS_NONE(block->prev) && AS_BLOCK(block->prev)->free) {
        before = AS_BLOCK(block->prev);
        merged += before->size;
        if (!freelist_holds(before)) {
            goto slow;
        }
    }
    /* the list of the merged size: unmerged, the one the block names while its pool lists it
       (no lookup); else the pool's list of that size, which must be listed already */
    PyObject *target = block->free_list;
    if (after != NULL || before != NULL || !freelist_ready(target)
            || AS_FREE_LIST(target)->size != merged) {
        PyObject *merged_key = PyLong_FromLongLong(merged);  /* an int: not tracked by the GC */
        if (merged_key == NULL) {
            goto slow;
        }
        target = PyDict_GetItemWithError(buckets, merged_key);
        Py_DECREF(merged_key);
        if (!freelist_ready(target) || AS_FREE_LIST(target)->size != merged) {
            goto slow;  /* a size never listed in this pool: it needs a place in `sizes` */
        }
    }
    BlockObject *result = before != NULL ? before : block;
    PyObject *beyond = OR_NONE(after != NULL ? after->next : block->next);
    IdleRecord *idle = (IdleRecord *)self->idle;
    int whole_segment = IS_NONE(result->prev) && beyond == Py_None;
    if (whole_segment && (!idle_ready(idle, result) || idle_contains(idle, result))) {
        goto slow;
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
        freelist_remove(after);
        block->size += after->size;
        SET_FIELD(block->next, beyond);
        if (beyond != Py_None) {
            SET_FIELD(AS_BLOCK(beyond)->prev, (PyObject *)block);
        }
    }
    if (before != NULL) {
        freelist_remove(before);  /* held by its own neighbours */
        before->size += block->size;
        SET_FIELD(before->next, beyond);
        if (beyond != Py_None) {
            SET_FIELD(AS_BLOCK(beyond)->prev, (PyObject *)before);
        }
    }
    else {
        block->free = 1;
    }
    freelist_push(AS_FREE_LIST(target), result);
    if (whole_segment) {
        idle_append(idle, result);  /* the whole segment is free: newest in the LRU order */
    }
    count_free(self, allocation->size, allocation->nbytes);
    Py_XDECREF(after);
    Py_XDECREF(handle);
    Py_XDECREF(raw);
    Py_RETURN_NONE;

slow:
    PyErr_Clear();
    return call_slow((PyObject *)self, str_free_slow, arg);
}

static PyMethodDef state_methods[] = {
    {"_caching_allocate", (PyCFunction)state_caching_allocate, METH_O, caching_allocate_doc},
    {"_caching_free", (PyCFunction)state_caching_free, METH_O, caching_free_doc},
    {"_book_allocation", (PyCFunction)(void (*)(void))state_book_allocation, METH_FASTCALL,
     book_allocation_doc},
    {"_book_free", (PyCFunction)state_book_free, METH_O, book_free_doc},
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
    /* NOTE: object slots are T_OBJECT_EX (AttributeError while unset, as in the Python class):
       the specializing interpreter reads and writes only those in a few instructions */
    STATE_MEMBER("_live", live, T_OBJECT_EX),
    STATE_MEMBER("_lock", lock, T_OBJECT_EX),
    STATE_MEMBER("device", device, T_OBJECT_EX),
    STATE_MEMBER("_hot", hot, T_BOOL),
    STATE_MEMBER("_ordered", ordered, T_OBJECT_EX),
    STATE_MEMBER("_rounded", rounded, T_OBJECT_EX),
    STATE_MEMBER("_small_size", small_size, T_LONGLONG),
    STATE_MEMBER("_max_cached_bytes", max_cached_bytes, T_OBJECT_EX),
    {NULL}
};

#define RECORD_FIELD(name, field) \
    {name, (getter)state_get_record, (setter)state_set_record, NULL, (void *)&(field)}
static PyGetSetDef state_getset[] = {
    RECORD_FIELD("_small", small_field),
    RECORD_FIELD("_large", large_field),
    RECORD_FIELD("_idle", idle_field),
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
    .tp_getset = state_getset,
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

/* The hot path as allocate / free of one class (see caching_methods). */
static PyMethodDef caching_defs[] = {
    {"allocate", (PyCFunction)state_caching_allocate, METH_O, caching_allocate_doc},
    {"free", (PyCFunction)state_caching_free, METH_O, caching_free_doc},
};

static PyObject *
caching_methods(PyObject *Py_UNUSED(module), PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &AllocatorStateType)) {
        PyErr_SetString(PyExc_TypeError, "caching_methods() takes a subclass of AllocatorState");
        return NULL;
    }
    PyObject *allocate = PyDescr_NewMethod((PyTypeObject *)cls, &caching_defs[0]);
    PyObject *free = PyDescr_NewMethod((PyTypeObject *)cls, &caching_defs[1]);
    PyObject *pair = allocate != NULL && free != NULL ? PyTuple_Pack(2, allocate, free) : NULL;
    Py_XDECREF(allocate);
    Py_XDECREF(free);
    return pair;
}

static PyMethodDef module_methods[] = {
    {"set_allocation_class", set_allocation_class, METH_O,
     PyDoc_STR("set_allocation_class(cls)\n--\n\n"
               "The class whose instances the hot path hands out (allocators.Allocation).")},
    {"caching_methods", caching_methods, METH_O,
     PyDoc_STR("caching_methods(cls) -> (allocate, free)\n--\n\n"
               "The hot path (AllocatorState._caching_allocate / _caching_free) as method\n"
               "descriptors of `cls`, a subclass of AllocatorState. CPython 3.11 specializes a\n"
               "call of a C method only for instances of exactly the class its descriptor\n"
               "names: `alloc.allocate(n)` on a CachingAllocator takes the fast call this way,\n"
               "the generic one with AllocatorState's.")},
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
    PyTypeObject *types[] = {&LockType, &AllocationRecordType, &BlockType, &FreeListType,
                             &PoolRecordType, &IdleRecordType, &AllocatorStateType};
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
