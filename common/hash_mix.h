#pragma once
// mix64: splitmix64's finaliser, the hash step behind the KV caches' content keys.
#include <cstdint>

namespace kvserve {

// Every input bit reaches every output bit; chain it (h = mix64(h ^ x)) to hash a sequence.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace kvserve
