// Splitting a leaf's rows over threads for the kernel's FFI calls
// (kernels.cc includes it once, inside its anonymous namespace, after
// FlushDenormals and kGrainElements).
#ifndef OPTAX4BIT_CPU_ROW_SPLITTER_H_
#define OPTAX4BIT_CPU_ROW_SPLITTER_H_

// Process-wide worker threads, started on first use. XLA's intra-op pool
// (ffi::ThreadPool) is busy while a custom call runs on it: tasks scheduled
// there mostly start after the call has finished its rows alone.
class Workers {
 public:
  static Workers& Get() {
    static Workers* workers = new Workers();  // never destroyed: threads outlive main
    return *workers;
  }

  // Runs task(w) for w in [1, n) on worker threads; returns at once.
  void Launch(int64_t n, const std::function<void(int64_t)>& task) {
    std::lock_guard<std::mutex> lock(mu_);
    while ((int64_t)threads_ < n - 1) {
      std::thread([this] { Loop(); }).detach();
      ++threads_;
    }
    for (int64_t w = 1; w < n; ++w) queue_.push_back([task, w] { task(w); });
    cv_.notify_all();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  size_t threads_ = 0;
};

// Splits rows into chunks run by the caller and up to n - 1 worker threads,
// n = the size of XLA's intra-op pool; body(lo, hi, worker) with worker <
// NumWorkers(). The caller waits only for chunks some thread has claimed, so
// a worker that starts late (or never) cannot block it.
class RowSplitter {
 public:
  RowSplitter(ffi::ThreadPool& pool, int64_t rows, int64_t row_size) : rows_(rows) {
    grain_ = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_size, 1));
    chunks_ = (rows + grain_ - 1) / grain_;
    workers_ = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), chunks_));
  }

  int64_t NumWorkers() const { return workers_; }

  template <typename Body>
  void Run(const Body& body) {
    auto shared = std::make_shared<Shared>();
    const int64_t rows = rows_, grain = grain_, chunks = chunks_;
    const Body* body_ptr = &body;
    auto work = [shared, body_ptr, rows, grain, chunks](int64_t worker) {
      FlushDenormals flush;
      for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
        (*body_ptr)(c * grain, std::min(rows, (c + 1) * grain), worker);
        if (shared->done.fetch_add(1) + 1 == chunks) {
          std::lock_guard<std::mutex> lock(shared->mu);
          shared->cv.notify_all();
        }
      }
    };
    if (workers_ > 1) Workers::Get().Launch(workers_, work);
    work(0);
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load() == chunks; });
  }

 private:
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  int64_t rows_, grain_, chunks_, workers_;
};

// Runs rows_fn(args, lo, hi, scratch) over `rows` rows of d values, split over
// the threads, each with scratch_rows * d floats of scratch.
template <typename Args, typename RowsFn>
void RunRows(ffi::ThreadPool& pool, int64_t rows, int64_t d, int64_t scratch_rows,
             const Args& args, RowsFn rows_fn) {
  RowSplitter splitter(pool, rows, d);
  std::vector<std::vector<float>> scratch(splitter.NumWorkers());
  splitter.Run([&](int64_t lo, int64_t hi, int64_t worker) {
    scratch[worker].resize(scratch_rows * d);
    rows_fn(args, lo, hi, scratch[worker].data());
  });
}

#endif  // OPTAX4BIT_CPU_ROW_SPLITTER_H_
