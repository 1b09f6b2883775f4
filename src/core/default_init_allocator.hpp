// std::allocator, except that a vector's value-less construction default-initialises: for a
// trivially constructible T, std::vector<T, DefaultInitAllocator<T>>::resize(n) leaves the new
// elements unwritten, so that a large buffer's pages are first touched by the threads that fill
// it, not zeroed page by page by one thread beforehand (85 MB of KV rows per GLM-5 prefill
// step-layer). Only for buffers every element of which is written before it is read.
// (Boost.Container's default_init does the same, but public headers of the references layer must
// not include Boost: references/CMakeLists.txt.)
#pragma once

#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace kvaudit {

template <class T>
struct DefaultInitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <class U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}

  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

}  // namespace kvaudit
