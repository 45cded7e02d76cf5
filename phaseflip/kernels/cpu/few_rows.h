// The rows of x up to which quant.cpp's products on GGUF blocks take the few-rows dots, each weight row
// read once for all of them: FEW_ROWS always, and with int8 x (int8.h's PF_INT8_DOT) up to a per-format
// limit in passes of FEW_ROWS, each pass reading the weights again, before the wide integer tile
// (int8_wide.h), whose unpacking of every group of weight rows costs a fixed share that more rows pay back
// (docs/performance.md). CPUs of one instruction set differ here, so the boot measures its own limits and
// sets them (kernels/cpu/forms.py choose_block_rows); the defaults serve until it does.
#pragma once
#include <atomic>
#include <cstdint>
#include <type_traits>
#include "blocks.h"
#include "int8.h"

namespace few_rows {

constexpr int64_t FEW_ROWS = 8;   // rows of x up to which each weight row is read once for all of them

// The default limit. With AVX512-VNNI (measured on a Zen 4): past 16 rows for the 32-value formats, 24 for
// Q4_K, 48 for Q6_K. AVX2's tile (measured on a Zen 3) pays back sooner: past FEW_ROWS for Q4_0 and Q4_1,
// 12 for Q8_0, 24 for the K formats; Q5's limit was not measured there. A pass's dots compute from the
// blocks at a fraction of the memory's rate, so reading the weights again from DRAM costs no more than
// from L3. Without int8 products: FEW_ROWS.
template <typename B>
constexpr int64_t default_limit() {
#if defined(PF_INT8_DOT) && defined(PF_INT8_VNNI)
  if constexpr (std::is_same_v<B, blocks::Q6_K>) return 48;
  if constexpr (std::is_same_v<B, blocks::Q4_K>) return 24;
  return 16;
#elif defined(PF_INT8_DOT)
  if constexpr (std::is_same_v<B, blocks::Q6_K> || std::is_same_v<B, blocks::Q4_K>) return 24;
  if constexpr (std::is_same_v<B, blocks::Q8_0>) return 12;
  if constexpr (std::is_same_v<B, blocks::Q4_0> || std::is_same_v<B, blocks::Q4_1>) return FEW_ROWS;
  return 16;
#else
  return FEW_ROWS;
#endif
}

// The limits set, by GGML type id (every served format's id is below 16): -1 the default
struct Limits {
  std::atomic<int64_t> rows[16];
  Limits() {
    for (auto& r : rows) r.store(-1);
  }
};
inline Limits limits;

// The limit the products of format B take now
template <typename B>
int64_t few_rows_limit() {
  const int64_t rows = limits.rows[B::id].load(std::memory_order_relaxed);
  return rows >= 0 ? rows : default_limit<B>();
}

// Set the limit of the format with GGML type id `type` (a served one) to `rows`, or -1: its default
inline void set(int64_t type, int64_t rows) { limits.rows[type].store(rows, std::memory_order_relaxed); }

}  // namespace few_rows
