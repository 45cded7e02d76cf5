// How the CPU kernels spread their work over torch's threads: at::get_num_threads() of them (what
// torch.set_num_threads sets), in one of two shapes.
// - Independent ranges (`ranges`): [0, n) cut into ranges run at once, in no order, all done on return:
//   a product's weight rows, attention's (sequence, kv head) pairs. at::parallel_for: torch's own pool.
// - A region with phases (`region`): every thread runs one function from start to end, each phase's
//   work split by Team::share and a Team::barrier before the next phase reads what the others wrote:
//   the one-token decoder layers (layer.cpp), ~8 phases a layer. As ranges, each phase would fork and
//   join the threads, the main thread dispatching alone between them; at::parallel_for has no barrier.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>
#include <cstdint>

namespace par {

// fn(begin, end) over ranges of [0, n), each at least `grain` long where n allows
template <typename Fn>
inline void ranges(int64_t n, int64_t grain, const Fn& fn) {
  at::parallel_for(0, n, grain, fn);
}

struct Range {
  int64_t begin, end;
};

// This thread's place in a region: its id among `size` threads
struct Team {
  int id, size;
  // its share of n items: equal parts in thread order
  Range share(int64_t n) const { return {n * id / size, n * (id + 1) / size}; }
  // every thread waits here until all have come: what one phase wrote, the next reads
  void barrier() const {
#pragma omp barrier
  }
  // fn() on one thread, the others waiting until it is done
  template <typename Fn>
  void single(const Fn& fn) const {
#pragma omp single
    fn();
  }
};

// fn(team) on every one of torch's threads at once; returns when all are done. fn must not throw (an
// exception cannot leave an OpenMP region): check the inputs before.
template <typename Fn>
inline void region(const Fn& fn) {
#pragma omp parallel num_threads(at::get_num_threads())
  fn(Team{omp_get_thread_num(), omp_get_num_threads()});
}

}  // namespace par
