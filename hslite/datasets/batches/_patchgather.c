/* Patch gather from a band-major cube into contiguous (n, B, p, p) float32 patches, at memory speed on the CPU.
 *
 * Why C: in a band-major (B, H, W) cube a patch is B*p rows of p floats, one short run each. torch's index ops pay
 * a fixed cost per run that is several times the copy of p floats, and gathering whole spectra from a pixel-major
 * cube needs a (p*p, B) -> (B, p*p) transpose per sample that costs as much as the gather itself (hslite's torch
 * path: "vectorised, torch" in benchmarks/patches.py). Here each run is a few vector moves in a loop the compiler unrolls for the patch size,
 * and the next sample's runs are prefetched while this one is copied: the B*p runs of a sample lie a plane apart,
 * a pattern no hardware prefetcher follows, so without the hint every run waits on its own cache miss.
 * benchmarks/patches.py gives the figures.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch((address), 0, 2)
#else
#define PREFETCH(address) ((void)0)
#endif

/* One sample: out[b, i, j] = cube[b, row + i, col + j]; the compiler unrolls the inner copy when p is a constant. */
static inline void copy_sample(const float *origin, const float *next, float *out, Py_ssize_t bands,
                               Py_ssize_t plane, Py_ssize_t width, const Py_ssize_t p) {
    for (Py_ssize_t b = 0; b < bands; ++b) {
        const float *source = origin + b * plane;
        const float *ahead = next + b * plane;
        for (Py_ssize_t i = 0; i < p; ++i) {
            PREFETCH(ahead + i * width);
            PREFETCH(ahead + i * width + p - 1);
            memcpy(out, source + i * width, (size_t)p * sizeof(float));
            out += p;
        }
    }
}

static void gather_all(const float *cube, const int64_t *coords, float *out, Py_ssize_t n, Py_ssize_t bands,
                       Py_ssize_t height, Py_ssize_t width, Py_ssize_t p) {
    const Py_ssize_t plane = height * width, size = bands * p * p;
    for (Py_ssize_t s = 0; s < n; ++s) {
        const float *origin = cube + coords[2 * s] * width + coords[2 * s + 1];
        const Py_ssize_t t = s + 1 < n ? s + 1 : s;
        const float *next = cube + coords[2 * t] * width + coords[2 * t + 1];
        float *target = out + s * size;
        switch (p) { /* the usual patch sizes get a copy unrolled for them */
        case 1: copy_sample(origin, next, target, bands, plane, width, 1); break;
        case 3: copy_sample(origin, next, target, bands, plane, width, 3); break;
        case 5: copy_sample(origin, next, target, bands, plane, width, 5); break;
        case 7: copy_sample(origin, next, target, bands, plane, width, 7); break;
        case 9: copy_sample(origin, next, target, bands, plane, width, 9); break;
        case 11: copy_sample(origin, next, target, bands, plane, width, 11); break;
        case 13: copy_sample(origin, next, target, bands, plane, width, 13); break;
        case 15: copy_sample(origin, next, target, bands, plane, width, 15); break;
        default: copy_sample(origin, next, target, bands, plane, width, p);
        }
    }
}

static int check_buffer(Py_buffer *view, const char *name, int ndim, Py_ssize_t itemsize, const char *kinds) {
    const char *format = view->format ? view->format : "B";
    while (*format == '<' || *format == '=' || *format == '@') ++format;
    if (view->ndim != ndim || view->itemsize != itemsize || format[0] == '\0' || format[1] != '\0' ||
        strchr(kinds, format[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %d-d array of %zd-byte items (format %s); got %d-d, "
                     "format %s", name, ndim, itemsize, kinds, view->ndim, view->format ? view->format : "B");
        return -1;
    }
    return 0;
}

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *cube_object, *coords_object, *out_object;
    Py_ssize_t p;
    if (!PyArg_ParseTuple(args, "OOOn:gather", &cube_object, &coords_object, &out_object, &p)) return NULL;
    Py_buffer cube, coords, out;
    if (PyObject_GetBuffer(cube_object, &cube, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(coords_object, &coords, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&cube);
        return NULL;
    }
    if (PyObject_GetBuffer(out_object, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&cube);
        PyBuffer_Release(&coords);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_buffer(&cube, "cube", 3, 4, "f") < 0 || check_buffer(&coords, "coords", 2, 8, "lq") < 0 ||
        check_buffer(&out, "out", 4, 4, "f") < 0)
        goto done;
    const Py_ssize_t bands = cube.shape[0], height = cube.shape[1], width = cube.shape[2], n = coords.shape[0];
    if (p < 1 || p > height || p > width || coords.shape[1] != 2 || out.shape[0] != n || out.shape[1] != bands ||
        out.shape[2] != p || out.shape[3] != p) {
        PyErr_Format(PyExc_ValueError, "gather needs cube (B, H, W), coords (n, 2) and out (n, B, p, p) with "
                     "1 <= p <= H, W; got B=%zd H=%zd W=%zd, coords (%zd, %zd), p=%zd", bands, height, width, n,
                     coords.shape[1], p);
        goto done;
    }
    const int64_t *centres = (const int64_t *)coords.buf;
    for (Py_ssize_t s = 0; s < n; ++s) { /* nothing is read outside the cube, whatever the caller passes */
        if (centres[2 * s] < 0 || centres[2 * s] > height - p || centres[2 * s + 1] < 0 ||
            centres[2 * s + 1] > width - p) {
            PyErr_Format(PyExc_IndexError, "patch %zd at (%lld, %lld) falls outside the %zdx%zd image", s,
                         (long long)centres[2 * s], (long long)centres[2 * s + 1], height - p + 1, width - p + 1);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    gather_all((const float *)cube.buf, centres, (float *)out.buf, n, bands, height, width, p);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(out_object);
done:
    PyBuffer_Release(&cube);
    PyBuffer_Release(&coords);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(cube, coords, out, patch_size) -> out\n\n"
     "Copy the patch_size x patch_size patches whose top-left corners are coords (n, 2) int64 from the band-major\n"
     "float32 cube (B, H, W) into out (n, B, p, p) float32, all C-contiguous. Raises IndexError for a corner\n"
     "outside the cube and releases the GIL while copying."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_patchgather", "Patch gather at memory speed.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__patchgather(void) { return PyModule_Create(&module); }
