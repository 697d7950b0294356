// Python bindings of fusedist._C: the only file that includes pybind11.
//
// Everything crosses the boundary as plain values: device pointers and cudaStream_t handles
// as integers (Tensor.data_ptr(), torch.cuda.Stream.cuda_stream), dtypes and reduce ops as
// NCCL codes. The torch-dtype -> NCCL-code map lives in fusedist/comm/_nccl_types.py.
// Importing the module touches neither the CUDA driver nor NCCL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime_api.h>

#include "checks.h"
#include "comm_stream.h"
#include "communicator.h"
#include "nccl_api.h"

namespace py = pybind11;
using namespace fusedist;

#ifndef FUSEDIST_CUDA_ARCHS
#define FUSEDIST_CUDA_ARCHS "unknown"
#endif

namespace {

int device_count() {
  int count = 0;
  FUSEDIST_CUDA_CHECK(cudaGetDeviceCount(&count));
  return count;
}

py::bytes get_unique_id() {
  ncclUniqueId id;
  FUSEDIST_NCCL_CHECK(nccl().GetUniqueId(&id));
  return py::bytes(id.internal, kNcclUniqueIdBytes);
}

int nccl_version() {
  int version = 0;
  FUSEDIST_NCCL_CHECK(nccl().GetVersion(&version));
  return version;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedist CUDA/NCCL extension (torch-ABI independent; NCCL loaded with dlopen)";

  py::register_exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  py::register_exception<NcclError>(m, "NcclError", PyExc_RuntimeError);

  m.attr("NCCL_UNIQUE_ID_BYTES") = kNcclUniqueIdBytes;
  m.def("build_info", []() {
    py::dict info;
    info["cuda_runtime"] = CUDART_VERSION;
    info["archs"] = FUSEDIST_CUDA_ARCHS;
    return info;
  }, "CUDA runtime version the module was compiled against and its arch list.");
  m.def("device_count", &device_count,
        "Number of visible CUDA devices; raises CudaError (explaining a missing driver) when "
        "the CUDA runtime cannot initialize.");
  m.def("load_nccl", [](const std::string& path) {
    load_nccl(path);
    return nccl_version();
  }, py::arg("path") = "",
        "dlopen NCCL (path, else $FUSEDIST_NCCL_LIBRARY, else libnccl.so.2) and return its "
        "version code; idempotent. Raises RuntimeError naming the library when it cannot load.");
  m.def("nccl_library", &nccl_library_path, "Where NCCL was loaded from ('' if not loaded).");
  m.def("nccl_version", &nccl_version);
  m.def("get_unique_id", &get_unique_id,
        "A fresh 128-byte ncclUniqueId (call on one rank, share with all).");

  py::class_<Event, std::shared_ptr<Event>>(m, "Event")
      .def(py::init<int>(), py::arg("device"))
      .def("record", [](Event& e, uintptr_t s) { e.record(as_stream(s)); }, py::arg("stream"))
      .def("query", &Event::query)
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("block", [](const Event& e, uintptr_t s) { e.block(as_stream(s)); }, py::arg("stream"),
           "Make `stream` wait for this event (host does not block).")
      .def_property_readonly("device", &Event::device);

  py::class_<CommStream, std::shared_ptr<CommStream>>(m, "CommStream")
      .def(py::init<int, bool>(), py::arg("device"), py::arg("high_priority") = true)
      .def_property_readonly("handle", &CommStream::handle)
      .def_property_readonly("device", &CommStream::device)
      .def_property_readonly("priority", &CommStream::priority)
      .def("wait_for", [](CommStream& c, uintptr_t s) { c.wait_for(as_stream(s)); },
           py::arg("producer"))
      .def("record_done", &CommStream::record_done)
      .def("make_wait",
           [](const CommStream& c, uintptr_t s, const Event& e) { c.make_wait(as_stream(s), e); },
           py::arg("consumer"), py::arg("done"));

  py::class_<NcclComm, std::shared_ptr<NcclComm>>(m, "NcclComm")
      .def(py::init([](py::bytes uid, int world_size, int rank, int device) {
             std::string id = uid;
             py::gil_scoped_release release;  // blocks until every rank has joined
             return std::make_shared<NcclComm>(id, world_size, rank, device);
           }),
           py::arg("unique_id"), py::arg("world_size"), py::arg("rank"), py::arg("device"))
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("world_size", &NcclComm::world_size)
      .def_property_readonly("device", &NcclComm::device)
      // Note [launches without the GIL]: every call that may block inside NCCL releases the GIL.
      .def("all_reduce", &NcclComm::all_reduce, py::arg("send"), py::arg("recv"),
           py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"),
           py::arg("what") = "all_reduce", py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &NcclComm::reduce_scatter, py::arg("send"), py::arg("recv"),
           py::arg("recv_count"), py::arg("dtype"), py::arg("op"), py::arg("stream"),
           py::arg("what") = "reduce_scatter", py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &NcclComm::all_gather, py::arg("send"), py::arg("recv"),
           py::arg("send_count"), py::arg("dtype"), py::arg("stream"),
           py::arg("what") = "all_gather", py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &NcclComm::broadcast, py::arg("send"), py::arg("recv"), py::arg("count"),
           py::arg("dtype"), py::arg("root"), py::arg("stream"), py::arg("what") = "broadcast",
           py::call_guard<py::gil_scoped_release>())
      .def("check_async_error", &NcclComm::check_async_error, py::arg("what"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait", &NcclComm::wait, py::arg("done"), py::arg("timeout_s"), py::arg("what"),
           py::call_guard<py::gil_scoped_release>(),
           "Block until `done` completed; past `timeout_s` seconds abort and raise NcclError. "
           "inf waits without a deadline; NaN or a negative timeout raises ValueError.")
      .def("abort", &NcclComm::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      .def("destroy", &NcclComm::destroy, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("aborted", &NcclComm::is_aborted)
      .def_property_readonly("abort_reason", &NcclComm::abort_reason);
}
