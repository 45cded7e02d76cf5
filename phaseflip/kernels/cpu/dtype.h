// The dtypes the CPU kernels are written for (float32, bfloat16), and the one branch from a tensor's
// dtype to the C++ type a kernel is instantiated for.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

namespace dtype {

// fn(T()) with T the element type of dt (float32: float, bfloat16: c10::BFloat16); any other dtype an
// error naming the op, the dtype it got and those it takes
template <typename Fn>
decltype(auto) dispatch(const char* op, at::ScalarType dt, Fn&& fn) {
  if (dt == at::kFloat) return fn(float());
  TORCH_CHECK(dt == at::kBFloat16, op, ": float32 or bfloat16, got ", dt);
  return fn(c10::BFloat16());
}

}  // namespace dtype
