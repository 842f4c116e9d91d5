// The kda_ops._C Python module. Importing it loads this library, whose TORCH_LIBRARY blocks
// (csrc/api/registration.cpp and the per-backend files) register the torch.ops.kda schemas and kernels.
// Its functions: the routing spine's Python face (kda_ops/_routing.py: the launch knobs and the split route,
// kda/route/route.h), and the key of the eager fast path of kda_ops.recurrent_kda (kda_ops/interface.py):
//
//   tensor_call_key(n_writes, *args) -> bytes | None
//
// args are tensors or None; the last n_writes of them are the tensors the call writes. Returns an exact
// key of what the Python layer validated about them (per argument: absent, or the Python type, dtype,
// device, sizes and strides), or None when an argument is not None, a torch.Tensor or a torch.nn.Parameter
// (subclasses such as FakeTensor always take the full path), or when the memory
// of a non-empty written tensor overlaps that of another argument (the full path then raises the error
// that names them). In C++ this costs well under a microsecond; the same key built from Python attribute
// reads cost ~10 µs per decode step (benchmarks/bench_api_overhead.py).
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "kda/route/route.h"

namespace {

struct Span {
  uintptr_t lo, hi;  // [lo, hi) bytes
};

// [data, data + extent) of a non-empty tensor's memory (strides are never negative in torch).
bool tensor_span(const at::Tensor& t, Span* s) {
  if (t.numel() == 0) return false;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  s->lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  s->hi = s->lo + static_cast<uintptr_t>(extent) * t.element_size();
  return true;
}

// torch.nn.Parameter, looked up once when the module loads (kda_ops imports torch, and with it torch.nn,
// before _C; a lookup here, not at a first call, keeps Python calls out of a C++ static initialiser that a
// second thread could block on while holding the GIL). Null if the lookup failed: parameters then always
// take the full path.
PyTypeObject* g_parameter_type = nullptr;

void look_up_parameter_type() {
  if (PyObject* nn = PyImport_ImportModule("torch.nn")) {
    PyObject* p = PyObject_GetAttrString(nn, "Parameter");
    if (p != nullptr && PyType_Check(p))
      g_parameter_type = reinterpret_cast<PyTypeObject*>(p);  // a reference kept for the process
    else
      Py_XDECREF(p);
    Py_DECREF(nn);
  }
  PyErr_Clear();
}

PyObject* call_key(PyObject* const* args, Py_ssize_t nargs);

PyObject* tensor_call_key(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return call_key(args, nargs);
  } catch (const std::exception&) {  // a tensor whose metadata cannot be read here: the full path decides
    Py_RETURN_NONE;
  }
}

PyObject* call_key(PyObject* const* args, Py_ssize_t nargs) {
  constexpr Py_ssize_t kMaxArgs = 32;
  if (nargs < 1 || nargs - 1 > kMaxArgs) {
    PyErr_SetString(PyExc_TypeError, "tensor_call_key(n_writes, *tensors): 1 to 32 tensors");
    return nullptr;
  }
  const long n_writes = PyLong_AsLong(args[0]);
  if (n_writes < 0 || n_writes > nargs - 1) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "tensor_call_key: n_writes out of range");
    return nullptr;
  }
  const Py_ssize_t n = nargs - 1;
  std::string key;
  key.reserve(static_cast<size_t>(n) * 80);
  auto put = [&key](int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  Span spans[kMaxArgs];
  bool has_span[kMaxArgs];
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = args[i + 1];
    has_span[i] = false;
    if (obj == Py_None) {
      put(0);
      continue;
    }
    PyTypeObject* type = Py_TYPE(obj);
    if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) && type != g_parameter_type) Py_RETURN_NONE;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) Py_RETURN_NONE;
    put(static_cast<int64_t>(reinterpret_cast<uintptr_t>(type)));
    const at::Device dev = t.device();
    put(static_cast<int64_t>(t.scalar_type()) | (static_cast<int64_t>(dev.type()) << 8) |
        ((static_cast<int64_t>(dev.index()) + 1) << 16) | (static_cast<int64_t>(t.dim()) << 32));
    for (int64_t d = 0; d < t.dim(); ++d) put(t.size(d));
    for (int64_t d = 0; d < t.dim(); ++d) put(t.stride(d));
    // meta tensors have no memory to compare
    if (dev.type() != at::kMeta) has_span[i] = tensor_span(t, &spans[i]);
  }
  // every written tensor against every other argument
  for (Py_ssize_t w = n - n_writes; w < n; ++w) {
    if (!has_span[w]) continue;
    for (Py_ssize_t r = 0; r < n; ++r) {
      if (r == w || !has_span[r]) continue;
      if (spans[r].lo < spans[w].hi && spans[w].lo < spans[r].hi) Py_RETURN_NONE;
    }
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

// ---- the routing spine (kda/route) --------------------------------------------------------------------------

// A Python sequence of ints as int64 lengths; false (a Python error set) otherwise.
bool int64_list(PyObject* obj, std::vector<int64_t>* out) {
  PyObject* seq = PySequence_Fast(obj, "lengths must be a sequence of ints");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return false;
    }
    (*out)[static_cast<size_t>(i)] = v;
  }
  Py_DECREF(seq);
  return true;
}

PyObject* reload_launch_knobs(PyObject* /*self*/, PyObject* /*args*/) {
  const std::string err = kda::reload_launch_knobs();
  return PyUnicode_FromStringAndSize(err.data(), static_cast<Py_ssize_t>(err.size()));
}

PyObject* launch_knobs(PyObject* /*self*/, PyObject* /*args*/) {
  const kda::LaunchKnobs& k = kda::launch_knobs();
  return Py_BuildValue("{s:O,s:O,s:s,s:s,s:s,s:s,s:L,s:O,s:s}", "verbose", k.verbose ? Py_True : Py_False,
                       "batch_invariant", k.batch_invariant ? Py_True : Py_False, "decode", kda::pin_name(k.decode),
                       "chunked", kda::pin_name(k.chunked), "sweep", kda::pin_name(k.sweep), "split",
                       kda::pin_name(k.split), "split_tokens", static_cast<long long>(k.split_tokens),
                       "experiments_built", kda::kExperimentsBuilt ? Py_True : Py_False, "error", k.error.c_str());
}

// route_split(lengths, HV, on_cuda, device_index, training, multiple) -> segment length (0: no split)
PyObject* route_split(PyObject* /*self*/, PyObject* args) {
  PyObject* lens_obj = nullptr;
  int HV = 0, on_cuda = 0, device_index = 0, training = 0;
  long long multiple = 64;
  if (!PyArg_ParseTuple(args, "OipipL", &lens_obj, &HV, &on_cuda, &device_index, &training, &multiple)) return nullptr;
  std::vector<int64_t> lens;
  if (!int64_list(lens_obj, &lens)) return nullptr;
  kda::SplitQuery q;
  q.lens = lens.data();
  q.n = static_cast<int64_t>(lens.size());
  q.HV = HV;
  q.on_cuda = on_cuda != 0;
  q.device_index = device_index;
  q.training = training != 0;
  q.multiple = multiple;
  return PyLong_FromLongLong(kda::route_split(q));
}

// route_split_device_lengths(tokens, n, HV, on_cuda, device_index, training, multiple) -> segment length: the split
// route of a packed call whose lengths live on the device only
PyObject* route_split_device_lengths(PyObject* /*self*/, PyObject* args) {
  long long tokens = 0, n = 0, multiple = 64;
  int HV = 0, on_cuda = 0, device_index = 0, training = 0;
  if (!PyArg_ParseTuple(args, "LLipipL", &tokens, &n, &HV, &on_cuda, &device_index, &training, &multiple))
    return nullptr;
  kda::SplitQuery q;
  q.n = n;
  q.tokens = tokens;
  q.HV = HV;
  q.on_cuda = on_cuda != 0;
  q.device_index = device_index;
  q.training = training != 0;
  q.multiple = multiple;
  return PyLong_FromLongLong(kda::route_split(q));
}

// plan_segments(lengths, HV, sms, multiple) -> the planned segment length
PyObject* plan_segments(PyObject* /*self*/, PyObject* args) {
  PyObject* lens_obj = nullptr;
  int HV = 0, sms = 0;
  long long multiple = 64;
  if (!PyArg_ParseTuple(args, "OiiL", &lens_obj, &HV, &sms, &multiple)) return nullptr;
  std::vector<int64_t> lens;
  if (!int64_list(lens_obj, &lens)) return nullptr;
  if (lens.empty() || multiple <= 0) return PyLong_FromLongLong(0);
  return PyLong_FromLongLong(kda::plan_segments(lens.data(), static_cast<int64_t>(lens.size()), HV, sms, multiple));
}

// split_pays(lengths, HV, sms, Ls, rows128_cost) -> bool
PyObject* split_pays(PyObject* /*self*/, PyObject* args) {
  PyObject* lens_obj = nullptr;
  int HV = 0, sms = 0;
  long long Ls = 0;
  double cost = 1.5;
  if (!PyArg_ParseTuple(args, "OiiLd", &lens_obj, &HV, &sms, &Ls, &cost)) return nullptr;
  std::vector<int64_t> lens;
  if (!int64_list(lens_obj, &lens)) return nullptr;
  if (lens.empty() || Ls <= 0) Py_RETURN_FALSE;
  return PyBool_FromLong(kda::split_pays(lens.data(), static_cast<int64_t>(lens.size()), HV, sms, Ls, cost));
}

PyMethodDef kMethods[] = {
    {"tensor_call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensor_call_key)), METH_FASTCALL,
     "tensor_call_key(n_writes, *tensors) -> bytes | None: the fast-path key of a call's tensor arguments "
     "(None: a non-tensor argument, or a written tensor overlapping another argument)."},
    {"reload_launch_knobs", reload_launch_knobs, METH_NOARGS,
     "reload_launch_knobs() -> str: re-reads the KDA_* environment switches (docs/env.md); the first invalid "
     "value's message, or ''."},
    {"launch_knobs", launch_knobs, METH_NOARGS, "launch_knobs() -> dict: the switches as read."},
    {"route_split", route_split, METH_VARARGS,
     "route_split(lengths, HV, on_cuda, device_index, training, multiple) -> int: the split route's segment "
     "length (0: no split)."},
    {"route_split_device_lengths", route_split_device_lengths, METH_VARARGS,
     "route_split_device_lengths(tokens, n, HV, on_cuda, device_index, training, multiple) -> int: the split route "
     "of a packed call whose lengths live on the device (planned as one sequence of all its tokens)."},
    {"plan_segments", plan_segments, METH_VARARGS,
     "plan_segments(lengths, HV, sms, multiple) -> int: the shortest segment length whose chains fit the SMs."},
    {"split_pays", split_pays, METH_VARARGS,
     "split_pays(lengths, HV, sms, Ls, rows128_cost) -> bool: the auto split's cost model."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};
  look_up_parameter_type();
  return PyModule_Create(&module_def);
}
}
