#pragma once
// Marks a decode step on this thread (its layers and LM head, plain, draft or verify): inside it a
// linear layer picks its kernel by what the step is, not by how many rows it has, so that a row's
// output does not depend on how many other rows share the step. That is what makes a verify step's
// rows equal the plain steps' bit for bit, and a sequence's tokens the same in any batch.

namespace kvserve {

class DecodeScope {
 public:
  DecodeScope();
  ~DecodeScope();
  DecodeScope(const DecodeScope&) = delete;
  DecodeScope& operator=(const DecodeScope&) = delete;
  static bool active();
};

}  // namespace kvserve
