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

/* 3. The slot table: small payloads handed off without file syscalls (see slots.py, docs/backends/shm.md).
 *
 * Table file layout (all little-endian, native atomics; the file is a MAP_SHARED tmpfs mapping):
 *   header (TBL_HDR bytes): magic "OMNISLT1", u32 version, u32 nslots, u64 slot_bytes, u64 stride,
 *     at FILES_OFF a u64 hint: file-path payloads table instances published and nobody consumed yet
 *     (raised before the publishing rename, lowered by the get that consumes one; it may be too high
 *     after a crash or a cleanup, never too low among table instances: 0 lets a waiting get skip its
 *     file-path claim attempt, see slot_take)
 *   slot i at TBL_HDR + i * stride:
 *     0  u64 state   = pid << 32 | (start & 0xFFFFFF) << 8 | kind   (kind: FREE 0, WRITING 1, READY 2, CLAIMED 3)
 *     8  u64 key hash (FNV-1a 64 of the UTF-8 key)
 *    16  u32 key length       20 u32 payload length
 *    24  f64 publish time (CLOCK_REALTIME seconds)
 *    32  u32 producer instance tag   36 u32 reserved
 *    40  u64 producer start time (full)
 *    64  key bytes (<= SLOT_KEY_MAX)
 *   SLOT_HDR: payload bytes (<= slot_bytes)
 * A slot changes hands only by compare-and-swap of its state word, so one claimer wins; the
 * owner (pid + start time) in the word lets gc reclaim WRITING/CLAIMED slots of dead processes
 * race-free (it CASes exactly the word it judged).
 */
#define TBL_HDR 4096
#define FILES_OFF 64
#define FILES_BIT ((uint64_t)1 << 32)
#define TIMED_OUT_BIT ((uint64_t)1 << 33)
#define SLOT_HDR 256
/* slot header fields (offsets from the slot's start; the layout above) */
#define SLOT_HASH_OFF 8
#define SLOT_KEYLEN_OFF 16
#define SLOT_LEN_OFF 20
#define SLOT_TIME_OFF 24
#define SLOT_TAG_OFF 32
#define SLOT_START_OFF 40
#define SLOT_KEY_OFF 64
#define SLOT_KEY_MAX (SLOT_HDR - SLOT_KEY_OFF)
#define S_FREE 0
#define S_WRITING 1
#define S_READY 2
#define S_CLAIMED 3
#define PROBES 16

typedef struct {
    Py_buffer view;
    char *base;
    uint32_t nslots;
    uint64_t slot_bytes, stride;
} table_t;

static int
table_open(PyObject *obj, table_t *t)
{
    if (PyObject_GetBuffer(obj, &t->view, PyBUF_WRITABLE) < 0)
        return -1;
    t->base = (char *)t->view.buf;
    if (t->view.len < TBL_HDR || memcmp(t->base, "OMNISLT1", 8) != 0 || ((uintptr_t)t->base & 7))
        goto bad;
    memcpy(&t->nslots, t->base + 12, 4);
    memcpy(&t->slot_bytes, t->base + 16, 8);
    memcpy(&t->stride, t->base + 24, 8);
    if (t->nslots == 0 || t->stride < SLOT_HDR + t->slot_bytes || (t->stride & 63) || t->stride > ((uint64_t)1 << 40) ||
        (uint64_t)TBL_HDR + (uint64_t)t->nslots * t->stride > (uint64_t)t->view.len)
        goto bad;
    return 0;
bad:
    PyBuffer_Release(&t->view);
    PyErr_SetString(PyExc_ValueError, "slot table header is invalid");
    return -1;
}

/* table_open + check that slot index i exists (IndexError otherwise; the view is released on error) */
static int
table_open_at(PyObject *obj, Py_ssize_t i, table_t *t)
{
    if (table_open(obj, t) < 0)
        return -1;
    if (i < 0 || (uint64_t)i >= t->nslots) {
        PyBuffer_Release(&t->view);
        PyErr_SetString(PyExc_IndexError, "slot index out of range");
        return -1;
    }
    return 0;
}

static inline char *
slot_at(table_t *t, uint64_t i)
{
    return t->base + TBL_HDR + (i % t->nslots) * t->stride;
}

static inline uint64_t *
slot_state(char *s)
{
    return (uint64_t *)s;
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
    for (int p = 0; p < PROBES && p < (int)t->nslots; p++) {
        char *s = slot_at(t, h + (uint64_t)p);
        uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
        if ((w & 0xFF) == S_READY && slot_has_key(s, h, k, n) && claim_ready(s, w, claimer, h, k, n))
            __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
    }
}

/* CAS a FREE bucket of hash h to `writing`; the slot, or NULL (*index set) */
static char *
reserve(table_t *t, uint64_t h, uint64_t writing, long *index)
{
    for (int p = 0; p < PROBES && p < (int)t->nslots; p++) {
        char *s = slot_at(t, h + (uint64_t)p);
        uint64_t want = S_FREE;
        if (__atomic_load_n(slot_state(s), __ATOMIC_RELAXED) == S_FREE &&
            __atomic_compare_exchange_n(slot_state(s), &want, writing, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            *index = (long)((h + (uint64_t)p) % t->nslots);
            return s;
        }
    }
    return NULL;
}

/* fill the slot's fields and publish it (READY, seq_cst) */
static void
publish(char *s, uint64_t h, const char *k, Py_ssize_t n, Py_ssize_t nbytes, unsigned long tag, unsigned long long start, uint64_t ready)
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
    __atomic_store_n(slot_state(s), ready, __ATOMIC_SEQ_CST);
}

PyDoc_STRVAR(slot_put_doc,
             "slot_put(table, key, writing, ready, claimer, tag, start, buffers, nbytes, wake) -> int\n\n"
             "Publish the concatenation of buffers (nbytes) under key: replace a READY slot of the same key,\n"
             "take a FREE slot among the key's PROBES buckets (CAS FREE->writing), copy, store ready (release),\n"
             "ring the wake slots. Returns the slot index, -1 if the key or payload does not fit, -2 if no slot is free.");

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
    if (n > SLOT_KEY_MAX || nbytes < 0 || (uint64_t)nbytes > t.slot_bytes) {
        PyBuffer_Release(&t.view);
        return PyLong_FromLong(-1);
    }
    uint64_t h = fnv1a(k, n);
    /* a put replaces an unconsumed payload of the same key (as the file path does) */
    replace_ready(&t, h, k, n, claimer);
    long found = -2;
    char *s = reserve(&t, h, writing, &found);
    if (s == NULL) {
        PyBuffer_Release(&t.view);
        return PyLong_FromLong(found);
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
    publish(s, h, k, n, nbytes, tag, start, ready);
    PyBuffer_Release(&t.view);
    ring(wake, wake_offset(h), WAKE_ANY);
    return PyLong_FromLong(found);
fail:
    __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
    PyBuffer_Release(&t.view);
    return NULL;
}

PyDoc_STRVAR(slot_put_obj_doc,
             "slot_put_obj(table, writing, ready, claimer, tag, start, wake, limits, key, encoder, obj) -> int\n\n"
             "slot_put with the encoding written straight into the slot: reserve a FREE bucket (CAS FREE->writing),\n"
             "encode obj into the slot's payload area with encoder (omni_plugins.wire.native_c_api(): the compiled\n"
             "encoder's C API), replace a READY slot of the same key, publish, ring. Returns the encoded size; -1 if the key\n"
             "(or without UTF-8 bytes) or the encoding does not fit, -2 if no bucket is free (both after replacing an unconsumed payload of the\n"
             "key: the file path takes over), -3 if the compiled encoder declined (the Python encoder decides).");

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

/* Encode payload into dst (cap bytes) through the wire encoder's C API (`encoder`: its capsule).
 * Returns the message length (written only if <= cap), WIRE_ENCODE_DEFER, or -1 with an exception. */
static long long
encode_into_slot(PyObject *encoder, PyObject *payload, PyObject *limits, char *dst, Py_ssize_t cap)
{
    if (!PyCapsule_CheckExact(encoder)) {
        PyErr_Format(PyExc_TypeError, "encoder must be omni_plugins.wire.native_c_api(), not %.100s", Py_TYPE(encoder)->tp_name);
        return -1;
    }
    const WireCAPI *api = PyCapsule_GetPointer(encoder, WIRE_C_API_NAME);
    if (api == NULL)
        return -1;
    if (api->version != 1) {
        PyErr_Format(PyExc_RuntimeError, "omni_plugins.wire C API version %d (this extension knows 1)", api->version);
        return -1;
    }
    return api->encode_into(payload, limits, (unsigned char *)dst, cap);
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
    if ((k = utf8_key(key, &n)) == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    if (table_open(obj, &t) < 0)
        return NULL;
    if (n > SLOT_KEY_MAX) {
        PyBuffer_Release(&t.view);
        return PyLong_FromLong(-1);
    }
    uint64_t h = fnv1a(k, n);
    long index = -2;
    char *s = reserve(&t, h, writing, &index);
    if (s == NULL) {
        replace_ready(&t, h, k, n, claimer); /* maybe it frees a bucket; else the file path replaces it */
        s = reserve(&t, h, writing, &index);
        if (s == NULL) {
            PyBuffer_Release(&t.view);
            return PyLong_FromLong(-2);
        }
    }
    long long nbytes = encode_into_slot(encoder, payload, limits, s + SLOT_HDR, (Py_ssize_t)t.slot_bytes);
    if (nbytes < 0 || (uint64_t)nbytes > t.slot_bytes) {
        __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
        if (nbytes >= 0)
            replace_ready(&t, h, k, n, claimer); /* too big: the file path publishes it */
        PyBuffer_Release(&t.view);
        if (nbytes == -1)
            return NULL;
        return PyLong_FromLong(nbytes == WIRE_ENCODE_DEFER ? -3 : -1);
    }
    replace_ready(&t, h, k, n, claimer);
    publish(s, h, k, n, (Py_ssize_t)nbytes, tag, start, ready);
    PyBuffer_Release(&t.view);
    ring(wake, wake_offset(h), WAKE_ANY);
    return PyLong_FromLongLong(nbytes);
}

PyDoc_STRVAR(slot_take_doc,
             "slot_take(table, claimer, wake, key) -> bytearray | int | None\n\n"
             "Load the wake slot's seq, then look for a READY payload of key among its PROBES buckets; claim it\n"
             "(CAS READY->claimer), copy it into a new bytearray and free the slot. Returns the bytearray, or the\n"
             "seq read before looking (sleep on it with wait()), plus 1 << 32 when the table's count of unconsumed\n"
             "file-path payloads (read after looking) is not 0; None for a key without UTF-8 bytes (lone surrogates).\n"
             "ValueError if the claimed slot is corrupt (freed). (Arguments ordered for functools.partial.)");

/* one look for key: the payload (claimed, copied out, freed) as a bytearray, or NULL with *miss set to the seq
 * read before looking (| FILES_BIT when the file-path hint is not 0), or NULL with an exception */
static PyObject *
take_once(table_t *t, uint32_t *seq, uint64_t claimer, const char *k, Py_ssize_t n, uint64_t *miss)
{
    uint32_t seen = seq != NULL ? __atomic_load_n(seq, __ATOMIC_SEQ_CST) : 0;
    if (n <= SLOT_KEY_MAX) {
        uint64_t h = fnv1a(k, n);
        for (int p = 0; p < PROBES && p < (int)t->nslots; p++) {
            char *s = slot_at(t, h + (uint64_t)p);
            uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
            if ((w & 0xFF) != S_READY || !slot_has_key(s, h, k, n) || !claim_ready(s, w, claimer, h, k, n))
                continue;
            uint32_t len;
            memcpy(&len, s + SLOT_LEN_OFF, 4);
            if ((uint64_t)len > t->slot_bytes) {
                __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
                PyErr_Format(PyExc_ValueError, "slot %ld is corrupt: payload length %u > slot size %llu; freed it",
                             (long)((h + (uint64_t)p) % t->nslots), len, (unsigned long long)t->slot_bytes);
                return NULL;
            }
            PyObject *out = PyByteArray_FromStringAndSize(s + SLOT_HDR, (Py_ssize_t)len);
            __atomic_store_n(slot_state(s), (uint64_t)S_FREE, __ATOMIC_RELEASE);
            return out; /* NULL on MemoryError: the payload is lost like any failed get's */
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
    static const Py_ssize_t want[] = {4, 6, 5};
    PyObject *obj, *wake, *key;
    const char *k;
    Py_ssize_t n;
    unsigned long long claimer, expected = 0;
    double seconds = 0.0;
    table_t t;
    if (fast_args(fname[mode], nargs, want[mode]) < 0 || arg_u64(args[1], &claimer) < 0 || arg_str(args[3]) < 0)
        return NULL;
    obj = args[0], wake = args[2], key = args[3];
    if (mode == TAKE_WAIT && arg_u64(args[4], &expected) < 0)
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
    out = take_once(&t, seq, claimer, k, n, &miss);
    if (mode == TAKE_OR_WAIT && out == NULL && !PyErr_Occurred() && seq != NULL && seconds > 0.0 && !(miss & FILES_BIT)) {
        /* a miss with no file payload to look for: sleep on the seq read before the look, then look again */
        if ((slept = sleep_checked(seq, (uint32_t)miss, seconds)) < 0)
            goto done;
        timed_out = slept ? TIMED_OUT_BIT : 0;
        out = take_once(&t, seq, claimer, k, n, &miss);
    }
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
             "slot_take_wait(table, claimer, wake, key, expected, seconds) -> bytearray | int | None\n\n"
             "Sleep up to seconds while the key's wake slot reads expected (GIL released), then slot_take. A miss after\n"
             "a sleep that ran out its time has 1 << 33 added. (wake.sleep + slot_take in one call: the hot wait.)");

static PyObject *
native_slot_take_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return take(args, nargs, TAKE_WAIT);
}

PyDoc_STRVAR(slot_take_or_wait_doc,
             "slot_take_or_wait(table, claimer, wake, key, seconds) -> bytearray | int | None\n\n"
             "slot_take; if that misses and the file-path hint is 0, sleep up to seconds on the seq it read before\n"
             "looking (GIL released) and look once more: a blocking get's first look, its sleep and the look after it\n"
             "in one call. The miss is slot_take's (+ 1 << 33 when the sleep ran out its time); a miss with the\n"
             "file-path bit set is returned without sleeping.");

static PyObject *
native_slot_take_or_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return take(args, nargs, TAKE_OR_WAIT);
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
    uint64_t *word = (uint64_t *)(t.base + FILES_OFF), now;
    if (delta >= 0) {
        now = __atomic_add_fetch(word, (uint64_t)delta, __ATOMIC_SEQ_CST);
    } else {
        uint64_t cur = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        do {
            now = cur > (uint64_t)(-delta) ? cur - (uint64_t)(-delta) : 0;
        } while (!__atomic_compare_exchange_n(word, &cur, now, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    }
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLongLong(now);
}

PyDoc_STRVAR(slot_present_doc,
             "slot_present(table, keys) -> list[int]\n\nIndexes into keys (a list of str) of the keys with a READY slot.");

static PyObject *
native_slot_present(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys;
    table_t t;
    if (!PyArg_ParseTuple(args, "OO!:slot_present", &obj, &PyList_Type, &keys))
        return NULL;
    if (table_open(obj, &t) < 0)
        return NULL;
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
        for (int p = 0; p < PROBES && p < (int)t.nslots; p++) {
            char *s = slot_at(&t, h + (uint64_t)p);
            uint64_t w = __atomic_load_n(slot_state(s), __ATOMIC_ACQUIRE);
            if ((w & 0xFF) == S_READY && slot_has_key(s, h, k, n)) {
                PyObject *idx = PyLong_FromSsize_t(i);
                if (idx == NULL || PyList_Append(out, idx) < 0)
                    Py_CLEAR(out);
                Py_XDECREF(idx);
                break;
            }
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
    for (uint32_t i = 0; out && i < t.nslots; i++) {
        char *s = slot_at(&t, i);
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
        PyObject *item = Py_BuildValue("(IKkdy#)", i, (unsigned long long)w, (unsigned long)tag, when, s + SLOT_KEY_OFF, (Py_ssize_t)kn);
        if (item == NULL || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
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
    if (!PyArg_ParseTuple(args, "OnKK:slot_cas", &obj, &i, &expected, &desired))
        return NULL;
    if (table_open_at(obj, i, &t) < 0)
        return NULL;
    uint64_t want = expected;
    int ok = __atomic_compare_exchange_n(slot_state(slot_at(&t, (uint64_t)i)), &want, (uint64_t)desired, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE);
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
    if (!PyArg_ParseTuple(args, "On:slot_tag", &obj, &i))
        return NULL;
    if (table_open_at(obj, i, &t) < 0)
        return NULL;
    uint32_t tag;
    memcpy(&tag, slot_at(&t, (uint64_t)i) + 32, 4);
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLong(tag);
}

static PyMethodDef methods[] = {
    {"rename_noreplace", native_rename_noreplace, METH_VARARGS, rename_doc},
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
    {"slot_scan", native_slot_scan, METH_VARARGS, slot_scan_doc},
    {"slot_cas", native_slot_cas, METH_VARARGS, slot_cas_doc},
    {"slot_tag", native_slot_tag, METH_VARARGS, slot_tag_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "omni_plugins_shm._native", "Futex wake slots in shared mappings and renameat2 (see docs/backends/shm.md).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
