# ggml (llama.cpp's tensor library, MIT) from the pinned PyPI source distribution of
# llama-cpp-python, which vendors it; the sdist's sha256 is checked by CMake before it is unpacked.
# Only ggml-base (types, block formats, GGUF reader) and ggml-cpu (the CPU dot products per block
# type) are built, static, CPU only: kvserve calls their type traits from its own quantized linear
# layers (backend/quantization/). No llama.cpp, no ggml CUDA (kvserve has its own CUDA kernels).
# Offline: -DKVSERVE_GGML_SDIST=/path/to/llama_cpp_python-0.3.36.tar.gz (the same hash is checked),
# or -DKVSERVE_GGML_SOURCE_DIR=/path/to/ggml: that sdist's vendor/llama.cpp/ggml already unpacked
# (tools/gpu_check.sh carries its CPU part to a GPU machine, where the 77 MB sdist would not fit).
include_guard(GLOBAL)

set(KVSERVE_GGML_SDIST_VERSION 0.3.36)
set(KVSERVE_GGML_SDIST_SHA256 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e)
set(KVSERVE_GGML_SDIST "" CACHE FILEPATH "a local copy of the llama-cpp-python sdist (else it is fetched from pip's index)")
set(KVSERVE_GGML_SOURCE_DIR "" CACHE PATH "the sdist's vendor/llama.cpp/ggml, unpacked (instead of the sdist)")
if(KVSERVE_GGML_SOURCE_DIR)
  if(NOT EXISTS "${KVSERVE_GGML_SOURCE_DIR}/src/ggml-cpu/CMakeLists.txt")
    message(FATAL_ERROR "KVSERVE_GGML_SOURCE_DIR=${KVSERVE_GGML_SOURCE_DIR} is not a ggml tree (no src/ggml-cpu/CMakeLists.txt)")
  endif()
  set(KVSERVE_GGML_ROOT ${KVSERVE_GGML_SOURCE_DIR})
else()
  include(${CMAKE_CURRENT_LIST_DIR}/pinned_sdist.cmake)
  kvserve_pinned_sdist_source(ggml_sdist_dir kvserve_ggml llama_cpp_python ${KVSERVE_GGML_SDIST_VERSION}
                              ${KVSERVE_GGML_SDIST_SHA256} "${KVSERVE_GGML_SDIST}")
  set(KVSERVE_GGML_ROOT ${ggml_sdist_dir}/vendor/llama.cpp/ggml)
endif()

# ggml's own CMake, told to build static CPU-only libraries for this machine. Its targets are
# EXCLUDE_FROM_ALL: only ggml-base and ggml-cpu, which kvserve links, get built.
set(BUILD_SHARED_LIBS OFF)
set(GGML_STATIC OFF CACHE BOOL "" FORCE)
set(GGML_NATIVE ON CACHE BOOL "" FORCE)
set(GGML_BACKEND_DL OFF CACHE BOOL "" FORCE)
set(GGML_CPU ON CACHE BOOL "" FORCE)
set(GGML_CUDA OFF CACHE BOOL "" FORCE)
set(GGML_METAL OFF CACHE BOOL "" FORCE)
set(GGML_VULKAN OFF CACHE BOOL "" FORCE)
set(GGML_BLAS OFF CACHE BOOL "" FORCE)
# kvserve calls the dot products from its own (libtorch) OpenMP loop, never ggml's thread pool: no
# second OpenMP runtime beside the one the torch wheel ships.
set(GGML_OPENMP OFF CACHE BOOL "" FORCE)
set(GGML_LLAMAFILE ON CACHE BOOL "" FORCE)
set(GGML_CCACHE ON CACHE BOOL "" FORCE)
set(GGML_ALL_WARNINGS OFF CACHE BOOL "" FORCE)
set(GGML_BUILD_TESTS OFF CACHE BOOL "" FORCE)
set(GGML_BUILD_EXAMPLES OFF CACHE BOOL "" FORCE)
add_subdirectory(${KVSERVE_GGML_ROOT} ${CMAKE_BINARY_DIR}/_ggml EXCLUDE_FROM_ALL SYSTEM)
foreach(t ggml-base ggml-cpu)
  set_target_properties(${t} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  # Third-party code: its warnings are not ours to fix.
  target_compile_options(${t} PRIVATE -w)
endforeach()
# ggml-base's reference dequantizers (to_float) round each product and sum on its own, as the gguf
# Python package's NumPy dequantize does, so kvserve's weights equal it bit for bit (no FMAs).
target_compile_options(ggml-base PRIVATE -ffp-contract=off)
