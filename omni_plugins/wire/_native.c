/*
 * omni_plugins.wire._native: a compiled fast path for the wire format's msgpack header.
 *
 * It is an *accelerator*, never an authority. The pure-Python codec (_encode.py,
 * _decode.py) defines the format; this module either produces exactly what the Python
 * code would, or hands the call back to it:
 *
 * encode(obj, limits) -> Encoded | None
 *     Walks dict / list / tuple / str / int / float / bool / None / small bytes of the
 *     exact builtin types and writes msgpack directly. Anything else (tensors, arrays,
 *     large bytes, subclasses) goes to the Python encoder's own methods, whose result
 *     (a fragment of exact builtins and the REF / TUPLE markers) is serialised as msgpack
 *     would. Returns None on any refusal, so that the Python encoder re-runs and raises
 *     its path-naming error. Bytes are identical to msgpack.Packer(use_bin_type=True).
 *
 * decode(buffer, copy, limits) -> object | DEFER
 *     Checks the prefix and header checksum, copies the header out of the (possibly
 *     shared) buffer, checks that it is well-formed msgpack of the shape [tree, table],
 *     parses and validates the whole buffer table (allowlisted dtype codes, shape x
 *     itemsize == nbytes with overflow checks, alignment, order, bounds) BEFORE it builds
 *     anything, then builds the tree. Failures of those checks raise WireFormatError.
 *     Anything the tree walk does not accept (depth, item budget, a non-str key, a misplaced
 *     marker, invalid UTF-8, a duplicate key whose first value the Python builder would
 *     never visit, ...) returns DEFER and the Python decoder decides; so the accepted set
 *     and the decoded values are the Python decoder's by construction.
 *
 * No read ever leaves the header copy or a validated buffer-table extent.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ configuration */

#define ALIGNMENT 64
#define PREFIX_SIZE 24
#define EXT_REF 1
#define EXT_TUPLE 2
#define OOB_BYTES_THRESHOLD 4096
#define MAX_EXTENT ((uint64_t)1 << 62)
/* Recursion bound of the C walks. Deeper payloads (only possible with a custom
 * Limits.max_depth) are handed to the Python code, which has its own limits. */
#define C_DEPTH_CAP 200
#define STACK_HEADER 4096

enum { KIND_TORCH = 0, KIND_NUMPY = 1, KIND_BYTES = 2 };

typedef struct {
    int valid;
    int kind;
    int needs_view;
    int is_bool;
    Py_ssize_t itemsize;
    PyObject *carrier;     /* numpy dtype */
    PyObject *torch_dtype; /* torch dtype or Py_None */
} Spec;

static Spec specs[256];
static int configured = 0;

static PyObject *WireFormatError, *Refused, *REF, *TUPLE, *EncodedType, *EncoderType, *TensorType, *SegmentType;
static PyObject *TorchSpecs, *Strided;
static PyObject *s_dtype, *s_is_cpu, *s_layout, *s_requires_grad, *s_is_contiguous, *s_is_neg, *s_is_conj, *s_shape, *s_nbytes;
static PyObject *s_offset, *s_source, *s__head, *s__data_start, *s__segments;
static PyObject *DefaultLimits, *DEFER;
static PyObject *np_frombuffer, *torch_from_numpy, *copy_out, *from_readonly, *zlib_crc32;
static PyObject *torch_frombuffer, *frombuffer_kwnames; /* torch.frombuffer and ("dtype", "count", "offset") */
static PyObject *s_walk, *s_tensor, *s_items, *s_cursor, *s_table, *s_segments, *s_reshape, *s_view, *s_cast;
static PyObject *s_max_header_bytes, *s_max_depth, *s_max_items, *s_max_ndim, *s_B, *s_data_ptr;

typedef struct {
    Py_ssize_t max_header_bytes, max_depth, max_items, max_ndim;
} CLimits;

static CLimits default_limits;

static int read_limit(PyObject *limits, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(limits, name);
    if (v == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    *out = n;
    return 0;
}

/* 0: read; 1: read, but a limit is negative (msgpack gives -1 a meaning of its own, so the
 * Python code decides); -1: error. */
static int read_limits(PyObject *limits, CLimits *out) {
    if (limits == DefaultLimits) {
        *out = default_limits;
        return 0;
    }
    if (read_limit(limits, s_max_header_bytes, &out->max_header_bytes) < 0) return -1;
    if (read_limit(limits, s_max_depth, &out->max_depth) < 0) return -1;
    if (read_limit(limits, s_max_items, &out->max_items) < 0) return -1;
    if (read_limit(limits, s_max_ndim, &out->max_ndim) < 0) return -1;
    return (out->max_header_bytes < 0 || out->max_depth < 0 || out->max_items < 0 || out->max_ndim < 0) ? 1 : 0;
}

/* ------------------------------------------------------------------ crc32 (zlib's) */

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
}

static uint32_t crc32_bytes(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo = ((uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24)) ^ c;
        uint32_t hi = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^ crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^ crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* zlib.crc32 of a header: the table version for short ones, zlib's (faster) above 1 MiB. */
static int header_crc(const unsigned char *p, size_t n, uint32_t *out) {
    if (n <= (1u << 20)) {
        *out = crc32_bytes(p, n);
        return 0;
    }
    PyObject *mv = PyMemoryView_FromMemory((char *)p, (Py_ssize_t)n, PyBUF_READ);
    if (mv == NULL) return -1;
    PyObject *c = PyObject_CallOneArg(zlib_crc32, mv);
    Py_DECREF(mv);
    if (c == NULL) return -1;
    *out = (uint32_t)PyLong_AsUnsignedLong(c);
    Py_DECREF(c);
    return PyErr_Occurred() ? -1 : 0;
}

/* ------------------------------------------------------------------ small helpers */

static inline void put_be16(unsigned char *p, uint16_t v) { p[0] = (unsigned char)(v >> 8); p[1] = (unsigned char)v; }
static inline void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16); p[2] = (unsigned char)(v >> 8); p[3] = (unsigned char)v;
}
static inline void put_be64(unsigned char *p, uint64_t v) { put_be32(p, (uint32_t)(v >> 32)); put_be32(p + 4, (uint32_t)v); }
static inline void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}
static inline void put_le64(unsigned char *p, uint64_t v) { put_le32(p, (uint32_t)v); put_le32(p + 4, (uint32_t)(v >> 32)); }
static inline uint16_t get_be16(const unsigned char *p) { return (uint16_t)(((uint16_t)p[0] << 8) | p[1]); }
static inline uint32_t get_be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static inline uint64_t get_be64(const unsigned char *p) { return ((uint64_t)get_be32(p) << 32) | get_be32(p + 4); }
static inline uint32_t get_le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t get_le64(const unsigned char *p) { return (uint64_t)get_le32(p) | ((uint64_t)get_le32(p + 4) << 32); }

/* ================================================================== encoder */

typedef struct {
    unsigned char *buf;
    size_t len, cap;
    unsigned char stack[1024];
} WBuf;

/* One buffer-table row of a plain tensor, kept in C until Python objects are needed. */
typedef struct {
    PyObject *code;   /* the dtype's code (int) */
    PyObject *shape;  /* the tensor's shape (torch.Size) */
    PyObject *source; /* the tensor (or its view as the carrier dtype) */
    uint64_t off, nbytes;
} CRow;

#define CROWS_STACK 8

typedef struct {
    WBuf w;
    CLimits lim;
    Py_ssize_t items;
    uint64_t cursor;     /* end of the data section so far */
    /* The buffer table: C rows while the walk stays in C; at the first call-back into the Python
     * encoder (or when an Encoded needs its segments) they become the two lists, which the
     * _Encoder then shares. */
    CRow *crows;
    Py_ssize_t ncrows, capcrows;
    CRow crow_stack[CROWS_STACK];
    PyObject *table;     /* list of [code, offset, nbytes, shape], or NULL while the rows are C rows */
    PyObject *segments;  /* list of Segment */
    PyObject *limits;    /* borrowed */
    PyObject *enc;       /* the Python _Encoder, created at the first call-back; shares table and segments */
} Enc;

/* All encoder functions return 0 on success and -1 to refuse; a refusal may or may not
 * have a Python exception set (the caller sorts that out). */

static int wb_grow(WBuf *w, size_t extra) {
    size_t need = w->len + extra;
    if (need < w->len) { PyErr_NoMemory(); return -1; }
    size_t ncap = w->cap * 2;
    while (ncap < need) ncap *= 2;
    unsigned char *nb;
    if (w->buf == w->stack) {
        nb = PyMem_Malloc(ncap);
        if (nb != NULL) memcpy(nb, w->buf, w->len);
    } else {
        nb = PyMem_Realloc(w->buf, ncap);
    }
    if (nb == NULL) { PyErr_NoMemory(); return -1; }
    w->buf = nb;
    w->cap = ncap;
    return 0;
}

static inline unsigned char *wb_take(WBuf *w, size_t n) {
    if (w->len + n > w->cap && wb_grow(w, n) < 0) return NULL;
    unsigned char *p = w->buf + w->len;
    w->len += n;
    return p;
}

static int w_uint(WBuf *w, uint64_t u) {
    unsigned char *p;
    if (u < 128) {
        if (!(p = wb_take(w, 1))) return -1;
        p[0] = (unsigned char)u;
    } else if (u < 256) {
        if (!(p = wb_take(w, 2))) return -1;
        p[0] = 0xcc; p[1] = (unsigned char)u;
    } else if (u < 65536) {
        if (!(p = wb_take(w, 3))) return -1;
        p[0] = 0xcd; put_be16(p + 1, (uint16_t)u);
    } else if (u <= 0xFFFFFFFFull) {
        if (!(p = wb_take(w, 5))) return -1;
        p[0] = 0xce; put_be32(p + 1, (uint32_t)u);
    } else {
        if (!(p = wb_take(w, 9))) return -1;
        p[0] = 0xcf; put_be64(p + 1, u);
    }
    return 0;
}

static int w_sint(WBuf *w, int64_t v) { /* v <= 0 */
    unsigned char *p;
    if (v >= -32) {
        if (!(p = wb_take(w, 1))) return -1;
        p[0] = (unsigned char)(int8_t)v;
    } else if (v >= -128) {
        if (!(p = wb_take(w, 2))) return -1;
        p[0] = 0xd0; p[1] = (unsigned char)(int8_t)v;
    } else if (v >= -32768) {
        if (!(p = wb_take(w, 3))) return -1;
        p[0] = 0xd1; put_be16(p + 1, (uint16_t)(int16_t)v);
    } else if (v >= -2147483648LL) {
        if (!(p = wb_take(w, 5))) return -1;
        p[0] = 0xd2; put_be32(p + 1, (uint32_t)(int32_t)v);
    } else {
        if (!(p = wb_take(w, 9))) return -1;
        p[0] = 0xd3; put_be64(p + 1, (uint64_t)v);
    }
    return 0;
}

/* An exact int within [-2**63, 2**64 - 1] (the encoder's range); -1 without an exception otherwise. */
static int w_long(WBuf *w, PyObject *o) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return -1;
        return v > 0 ? w_uint(w, (uint64_t)v) : w_sint(w, (int64_t)v);
    }
    if (overflow < 0) return -1;
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return w_uint(w, (uint64_t)u);
}

static int w_float(WBuf *w, PyObject *o) {
    double d = PyFloat_AS_DOUBLE(o);
    uint64_t bits;
    memcpy(&bits, &d, 8);
    unsigned char *p = wb_take(w, 9);
    if (!p) return -1;
    p[0] = 0xcb;
    put_be64(p + 1, bits);
    return 0;
}

static int w_rawhead(WBuf *w, size_t n, int is_bin) {
    unsigned char *p;
    if (!is_bin && n < 32) {
        if (!(p = wb_take(w, 1))) return -1;
        p[0] = (unsigned char)(0xa0 | n);
    } else if (n < 256) {
        if (!(p = wb_take(w, 2))) return -1;
        p[0] = is_bin ? 0xc4 : 0xd9; p[1] = (unsigned char)n;
    } else if (n < 65536) {
        if (!(p = wb_take(w, 3))) return -1;
        p[0] = is_bin ? 0xc5 : 0xda; put_be16(p + 1, (uint16_t)n);
    } else if (n <= 0xFFFFFFFFull) {
        if (!(p = wb_take(w, 5))) return -1;
        p[0] = is_bin ? 0xc6 : 0xdb; put_be32(p + 1, (uint32_t)n);
    } else {
        return -1; /* msgpack refuses; the Python encoder reports it */
    }
    return 0;
}

static int w_str(WBuf *w, PyObject *o) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    if (s == NULL) { PyErr_Clear(); return -1; } /* e.g. lone surrogates: the Python path names it */
    if (w_rawhead(w, (size_t)n, 0) < 0) return -1;
    unsigned char *p = wb_take(w, (size_t)n);
    if (!p) return -1;
    memcpy(p, s, (size_t)n);
    return 0;
}

static int w_bin(WBuf *w, const char *s, Py_ssize_t n) {
    if (w_rawhead(w, (size_t)n, 1) < 0) return -1;
    unsigned char *p = wb_take(w, (size_t)n);
    if (!p) return -1;
    memcpy(p, s, (size_t)n);
    return 0;
}

static int w_container(WBuf *w, size_t n, int is_map) {
    unsigned char *p;
    if (n < 16) {
        if (!(p = wb_take(w, 1))) return -1;
        p[0] = (unsigned char)((is_map ? 0x80 : 0x90) | n);
    } else if (n < 65536) {
        if (!(p = wb_take(w, 3))) return -1;
        p[0] = is_map ? 0xde : 0xdc; put_be16(p + 1, (uint16_t)n);
    } else if (n <= 0xFFFFFFFFull) {
        if (!(p = wb_take(w, 5))) return -1;
        p[0] = is_map ? 0xdf : 0xdd; put_be32(p + 1, (uint32_t)n);
    } else {
        return -1;
    }
    return 0;
}

static int w_ext0(WBuf *w, int code) {
    unsigned char *p = wb_take(w, 3);
    if (!p) return -1;
    p[0] = 0xc7; p[1] = 0; p[2] = (unsigned char)code;
    return 0;
}

/* Serialise a fragment the Python encoder returned (already walked and counted): exact
 * builtins, lists / tuples (torch.Size in the table), str-keyed dicts and the two markers. */
static int w_plain(WBuf *w, PyObject *o, int depth) {
    if (depth > C_DEPTH_CAP) return -1;
    PyTypeObject *t = Py_TYPE(o);
    if (o == Py_None) { unsigned char *p = wb_take(w, 1); if (!p) return -1; p[0] = 0xc0; return 0; }
    if (o == Py_True || o == Py_False) { unsigned char *p = wb_take(w, 1); if (!p) return -1; p[0] = o == Py_True ? 0xc3 : 0xc2; return 0; }
    if (t == &PyLong_Type) return w_long(w, o);
    if (t == &PyFloat_Type) return w_float(w, o);
    if (t == &PyUnicode_Type) return w_str(w, o);
    if (t == &PyBytes_Type) return w_bin(w, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
    if (o == REF) return w_ext0(w, EXT_REF);
    if (o == TUPLE) return w_ext0(w, EXT_TUPLE);
    if (t == &PyList_Type || PyTuple_Check(o)) {
        PyObject *seq = PySequence_Fast(o, "");
        if (seq == NULL) return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        int rc = w_container(w, (size_t)n, 0);
        for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(seq); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            Py_INCREF(item);
            rc = w_plain(w, item, depth + 1);
            Py_DECREF(item);
        }
        if (rc == 0 && PySequence_Fast_GET_SIZE(seq) != n) rc = -1;
        Py_DECREF(seq);
        return rc;
    }
    if (t == &PyDict_Type) {
        Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0;
        PyObject *k, *v;
        if (w_container(w, (size_t)n, 1) < 0) return -1;
        while (PyDict_Next(o, &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k)) return -1;
            Py_INCREF(k);
            Py_INCREF(v);
            int rc = w_str(w, k);
            if (rc == 0) rc = w_plain(w, v, depth + 1);
            Py_DECREF(k);
            Py_DECREF(v);
            if (rc < 0) return -1;
        }
        return PyDict_GET_SIZE(o) == n ? 0 : -1;
    }
    return -1;
}

static int set_ssize(PyObject *obj, PyObject *name, Py_ssize_t v) {
    PyObject *n = PyLong_FromSsize_t(v);
    if (n == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, n);
    Py_DECREF(n);
    return rc;
}

static int get_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *new_slotted(PyObject *type, PyObject *const *names, PyObject *const *values, int n);

/* Append one row to the lists: [code, offset, nbytes, shape] and its Segment. */
static int append_row(Enc *e, PyObject *code, uint64_t off, uint64_t n, PyObject *shape, PyObject *source) {
    PyObject *offset = PyLong_FromUnsignedLongLong(off), *nbytes = PyLong_FromUnsignedLongLong(n), *row = NULL, *segment = NULL;
    int rc = -1;
    if (offset == NULL || nbytes == NULL || (row = PyList_New(4)) == NULL) goto out;
    PyList_SET_ITEM(row, 0, Py_NewRef(code));
    PyList_SET_ITEM(row, 1, Py_NewRef(offset));
    PyList_SET_ITEM(row, 2, Py_NewRef(nbytes));
    PyList_SET_ITEM(row, 3, Py_NewRef(shape));
    {
        PyObject *names[3] = {s_offset, s_nbytes, s_source}, *values[3] = {offset, nbytes, source};
        if ((segment = new_slotted(SegmentType, names, values, 3)) == NULL) goto out;
    }
    if (PyList_Append(e->table, row) < 0 || PyList_Append(e->segments, segment) < 0) goto out;
    rc = 0;
out:
    Py_XDECREF(offset);
    Py_XDECREF(nbytes);
    Py_XDECREF(row);
    Py_XDECREF(segment);
    return rc;
}

static void clear_crows(Enc *e) {
    for (Py_ssize_t i = 0; i < e->ncrows; i++) {
        Py_DECREF(e->crows[i].code);
        Py_DECREF(e->crows[i].shape);
        Py_DECREF(e->crows[i].source);
    }
    e->ncrows = 0;
}

/* Switch the table to the two lists (moving the C rows there); from then on rows go to the lists. */
static int ensure_lists(Enc *e) {
    if (e->table != NULL) return 0;
    e->table = PyList_New(0);
    e->segments = PyList_New(0);
    if (e->table == NULL || e->segments == NULL) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < e->ncrows; i++) {
        CRow *r = &e->crows[i];
        rc = append_row(e, r->code, r->off, r->nbytes, r->shape, r->source);
    }
    clear_crows(e);
    return rc;
}

static int push_crow(Enc *e, PyObject *code, uint64_t off, uint64_t n, PyObject *shape, PyObject *source) {
    if (e->ncrows == e->capcrows) {
        Py_ssize_t ncap = e->capcrows * 2;
        CRow *nr = e->crows == e->crow_stack ? PyMem_Malloc((size_t)ncap * sizeof(CRow)) : PyMem_Realloc(e->crows, (size_t)ncap * sizeof(CRow));
        if (nr == NULL) { PyErr_NoMemory(); return -1; }
        if (e->crows == e->crow_stack) memcpy(nr, e->crow_stack, sizeof(e->crow_stack));
        e->crows = nr;
        e->capcrows = ncap;
    }
    CRow *r = &e->crows[e->ncrows++];
    r->code = Py_NewRef(code);
    r->shape = Py_NewRef(shape);
    r->source = Py_NewRef(source);
    r->off = off;
    r->nbytes = n;
    return 0;
}

/* Hand one value to the Python encoder (``_Encoder.walk`` or ``_tensor``) and serialise
 * the fragment it returns. The item budget and the data cursor go to and come back from
 * the ``_Encoder``; the table and segment lists are the same objects on both sides. */
static int e_callback(Enc *e, PyObject *o, int depth) {
    if (e->enc == NULL) {
        if (ensure_lists(e) < 0) return -1;
        e->enc = PyObject_CallOneArg(EncoderType, e->limits);
        if (e->enc == NULL) return -1;
        if (PyObject_SetAttr(e->enc, s_table, e->table) < 0 || PyObject_SetAttr(e->enc, s_segments, e->segments) < 0) return -1;
    }
    if (set_ssize(e->enc, s_items, e->items) < 0 || set_ssize(e->enc, s_cursor, (Py_ssize_t)e->cursor) < 0) return -1;
    PyObject *frag;
    if (Py_TYPE(o) == (PyTypeObject *)TensorType) {
        PyObject *args[2] = {e->enc, o};
        frag = PyObject_VectorcallMethod(s_tensor, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    } else {
        PyObject *d = PyLong_FromLong(depth);
        if (d == NULL) return -1;
        PyObject *args[3] = {e->enc, o, d};
        frag = PyObject_VectorcallMethod(s_walk, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(d);
    }
    if (frag == NULL) return -1;
    Py_ssize_t cursor;
    int rc = get_ssize(e->enc, s_items, &e->items);
    if (rc == 0) rc = get_ssize(e->enc, s_cursor, &cursor);
    if (rc == 0 && cursor < 0) rc = -1;
    if (rc == 0) {
        e->cursor = (uint64_t)cursor;
        rc = w_plain(&e->w, frag, 0);
    }
    Py_DECREF(frag);
    return rc;
}

/* An instance of a plain Python class with __slots__, without running its __init__
 * (Encoded and Segment only assign their arguments; the differential tests compare
 * every field through to_bytes() / buffers()). */
static PyObject *new_slotted(PyObject *type, PyObject *const *names, PyObject *const *values, int n) {
    PyObject *obj = ((PyTypeObject *)type)->tp_alloc((PyTypeObject *)type, 0);
    if (obj == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        if (PyObject_SetAttr(obj, names[i], values[i]) < 0) {
            Py_DECREF(obj);
            return NULL;
        }
    }
    return obj;
}

static int is_true_attr(PyObject *o, PyObject *name, int want) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = (v == (want ? Py_True : Py_False));
    Py_DECREF(v);
    return r;
}

static int is_true_call(PyObject *o, PyObject *name, int want) {
    PyObject *args[1] = {o};
    PyObject *v = PyObject_VectorcallMethod(name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (v == NULL) return -1;
    int r = (v == (want ? Py_True : Py_False));
    Py_DECREF(v);
    return r;
}

/* The common tensor: exact torch.Tensor, allowlisted dtype, CPU, strided, no autograd,
 * contiguous, no lazy neg / conj bit, ndim <= max_ndim. Returns 1 when it was added to the
 * table, 0 when the Python ``_tensor`` must handle it, -1 on error. Mirrors ``_tensor`` +
 * ``_add`` for exactly that case. */
static int e_plain_tensor(Enc *e, PyObject *t) {
    PyObject *dtype = PyObject_GetAttr(t, s_dtype);
    if (dtype == NULL) return -1;
    PyObject *spec = PyDict_GetItemWithError(TorchSpecs, dtype); /* (code, carrier torch dtype or None, is_complex) */
    Py_DECREF(dtype);
    if (spec == NULL) return PyErr_Occurred() ? -1 : 0;
    int r;
    if ((r = is_true_attr(t, s_is_cpu, 1)) != 1) return r;
    PyObject *layout = PyObject_GetAttr(t, s_layout);
    if (layout == NULL) return -1;
    r = layout == Strided;
    Py_DECREF(layout);
    if (!r) return 0;
    if ((r = is_true_attr(t, s_requires_grad, 0)) != 1) return r;
    if ((r = is_true_call(t, s_is_contiguous, 1)) != 1) return r;
    if ((r = is_true_call(t, s_is_neg, 0)) != 1) return r;
    if (PyTuple_GET_ITEM(spec, 2) == Py_True && (r = is_true_call(t, s_is_conj, 0)) != 1) return r;
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (shape == NULL) return -1;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > e->lim.max_ndim || e->items + 1 > e->lim.max_items) {
        Py_DECREF(shape);
        return 0;
    }
    PyObject *source = Py_NewRef(t), *carrier = PyTuple_GET_ITEM(spec, 1);
    if (carrier != Py_None) {
        PyObject *args[2] = {t, carrier};
        Py_SETREF(source, PyObject_VectorcallMethod(s_view, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
        if (source == NULL) { Py_DECREF(shape); return -1; }
    }
    Py_ssize_t n;
    uint64_t off = (e->cursor + ALIGNMENT - 1) & ~(uint64_t)(ALIGNMENT - 1);
    r = -1;
    if (get_ssize(source, s_nbytes, &n) < 0 || n < 0) goto out;
    PyObject *code = PyTuple_GET_ITEM(spec, 0);
    if ((e->table == NULL ? push_crow(e, code, off, (uint64_t)n, shape, source) : append_row(e, code, off, (uint64_t)n, shape, source)) < 0)
        goto out;
    e->items += 1;
    e->cursor = off + (uint64_t)n;
    r = 1;
out:
    Py_DECREF(source);
    Py_DECREF(shape);
    return r;
}

static int e_tensor(Enc *e, PyObject *t) {
    int r = e_plain_tensor(e, t);
    if (r < 0) return -1;
    if (r == 0) return e_callback(e, t, 0);
    return w_ext0(&e->w, EXT_REF);
}

static int e_walk(Enc *e, PyObject *o, int depth);

/* ``depth`` is the depth of the container being entered (the root container is 1). */
static int e_enter(Enc *e, Py_ssize_t n, int depth) {
    if (depth > e->lim.max_depth || depth > C_DEPTH_CAP) return -1;
    e->items += n;
    if (e->items > e->lim.max_items) return -1;
    return 0;
}

static int e_dict(Enc *e, PyObject *o, int depth) {
    Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0;
    PyObject *k, *v;
    if (e_enter(e, n, depth) < 0 || w_container(&e->w, (size_t)n, 1) < 0) return -1;
    while (PyDict_Next(o, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return -1;
        Py_INCREF(k);
        Py_INCREF(v);
        int rc = w_str(&e->w, k);
        if (rc == 0) rc = e_walk(e, v, depth);
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc < 0) return -1;
    }
    return PyDict_GET_SIZE(o) == n ? 0 : -1; /* changed under us by a call-back: let Python decide */
}

static int e_seq(Enc *e, PyObject *o, int depth, int is_tuple) {
    Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
    if (e_enter(e, n, depth) < 0 || w_container(&e->w, (size_t)n + (is_tuple ? 1 : 0), 0) < 0) return -1;
    if (is_tuple && w_ext0(&e->w, EXT_TUPLE) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!is_tuple && PyList_GET_SIZE(o) != n) return -1;
        PyObject *item = is_tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
        Py_INCREF(item);
        int rc = e_walk(e, item, depth);
        Py_DECREF(item);
        if (rc < 0) return -1;
    }
    return (is_tuple || PyList_GET_SIZE(o) == n) ? 0 : -1;
}

/* A value inside a container at ``depth`` (0 for the root). */
static int e_walk(Enc *e, PyObject *o, int depth) {
    PyTypeObject *t = Py_TYPE(o);
    if (t == &PyUnicode_Type) return w_str(&e->w, o);
    if (t == &PyLong_Type) return w_long(&e->w, o);
    if (t == &PyFloat_Type) return w_float(&e->w, o);
    if (o == Py_None || o == Py_True || o == Py_False) return w_plain(&e->w, o, 0);
    if (t == &PyDict_Type) return e_dict(e, o, depth + 1);
    if (t == &PyList_Type) return e_seq(e, o, depth + 1, 0);
    if (t == &PyTuple_Type) return e_seq(e, o, depth + 1, 1);
    if (t == &PyBytes_Type && PyBytes_GET_SIZE(o) < OOB_BYTES_THRESHOLD) return w_bin(&e->w, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
    if (t == (PyTypeObject *)TensorType) return e_tensor(e, o);
    return e_callback(e, o, depth);
}

static void enc_init(Enc *e, PyObject *limits) {
    e->w.buf = e->w.stack;
    e->w.cap = sizeof(e->w.stack);
    e->w.len = PREFIX_SIZE + 1; /* prefix, then the [tree, table] array header */
    e->items = 0;
    e->cursor = 0;
    e->crows = e->crow_stack;
    e->ncrows = 0;
    e->capcrows = CROWS_STACK;
    e->table = NULL;
    e->segments = NULL;
    e->limits = limits;
    e->enc = NULL;
}

static void enc_clear(Enc *e) {
    if (e->w.buf != e->w.stack) PyMem_Free(e->w.buf);
    Py_XDECREF(e->enc);
    clear_crows(e);
    if (e->crows != e->crow_stack) PyMem_Free(e->crows);
    Py_XDECREF(e->table);
    Py_XDECREF(e->segments);
}

/* Walk ``obj`` and finish the header in e->w (after PREFIX_SIZE bytes left for the prefix).
 * 0: done (*hlen, *data_start, *crc, *total set; e->segments holds the buffers); 1: refused
 * (no exception set: the Python encoder must decide); -1: error (exception set). */
typedef struct {
    size_t hlen, data_start; /* header length; where the data section starts */
    uint32_t crc;            /* of the header */
    uint64_t total;          /* message length */
} Head;

static int enc_run(Enc *e, PyObject *obj, Head *out) {
    int lim_rc = read_limits(e->limits, &e->lim);
    if (lim_rc < 0) return -1;
    if (lim_rc > 0) goto refuse;
    e->w.buf[PREFIX_SIZE] = 0x92;
    if (e_walk(e, obj, 0) < 0) goto refuse;
    if (e->table != NULL) {
        if (w_plain(&e->w, e->table, 0) < 0) goto refuse;
    } else { /* the C rows, exactly as w_plain writes the lists */
        if (w_container(&e->w, (size_t)e->ncrows, 0) < 0) goto refuse;
        for (Py_ssize_t i = 0; i < e->ncrows; i++) {
            const CRow *r = &e->crows[i];
            if (w_container(&e->w, 4, 0) < 0 || w_long(&e->w, r->code) < 0 || w_uint(&e->w, r->off) < 0 || w_uint(&e->w, r->nbytes) < 0 ||
                w_plain(&e->w, r->shape, 2) < 0)
                goto refuse;
        }
    }
    size_t hlen = e->w.len - PREFIX_SIZE;
    if (hlen > (size_t)e->lim.max_header_bytes || hlen > 0xFFFFFFFFu) goto refuse;
    if (header_crc(e->w.buf + PREFIX_SIZE, hlen, &out->crc) < 0) return -1;
    out->hlen = hlen;
    out->data_start = (PREFIX_SIZE + hlen + ALIGNMENT - 1) & ~(size_t)(ALIGNMENT - 1);
    out->total = (uint64_t)out->data_start + e->cursor;
    return 0;
refuse:
    /* A refusal: the Python encoder re-runs and raises its path-naming error. Exceptions
     * that are not Exceptions (KeyboardInterrupt, SystemExit) propagate. */
    if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 1;
    }
    return -1;
}

/* prefix + header + zero padding up to data_start, into h */
static void write_head(unsigned char *h, const Enc *e, const Head *hd) {
    memcpy(h, "OMNW", 4);
    h[4] = 1; /* FORMAT_VERSION */
    h[5] = 0;
    h[6] = 0;
    h[7] = 0;
    put_le32(h + 8, (uint32_t)hd->hlen);
    put_le32(h + 12, hd->crc);
    put_le64(h + 16, hd->total);
    memcpy(h + PREFIX_SIZE, e->w.buf + PREFIX_SIZE, hd->hlen);
    memset(h + PREFIX_SIZE + hd->hlen, 0, hd->data_start - PREFIX_SIZE - hd->hlen);
}

static PyObject *native_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!configured) { PyErr_SetString(PyExc_RuntimeError, "omni_plugins.wire._native is not configured"); return NULL; }
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "encode(obj, limits)"); return NULL; }
    Enc e;
    enc_init(&e, args[1]);
    PyObject *result = NULL, *head = NULL, *ds = NULL, *tot = NULL;
    Head hd;
    int rc = enc_run(&e, args[0], &hd);
    if (rc != 0) {
        result = rc > 0 ? Py_NewRef(Py_None) : NULL;
        goto done;
    }
    if (ensure_lists(&e) < 0) goto done; /* the Encoded holds the Segment list */
    head = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hd.data_start);
    if (head == NULL) goto done;
    write_head((unsigned char *)PyBytes_AS_STRING(head), &e, &hd);
    ds = PyLong_FromSize_t(hd.data_start);
    tot = PyLong_FromUnsignedLongLong(hd.total);
    if (ds == NULL || tot == NULL) goto done;
    {
        PyObject *names[4] = {s__head, s__data_start, s__segments, s_nbytes}, *values[4] = {head, ds, e.segments, tot};
        result = new_slotted(EncodedType, names, values, 4);
    }
done:
    enc_clear(&e);
    Py_XDECREF(head);
    Py_XDECREF(ds);
    Py_XDECREF(tot);
    return result;
}

/* Copy one segment's source (a plain CPU tensor, a C-contiguous array or bytes) to dst, exactly nbytes.
 * A tensor is re-checked here (contiguous, same nbytes) right before its memory is read: Python code
 * run by a call-back after the walk could have resized it. */
static int copy_source(unsigned char *dst, PyObject *source, Py_ssize_t nbytes) {
    if (Py_TYPE(source) == (PyTypeObject *)TensorType) {
        Py_ssize_t now;
        int contiguous = is_true_call(source, s_is_contiguous, 1);
        if (contiguous < 0 || get_ssize(source, s_nbytes, &now) < 0) return -1;
        if (!contiguous || now != nbytes) {
            PyErr_SetString(WireFormatError, "a tensor changed shape or layout while it was being encoded");
            return -1;
        }
        PyObject *args[1] = {source};
        PyObject *ptr = PyObject_VectorcallMethod(s_data_ptr, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (ptr == NULL) return -1;
        void *src = PyLong_AsVoidPtr(ptr);
        Py_DECREF(ptr);
        if (src == NULL) return PyErr_Occurred() ? -1 : (nbytes == 0 ? 0 : (PyErr_SetString(WireFormatError, "a tensor has no data"), -1));
        memcpy(dst, src, (size_t)nbytes);
        return 0;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(source, &b, PyBUF_C_CONTIGUOUS) < 0) return -1;
    int rc = 0;
    if (b.len != nbytes) {
        PyErr_SetString(WireFormatError, "a buffer changed size while it was being encoded");
        rc = -1;
    } else {
        memcpy(dst, b.buf, (size_t)nbytes);
    }
    PyBuffer_Release(&b);
    return rc;
}

/* The message into dst (cap bytes, >= total): head, then each segment at data_start + offset, gaps zeroed. */
static int write_message(unsigned char *dst, const Enc *e, const Head *hd) {
    write_head(dst, e, hd);
    uint64_t data_start = hd->data_start, total = hd->total, cursor = data_start;
    int c_rows = e->table == NULL; /* the walk stayed in C: its rows, else the Segment list */
    Py_ssize_t n = c_rows ? e->ncrows : PyList_GET_SIZE(e->segments);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off, nbytes;
        PyObject *source;
        if (c_rows) {
            const CRow *r = &e->crows[i];
            off = (Py_ssize_t)r->off;
            nbytes = (Py_ssize_t)r->nbytes;
            source = Py_NewRef(r->source);
        } else {
            PyObject *seg = PyList_GET_ITEM(e->segments, i);
            if (get_ssize(seg, s_offset, &off) < 0 || get_ssize(seg, s_nbytes, &nbytes) < 0) return -1;
            if ((source = PyObject_GetAttr(seg, s_source)) == NULL) return -1;
        }
        uint64_t start = (uint64_t)data_start + (uint64_t)off;
        if (off < 0 || nbytes < 0 || start < cursor || start + (uint64_t)nbytes > total) {
            Py_DECREF(source);
            PyErr_SetString(WireFormatError, "encoder segments are out of order (internal error)");
            return -1;
        }
        memset(dst + cursor, 0, (size_t)(start - cursor));
        int rc = nbytes ? copy_source(dst + start, source, nbytes) : 0;
        Py_DECREF(source);
        if (rc < 0) return -1;
        cursor = start + (uint64_t)nbytes;
    }
    memset(dst + cursor, 0, (size_t)(total - cursor));
    return 0;
}

/* encode_into for C callers (the C_API capsule): the message length (written to dst only if it
 * fits in cap bytes), ENCODE_DEFER to let the Python encoder decide, or -1 with an exception. */
#define ENCODE_DEFER (-2)

static long long encode_into_raw(PyObject *obj, PyObject *limits, unsigned char *dst, Py_ssize_t cap) {
    if (!configured) { PyErr_SetString(PyExc_RuntimeError, "omni_plugins.wire._native is not configured"); return -1; }
    Enc e;
    enc_init(&e, limits);
    long long result;
    Head hd;
    int rc = enc_run(&e, obj, &hd);
    if (rc != 0)
        result = rc > 0 ? ENCODE_DEFER : -1;
    else if (hd.total <= (uint64_t)cap && write_message(dst, &e, &hd) < 0)
        result = -1;
    else
        result = (long long)hd.total;
    enc_clear(&e);
    return result;
}

static PyObject *native_encode_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "encode_into(obj, limits, dest)"); return NULL; }
    Py_buffer dest;
    if (PyObject_GetBuffer(args[2], &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
        PyErr_Clear();
        return Py_NewRef(Py_None); /* let the Python path raise its error */
    }
    long long n = encode_into_raw(args[0], args[1], (unsigned char *)dest.buf, dest.len);
    PyBuffer_Release(&dest);
    if (n == ENCODE_DEFER) return Py_NewRef(Py_None);
    return n < 0 ? NULL : PyLong_FromLongLong(n);
}

/* The C API other extensions call without Python objects in between (PyCapsule C_API_NAME):
 * the shm slot table encodes straight into a slot with it. Layout and version are fixed;
 * a caller checks ``version`` and falls back to the Python-level encode_into otherwise. */
#define C_API_NAME "omni_plugins.wire._native.C_API"
typedef struct {
    int version; /* 1 */
    long long (*encode_into)(PyObject *obj, PyObject *limits, unsigned char *dst, Py_ssize_t cap);
} WireCAPI;

static const WireCAPI c_api = {1, encode_into_raw};

/* ================================================================== decoder */

typedef struct {
    const Spec *spec;
    Py_ssize_t off; /* absolute offset in the message */
    Py_ssize_t nbytes;
    Py_ssize_t count;
    PyObject *shape; /* tuple for reshape, NULL for 1-d */
} Row;

typedef struct {
    const unsigned char *h;   /* private copy of the header */
    const unsigned char *end; /* h + header_len */
    const unsigned char *data; /* the message (for buffers) */
    PyObject *mv;              /* the memoryview the buffers are views of */
    int copy, readonly;
    CLimits lim;
    Py_ssize_t depth_cap;
    Row *rows;
    Py_ssize_t nrows, next_ref, items;
} Dec;

static PyObject *wire_error(const char *fmt, ...) {
    va_list vargs;
    va_start(vargs, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, vargs);
    va_end(vargs);
    if (msg != NULL) {
        PyErr_SetObject(WireFormatError, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

/* --- structural scan: is [p, end) one well-formed msgpack object, as msgpack.unpackb with
 * our options would accept it (max_array_len = max_map_len = max_items, max_ext_len = 0,
 * only our two extension codes)? Map keys, UTF-8 and depth are left to the build walk.
 * Returns the end of the object or NULL with a WireFormatError set. */

#define NEED(n)                                                                         \
    do {                                                                                \
        if ((size_t)(end - p) < (size_t)(n)) {                                          \
            wire_error("header is not valid msgpack: truncated at header byte %zd", (Py_ssize_t)(p - start)); \
            return NULL;                                                                \
        }                                                                               \
    } while (0)

static const unsigned char *scan_object(const unsigned char *start, const unsigned char *p, const unsigned char *end, Py_ssize_t max_items) {
    uint64_t remaining = 1;
    while (remaining) {
        remaining--;
        NEED(1);
        unsigned int b = *p++;
        uint64_t len = 0, children = 0;
        int raw = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;
        if (b >= 0x80 && b <= 0x8f) { children = 2 * (uint64_t)(b & 0x0f); len = b & 0x0f; goto container_map; }
        if (b >= 0x90 && b <= 0x9f) { children = b & 0x0f; len = children; goto container_array; }
        if (b >= 0xa0 && b <= 0xbf) { len = b & 0x1f; raw = 1; goto rawdata; }
        switch (b) {
        case 0xcc: case 0xd0: NEED(1); p += 1; continue;
        case 0xcd: case 0xd1: NEED(2); p += 2; continue;
        case 0xce: case 0xd2: case 0xca: NEED(4); p += 4; continue;
        case 0xcf: case 0xd3: case 0xcb: NEED(8); p += 8; continue;
        case 0xc4: case 0xd9: NEED(1); len = p[0]; p += 1; raw = 1; goto rawdata;
        case 0xc5: case 0xda: NEED(2); len = get_be16(p); p += 2; raw = 1; goto rawdata;
        case 0xc6: case 0xdb: NEED(4); len = get_be32(p); p += 4; raw = 1; goto rawdata;
        case 0xc7: NEED(1); len = p[0]; p += 1; goto ext;
        case 0xc8: NEED(2); len = get_be16(p); p += 2; goto ext;
        case 0xc9: NEED(4); len = get_be32(p); p += 4; goto ext;
        case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
            wire_error("header is not valid msgpack: extension data longer than max_ext_len=0 at header byte %zd", (Py_ssize_t)(p - 1 - start));
            return NULL;
        case 0xdc: NEED(2); len = get_be16(p); p += 2; children = len; goto container_array;
        case 0xdd: NEED(4); len = get_be32(p); p += 4; children = len; goto container_array;
        case 0xde: NEED(2); len = get_be16(p); p += 2; children = 2 * len; goto container_map;
        case 0xdf: NEED(4); len = get_be32(p); p += 4; children = 2 * len; goto container_map;
        default:
            wire_error("header is not valid msgpack: reserved type byte 0x%x at header byte %zd", b, (Py_ssize_t)(p - 1 - start));
            return NULL;
        }
    rawdata:
        (void)raw;
        NEED(len);
        p += len;
        continue;
    ext:
        NEED(1);
        if (len != 0) {
            wire_error("header is not valid msgpack: extension data longer than max_ext_len=0 at header byte %zd", (Py_ssize_t)(p - start));
            return NULL;
        }
        if ((int8_t)p[0] != EXT_REF && (int8_t)p[0] != EXT_TUPLE) {
            wire_error("unknown msgpack extension type %d (0 data bytes)", (int)(int8_t)p[0]);
            return NULL;
        }
        p += 1;
        continue;
    container_map:
        if (len > (uint64_t)max_items) { /* msgpack's own wording: these are its max_map_len / max_array_len */
            wire_error("header is not valid msgpack: %llu exceeds max_map_len(%zd)", (unsigned long long)len, max_items);
            return NULL;
        }
        goto container;
    container_array:
        if (len > (uint64_t)max_items) {
            wire_error("header is not valid msgpack: %llu exceeds max_array_len(%zd)", (unsigned long long)len, max_items);
            return NULL;
        }
    container:
        NEED(children); /* every element takes at least one byte */
        remaining += children;
    }
    return p;
}

/* --- buffer table */

typedef struct {
    int neg;
    uint64_t u; /* magnitude */
} Int;

/* Read one msgpack int; 0 on success, 1 if the value there is not an int, -1 on truncation. */
static int read_int(const unsigned char **pp, const unsigned char *end, Int *out) {
    const unsigned char *p = *pp;
    if (p >= end) return -1;
    unsigned int b = *p++;
    size_t n = 0;
    out->neg = 0;
    if (b <= 0x7f) { out->u = b; *pp = p; return 0; }
    if (b >= 0xe0) { out->neg = 1; out->u = (uint64_t)(256 - b); *pp = p; return 0; }
    switch (b) {
    case 0xcc: case 0xd0: n = 1; break;
    case 0xcd: case 0xd1: n = 2; break;
    case 0xce: case 0xd2: n = 4; break;
    case 0xcf: case 0xd3: n = 8; break;
    default: return 1;
    }
    if ((size_t)(end - p) < n) return -1;
    uint64_t raw = n == 1 ? p[0] : n == 2 ? get_be16(p) : n == 4 ? get_be32(p) : get_be64(p);
    if (b >= 0xd0) { /* signed */
        int64_t v = n == 1 ? (int8_t)raw : n == 2 ? (int16_t)raw : n == 4 ? (int32_t)raw : (int64_t)raw;
        if (v < 0) { out->neg = 1; out->u = (uint64_t)0 - (uint64_t)v; }
        else out->u = (uint64_t)v;
    } else {
        out->u = raw;
    }
    *pp = p + n;
    return 0;
}

/* Read an array header; returns 0 and sets *n, 1 if not an array, -1 on truncation. */
static int read_array(const unsigned char **pp, const unsigned char *end, uint64_t *n) {
    const unsigned char *p = *pp;
    if (p >= end) return -1;
    unsigned int b = *p++;
    if (b >= 0x90 && b <= 0x9f) { *n = b & 0x0f; }
    else if (b == 0xdc) { if (end - p < 2) return -1; *n = get_be16(p); p += 2; }
    else if (b == 0xdd) { if (end - p < 4) return -1; *n = get_be32(p); p += 4; }
    else return 1;
    *pp = p;
    return 0;
}

/* Whether the Python builder's first step would exceed the item budget: it enters the root
 * container (depth 1) with the table's rows already counted, and adds the root's length. */
static int root_over_budget(const unsigned char *tree, const unsigned char *end, Py_ssize_t nrows, const CLimits *lim) {
    if (tree >= end || lim->max_depth < 1) return 0;
    unsigned int b = *tree;
    uint64_t n;
    if (b >= 0x80 && b <= 0x8f) n = b & 0x0f;
    else if (b == 0xde && end - tree >= 3) n = get_be16(tree + 1);
    else if (b == 0xdf && end - tree >= 5) n = get_be32(tree + 1);
    else if (read_array(&tree, end, &n) != 0) return 0;
    return (uint64_t)nrows + n > (uint64_t)lim->max_items;
}

static void free_rows(Row *rows, Py_ssize_t n) {
    if (rows == NULL) return;
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(rows[i].shape);
    PyMem_Free(rows);
}

/* The table was already scanned as well-formed msgpack; this reads it strictly as
 * [[code, offset, nbytes, [dims...]], ...] and applies every check of _check_table. */
static int parse_table(Dec *d, const unsigned char **pp, uint64_t data_start, uint64_t total) {
    const unsigned char *p = *pp, *end = d->end;
    uint64_t n;
    if (read_array(&p, end, &n) != 0) { wire_error("header buffer table is not a list"); return -1; }
    if (n > (uint64_t)d->lim.max_items) {
        wire_error("buffer table has %llu entries > max_items=%zd", (unsigned long long)n, d->lim.max_items);
        return -1;
    }
    if (n > (uint64_t)(end - p)) { wire_error("header buffer table is truncated"); return -1; }
    d->rows = n ? PyMem_Calloc((size_t)n, sizeof(Row)) : NULL;
    if (n && d->rows == NULL) { PyErr_NoMemory(); return -1; }
    d->nrows = (Py_ssize_t)n;
    uint64_t prev_end = 0, data_len = total - data_start;
    for (uint64_t i = 0; i < n; i++) {
        Row *row = &d->rows[i];
        uint64_t four, ndim;
        Int code, off, nbytes, dim;
        if (read_array(&p, end, &four) != 0 || four != 4) {
            wire_error("buffer table entry %llu is not [code, offset, nbytes, shape]", (unsigned long long)i);
            return -1;
        }
        if (read_int(&p, end, &code) != 0 || read_int(&p, end, &off) != 0 || read_int(&p, end, &nbytes) != 0 || read_array(&p, end, &ndim) != 0) {
            wire_error("buffer table entry %llu has fields of the wrong type", (unsigned long long)i);
            return -1;
        }
        if (code.neg || code.u > 255 || !specs[code.u].valid) {
            wire_error("buffer %llu: dtype code %s%llu is not in the allowlist", (unsigned long long)i, code.neg ? "-" : "",
                       (unsigned long long)code.u);
            return -1;
        }
        const Spec *spec = &specs[code.u];
        uint64_t itemsize = (uint64_t)spec->itemsize;
        if (ndim != 1) {
            if (spec->kind == KIND_BYTES) { wire_error("buffer %llu: bytes entry must have a 1-d shape", (unsigned long long)i); return -1; }
            if (ndim > (uint64_t)d->lim.max_ndim) {
                wire_error("buffer %llu: %llu dimensions > max_ndim=%zd", (unsigned long long)i, (unsigned long long)ndim, d->lim.max_ndim);
                return -1;
            }
        }
        /* extent = itemsize x product of (dim or 1), saturated above MAX_EXTENT */
        uint64_t extent = itemsize, product = 1;
        int zero = 0, too_large = 0;
        PyObject *shape = NULL;
        if (ndim != 1) {
            shape = PyTuple_New((Py_ssize_t)ndim);
            if (shape == NULL) return -1;
            row->shape = shape;
        }
        for (uint64_t k = 0; k < ndim; k++) {
            int rc = read_int(&p, end, &dim);
            if (rc != 0 || dim.neg) {
                wire_error("buffer %llu: shape has a dimension that is not a non-negative int", (unsigned long long)i);
                return -1;
            }
            if (dim.u == 0) zero = 1;
            uint64_t f = dim.u ? dim.u : 1;
            if (!too_large) {
                if (__builtin_mul_overflow(extent, f, &extent) || extent > MAX_EXTENT) too_large = 1;
                else product *= f; /* <= extent, no overflow */
            }
            if (shape != NULL) {
                PyObject *v = PyLong_FromUnsignedLongLong(dim.u);
                if (v == NULL) return -1;
                PyTuple_SET_ITEM(shape, (Py_ssize_t)k, v);
            }
        }
        if (too_large) { wire_error("buffer %llu: shape is too large for any array", (unsigned long long)i); return -1; }
        uint64_t count = zero ? 0 : product;
        if (nbytes.neg || count * itemsize != nbytes.u) {
            wire_error("buffer %llu: shape x itemsize %llu = %llu != declared length %s%llu", (unsigned long long)i, (unsigned long long)itemsize,
                       (unsigned long long)(count * itemsize), nbytes.neg ? "-" : "", (unsigned long long)nbytes.u);
            return -1;
        }
        if (off.neg) { wire_error("buffer %llu: offset -%llu overlaps the previous buffer", (unsigned long long)i, (unsigned long long)off.u); return -1; }
        if (off.u & (ALIGNMENT - 1)) {
            wire_error("buffer %llu: offset %llu is not %d-byte aligned", (unsigned long long)i, (unsigned long long)off.u, ALIGNMENT);
            return -1;
        }
        if (off.u < prev_end) {
            wire_error("buffer %llu: offset %llu overlaps the previous buffer (ends at %llu)", (unsigned long long)i, (unsigned long long)off.u,
                       (unsigned long long)prev_end);
            return -1;
        }
        if (off.u > data_len || nbytes.u > data_len - off.u) {
            wire_error("buffer %llu: bytes at data offset %llu (+%llu) lie outside the message (%llu data bytes)", (unsigned long long)i,
                       (unsigned long long)off.u, (unsigned long long)nbytes.u, (unsigned long long)data_len);
            return -1;
        }
        prev_end = off.u + nbytes.u;
        row->spec = spec;
        row->off = (Py_ssize_t)(data_start + off.u);
        row->nbytes = (Py_ssize_t)nbytes.u;
        row->count = (Py_ssize_t)count;
    }
    *pp = p;
    return 0;
}

/* --- build walk: returns a new reference, or NULL = defer to the Python decoder
 * (an exception may be set; the caller clears it). */

static PyObject *make_ref(Dec *d) {
    if (d->next_ref >= d->nrows) return NULL;
    Row *row = &d->rows[d->next_ref++];
    const Spec *spec = row->spec;
    const unsigned char *src = d->data + row->off;
    if (spec->kind == KIND_BYTES) return PyBytes_FromStringAndSize((const char *)src, row->nbytes);
    if (spec->is_bool) {
        for (Py_ssize_t i = 0; i < row->nbytes; i++)
            if (src[i] > 1) return NULL;
    }
    PyObject *count = PyLong_FromSsize_t(row->count);
    PyObject *off = PyLong_FromSsize_t(row->off);
    PyObject *arr = NULL;
    if (!d->copy && !d->readonly && row->shape == NULL && row->count > 0 && spec->torch_dtype != Py_None && !spec->needs_view) {
        /* a 1-d tensor viewing a writable buffer: torch.frombuffer makes it without a numpy array in between
         * (the same tensor as torch.from_numpy(numpy.frombuffer(...)): same memory, dtype, shape, writability;
         * it keeps the buffer exported while it lives). Measured across processes: ~0.8 us less per tensor on
         * two cores, ~3 us on one shared core. */
        PyObject *t = NULL;
        if (count != NULL && off != NULL) {
            PyObject *args[4] = {d->mv, spec->torch_dtype, count, off};
            t = PyObject_Vectorcall(torch_frombuffer, args, 1, frombuffer_kwnames);
        }
        Py_XDECREF(count);
        Py_XDECREF(off);
        return t;
    }
    if (count != NULL && off != NULL) {
        PyObject *args[4] = {d->mv, spec->carrier, count, off};
        arr = PyObject_Vectorcall(np_frombuffer, args, 4, NULL);
    }
    Py_XDECREF(count);
    Py_XDECREF(off);
    if (arr == NULL) return NULL;
    PyObject *tmp;
    if (row->shape != NULL) {
        PyObject *args[2] = {arr, row->shape};
        tmp = PyObject_VectorcallMethod(s_reshape, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(arr);
        if ((arr = tmp) == NULL) return NULL;
    }
    PyObject *to_tensor = torch_from_numpy;
    if (d->copy) {
        tmp = PyObject_CallOneArg(copy_out, arr);
        Py_DECREF(arr);
        if ((arr = tmp) == NULL) return NULL;
    } else if (d->readonly) {
        to_tensor = from_readonly;
    }
    if (spec->torch_dtype == Py_None) return arr;
    PyObject *t = PyObject_CallOneArg(to_tensor, arr);
    Py_DECREF(arr);
    if (t == NULL || !spec->needs_view) return t;
    PyObject *args[2] = {t, spec->torch_dtype};
    tmp = PyObject_VectorcallMethod(s_view, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(t);
    return tmp;
}

static PyObject *build(Dec *d, const unsigned char **pp, Py_ssize_t depth);

/* msgpack str at *pp (any str format); NULL if it is not a str or not valid UTF-8. */
static PyObject *read_str(const unsigned char **pp, const unsigned char *end) {
    const unsigned char *p = *pp;
    if (p >= end) return NULL;
    unsigned int b = *p++;
    uint64_t n;
    if (b >= 0xa0 && b <= 0xbf) n = b & 0x1f;
    else if (b == 0xd9) { if (end - p < 1) return NULL; n = p[0]; p += 1; }
    else if (b == 0xda) { if (end - p < 2) return NULL; n = get_be16(p); p += 2; }
    else if (b == 0xdb) { if (end - p < 4) return NULL; n = get_be32(p); p += 4; }
    else return NULL;
    if ((uint64_t)(end - p) < n) return NULL;
    *pp = p + n;
    return PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)n, NULL);
}

/* If the next object is an extension value of length 0 and type ``code``, skip it and return 1. */
static int take_marker(const unsigned char **pp, const unsigned char *end, int code) {
    const unsigned char *p = *pp;
    size_t hdr;
    if (p >= end) return 0;
    if (p[0] == 0xc7) hdr = 2;
    else if (p[0] == 0xc8) hdr = 3;
    else if (p[0] == 0xc9) hdr = 5;
    else return 0;
    if ((size_t)(end - p) < hdr + 1) return 0;
    for (size_t i = 1; i < hdr; i++)
        if (p[i] != 0) return 0;
    if ((int8_t)p[hdr] != code) return 0;
    *pp = p + hdr + 1;
    return 1;
}

static int enter(Dec *d, Py_ssize_t depth, uint64_t n) {
    if (depth > d->lim.max_depth || depth > d->depth_cap) return -1;
    if (n > (uint64_t)d->lim.max_items) return -1;
    d->items += (Py_ssize_t)n;
    return d->items > d->lim.max_items ? -1 : 0;
}

static PyObject *build_array(Dec *d, const unsigned char **pp, Py_ssize_t depth, uint64_t n) {
    if (enter(d, depth, n) < 0) return NULL;
    if (n > (uint64_t)(d->end - *pp)) return NULL;
    if (n > 0 && take_marker(pp, d->end, EXT_TUPLE)) {
        PyObject *tup = PyTuple_New((Py_ssize_t)n - 1);
        if (tup == NULL) return NULL;
        for (Py_ssize_t i = 0; i < (Py_ssize_t)n - 1; i++) {
            PyObject *v = build(d, pp, depth);
            if (v == NULL) { Py_DECREF(tup); return NULL; }
            PyTuple_SET_ITEM(tup, i, v);
        }
        return tup;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        PyObject *v = build(d, pp, depth);
        if (v == NULL) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, v);
    }
    return list;
}

static PyObject *build_map(Dec *d, const unsigned char **pp, Py_ssize_t depth, uint64_t n) {
    if (enter(d, depth, n) < 0) return NULL;
    if (n > (uint64_t)(d->end - *pp)) return NULL;
    PyObject *dict = PyDict_New();
    if (dict == NULL) return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *k = read_str(pp, d->end);
        if (k == NULL) goto fail;
        PyObject *v = build(d, pp, depth);
        if (v == NULL) { Py_DECREF(k); goto fail; }
        int rc = PyDict_SetItem(dict, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        /* a duplicate key: the Python builder walks the surviving values only */
        if (rc < 0 || (uint64_t)PyDict_GET_SIZE(dict) != i + 1) goto fail;
    }
    return dict;
fail:
    Py_DECREF(dict);
    return NULL;
}

/* One value inside a container at ``depth`` (0 for the root). */
static PyObject *build(Dec *d, const unsigned char **pp, Py_ssize_t depth) {
    const unsigned char *p = *pp, *end = d->end;
    if (p >= end) return NULL;
    unsigned int b = *p;
    if (b <= 0x7f) { *pp = p + 1; return PyLong_FromLong((long)b); }
    if (b >= 0xe0) { *pp = p + 1; return PyLong_FromLong((long)(int8_t)b); }
    if (b >= 0x80 && b <= 0x8f) { *pp = p + 1; return build_map(d, pp, depth + 1, b & 0x0f); }
    if (b >= 0x90 && b <= 0x9f) { *pp = p + 1; return build_array(d, pp, depth + 1, b & 0x0f); }
    if ((b >= 0xa0 && b <= 0xbf) || b == 0xd9 || b == 0xda || b == 0xdb) return read_str(pp, end);
    p++;
    size_t avail = (size_t)(end - p);
    uint64_t n;
    switch (b) {
    case 0xc0: *pp = p; Py_RETURN_NONE;
    case 0xc2: *pp = p; Py_RETURN_FALSE;
    case 0xc3: *pp = p; Py_RETURN_TRUE;
    case 0xcc: case 0xcd: case 0xce: case 0xcf: case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        Int v;
        if (read_int(pp, end, &v) != 0) return NULL;
        if (!v.neg) return PyLong_FromUnsignedLongLong(v.u);
        return PyLong_FromLongLong((long long)((uint64_t)0 - v.u));
    }
    case 0xca: {
        if (avail < 4) return NULL;
        uint32_t bits = get_be32(p);
        float f;
        memcpy(&f, &bits, 4);
        *pp = p + 4;
        return PyFloat_FromDouble((double)f);
    }
    case 0xcb: {
        if (avail < 8) return NULL;
        uint64_t bits = get_be64(p);
        double v;
        memcpy(&v, &bits, 8);
        *pp = p + 8;
        return PyFloat_FromDouble(v);
    }
    case 0xc4: case 0xc5: case 0xc6: {
        size_t hdr = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
        if (avail < hdr) return NULL;
        n = hdr == 1 ? p[0] : hdr == 2 ? get_be16(p) : get_be32(p);
        if (avail - hdr < n) return NULL;
        *pp = p + hdr + n;
        return PyBytes_FromStringAndSize((const char *)p + hdr, (Py_ssize_t)n);
    }
    case 0xc7: case 0xc8: case 0xc9:
        if (take_marker(pp, end, EXT_REF)) return make_ref(d);
        return NULL; /* a tuple marker out of place (or anything else): Python decides */
    case 0xdc: if (avail < 2) return NULL; *pp = p + 2; return build_array(d, pp, depth + 1, get_be16(p));
    case 0xdd: if (avail < 4) return NULL; *pp = p + 4; return build_array(d, pp, depth + 1, get_be32(p));
    case 0xde: if (avail < 2) return NULL; *pp = p + 2; return build_map(d, pp, depth + 1, get_be16(p));
    case 0xdf: if (avail < 4) return NULL; *pp = p + 4; return build_map(d, pp, depth + 1, get_be32(p));
    default: return NULL;
    }
}

static PyObject *as_byte_view(PyObject *buffer) {
    PyObject *mv = PyMemoryView_FromObject(buffer);
    if (mv == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return wire_error("cannot decode a %s: not a buffer-protocol object", Py_TYPE(buffer)->tp_name);
        }
        return NULL;
    }
    Py_buffer *view = PyMemoryView_GET_BUFFER(mv);
    if (!PyBuffer_IsContiguous(view, 'C')) {
        Py_DECREF(mv);
        return wire_error("buffer is not C-contiguous");
    }
    if (view->ndim != 1 || view->format == NULL || strcmp(view->format, "B") != 0) {
        PyObject *args[2] = {mv, s_B};
        PyObject *cast = PyObject_VectorcallMethod(s_cast, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(mv);
        if (cast == NULL) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                return wire_error("buffer is not C-contiguous");
            }
            return NULL;
        }
        mv = cast;
    }
    return mv;
}

static PyObject *native_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!configured) { PyErr_SetString(PyExc_RuntimeError, "omni_plugins.wire._native is not configured"); return NULL; }
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "decode(buffer, copy, limits)"); return NULL; }
    Dec d;
    memset(&d, 0, sizeof(d));
    unsigned char stack_header[STACK_HEADER];
    unsigned char *header = NULL;
    PyObject *result = NULL;
    int copy = PyObject_IsTrue(args[1]);
    if (copy < 0) return NULL;
    d.copy = copy;
    int lim_rc = read_limits(args[2], &d.lim);
    if (lim_rc < 0) return NULL;
    if (lim_rc > 0) return Py_NewRef(DEFER);
    d.depth_cap = C_DEPTH_CAP;
    PyObject *mv = as_byte_view(args[0]);
    if (mv == NULL) return NULL;
    Py_buffer *view = PyMemoryView_GET_BUFFER(mv);
    const unsigned char *base = (const unsigned char *)view->buf;
    uint64_t size = (uint64_t)view->len;
    d.readonly = view->readonly;
    if (size < PREFIX_SIZE) {
        wire_error("truncated message: %llu bytes is shorter than the %d-byte prefix", (unsigned long long)size, PREFIX_SIZE);
        goto done;
    }
    if (memcmp(base, "OMNW", 4) != 0) {
        PyObject *magic = PyBytes_FromStringAndSize((const char *)base, 4);
        if (magic != NULL) {
            wire_error("bad magic %R: not an omni_plugins.wire message (expected b'OMNW')", magic);
            Py_DECREF(magic);
        }
        goto done;
    }
    if (base[4] != 1) { wire_error("unsupported version %d (this decoder reads version 1)", (int)base[4]); goto done; }
    if (base[5] != 0 || base[6] != 0 || base[7] != 0) {
        wire_error("reserved prefix fields are not zero (flags=%d, reserved=%d)", (int)base[5], (int)(base[6] | (base[7] << 8)));
        goto done;
    }
    uint64_t hlen = get_le32(base + 8);
    uint32_t crc = get_le32(base + 12);
    uint64_t total = get_le64(base + 16);
    if (hlen > (uint64_t)d.lim.max_header_bytes) {
        wire_error("header length %llu exceeds max_header_bytes=%zd", (unsigned long long)hlen, d.lim.max_header_bytes);
        goto done;
    }
    if (total > size) {
        wire_error("truncated message: prefix declares %llu bytes but the buffer holds %llu", (unsigned long long)total, (unsigned long long)size);
        goto done;
    }
    uint64_t data_start = (PREFIX_SIZE + hlen + ALIGNMENT - 1) & ~(uint64_t)(ALIGNMENT - 1);
    if (data_start > total) {
        wire_error("header length %llu does not fit in the declared message length %llu", (unsigned long long)hlen, (unsigned long long)total);
        goto done;
    }
    /* Parse a private copy: a header in shared memory cannot change between the checks. */
    header = hlen <= STACK_HEADER ? stack_header : PyMem_Malloc((size_t)hlen);
    if (header == NULL) { PyErr_NoMemory(); goto done; }
    memcpy(header, base + PREFIX_SIZE, (size_t)hlen);
    uint32_t actual;
    if (header_crc(header, (size_t)hlen, &actual) < 0) goto done;
    if (actual != crc) { wire_error("header checksum mismatch (corrupted or truncated header)"); goto done; }
    d.h = header;
    d.end = header + hlen;
    const unsigned char *p = header;
    uint64_t two;
    int rc = read_array(&p, d.end, &two);
    if (rc != 0 || two != 2) {
        if (scan_object(header, header, d.end, d.lim.max_items) != NULL) wire_error("header is not a [tree, table] pair");
        goto done;
    }
    const unsigned char *tree = p;
    p = scan_object(header, p, d.end, d.lim.max_items);
    if (p == NULL) goto done;
    const unsigned char *table = p;
    p = scan_object(header, p, d.end, d.lim.max_items);
    if (p == NULL) goto done;
    if (p != d.end) { wire_error("header is not valid msgpack: %zd extra bytes after the header", (Py_ssize_t)(d.end - p)); goto done; }
    p = table;
    if (parse_table(&d, &p, data_start, total) < 0) goto done;
    if (total < size) {
        PyObject *sliced = PySequence_GetSlice(mv, 0, (Py_ssize_t)total);
        if (sliced == NULL) goto done;
        Py_SETREF(mv, sliced);
    }
    d.mv = mv;
    d.data = base;
    d.items = d.nrows;
    /* Two rejections the Python decoder would reach too, made here so that a crafted table (a
     * million rows nobody references) costs no second, Python-object parse of the header. */
    if (root_over_budget(tree, d.end, d.nrows, &d.lim)) {
        wire_error("more than max_items=%zd elements", d.lim.max_items);
        goto done;
    }
    p = tree;
    result = build(&d, &p, 0);
    if (result != NULL && p == table && d.next_ref != d.nrows) {
        Py_CLEAR(result);
        wire_error("header references %zd buffers but the table has %zd", d.next_ref, d.nrows);
        goto done;
    }
    if (result != NULL && p != table) Py_CLEAR(result);
    if (result == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) goto done; /* KeyboardInterrupt & co */
        PyErr_Clear();
        result = Py_NewRef(DEFER);
    }
done:
    free_rows(d.rows, d.nrows);
    if (header != NULL && header != stack_header) PyMem_Free(header);
    Py_DECREF(mv);
    return result;
}

/* ================================================================== configuration */

static PyObject *native_crc32(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t c = crc32_bytes((const unsigned char *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static int set_global(PyObject *kw, const char *name, PyObject **slot) {
    PyObject *v = PyDict_GetItemString(kw, name);
    if (v == NULL) {
        PyErr_Format(PyExc_TypeError, "configure() needs %s", name);
        return -1;
    }
    Py_XSETREF(*slot, Py_NewRef(v));
    return 0;
}

/* configure(**kw): hand the Python objects of the codec to the module (called once at import). */
static PyObject *native_configure(PyObject *self, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) != 0 || kw == NULL) { PyErr_SetString(PyExc_TypeError, "configure takes keyword arguments only"); return NULL; }
    /* once only: a decode in another thread holds borrowed pointers into the tables */
    if (configured) { PyErr_SetString(PyExc_RuntimeError, "omni_plugins.wire._native is already configured"); return NULL; }
    if (set_global(kw, "WireFormatError", &WireFormatError) < 0 || set_global(kw, "Refused", &Refused) < 0 || set_global(kw, "REF", &REF) < 0 ||
        set_global(kw, "TUPLE", &TUPLE) < 0 || set_global(kw, "Encoded", &EncodedType) < 0 || set_global(kw, "Encoder", &EncoderType) < 0 ||
        set_global(kw, "Tensor", &TensorType) < 0 || set_global(kw, "default_limits", &DefaultLimits) < 0 ||
        set_global(kw, "frombuffer", &np_frombuffer) < 0 || set_global(kw, "from_numpy", &torch_from_numpy) < 0 ||
        set_global(kw, "copy_out", &copy_out) < 0 || set_global(kw, "from_readonly", &from_readonly) < 0 ||
        set_global(kw, "crc32", &zlib_crc32) < 0 || set_global(kw, "Segment", &SegmentType) < 0 ||
        set_global(kw, "torch_specs", &TorchSpecs) < 0 || set_global(kw, "strided", &Strided) < 0 ||
        set_global(kw, "torch_frombuffer", &torch_frombuffer) < 0)
        return NULL;
    if (frombuffer_kwnames == NULL && (frombuffer_kwnames = Py_BuildValue("(sss)", "dtype", "count", "offset")) == NULL) return NULL;
    if (!PyType_Check(TensorType) || !PyType_Check(EncodedType) || !PyType_Check(SegmentType) || !PyDict_Check(TorchSpecs)) {
        PyErr_SetString(PyExc_TypeError, "Tensor, Encoded and Segment must be types, torch_specs a dict");
        return NULL;
    }
    {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(TorchSpecs, &pos, &k, &v)) {
            if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(v, 0))) {
                PyErr_SetString(PyExc_TypeError, "torch_specs values must be (code, carrier torch dtype or None, is_complex)");
                return NULL;
            }
        }
    }
    CLimits lim;
    if (read_limit(DefaultLimits, s_max_header_bytes, &lim.max_header_bytes) < 0 || read_limit(DefaultLimits, s_max_depth, &lim.max_depth) < 0 ||
        read_limit(DefaultLimits, s_max_items, &lim.max_items) < 0 || read_limit(DefaultLimits, s_max_ndim, &lim.max_ndim) < 0)
        return NULL;
    /* specs: a sequence of (code, kind, itemsize, carrier, torch_dtype or None, needs_view, is_bool) */
    PyObject *seq = PyDict_GetItemString(kw, "specs");
    if (seq == NULL) { PyErr_SetString(PyExc_TypeError, "configure() needs specs"); return NULL; }
    PyObject *fast = PySequence_Fast(seq, "specs must be a sequence");
    if (fast == NULL) return NULL;
    Spec fresh[256];
    memset(fresh, 0, sizeof(fresh));
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        int code, kind, needs_view, is_bool;
        Py_ssize_t itemsize;
        PyObject *carrier, *tdt;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iinOOpp", &code, &kind, &itemsize, &carrier, &tdt, &needs_view, &is_bool)) {
            Py_DECREF(fast);
            return NULL;
        }
        if (code < 0 || code > 255 || kind < KIND_TORCH || kind > KIND_BYTES || itemsize <= 0 || itemsize > 64) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "bad spec");
            return NULL;
        }
        fresh[code] = (Spec){1, kind, needs_view, is_bool, itemsize, carrier, tdt};
    }
    for (int c = 0; c < 256; c++) {
        if (fresh[c].valid) {
            Py_INCREF(fresh[c].carrier);
            Py_INCREF(fresh[c].torch_dtype);
        }
        Py_XDECREF(specs[c].carrier);
        Py_XDECREF(specs[c].torch_dtype);
        specs[c] = fresh[c];
    }
    Py_DECREF(fast);
    default_limits = lim;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))native_encode, METH_FASTCALL, "encode(obj, limits) -> Encoded, or None to let the Python encoder decide"},
    {"encode_into", (PyCFunction)(void (*)(void))native_encode_into, METH_FASTCALL,
     "encode_into(obj, limits, dest) -> int (the message length; written into dest only if it fits), or None to let the Python encoder decide"},
    {"decode", (PyCFunction)(void (*)(void))native_decode, METH_FASTCALL, "decode(buffer, copy, limits) -> object, or DEFER to let the Python decoder decide"},
    {"configure", (PyCFunction)(void (*)(void))native_configure, METH_VARARGS | METH_KEYWORDS, "configure(**objects) -- called once by omni_plugins.wire"},
    {"crc32", native_crc32, METH_O, "zlib-compatible CRC-32 of a bytes-like object (for tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "omni_plugins.wire._native", "Compiled header path of omni_plugins.wire.", -1, methods, NULL, NULL, NULL, NULL};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    INTERN(s_walk, "walk");
    INTERN(s_tensor, "_tensor");
    INTERN(s_items, "items");
    INTERN(s_cursor, "cursor");
    INTERN(s_table, "table");
    INTERN(s_segments, "segments");
    INTERN(s_reshape, "reshape");
    INTERN(s_view, "view");
    INTERN(s_cast, "cast");
    INTERN(s_B, "B");
    INTERN(s_max_header_bytes, "max_header_bytes");
    INTERN(s_max_depth, "max_depth");
    INTERN(s_max_items, "max_items");
    INTERN(s_max_ndim, "max_ndim");
    INTERN(s_dtype, "dtype");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_layout, "layout");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_is_neg, "is_neg");
    INTERN(s_is_conj, "is_conj");
    INTERN(s_shape, "shape");
    INTERN(s_nbytes, "nbytes");
    INTERN(s_offset, "offset");
    INTERN(s_source, "source");
    INTERN(s__head, "_head");
    INTERN(s__data_start, "_data_start");
    INTERN(s__segments, "_segments");
    INTERN(s_data_ptr, "data_ptr");
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    DEFER = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (DEFER == NULL || PyModule_AddObjectRef(m, "DEFER", DEFER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New((void *)&c_api, C_API_NAME, NULL);
    int added = capsule == NULL ? -1 : PyModule_AddObjectRef(m, "C_API", capsule);
    Py_XDECREF(capsule);
    if (added < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
