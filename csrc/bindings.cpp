// pybind11 module cgx._C: the backend class, its options, and the codec on tensors.
// The one translation unit that includes torch/python.h.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <iterator>
#include <optional>
#include <variant>

#include "backend/argument_checks.h"
#include "backend/process_group_cgx.h"
#include "backend/tensor_codec.h"
#include "backend/thread_tasks.h"
#include "collectives/call_agreement.h"
#include "collectives/path_choice.h"
#include "compression/chunk_places.h"
#include "compression/quantizer.h"
#ifdef CGX_WITH_MPI
#include "transport/mpi_runtime.h"
#endif

namespace py = pybind11;

// What holds a ProcessGroupCGX from Python: an intrusive_ptr whose last release, when it
// comes with the GIL held (a Python wrapper freed, often by gc), drops the GIL first, as
// torch does for its own backends. Destroying the group joins the wrapped Gloo backend's
// threads, and a Gloo thread freeing a finished call's tensors needs the GIL to drop their
// Python objects: with the GIL kept here both waited for ever (a rank's exit hung in gc,
// about once in 80 runs of a DiLoCo test). Laid out as a single intrusive_ptr, like the
// holder torch gives the c10d::Backend base.
template <typename T>
class GilFreeRelease {
 public:
  GilFreeRelease() = default;
  explicit GilFreeRelease(T* raw) : ptr_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(raw)) {}
  GilFreeRelease(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}  // NOLINT: implicit on purpose
  GilFreeRelease(const GilFreeRelease&) = default;
  GilFreeRelease(GilFreeRelease&&) noexcept = default;
  GilFreeRelease& operator=(const GilFreeRelease&) = default;
  GilFreeRelease& operator=(GilFreeRelease&&) noexcept = default;
  ~GilFreeRelease() {
    if (ptr_ && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      ptr_.reset();
    }
  }
  T* get() const { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};
PYBIND11_DECLARE_HOLDER_TYPE(T, GilFreeRelease<T>, true);

using cgx::backend::CrossCommunicator;
using cgx::backend::InnerCommunicator;
using cgx::backend::Settings;
using cgx::backend::ProcessGroupCGX;
using cgx::collectives::ReductionAlgorithm;

namespace {

// pybind11 takes True for 1 where an int is asked: not for a bit count.
int bits_of(const py::handle& bits) {
  if (PyBool_Check(bits.ptr()) || !PyLong_Check(bits.ptr()))
    throw py::type_error("cgx: bits must be an int, got " +
                         std::string(py::str(py::type::handle_of(bits).attr("__name__"))));
  return bits.cast<int>();
}

cgx::compression::QuantizerParams quantizer(const py::handle& bits, int64_t bucket_size,
                                            bool skip_incomplete, bool stochastic,
                                            const std::string& scheme) {
  cgx::compression::QuantizerParams p;
  p.bits = bits_of(bits);
  p.bucket_size = bucket_size;
  p.skip_incomplete_buckets = skip_incomplete;
  p.stochastic = stochastic;
  try {
    p.scheme = cgx::compression::scheme_from_name(scheme);
    cgx::compression::validate(p);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  return p;
}

// A plan as Python gives it: (offset, numel, bits, bucket_size[, scheme]) per segment; bits
// 32 raw; no scheme is "maxmin".
using SegmentArg = std::variant<std::tuple<int64_t, int64_t, int, int64_t>,
                                std::tuple<int64_t, int64_t, int, int64_t, std::string>>;
using LayoutArg = std::vector<SegmentArg>;

std::vector<cgx::compression::Segment> segments(const ProcessGroupCGX& pg, const LayoutArg& layout,
                                                bool stochastic) {
  std::vector<cgx::compression::Segment> out;
  out.reserve(layout.size());
  for (const auto& arg : layout) {
    const auto [offset, numel, bits, bucket_size, scheme] = std::visit(
        [](const auto& t) {
          if constexpr (std::tuple_size_v<std::decay_t<decltype(t)>> == 4)
            return std::tuple_cat(t, std::make_tuple(std::string("maxmin")));
          else
            return t;
        },
        arg);
    cgx::compression::Segment s;
    s.offset = offset;
    s.numel = numel;
    s.raw = bits == cgx::backend::kRawBits;
    s.params.bits = bits;
    s.params.bucket_size = bucket_size;
    s.params.scheme = cgx::compression::scheme_from_name(scheme);
    s.params.skip_incomplete_buckets = pg.settings().skip_incomplete_buckets;
    s.params.stochastic = stochastic;
    out.push_back(s);
  }
  return out;
}

void check_threads(int threads, const char* what) {
  TORCH_CHECK_VALUE(threads >= 1 && threads <= cgx::backend::kMaxCodecThreads, what, ": threads must be in 1..",
                    cgx::backend::kMaxCodecThreads, ", got ", threads);
}

void check_chunk_places(const cgx::compression::ChunkPlaces& shape, const char* what) {
  TORCH_CHECK_VALUE(shape.rows >= 0 && shape.width >= 1 && shape.kept >= 1 && shape.kept <= shape.width &&
                        shape.low_bits >= 0 && shape.low_bits < 31 && (shape.width - 1) >> shape.low_bits < (1 << 30),
                    what, ": need rows >= 0, 1 <= kept <= width, 0 <= low_bits < 31 and (width - 1) >> low_bits < 2**30",
                    ", got rows=", shape.rows, " width=", shape.width, " kept=", shape.kept, " low_bits=", shape.low_bits);
}

// The codec on tensors (backend/tensor_codec.h), its bit count, scheme and threads read here.
at::Tensor compress(const at::Tensor& input, const py::object& bits, int64_t bucket_size, bool stochastic,
                    uint64_t seed, bool skip_incomplete, std::optional<at::Tensor> out,
                    const std::string& scheme, int threads) {
  const auto p = quantizer(bits, bucket_size, skip_incomplete, stochastic, scheme);
  check_threads(threads, "cgx.compress");
  py::gil_scoped_release no_gil;
  return cgx::backend::compress_tensor(input, p, seed, std::move(out), threads);
}

at::Tensor decompress(const at::Tensor& buffer, int64_t numel, const py::object& bits, int64_t bucket_size,
                      bool skip_incomplete, std::optional<at::Tensor> out, bool add,
                      const std::string& scheme, int threads) {
  const auto p = quantizer(bits, bucket_size, skip_incomplete, false, scheme);
  check_threads(threads, "cgx.decompress");
  py::gil_scoped_release no_gil;
  return cgx::backend::decompress_tensor(buffer, numel, p, std::move(out), add, threads);
}

// A Python enum whose members are `names`, the C++ enum's values in order.
template <typename Enum, size_t N>
void bind_enum(py::module_& m, const char* name, const char* const (&names)[N]) {
  py::enum_<Enum> bound(m, name);
  for (size_t i = 0; i < N; ++i) bound.value(names[i], static_cast<Enum>(i));
}

// Sets the Python error to cgx.errors.<name> (RuntimeError should that module fail to
// import), with the message torch itself would show: no C++ backtrace.
void raise_as(const char* name, const c10::Error& e) {
  try {
    PyErr_SetString(py::module_::import("cgx.errors").attr(name).ptr(), e.what_without_backtrace());
  } catch (const py::error_already_set&) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cgx native module: ProcessGroupCGX and the max-min quantizer";
  // The base classes (Backend, Store) are registered by torch.distributed.
  py::module_::import("torch.distributed");
  // Global, not module-local: the errors cross into Python through torch's bindings
  // (Work.wait, Future.wait), which share pybind11's registry with this module.
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const cgx::backend::PeerError& e) {
      raise_as("PeerError", e);
    } catch (const cgx::backend::CollectiveTimeoutError& e) {
      raise_as("CollectiveTimeoutError", e);
    } catch (const cgx::backend::CallMismatchError& e) {
      raise_as("CallMismatchError", e);
    }
  });

  // The enums' members come from their C++ name lists: cgx/config.py takes the choices it
  // accepts from these (e.g. _C.InnerCommunicator.__members__).
  bind_enum<cgx::compression::Scheme>(m, "Scheme", cgx::compression::kSchemeNames);
  bind_enum<InnerCommunicator>(m, "InnerCommunicator", cgx::backend::kInnerCommunicatorNames);
  bind_enum<CrossCommunicator>(m, "CrossCommunicator", cgx::backend::kCrossCommunicatorNames);
  bind_enum<ReductionAlgorithm>(m, "ReductionAlgorithm", cgx::collectives::kReductionAlgorithmNames);

  // The limits of the settings (backend/settings.h), read by cgx/config.py and cgx/layers.py.
  m.attr("RAW_BITS") = cgx::backend::kRawBits;
  m.attr("MAX_BITS") = cgx::backend::kMaxBits;
  m.attr("MAX_BUCKET_SIZE") = cgx::backend::kMaxBucketSize;
  // The quantizer's schemes by name (compression/schemes.h), and the hadamard one's limits.
  m.attr("SCHEMES") = py::tuple(m.attr("Scheme").attr("__members__"));
  // Why the codec refuses these bits and bucket size in `scheme` (its words), or "": the
  // one rule, which cgx/layers.py asks.
  m.def(
      "scheme_problem",
      [](const py::handle& bits, int64_t bucket_size, const std::string& scheme) -> std::string {
        try {
          quantizer(bits, bucket_size, false, false, scheme);
        } catch (const py::value_error& e) {
          return e.what();
        }
        return "";
      },
      py::arg("bits"), py::arg("bucket_size"), py::arg("scheme"));
  m.attr("MAX_HADAMARD_BITS") = cgx::compression::kMaxHadamardBits;
  m.attr("MAX_HADAMARD_BUCKET") = cgx::compression::kMaxHadamardBucket;
  m.attr("MAX_MINIMAL_SIZE") = cgx::backend::kMaxMinimalSize;
  m.attr("MIN_SHM_RING_BYTES") = cgx::backend::kMinShmRingBytes;
  m.attr("MAX_SHM_RING_BYTES") = cgx::backend::kMaxShmRingBytes;
  m.attr("PIECE_VALUES") = cgx::collectives::kPieceValues;  // the default
  m.attr("MAX_PIECE_VALUES") = cgx::backend::kMaxPieceValues;
  m.attr("MAX_CODEC_THREADS") = cgx::backend::kMaxCodecThreads;
  m.attr("MAX_SHM_NAME_TAG") = cgx::backend::kMaxShmNameTag;

  // Filled field by field from a cgx.Config (cgx/backend.py to_settings): no defaults.
  py::class_<Settings> settings(m, "Settings");
  settings.def(py::init<>());
#define CGX_BIND_SETTING(type, name, is_signed) settings.def_readwrite(#name, &Settings::name);
  CGX_SETTINGS_FIELDS(CGX_BIND_SETTING)
#undef CGX_BIND_SETTING

  py::class_<ProcessGroupCGX, c10d::Backend, GilFreeRelease<ProcessGroupCGX>>(
      m, "ProcessGroupCGX")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> exact,
                       const py::object& exact_cuda, Settings settings) {
             auto cuda = exact_cuda.is_none() ? c10::intrusive_ptr<c10d::Backend>()
                                              : exact_cuda.cast<c10::intrusive_ptr<c10d::Backend>>();
             py::gil_scoped_release no_gil;
             return GilFreeRelease<ProcessGroupCGX>(c10::make_intrusive<ProcessGroupCGX>(
                 store, rank, size, timeout, std::move(exact), std::move(cuda), std::move(settings)));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("exact"), py::arg("exact_cuda"), py::arg("settings"),
           "exact: the Gloo backend of the exact path; exact_cuda: the backend for CUDA tensors "
           "on the exact path (NCCL), or None for Gloo.")
      .def_property_readonly("cuda_exact_backend", &ProcessGroupCGX::cuda_exact_backend,
                             "The backend CUDA tensors take on the exact path: gloo or nccl.")
      // A copy: the live settings are const, shared with the worker thread.
      .def_property_readonly("settings", [](const ProcessGroupCGX& pg) { return pg.settings(); })
      .def_property_readonly("num_hosts", &ProcessGroupCGX::num_hosts)
      .def_property_readonly("hierarchical", &ProcessGroupCGX::hierarchical,
                             "Whether compressed allreduces take the hierarchical path.")
      .def(
          "allreduce_layout",
          [](ProcessGroupCGX& pg, const at::Tensor& tensor, const LayoutArg& layout, bool average,
             std::optional<at::Tensor> residual) {
            return pg.allreduce_layout(tensor, segments(pg, layout, pg.settings().stochastic_rounding),
                                       average, std::move(residual));
          },
          py::arg("tensor"), py::arg("layout"), py::kw_only(), py::arg("average") = false,
          py::arg("residual") = py::none(), py::call_guard<py::gil_scoped_release>(),
          "Allreduce of one tensor with a per-segment plan: layout = [(offset, numel, bits, "
          "bucket_size), ...] covering the tensor in order; bits 32 sends a segment exactly. "
          "residual: this rank's error-feedback buffer (float32, the tensor's size), added to "
          "the input, then holding what this rank's quantizations dropped (both stages).")
      .def(
          "allgather_layout",
          [](ProcessGroupCGX& pg, const at::Tensor& output, const at::Tensor& input,
             const LayoutArg& layout, bool stochastic, uint64_t seed) {
            return pg.allgather_layout(output, input, segments(pg, layout, stochastic), seed);
          },
          py::arg("output"), py::arg("input"), py::arg("layout"), py::kw_only(),
          py::arg("stochastic") = false, py::arg("seed") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "All-gather of equal shards: layout is one shard's plan [(offset, numel, bits, "
          "bucket_size), ...]; every rank decodes the same bytes, its own shard included. "
          "stochastic: unbiased rounding, its stream chosen by seed.")
      .def(
          "reduce_scatter_layout",
          [](ProcessGroupCGX& pg, const at::Tensor& output, const at::Tensor& input,
             const LayoutArg& layout, const std::string& op, double factor,
             std::optional<at::Tensor> residual) {
            c10d::ReduceOp::RedOpType red;
            if (op == "sum") red = c10d::ReduceOp::SUM;
            else if (op == "avg") red = c10d::ReduceOp::AVG;
            else if (op == "premul_sum") red = c10d::ReduceOp::PREMUL_SUM;
            else throw py::value_error("cgx reduce_scatter_layout: op must be 'sum', 'avg' or 'premul_sum', got '" + op + "'");
            return pg.reduce_scatter_layout(output, input, segments(pg, layout, false), red,
                                            factor, std::move(residual));
          },
          py::arg("output"), py::arg("input"), py::arg("layout"), py::kw_only(),
          py::arg("op") = "avg", py::arg("factor") = 1.0, py::arg("residual") = py::none(),
          py::call_guard<py::gil_scoped_release>(),
          "Reduce-scatter of equal shards, each contribution quantized once (round to "
          "nearest) as the shard's layout says. op: 'sum', 'avg' or 'premul_sum' (the sum "
          "times factor). residual: this rank's error-feedback buffer (float32, input's size).")
      .def(
          "stats",
          [](const ProcessGroupCGX& pg) {
            const auto s = pg.stats();
            auto counters = [](const ProcessGroupCGX::Counters& c, py::dict d) {
              d["calls"] = c.calls;
              d["bytes_sent"] = c.bytes_sent;
              d["uncompressed_bytes"] = c.uncompressed_bytes;
              return d;
            };
            py::dict d = counters(s.allreduce, py::dict());
            d["cross_host_bytes"] = s.cross_host_bytes;
            d["allgather"] = counters(s.allgather, py::dict());
            d["reduce_scatter"] = counters(s.reduce_scatter, py::dict());
            py::list paths;
            for (const auto& c : s.paths) {
              py::dict p;
              p["min_bytes"] = uint64_t{1} << c.size_class;  // the class: [min_bytes, 2 min_bytes)
              p["path"] = c.path == cgx::collectives::Path::kExact ? "exact" : "compressed";
              p["compressed_ms"] = c.compressed_us / 1e3;
              p["exact_ms"] = c.exact_us / 1e3;
              p["compressed_calls"] = c.compressed_calls;
              p["exact_calls"] = c.exact_calls;
              paths.append(p);
            }
            d["auto"] = paths;
            uint64_t exact_calls = 0, exact_bytes = 0;
            py::dict why;
            for (size_t i = 0; i < s.exact.size(); ++i) {
              const auto& c = s.exact[i];
              exact_calls += c.calls;
              exact_bytes += c.bytes;
              if (c.calls == 0) continue;
              py::dict counts;
              counts["calls"] = c.calls;
              counts["bytes"] = c.bytes;
              why[ProcessGroupCGX::exact_reason_name(static_cast<ProcessGroupCGX::ExactReason>(i))] = counts;
            }
            d["exact_calls"] = exact_calls;
            d["exact_bytes"] = exact_bytes;
            d["exact_why"] = why;
            return d;
          },
          "This rank's totals: calls, bytes_sent and uncompressed_bytes (what the same "
          "algorithm sends uncompressed) of its compressed allreduces, the same under "
          "'allgather' and 'reduce_scatter' for the sharded collectives, and "
          "cross_host_bytes (everything it sent to other hosts, call checks included); "
          "'auto': CGX_COMPRESSION_AUTO's last choice per size class of allreduce (float32 "
          "bytes in [min_bytes, 2 min_bytes)), the slowest rank's timings it compared (0: not "
          "agreed yet) and the calls sent each way; exact_calls and exact_bytes: the allreduces "
          "that went the exact way (auto's included) and their tensors' bytes, and exact_why "
          "the same per reason ('auto', 'cgx.exact', 'bits', 'op', 'dtype', 'minimal_size', "
          "'tensor_list').");

  m.def("set_exact_on_this_thread", &ProcessGroupCGX::set_exact_on_this_thread,
        py::arg("exact"),
        "While set, the allreduces this thread issues on a cgx group take the exact path "
        "(use cgx.exact()). Returns the previous value.");

  m.def(
      "sent_exactly",
      [](const c10::intrusive_ptr<c10d::Work>& work) {
        const auto* cgx_work = dynamic_cast<const cgx::backend::CGXWork*>(work.get());
        return cgx_work != nullptr && cgx_work->sent_exactly();
      },
      py::arg("work"),
      "Whether CGX_COMPRESSION_AUTO sent a completed cgx call with every value raw (float32 "
      "on the wire) instead of compressed; False for any other Work.");

  m.def("compress", &compress, py::arg("input"), py::arg("bits"), py::arg("bucket_size"),
        py::kw_only(), py::arg("stochastic") = false, py::arg("seed") = 0,
        py::arg("skip_incomplete_buckets") = false, py::arg("out") = py::none(),
        py::arg("scheme") = "maxmin", py::arg("threads") = 1,
        "Quantizes a float tensor into the cgx wire format (docs/wire-format.md); on the CPU "
        "its buckets split over up to `threads` threads (the same bytes for any count).");
  m.def("decompress", &decompress, py::arg("buffer"), py::arg("numel"), py::arg("bits"),
        py::arg("bucket_size"), py::kw_only(), py::arg("skip_incomplete_buckets") = false,
        py::arg("out") = py::none(), py::arg("add") = false, py::arg("scheme") = "maxmin",
        py::arg("threads") = 1,
        "Decodes a cgx buffer into float32 values; add=True adds them into out; on the CPU "
        "over up to `threads` threads.");
  m.def(
      "compressed_size",
      [](int64_t numel, const py::object& bits, int64_t bucket_size, bool skip_incomplete,
         const std::string& scheme) {
        TORCH_CHECK_VALUE(numel >= 0, "cgx.compressed_size: numel must be >= 0, got ", numel);
        return cgx::compression::compressed_bytes(
            quantizer(bits, bucket_size, skip_incomplete, false, scheme), numel);
      },
      py::arg("numel"), py::arg("bits"), py::arg("bucket_size"), py::kw_only(),
      py::arg("skip_incomplete_buckets") = false, py::arg("scheme") = "maxmin", "Bytes of the compressed form of numel values.");

  m.def(
      "wait_for_thread_tasks",
      [](double seconds) {
        return cgx::backend::thread_tasks::wait_released(
            std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
      },
      py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
      "Waits until every task queued to cgx's threads ran and released what it held, at most "
      "`seconds`: False where they passed (cgx/backend.py calls it as Python exits).");
  m.def(
      "chunk_places",
      [](int64_t numel, int64_t chunk, int64_t k) {
        TORCH_CHECK_VALUE(numel >= 1 && chunk >= 1 && k >= 1, "cgx.chunk_places: need numel, chunk and k >= 1, got ",
                          numel, ", ", chunk, ", ", k);
        const auto shape = cgx::compression::ChunkPlaces::of(numel, chunk, k);
        return std::make_tuple(shape.rows, shape.width, shape.kept, shape.low_bits, shape.code_bytes());
      },
      py::arg("numel"), py::arg("chunk"), py::arg("k"),
      "How numel values travel as chunks of `chunk` with k of each kept: (rows, width, kept, low_bits, "
      "the places' code's bytes).");
  m.def(
      "select_places",
      [](const at::Tensor& values, int64_t rows, int64_t width, int64_t kept, int low_bits) {
        const cgx::compression::ChunkPlaces shape{rows, width, kept, low_bits};
        check_chunk_places(shape, "cgx.select_places");
        TORCH_CHECK_VALUE(values.device().is_cpu() && values.scalar_type() == at::kFloat && values.dim() == 1 &&
                              values.is_contiguous() && values.numel() <= rows * width &&
                              values.numel() > (rows - 1) * width,
                          "cgx.select_places: values must be a contiguous 1-D float32 CPU tensor filling ",
                          rows, " chunks of ", width);
        auto code = at::empty({shape.code_bytes()}, at::kByte);
        auto kept_values = at::empty({rows * kept}, at::kFloat);
        auto places = at::empty({rows, kept}, at::kLong);
        {
          py::gil_scoped_release no_gil;
          cgx::compression::select_places(values.const_data_ptr<float>(), values.numel(), shape,
                                          code.mutable_data_ptr<uint8_t>(), kept_values.mutable_data_ptr<float>(),
                                          places.mutable_data_ptr<int64_t>());
        }
        return std::make_tuple(code, kept_values, places);
      },
      py::arg("values"), py::arg("rows"), py::arg("width"), py::arg("kept"), py::arg("low_bits"),
      "Of each chunk of `width` values, the `kept` largest in magnitude, ascending by place: "
      "(their places in Elias-Fano's code, their values, their places as (rows, kept)).");
  m.def(
      "read_places",
      [](const at::Tensor& code, int64_t rows, int64_t width, int64_t kept, int low_bits) {
        const cgx::compression::ChunkPlaces shape{rows, width, kept, low_bits};
        check_chunk_places(shape, "cgx.read_places");
        TORCH_CHECK_VALUE(code.device().is_cpu() && code.scalar_type() == at::kByte && code.dim() == 1 &&
                              code.is_contiguous() && code.numel() == shape.code_bytes(),
                          "cgx.read_places: code must be a contiguous 1-D uint8 CPU tensor of ",
                          shape.code_bytes(), " bytes");
        auto places = at::empty({rows, kept}, at::kLong);
        bool read;
        {
          py::gil_scoped_release no_gil;
          read = cgx::compression::read_places(code.const_data_ptr<uint8_t>(), shape,
                                               places.mutable_data_ptr<int64_t>());
        }
        return read ? py::object(py::cast(places)) : py::object(py::none());
      },
      py::arg("code"), py::arg("rows"), py::arg("width"), py::arg("kept"), py::arg("low_bits"),
      "The (rows, kept) places select_places coded; None where the code does not hold `kept` "
      "ascending places below `width` in every chunk.");

  // MPI runtime, for the mpirun launch (cgx/mpi.py). Absent functions: built without MPI.
  m.attr("mpi_built") = cgx::backend::kWithMpi;
  // Bytes each compressed call sends every peer to compare calls before data moves.
  m.attr("call_header_bytes") = cgx::collectives::AgreedCall::kHeaderBytes;
  m.attr("cuda_built") = cgx::backend::kWithCuda;
#ifdef CGX_WITH_MPI
  auto mpi = m.def_submodule("mpi", "The process's MPI library, as cgx uses it.");
  mpi.def(
      "init",
      []() {
        try {
          cgx::transport::mpi::ensure_initialized();
        } catch (const std::runtime_error& e) {
          throw py::value_error(e.what());
        }
      },
      "Initialises MPI with MPI_THREAD_MULTIPLE unless it already is (checks the level).");
  mpi.def("world_rank", &cgx::transport::mpi::world_rank);
  mpi.def("world_size", &cgx::transport::mpi::world_size);
  mpi.def(
      "allgather",
      [](const std::string& mine) {
        std::vector<std::string> all;
        {
          py::gil_scoped_release no_gil;
          all = cgx::transport::mpi::allgather(mine);
        }
        py::list out;
        for (const auto& s : all) out.append(py::bytes(s));
        return out;
      },
      "Every rank's bytes, over MPI_COMM_WORLD.");
  mpi.def(
      "broadcast_from_root",
      [](const std::string& value) {
        std::string out;
        {
          py::gil_scoped_release no_gil;
          out = cgx::transport::mpi::broadcast_from_root(value);
        }
        return py::bytes(out);
      },
      "Rank 0's bytes on every rank, over MPI_COMM_WORLD.");
  mpi.def("finalize", &cgx::transport::mpi::finalize, py::call_guard<py::gil_scoped_release>(),
          "Frees cgx's communicators; finalises MPI if cgx initialised it.");
#endif
}
