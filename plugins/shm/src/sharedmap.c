/* omni_plugins_shm._native.SharedMap: a shared read-write mapping of a file that holds no descriptor.
 *
 * Python's mmap.mmap keeps a dup() of the file descriptor for as long as the mapping lives (before
 * Python 3.13 there is no way to say no), so every segment a producer pools and every segment a
 * consumer keeps mapped costs one descriptor of the process's RLIMIT_NOFILE, on top of whatever the
 * application holds. The kernel needs none: a mapping keeps its file (and inode) alive by itself.
 * map_shared(fd, length) maps and returns; the caller closes fd at once.
 *
 * The object exports its memory through the buffer protocol like mmap.mmap: close() raises
 * BufferError while any buffer (memoryview, numpy array) is exported, the mapping is unmapped by
 * close() or when the object is freed (which cannot happen while an export holds a reference).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/mman.h>

#include "sharedmap.h"

typedef struct {
    PyObject_HEAD
    char *data;         /* NULL once closed */
    Py_ssize_t size;
    Py_ssize_t exports; /* buffers handed out and not released yet */
} SharedMap;

static int
sharedmap_unmap(SharedMap *self)
{
    if (self->data == NULL)
        return 0;
    int rc = munmap(self->data, (size_t)self->size);
    self->data = NULL;
    return rc;
}

static void
sharedmap_dealloc(SharedMap *self)
{
    sharedmap_unmap(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
sharedmap_getbuffer(SharedMap *self, Py_buffer *view, int flags)
{
    if (self->data == NULL) {
        PyErr_SetString(PyExc_ValueError, "shared mapping is closed");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->size, 0, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void
sharedmap_releasebuffer(SharedMap *self, Py_buffer *view)
{
    self->exports--;
}

static PyBufferProcs sharedmap_as_buffer = {
    (getbufferproc)sharedmap_getbuffer,
    (releasebufferproc)sharedmap_releasebuffer,
};

static Py_ssize_t
sharedmap_length(SharedMap *self)
{
    if (self->data == NULL) {
        PyErr_SetString(PyExc_ValueError, "shared mapping is closed");
        return -1;
    }
    return self->size;
}

static PySequenceMethods sharedmap_as_sequence = {
    .sq_length = (lenfunc)sharedmap_length,
};

PyDoc_STRVAR(close_doc, "close() -> None\n\nUnmap (idempotent). BufferError while a buffer of it is exported.");

static PyObject *
sharedmap_close(SharedMap *self, PyObject *unused)
{
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "cannot close exported pointers exist");
        return NULL;
    }
    if (sharedmap_unmap(self) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *
sharedmap_closed(SharedMap *self, void *unused)
{
    return PyBool_FromLong(self->data == NULL);
}

static PyMethodDef sharedmap_methods[] = {
    {"close", (PyCFunction)sharedmap_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef sharedmap_getset[] = {
    {"closed", (getter)sharedmap_closed, NULL, "True once unmapped", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SharedMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "omni_plugins_shm._native.SharedMap",
    .tp_doc = "A MAP_SHARED read-write mapping that holds no file descriptor (made by map_shared).",
    .tp_basicsize = sizeof(SharedMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)sharedmap_dealloc,
    .tp_as_buffer = &sharedmap_as_buffer,
    .tp_as_sequence = &sharedmap_as_sequence,
    .tp_methods = sharedmap_methods,
    .tp_getset = sharedmap_getset,
};

PyDoc_STRVAR(map_shared_doc,
             "map_shared(fd, length) -> SharedMap\n\n"
             "mmap(length, PROT_READ | PROT_WRITE, MAP_SHARED) of the open file fd, keeping no descriptor: close fd\n"
             "afterwards. OSError with the mmap errno (ENOMEM: address space or vm.max_map_count).");

static PyObject *
native_map_shared(PyObject *module, PyObject *args)
{
    int fd;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "in:map_shared", &fd, &length))
        return NULL;
    if (length <= 0) {
        PyErr_SetString(PyExc_ValueError, "map_shared: length must be positive");
        return NULL;
    }
    SharedMap *self = PyObject_New(SharedMap, &SharedMapType);
    if (self == NULL)
        return NULL;
    self->data = NULL;
    self->size = length;
    self->exports = 0;
    void *p;
    Py_BEGIN_ALLOW_THREADS
    p = mmap(NULL, (size_t)length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    Py_END_ALLOW_THREADS
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->data = (char *)p;
    return (PyObject *)self;
}

static PyMethodDef sharedmap_functions[] = {
    {"map_shared", native_map_shared, METH_VARARGS, map_shared_doc},
    {NULL, NULL, 0, NULL},
};

int
sharedmap_add(PyObject *module)
{
    if (PyType_Ready(&SharedMapType) < 0)
        return -1;
    Py_INCREF(&SharedMapType);
    if (PyModule_AddObject(module, "SharedMap", (PyObject *)&SharedMapType) < 0) {
        Py_DECREF(&SharedMapType);
        return -1;
    }
    return PyModule_AddFunctions(module, sharedmap_functions);
}
