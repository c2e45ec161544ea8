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
 * 3. The slot table (slot_*): payloads up to a slot size handed off by compare-and-swap (below).
 *
 * 4. map_shared / SharedMap (sharedmap.c): segment mappings that hold no file descriptor.
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
#include <string.h>

#include "sharedmap.h"

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

/* seq += 1; FUTEX_WAKE all only when a waiter is registered. 1 if a wake was issued. */
static int
bump_word(uint32_t *seq)
{
    __atomic_add_fetch(seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(seq + 1, __ATOMIC_SEQ_CST) == 0)
        return 0;
    syscall(SYS_futex, seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    return 1;
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
    int woke = bump_word(seq);
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

/* Sleep while *seq == expected, at most seconds (GIL released), with waiters (seq[1]) raised around it.
 * The syscall's result; *err its errno. */
static long
futex_sleep(uint32_t *seq, uint32_t expected, double seconds, int *err)
{
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L)
        ts.tv_nsec = 999999999L;
    uint32_t *waiters = seq + 1;
    long rc = 0;
    *err = 0;
    __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(seq, __ATOMIC_SEQ_CST) == expected) {
        Py_BEGIN_ALLOW_THREADS
        rc = syscall(SYS_futex, seq, FUTEX_WAIT, expected, &ts, NULL, 0);
        *err = errno;
        Py_END_ALLOW_THREADS
    }
    __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    return rc;
}

/* futex_sleep with its outcome read: 1 if it ran out its time, 0 if woken (or interrupted by a signal whose
 * handler did not raise: callers re-check and loop), -1 with the handler's exception set */
static int
sleep_checked(uint32_t *seq, uint32_t expected, double seconds)
{
    int err;
    long rc = futex_sleep(seq, expected, seconds, &err);
    if (rc == -1 && err == EINTR && PyErr_CheckSignals() < 0)
        return -1;
    return rc == -1 && err == ETIMEDOUT;
}

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
    int timed_out = sleep_checked(seq, (uint32_t)expected, seconds);
    PyBuffer_Release(&view);
    if (timed_out < 0)
        return NULL;
    return PyBool_FromLong(!timed_out);
}

PyDoc_STRVAR(spin_doc,
             "spin(buffer, offset, expected, seconds) -> bool\n\n"
             "Busy-poll while the slot's seq equals expected, at most seconds (0 <= seconds <= 1), with the GIL\n"
             "released and without a syscall per look. True when seq changed, False when the time ran out.\n"
             "Burns a core meanwhile: for waits of a millisecond or two right before an expected arrival, where a\n"
             "futex sleep would let the CPU go idle and the wake-up and the code after it run cold.");

static double
now_monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *
futex_spin(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    unsigned long expected;
    double seconds;
    Py_buffer view;
    uint32_t *seq;
    if (!PyArg_ParseTuple(args, "Onkd:spin", &obj, &off, &expected, &seconds))
        return NULL;
    if (!(seconds >= 0.0 && seconds <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "seconds must be in [0, 1] (spin is for short waits; sleep with wait)");
        return NULL;
    }
    if (slot(obj, off, &view, &seq) < 0)
        return NULL;
    int changed = 0;
    Py_BEGIN_ALLOW_THREADS
    double end = now_monotonic() + seconds;
    for (unsigned i = 0;; i++) {
        if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) != (uint32_t)expected) {
            changed = 1;
            break;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
        if ((i & 31) == 0 && now_monotonic() >= end)  /* the clock is a vDSO call: read it every 32 looks */
            break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(changed);
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

PyDoc_STRVAR(copy_doc,
             "copy(dst, src) -> None\n\n"
             "memcpy of the buffer src into the writable buffer dst (at least as long) with the GIL released: a get's copy\n"
             "out of a segment into the consumer's own memory, without holding up the process's other threads.");

static PyObject *
native_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer dst, src;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src)");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    int ok = dst.len >= src.len;
    if (ok) {
        /* both buffers stay exported meanwhile: neither can be unmapped or resized */
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "copy: dst is shorter than src");
        return NULL;
    }
    Py_RETURN_NONE;
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

/* 3. The slot table: payloads up to the largest slot size handed off without file syscalls (see slots.py,
 * docs/backends/shm.md).
 *
 * Table file layout (all little-endian, native atomics; the file is a MAP_SHARED tmpfs mapping):
 *   header (TBL_HDR bytes):
 *      0 magic "OMNISLT2"   8 u32 version   12 u32 slots (all classes)   16 u32 classes (1..MAX_CLASSES)
 *     24 u64 idle ns: a FREE slot of a class >= 1 left alone this long gives its pages back (0: never)
 *     32 u64 next trim (CLOCK_REALTIME ns; a put that finds it due wins it by CAS and trims)
 *     64 u64 file-path hint (FILES_OFF): file-path payloads table instances published and nobody consumed
 *        yet (raised before the publishing rename, lowered by the get that consumes one; it may be too high
 *        after a crash or a cleanup, never too low among table instances: 0 lets a waiting get skip its
 *        file-path claim attempt, see slot_take)
 *    128 class table (CLASS_OFF): per class 32 bytes: u32 slots, u32 first (global index of its slot 0),
 *        u64 slot_bytes, u64 stride, u64 offset. Classes ascend in slot_bytes; their regions ascend and do
 *        not overlap. A key probes a class's first PROBES slots (its hot window) and, in a larger class,
 *        PROBES more from its hash (probe_slot).
 *    512 + 64 c (COUNT_OFF): u64 for class c >= 1: an upper bound of its READY slots (raised before a slot
 *        becomes READY, lowered after it stopped being READY; too high after a crash, never too low): a
 *        look skips a class whose count is 0, so idle large classes cost small payloads nothing.
 *   slot j of class c at offset_c + j * stride_c (global index first_c + j):
 *     0  u64 state   = pid << 32 | (start & 0xFFFFFF) << 8 | kind   (kind: FREE 0, WRITING 1, READY 2, CLAIMED 3)
 *     8  u64 key hash (FNV-1a 64 of the UTF-8 key)
 *    16  u32 key length       20 u32 payload length
 *    24  f64 publish time (CLOCK_REALTIME seconds); in a FREE slot of a class >= 1 the time it was freed,
 *        0 once its pages were given back
 *    32  u32 producer instance tag
 *    36  u32 backed: payload bytes whose tmpfs pages are known to exist (so writes there cannot SIGBUS on a
 *        full tmpfs; 0 again once the trim gave them back)
 *    40  u64 producer start time (full)
 *    64  key bytes (<= SLOT_KEY_MAX)
 *   SLOT_HDR: payload bytes (<= slot_bytes of its class)
 * A slot changes hands only by compare-and-swap of its state word, so one claimer wins; the
 * owner (pid + start time) in the word lets gc reclaim WRITING/CLAIMED slots of dead processes
 * race-free (it CASes exactly the word it judged).
 */
#include <sys/mman.h>

#define TBL_HDR 4096
#define IDLE_OFF 24
#define TRIM_OFF 32
#define FILES_OFF 64
#define CLASS_OFF 128
#define CLASS_SIZE 32
#define COUNT_OFF 512
#define MAX_CLASSES 4
#define FILES_BIT ((uint64_t)1 << 32)
#define TIMED_OUT_BIT ((uint64_t)1 << 33)
#define SLOT_HDR 256
/* slot header fields (offsets from the slot's start; the layout above) */
#define SLOT_HASH_OFF 8
#define SLOT_KEYLEN_OFF 16
#define SLOT_LEN_OFF 20
#define SLOT_TIME_OFF 24
#define SLOT_TAG_OFF 32
#define SLOT_BACKED_OFF 36
#define SLOT_START_OFF 40
#define SLOT_KEY_OFF 64
#define SLOT_KEY_MAX (SLOT_HDR - SLOT_KEY_OFF)
#define S_FREE 0
#define S_WRITING 1
#define S_READY 2
#define S_CLAIMED 3
#define PROBES 16
/* copies at least this large run with the GIL released */
#define NOGIL_COPY (256 << 10)
#define PAGE 4096

typedef struct {
    uint32_t n, first;
    uint64_t slot_bytes, stride, off;
} class_t;

typedef struct {
    Py_buffer view;
    char *base;
    uint32_t nslots, nclasses;
    class_t cls[MAX_CLASSES];
} table_t;

static int
table_open(PyObject *obj, table_t *t)
{
    if (PyObject_GetBuffer(obj, &t->view, PyBUF_WRITABLE) < 0)
        return -1;
    t->base = (char *)t->view.buf;
    if (t->view.len < TBL_HDR || memcmp(t->base, "OMNISLT2", 8) != 0 || ((uintptr_t)t->base & 7))
        goto bad;
    memcpy(&t->nslots, t->base + 12, 4);
    memcpy(&t->nclasses, t->base + 16, 4);
    if (t->nclasses == 0 || t->nclasses > MAX_CLASSES)
        goto bad;
    uint64_t end = TBL_HDR, total = 0;
    for (uint32_t c = 0; c < t->nclasses; c++) {
        class_t *k = &t->cls[c];
        const char *e = t->base + CLASS_OFF + c * CLASS_SIZE;
        memcpy(&k->n, e, 4);
        memcpy(&k->first, e + 4, 4);
        memcpy(&k->slot_bytes, e + 8, 8);
        memcpy(&k->stride, e + 16, 8);
        memcpy(&k->off, e + 24, 8);
        if (k->n == 0 || k->n > (1u << 20) || k->first != total || k->stride < SLOT_HDR + k->slot_bytes || (k->stride & 63) ||
            k->stride > ((uint64_t)1 << 34) || k->off < end || (k->off & 63) ||
            (c > 0 && k->slot_bytes <= t->cls[c - 1].slot_bytes))
            goto bad;
        end = k->off + (uint64_t)k->n * k->stride;
        total += k->n;
    }
    if (total != t->nslots || end > (uint64_t)t->view.len)
        goto bad;
    return 0;
bad:
    PyBuffer_Release(&t->view);
    PyErr_SetString(PyExc_ValueError, "slot table header is invalid");
    return -1;
}

/* slot j of class c (j < n) */
static inline char *
class_slot(table_t *t, uint32_t c, uint64_t j)
{
    class_t *k = &t->cls[c];
    return t->base + k->off + (j % k->n) * k->stride;
}

/* the slot of global index i, its class in *c; NULL if there is none */
static char *
slot_at(table_t *t, uint64_t i, uint32_t *c)
{
    for (uint32_t k = 0; k < t->nclasses; k++) {
        if (i < (uint64_t)t->cls[k].first + t->cls[k].n) {
            *c = k;
            return class_slot(t, k, i - t->cls[k].first);
        }
    }
    return NULL;
}

/* table_open + the slot of global index i (IndexError otherwise; the view is released on error) */
static char *
table_open_at(PyObject *obj, Py_ssize_t i, table_t *t, uint32_t *c)
{
    if (table_open(obj, t) < 0)
        return NULL;
    char *s = i < 0 ? NULL : slot_at(t, (uint64_t)i, c);
    if (s == NULL) {
        PyBuffer_Release(&t->view);
        PyErr_SetString(PyExc_IndexError, "slot index out of range");
    }
    return s;
}

static inline uint64_t *
slot_state(char *s)
{
    return (uint64_t *)s;
}

static inline long
slot_index(table_t *t, uint32_t c, char *s)
{
    return (long)(t->cls[c].first + (uint64_t)(s - t->base - t->cls[c].off) / t->cls[c].stride);
}

/* The buckets a key of hash h probes in class c, in order: the class's first PROBES slots (its hot window,
 * the same for every key: puts take its lowest free slot, so while few payloads are in flight the same
 * few slots carry them, their pages faulted in and their lines in cache), then, in a class of more slots,
 * PROBES from the key's hash (the overflow when many payloads wait at once). */
static inline int
probe_total(table_t *t, uint32_t c)
{
    return t->cls[c].n <= PROBES ? (int)t->cls[c].n : 2 * PROBES;
}

static inline char *
probe_slot(table_t *t, uint32_t c, uint64_t h, int p)
{
    return class_slot(t, c, p < PROBES ? (uint64_t)p : h + (uint64_t)(p - PROBES));
}

/* the READY bound of class c >= 1 */
static inline uint64_t *
ready_count(table_t *t, uint32_t c)
{
    return (uint64_t *)(t->base + COUNT_OFF + 64 * c);
}

/* add delta to a counter that never goes below 0; the new value */
static uint64_t
counter_add(uint64_t *word, long long delta)
{
    if (delta >= 0)
        return __atomic_add_fetch(word, (uint64_t)delta, __ATOMIC_SEQ_CST);
    uint64_t cur = __atomic_load_n(word, __ATOMIC_SEQ_CST), now;
    do {
        now = cur > (uint64_t)(-delta) ? cur - (uint64_t)(-delta) : 0;
    } while (!__atomic_compare_exchange_n(word, &cur, now, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return now;
}

static inline void
ready_add(table_t *t, uint32_t c, long long delta)
{
    if (c > 0)
        counter_add(ready_count(t, c), delta);
}

/* whether a look for a key must search class c (class 0 always; a larger one while it may hold a READY slot) */
static inline int
class_live(table_t *t, uint32_t c)
{
    return c == 0 || __atomic_load_n(ready_count(t, c), __ATOMIC_SEQ_CST) != 0;
}

static uint64_t
fnv1a(const char *p, Py_ssize_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* READY slot s holds key (h, k, n)? (reads the key bytes of a slot someone may be rewriting: callers re-check after CAS) */
static int
slot_has_key(char *s, uint64_t h, const char *k, Py_ssize_t n)
{
    uint64_t sh;
    uint32_t sn;
    memcpy(&sh, s + SLOT_HASH_OFF, 8);
    memcpy(&sn, s + SLOT_KEYLEN_OFF, 4);
    return sh == h && (Py_ssize_t)sn == n && memcmp(s + SLOT_KEY_OFF, k, (size_t)n) == 0;
}

/* the key's wake slot in the wake file (naming.WAKE_FIRST_SLOT + 8 * (hash % naming.WAKE_SLOTS)) */
#define WAKE_FIRST 64
#define WAKE_COUNT 256
#define WAKE_ANY 56

static inline Py_ssize_t
wake_offset(uint64_t h)
{
    return WAKE_FIRST + 8 * (Py_ssize_t)(h % WAKE_COUNT);
}

PyDoc_STRVAR(wake_slot_doc, "wake_slot(key) -> int\n\nOffset of key's wake slot in the wake file (FNV-1a 64 of its UTF-8 bytes).");

static PyObject *
native_wake_slot(PyObject *self, PyObject *args)
{
    const char *k;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "s#:wake_slot", &k, &n))
        return NULL;
    return PyLong_FromSsize_t(wake_offset(fnv1a(k, n)));
}

static void
ring(PyObject *wake, Py_ssize_t off, Py_ssize_t any_off)
{
    /* callers validated both offsets through slot() */
    Py_buffer view;
    uint32_t *seq;
    if (wake == Py_None)
        return;
    Py_ssize_t offs[2] = {off, any_off};
    for (int i = 0; i < 2; i++) {
        if (offs[i] < 0)
            continue;
        if (slot(wake, offs[i], &view, &seq) < 0) {
            PyErr_Clear();
            continue;
        }
        bump_word(seq);
        PyBuffer_Release(&view);
    }
}

static double
now_realtime(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* take the READY slot s (word w) for `me`; re-verify the key after the CAS (the slot may have been reused) */
static int
claim_ready(char *s, uint64_t w, uint64_t me, uint64_t h, const char *k, Py_ssize_t n)
{
    uint64_t want = w;
    if (!__atomic_compare_exchange_n(slot_state(s), &want, me, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 0;
    if (slot_has_key(s, h, k, n))
        return 1;
    /* a different payload landed there between our read and the CAS: put it back */
    __atomic_store_n(slot_state(s), w, __ATOMIC_RELEASE);
    return 0;
}

/* free slot s of class c, which we hold (a slot of a class >= 1 notes when, for the idle trim) */
static void
free_slot(uint32_t c, char *s)
{
    if (c > 0) {
        double now = now_realtime();
        memcpy(s + SLOT_TIME_OFF, &now, 8);
    }
    __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
}

/* the UTF-8 bytes of key; NULL without an exception when it has none (lone surrogates: the table cannot hold it) */
static const char *
utf8_key(PyObject *key, Py_ssize_t *n)
{
    const char *k = PyUnicode_AsUTF8AndSize(key, n);
    if (k == NULL && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
        PyErr_Clear();
    return k;
}

/* claim-and-free every READY slot of key (h, k, n) among its buckets: a put replaces an unconsumed payload */
static void
replace_ready(table_t *t, uint64_t h, const char *k, Py_ssize_t n, uint64_t claimer)
{
    for (uint32_t c = 0; c < t->nclasses; c++) {
        if (!class_live(t, c))
            continue;
        for (int p = 0; p < probe_total(t, c); p++) {
            char *s = probe_slot(t, c, h, p);
            uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
            if ((w & 0xFF) == S_READY && slot_has_key(s, h, k, n) && claim_ready(s, w, claimer, h, k, n)) {
                ready_add(t, c, -1);
                free_slot(c, s);
            }
        }
    }
}

/* CAS a FREE bucket of hash h in class c to `writing`; the slot, or NULL */
static char *
reserve(table_t *t, uint32_t c, uint64_t h, uint64_t writing)
{
    for (int p = 0; p < probe_total(t, c); p++) {
        char *s = probe_slot(t, c, h, p);
        uint64_t want = S_FREE;
        if (__atomic_load_n(slot_state(s), __ATOMIC_RELAXED) == S_FREE &&
            __atomic_compare_exchange_n(slot_state(s), &want, writing, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return s;
    }
    return NULL;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Make sure the first `need` payload bytes of slot s (which we hold) have their tmpfs pages: a write into a
 * hole of a full tmpfs (a container's small /dev/shm) would be a SIGBUS. MADV_POPULATE_WRITE allocates them
 * or fails with an error; the slot's `backed` mark remembers how far they exist, so this costs a syscall
 * only when a slot is first used (or first used after the trim gave its pages back) or holds a larger
 * payload than before. 0, or -1 if the pages cannot be had (the caller frees the slot). Kernels before 5.14
 * lack the call (EINVAL): then writes go ahead as into any shared mapping. */
static int
back(char *s, uint64_t need, uint64_t stride)
{
    uint32_t have;
    memcpy(&have, s + SLOT_BACKED_OFF, 4);
    if (need <= have)
        return 0;
    uintptr_t from = ((uintptr_t)s + SLOT_HDR + have) & ~(uintptr_t)(PAGE - 1);
    uintptr_t to = ((uintptr_t)s + SLOT_HDR + need + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
    if (madvise((void *)from, to - from, MADV_POPULATE_WRITE) != 0 && errno != EINVAL) {
        /* give back what it allocated before it failed (an unused slot is never trimmed): whole pages of this
         * slot only, never the page it may share with the next slot's header */
        uintptr_t kept = ((uintptr_t)s + SLOT_HDR + have + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
        uintptr_t end = ((uintptr_t)s + stride) & ~(uintptr_t)(PAGE - 1);
        if (end > to)
            end = to;
        if (end > kept)
            madvise((void *)kept, end - kept, MADV_REMOVE);
        return -1;
    }
    uint32_t n32 = (uint32_t)need;
    memcpy(s + SLOT_BACKED_OFF, &n32, 4);
    return 0;
}

/* a FREE slot for nbytes with its pages there: in the smallest class whose slots hold it, else in a larger one;
 * NULL if every class that could hold it is busy among the key's buckets or its pages cannot be had (*c: its
 * class). A slot of the small class is backed whole (its payload is encoded into it before its size is known). */
static char *
reserve_for(table_t *t, uint64_t h, uint64_t nbytes, uint64_t writing, uint32_t *c)
{
    for (uint32_t k = 0; k < t->nclasses; k++) {
        if (t->cls[k].slot_bytes < nbytes)
            continue;
        char *s = reserve(t, k, h, writing);
        if (s == NULL)
            continue;
        if (back(s, k == 0 ? t->cls[0].slot_bytes : nbytes, t->cls[k].stride) < 0) {
            free_slot(k, s);
            return NULL; /* tmpfs full: the file path reports it (ENOSPC) */
        }
        *c = k;
        return s;
    }
    return NULL;
}

static inline uint64_t
largest(table_t *t)
{
    return t->cls[t->nclasses - 1].slot_bytes;
}

/* give back the pages of FREE slots of classes >= 1 freed before `before` (CLOCK_REALTIME); the bytes
 * given back. Each slot is taken (CAS FREE -> writing) while its pages are removed (MADV_REMOVE: the
 * tmpfs pages go, for every process mapping the table), so no put writes it meanwhile; its first page
 * (the slot header) stays. */
static uint64_t
trim_slots(table_t *t, uint64_t writing, double before)
{
    uint64_t freed = 0;
    for (uint32_t c = 1; c < t->nclasses; c++) {
        for (uint64_t j = 0; j < t->cls[c].n; j++) {
            char *s = class_slot(t, c, j);
            double when;
            if (__atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE) != S_FREE)
                continue;
            memcpy(&when, s + SLOT_TIME_OFF, 8);
            if (!(when > 0.0 && when < before))
                continue;
            uint64_t want = S_FREE;
            if (!__atomic_compare_exchange_n(slot_state(s), &want, writing, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                continue;
            memcpy(&when, s + SLOT_TIME_OFF, 8);
            if (when > 0.0 && when < before) {
                uintptr_t from = ((uintptr_t)s + SLOT_HDR + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
                uintptr_t to = ((uintptr_t)s + t->cls[c].stride) & ~(uintptr_t)(PAGE - 1);
                if (to > from && madvise((void *)from, to - from, MADV_REMOVE) == 0)
                    freed += to - from;
                when = 0.0;
                memcpy(s + SLOT_TIME_OFF, &when, 8);
                uint32_t none = 0;
                memcpy(s + SLOT_BACKED_OFF, &none, 4);
            }
            __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
        }
    }
    return freed;
}

/* after a put: trim idle slots if the table's trim is due and this put wins it (at most every idle / 4,
 * between 50 ms and 1 s) */
static void
trim_if_due(table_t *t, uint64_t writing, double now)
{
    uint64_t idle_ns, *next = (uint64_t *)(t->base + TRIM_OFF);
    memcpy(&idle_ns, t->base + IDLE_OFF, 8);
    if (t->nclasses < 2 || idle_ns == 0)
        return;
    uint64_t now_ns = (uint64_t)(now * 1e9), due = __atomic_load_n(next, __ATOMIC_RELAXED);
    if (now_ns < due)
        return;
    uint64_t every = idle_ns / 4;
    every = every < 50000000ULL ? 50000000ULL : every > 1000000000ULL ? 1000000000ULL : every;
    if (!__atomic_compare_exchange_n(next, &due, now_ns + every, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return;
    trim_slots(t, writing, now - (double)idle_ns * 1e-9);
}

/* fill the slot's fields and publish it (READY, seq_cst); the publish time */
static double
publish(table_t *t, uint32_t c, char *s, uint64_t h, const char *k, Py_ssize_t n, Py_ssize_t nbytes, unsigned long tag,
        unsigned long long start, uint64_t ready)
{
    uint32_t n32 = (uint32_t)n, len32 = (uint32_t)nbytes, tag32 = (uint32_t)tag;
    uint64_t st64 = (uint64_t)start;
    double now = now_realtime();
    memcpy(s + SLOT_HASH_OFF, &h, 8);
    memcpy(s + SLOT_KEYLEN_OFF, &n32, 4);
    memcpy(s + SLOT_LEN_OFF, &len32, 4);
    memcpy(s + SLOT_TIME_OFF, &now, 8);
    memcpy(s + SLOT_TAG_OFF, &tag32, 4);
    memcpy(s + SLOT_START_OFF, &st64, 8);
    memcpy(s + SLOT_KEY_OFF, k, (size_t)n);
    ready_add(t, c, 1); /* before READY: a look that reads the count 0 cannot miss this slot */
    __atomic_store_n(slot_state(s), ready, __ATOMIC_SEQ_CST);
    return now;
}

PyDoc_STRVAR(slot_put_doc,
             "slot_put(table, key, writing, ready, claimer, tag, start, buffers, nbytes, wake) -> int\n\n"
             "Publish the concatenation of buffers (nbytes) under key: take a FREE slot (CAS FREE->writing) in the\n"
             "smallest class that holds nbytes (else a larger one) among the key's buckets, copy, replace a READY slot\n"
             "of the same key, store ready, ring the wake slots. Returns the slot index, -1 if the key or payload does\n"
             "not fit, -2 if no slot is free.");

static PyObject *
native_slot_put(PyObject *self, PyObject *args)
{
    PyObject *obj, *bufs, *wake;
    const char *k;
    Py_ssize_t n, nbytes;
    unsigned long long writing, ready, claimer, start;
    unsigned long tag;
    table_t t;
    if (!PyArg_ParseTuple(args, "Os#KKKkKOnO:slot_put", &obj, &k, &n, &writing, &ready, &claimer, &tag, &start, &bufs, &nbytes,
                          &wake))
        return NULL;
    if (!PyList_Check(bufs)) {
        PyErr_SetString(PyExc_TypeError, "buffers must be a list");
        return NULL;
    }
    if (table_open(obj, &t) < 0)
        return NULL;
    if (n > SLOT_KEY_MAX || nbytes < 0 || (uint64_t)nbytes > largest(&t)) {
        PyBuffer_Release(&t.view);
        return PyLong_FromLong(-1);
    }
    uint64_t h = fnv1a(k, n);
    uint32_t c = 0;
    char *s = reserve_for(&t, h, (uint64_t)nbytes, writing, &c);
    if (s == NULL) {
        replace_ready(&t, h, k, n, claimer); /* maybe its own old payload fills the key's buckets */
        s = reserve_for(&t, h, (uint64_t)nbytes, writing, &c);
        if (s == NULL) {
            PyBuffer_Release(&t.view);
            return PyLong_FromLong(-2);
        }
    }
    char *data = s + SLOT_HDR;
    Py_ssize_t at = 0, nb = PyList_GET_SIZE(bufs);
    for (Py_ssize_t i = 0; i < nb; i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, i), &b, PyBUF_SIMPLE) < 0)
            goto fail;
        if (b.len > nbytes - at) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError, "buffers are longer than nbytes");
            goto fail;
        }
        memcpy(data + at, b.buf, (size_t)b.len);
        at += b.len;
        PyBuffer_Release(&b);
    }
    if (at != nbytes) {
        PyErr_SetString(PyExc_ValueError, "buffers are shorter than nbytes");
        goto fail;
    }
    replace_ready(&t, h, k, n, claimer); /* a put replaces an unconsumed payload of the same key (as the file path does) */
    long index = slot_index(&t, c, s);
    double now = publish(&t, c, s, h, k, n, nbytes, tag, start, ready);
    ring(wake, wake_offset(h), WAKE_ANY);
    trim_if_due(&t, writing, now);
    PyBuffer_Release(&t.view);
    return PyLong_FromLong(index);
fail:
    free_slot(c, s);
    PyBuffer_Release(&t.view);
    return NULL;
}

PyDoc_STRVAR(slot_put_obj_doc,
             "slot_put_obj(table, writing, ready, claimer, tag, start, wake, limits, key, encoder, obj) -> int\n\n"
             "slot_put with the encoding written straight into the slot: encode obj with encoder (omni_plugins.wire.\n"
             "native_c_api(): the compiled encoder's C API) into a FREE slot of the smallest class (CAS FREE->writing);\n"
             "an encoding too big for it goes, encoded again, into a slot of the smallest class that holds it (else a\n"
             "larger one). Replace a READY slot of the same key, publish, ring. Returns the encoded size; -1 if the key\n"
             "(or without UTF-8 bytes) or the encoding does not fit, -2 if no bucket is free (both after replacing an\n"
             "unconsumed payload of the key: the file path takes over), -3 if the compiled encoder declined (the Python\n"
             "encoder decides).");

/* The C entry point of omni_plugins.wire's compiled encoder (its C_API capsule; same layout there). */
#define WIRE_C_API_NAME "omni_plugins.wire._native.C_API"
#define WIRE_ENCODE_DEFER (-2)
typedef struct {
    int version; /* 1 */
    long long (*encode_into)(PyObject *obj, PyObject *limits, unsigned char *dst, Py_ssize_t cap);
} WireCAPI;

/* Positional arguments of the METH_FASTCALL hot calls (bound by functools.partial, which calls
 * them without building a tuple). Integers are taken modulo 2**64 like PyArg_ParseTuple's K / k. */
static int
fast_args(const char *fname, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", fname, want, nargs);
    return -1;
}

static int
arg_u64(PyObject *o, unsigned long long *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "an integer is required (got %.100s)", Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLongMask(o);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int
arg_str(PyObject *o)
{
    if (PyUnicode_Check(o))
        return 0;
    PyErr_Format(PyExc_TypeError, "key must be str, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
}

/* The wire encoder's C API from its capsule (`encoder`); NULL with an exception. */
static const WireCAPI *
wire_api(PyObject *encoder)
{
    if (!PyCapsule_CheckExact(encoder)) {
        PyErr_Format(PyExc_TypeError, "encoder must be omni_plugins.wire.native_c_api(), not %.100s", Py_TYPE(encoder)->tp_name);
        return NULL;
    }
    const WireCAPI *api = PyCapsule_GetPointer(encoder, WIRE_C_API_NAME);
    if (api == NULL)
        return NULL;
    if (api->version != 1) {
        PyErr_Format(PyExc_RuntimeError, "omni_plugins.wire C API version %d (this extension knows 1)", api->version);
        return NULL;
    }
    return api;
}

static PyObject *
native_slot_put_obj(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *obj, *encoder, *payload, *limits, *wake, *key;
    const char *k;
    Py_ssize_t n;
    unsigned long long writing, ready, claimer, start, tag;
    table_t t;
    if (fast_args("slot_put_obj", nargs, 11) < 0 || arg_u64(args[1], &writing) < 0 || arg_u64(args[2], &ready) < 0 ||
        arg_u64(args[3], &claimer) < 0 || arg_u64(args[4], &tag) < 0 || arg_u64(args[5], &start) < 0 || arg_str(args[8]) < 0)
        return NULL;
    obj = args[0], wake = args[6], limits = args[7], key = args[8], encoder = args[9], payload = args[10];
    const WireCAPI *api = wire_api(encoder);
    if (api == NULL)
        return NULL;
    if ((k = utf8_key(key, &n)) == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    if (table_open(obj, &t) < 0)
        return NULL;
    if (n > SLOT_KEY_MAX) {
        PyBuffer_Release(&t.view);
        return PyLong_FromLong(-1);
    }
    uint64_t h = fnv1a(k, n);
    uint32_t c = 0;
    long long nbytes, result;
    /* most payloads fit the smallest class: encode straight into one of its slots; one that does not was
     * only measured (the encoder writes nothing that does not fit) and is encoded again into a larger slot */
    char *s = reserve(&t, 0, h, writing);
    if (s != NULL && back(s, t.cls[0].slot_bytes, t.cls[0].stride) < 0) {
        free_slot(0, s);
        result = -2; /* tmpfs full: the file path reports it */
        goto declined;
    }
    if (s != NULL) {
        nbytes = api->encode_into(payload, limits, (unsigned char *)s + SLOT_HDR, (Py_ssize_t)t.cls[0].slot_bytes);
        if (nbytes >= 0 && (uint64_t)nbytes <= t.cls[0].slot_bytes)
            goto publish;
        free_slot(0, s);
        s = NULL;
    } else {
        nbytes = api->encode_into(payload, limits, NULL, 0); /* its size alone */
    }
    if (nbytes < 0) {
        result = nbytes == WIRE_ENCODE_DEFER ? -3 : -4;
        goto out;
    }
    if ((uint64_t)nbytes > largest(&t)) {
        result = -1;
        goto declined;
    }
    s = reserve_for(&t, h, (uint64_t)nbytes, writing, &c);
    if (s == NULL) {
        replace_ready(&t, h, k, n, claimer); /* maybe its own old payload fills the key's buckets */
        s = reserve_for(&t, h, (uint64_t)nbytes, writing, &c);
        if (s == NULL) {
            result = -2;
            goto out;
        }
    }
    long long again = api->encode_into(payload, limits, (unsigned char *)s + SLOT_HDR, (Py_ssize_t)t.cls[c].slot_bytes);
    if (again != nbytes) { /* an error, or the payload changed between the two walks: the file path decides */
        free_slot(c, s);
        result = again == -1 ? -4 : -1;
        goto declined;
    }
publish:
    replace_ready(&t, h, k, n, claimer);
    double now = publish(&t, c, s, h, k, n, (Py_ssize_t)nbytes, (unsigned long)tag, start, ready);
    ring(wake, wake_offset(h), WAKE_ANY);
    trim_if_due(&t, writing, now);
    PyBuffer_Release(&t.view);
    return PyLong_FromLongLong(nbytes);
declined:
    replace_ready(&t, h, k, n, claimer); /* too big: the file path publishes it */
out:
    PyBuffer_Release(&t.view);
    if (result == -4)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    return PyLong_FromLongLong(result);
}

PyDoc_STRVAR(slot_take_doc,
             "slot_take(table, claimer, wake, lend, key) -> bytearray | tuple | int | None\n\n"
             "Load the wake slot's seq, then look for a READY payload of key among its buckets (the smallest class,\n"
             "then each larger class that may hold a READY slot); claim it (CAS READY->claimer), copy it into a new\n"
             "bytearray and free the slot. With lend true, a payload of a class >= 1 is not copied: its slot stays\n"
             "claimed and (index, offset, length) is returned (views over the table's mapping; slot_release frees it).\n"
             "A miss returns the seq read before looking, plus 1 << 32 when the table's count of unconsumed file-path\n"
             "payloads (read after looking) is not 0; None for a key without UTF-8 bytes (lone surrogates).\n"
             "ValueError if the claimed slot is corrupt (freed). (Arguments ordered for functools.partial.)");

/* copy n bytes of slot s into a new bytearray (the GIL released for a large copy: the slot is ours and both
 * buffers stay exported) */
static PyObject *
copy_out(char *s, uint32_t len)
{
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (out == NULL || len == 0)
        return out;
    char *dst = PyByteArray_AS_STRING(out);
    if (len >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, s + SLOT_HDR, len);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, s + SLOT_HDR, len);
    }
    return out;
}

/* one look for key: the payload (claimed, copied out, freed) as a bytearray, or with `lend` a payload of a
 * class >= 1 as (index, offset, length) with its slot left claimed, or NULL with *miss set to the seq read
 * before looking (| FILES_BIT when the file-path hint is not 0), or NULL with an exception */
static PyObject *
take_once(table_t *t, uint32_t *seq, uint64_t claimer, int lend, const char *k, Py_ssize_t n, uint64_t *miss)
{
    uint32_t seen = seq != NULL ? __atomic_load_n(seq, __ATOMIC_SEQ_CST) : 0;
    if (n <= SLOT_KEY_MAX) {
        uint64_t h = fnv1a(k, n);
        for (uint32_t c = 0; c < t->nclasses; c++) {
            if (!class_live(t, c))
                continue;
            for (int p = 0; p < probe_total(t, c); p++) {
                char *s = probe_slot(t, c, h, p);
                uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
                if ((w & 0xFF) != S_READY || !slot_has_key(s, h, k, n) || !claim_ready(s, w, claimer, h, k, n))
                    continue;
                ready_add(t, c, -1);
                uint32_t len;
                memcpy(&len, s + SLOT_LEN_OFF, 4);
                if ((uint64_t)len > t->cls[c].slot_bytes) {
                    free_slot(c, s);
                    PyErr_Format(PyExc_ValueError, "slot %ld is corrupt: payload length %u > slot size %llu; freed it",
                                 slot_index(t, c, s), len, (unsigned long long)t->cls[c].slot_bytes);
                    return NULL;
                }
                if (lend && c > 0) {
                    PyObject *lent = Py_BuildValue("(lnI)", slot_index(t, c, s), (Py_ssize_t)(s + SLOT_HDR - t->base), len);
                    if (lent == NULL)
                        free_slot(c, s);
                    return lent;
                }
                PyObject *out = copy_out(s, len);
                free_slot(c, s);
                return out; /* NULL on MemoryError: the payload is lost like any failed get's */
            }
        }
    }
    /* read after the seq (both seq_cst): a file publication this misses raised the count after this
     * load, so its ring comes after `seen` was read and the caller's FUTEX_WAIT returns at once */
    uint64_t files = __atomic_load_n((uint64_t *)(t->base + FILES_OFF), __ATOMIC_SEQ_CST);
    *miss = (uint64_t)seen | (files ? FILES_BIT : 0);
    return NULL;
}

enum { TAKE = 0, TAKE_WAIT = 1, TAKE_OR_WAIT = 2 };

/* slot_take: one look. slot_take_wait: first sleep up to `seconds` while the key's wake slot still reads
 * `expected` (the seq an earlier slot_take read before its look and the caller's file-path check), then look.
 * slot_take_or_wait: look; on a miss without the file-path bit, sleep on the seq read before it, then look again. */
static PyObject *
take(PyObject *const *args, Py_ssize_t nargs, int mode)
{
    static const char *const fname[] = {"slot_take", "slot_take_wait", "slot_take_or_wait"};
    static const Py_ssize_t want[] = {5, 7, 6};
    PyObject *obj, *wake, *key;
    const char *k;
    Py_ssize_t n;
    unsigned long long claimer, expected = 0;
    double seconds = 0.0;
    table_t t;
    if (fast_args(fname[mode], nargs, want[mode]) < 0 || arg_u64(args[1], &claimer) < 0 || arg_str(args[4]) < 0)
        return NULL;
    obj = args[0], wake = args[2], key = args[4];
    int lend = PyObject_IsTrue(args[3]);
    if (lend < 0)
        return NULL;
    if (mode == TAKE_WAIT && arg_u64(args[5], &expected) < 0)
        return NULL;
    if (mode != TAKE) {
        seconds = PyFloat_AsDouble(args[nargs - 1]);
        if (seconds == -1.0 && PyErr_Occurred())
            return NULL;
    }
    if (!(seconds >= 0.0 && seconds <= 86400.0)) {
        PyErr_SetString(PyExc_ValueError, "seconds must be in [0, 86400]");
        return NULL;
    }
    if ((k = utf8_key(key, &n)) == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_buffer wv;
    uint32_t *seq = NULL;
    if (wake != Py_None && slot(wake, wake_offset(fnv1a(k, n)), &wv, &seq) < 0)
        return NULL;
    if (table_open(obj, &t) < 0) {
        if (seq != NULL)
            PyBuffer_Release(&wv);
        return NULL;
    }
    /* both mappings stay exported while we sleep (a close cannot unmap them) */
    uint64_t timed_out = 0, miss = 0;
    int slept = 0;
    PyObject *out = NULL;
    if (mode == TAKE_WAIT && seq != NULL && seconds > 0.0) {
        if ((slept = sleep_checked(seq, (uint32_t)expected, seconds)) < 0)
            goto done;
        timed_out = slept ? TIMED_OUT_BIT : 0;
    }
    out = take_once(&t, seq, claimer, lend, k, n, &miss);
    if (mode == TAKE_OR_WAIT && out == NULL && !PyErr_Occurred() && seq != NULL && seconds > 0.0 && !(miss & FILES_BIT)) {
        /* a miss with no file payload to look for: sleep on the seq read before the look, then look again */
        if ((slept = sleep_checked(seq, (uint32_t)miss, seconds)) < 0)
            goto done;
        timed_out = slept ? TIMED_OUT_BIT : 0;
        out = take_once(&t, seq, claimer, lend, k, n, &miss);
    }
    if (timed_out && out == NULL && !PyErr_Occurred())
        trim_if_due(&t, claimer, now_realtime()); /* a quiet namespace: its waiting gets give idle slots' memory back */
done:
    PyBuffer_Release(&t.view);
    if (seq != NULL)
        PyBuffer_Release(&wv);
    if (out != NULL || PyErr_Occurred())
        return out;
    return PyLong_FromUnsignedLongLong(miss | timed_out);
}

static PyObject *
native_slot_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return take(args, nargs, TAKE);
}

PyDoc_STRVAR(slot_take_wait_doc,
             "slot_take_wait(table, claimer, wake, lend, key, expected, seconds) -> bytearray | tuple | int | None\n\n"
             "Sleep up to seconds while the key's wake slot reads expected (GIL released), then slot_take. A miss after\n"
             "a sleep that ran out its time has 1 << 33 added. (wake.sleep + slot_take in one call: the hot wait.)");

static PyObject *
native_slot_take_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return take(args, nargs, TAKE_WAIT);
}

PyDoc_STRVAR(slot_take_or_wait_doc,
             "slot_take_or_wait(table, claimer, wake, lend, key, seconds) -> bytearray | tuple | int | None\n\n"
             "slot_take; if that misses and the file-path hint is 0, sleep up to seconds on the seq it read before\n"
             "looking (GIL released) and look once more: a blocking get's first look, its sleep and the look after it\n"
             "in one call. The miss is slot_take's (+ 1 << 33 when the sleep ran out its time); a miss with the\n"
             "file-path bit set is returned without sleeping.");

static PyObject *
native_slot_take_or_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return take(args, nargs, TAKE_OR_WAIT);
}

PyDoc_STRVAR(slot_release_doc,
             "slot_release(table, claimer, index) -> bool\n\n"
             "Free slot index if it is still claimed by claimer (a lent payload's views died). True if it was.");

static PyObject *
native_slot_release(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long claimer;
    Py_ssize_t i;
    table_t t;
    uint32_t c;
    if (!PyArg_ParseTuple(args, "OKn:slot_release", &obj, &claimer, &i))
        return NULL;
    char *s = table_open_at(obj, i, &t, &c);
    if (s == NULL)
        return NULL;
    int ok = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE) == (uint64_t)claimer;
    if (ok)
        free_slot(c, s);
    PyBuffer_Release(&t.view);
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(slot_trim_doc,
             "slot_trim(table, writing, before) -> int\n\n"
             "Give back the pages of every FREE slot of a class >= 1 last freed before `before` (CLOCK_REALTIME\n"
             "seconds); the bytes given back.");

static PyObject *
native_slot_trim(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long writing;
    double before;
    table_t t;
    if (!PyArg_ParseTuple(args, "OKd:slot_trim", &obj, &writing, &before))
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
    uint64_t freed = trim_slots(&t, writing, before);
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLongLong(freed);
}

PyDoc_STRVAR(slot_trim_due_doc,
             "slot_trim_due(table, owner) -> None\n\n"
             "The trim puts run (slot_trim of the slots idle longer than the table's idle time), if it is due: at most\n"
             "every quarter of that time. For waits that ran out in a quiet namespace. owner: a state word of this process.");

static PyObject *
native_slot_trim_due(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long owner;
    table_t t;
    if (!PyArg_ParseTuple(args, "OK:slot_trim_due", &obj, &owner))
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
    trim_if_due(&t, owner, now_realtime());
    PyBuffer_Release(&t.view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(slot_files_doc,
             "slot_files(table, delta) -> int\n\n"
             "Add delta to the table's count of unconsumed file-path payloads (a decrement stops at 0); the new count.");

static PyObject *
native_slot_files(PyObject *self, PyObject *args)
{
    PyObject *obj;
    long long delta;
    table_t t;
    if (!PyArg_ParseTuple(args, "OL:slot_files", &obj, &delta))
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
    uint64_t now = counter_add((uint64_t *)(t.base + FILES_OFF), delta);
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLongLong(now);
}

/* The READY slots of every live class, each slot's state read once, into ready[0..cap): their count, or -1 when
 * more than cap are READY (the caller then looks another way). */
static Py_ssize_t
collect_ready(table_t *t, char **ready, Py_ssize_t cap)
{
    Py_ssize_t n = 0;
    for (uint32_t c = 0; c < t->nclasses; c++) {
        if (!class_live(t, c))
            continue;
        for (uint64_t j = 0; j < t->cls[c].n; j++) {
            char *s = class_slot(t, c, j);
            if ((__atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE) & 0xFF) != S_READY)
                continue;
            if (n == cap)
                return -1;
            ready[n++] = s;
        }
    }
    return n;
}

/* slot_ready_among hands the look back (None) above this many READY slots when they also outnumber half the keys */
#define READY_AMONG_MAX_READY 64

PyDoc_STRVAR(slot_ready_among_doc,
             "slot_ready_among(table, keys) -> list[str] | None\n\nThe keys with a READY slot that are in keys (any sized container\n"
             "with a fast ``in``: a set, a dict or its keys view), found by reading every slot's state once and looking up the\n"
             "key of each READY slot in keys: the cost follows the READY slots, not the number of keys. None when more than 64\n"
             "slots and more than half as many slots as keys are READY (then probe per key with slot_present).");

/* Keys of READY slots that ``keys`` contains. Every slot's state is read once (about a microsecond for the default
 * table: collect_ready); a READY slot's key is decoded and looked up in ``keys``. A hint as slot_present's is: a slot claimed or
 * reused meanwhile may give a key that is gone, or bytes that are no key (skipped). Py_None (a new reference) when
 * more slots are READY than half the keys (a consumer far behind its producers): a lookup per READY slot would then
 * cost more than slot_present's probe per key, which the caller uses instead. */
static PyObject *
native_slot_ready_among(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys;
    table_t t;
    if (!PyArg_ParseTuple(args, "OO:slot_ready_among", &obj, &keys))
        return NULL;
    Py_ssize_t nkeys = PyObject_Size(keys);
    if (nkeys < 0)
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
    Py_ssize_t cap = nkeys / 2 > READY_AMONG_MAX_READY ? nkeys / 2 : READY_AMONG_MAX_READY, nslots = 0;
    for (uint32_t c = 0; c < t.nclasses; c++)
        nslots += (Py_ssize_t)t.cls[c].n;
    if (cap > nslots)
        cap = nslots; /* no more can be READY */
    char **ready = PyMem_Malloc((size_t)(cap > 0 ? cap : 1) * sizeof(char *));
    if (ready == NULL) {
        PyBuffer_Release(&t.view);
        return PyErr_NoMemory();
    }
    Py_ssize_t nready = collect_ready(&t, ready, cap);
    if (nready < 0) {
        PyMem_Free(ready);
        PyBuffer_Release(&t.view);
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t r = 0; out != NULL && r < nready; r++) {
        char *s = ready[r];
        uint32_t kn;
        memcpy(&kn, s + SLOT_KEYLEN_OFF, 4);
        if (kn == 0 || kn > SLOT_KEY_MAX)
            continue;
        PyObject *key = PyUnicode_DecodeUTF8(s + SLOT_KEY_OFF, (Py_ssize_t)kn, "strict");
        if (key == NULL) { /* torn by a concurrent reuse: not a key anyone waits for */
            PyErr_Clear();
            continue;
        }
        int wanted = PySequence_Contains(keys, key);
        if (wanted == 1)
            wanted = PySequence_Contains(out, key) == 0 ? 1 : 0; /* once, even if two slots hold it */
        if (wanted < 0 || (wanted == 1 && PyList_Append(out, key) < 0))
            Py_CLEAR(out);
        Py_DECREF(key);
    }
    PyMem_Free(ready);
    PyBuffer_Release(&t.view);
    return out;
}

PyDoc_STRVAR(slot_present_doc,
             "slot_present(table, keys) -> list[int]\n\nIndexes into keys (a list of str) of the keys with a READY slot.");

/* ``slot_present`` with at least this many keys first reads every slot's state once (about a microsecond for
 * the default table) instead of probing each key's 16 hashed slots (about 45 ns a key): a receive thread waiting
 * on a thousand streams looks at the table several times per arrival. */
#define PRESENT_SCAN_MIN_KEYS 64
/* the scan gives up above this many READY slots (then each key would be compared with too many) */
#define PRESENT_SCAN_MAX_READY 64

/* Indexes into ``keys`` of the keys with a READY slot, found by reading every slot of every live class once and
 * comparing each key's hash with those of the READY ones; Py_None (a new reference) when more than
 * PRESENT_SCAN_MAX_READY slots are READY; NULL on error. A key is READY only in a slot of its probe window, so
 * finding it among all READY slots gives the answer the per-key probe gives. */
static PyObject *
present_by_scan(table_t *t, PyObject *keys)
{
    char *ready[PRESENT_SCAN_MAX_READY];
    uint64_t ready_hash[PRESENT_SCAN_MAX_READY];
    Py_ssize_t nready = collect_ready(t, ready, PRESENT_SCAN_MAX_READY);
    if (nready < 0)
        Py_RETURN_NONE;
    for (Py_ssize_t j = 0; j < nready; j++)
        memcpy(&ready_hash[j], ready[j] + SLOT_HASH_OFF, 8);
    PyObject *out = PyList_New(0);
    if (out == NULL || nready == 0)
        return out;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        Py_ssize_t n;
        const char *k = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, i), &n);
        if (k == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        if (n > SLOT_KEY_MAX)
            continue;
        uint64_t h = fnv1a(k, n);
        int found = 0;
        for (Py_ssize_t j = 0; !found && j < nready; j++)
            found = ready_hash[j] == h && slot_has_key(ready[j], h, k, n);
        if (found) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (idx == NULL || PyList_Append(out, idx) < 0) {
                Py_XDECREF(idx);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(idx);
        }
    }
    return out;
}

static PyObject *
native_slot_present(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys;
    table_t t;
    if (!PyArg_ParseTuple(args, "OO!:slot_present", &obj, &PyList_Type, &keys))
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
    if (PyList_GET_SIZE(keys) >= PRESENT_SCAN_MIN_KEYS) {
        PyObject *scanned = present_by_scan(&t, keys);
        if (scanned != Py_None) {
            PyBuffer_Release(&t.view);
            return scanned; /* the list, or NULL with the error set */
        }
        Py_DECREF(scanned); /* too many READY slots for the scan: probe per key */
    }
    /* the hot windows are the same for every key: read them once, then compare each key's hash with theirs */
    char *hot[MAX_CLASSES * PROBES];
    uint64_t hot_hash[MAX_CLASSES * PROBES];
    int nhot = 0;
    for (uint32_t c = 0; c < t.nclasses; c++) {
        if (!class_live(&t, c))
            continue;
        int window = probe_total(&t, c) < PROBES ? probe_total(&t, c) : PROBES;
        for (int p = 0; p < window; p++) {
            char *s = probe_slot(&t, c, 0, p);
            if ((__atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE) & 0xFF) == S_READY) {
                hot[nhot] = s;
                memcpy(&hot_hash[nhot++], s + SLOT_HASH_OFF, 8);
            }
        }
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(keys); i++) {
        Py_ssize_t n;
        const char *k = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, i), &n);
        if (k == NULL) {
            Py_CLEAR(out);
            break;
        }
        if (n > SLOT_KEY_MAX)
            continue;
        uint64_t h = fnv1a(k, n);
        int found = 0;
        for (int j = 0; !found && j < nhot; j++)
            found = hot_hash[j] == h && slot_has_key(hot[j], h, k, n);
        for (uint32_t c = 0; !found && c < t.nclasses; c++) {
            if (!class_live(&t, c))
                continue;
            for (int p = PROBES; !found && p < probe_total(&t, c); p++) { /* a large class's buckets from the hash */
                char *s = probe_slot(&t, c, h, p);
                uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
                found = (w & 0xFF) == S_READY && slot_has_key(s, h, k, n);
            }
        }
        if (found) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (idx == NULL || PyList_Append(out, idx) < 0)
                Py_CLEAR(out);
            Py_XDECREF(idx);
        }
    }
    PyBuffer_Release(&t.view);
    return out;
}

PyDoc_STRVAR(slot_scan_doc,
             "slot_scan(table) -> list[tuple[int, int, int, float, bytes]]\n\n"
             "(index, state word, producer tag, publish time, key bytes) of every slot that is not FREE (a snapshot).");

static PyObject *
native_slot_scan(PyObject *self, PyObject *args)
{
    PyObject *obj;
    table_t t;
    if (!PyArg_ParseTuple(args, "O:slot_scan", &obj))
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    for (uint32_t c = 0; out && c < t.nclasses; c++) {
        for (uint64_t j = 0; out && j < t.cls[c].n; j++) {
            char *s = class_slot(&t, c, j);
            uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
            if (w == S_FREE)
                continue;
            uint32_t tag, kn;
            double when;
            memcpy(&tag, s + SLOT_TAG_OFF, 4);
            memcpy(&when, s + SLOT_TIME_OFF, 8);
            memcpy(&kn, s + SLOT_KEYLEN_OFF, 4);
            if (kn > SLOT_KEY_MAX)
                kn = 0;
            PyObject *item = Py_BuildValue("(kKkdy#)", (unsigned long)(t.cls[c].first + j), (unsigned long long)w, (unsigned long)tag,
                                           when, s + SLOT_KEY_OFF, (Py_ssize_t)kn);
            if (item == NULL || PyList_Append(out, item) < 0)
                Py_CLEAR(out);
            Py_XDECREF(item);
        }
    }
    PyBuffer_Release(&t.view);
    return out;
}

PyDoc_STRVAR(slot_cas_doc,
             "slot_cas(table, index, expected, new) -> bool\n\nCompare-and-swap slot index's state word (gc, ttl, close).");

static PyObject *
native_slot_cas(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long expected, desired;
    Py_ssize_t i;
    table_t t;
    uint32_t c;
    if (!PyArg_ParseTuple(args, "OnKK:slot_cas", &obj, &i, &expected, &desired))
        return NULL;
    char *s = table_open_at(obj, i, &t, &c);
    if (s == NULL)
        return NULL;
    /* the class's READY bound: raised before a slot becomes READY, lowered after it stopped being READY */
    int was_ready = (expected & 0xFF) == S_READY, is_ready = (desired & 0xFF) == S_READY;
    if (is_ready && !was_ready)
        ready_add(&t, c, 1);
    uint64_t want = expected;
    int ok = __atomic_compare_exchange_n(slot_state(s), &want, (uint64_t)desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    if (is_ready != was_ready && (ok ? was_ready : is_ready))
        ready_add(&t, c, -1);
    PyBuffer_Release(&t.view);
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(slot_tag_doc, "slot_tag(table, index) -> int\n\nThe producer tag of slot index (read after claiming it).");

static PyObject *
native_slot_tag(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t i;
    table_t t;
    uint32_t c;
    if (!PyArg_ParseTuple(args, "On:slot_tag", &obj, &i))
        return NULL;
    char *s = table_open_at(obj, i, &t, &c);
    if (s == NULL)
        return NULL;
    uint32_t tag;
    memcpy(&tag, s + SLOT_TAG_OFF, 4);
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLong(tag);
}

static PyMethodDef methods[] = {
    {"rename_noreplace", native_rename_noreplace, METH_VARARGS, rename_doc},
    {"copy", (PyCFunction)(void (*)(void))native_copy, METH_FASTCALL, copy_doc},
    {"bump", futex_bump, METH_VARARGS, bump_doc},
    {"cas", futex_cas, METH_VARARGS, cas_doc},
    {"load", futex_load, METH_VARARGS, load_doc},
    {"wait", futex_wait, METH_VARARGS, wait_doc},
    {"spin", futex_spin, METH_VARARGS, spin_doc},
    {"wake_slot", native_wake_slot, METH_VARARGS, wake_slot_doc},
    {"slot_put", native_slot_put, METH_VARARGS, slot_put_doc},
    {"slot_put_obj", (PyCFunction)(void (*)(void))native_slot_put_obj, METH_FASTCALL, slot_put_obj_doc},
    {"slot_take", (PyCFunction)(void (*)(void))native_slot_take, METH_FASTCALL, slot_take_doc},
    {"slot_take_wait", (PyCFunction)(void (*)(void))native_slot_take_wait, METH_FASTCALL, slot_take_wait_doc},
    {"slot_take_or_wait", (PyCFunction)(void (*)(void))native_slot_take_or_wait, METH_FASTCALL, slot_take_or_wait_doc},
    {"slot_files", native_slot_files, METH_VARARGS, slot_files_doc},
    {"slot_present", native_slot_present, METH_VARARGS, slot_present_doc},
    {"slot_ready_among", native_slot_ready_among, METH_VARARGS, slot_ready_among_doc},
    {"slot_scan", native_slot_scan, METH_VARARGS, slot_scan_doc},
    {"slot_cas", native_slot_cas, METH_VARARGS, slot_cas_doc},
    {"slot_tag", native_slot_tag, METH_VARARGS, slot_tag_doc},
    {"slot_release", native_slot_release, METH_VARARGS, slot_release_doc},
    {"slot_trim", native_slot_trim, METH_VARARGS, slot_trim_doc},
    {"slot_trim_due", native_slot_trim_due, METH_VARARGS, slot_trim_due_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "omni_plugins_shm._native", "Futex wake slots in shared mappings and renameat2 (see docs/backends/shm.md).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && sharedmap_add(m) < 0)
        Py_CLEAR(m);
    return m;
}
