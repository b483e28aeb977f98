/*
 * zephon_torch._native.training: the fused kernel of SampleBatch.to_training.
 *
 * One call turns a batch of packed token rows (a [rows, width] array, plus
 * optional positions and loss mask of the same shape) into every requested
 * output at once, written into buffers the caller allocated:
 *
 *   inputs     tokens[:, :-1] with labels (else the whole rows), widened or
 *              narrowed to the output integer type;
 *   labels     tokens[:, 1:], set to ignore_index on each row's trailing
 *              padding (from width - padding_length - 1 on), where the loss
 *              mask (shifted by one) is 0, and after an EOS input token;
 *   positions  the input-aligned payload positions, or 0..w-1 in every row;
 *   loss_out   1.0 where a label is not ignore_index, else 0.0 (float32);
 *   pad_out    True on each row's trailing padding (input-aligned, bool);
 *   cu_seqlens the columns where the input positions are 0 (segment starts),
 *              row by row, then each row's length (padded to the longest row's
 *              count), or flattened, offset by each row's start in the batch;
 *              returned as a bytearray of int32, with maxlen, each row's longest
 *              segment, written into the caller's buffer.
 *
 * The twin is the numpy code in zephon_torch/_training.py, which states the
 * contract; tests/test_to_training_native.py holds the two to identical
 * outputs. Anything this kernel does not cover (a padding length outside its
 * row, a row whose positions do not start at 0) makes it return None before
 * it writes anything, and the caller takes the twin, which raises the
 * error that names the record. The row loops run with the GIL released.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { SHIFT = 1, SEQUENCE_POSITIONS = 2, EOS = 4, COUNT_VALID = 8, CU_SEQLENS = 16,
       FLATTEN = 32 };

typedef struct {
    Py_ssize_t rows, width, w; /* tokens [rows, width]; outputs [rows, w] */
    int flags;
    int64_t ignore, eos;
    const void *tokens;
    int tok64;
    const void *positions; /* NULL: none */
    int pos64;
    const uint8_t *loss; /* NULL: none; nonzero = supervised */
    const int64_t *pads; /* NULL: none */
    void *inputs, *labels, *pos_out; /* labels, pos_out may be NULL */
    int out64;
    float *loss_out;
    uint8_t *pad_out;
    int32_t *maxlen; /* NULL: none (flattened boundaries need no per-row maxima) */
    /* results */
    int32_t *starts;   /* with CU_SEQLENS: the segment starts, row after row (malloc) */
    Py_ssize_t cap;    /* starts' capacity */
    Py_ssize_t *count; /* with CU_SEQLENS: each row's number of starts (malloc) */
    int oom;           /* starts could not grow */
    int64_t valid;
    Py_ssize_t kmax, nstarts;
    int32_t maxseg;
} Job;

/* ------------------------------------------------------------------ row passes
 *
 * Each pass is one loop over a row that gcc vectorises; the outputs are written once, and
 * a row's inputs are read while they are in cache. Conversions are C's (they wrap, like
 * numpy's unsafe casts). Comparisons are made in CT, the narrower of the token and the
 * output type: an output value (OT)x equals v exactly when (CT)x equals (CT)v, for any v
 * that CT holds, and never for a v that CT does not hold (a comparison the caller then
 * drops). The passes are written once as macros and instantiated per type; the `use_*`
 * arguments are constants at every call, so each combination is its own tight loop. */

#define INLINE static inline __attribute__((always_inline))

/* dst[j] = src[j] over n values. */
#define DEFINE_COPY(NAME, ST, DT)                                               \
    static void NAME(DT *restrict dst, const ST *restrict src, Py_ssize_t n) { \
        for (Py_ssize_t j = 0; j < n; j++) dst[j] = (DT)src[j];                 \
    }
DEFINE_COPY(copy_i32_i32, int32_t, int32_t)
DEFINE_COPY(copy_i32_i64, int32_t, int64_t)
DEFINE_COPY(copy_i64_i32, int64_t, int32_t)
DEFINE_COPY(copy_i64_i64, int64_t, int64_t)

static void copy_values(void *dst, int dst64, const void *src, int src64, Py_ssize_t n) {
    if (src64) {
        if (dst64) copy_i64_i64((int64_t *)dst, (const int64_t *)src, n);
        else copy_i64_i32((int32_t *)dst, (const int64_t *)src, n);
    } else {
        if (dst64) copy_i32_i64((int64_t *)dst, (const int32_t *)src, n);
        else copy_i32_i32((int32_t *)dst, (const int32_t *)src, n);
    }
}

/* The first column from which `out` (items of `size` bytes) is 16-byte aligned, at most n.
 * Rows of an odd width start off the alignment every other row, and vector stores that
 * straddle cache lines are slower: each pass runs its first columns on their own. */
static Py_ssize_t aligned_from(const void *out, size_t size, Py_ssize_t n) {
    const uintptr_t off = (uintptr_t)out & 15;
    const Py_ssize_t head = off && off % size == 0 ? (Py_ssize_t)((16 - off) / size) : 0;
    return head < n ? head : n;
}

/* What the token pass of a row needs beyond its pointers. */
typedef struct {
    Py_ssize_t w, end; /* labels from `end` on are padding */
    int64_t ignore, eos;
    int ign_cmp, use_eos; /* ignore_index, the EOS id fit CT */
} TokenArgs;

/* Columns [j0, j1) of a row's tokens: inputs = t[j], labels = t[j + 1] unless ignored (from
 * `end` on, where the loss mask at j + 1 is 0, after an EOS input, or equal to
 * ignore_index itself), the float mask of the labels that count; returns their number. */
#define DEFINE_TOKENS(NAME, TT, OT, CT)                                                      \
    INLINE int32_t NAME##_body(const TT *restrict t, OT *restrict in, OT *restrict lab,      \
                               float *restrict lm, const uint8_t *restrict loss,             \
                               const TokenArgs *a, Py_ssize_t j0, Py_ssize_t j1,             \
                               const int use_loss, const int use_eos, const int use_lm,      \
                               const int ign_cmp) {                                          \
        const Py_ssize_t end = a->end < j1 ? a->end : j1;                                    \
        const OT ign = (OT)a->ignore;                                                        \
        const CT ign_c = (CT)a->ignore, eos_c = (CT)a->eos;                                  \
        int32_t valid = 0; /* rows are at most INT32_MAX wide */                             \
        for (Py_ssize_t j = j0; j < end; j++) {                                              \
            const TT x = t[j], y = t[j + 1];                                                 \
            int32_t keep = 1;                                                                \
            if (ign_cmp) keep &= (CT)y != ign_c;                                             \
            if (use_loss) keep &= loss[j + 1] != 0;                                          \
            if (use_eos) keep &= (CT)x != eos_c;                                             \
            in[j] = (OT)x;                                                                   \
            /* selected in CT, the narrower type, where ignore_index fits it */              \
            if (ign_cmp) lab[j] = (OT)(keep ? (CT)y : ign_c);                                \
            else lab[j] = keep ? (OT)y : ign;                                                \
            if (use_lm) lm[j] = (float)keep;                                                 \
            valid += keep;                                                                   \
        }                                                                                    \
        for (Py_ssize_t j = end > j0 ? end : j0; j < j1; j++) {                              \
            in[j] = (OT)t[j];                                                                \
            lab[j] = ign;                                                                    \
            if (use_lm) lm[j] = 0.0f;                                                        \
        }                                                                                    \
        return valid;                                                                        \
    }                                                                                        \
    INLINE int32_t NAME##_row(const TT *t, OT *in, OT *lab, float *lm, const uint8_t *loss,  \
                              const TokenArgs *a, const int use_loss, const int use_eos,     \
                              const int use_lm, const int ign_cmp) {                         \
        const Py_ssize_t head = aligned_from(in, sizeof(OT), a->w);                          \
        return NAME##_body(t, in, lab, lm, loss, a, 0, head, use_loss, use_eos, use_lm,      \
                           ign_cmp) +                                                        \
               NAME##_body(t, in, lab, lm, loss, a, head, a->w, use_loss, use_eos, use_lm,   \
                           ign_cmp);                                                         \
    }                                                                                        \
    static int64_t NAME(const TT *t, OT *in, OT *lab, float *lm, const uint8_t *loss,        \
                        const TokenArgs *a) {                                                \
        const int sel = (loss != NULL) | (a->use_eos << 1) | ((lm != NULL) << 2) |           \
                        (a->ign_cmp << 3);                                                   \
        switch (sel) {                                                                       \
        case 0: return NAME##_row(t, in, lab, lm, loss, a, 0, 0, 0, 0);                      \
        case 1: return NAME##_row(t, in, lab, lm, loss, a, 1, 0, 0, 0);                      \
        case 2: return NAME##_row(t, in, lab, lm, loss, a, 0, 1, 0, 0);                      \
        case 3: return NAME##_row(t, in, lab, lm, loss, a, 1, 1, 0, 0);                      \
        case 4: return NAME##_row(t, in, lab, lm, loss, a, 0, 0, 1, 0);                      \
        case 5: return NAME##_row(t, in, lab, lm, loss, a, 1, 0, 1, 0);                      \
        case 6: return NAME##_row(t, in, lab, lm, loss, a, 0, 1, 1, 0);                      \
        case 7: return NAME##_row(t, in, lab, lm, loss, a, 1, 1, 1, 0);                      \
        case 8: return NAME##_row(t, in, lab, lm, loss, a, 0, 0, 0, 1);                      \
        case 9: return NAME##_row(t, in, lab, lm, loss, a, 1, 0, 0, 1);                      \
        case 10: return NAME##_row(t, in, lab, lm, loss, a, 0, 1, 0, 1);                     \
        case 11: return NAME##_row(t, in, lab, lm, loss, a, 1, 1, 0, 1);                     \
        case 12: return NAME##_row(t, in, lab, lm, loss, a, 0, 0, 1, 1);                     \
        case 13: return NAME##_row(t, in, lab, lm, loss, a, 1, 0, 1, 1);                     \
        case 14: return NAME##_row(t, in, lab, lm, loss, a, 0, 1, 1, 1);                     \
        default: return NAME##_row(t, in, lab, lm, loss, a, 1, 1, 1, 1);                     \
        }                                                                                    \
    }
DEFINE_TOKENS(tokens_i32_i32, int32_t, int32_t, int32_t)
DEFINE_TOKENS(tokens_i32_i64, int32_t, int64_t, int32_t)
DEFINE_TOKENS(tokens_i64_i32, int64_t, int32_t, int32_t)
DEFINE_TOKENS(tokens_i64_i64, int64_t, int64_t, int64_t)

/* Columns [j0, j1) of a row's positions: copied to po (when `copy`) and, when `scan`, the
 * columns where they are 0 appended to starts (their count is returned). Blocks without a
 * zero cost one vectorised test. */
#define BLOCK 64
#define DEFINE_POSITIONS(NAME, PT, OT)                                                     \
    INLINE Py_ssize_t NAME##_body(const PT *restrict p, OT *restrict po, Py_ssize_t j0,    \
                                  Py_ssize_t j1, int32_t *restrict starts, const int copy, \
                                  const int scan) {                                        \
        Py_ssize_t n = 0, j = j0;                                                          \
        for (; j + BLOCK <= j1; j += BLOCK) {                                              \
            int zero = 0;                                                                  \
            for (int k = 0; k < BLOCK; k++) {                                              \
                const PT v = p[j + k];                                                     \
                if (copy) po[j + k] = (OT)v;                                               \
                zero |= v == 0;                                                            \
            }                                                                              \
            if (scan && zero)                                                              \
                for (int k = 0; k < BLOCK; k++)                                            \
                    if (p[j + k] == 0) starts[n++] = (int32_t)(j + k);                     \
        }                                                                                  \
        for (; j < j1; j++) {                                                              \
            if (copy) po[j] = (OT)p[j];                                                    \
            if (scan && p[j] == 0) starts[n++] = (int32_t)j;                               \
        }                                                                                  \
        return n;                                                                          \
    }                                                                                      \
    INLINE Py_ssize_t NAME##_row(const PT *p, OT *po, Py_ssize_t w, int32_t *starts,       \
                                 const int copy, const int scan) {                         \
        const Py_ssize_t head = copy ? aligned_from(po, sizeof(OT), w) : 0;                \
        const Py_ssize_t n = NAME##_body(p, po, 0, head, starts, copy, scan);              \
        return n + NAME##_body(p, po, head, w, starts + n, copy, scan);                    \
    }                                                                                      \
    static Py_ssize_t NAME(const PT *p, OT *po, Py_ssize_t w, int32_t *starts) {           \
        if (!starts) return NAME##_row(p, po, w, starts, 1, 0);                            \
        if (!po) return NAME##_row(p, po, w, starts, 0, 1);                                \
        return NAME##_row(p, po, w, starts, 1, 1);                                         \
    }
DEFINE_POSITIONS(positions_i32_i32, int32_t, int32_t)
DEFINE_POSITIONS(positions_i32_i64, int32_t, int64_t)
DEFINE_POSITIONS(positions_i64_i32, int64_t, int32_t)
DEFINE_POSITIONS(positions_i64_i64, int64_t, int64_t)

static Py_ssize_t positions_row(const void *p, int p64, void *po, int o64, Py_ssize_t w,
                                int32_t *starts) {
    if (p64) {
        if (o64) return positions_i64_i64((const int64_t *)p, (int64_t *)po, w, starts);
        return positions_i64_i32((const int64_t *)p, (int32_t *)po, w, starts);
    }
    if (o64) return positions_i32_i64((const int32_t *)p, (int64_t *)po, w, starts);
    return positions_i32_i32((const int32_t *)p, (int32_t *)po, w, starts);
}

/* 0, 1, ..., n - 1. */
#define DEFINE_IOTA(NAME, T)                                   \
    static void NAME(T *restrict dst, Py_ssize_t n) {          \
        for (Py_ssize_t j = 0; j < n; j++) dst[j] = (T)j;      \
    }
DEFINE_IOTA(iota_i32, int32_t)
DEFINE_IOTA(iota_i64, int64_t)

static int fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

static void run(Job *job) {
    const Py_ssize_t width = job->width, w = job->w;
    const size_t tsize = job->tok64 ? 8 : 4, psize = job->pos64 ? 8 : 4;
    const size_t osize = job->out64 ? 8 : 4;
    const int shift = (job->flags & SHIFT) != 0;
    const int narrow = !job->tok64 || !job->out64; /* CT is int32 */
    TokenArgs a;
    a.w = w;
    a.ignore = job->ignore;
    a.eos = job->eos;
    a.ign_cmp = !narrow || fits32(job->ignore);
    a.use_eos = (job->flags & EOS) && (!narrow || fits32(job->eos));
    const int cu = (job->flags & CU_SEQLENS) != 0;
    job->valid = 0;
    job->kmax = 0;
    job->nstarts = 0;
    job->maxseg = 0;
    for (Py_ssize_t r = 0; r < job->rows; r++) {
        const char *tok = (const char *)job->tokens + (size_t)(r * width) * tsize;
        char *in = (char *)job->inputs + (size_t)(r * w) * osize;
        const int64_t pad = job->pads ? job->pads[r] : 0;
        if (shift) {
            char *lab = (char *)job->labels + (size_t)(r * w) * osize;
            /* Label j is token j + 1: from width - pad - 1 on, labels are pads. */
            a.end = w;
            if (pad > 0) a.end = width - pad - 1 > 0 ? (Py_ssize_t)(width - pad - 1) : 0;
            const uint8_t *loss = job->loss ? job->loss + r * width : NULL;
            float *lm = job->loss_out ? job->loss_out + r * w : NULL;
            if (job->tok64)
                job->valid += job->out64
                    ? tokens_i64_i64((const int64_t *)tok, (int64_t *)in, (int64_t *)lab, lm,
                                     loss, &a)
                    : tokens_i64_i32((const int64_t *)tok, (int32_t *)in, (int32_t *)lab, lm,
                                     loss, &a);
            else
                job->valid += job->out64
                    ? tokens_i32_i64((const int32_t *)tok, (int64_t *)in, (int64_t *)lab, lm,
                                     loss, &a)
                    : tokens_i32_i32((const int32_t *)tok, (int32_t *)in, (int32_t *)lab, lm,
                                     loss, &a);
        } else {
            copy_values(in, job->out64, tok, job->tok64, w);
        }
        char *po = job->pos_out ? (char *)job->pos_out + (size_t)(r * w) * osize : NULL;
        if (po && (job->flags & SEQUENCE_POSITIONS)) {
            if (job->out64) iota_i64((int64_t *)po, w);
            else iota_i32((int32_t *)po, w);
            po = NULL;
        }
        int32_t *starts = NULL;
        if (cu) {
            /* Room for a start in every column of the row. */
            if (!job->starts || job->cap - job->nstarts < w) {
                Py_ssize_t cap = job->cap ? job->cap : 1024;
                while (cap - job->nstarts < w) cap *= 2;
                int32_t *grown = (int32_t *)realloc(job->starts, (size_t)cap * sizeof(int32_t));
                if (!grown) {
                    job->oom = 1;
                    return;
                }
                job->starts = grown;
                job->cap = cap;
            }
            starts = job->starts + job->nstarts;
        }
        if (po || starts) {
            const char *pos = (const char *)job->positions + (size_t)(r * width) * psize;
            const Py_ssize_t n = positions_row(pos, job->pos64, po, job->out64, w, starts);
            if (starts) {
                /* A segment runs to the next start, the row's last to its end. */
                int32_t longest = 0;
                for (Py_ssize_t k = 0; k < n; k++) {
                    const int32_t len = (k + 1 < n ? starts[k + 1] : (int32_t)w) - starts[k];
                    if (len > longest) longest = len;
                }
                job->count[r] = n;
                job->nstarts += n;
                if (n > job->kmax) job->kmax = n;
                if (job->maxlen) job->maxlen[r] = longest;
                if (longest > job->maxseg) job->maxseg = longest;
            }
        }
        if (job->pad_out) {
            /* Input column j is trailing padding from width - pad on. */
            uint8_t *pm = job->pad_out + r * w;
            const Py_ssize_t first = width - pad;
            for (Py_ssize_t j = 0; j < w; j++) pm[j] = j >= first;
        }
    }
}

/* ------------------------------------------------------------------ arguments */

typedef struct {
    Py_buffer views[10];
    int n;
} Views;

static void release(Views *v) {
    for (int i = 0; i < v->n; i++) PyBuffer_Release(&v->views[i]);
    v->n = 0;
}

/* The element kind of a buffer: 'i' signed integer, 'u' unsigned, 'f' float, '?' bool,
 * or 0 for anything else (a non-native byte order included). */
static char kind_of(const Py_buffer *view) {
    const char *f = view->format;
    if (!f) return 'u'; /* plain bytes */
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] == 0 || f[1] != 0) return 0;
    switch (f[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': return 'i';
    case 'B': case 'H': case 'I': case 'L': case 'Q': return 'u';
    case 'f': case 'd': return 'f';
    case '?': return '?';
    default: return 0;
    }
}

/* Take a C-contiguous buffer of at least `count` items, or NULL for None when `optional`.
 * `itemsize` 0 accepts 4 or 8 bytes; itemsize 1 accepts any 1-byte kind; otherwise the
 * kind must be `kind`. `write` asks for a writable buffer (an output). */
static Py_buffer *take(Views *v, PyObject *obj, const char *name, char kind,
                       Py_ssize_t itemsize, Py_ssize_t count, int optional, int write,
                       void **buf) {
    static Py_buffer none;
    *buf = NULL;
    if (obj == Py_None && optional) return &none;
    Py_buffer *view = &v->views[v->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (write ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a%s C-contiguous array", name,
                     write ? " writable" : "");
        return NULL;
    }
    v->n++;
    const char k = kind_of(view);
    const int size_ok = itemsize ? view->itemsize == itemsize
                                 : (view->itemsize == 4 || view->itemsize == 8);
    if (!size_ok || k == 0 || (view->itemsize != 1 && k != kind) ||
        view->len < count * view->itemsize) {
        const char *what = kind == 'i' ? "signed integers" : kind == 'f' ? "floats" : "bytes";
        if (itemsize)
            PyErr_Format(PyExc_TypeError,
                         "%s must hold at least %zd %s of %zd bytes, got %zd bytes of %zd-byte "
                         "items (format %s)", name, count, what, itemsize, view->len,
                         view->itemsize, view->format ? view->format : "B");
        else
            PyErr_Format(PyExc_TypeError,
                         "%s must hold at least %zd %s of 4 or 8 bytes, got %zd bytes of "
                         "%zd-byte items (format %s)", name, count, what, view->len,
                         view->itemsize, view->format ? view->format : "B");
        return NULL;
    }
    *buf = view->buf;
    return view;
}

/* The segment starts of a finished job laid out as cu_seqlens, a bytearray of int32:
 * row-wise, [rows, kmax + 1], each row's starts, then its length w repeated; flattened,
 * [nstarts + 1], the starts offset by row * w, then rows * w. */
static PyObject *boundaries(const Job *job) {
    const int flatten = (job->flags & FLATTEN) != 0;
    const Py_ssize_t w = job->w, kmax = job->kmax;
    const Py_ssize_t n = flatten ? job->nstarts + 1 : job->rows * (kmax + 1);
    PyObject *bytes = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    if (!bytes) return NULL;
    int32_t *out = (int32_t *)PyByteArray_AS_STRING(bytes);
    const int32_t *s = job->starts;
    for (Py_ssize_t r = 0; r < job->rows; r++) {
        const Py_ssize_t k = job->count[r];
        if (flatten) {
            for (Py_ssize_t i = 0; i < k; i++) *out++ = (int32_t)(r * w + s[i]);
        } else {
            memcpy(out, s, (size_t)k * sizeof(int32_t));
            for (Py_ssize_t i = k; i <= kmax; i++) out[i] = (int32_t)w;
            out += kmax + 1;
        }
        s += k;
    }
    if (flatten) *out = (int32_t)(job->rows * w);
    return bytes;
}

/* fill(tokens, positions, loss, pads, flags, ignore_index, eos_token_id,
 *      inputs, labels, pos_out, loss_out, pad_out, maxlen)
 *   -> (valid, cu_seqlens, kmax, maxseg), or None where the twin must decide;
 *   cu_seqlens is None without CU_SEQLENS. */
static PyObject *fill(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "fill() takes 13 arguments (%zd given)", nargs);
        return NULL;
    }
    Job job;
    memset(&job, 0, sizeof job);
    Views v;
    v.n = 0;
    PyObject *result = NULL;
    int64_t *pads = NULL;
    void *buf;
    Py_buffer *view;

    if (!(view = take(&v, args[0], "tokens", 'i', 0, 0, 0, 0, &buf))) goto done;
    if (view->ndim != 2) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a 2-D array of int32 or int64");
        goto done;
    }
    job.rows = view->shape[0];
    job.width = view->shape[1];
    job.tokens = buf;
    job.tok64 = view->itemsize == 8;
    job.flags = (int)PyLong_AsLong(args[4]);
    if (job.flags == -1 && PyErr_Occurred()) goto done;
    const int shift = (job.flags & SHIFT) != 0;
    if (shift && job.width < 1) {
        PyErr_SetString(PyExc_ValueError, "labels need rows of at least one token");
        goto done;
    }
    job.w = job.width - shift;
    const Py_ssize_t cells = job.rows * job.width, out_cells = job.rows * job.w;

    if (!(view = take(&v, args[1], "positions", 'i', 0, cells, 1, 0, &buf))) goto done;
    job.positions = buf;
    job.pos64 = buf && view->itemsize == 8;
    if (!take(&v, args[2], "loss", 'u', 1, cells, 1, 0, &buf)) goto done;
    job.loss = (const uint8_t *)buf;

    if (args[3] != Py_None) {
        PyObject *seq = PySequence_Fast(args[3], "pads must be a sequence of ints");
        if (!seq) goto done;
        if (PySequence_Fast_GET_SIZE(seq) != job.rows) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "pads must hold one length per row");
            goto done;
        }
        pads = (int64_t *)malloc((size_t)(job.rows ? job.rows : 1) * sizeof(int64_t));
        if (!pads) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            goto done;
        }
        int out_of_row = 0;
        for (Py_ssize_t r = 0; r < job.rows; r++) {
            int overflow = 0;
            long long pad =
                PyLong_AsLongLongAndOverflow(PySequence_Fast_GET_ITEM(seq, r), &overflow);
            if (pad == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                goto done;
            }
            if (overflow || pad < 0 || pad > job.width) out_of_row = 1;
            pads[r] = pad;
        }
        Py_DECREF(seq);
        if (out_of_row) {
            result = Py_NewRef(Py_None); /* the twin names the record */
            goto done;
        }
        job.pads = pads;
    }
    int overflow = 0;
    job.ignore = PyLong_AsLongLongAndOverflow(args[5], &overflow);
    if (!PyErr_Occurred() && !overflow)
        job.eos = PyLong_AsLongLongAndOverflow(args[6], &overflow);
    if (PyErr_Occurred() || overflow) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_OverflowError, "ignore_index or eos_token_id overflows");
        goto done;
    }

    /* inputs decides the output integer type; labels and positions share it */
    if (!(view = take(&v, args[7], "inputs", 'i', 0, out_cells, 0, 1, &buf))) goto done;
    job.inputs = buf;
    job.out64 = view->itemsize == 8;
    const Py_ssize_t osize = view->itemsize;
    if (!job.out64 && (job.ignore < INT32_MIN || job.ignore > INT32_MAX)) {
        PyErr_SetString(PyExc_OverflowError, "ignore_index does not fit the output type");
        goto done;
    }
    if (!take(&v, args[8], "labels", 'i', osize, shift ? out_cells : 0, 1, 1, &job.labels) ||
        !take(&v, args[9], "pos_out", 'i', osize, out_cells, 1, 1, &job.pos_out))
        goto done;
    if (!take(&v, args[10], "loss_out", 'f', 4, out_cells, 1, 1, &buf)) goto done;
    job.loss_out = (float *)buf;
    if (!take(&v, args[11], "pad_out", '?', 1, out_cells, 1, 1, &buf)) goto done;
    job.pad_out = (uint8_t *)buf;
    const int cu = (job.flags & CU_SEQLENS) != 0;
    if (!take(&v, args[12], "maxlen", 'i', 4, job.rows, !cu || (job.flags & FLATTEN), 1, &buf))
        goto done;
    job.maxlen = (int32_t *)buf;
    if (job.pos_out && !(job.flags & SEQUENCE_POSITIONS) && !job.positions) {
        PyErr_SetString(PyExc_ValueError, "pos_out needs positions or SEQUENCE_POSITIONS");
        goto done;
    }
    if ((job.loss_out || job.loss || (job.flags & (EOS | COUNT_VALID))) && !job.labels) {
        PyErr_SetString(PyExc_ValueError, "masks and counts need labels");
        goto done;
    }
    if (cu) {
        if (!job.positions) {
            PyErr_SetString(PyExc_ValueError, "cu_seqlens need positions");
            goto done;
        }
        if (job.w > INT32_MAX || ((job.flags & FLATTEN) && out_cells > INT32_MAX)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        /* Every nonempty row must start a segment; the twin names a row that does not. */
        for (Py_ssize_t r = 0; r < job.rows && job.w > 0; r++) {
            const int64_t first = job.pos64
                ? ((const int64_t *)job.positions)[r * job.width]
                : ((const int32_t *)job.positions)[r * job.width];
            if (first != 0) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
    }

    if (cu) {
        job.count = (Py_ssize_t *)malloc((size_t)(job.rows ? job.rows : 1) * sizeof(Py_ssize_t));
        if (!job.count) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (job.w > INT32_MAX) { /* counts of labels per row are int32 */
        result = Py_NewRef(Py_None);
        goto done;
    }

    Py_BEGIN_ALLOW_THREADS
    run(&job);
    Py_END_ALLOW_THREADS
    if (job.oom) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *bounds = cu ? boundaries(&job) : Py_NewRef(Py_None);
    if (bounds)
        result = Py_BuildValue("(LNnL)", (long long)job.valid, bounds, job.kmax,
                               (long long)job.maxseg);
done:
    release(&v);
    free(pads);
    free(job.starts);
    free(job.count);
    return result;
}

static PyMethodDef training_methods[] = {
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL,
     "fill(tokens, positions, loss, pads, flags, ignore_index, eos_token_id, inputs, labels, "
     "pos_out, loss_out, pad_out, maxlen) -> (valid, cu_seqlens, kmax, maxseg) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef training_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon_torch._native.training",
    .m_doc = "The fused kernel of SampleBatch.to_training (see zephon_torch/_training_native.py).",
    .m_size = -1,
    .m_methods = training_methods,
};

PyMODINIT_FUNC PyInit_training(void) {
    PyObject *m = PyModule_Create(&training_module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "SHIFT", SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "SEQUENCE_POSITIONS", SEQUENCE_POSITIONS) < 0 ||
        PyModule_AddIntConstant(m, "EOS", EOS) < 0 ||
        PyModule_AddIntConstant(m, "COUNT_VALID", COUNT_VALID) < 0 ||
        PyModule_AddIntConstant(m, "CU_SEQLENS", CU_SEQLENS) < 0 ||
        PyModule_AddIntConstant(m, "FLATTEN", FLATTEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
