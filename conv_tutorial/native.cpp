// The operators' repeat calls with no Python in them: what native.py builds and installs.
//
// A repeat call of an operator (hostpath.py) is a replay: allocate the results, make the recorded
// launches on the new addresses. In Python that still costs the dispatcher's call into the Python
// kernel, the key, the replay's loop and each allocation (RESULTS.md, "Host time"). Here a boxed
// kernel, registered for the operator at the CUDA key (below autograd) and at AutogradCUDA, does the
// same in C++: it makes the call's key from the dispatcher's stack, finds the program that the Python
// path handed over for that key (`offer`), and runs it: allocations by ATen, launches by packed_launch.c's
// C entry (its `_C_API` capsule). Every call it cannot serve so goes to the Python kernel it replaced,
// as before: a call that needs a gradient, a tensor subclass or dispatch mode, a key with no program
// (a first call, a call the Python path does not replay), a program made under other settings (the
// generation, bumped by Python on every setting that chooses a path), a call while Python records or
// compiles ahead (`suspend`), an unaligned input, a profiler listening to Triton's launches.
//
// A kernel takes the GIL for its call (the dispatcher lets it go before a kernel runs): it guards the
// programs, which Python hands over, and the packed launches, which keep tensor maps per address. A
// program's run lets it go around each launch's driver call (packed_launch.c) and may call Python (the
// profiler check), where another thread may drop or replace the program: a run holds its own reference.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

// packed_launch.c's capsule (the same struct)
struct PackedLaunchApi {
  PyTypeObject *type;
  int (*run)(PyObject *launch, uint64_t stream, const uint64_t *bases, Py_ssize_t n_bases);
};

const PackedLaunchApi *packed_api = nullptr;
std::atomic<int> suspended{0};  // > 0 while Python records a call or compiles ahead: no program runs
uint64_t generation = 1;        // programs of an older generation are stale
bool enabled = true;
py::object *hooks_set = nullptr;  // () -> whether a profiler listens to Triton's launches

struct Step {
  enum Kind { kAlloc, kLaunch, kFree } kind;
  int base = -1;                            // alloc, free: which of the bases
  std::vector<int64_t> shape, strides;      // alloc (strides empty: contiguous)
  bool strided = false, zeroed = false;
  at::ScalarType dtype = at::kFloat;
  int position = -1;                        // alloc: the result's place, or -1 (a workspace)
  py::object launch;                        // launch: a PackedLaunch, or anything with launch(stream, bases)
  bool packed = false;
};

struct Program {
  int n_bases = 0;
  std::vector<int> sources;  // the stack positions of the sources, the first bases in order
  std::vector<Step> steps;
  int device_argument = -1;  // the allocations' device: that argument's
  uint64_t generation = 0;
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key &key) const {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t v : key)
      h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ULL;
    return static_cast<size_t>(h);
  }
};

constexpr size_t kMaxPrograms = 4096;  // (hostpath.MAX_KEYS: shapes that keep changing start over)

// Why a call went to the Python kernel (`declines` counts them per operator, for the benchmarks and the
// tests: a model whose calls keep missing shows where)
enum Decline {
  kDisabled,       // the native kernels are off (set_enabled(false), CONV_TUTORIAL_NATIVE=0)
  kOtherKey,       // a dispatch key below autograd other than the backend's (a tensor subclass, a mode)
  kGradient,       // a gradient to record: grad mode on and an input that requires grad
  kOtherDevice,    // a tensor on another device than the backend's
  kUnkeyed,        // an argument of a kind no key holds
  kSuspended,      // a recording or a compile-ahead pass under way
  kNoProgram,      // no program for the key yet (its first calls, or one Python keeps)
  kStale,          // a program handed over under settings that changed since
  kMisaligned,     // a source's address not a multiple of 16 bytes
  kHooksSet,       // a profiler listens to Triton's launches
  kDeclines
};
const char *const kDeclineNames[kDeclines] = {"disabled", "other dispatch key", "gradient to record", "other device",
                                              "unkeyed argument", "suspended", "no program", "stale program",
                                              "misaligned address", "launch hooks set"};
constexpr int kServed = -1;

// One operator's programs, shared by its two kernels
struct Operator {
  std::string name;                  // as Python names it: the library's operator name, no namespace
  std::vector<std::string> arguments;  // the schema's argument names
  size_t n_returns = 0;
  std::unordered_map<Key, std::shared_ptr<const Program>, KeyHash> programs;
  uint64_t hits = 0, misses = 0;
  uint64_t declined[kDeclines] = {};  // the misses by reason
};

// A call the Python kernel is serving, whose program Python may hand over (`offer`)
struct Pending {
  Operator *op;
  const Key *key;
  const std::vector<c10::IValue> *arguments;
  uint64_t generation;  // the settings' generation when the call missed: a program offered under it
  bool taken = false;
};
thread_local std::vector<Pending *> pending;

std::unordered_map<std::string, Operator *> operators;  // (never freed: the dispatcher holds the kernels)

// The key of a call: each argument's kind and value (a tensor: its sizes, strides, dtype and device),
// then the current CUDA device. False where an argument is of a kind no operator here takes.
bool make_key(const std::vector<c10::IValue> &arguments, int device, Key &key) {
  key.reserve(64);
  for (const c10::IValue &v : arguments) {
    if (v.isNone()) {
      key.push_back(-1);
    } else if (v.isTensor()) {
      const at::Tensor &t = v.toTensor();
      if (!t.defined()) {
        key.push_back(-1);
        continue;
      }
      key.push_back(-2);
      key.push_back(t.dim());
      for (int64_t s : t.sizes())
        key.push_back(s);
      for (int64_t s : t.strides())
        key.push_back(s);
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(t.device().type()));
      key.push_back(t.device().index());
    } else if (v.isInt()) {  // (a ScalarType argument is an int on the stack)
      key.push_back(-3);
      key.push_back(v.toInt());
    } else if (v.isBool()) {
      key.push_back(-4);
      key.push_back(v.toBool());
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof(bits));
      key.push_back(-5);
      key.push_back(bits);
    } else if (v.isIntList()) {
      auto list = v.toIntList();
      key.push_back(-6);
      key.push_back(static_cast<int64_t>(list.size()));
      for (int64_t x : list)
        key.push_back(x);
    } else if (v.isString()) {
      const std::string &s = v.toStringRef();
      key.push_back(-7);
      key.push_back(static_cast<int64_t>(s.size()));
      for (unsigned char c : s)
        key.push_back(c);
    } else {
      return false;
    }
  }
  key.push_back(device);
  return true;
}

// An argument as the Python kernel takes it (a ScalarType argument as a torch.dtype, not its int)
py::object to_python(const c10::IValue &v, const c10::Argument &argument) {
  if (!v.isNone() && v.isInt()) {
    c10::TypePtr type = argument.real_type();  // (type() says int: the type the stack holds)
    if (auto optional = type->cast<c10::OptionalType>())
      type = optional->getElementType();
    if (type->kind() == c10::TypeKind::ScalarTypeType)
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject *>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
  }
  return torch::jit::toPyObject(v);
}

class Kernel : public c10::OperatorKernel {
 public:
  // `fallback` is kept for good (never released): the dispatcher frees its kernels at the process's exit,
  // after Python has finalized, when no Python object may be touched.
  Kernel(Operator *op, const py::object &fallback, c10::DispatchKey backend, bool autograd)
      : op_(op), fallback_(fallback.inc_ref().ptr()), backend_(backend), autograd_(autograd) {}

  void operator()(const c10::OperatorHandle &handle, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto &schema = handle.schema();
    std::vector<c10::IValue> arguments = torch::jit::pop(*stack, schema.arguments().size());
    py::gil_scoped_acquire gil;
    Key key;
    int why = enabled ? ineligible(keys, arguments) : kDisabled;
    bool keyed = why == kServed && make_key(arguments, current_device(), key);
    if (why == kServed && !keyed)
      why = kUnkeyed;
    if (keyed && suspended.load() != 0) {
      why = kSuspended;
    } else if (keyed) {
      auto found = op_->programs.find(key);
      if (found == op_->programs.end()) {
        why = kNoProgram;
      } else if (found->second->generation != generation) {
        why = kStale;
      } else {
        std::shared_ptr<const Program> program = found->second;  // (kept alive through the run)
        why = run(*program, arguments, stack);
        if (why == kServed) {
          op_->hits++;
          return;
        }
      }
    }
    op_->misses++;
    op_->declined[why]++;
    Pending call{op_, &key, &arguments, generation};
    if (keyed)
      pending.push_back(&call);
    py::object out;
    try {
      py::tuple args(arguments.size());
      for (size_t i = 0; i < arguments.size(); ++i)
        args[i] = to_python(arguments[i], schema.arguments()[i]);
      out = py::reinterpret_borrow<py::object>(fallback_)(*args);
    } catch (...) {
      if (keyed)
        pending.pop_back();
      throw;
    }
    if (keyed)
      pending.pop_back();
    push_results(out, stack);
  }

 private:
  // A call a program may serve: no gradient to record, no tensor subclass or mode below autograd
  // (at the CUDA key the dispatcher has already sent those elsewhere), every tensor on the backend.
  // kServed where it may, else the Decline that sends it to Python.
  int ineligible(c10::DispatchKeySet keys, const std::vector<c10::IValue> &arguments) const {
    if (autograd_) {
      c10::DispatchKeySet below = keys & c10::after_ADInplaceOrView_keyset;
      if (below.highestPriorityTypeId() != backend_)
        return kOtherKey;
    }
    bool grad = autograd_ && at::GradMode::is_enabled();
    for (const c10::IValue &v : arguments) {
      if (!v.isTensor())
        continue;
      const at::Tensor &t = v.toTensor();
      if (!t.defined())
        continue;
      if (grad && t.requires_grad())
        return kGradient;
      if (t.device().type() != (backend_ == c10::DispatchKey::CUDA ? c10::DeviceType::CUDA : c10::DeviceType::CPU))
        return kOtherDevice;
    }
    return kServed;
  }

  int current_device() const {
    if (backend_ != c10::DispatchKey::CUDA)
      return -1;
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  }

  // The program on these arguments, its results pushed: kServed; else (nothing run) the Decline
  int run(const Program &program, const std::vector<c10::IValue> &arguments, torch::jit::Stack *stack) {
    std::vector<uint64_t> bases(program.n_bases, 0);
    for (size_t i = 0; i < program.sources.size(); ++i) {
      uint64_t address = reinterpret_cast<uint64_t>(arguments[program.sources[i]].toTensor().data_ptr());
      if (address % 16)  // (the full path explains)
        return kMisaligned;
      bases[i] = address;
    }
    if (hooks_set && (*hooks_set)().cast<bool>())
      return kHooksSet;
    const at::Tensor &like = arguments[program.device_argument].toTensor();
    c10::Device device = like.device();  // the results' (the Python path's `device`: the input's)
    uint64_t stream = 0;                 // the launches', as Python's: the current device's current stream
    if (device.is_cuda()) {
      c10::Device current(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(current_device()));
      stream = reinterpret_cast<uint64_t>(
          c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(current).native_handle());
    }
    std::vector<at::Tensor> results(op_->n_returns);
    std::unordered_map<int, at::Tensor> held;
    py::list base_list;  // (for launches that are not packed: the CPU tests' stand-ins)
    for (const Step &step : program.steps) {
      if (step.kind == Step::kAlloc) {
        auto options = at::TensorOptions().dtype(step.dtype).device(device);
        at::Tensor t = step.strided ? at::empty_strided(step.shape, step.strides, options)
                                    : at::empty(step.shape, options);
        if (step.zeroed)
          t.zero_();
        bases[step.base] = reinterpret_cast<uint64_t>(t.data_ptr());
        if (step.position >= 0)
          results[step.position] = t;
        held[step.base] = std::move(t);
      } else if (step.kind == Step::kLaunch) {
        if (step.packed) {
          if (packed_api->run(step.launch.ptr(), stream, bases.data(), static_cast<Py_ssize_t>(bases.size())) < 0)
            throw py::error_already_set();
        } else {
          py::list list(bases.size());
          for (size_t i = 0; i < bases.size(); ++i)
            list[i] = py::int_(bases[i]);
          step.launch.attr("launch")(stream, list);
        }
      } else {
        held.erase(step.base);
      }
    }
    for (at::Tensor &t : results)
      torch::jit::push(*stack, std::move(t));
    return kServed;
  }

  void push_results(const py::object &out, torch::jit::Stack *stack) const {
    if (op_->n_returns == 1) {
      torch::jit::push(*stack, tensor_of(out));
      return;
    }
    py::tuple tuple = out.cast<py::tuple>();
    if (tuple.size() != op_->n_returns)
      throw std::runtime_error("conv_tutorial::" + op_->name + ": the Python kernel returned " +
                               std::to_string(tuple.size()) + " results, not " + std::to_string(op_->n_returns));
    for (size_t i = 0; i < tuple.size(); ++i)
      torch::jit::push(*stack, tensor_of(tuple[i]));
  }

  at::Tensor tensor_of(const py::handle &obj) const {
    if (!THPVariable_Check(obj.ptr()))
      throw std::runtime_error("conv_tutorial::" + op_->name + ": the Python kernel returned a " +
                               std::string(Py_TYPE(obj.ptr())->tp_name) + ", not a tensor");
    return THPVariable_Unpack(obj.ptr());
  }

  Operator *op_;
  PyObject *fallback_;
  c10::DispatchKey backend_;
  bool autograd_;
};

std::vector<torch::Library *> libraries;  // (never freed: freeing one would unregister its kernels at exit)

// Register the C++ kernels of operator `ns::name` at `backend` (the CUDA key, or CPU for the tests), over
// `implementation` (the Python kernel there), and at its autograd key over `autograd` (or None: none there).
void install(const std::string &ns, const std::string &name, const std::string &backend, py::object implementation,
             py::object autograd) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "");
  const auto &schema = handle.schema();
  for (const auto &r : schema.returns())
    if (r.type()->kind() != c10::TypeKind::TensorType)
      throw std::invalid_argument(ns + "::" + name + " returns a " + r.type()->str() + ", not only tensors");
  c10::DispatchKey key = backend == "CUDA" ? c10::DispatchKey::CUDA : backend == "CPU" ? c10::DispatchKey::CPU
                                                                                          : c10::DispatchKey::Undefined;
  if (key == c10::DispatchKey::Undefined)
    throw std::invalid_argument("backend must be 'CUDA' or 'CPU', got '" + backend + "'");
  std::string qualified = ns + "::" + name;
  if (operators.count(qualified))
    throw std::invalid_argument(qualified + " has its native kernels already");
  auto *op = new Operator();
  op->name = name;
  for (const auto &a : schema.arguments())
    op->arguments.push_back(a.name());
  op->n_returns = schema.returns().size();
  operators[qualified] = op;
  auto *lib = new torch::Library(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(op, implementation, key, false)));
  libraries.push_back(lib);
  if (!autograd.is_none()) {
    c10::DispatchKey autograd_key = key == c10::DispatchKey::CUDA ? c10::DispatchKey::AutogradCUDA
                                                                   : c10::DispatchKey::AutogradCPU;
    auto *autograd_lib = new torch::Library(torch::Library::IMPL, ns, autograd_key, __FILE__, __LINE__);
    autograd_lib->impl(name.c_str(),
                       torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(op, autograd, key, true)));
    libraries.push_back(autograd_lib);
  }
}

// Hand over the program of the call now pending for operator `name` (ns::name), if there is one: True if
// it was kept. `sources`: the names of the arguments whose addresses are the first bases; `steps`:
// ("alloc", base, shape, strides or None, dtype, zeroed, result position or None), ("launch", launch),
// ("free", base).
bool offer(const std::string &qualified, int n_bases, const std::vector<std::string> &sources, py::sequence steps) {
  if (pending.empty() || pending.back()->taken)
    return false;
  Pending *call = pending.back();
  auto found = operators.find(qualified);
  if (found == operators.end() || found->second != call->op)
    return false;  // (a call of another operator inside this one's Python: not this call's program)
  Operator *op = call->op;
  Program program;
  program.n_bases = n_bases;
  program.generation = call->generation;  // (a setting changed since the call missed: the program is stale)
  for (const std::string &source : sources) {
    auto at = std::find(op->arguments.begin(), op->arguments.end(), source);
    if (at == op->arguments.end())
      return false;
    int position = static_cast<int>(at - op->arguments.begin());
    if (!(*call->arguments)[position].isTensor())
      return false;
    program.sources.push_back(position);
    if (program.device_argument < 0)
      program.device_argument = position;
  }
  if (program.device_argument < 0 || static_cast<int>(program.sources.size()) > n_bases)
    return false;
  std::vector<bool> filled(op->n_returns, false);
  for (py::handle item : steps) {
    py::tuple t = item.cast<py::tuple>();
    std::string kind = t[0].cast<std::string>();
    Step step;
    if (kind == "alloc") {
      step.kind = Step::kAlloc;
      step.base = t[1].cast<int>();
      step.shape = t[2].cast<std::vector<int64_t>>();
      step.strided = !t[3].is_none();
      if (step.strided)
        step.strides = t[3].cast<std::vector<int64_t>>();
      step.dtype = reinterpret_cast<THPDtype *>(t[4].ptr())->scalar_type;
      step.zeroed = t[5].cast<bool>();
      step.position = t[6].is_none() ? -1 : t[6].cast<int>();
      if (step.position >= static_cast<int>(op->n_returns))
        return false;
      if (step.position >= 0)
        filled[step.position] = true;
    } else if (kind == "launch") {
      step.kind = Step::kLaunch;
      step.launch = py::reinterpret_borrow<py::object>(t[1]);
      step.packed = packed_api && Py_TYPE(step.launch.ptr()) == packed_api->type;
    } else if (kind == "free") {
      step.kind = Step::kFree;
      step.base = t[1].cast<int>();
    } else {
      return false;  // (a step only Python runs: the call keeps the Python path)
    }
    if (step.kind != Step::kLaunch && (step.base < 0 || step.base >= n_bases))
      return false;
    program.steps.push_back(std::move(step));
  }
  for (bool f : filled)
    if (!f)
      return false;
  if (op->programs.size() >= kMaxPrograms)
    op->programs.clear();
  op->programs[*call->key] = std::make_shared<const Program>(std::move(program));
  call->taken = true;
  return true;
}

void set_packed_api(py::capsule capsule) {
  packed_api = static_cast<const PackedLaunchApi *>(
      PyCapsule_GetPointer(capsule.ptr(), "conv_tutorial_packed_launch._C_API"));
  if (!packed_api)
    throw py::error_already_set();
}

void set_hooks_check(py::object check) {
  if (!hooks_set)
    hooks_set = new py::object();  // (never freed: no Python object outlives the interpreter here)
  *hooks_set = std::move(check);
}

// Forget every program (Python: a setting that chooses a path changed, or its replays were cleared); the
// generation makes stale the programs of calls that missed before it and are handed over after it
void clear() {
  generation++;
  for (auto &entry : operators)
    entry.second->programs.clear();
}

bool set_enabled(bool on) {
  bool previous = enabled;
  enabled = on;
  return previous;
}

void suspend(int delta) { suspended += delta; }

py::dict counts() {
  py::dict out;
  for (auto &entry : operators)
    out[py::str(entry.first)] = py::make_tuple(entry.second->hits, entry.second->misses, entry.second->programs.size());
  return out;
}

// {operator: {reason: calls}}: why each operator's calls went to Python (the reasons seen)
py::dict declines() {
  py::dict out;
  for (auto &entry : operators) {
    py::dict reasons;
    for (int i = 0; i < kDeclines; ++i)
      if (entry.second->declined[i])
        reasons[py::str(kDeclineNames[i])] = entry.second->declined[i];
    out[py::str(entry.first)] = reasons;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("offer", &offer);
  m.def("set_packed_api", &set_packed_api);
  m.def("set_hooks_check", &set_hooks_check);
  m.def("clear", &clear);
  m.def("set_enabled", &set_enabled);
  m.def("suspend", &suspend);
  m.def("counts", &counts);
  m.def("declines", &declines);
}
