#pragma once
// Shared by the fuzz targets: the one rule every parser must keep on outside bytes is that it
// either succeeds or throws its documented error type. Anything else (a crash, a sanitizer report,
// another exception escaping) is a bug, so it aborts and libFuzzer records the input.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace kvfuzz {

[[noreturn]] inline void unexpected(const char* what) {
  std::fprintf(stderr, "fuzz: an undocumented exception escaped the parser: %s\n", what);
  std::abort();
}

// Runs `fn`; the expected error type E is swallowed, every other exception aborts.
template <typename E, typename F>
void expect_only(F&& fn) {
  try {
    fn();
  } catch (const E&) {
  } catch (const std::exception& e) {
    unexpected(e.what());
  } catch (...) {
    unexpected("(not a std::exception)");
  }
}

// A file of the checkout (path relative to the repository root); aborts when it cannot be read.
std::string read_source_file(const std::string& relative);

}  // namespace kvfuzz
