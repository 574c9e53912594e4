#include "backend/engine/kv_room.h"

#include <utility>

#include "common/check.h"

namespace kvserve {

KvRoom::KvRoom(std::vector<int64_t> own, int64_t free_slabs, int64_t slab_units)
    : own_(std::move(own)), free_slabs_(free_slabs), slab_units_(slab_units) {
  KV_CHECK(!own_.empty() && slab_units_ >= 0 && free_slabs_ >= 0, "internal: a KV room of " << own_.size() << " formats, "
                                                                       << free_slabs_ << " slabs of " << slab_units_ << " units");
}

int64_t KvRoom::slabs_for(size_t format, int64_t units) const {
  const int64_t beyond = units - own_.at(at(format));
  if (beyond <= 0) return 0;
  if (slab_units_ == 0) return -1;
  return (beyond + slab_units_ - 1) / slab_units_;
}

bool KvRoom::fits(size_t format, int64_t units) const {
  const int64_t n = slabs_for(format, units);
  return n >= 0 && n <= free_slabs_;
}

bool KvRoom::fits(const std::vector<int64_t>& units) const {
  if (slab_units_ == 0) {
    int64_t sum = 0;
    for (int64_t u : units) sum += u;
    return sum <= own_[0];
  }
  KV_CHECK(units.size() <= own_.size(), "internal: demands of " << units.size() << " KV formats for " << own_.size());
  int64_t slabs = 0;
  for (size_t f = 0; f < units.size(); ++f) {
    const int64_t n = slabs_for(f, units[f]);
    if (n < 0) return false;
    slabs += n;
  }
  return slabs <= free_slabs_;
}

bool KvRoom::draws_slabs(size_t format, int64_t units) const {
  return slab_units_ == 0 || slabs_for(format, units) > 0;
}

void KvRoom::take(size_t format, int64_t units) {
  int64_t& own = own_.at(at(format));
  const int64_t slabs = slabs_for(format, units);
  if (slabs > 0) {
    free_slabs_ -= slabs;
    own += slabs * slab_units_;
  }
  own -= units;
}

void KvRoom::give(size_t format, int64_t units) { own_.at(at(format)) += units; }

}  // namespace kvserve
