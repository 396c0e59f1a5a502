// tracecmp._crecord, its row buffers: Buffer, the number columns of tracecmp.trace.columns.Columns,
// and append_row, one row into a Columns in its layout.
#include <climits>
#include <cstdint>
#include <cstring>

#include "record.hpp"

namespace tracecmp::record {
namespace {

// ---- Buffer: a column of numbers --------------------------------------------------------------

// A growable array of int64 ('q'), int32 ('i'), float64 ('d') or int8 ('b') values, the
// interface of array.array that tracecmp/trace/columns.py uses (its fallback where this module
// is not built): append, extend, len and the buffer protocol, with the typecode as the buffer's
// format. Values are stored as they come, so Arrow takes the column as one copy of its bytes
// instead of reading one Python object per row, cold, once a second. It never moves its storage
// while a view of it is alive (an append that would raises BufferError, as array.array does).
struct Buffer {
  PyObject_HEAD
  char* data;
  Py_ssize_t size;      // items
  Py_ssize_t capacity;  // items
  Py_ssize_t exports;
  char code[2];         // the typecode, a format string
  Py_ssize_t itemsize;  // also the buffer's one stride
};

bool is_buffer(PyObject* o) { return Py_IS_TYPE(o, &BufferType); }

// The next free item, growing the storage; nullptr with an exception set.
char* buffer_slot(Buffer* b) {
  if (b->size == b->capacity) {
    if (b->exports > 0) {
      PyErr_SetString(PyExc_BufferError, "cannot append to a Buffer while a view of it exists");
      return nullptr;
    }
    Py_ssize_t capacity = b->capacity < 64 ? 64 : b->capacity * 2;
    char* grown = static_cast<char*>(PyMem_Realloc(b->data, static_cast<size_t>(capacity) * b->itemsize));
    if (grown == nullptr) {
      PyErr_NoMemory();
      return nullptr;
    }
    b->data = grown;
    b->capacity = capacity;
  }
  return b->data + b->size * b->itemsize;
}

bool buffer_append(Buffer* b, PyObject* v) {
  char* slot = buffer_slot(b);
  if (slot == nullptr) return false;
  switch (b->code[0]) {
    case 'd': {
      double x = PyFloat_AsDouble(v);
      if (x == -1.0 && PyErr_Occurred()) return false;
      std::memcpy(slot, &x, sizeof x);
      break;
    }
    case 'q': {
      long long x = PyLong_AsLongLong(v);
      if (x == -1 && PyErr_Occurred()) return false;
      int64_t y = x;
      std::memcpy(slot, &y, sizeof y);
      break;
    }
    default: {  // 'i', 'b'
      long x = PyLong_AsLong(v);
      if (x == -1 && PyErr_Occurred()) return false;
      long low = b->code[0] == 'i' ? INT32_MIN : INT8_MIN, high = b->code[0] == 'i' ? INT32_MAX : INT8_MAX;
      if (x < low || x > high) {
        PyErr_Format(PyExc_OverflowError, "%ld does not fit a Buffer of typecode '%s'", x, b->code);
        return false;
      }
      if (b->code[0] == 'i') {
        int32_t y = static_cast<int32_t>(x);
        std::memcpy(slot, &y, sizeof y);
      } else {
        *slot = static_cast<char>(x);
      }
    }
  }
  ++b->size;
  return true;
}

// append to a column, a Buffer directly and anything else (a list, an array.array) by its method.
bool column_append(PyObject* column, PyObject* v) {
  if (is_buffer(column)) return buffer_append(reinterpret_cast<Buffer*>(column), v);
  if (PyList_CheckExact(column)) return PyList_Append(column, v) == 0;
  Ref r(PyObject_CallMethodOneArg(column, s.append, v));
  return static_cast<bool>(r);
}

// A zero (the value under a None) at the end of a column.
bool column_append_zero(PyObject* column) {
  if (!is_buffer(column)) return column_append(column, s.zero);
  auto* b = reinterpret_cast<Buffer*>(column);
  char* slot = buffer_slot(b);
  if (slot == nullptr) return false;
  std::memset(slot, 0, static_cast<size_t>(b->itemsize));
  ++b->size;
  return true;
}

PyObject* Buffer_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  const char* code = nullptr;
  static const char* keywords[] = {"typecode", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s:Buffer", const_cast<char**>(keywords), &code)) return nullptr;
  Py_ssize_t itemsize = 0;
  if (code[0] != '\0' && code[1] == '\0')
    itemsize = code[0] == 'q' || code[0] == 'd' ? 8 : code[0] == 'i' ? 4 : code[0] == 'b' ? 1 : 0;
  if (itemsize == 0) {
    PyErr_Format(PyExc_ValueError, "Buffer typecode must be 'q', 'i', 'd' or 'b', not '%s'", code);
    return nullptr;
  }
  auto* b = reinterpret_cast<Buffer*>(type->tp_alloc(type, 0));
  if (b == nullptr) return nullptr;
  b->data = nullptr;
  b->size = b->capacity = b->exports = 0;
  b->code[0] = code[0];
  b->code[1] = '\0';
  b->itemsize = itemsize;
  return reinterpret_cast<PyObject*>(b);
}

void Buffer_dealloc(PyObject* self) {
  PyMem_Free(reinterpret_cast<Buffer*>(self)->data);
  Py_TYPE(self)->tp_free(self);
}

PyObject* Buffer_append(PyObject* self, PyObject* v) {
  if (!buffer_append(reinterpret_cast<Buffer*>(self), v)) return nullptr;
  Py_RETURN_NONE;
}

PyObject* Buffer_extend(PyObject* self, PyObject* values) {
  Ref items(PySequence_Fast(values, "Buffer.extend takes an iterable"));
  if (!items) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items.p); ++i)
    if (!buffer_append(reinterpret_cast<Buffer*>(self), PySequence_Fast_GET_ITEM(items.p, i))) return nullptr;
  Py_RETURN_NONE;
}

PyObject* Buffer_truncate(PyObject* self, PyObject* arg) {
  Py_ssize_t size = PyLong_AsSsize_t(arg);
  if (size == -1 && PyErr_Occurred()) return nullptr;
  auto* b = reinterpret_cast<Buffer*>(self);
  if (size < 0 || size > b->size) {
    PyErr_Format(PyExc_ValueError, "cannot truncate a Buffer of %zd items to %zd", b->size, size);
    return nullptr;
  }
  b->size = size;  // the storage stays, so a view alive now still points at valid memory
  Py_RETURN_NONE;
}

PyObject* Buffer_typecode(PyObject* self, void*) { return PyUnicode_FromString(reinterpret_cast<Buffer*>(self)->code); }

Py_ssize_t Buffer_length(PyObject* self) { return reinterpret_cast<Buffer*>(self)->size; }

int Buffer_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  auto* b = reinterpret_cast<Buffer*>(self);
  static char empty_storage = 0;  // a valid pointer for an empty buffer
  view->obj = Py_NewRef(self);
  view->buf = b->data != nullptr ? b->data : &empty_storage;
  view->len = b->size * b->itemsize;
  view->readonly = 0;
  view->itemsize = b->itemsize;
  view->format = (flags & PyBUF_FORMAT) ? b->code : nullptr;
  view->ndim = 1;
  view->shape = (flags & PyBUF_ND) ? &b->size : nullptr;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &b->itemsize : nullptr;
  view->suboffsets = nullptr;
  view->internal = nullptr;
  ++b->exports;
  return 0;
}

void Buffer_releasebuffer(PyObject* self, Py_buffer*) { --reinterpret_cast<Buffer*>(self)->exports; }

PyMethodDef buffer_methods[] = {
    {"append", Buffer_append, METH_O, "append(value): one value at the end."},
    {"extend", Buffer_extend, METH_O, "extend(values): the values at the end, in order."},
    {"truncate", Buffer_truncate, METH_O, "truncate(size): keep the first size values."},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef buffer_getset[] = {{"typecode", Buffer_typecode, nullptr, "the array.array typecode", nullptr},
                               {nullptr, nullptr, nullptr, nullptr, nullptr}};
PySequenceMethods buffer_sequence = {Buffer_length};
PyBufferProcs buffer_procs = {Buffer_getbuffer, Buffer_releasebuffer};

}  // namespace

bool buffer_extend_doubles(PyObject* column, const double* values, Py_ssize_t n) {
  if (!is_buffer(column) || reinterpret_cast<Buffer*>(column)->code[0] != 'd') {
    PyErr_SetString(PyExc_TypeError, "not a Buffer of typecode 'd'");
    return false;
  }
  auto* b = reinterpret_cast<Buffer*>(column);
  for (Py_ssize_t i = 0; i < n; ++i) {
    char* slot = buffer_slot(b);
    if (slot == nullptr) return false;
    std::memcpy(slot, &values[i], sizeof(double));
    ++b->size;
  }
  return true;
}

PyTypeObject BufferType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Columns.append: one row into a Columns buffer (tracecmp/trace/columns.py), field by field as
// Columns.kinds says: 's' a list of objects, 'n' a Buffer, 'N' a Buffer and its validity (0 for
// None), 'l' a list column: its items to one Buffer and its length to the next.
bool append_row(PyObject* columns, PyObject* const* fields, int n, Py_ssize_t* rows) {
  Ref parts(PyObject_GetAttr(columns, s.parts));
  Ref kinds(parts ? PyObject_GetAttr(columns, s.kinds) : nullptr);
  if (!kinds) return false;
  if (!PyTuple_Check(parts.p) || !PyBytes_Check(kinds.p) || PyBytes_GET_SIZE(kinds.p) != n) {
    PyErr_SetString(PyExc_TypeError, "row does not fit the Columns layout");
    return false;
  }
  const char* kind = PyBytes_AS_STRING(kinds.p);
  Py_ssize_t j = 0, count = PyTuple_GET_SIZE(parts.p);
  Py_ssize_t before = count > 0 ? PyObject_Length(PyTuple_GET_ITEM(parts.p, 0)) : -1;
  if (before < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "row does not fit the Columns layout");
    return false;
  }
  // A value that cannot be stored leaves the buffers as they were: the columns stay aligned.
  auto rollback = [&]() {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    Ref size(PyLong_FromSsize_t(before));
    Ref r(size ? PyObject_CallMethodOneArg(columns, s._rollback, size.p) : nullptr);
    if (!r) PyErr_WriteUnraisable(columns);
    PyErr_Restore(type, value, traceback);
    return false;
  };
  for (int i = 0; i < n; ++i) {
    PyObject* v = fields[i];
    bool pair = kind[i] == 'N' || kind[i] == 'l';
    if (j + (pair ? 1 : 0) >= count) {
      PyErr_SetString(PyExc_ValueError, "row does not fit the Columns layout");
      return rollback();
    }
    PyObject* part = PyTuple_GET_ITEM(parts.p, j);
    bool ok = true;
    switch (kind[i]) {
      case 'N': {
        PyObject* valid = PyTuple_GET_ITEM(parts.p, j + 1);
        ok = v == Py_None ? column_append_zero(part) && column_append(valid, s.zero)
                          : column_append(part, v) && column_append(valid, s.one);
        break;
      }
      case 'l': {
        if (!PyTuple_Check(v)) {
          PyErr_SetString(PyExc_TypeError, "a list column's value must be a tuple");
          return rollback();
        }
        for (Py_ssize_t k = 0; ok && k < PyTuple_GET_SIZE(v); ++k) ok = column_append(part, PyTuple_GET_ITEM(v, k));
        Ref length(ok ? PyLong_FromSsize_t(PyTuple_GET_SIZE(v)) : nullptr);
        ok = length && column_append(PyTuple_GET_ITEM(parts.p, j + 1), length.p);
        break;
      }
      default:  // 's', 'n'
        ok = column_append(part, v);
    }
    if (!ok) return rollback();
    j += pair ? 2 : 1;
  }
  if (rows != nullptr) *rows = PyObject_Length(PyTuple_GET_ITEM(parts.p, 0));
  return rows == nullptr || *rows >= 0;
}

bool ready_buffer_type() {
  BufferType.tp_name = "tracecmp._crecord.Buffer";
  BufferType.tp_basicsize = sizeof(Buffer);
  BufferType.tp_flags = Py_TPFLAGS_DEFAULT;
  BufferType.tp_doc = "Buffer(typecode): a growable column of numbers ('q', 'i', 'd' or 'b'), as array.array.";
  BufferType.tp_new = Buffer_new;
  BufferType.tp_dealloc = Buffer_dealloc;
  BufferType.tp_methods = buffer_methods;
  BufferType.tp_getset = buffer_getset;
  BufferType.tp_as_sequence = &buffer_sequence;
  BufferType.tp_as_buffer = &buffer_procs;
  return PyType_Ready(&BufferType) == 0;
}

}  // namespace tracecmp::record
