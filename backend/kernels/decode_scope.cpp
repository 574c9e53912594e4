#include "backend/kernels/decode_scope.h"

namespace kvserve {

namespace {
thread_local int decode_scope_depth = 0;
}  // namespace

DecodeScope::DecodeScope() { ++decode_scope_depth; }
DecodeScope::~DecodeScope() { --decode_scope_depth; }
bool DecodeScope::active() { return decode_scope_depth > 0; }

}  // namespace kvserve
