#pragma once
// Work items of uneven cost (prefill attention's blocks of query rows: rows near the end of a
// long prompt see the most keys; an MoE expert's rows: routing is uneven; decode attention's
// contexts: short requests beside long ones) run costliest first,
// handed out from a shared counter over the thread team, so no thread is left with the big
// items at the end. Shared by the attention and MoE modules (cpp_build copies it beside each).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// Sorts `items` (each with an int64 `cost`) costliest first (items of equal cost keep their
// order), then runs body(state, item) on every item; each thread makes its `state` once with
// make() (scratch buffers; a struct whose constructor and destructor set up and release
// per-thread hardware state).
template <typename Item, typename Make, typename Body>
inline void costliest_first(std::vector<Item>& items, Make make, Body body) {
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto state = make();
    for (int64_t i = next++; i < n; i = next++) body(state, items[i]);
  });
}
