// A .safetensors file image (8-byte length, JSON header, data): validated or a KvError naming the
// file. Every accepted entry must lie inside the image, so later reads cannot leave the mapping.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_common.h"
#include "common/check.h"
#include "backend/model/safetensors_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A copy of exactly `size` bytes, so that ASan sees any read past the image.
  std::vector<std::byte> image(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  kvfuzz::expect_only<kvserve::KvError>([&] {
    kvserve::SafetensorsFile f(image.data(), image.size(), "fuzz.safetensors");
    for (const auto& [name, e] : f.entries()) {
      if (e.nbytes > 0 && (e.data < image.data() || e.data + e.nbytes > image.data() + image.size())) std::abort();
      size_t elems = 1;
      for (int64_t d : e.shape) {
        if (d < 0) std::abort();
        elems *= static_cast<size_t>(d);
      }
      if (elems * kvserve::SafetensorsFile::dtype_size(e.dtype) != e.nbytes) std::abort();
      volatile std::byte sink{};
      if (e.nbytes > 0) sink = e.data[e.nbytes - 1];  // touch the last byte of the declared range
      (void)sink;
    }
  });
  return 0;
}
