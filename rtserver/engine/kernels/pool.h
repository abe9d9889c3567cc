// The kernel's own worker threads: every parallel loop of a step runs on the thread that owns the pool
// (the scheduler's) and on workers that stay awake between the loops of a step.
//
// libgomp's workers sleep after a short spin once a process has more threads than CPUs, so a single
// stream paid a wake-up on every loop, and how much depended on what ran before. Here the workers spin
// for `kSpin` after each loop, then sleep on a condition variable; a step's loops follow each other
// well inside the spin. A loop started on any other thread runs there alone, and is counted.
//
// A loop is cut into a few chunks per thread that every thread claims as it comes. On a busy machine a
// worker may not run for a whole time slice; the owner then takes its chunks instead of waiting for it.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <sched.h>
#include <thread>
#include <vector>

namespace pool {

class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: workers may outlive static destructors
    return *p;
  }

  // The calling thread owns the pool from now on, with `threads` threads in all (itself included).
  void bind(int threads) {
    std::lock_guard<std::mutex> running(job_lock_);
    resize(std::max(1, threads));
    owner_.store(std::this_thread::get_id());
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  int64_t loops() const { return loops_.load(); }
  int64_t off_owner() const { return off_owner_.load(); }

  // f(b0, b1) over [begin, end) in chunks of at least `grain`, as at::parallel_for splits them.
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return;
    const auto me = std::this_thread::get_id();
    if (owner_.load() == std::thread::id()) bind(at::get_num_threads());  // used before any bind: the first caller owns it
    if (in_loop_ || me != owner_.load() || workers_.empty() || end - begin <= grain) {
      if (!in_loop_ && me != owner_.load() && end - begin > grain) off_owner_.fetch_add(1);
      f(begin, end);
      return;
    }
    std::lock_guard<std::mutex> running(job_lock_);
    const int64_t n = end - begin;
    const int64_t chunk = std::max(grain, (n + kChunksPerThread * threads() - 1) / (kChunksPerThread * threads()));
    const int64_t chunks = (n + chunk - 1) / chunk;
    const uint64_t gen = generation_.load() + 1;
    job_[gen & 1] = Job{&call<F>, &f, begin, end, chunk};
    error_ = nullptr;
    loops_.fetch_add(1);
    left_.store(chunks);
    claims_.store(gen << kIndexBits | 0, std::memory_order_release);  // chunks counted from 0 here
    limit_.store(chunks, std::memory_order_release);
    generation_.store(gen, std::memory_order_release);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lk(sleep_lock_);
      wake_.notify_all();
    }
    run_chunks(gen);
    wait_left();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kSpin = std::chrono::microseconds(2000);
  static constexpr int64_t kChunksPerThread = 4;
  static constexpr int kPausePolls = 4096;  // about a hundred microseconds of spinning, then yields
  static constexpr int kIndexBits = 24;
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;

  struct Job {
    void (*call)(const void*, int64_t, int64_t) = nullptr;
    const void* fn = nullptr;
    int64_t begin = 0, end = 0, chunk = 0;
  };

  template <typename F>
  static void call(const void* fn, int64_t b0, int64_t b1) {
    (*static_cast<const F*>(fn))(b0, b1);
  }

  // Claims chunks of loop `gen` until none are left; a claim names its loop, so a late worker can
  // never take a chunk of the next one.
  void run_chunks(uint64_t gen) {
    const Job& job = job_[gen & 1];
    for (;;) {
      uint64_t c = claims_.load(std::memory_order_acquire);
      const uint64_t index = c & kIndexMask;
      if (c >> kIndexBits != gen || static_cast<int64_t>(index) >= limit_.load(std::memory_order_acquire)) return;
      if (!claims_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      const int64_t b0 = job.begin + static_cast<int64_t>(index) * job.chunk, b1 = std::min(job.end, b0 + job.chunk);
      in_loop_ = true;
      try {
        job.call(job.fn, b0, b1);
      } catch (...) {
        std::lock_guard<std::mutex> lk(sleep_lock_);
        if (!error_) error_ = std::current_exception();
      }
      in_loop_ = false;
      left_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // The owner waits only for chunks a worker has claimed and not finished; a worker that lost its core
  // gets the CPU back sooner when the owner yields instead of spinning.
  void wait_left() {
    for (int polls = 0; left_.load(std::memory_order_acquire) > 0; ++polls) {
      if (polls < kPausePolls) _mm_pause();
      else sched_yield();
    }
  }

  // `seen`: the generation when the worker was made; a loop posted before it first runs is still its.
  void work(uint64_t seen) {
    for (;;) {
      const auto spun = Clock::now() + kSpin;
      uint64_t now;
      int polls = 0;
      while ((now = generation_.load(std::memory_order_acquire)) == seen && !stop_.load()) {
        _mm_pause();
        if (++polls % 256 == 0 && Clock::now() > spun) {
          std::unique_lock<std::mutex> lk(sleep_lock_);
          sleeping_.fetch_add(1);
          wake_.wait(lk, [&] { return generation_.load() != seen || stop_.load(); });
          sleeping_.fetch_sub(1);
        }
      }
      if (stop_.load()) return;
      seen = now;
      run_chunks(now);
    }
  }

  // Called with job_lock_ held and no loop running.
  void resize(int threads) {
    if (threads == this->threads()) return;
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lk(sleep_lock_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_.store(false);
    const uint64_t now = generation_.load();
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, now] { work(now); });
  }

  std::vector<std::thread> workers_;
  std::atomic<std::thread::id> owner_{};
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> claims_{0};  // the loop's generation, then the next chunk's index
  std::atomic<int64_t> limit_{0}, left_{0};  // the loop's chunks; those not yet finished
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> loops_{0}, off_owner_{0};
  std::mutex job_lock_, sleep_lock_;
  std::condition_variable wake_;
  Job job_[2];  // by generation parity: a loop is written while the last one's slot may still be read
  std::exception_ptr error_;
  static inline thread_local bool in_loop_ = false;
};

// at::parallel_for's shape, on the pool.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool::get().parallel_for(begin, end, grain, f);
}

inline int num_threads() { return Pool::get().threads(); }

}  // namespace pool
