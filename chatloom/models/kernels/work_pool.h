// The kernels' own pool of worker threads, for parallel loops that degrade gracefully when a core is taken.
//
// at::parallel_for (OpenMP underneath) splits a loop evenly between its threads in advance and ends with a
// barrier every thread must reach. When another process takes one of two cores, the thread it displaces
// holds its half of every loop, and the other thread waits at the barrier until the scheduler gives the
// displaced one a turn (milliseconds): a decode step of a few hundred loops then takes 7-20 times as long.
//
// Here a loop is cut into chunks that go to whichever thread asks next from a shared counter, and the
// calling thread takes chunks too: a worker the OS has not scheduled never holds a chunk, so the caller
// runs the loop alone, at the speed of the cores it has. The caller waits only for chunks a worker has
// started. Waiting threads spin for a short while (a loop follows the previous one within microseconds
// in a decode step), then sleep on a futex, so a thread that has nothing to do gives its core to the
// thread that has (ours, descheduled, or the neighbour's) instead of burning it.
//
// Each chunk computes the same outputs whichever thread runs it, so the bits do not depend on the split.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <mutex>
#include <thread>

namespace chatloom_kernels {

namespace pool_detail {

// How long an idle thread spins before it sleeps: several times the gap between two loops of a step.
constexpr int64_t kSpinNs = 50000;
// Chunks per thread: enough that a thread's share is picked up by the others when it is descheduled.
constexpr int64_t kChunksPerThread = 8;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spins until pred() holds or kSpinNs pass; true if it holds.
template <typename Pred>
inline bool spin_until(const Pred& pred) {
  int64_t start = -1;
  for (int i = 1;; ++i) {
    if (pred()) return true;
    _mm_pause();
    if ((i & 255) == 0) {
      const int64_t now = now_ns();
      if (start < 0) start = now;
      else if (now - start > kSpinNs) return false;
    }
  }
}

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = [] {
      auto* p = new Pool();  // never destroyed: detached workers may still read it at exit
      pthread_atfork(nullptr, nullptr, [] { get().after_fork(); });
      return p;
    }();
    return *pool;
  }

  // Runs fn(c) for every chunk c in [0, chunks) on up to `threads` threads, the caller among them.
  // False (nothing run) when another thread is running a loop: the caller then runs it alone.
  template <typename F>
  bool run(int64_t chunks, int threads, const F& fn) {
    std::unique_lock<std::mutex> one_loop_at_a_time(caller_, std::try_to_lock);
    if (!one_loop_at_a_time.owns_lock()) return false;
    ensure_workers(threads - 1);
    call_.store([](const void* f, int64_t c) { (*static_cast<const F*>(f))(c); }, std::memory_order_relaxed);
    fn_.store(&fn, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    active_.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    // A new ticket: the loop's number in the high half, the next chunk in the low half. Its release
    // publishes the fields above to whoever claims a chunk of this loop.
    const uint64_t loop = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(loop << 32, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
    in_loop() = true;
    work(loop);
    in_loop() = false;
    wait_done((uint32_t)chunks);
    return true;
  }

  static bool& in_loop() {
    thread_local bool inside = false;
    return inside;
  }

 private:
  // Claims and runs chunks of loop `loop` until none is left; true if it ran any.
  bool work(uint64_t loop) {
    bool ran = false;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      int64_t c;
      do {
        // A ticket of another loop, or none left: this loop needs nothing more from this thread. A
        // claim succeeds only while the loop is unfinished, so its fields are still this loop's.
        if ((t >> 32) != loop) return ran;
        c = (int64_t)(t & 0xffffffffu);
        if (c >= chunks_.load(std::memory_order_relaxed)) return ran;
      } while (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      call_.load(std::memory_order_relaxed)(fn_.load(std::memory_order_relaxed), c);
      done_.fetch_add(1, std::memory_order_seq_cst);
      ran = true;
    }
  }

  // The caller, after the chunks it could claim: waits for the ones workers are still running.
  void wait_done(uint32_t chunks) {
    const auto all_done = [&] { return done_.load(std::memory_order_acquire) >= chunks; };
    if (spin_until(all_done)) return;
    caller_sleeping_.store(true, std::memory_order_seq_cst);
    for (uint32_t seen; (seen = done_.load(std::memory_order_seq_cst)) < chunks;) done_.wait(seen);
    caller_sleeping_.store(false, std::memory_order_relaxed);
  }

  void worker(int index) {
    in_loop() = true;  // a loop inside a chunk runs serially on its thread
    uint32_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto moved = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(moved)) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (generation_.load(std::memory_order_seq_cst) == seen) generation_.wait(seen);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = generation_.load(std::memory_order_acquire);
      if (index >= active_.load(std::memory_order_relaxed)) continue;
      // The caller sleeps only once it has run out of chunks to claim: wake it after ours.
      if (work(ticket_.load(std::memory_order_acquire) >> 32) && caller_sleeping_.load(std::memory_order_seq_cst))
        done_.notify_all();
    }
  }

  void ensure_workers(int wanted) {
    while (spawned_ < wanted) {
      const int index = spawned_++;
      std::thread([this, index] { worker(index); }).detach();
    }
  }

  void after_fork() {
    // The child has none of the parent's workers; it starts its own when it runs a loop.
    spawned_ = 0;
    sleepers_.store(0);
    new (&caller_) std::mutex();
  }

  std::mutex caller_;  // one loop at a time (the engine runs one step at a time)
  std::atomic<void (*)(const void*, int64_t)> call_{nullptr};
  std::atomic<const void*> fn_{nullptr};
  std::atomic<int64_t> chunks_{0};
  std::atomic<int> active_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint32_t> generation_{0}, done_{0}, sleepers_{0};
  std::atomic<bool> caller_sleeping_{false};
  int spawned_ = 0;
};

// CHATLOOM_RUNTIME__WORK_POOL=0 runs the loops on OpenMP as before (at::parallel_for), for comparisons.
inline bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CHATLOOM_RUNTIME__WORK_POOL");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

}  // namespace pool_detail

// at::parallel_for's contract (fn(b, e) over sub-ranges of [begin, end), each at least `grain` long
// but the last; serial when nested or small), on the pool above: the chunks are handed out as threads
// ask for them, so a thread the OS takes away leaves its share to the others.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (!pool_detail::enabled()) {
    at::parallel_for(begin, end, grain, fn);
    return;
  }
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int threads = (int)std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || omp_in_parallel() || pool_detail::Pool::in_loop()) {
    fn(begin, end);
    return;
  }
  const int64_t chunk = std::max(grain, (n + threads * pool_detail::kChunksPerThread - 1) /
                                            (threads * pool_detail::kChunksPerThread));
  const int64_t chunks = (n + chunk - 1) / chunk;
  const auto one = [&](int64_t c) {
    const int64_t b = begin + c * chunk;
    fn(b, std::min(end, b + chunk));
  };
  if (!pool_detail::Pool::get().run(chunks, threads, one)) fn(begin, end);
}

// parallel_for in chunks of exactly `chunk` items (each chunk its own call).
template <typename F>
inline void parallel_for_dynamic(int64_t n, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = (int)std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || omp_in_parallel() || pool_detail::Pool::in_loop()) {
    fn(0, n);
    return;
  }
  if (!pool_detail::enabled()) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t c = 0; c < chunks; ++c) fn(c * chunk, std::min(n, (c + 1) * chunk));
    return;
  }
  const auto one = [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); };
  if (!pool_detail::Pool::get().run(chunks, threads, one))
    for (int64_t c = 0; c < chunks; ++c) one(c);
}

}  // namespace chatloom_kernels
