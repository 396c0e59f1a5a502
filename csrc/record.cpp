// tracecmp._crecord: the capture mode's per-op path in C, over the CPython API only.
//
// tracecmp.capture.mode.CaptureMode.__torch_dispatch__ is the reference: these files do the
// same steps in the same order on the same Python objects (the mode's instance dict, its scope,
// locator and weak records), so a trace is identical row for row whichever runs, and the tests
// require that. What it saves is the interpreter: recording an op takes ~3 us of C instead of
// ~8 us of bytecode (benchmarks/overhead_ablation.py). It runs the common cases itself (an op of
// a known schema returning one new tensor, one view, one written input or only new tensors; CPU
// statistics by the fused kernel) and calls the reference's own methods for everything rarer (a
// new source tensor, an alias update, other output patterns, accelerator or saved tensors), or
// hands the whole op to the reference before anything is recorded (an op seen for the first
// time, argument rewrites, full stacks). Like _cstats it includes no torch headers: one build
// serves every torch.
//
// Python API:
//   configure(**objects)   once, from tracecmp.capture.mode (the reference's helpers and types)
//   dispatch(mode, func, types, args=(), kwargs=None)   bound to a mode as its __torch_dispatch__
//   passthrough(mode, func, types, args, kwargs=None)   the same binding recording nothing (benchmarks)
//
// Files: record.cpp (this module: configure() and the method table), record_buffer.cpp (the
// number columns of the row buffers), record_identity.cpp (which value each tensor holds),
// record_check.cpp (sampled self-checks), record_dispatch.cpp (the per-op path),
// record.hpp (what they share).
#include "record.hpp"

namespace tracecmp::record {

Config g;
Names s;

namespace {

PyObject* configure(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"slow", "tensor_type", "op_overload", "op_infos", "one_fresh", "marker",
                                   "scan_value", "plain_types", "rec_type", "current_node", "sequence_nr",
                                   "grad_enabled", "inference_enabled", "num_threads", "stats_module",
                                   "native_codes", "parallel_min", "view_kind", "write_kind", "fresh_kind",
                                   "parameter_type", "strided", "stack_len", "graph_task", "recipe_kinds", nullptr};
  Config c;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOO!OOOO!OOOOOOOO!OOOOOOOOO", const_cast<char**>(keywords), &c.slow,
                                   &c.tensor_type, &c.op_overload, &PyDict_Type, &c.op_infos, &c.one_fresh,
                                   &c.marker, &c.scan_value, &PyTuple_Type, &c.plain_types, &c.rec_type,
                                   &c.current_node, &c.sequence_nr, &c.grad_enabled, &c.inference_enabled,
                                   &c.num_threads, &c.stats_module, &PyDict_Type, &c.native_codes,
                                   &c.parallel_min, &c.view_kind, &c.write_kind, &c.fresh_kind, &c.parameter_type,
                                   &c.strided, &c.stack_len, &c.graph_task, &c.recipe_kinds))
    return nullptr;
  if (!PyType_Check(c.tensor_type) || !PyType_Check(c.op_overload) || !PyType_Check(c.rec_type) ||
      !PyType_Check(c.parameter_type)) {
    PyErr_SetString(PyExc_TypeError, "tensor_type, op_overload, rec_type and parameter_type must be types");
    return nullptr;
  }
  PyObject** fields[] = {&c.slow, &c.tensor_type, &c.op_overload, &c.op_infos, &c.one_fresh, &c.marker,
                         &c.scan_value, &c.plain_types, &c.rec_type, &c.current_node, &c.sequence_nr,
                         &c.grad_enabled, &c.inference_enabled, &c.num_threads, &c.stats_module,
                         &c.native_codes, &c.parallel_min, &c.view_kind, &c.write_kind, &c.fresh_kind,
                         &c.parameter_type, &c.strided, &c.stack_len, &c.graph_task, &c.recipe_kinds};
  for (PyObject** f : fields) Py_INCREF(*f);
  c.ready = true;
  g = c;  // once per process; a second call (a reload) leaks the first set, by design tiny
  ready_ops();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dispatch)),
     METH_FASTCALL | METH_KEYWORDS,
     "dispatch(mode, func, types, args=(), kwargs=None)\n\nCaptureMode.__torch_dispatch__ in C; "
     "bind it to a mode with types.MethodType."},
    {"passthrough", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(passthrough)),
     METH_FASTCALL | METH_KEYWORDS,
     "passthrough(mode, func, types, args, kwargs=None)\n\nRe-dispatch the op as dispatch() does, "
     "recording nothing: the floor of a capture built on a dispatch mode."},
    {"forget", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forget)), METH_FASTCALL,
     "forget(known, rec)\n\nCaptureMode._forget over the map ``known``, for weak-record callbacks."},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(configure)),
     METH_VARARGS | METH_KEYWORDS, "configure(**objects): the reference's helpers and types, once."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tracecmp._crecord",
                          "The capture mode's per-op path in C (no torch headers).", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace tracecmp::record

using namespace tracecmp::record;

PyMODINIT_FUNC PyInit__crecord() {
#define TRACECMP_INTERN(n)                          \
  s.n = PyUnicode_InternFromString(#n);             \
  if (s.n == nullptr) return nullptr;
  TRACECMP_NAMES(TRACECMP_INTERN)
#undef TRACECMP_INTERN
  s.empty = PyUnicode_FromString("");
  s.one = PyLong_FromLong(1);
  s.zero = PyLong_FromLong(0);
  if (s.empty == nullptr || s.one == nullptr || s.zero == nullptr) return nullptr;
  if (!ready_buffer_type()) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr || PyModule_AddObjectRef(module, "Buffer", reinterpret_cast<PyObject*>(&BufferType)) < 0) {
    Py_XDECREF(module);
    return nullptr;
  }
  return module;
}
