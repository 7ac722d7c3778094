// Activation buffers that skip value-initialisation: every element is written before it is
// read, and zero-filling a multi-hundred-megabyte buffer first would be a whole extra pass over
// memory (it would dominate the dispatch kernels it exists for).
#pragma once

#include <memory>
#include <new>
#include <vector>

namespace rs::train {

template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// resize() leaves new elements uninitialised; assign(n, v) and Buffer(n, v) still fill.
template <typename T>
using Buffer = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace rs::train
