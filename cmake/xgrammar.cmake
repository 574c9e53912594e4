# xgrammar's C++ core (JSON-schema / regex / EBNF grammar compiler and token matcher, Apache-2.0)
# from the pinned PyPI source distribution, its sha256 checked by CMake before it is unpacked.
# Only the C++ core is built (no Python bindings, no tvm-ffi), as the static target `xgrammar`.
# Offline: -DKVSERVE_XGRAMMAR_SDIST=/path/to/xgrammar-0.2.8.tar.gz (the same hash is checked).
include_guard(GLOBAL)

set(KVSERVE_XGRAMMAR_VERSION 0.2.8)
set(KVSERVE_XGRAMMAR_SHA256 8305646fd2b319d6c3003f51a1665e54cbbe9cba1fb636bc41d0b46434ccbb80)
set(KVSERVE_XGRAMMAR_SDIST "" CACHE FILEPATH "a local copy of the xgrammar sdist (else it is fetched from pip's index)")
include(${CMAKE_CURRENT_LIST_DIR}/pinned_sdist.cmake)
# Unpacked only: xgrammar's own CMake (Python bindings, -Werror, LTO) is not run; the target below
# lists the core's sources instead.
kvserve_pinned_sdist_source(XGRAMMAR_ROOT kvserve_xgrammar xgrammar ${KVSERVE_XGRAMMAR_VERSION} ${KVSERVE_XGRAMMAR_SHA256}
                            "${KVSERVE_XGRAMMAR_SDIST}")

file(GLOB_RECURSE xgrammar_sources ${XGRAMMAR_ROOT}/cpp/*.cc)
list(FILTER xgrammar_sources EXCLUDE REGEX "/cpp/tvm_ffi/")
add_library(xgrammar STATIC ${xgrammar_sources})
set_target_properties(xgrammar PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON POSITION_INDEPENDENT_CODE ON)
target_include_directories(xgrammar PUBLIC ${XGRAMMAR_ROOT}/include)
target_include_directories(xgrammar SYSTEM PUBLIC ${XGRAMMAR_ROOT}/3rdparty/picojson ${XGRAMMAR_ROOT}/3rdparty/dlpack/include)
target_compile_definitions(xgrammar PUBLIC XGRAMMAR_ENABLE_CPPTRACE=0)
# Third-party code: its warnings are not ours to fix.
target_compile_options(xgrammar PRIVATE -w)
find_package(Threads REQUIRED)
target_link_libraries(xgrammar PUBLIC Threads::Threads)
