# kvserve_pinned_sdist(VAR NAME VERSION SHA256 OVERRIDE): sets VAR to where the pinned PyPI source
# distribution NAME-VERSION.tar.gz is: OVERRIDE (a local copy, -D...=path) when set, else a copy in
# the build directory fetched once from the index pip uses (tools/fetch_sdist.py, sha256 checked).
# FetchContent checks the same hash again when it unpacks it.
include_guard(GLOBAL)

function(kvserve_pinned_sdist var name version sha256 override)
  if(override)
    set(${var} "${override}" PARENT_SCOPE)
    return()
  endif()
  set(dest "${CMAKE_BINARY_DIR}/_sdist/${name}-${version}.tar.gz")
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../tools/fetch_sdist.py ${name} ${version} ${sha256} ${dest}
    RESULT_VARIABLE fetch_rc)
  if(NOT fetch_rc EQUAL 0)
    message(FATAL_ERROR "could not fetch the ${name} ${version} sdist from pip's index "
                        "(pass a local copy: -D...=/path/to/${name}-${version}.tar.gz)")
  endif()
  set(${var} "${dest}" PARENT_SCOPE)
endfunction()

# kvserve_pinned_sdist_source(VAR FC_NAME NAME VERSION SHA256 OVERRIDE): the sdist above unpacked by
# FetchContent as FC_NAME (its hash checked again), and VAR set to the unpacked tree. Only unpacked:
# the package's own build (Python bindings, its CMake) is never run; the caller builds what it needs.
macro(kvserve_pinned_sdist_source var fc_name name version sha256 override)
  include(FetchContent)
  kvserve_pinned_sdist(_kvserve_sdist_url ${name} ${version} ${sha256} "${override}")
  FetchContent_Declare(${fc_name}
    URL "${_kvserve_sdist_url}"
    URL_HASH SHA256=${sha256}
    DOWNLOAD_EXTRACT_TIMESTAMP TRUE
    SOURCE_SUBDIR kvserve-unpack-only)
  FetchContent_MakeAvailable(${fc_name})
  set(${var} ${${fc_name}_SOURCE_DIR})
endmacro()
