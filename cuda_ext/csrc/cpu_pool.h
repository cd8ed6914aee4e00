// Helper threads for linear16's calls (linear16.cpp), in place of one OpenMP parallel region a call.
//
// Read me first.
// * Why: a decode step at batch 1 is ~120 short matmuls (30-1200 us each on the demo) with Python
//   between them. Under `wcodec serve`'s OMP_WAIT_POLICY=PASSIVE each OpenMP region wakes a sleeping
//   worker and waits for it at the join; under OpenMP's spinning policies the workers hold the cores
//   that the event loop and the clients need, and a region waits for a worker the kernel has
//   descheduled. Either way the caller waits on a thread (docs/BENCHMARKS.md, issue 23).
// * How: the caller works too. A job is `chunks` pieces of work claimed one at a time from an atomic
//   counter by the caller and by any helper that is awake. A helper that is asleep, late or
//   descheduled costs nothing: the caller claims what it has not. The caller waits only for the
//   pieces a helper has claimed (a few microseconds each).
// * A helper spins (pausing, yielding now and then) for kSpinNs after its last piece, so that the
//   matmuls of one step find it awake, then sleeps on a condition variable until a job comes.
// * What a piece computes does not depend on which thread runs it: outputs are the same bits.
// * One job at a time: a second caller while one runs (two engines) does its job alone. A process
//   forked after the helpers started has none of them: its callers work alone.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wcodec {

class CpuPool {
 public:
  static constexpr int64_t kSpinNs = 2'000'000;   // a helper's spin after its last piece (then it sleeps)
  static constexpr int kYieldEvery = 256;         // pause iterations between sched_yield()s while spinning

  // the process's pool: `helpers` threads, started at the first call (never stopped; leaked at exit)
  static CpuPool& instance(int helpers) {
    static CpuPool* pool = new CpuPool(helpers);
    return *pool;
  }

  // fn(c) for every c in [0, chunks), by this thread and whichever helpers join
  template <class Fn>
  void run(int64_t chunks, const Fn& fn) {
    if (helpers_ == 0 || chunks < 2 || getpid() != pid_ || busy_.test_and_set(std::memory_order_acquire)) {
      for (int64_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    body_ = [](const void* f, int64_t c) { (*static_cast<const Fn*>(f))(c); };
    fn_ = &fn;
    chunks_ = chunks;
    next_.store(0, std::memory_order_relaxed);
    const uint64_t gen = gen_.load(std::memory_order_relaxed) + 1;    // odd: a job is open
    gen_.store(gen, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work();
    gen_.store(gen + 1, std::memory_order_seq_cst);                    // even: closed, no helper enters
    while (active_.load(std::memory_order_seq_cst) != 0) pause();     // pieces a helper claimed
    busy_.clear(std::memory_order_release);
  }

 private:
  explicit CpuPool(int helpers) : helpers_(helpers < 0 ? 0 : helpers), pid_(getpid()) {
    for (int i = 0; i < helpers_; ++i) std::thread([this] { helper(); }).detach();
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  void work() {
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) body_(fn_, c);
  }

  // a job's generation once the helper may work on it (enters, then checks it is still open: the
  // caller closes, then checks nobody entered), else 0
  uint64_t enter(uint64_t seen) {
    const uint64_t gen = gen_.load(std::memory_order_seq_cst);
    if (gen % 2 == 0 || gen == seen) return 0;
    active_.fetch_add(1, std::memory_order_seq_cst);
    if (gen_.load(std::memory_order_seq_cst) == gen) return gen;
    active_.fetch_sub(1, std::memory_order_seq_cst);
    return 0;
  }

  bool open_job(uint64_t seen) const {
    const uint64_t gen = gen_.load(std::memory_order_seq_cst);
    return gen % 2 == 1 && gen != seen;
  }

  void sleep_until_a_job(uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    sleeping_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lock, [&] { return open_job(seen); });
    sleeping_.fetch_sub(1, std::memory_order_seq_cst);
  }

  [[noreturn]] void helper() {
    uint64_t seen = 0;
    int64_t idle_since = now_ns();
    for (int spins = 0;; ++spins) {
      if (const uint64_t gen = enter(seen)) {
        work();
        active_.fetch_sub(1, std::memory_order_seq_cst);
        seen = gen;
        idle_since = now_ns();
        continue;
      }
      pause();
      if (spins % kYieldEvery) continue;
      if (now_ns() - idle_since > kSpinNs) {
        sleep_until_a_job(seen);
        idle_since = now_ns();
      } else {
        sched_yield();
      }
    }
  }

  const int helpers_;
  const pid_t pid_;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;     // a caller owns the job slot
  std::atomic<uint64_t> gen_{0};                 // odd while a job is open
  std::atomic<int64_t> next_{0};                 // the next unclaimed piece
  std::atomic<int> active_{0};                   // helpers inside the open job
  std::atomic<int> sleeping_{0};                 // helpers waiting on wake_
  int64_t chunks_ = 0;
  void (*body_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace wcodec
