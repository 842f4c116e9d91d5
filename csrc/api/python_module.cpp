// The kda_ops._C Python module. Importing it loads this library, whose TORCH_LIBRARY blocks
// (csrc/api/registration.cpp and the per-backend files) register the torch.ops.kda schemas and kernels.
// The module's one function serves the eager fast path of kda_ops.recurrent_kda (kda_ops/interface.py):
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
    if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) && type != g_parameter_type)
      Py_RETURN_NONE;
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

PyMethodDef kMethods[] = {
    {"tensor_call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensor_call_key)), METH_FASTCALL,
     "tensor_call_key(n_writes, *tensors) -> bytes | None: the fast-path key of a call's tensor arguments "
     "(None: a non-tensor argument, or a written tensor overlapping another argument)."},
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
