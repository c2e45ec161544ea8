/* omni_plugins_shm._native: the shm connector's hot syscalls without ctypes.
 *
 * 1. Wake-ups through a futex word in a shared mapping.
 *
 * A "wake slot" is two 32-bit words at a 4-aligned offset of a MAP_SHARED mapping:
 *   seq     -- bumped (atomically, seq_cst) by a producer after each publication
 *   waiters -- consumers currently inside wait() on this slot
 * bump():  seq += 1; if waiters: FUTEX_WAKE(seq, all)     (no syscall when nobody waits)
 * wait():  waiters += 1; if seq == expected: FUTEX_WAIT(seq, expected, timeout); waiters -= 1
 * The pair of seq_cst operations on both sides (Dekker) means a producer either sees the
 * waiter or the waiter sees the new seq; FUTEX_WAIT itself re-compares seq in the kernel.
 * Shared (not PRIVATE) futexes: the word is keyed by its page, so it works across processes.
 *
 * 2. rename_noreplace(src, dst): renameat2(RENAME_NOREPLACE) (the publishing rename); ctypes
 *    plus two fsencode calls cost ~10 us more per call on this VM than a plain C call.
 *
 * Only Linux. The pure-Python path (inotify, ctypes) is the fallback when this does not build.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE 1
#endif

static int
slot(PyObject *obj, Py_ssize_t off, Py_buffer *view, uint32_t **seq)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (off < 0 || (off & 3) || off + 8 > view->len || (((uintptr_t)view->buf + (uintptr_t)off) & 3)) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "wake slot offset %zd is not a 4-aligned slot of an %zd-byte buffer", off, view->len);
        return -1;
    }
    *seq = (uint32_t *)((char *)view->buf + off);
    return 0;
}

PyDoc_STRVAR(bump_doc, "bump(buffer, offset) -> bool\n\nAdd one to the slot's seq; wake every waiter if any. True if a wake was issued.");

static PyObject *
futex_bump(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    Py_buffer view;
    uint32_t *seq;
    if (!PyArg_ParseTuple(args, "On:bump", &obj, &off) || slot(obj, off, &view, &seq) < 0)
        return NULL;
    __atomic_add_fetch(seq, 1, __ATOMIC_SEQ_CST);
    int woke = 0;
    if (__atomic_load_n(seq + 1, __ATOMIC_SEQ_CST) != 0) {
        syscall(SYS_futex, seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        woke = 1;
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(woke);
}

PyDoc_STRVAR(load_doc, "load(buffer, offset) -> int\n\nThe slot's seq (an atomic load).");

static PyObject *
futex_load(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    Py_buffer view;
    uint32_t *seq;
    if (!PyArg_ParseTuple(args, "On:load", &obj, &off) || slot(obj, off, &view, &seq) < 0)
        return NULL;
    uint32_t v = __atomic_load_n(seq, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(v);
}

PyDoc_STRVAR(wait_doc,
             "wait(buffer, offset, expected, seconds) -> bool\n\n"
             "Sleep while the slot's seq equals expected, at most seconds (>= 0). False only on timeout;\n"
             "True when seq differs, a wake came, or a signal interrupted (callers re-check and loop).\n"
             "The GIL is released while sleeping.");

static PyObject *
futex_wait(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    unsigned long expected;
    double seconds;
    Py_buffer view;
    uint32_t *seq;
    if (!PyArg_ParseTuple(args, "Onkd:wait", &obj, &off, &expected, &seconds))
        return NULL;
    if (!(seconds >= 0.0)) {
        PyErr_SetString(PyExc_ValueError, "seconds must be >= 0");
        return NULL;
    }
    if (seconds > 86400.0)
        seconds = 86400.0;
    if (slot(obj, off, &view, &seq) < 0)
        return NULL;
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L)
        ts.tv_nsec = 999999999L;
    uint32_t *waiters = seq + 1;
    long rc = 0;
    int err = 0;
    __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(seq, __ATOMIC_SEQ_CST) == (uint32_t)expected) {
        Py_BEGIN_ALLOW_THREADS
        rc = syscall(SYS_futex, seq, FUTEX_WAIT, (uint32_t)expected, &ts, NULL, 0);
        err = errno;
        Py_END_ALLOW_THREADS
    }
    __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    if (rc == -1 && err == ETIMEDOUT)
        Py_RETURN_FALSE;
    if (rc == -1 && err == EINTR && PyErr_CheckSignals() < 0)
        return NULL;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(cas_doc,
             "cas(buffer, offset, expected, new) -> bool\n\n"
             "Atomically set the 32-bit word at offset to new if it equals expected (seq_cst). True if it did.\n"
             "(Used by bench_shm's floor of a claim without syscalls; the connector claims by rename.)");

static PyObject *
futex_cas(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    unsigned long expected, desired;
    Py_buffer view;
    uint32_t *word;
    if (!PyArg_ParseTuple(args, "Onkk:cas", &obj, &off, &expected, &desired) || slot(obj, off, &view, &word) < 0)
        return NULL;
    uint32_t want = (uint32_t)expected;
    int ok = __atomic_compare_exchange_n(word, &want, (uint32_t)desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(rename_doc,
             "rename_noreplace(src, dst) -> None\n\n"
             "renameat2(src, dst, RENAME_NOREPLACE): FileExistsError if dst exists, OSError otherwise\n"
             "(NotImplementedError if the kernel or filesystem lacks it: ENOSYS / EINVAL).");

static PyObject *
native_rename_noreplace(PyObject *self, PyObject *args)
{
    PyObject *src = NULL, *dst = NULL;
    if (!PyArg_ParseTuple(args, "O&O&:rename_noreplace", PyUnicode_FSConverter, &src, PyUnicode_FSConverter, &dst)) {
        Py_XDECREF(src);
        return NULL;
    }
    long rc;
    int err = 0;
    rc = syscall(SYS_renameat2, AT_FDCWD, PyBytes_AS_STRING(src), AT_FDCWD, PyBytes_AS_STRING(dst), RENAME_NOREPLACE);
    if (rc != 0)
        err = errno;
    PyObject *result = NULL;
    if (rc == 0) {
        result = Py_None;
        Py_INCREF(result);
    } else if (err == ENOSYS || err == EINVAL) {
        PyErr_SetString(PyExc_NotImplementedError, "renameat2(RENAME_NOREPLACE) is not supported here");
    } else {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObjects(PyExc_OSError, src, dst);
    }
    Py_DECREF(src);
    Py_DECREF(dst);
    return result;
}

static PyMethodDef methods[] = {
    {"rename_noreplace", native_rename_noreplace, METH_VARARGS, rename_doc},
    {"bump", futex_bump, METH_VARARGS, bump_doc},
    {"cas", futex_cas, METH_VARARGS, cas_doc},
    {"load", futex_load, METH_VARARGS, load_doc},
    {"wait", futex_wait, METH_VARARGS, wait_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "omni_plugins_shm._native", "Futex wake slots in shared mappings and renameat2 (see docs/shm.md).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
