#pragma once
// ParallelGroups: the process groups one rank of a tensor x pipeline parallel job works with.
#include <memory>

namespace kvserve::parallel {

class ProcessGroup;

struct ParallelGroups {
  std::shared_ptr<ProcessGroup> world;  // every rank, Gloo: control messages
  std::shared_ptr<ProcessGroup> data;   // every rank, the device's backend: activations
  std::shared_ptr<ProcessGroup> tp;     // this stage's tensor-parallel ranks (null without TP)
};

}  // namespace kvserve::parallel
