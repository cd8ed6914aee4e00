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
// * Prefetch: a job names the bytes it reads (`span`: linear16's weight). The pool learns which span
//   followed which (a decode step calls the same weights in the same order every step), and a
//   helper that finishes its pieces reads ahead up to kPrefetchBytes of the span that came next
//   last time into its cache, while the caller runs the step's small ops between two matmuls. It
//   stops at the next job. A hint is only an address: a stale one (an unloaded model) costs a
//   useless read, never a wrong result.
// * What a piece computes does not depend on which thread runs it: outputs are the same bits.
// * One job at a time: a second caller while one runs (two engines) does its job alone. A process
//   forked after the helpers started has none of them: its callers work alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wcodec {

class CpuPool {
 public:
  static constexpr int64_t kSpinNs = 2'000'000;   // a helper's spin after its last piece (WCODEC_CPU_SPIN_US)
  static constexpr int kYieldEvery = 256;         // pause iterations between sched_yield()s while spinning
  static constexpr int64_t kPrefetchBytes = 4 << 20;   // read ahead of the next job (WCODEC_CPU_READ_AHEAD)
  static constexpr size_t kMaxHints = 1 << 14;    // learned successors kept (then forgotten, relearned)

  struct Span {
    const char* data = nullptr;
    int64_t bytes = 0;
  };

  // the process's pool: `helpers` threads, started at the first call (never stopped; leaked at exit)
  static CpuPool& instance(int helpers) {
    static CpuPool* pool = new CpuPool(helpers);
    return *pool;
  }

  // fn(c) for every c in [0, chunks), by this thread and whichever helpers join; the job reads `span`
  template <class Fn>
  void run(int64_t chunks, const Fn& fn, Span span) {
    if (helpers_ == 0 || chunks < 2 || getpid() != pid_ || busy_.test_and_set(std::memory_order_acquire)) {
      for (int64_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    body_ = [](const void* f, int64_t c) { (*static_cast<const Fn*>(f))(c); };
    fn_ = &fn;
    chunks_ = chunks;
    ahead_ = learn(span);
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
  explicit CpuPool(int helpers)
      : helpers_(helpers < 0 ? 0 : helpers), pid_(getpid()), spin_ns_(setting("WCODEC_CPU_SPIN_US", kSpinNs / 1000) * 1000),
        read_ahead_(setting("WCODEC_CPU_READ_AHEAD", kPrefetchBytes)) {
    for (int i = 0; i < helpers_; ++i) std::thread([this] { helper(); }).detach();
  }

  static int64_t setting(const char* name, int64_t fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::max<int64_t>(0, std::atoll(v)) : fallback;
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

  // the span that followed `span` last time (read ahead after this job); `span` follows the last job's
  Span learn(Span span) {
    if (hints_.size() >= kMaxHints) hints_.clear();
    if (last_) hints_[last_] = span;
    last_ = span.data;
    const auto it = hints_.find(span.data);
    return it == hints_.end() ? Span{} : it->second;
  }

  // reads `span` (up to read_ahead_ bytes) a cache line at a time into this core's caches, until a job opens
  void read_ahead(Span span, uint64_t seen) const {
    const int64_t bytes = std::min<int64_t>(span.bytes, read_ahead_);
    for (int64_t at = 0; at < bytes; at += 64) {
      if (at % 4096 == 0 && open_job(seen)) return;
#if defined(__x86_64__)
      _mm_prefetch(span.data + at, _MM_HINT_T1);
#endif
    }
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
        const Span ahead = ahead_;
        active_.fetch_sub(1, std::memory_order_seq_cst);
        seen = gen;
        read_ahead(ahead, seen);
        idle_since = now_ns();
        continue;
      }
      pause();
      if (spins % kYieldEvery) continue;
      if (now_ns() - idle_since > spin_ns_) {
        sleep_until_a_job(seen);
        idle_since = now_ns();
      } else {
        sched_yield();
      }
    }
  }

  const int helpers_;
  const pid_t pid_;
  const int64_t spin_ns_, read_ahead_;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;     // a caller owns the job slot
  std::atomic<uint64_t> gen_{0};                 // odd while a job is open
  std::atomic<int64_t> next_{0};                 // the next unclaimed piece
  std::atomic<int> active_{0};                   // helpers inside the open job
  std::atomic<int> sleeping_{0};                 // helpers waiting on wake_
  int64_t chunks_ = 0;
  Span ahead_;                                   // the open job's successor last time
  const char* last_ = nullptr;                   // the last job's span (callers own busy_ while they learn)
  std::unordered_map<const char*, Span> hints_;
  void (*body_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace wcodec
