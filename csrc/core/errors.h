// Exception types of the native core, one per Python exception they become.
//
// The core throws standard C++ exceptions so that it builds and tests without
// Python; the bindings map them (python/module.cpp):
//   DTypeError            -> TypeError     (wrong element type)
//   std::invalid_argument -> ValueError    (wrong shape, device, index, name)
//   std::out_of_range     -> IndexError / KeyError where pybind11 maps them
//   ArenaOverflowError    -> ortspec._native.ArenaOverflowError (a RuntimeError)
//   std::runtime_error    -> RuntimeError  (CUDA failures, no device, stale buffers)
#pragma once

#include <stdexcept>
#include <string>

namespace ortspec {

// A tensor has the wrong element type for the operation.
class DTypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A StepScopedArena cannot fit a requested block.
class ArenaOverflowError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace ortspec
