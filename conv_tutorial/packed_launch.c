/* One kernel launch with its parameters packed once: what a replay (launch.py's Replay) calls for
 * each of its launches. conv_tutorial/packed.py builds it, with Triton's build (the system compiler,
 * Triton's cuda.h, Triton's cache), at the first replay; it reads the CUDA driver with dlopen, so it
 * builds on a machine without one.
 *
 * Triton's launcher, on every launch, parses ~20 arguments, flattens the kernel's arguments by
 * their annotations, converts each by its type, and asks the driver about each pointer given as a
 * tensor. A replay's launch differs from the last only in its addresses: this object keeps the
 * parameters as bytes, packed once at their offsets in one buffer, and a call writes the addresses
 * (a base from `bases` plus an offset) and the tensor maps (kept per address; a new address asks
 * `encode`) into a copy of it on the stack, then calls cuLaunchKernelEx with the launch attributes
 * Triton's launcher sets (oversized shared memory, PDL, a cooperative grid, a cluster). */
#include "cuda.h"
#include <alloca.h>
#include <dlfcn.h>
#include <stdalign.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Triton's tensor-map object (triton/backends/nvidia/driver.c, PyCUtensorMapObject), laid out by the
 * same cuda.h */
typedef struct {
  PyObject_HEAD;
  _Alignas(alignof(CUtensorMap)) CUtensorMap tensorMap;
} TritonTensorMap;

#ifndef CU_LAUNCH_ATTRIBUTE_SHARED_MEMORY_MODE /* (as Triton's launcher: an older cuda.h lacks them) */
#define CU_LAUNCH_ATTRIBUTE_SHARED_MEMORY_MODE 18
#endif
#ifndef CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY
#define CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY 3
#endif

#define MAP_BYTES 128
#define MAP_ALIGN 128
#define MAPS_KEPT 16 /* per tensor-map parameter: the addresses last seen, replaced in turn */

typedef CUresult (*launch_kernel_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*ctx_get_current_t)(CUcontext *);
typedef CUresult (*ctx_set_current_t)(CUcontext);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*primary_ctx_retain_t)(CUcontext *, CUdevice);
typedef CUresult (*get_error_string_t)(CUresult, const char **);
typedef CUresult (*func_set_attribute_t)(CUfunction, CUfunction_attribute, int);

static struct {
  launch_kernel_t launch_kernel;
  ctx_get_current_t ctx_get_current;
  ctx_set_current_t ctx_set_current;
  device_get_t device_get;
  primary_ctx_retain_t primary_ctx_retain;
  get_error_string_t get_error_string;
  func_set_attribute_t func_set_attribute;
} cu;

static int load_driver(void) {
  if (cu.launch_kernel)
    return 0;
  void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!lib) {
    PyErr_SetString(PyExc_RuntimeError, "packed_launch: libcuda.so.1 could not be opened (no CUDA driver)");
    return -1;
  }
#define LOAD(field, symbol)                                                    \
  cu.field = (void *)dlsym(lib, symbol);                                       \
  if (!cu.field) {                                                             \
    PyErr_SetString(PyExc_RuntimeError, "packed_launch: the CUDA driver has no " symbol); \
    return -1;                                                                 \
  }
  LOAD(ctx_get_current, "cuCtxGetCurrent");
  LOAD(ctx_set_current, "cuCtxSetCurrent");
  LOAD(device_get, "cuDeviceGet");
  LOAD(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
  LOAD(get_error_string, "cuGetErrorString");
  LOAD(func_set_attribute, "cuFuncSetAttribute");
  LOAD(launch_kernel, "cuLaunchKernelEx"); /* last: it marks the table loaded */
#undef LOAD
  return 0;
}

static int cuda_failed(CUresult status, const char *what) {
  if (status == CUDA_SUCCESS)
    return 0;
  const char *text = NULL;
  cu.get_error_string(status, &text);
  PyErr_Format(PyExc_RuntimeError, "packed_launch: %s failed: %s (CUresult %d)", what,
               text ? text : "unknown error", (int)status);
  return 1;
}

typedef struct {
  uint64_t address;
  unsigned char map[MAP_BYTES]; /* (copied with memcpy: no alignment needed) */
} KeptMap;

typedef struct {
  Py_ssize_t offset;     /* where the map goes in the buffer */
  Py_ssize_t base;       /* which of `bases` its address starts from */
  int64_t displacement;  /* added to that base */
  PyObject *encode;      /* address -> the tensor map (Triton's object, or 128 bytes) */
  KeptMap *kept;         /* MAPS_KEPT of them */
  int next;              /* the one a new address replaces */
} MapSlot;

typedef struct {
  Py_ssize_t offset, base;
  int64_t displacement;
} AddressSlot;

typedef struct {
  PyObject_HEAD;
  PyObject *owner; /* what keeps `function` loaded (the DirectLaunch of its compiled kernel) */
  CUfunction function;
  unsigned grid[3], num_warps, num_ctas, shared;
  int cooperative, pdl, device;
  Py_ssize_t size, n_params, n_addresses, n_maps;
  unsigned char *buffer; /* the packed parameters, MAP_ALIGN-aligned */
  void *buffer_memory;
  Py_ssize_t *param_offsets, *param_sizes;
  AddressSlot *addresses;
  MapSlot *maps;
} PackedLaunch;

static void PackedLaunch_dealloc(PackedLaunch *self) {
  for (Py_ssize_t i = 0; i < self->n_maps; i++) {
    Py_XDECREF(self->maps[i].encode);
    PyMem_Free(self->maps[i].kept);
  }
  PyMem_Free(self->maps);
  Py_XDECREF(self->owner);
  PyMem_Free(self->addresses);
  PyMem_Free(self->param_offsets);
  PyMem_Free(self->param_sizes);
  PyMem_Free(self->buffer_memory);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* PackedLaunch(owner, function, grid (3 ints), (num_warps, num_ctas, shared), cooperative, pdl, device,
 *              buffer (bytes), params ((offset, size), ...), addresses ((offset, base, displacement), ...),
 *              maps ((offset, base, displacement, encode), ...)) */
static int PackedLaunch_init(PackedLaunch *self, PyObject *args, PyObject *kwargs) {
  unsigned long long function;
  long long grid[3];
  Py_buffer buffer;
  PyObject *owner, *params, *addresses, *maps;
  if (self->buffer_memory) { /* (a second __init__ would free what a launch in progress reads) */
    PyErr_SetString(PyExc_TypeError, "a PackedLaunch is initialised once");
    return -1;
  }
  if (!PyArg_ParseTuple(args, "OK(LLL)(III)ppiy*O!O!O!", &owner, &function, &grid[0], &grid[1], &grid[2],
                        &self->num_warps, &self->num_ctas, &self->shared, &self->cooperative, &self->pdl,
                        &self->device, &buffer, &PyTuple_Type, &params, &PyTuple_Type, &addresses, &PyTuple_Type,
                        &maps))
    return -1;
  /* the driver's limits: x < 2^31 (after the cluster's factor), y and z < 2^16 */
  if (grid[0] < 0 || grid[1] < 0 || grid[2] < 0 || self->num_ctas < 1 ||
      grid[0] * (long long)self->num_ctas > 2147483647LL || grid[1] > 65535 || grid[2] > 65535) {
    PyBuffer_Release(&buffer);
    PyErr_Format(PyExc_ValueError, "a grid of (%lld, %lld, %lld) with clusters of %u is outside the driver's limits",
                 grid[0], grid[1], grid[2], self->num_ctas);
    return -1;
  }
  for (int i = 0; i < 3; i++)
    self->grid[i] = (unsigned)grid[i];
  Py_INCREF(owner);
  self->owner = owner;
  self->function = (CUfunction)(uintptr_t)function;
  self->size = buffer.len;
  self->buffer_memory = PyMem_Malloc(buffer.len + MAP_ALIGN);
  if (!self->buffer_memory) {
    PyBuffer_Release(&buffer);
    PyErr_NoMemory();
    return -1;
  }
  self->buffer = (unsigned char *)(((uintptr_t)self->buffer_memory + MAP_ALIGN - 1) & ~(uintptr_t)(MAP_ALIGN - 1));
  memcpy(self->buffer, buffer.buf, buffer.len);
  PyBuffer_Release(&buffer);

  self->n_params = PyTuple_GET_SIZE(params);
  self->param_offsets = PyMem_Calloc(self->n_params + 1, sizeof(Py_ssize_t));
  self->param_sizes = PyMem_Calloc(self->n_params + 1, sizeof(Py_ssize_t));
  self->n_addresses = PyTuple_GET_SIZE(addresses);
  self->addresses = PyMem_Calloc(self->n_addresses + 1, sizeof(AddressSlot));
  self->n_maps = 0;
  self->maps = PyMem_Calloc(PyTuple_GET_SIZE(maps) + 1, sizeof(MapSlot));
  if (!self->param_offsets || !self->param_sizes || !self->addresses || !self->maps) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < self->n_params; i++) {
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(params, i), "nn", &self->param_offsets[i], &self->param_sizes[i]))
      return -1;
    if (self->param_offsets[i] < 0 || self->param_sizes[i] <= 0 || self->param_offsets[i] + self->param_sizes[i] > self->size) {
      PyErr_Format(PyExc_ValueError, "parameter %zd lies outside the buffer", i);
      return -1;
    }
  }
  for (Py_ssize_t i = 0; i < self->n_addresses; i++) {
    AddressSlot *slot = &self->addresses[i];
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(addresses, i), "nnL", &slot->offset, &slot->base, &slot->displacement))
      return -1;
    if (slot->offset < 0 || slot->offset + 8 > self->size || slot->offset % 8) {
      PyErr_Format(PyExc_ValueError, "address %zd: offset %zd is not an aligned 8-byte slot of the buffer", i,
                   slot->offset);
      return -1;
    }
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(maps); i++) {
    MapSlot *slot = &self->maps[i];
    PyObject *encode;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(maps, i), "nnLO", &slot->offset, &slot->base, &slot->displacement,
                          &encode))
      return -1;
    if (slot->offset < 0 || slot->offset + MAP_BYTES > self->size || slot->offset % MAP_ALIGN) {
      PyErr_Format(PyExc_ValueError, "tensor map %zd: offset %zd is not an aligned 128-byte slot of the buffer", i,
                   slot->offset);
      return -1;
    }
    slot->kept = PyMem_Calloc(MAPS_KEPT, sizeof(KeptMap));
    if (!slot->kept) {
      PyErr_NoMemory();
      return -1;
    }
    Py_INCREF(encode);
    slot->encode = encode;
    self->n_maps++;
  }
  return 0;
}

/* the addresses in `bases` (a list of ints), into `out` (room for all of them) */
static int read_bases(PyObject *bases, uint64_t *out) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bases); i++) {
    out[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(bases, i));
    if (PyErr_Occurred())
      return -1;
  }
  return 0;
}

static int read_base(const uint64_t *bases, Py_ssize_t n_bases, Py_ssize_t index, uint64_t *out) {
  if (index < 0 || index >= n_bases) {
    PyErr_Format(PyExc_IndexError, "packed_launch: base %zd of %zd", index, n_bases);
    return -1;
  }
  *out = bases[index];
  return 0;
}

/* The 128 bytes of the tensor map `encode` returned: Triton's object, or any 128-byte buffer. */
static int copy_map(PyObject *encoded, unsigned char *to) {
  if (strcmp(Py_TYPE(encoded)->tp_name, "triton.backends.nvidia.PyCUtensorMap") == 0) {
    memcpy(to, &((TritonTensorMap *)encoded)->tensorMap, MAP_BYTES);
    return 0;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(encoded, &view, PyBUF_SIMPLE) < 0)
    return -1;
  int ok = view.len == MAP_BYTES;
  if (ok)
    memcpy(to, view.buf, MAP_BYTES);
  PyBuffer_Release(&view);
  if (!ok)
    PyErr_Format(PyExc_ValueError, "packed_launch: a tensor map of %zd bytes, not 128", view.len);
  return ok ? 0 : -1;
}

static int write_map(MapSlot *slot, uint64_t address, unsigned char *to) {
  for (int i = 0; i < MAPS_KEPT; i++) {
    if (slot->kept[i].address == address && address != 0) {
      memcpy(to, slot->kept[i].map, MAP_BYTES);
      return 0;
    }
  }
  PyObject *encoded = PyObject_CallFunction(slot->encode, "K", (unsigned long long)address);
  if (!encoded)
    return -1;
  KeptMap *kept = &slot->kept[slot->next];
  int failed = copy_map(encoded, kept->map);
  Py_DECREF(encoded);
  if (failed) {
    kept->address = 0;
    return -1;
  }
  kept->address = address;
  slot->next = (slot->next + 1) % MAPS_KEPT;
  memcpy(to, kept->map, MAP_BYTES);
  return 0;
}

/* The parameters of a launch on `bases`, written into `buffer` (a copy of the packed one) */
static int fill(PackedLaunch *self, const uint64_t *bases, Py_ssize_t n_bases, unsigned char *buffer) {
  memcpy(buffer, self->buffer, self->size);
  for (Py_ssize_t i = 0; i < self->n_addresses; i++) {
    AddressSlot *slot = &self->addresses[i];
    uint64_t base;
    if (read_base(bases, n_bases, slot->base, &base) < 0)
      return -1;
    uint64_t address = base + (uint64_t)slot->displacement;
    memcpy(buffer + slot->offset, &address, 8);
  }
  for (Py_ssize_t i = 0; i < self->n_maps; i++) {
    MapSlot *slot = &self->maps[i];
    uint64_t base;
    if (read_base(bases, n_bases, slot->base, &base) < 0)
      return -1;
    if (write_map(slot, base + (uint64_t)slot->displacement, buffer + slot->offset) < 0)
      return -1;
  }
  return 0;
}

#define ALIGNED_STACK_BUFFER(name, size)                                                   \
  unsigned char *name = (unsigned char *)(((uintptr_t)alloca((size) + MAP_ALIGN) + MAP_ALIGN - 1) & \
                                          ~(uintptr_t)(MAP_ALIGN - 1))

/* The launch on `stream` (an address), its addresses from `bases[0..n_bases)`; 0, or -1 with a Python
 * error set. The GIL must be held (a new address's tensor map calls `encode`); it is let go around the
 * driver's calls. The C entry of native.cpp's repeat calls (`_C_API`), and of `launch` below. */
static int packed_run(PackedLaunch *self, uint64_t stream, const uint64_t *bases, Py_ssize_t n_bases) {
  if (self->grid[0] == 0 || self->grid[1] == 0 || self->grid[2] == 0) /* no program: no launch (as Triton's) */
    return 0;
  if (load_driver() < 0)
    return -1;
  ALIGNED_STACK_BUFFER(buffer, self->size);
  if (fill(self, bases, n_bases, buffer) < 0)
    return -1;
  void **params = alloca((self->n_params + 1) * sizeof(void *));
  for (Py_ssize_t i = 0; i < self->n_params; i++)
    params[i] = buffer + self->param_offsets[i];

  CUlaunchAttribute attributes[5];
  memset(attributes, 0, sizeof(attributes));
  unsigned n_attributes = 0;
  if (self->shared > 228 * 1024) { /* an int value, at the union's start (cuda.h may not name it) */
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_SHARED_MEMORY_MODE;
    int mode = CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY;
    memcpy(&attributes[n_attributes++].value, &mode, sizeof(mode));
  }
  if (self->pdl) {
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[n_attributes++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (self->cooperative) {
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[n_attributes++].value.cooperative = 1;
  }
  if (self->num_ctas != 1) {
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[n_attributes].value.clusterDim.x = self->num_ctas;
    attributes[n_attributes].value.clusterDim.y = 1;
    attributes[n_attributes++].value.clusterDim.z = 1;
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attributes[n_attributes++].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
  }
  CUlaunchConfig config = {0};
  config.gridDimX = self->grid[0] * self->num_ctas;
  config.gridDimY = self->grid[1];
  config.gridDimZ = self->grid[2];
  config.blockDimX = 32 * self->num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = self->shared;
  config.hStream = (CUstream)(uintptr_t)stream;
  config.attrs = attributes;
  config.numAttrs = n_attributes;

  CUresult status = CUDA_SUCCESS;
  const char *what = "cuLaunchKernelEx";
  Py_BEGIN_ALLOW_THREADS;
  CUcontext context = NULL;
  status = cu.ctx_get_current(&context);
  if (status == CUDA_SUCCESS && !context) { /* a thread the driver has not seen: the device's primary context */
    CUdevice device;
    what = "making the device's context current";
    status = cu.device_get(&device, self->device);
    if (status == CUDA_SUCCESS)
      status = cu.primary_ctx_retain(&context, device);
    if (status == CUDA_SUCCESS)
      status = cu.ctx_set_current(context);
  }
  if (status == CUDA_SUCCESS && self->num_ctas == 16) {
    what = "allowing a non-portable cluster";
    status = cu.func_set_attribute(self->function, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
  }
  if (status == CUDA_SUCCESS) {
    what = "cuLaunchKernelEx";
    status = cu.launch_kernel(&config, self->function, params, NULL);
  }
  Py_END_ALLOW_THREADS;
  return cuda_failed(status, what) ? -1 : 0;
}

/* launch(stream, bases): the kernel on `stream` (an address), its addresses read from `bases` (a list
 * of ints) */
static PyObject *PackedLaunch_call(PackedLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "launch(stream: int, bases: list[int])");
    return NULL;
  }
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[0]);
  if (PyErr_Occurred())
    return NULL;
  uint64_t *bases = alloca((PyList_GET_SIZE(args[1]) + 1) * sizeof(uint64_t));
  if (read_bases(args[1], bases) < 0 || packed_run(self, stream, bases, PyList_GET_SIZE(args[1])) < 0)
    return NULL;
  Py_RETURN_NONE;
}

/* parameters(bases): the bytes of each parameter a launch on `bases` would pass, launching nothing
 * (what the CPU tests read) */
static PyObject *PackedLaunch_parameters(PackedLaunch *self, PyObject *bases) {
  if (!PyList_Check(bases)) {
    PyErr_SetString(PyExc_TypeError, "parameters(bases: list[int])");
    return NULL;
  }
  uint64_t *addresses = alloca((PyList_GET_SIZE(bases) + 1) * sizeof(uint64_t));
  if (read_bases(bases, addresses) < 0)
    return NULL;
  ALIGNED_STACK_BUFFER(buffer, self->size);
  if (fill(self, addresses, PyList_GET_SIZE(bases), buffer) < 0)
    return NULL;
  PyObject *out = PyTuple_New(self->n_params);
  if (!out)
    return NULL;
  for (Py_ssize_t i = 0; i < self->n_params; i++) {
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)buffer + self->param_offsets[i],
                                                self->param_sizes[i]);
    if (!bytes) {
      Py_DECREF(out);
      return NULL;
    }
    PyTuple_SET_ITEM(out, i, bytes);
  }
  return out;
}

static PyMethodDef PackedLaunch_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))PackedLaunch_call, METH_FASTCALL,
     "launch(stream, bases): the kernel on `stream`, its addresses from `bases`"},
    {"parameters", (PyCFunction)PackedLaunch_parameters, METH_O,
     "parameters(bases): each parameter's bytes, launching nothing"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PackedLaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "conv_tutorial_packed_launch.PackedLaunch",
    .tp_basicsize = sizeof(PackedLaunch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A kernel launch with its parameters packed once",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PackedLaunch_init,
    .tp_dealloc = (destructor)PackedLaunch_dealloc,
    .tp_methods = PackedLaunch_methods,
};

/* load_driver(): open the CUDA driver now (packed.py asks before it packs: a failure falls back there) */
static PyObject *module_load_driver(PyObject *self, PyObject *unused) {
  if (load_driver() < 0)
    return NULL;
  Py_RETURN_NONE;
}

/* map_bytes(encoded): the 128 bytes of a tensor map as a launch copies them (packed.py compares two encodings) */
static PyObject *module_map_bytes(PyObject *self, PyObject *encoded) {
  unsigned char map[MAP_BYTES];
  if (copy_map(encoded, map) < 0)
    return NULL;
  return PyBytes_FromStringAndSize((const char *)map, MAP_BYTES);
}

static PyMethodDef module_methods[] = {
    {"load_driver", module_load_driver, METH_NOARGS, "Open the CUDA driver's launch functions"},
    {"map_bytes", module_map_bytes, METH_O, "The 128 bytes of a tensor map (Triton's object or a buffer)"},
    {NULL, NULL, 0, NULL},
};

/* What native.cpp calls, in the capsule `_C_API` (native.cpp declares the same struct) */
typedef struct {
  PyTypeObject *type;
  int (*run)(PyObject *launch, uint64_t stream, const uint64_t *bases, Py_ssize_t n_bases);
} PackedLaunchApi;

static int api_run(PyObject *launch, uint64_t stream, const uint64_t *bases, Py_ssize_t n_bases) {
  return packed_run((PackedLaunch *)launch, stream, bases, n_bases);
}

static PackedLaunchApi api = {&PackedLaunchType, api_run};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "conv_tutorial_packed_launch",
                                    "Kernel launches with their parameters packed once", -1, module_methods};

PyMODINIT_FUNC PyInit_conv_tutorial_packed_launch(void) {
  if (PyType_Ready(&PackedLaunchType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module);
  if (!m)
    return NULL;
  Py_INCREF(&PackedLaunchType);
  if (PyModule_AddObject(m, "PackedLaunch", (PyObject *)&PackedLaunchType) < 0) {
    Py_DECREF(&PackedLaunchType);
    Py_DECREF(m);
    return NULL;
  }
  PyObject *capsule = PyCapsule_New(&api, "conv_tutorial_packed_launch._C_API", NULL);
  if (!capsule || PyModule_AddObject(m, "_C_API", capsule) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
