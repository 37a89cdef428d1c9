/* The malloc and free that PyTorch's CUDAPluggableAllocator loads, by path and by name, for
 * backends.cuda.use_with_torch (docs/embedding.md).
 *
 * Each forwards to a function that blockrt registers from Python with blockrt_torch_hooks: a
 * ctypes callback, which takes the GIL itself on whatever thread PyTorch calls from, so
 * nothing here touches Python or CUDA. The signatures are PyTorch's: malloc(size, device,
 * stream) and free(ptr, size, device, stream), the stream a cudaStream_t (a pointer). A module
 * of no functions is defined too, so that Python can import the file it is built into. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <sys/types.h>

typedef void *(*blockrt_malloc_fn)(ssize_t size, int device, void *stream);
typedef void (*blockrt_free_fn)(void *ptr, ssize_t size, int device, void *stream);

static _Atomic(blockrt_malloc_fn) hook_malloc;
static _Atomic(blockrt_free_fn) hook_free;

/* Register the functions the two below forward to (NULL for none: malloc then returns NULL,
 * which PyTorch reports as out of memory, and free does nothing). */
void blockrt_torch_hooks(blockrt_malloc_fn malloc_fn, blockrt_free_fn free_fn)
{
    atomic_store(&hook_malloc, malloc_fn);
    atomic_store(&hook_free, free_fn);
}

void *blockrt_torch_malloc(ssize_t size, int device, void *stream)
{
    blockrt_malloc_fn fn = atomic_load(&hook_malloc);
    return fn ? fn(size, device, stream) : NULL;
}

void blockrt_torch_free(void *ptr, ssize_t size, int device, void *stream)
{
    blockrt_free_fn fn = atomic_load(&hook_free);
    if (fn)
        fn(ptr, size, device, stream);
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_torchalloc",
    "PyTorch's pluggable CUDA allocator entry points (C functions, loaded by path)", -1, NULL,
};

PyMODINIT_FUNC PyInit__torchalloc(void)
{
    return PyModule_Create(&module);
}
