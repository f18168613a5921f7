// gdngen.metal_sim runtime: runs the threads of a Metal compute dispatch on the CPU.
//
// Every Metal thread is a fiber. The fibers of one threadgroup run on one OS thread (a worker);
// workers run different threadgroups at once. `threadgroup` variables live in the worker's
// arena (msl_rt_threadgroup_var): every thread of the threadgroup gets the same address, the
// arena is poisoned with 0xFF (NaN) before each threadgroup, and each variable is followed by a
// red zone that is checked after each threadgroup (out-of-bounds threadgroup writes).
// A fiber runs until it blocks in threadgroup_barrier or a SIMD-group function; the barrier is
// released when every thread of the threadgroup has arrived (every lane of the SIMD-group for
// SIMD functions). When nothing can run but threads still wait, the dispatch fails ("barrier not
// reached by every thread") instead of hanging.
//
// Device buffers come from `msl_rt_buffer_alloc`: the data ends 16-byte aligned just below a
// 4 MiB PROT_NONE guard zone and another guard zone sits below the page it starts in; the
// slack between the guards and the data is filled with 0xFF and checked after the launch. An
// access that hits a guard zone is caught (SIGSEGV handler + siglongjmp) and reported with the
// buffer's name; inputs are mapped read-only during a launch, so writes to them are caught too.
//
// Built once per source hash by gdngen.metal_sim and loaded with ctypes; kernels link to it.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <pthread.h>
#include <random>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include "runtime.h"

namespace {

constexpr int kBlocked = 0, kRunnable = 1, kDone = 2;
constexpr int kSlotBytes = MSL_RT_SLOT_BYTES;
constexpr size_t kGuardBytes = size_t(4) << 20;  // accesses this far outside a buffer are caught
constexpr size_t kArenaBytes = size_t(1) << 20;  // threadgroup arena per worker
constexpr size_t kRedZone = 64;                  // poisoned bytes after every threadgroup variable

struct TgVar {
  size_t offset = 0, bytes = 0;
  const char* name = nullptr;  // nullptr: not placed yet
};

struct Fiber {
  msl_rt_thread info;
  int state = kDone;
  const char* wait_what = nullptr;  // "threadgroup_barrier" or a SIMD function name
  const char* wait_file = nullptr;
  int wait_line = 0;
  unsigned char* stack = nullptr;  // mapping base (guard page first)
  size_t stack_bytes = 0;
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

struct SimdGroup {
  int lanes = 0;        // lanes that exist in this SIMD-group
  int arrived = 0;
  unsigned gen = 0;
  const char* what = nullptr;
  const char* file = nullptr;
  int line = 0;
  alignas(64) unsigned char slots[2][32][kSlotBytes];
  alignas(64) unsigned char results[2][32][kSlotBytes];
};

struct Launch;

struct Worker {
  Launch* launch = nullptr;
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simd;
  std::vector<int> queue;  // ring buffer of runnable fiber ids
  size_t q_head = 0, q_len = 0;
  Fiber* current = nullptr;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc;
#endif
  int threads = 0;          // threads in the current threadgroup
  int done = 0;
  int barrier_arrived = 0;
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  bool failed = false;
  char error[1024] = {0};
  sigjmp_buf fault_jump;
  void* altstack = nullptr;
  unsigned char* arena = nullptr;  // threadgroup memory (kArenaBytes, then a guard page)
  size_t arena_used = 0;           // end of the last placed variable's red zone
  size_t tg_bytes = 0;             // sum of the variables' sizes
  std::vector<TgVar> vars;         // by declaration id
  std::mt19937_64 rng;
};

struct Launch {
  const msl_rt_launch_desc* desc = nullptr;
  std::atomic<uint64_t> next_group{0};
  std::atomic<bool> stop{false};
  uint64_t groups = 0;
  uint32_t groups_per[3] = {1, 1, 1};
  std::mutex error_mutex;
  char error[2048] = {0};
  size_t tg_bytes = 0;
};

thread_local Worker* tl_worker = nullptr;

// ------------------------------------------------------------------------- guarded buffers

struct Buffer {
  unsigned char* base = nullptr;  // mapping start (front guard page)
  size_t map_bytes = 0;
  unsigned char* data = nullptr;
  size_t nbytes = 0;
  unsigned char* data_pages = nullptr;  // first page holding data (after the front guard)
  size_t data_pages_bytes = 0;
  unsigned char* back_guard = nullptr;
  const char* name = "?";
  bool readonly = false;
  bool live = false;
};

std::mutex g_buffers_mutex;
std::vector<Buffer> g_buffers;  // index = handle
std::mutex g_launch_mutex;

size_t page_size() {
  static size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

void format(char* out, size_t len, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(out, len, fmt, args);
  va_end(args);
}

// ------------------------------------------------------------------------- fault handling

struct sigaction g_old_segv, g_old_bus;
std::atomic<int> g_handler_installed{0};

const char* describe_fault(uintptr_t addr, char* out, size_t len) {
  const msl_rt_launch_desc* desc = tl_worker && tl_worker->launch ? tl_worker->launch->desc
                                                                   : nullptr;
  const char* kernel = desc ? desc->kernel_name : "?";
  for (const Buffer& b : g_buffers) {
    if (!b.live) continue;
    uintptr_t lo = reinterpret_cast<uintptr_t>(b.base);
    uintptr_t hi = lo + b.map_bytes;
    if (addr < lo || addr >= hi) continue;
    intptr_t offset = static_cast<intptr_t>(addr - reinterpret_cast<uintptr_t>(b.data));
    bool in_data = offset >= 0 && static_cast<size_t>(offset) < b.nbytes;
    if (in_data && b.readonly) {
      format(out, len, "kernel %s wrote to input buffer '%s' (byte offset %lld)", kernel,
             b.name, static_cast<long long>(offset));
    } else {
      format(out, len,
             "kernel %s accessed buffer '%s' out of bounds: byte offset %lld, buffer size %zu "
             "bytes", kernel, b.name, static_cast<long long>(offset), b.nbytes);
    }
    return out;
  }
  if (tl_worker && tl_worker->arena) {
    uintptr_t end = reinterpret_cast<uintptr_t>(tl_worker->arena) + kArenaBytes;
    if (addr >= end && addr < end + page_size()) {
      format(out, len, "kernel %s accessed threadgroup memory past the end of its arena", kernel);
      return out;
    }
  }
  if (tl_worker) {
    for (const Fiber& f : tl_worker->fibers) {
      uintptr_t lo = reinterpret_cast<uintptr_t>(f.stack);
      if (f.stack && addr >= lo && addr < lo + page_size()) {
        format(out, len, "kernel %s: thread %u overflowed its %zu-byte stack (thread memory)",
               kernel, f.info.thread_index_in_threadgroup, f.stack_bytes - page_size());
        return out;
      }
    }
  }
  return nullptr;
}

void on_fault(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tl_worker;
  if (w && w->launch) {
    char msg[512];
    if (describe_fault(reinterpret_cast<uintptr_t>(info->si_addr), msg, sizeof msg)) {
      std::memcpy(w->error, msg, sizeof msg);
      w->failed = true;
      siglongjmp(w->fault_jump, 1);
    }
  }
  // Not ours: restore the previous handler and let the fault happen again under it.
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  (void)sig;
  (void)uctx;
}

void install_handler() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
}

void restore_handler() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
}

// ------------------------------------------------------------------------- fibers

[[noreturn]] void fiber_main();

#if defined(__x86_64__)
extern "C" void msl_rt_ctx_switch(void** save_sp, void* next_sp);
asm(R"(
.text
.p2align 4
.globl msl_rt_ctx_switch
.hidden msl_rt_ctx_switch
.type msl_rt_ctx_switch,@function
msl_rt_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size msl_rt_ctx_switch,.-msl_rt_ctx_switch
)");

void fiber_init(Worker*, Fiber* f) {
  uintptr_t top = reinterpret_cast<uintptr_t>(f->stack + f->stack_bytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  uint16_t cw;
  asm volatile("fnstcw %0" : "=m"(cw));
  csr[1] = cw;
  std::memcpy(sp, csr, 8);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;  // r15 r14 r13 r12 rbx rbp
  sp[7] = reinterpret_cast<uint64_t>(&fiber_main);
  sp[8] = 0;
  f->sp = sp;
}

inline void switch_to_fiber(Worker* w, Fiber* f) { msl_rt_ctx_switch(&w->sched_sp, f->sp); }
inline void switch_to_scheduler(Worker* w, Fiber* f) { msl_rt_ctx_switch(&f->sp, w->sched_sp); }
inline void switch_between(Fiber* from, Fiber* to) { msl_rt_ctx_switch(&from->sp, to->sp); }
#else
void fiber_trampoline() { fiber_main(); }

void fiber_init(Worker* w, Fiber* f) {
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack + page_size();
  f->uc.uc_stack.ss_size = f->stack_bytes - page_size();
  f->uc.uc_link = &w->sched_uc;
  makecontext(&f->uc, fiber_trampoline, 0);
}

inline void switch_to_fiber(Worker* w, Fiber* f) { swapcontext(&w->sched_uc, &f->uc); }
inline void switch_to_scheduler(Worker* w, Fiber* f) { swapcontext(&f->uc, &w->sched_uc); }
inline void switch_between(Fiber* from, Fiber* to) { swapcontext(&from->uc, &to->uc); }
#endif

void queue_push(Worker* w, int id) {
  size_t cap = w->queue.size();
  w->queue[(w->q_head + w->q_len) % cap] = id;
  ++w->q_len;
}

int queue_pop(Worker* w) {
  if (w->q_len == 0) return -1;
  size_t cap = w->queue.size();
  int schedule = w->launch->desc->schedule;
  size_t pick = 0;
  if (schedule == MSL_RT_SCHEDULE_REVERSE) {
    pick = w->q_len - 1;
  } else if (schedule == MSL_RT_SCHEDULE_RANDOM) {
    pick = static_cast<size_t>(w->rng() % w->q_len);
  } else if (schedule == MSL_RT_SCHEDULE_LOW_FIRST || schedule == MSL_RT_SCHEDULE_HIGH_FIRST) {
    bool low = schedule == MSL_RT_SCHEDULE_LOW_FIRST;
    for (size_t i = 1; i < w->q_len; ++i) {
      int a = w->queue[(w->q_head + i) % cap], b = w->queue[(w->q_head + pick) % cap];
      if (low ? a < b : a > b) pick = i;
    }
  }
  size_t slot = (w->q_head + pick) % cap;
  int id = w->queue[slot];
  if (pick == 0) {
    w->q_head = (w->q_head + 1) % cap;
  } else {
    w->queue[slot] = w->queue[(w->q_head + w->q_len - 1) % cap];  // swap-remove
  }
  --w->q_len;
  return id;
}

// Fail the current threadgroup from inside a fiber: the scheduler stops running it.
[[noreturn]] void fiber_fail(Worker* w) {
  w->failed = true;
  Fiber* f = w->current;
  f->state = kBlocked;
  switch_to_scheduler(w, f);
  __builtin_trap();  // never resumed
}

// Leave fiber f (blocked or done): straight to the next runnable fiber, or to the scheduler
// when there is none (it then finishes the threadgroup or reports the deadlock).
void leave_fiber(Worker* w, Fiber* f) {
  int id = queue_pop(w);
  if (id < 0) {
    switch_to_scheduler(w, f);
    return;
  }
  Fiber* next = &w->fibers[id];
  w->current = next;
  switch_between(f, next);
}

[[noreturn]] void fiber_main() {
  Worker* w = tl_worker;
  Fiber* f = w->current;
  w->launch->desc->thread_fn(w->launch->desc->args);
  f->state = kDone;
  ++w->done;
  leave_fiber(w, f);
  __builtin_trap();
}

void block_current(Worker* w, const char* what, const char* file, int line) {
  Fiber* f = w->current;
  f->state = kBlocked;
  f->wait_what = what;
  f->wait_file = file;
  f->wait_line = line;
  leave_fiber(w, f);
}

void describe_deadlock(Worker* w) {
  // Group the stuck threads by where they wait; finished threads are counted too.
  char* out = w->error;
  size_t len = sizeof w->error;
  const msl_rt_thread& t0 = w->fibers[0].info;
  int n = snprintf(out, len,
                   "kernel %s, threadgroup (%u,%u,%u): barrier not reached by every thread "
                   "(%d of %d threads finished):",
                   w->launch->desc->kernel_name, t0.threadgroup_position_in_grid[0],
                   t0.threadgroup_position_in_grid[1], t0.threadgroup_position_in_grid[2],
                   w->done, w->threads);
  int reported = 0;
  for (int i = 0; i < w->threads && n < static_cast<int>(len) - 100 && reported < 6; ++i) {
    const Fiber& f = w->fibers[i];
    if (f.state != kBlocked) continue;
    bool first = true;
    for (int j = 0; j < i; ++j) {
      const Fiber& g = w->fibers[j];
      if (g.state == kBlocked && g.wait_line == f.wait_line && g.wait_what == f.wait_what) {
        first = false;
        break;
      }
    }
    if (!first) continue;
    int count = 0;
    for (int j = 0; j < w->threads; ++j) {
      const Fiber& g = w->fibers[j];
      if (g.state == kBlocked && g.wait_line == f.wait_line && g.wait_what == f.wait_what) {
        ++count;
      }
    }
    n += snprintf(out + n, len - n, " %d thread(s) wait in %s at line %d (e.g. thread %u);",
                  count, f.wait_what, f.wait_line, f.info.thread_index_in_threadgroup);
    ++reported;
  }
}

// ------------------------------------------------------------------------- threadgroup arena

// After a threadgroup: every red zone (one before the first variable, one after each) must
// still hold the poison.
bool check_red_zones(Worker* w) {
  std::vector<const TgVar*> placed;
  for (const TgVar& v : w->vars) {
    if (v.name) placed.push_back(&v);
  }
  if (placed.empty()) return true;
  std::sort(placed.begin(), placed.end(),
            [](const TgVar* a, const TgVar* b) { return a->offset < b->offset; });
  for (size_t k = 0; k <= placed.size(); ++k) {
    size_t zone = k == 0 ? 0 : placed[k - 1]->offset + placed[k - 1]->bytes;
    for (size_t i = 0; i < kRedZone; ++i) {
      if (w->arena[zone + i] == 0xFF) continue;
      const char* kernel = w->launch->desc->kernel_name;
      if (k == 0) {
        format(w->error, sizeof w->error, "kernel %s wrote before the start of threadgroup "
               "variable '%s'", kernel, placed[0]->name);
      } else {
        const TgVar* v = placed[k - 1];
        format(w->error, sizeof w->error,
               "kernel %s wrote past the end of threadgroup variable '%s' (%zu bytes): byte %zu "
               "after it%s%s%s", kernel, v->name, v->bytes, i,
               k < placed.size() ? " (or before the start of '" : "",
               k < placed.size() ? placed[k]->name : "", k < placed.size() ? "')" : "");
      }
      return false;
    }
  }
  return true;
}

// ------------------------------------------------------------------------- threadgroups

void run_threadgroup(Worker* w, uint64_t group) {
  const msl_rt_launch_desc* d = w->launch->desc;
  const uint32_t* gp = w->launch->groups_per;
  uint32_t tgpos[3] = {static_cast<uint32_t>(group % gp[0]),
                       static_cast<uint32_t>((group / gp[0]) % gp[1]),
                       static_cast<uint32_t>(group / (uint64_t(gp[0]) * gp[1]))};
  uint32_t size[3];
  for (int a = 0; a < 3; ++a) {
    uint32_t origin = tgpos[a] * d->threadgroup[a];
    size[a] = d->grid[a] - origin < d->threadgroup[a] ? d->grid[a] - origin : d->threadgroup[a];
  }
  int n = static_cast<int>(size[0] * size[1] * size[2]);
  int simdgroups = (n + 31) / 32;
  w->threads = n;
  w->done = 0;
  w->barrier_arrived = 0;
  w->barrier_file = nullptr;
  w->q_head = 0;
  w->q_len = 0;
  std::memset(w->arena, 0xFF, w->arena_used);  // poison: never-written reads give NaN
  for (int s = 0; s < simdgroups; ++s) {
    SimdGroup& sg = w->simd[s];
    sg.lanes = n - 32 * s < 32 ? n - 32 * s : 32;
    sg.arrived = 0;
    sg.gen = 0;
    sg.what = nullptr;
  }
  for (int i = 0; i < n; ++i) {
    Fiber& f = w->fibers[i];
    msl_rt_thread& t = f.info;
    uint32_t x = static_cast<uint32_t>(i) % size[0];
    uint32_t y = (static_cast<uint32_t>(i) / size[0]) % size[1];
    uint32_t z = static_cast<uint32_t>(i) / (size[0] * size[1]);
    uint32_t local[3] = {x, y, z};
    for (int a = 0; a < 3; ++a) {
      t.thread_position_in_threadgroup[a] = local[a];
      t.threadgroup_position_in_grid[a] = tgpos[a];
      t.thread_position_in_grid[a] = tgpos[a] * d->threadgroup[a] + local[a];
      t.threads_per_threadgroup[a] = size[a];
      t.dispatch_threads_per_threadgroup[a] = d->threadgroup[a];
      t.threadgroups_per_grid[a] = gp[a];
      t.threads_per_grid[a] = d->grid[a];
    }
    t.thread_index_in_threadgroup = static_cast<uint32_t>(i);
    t.thread_index_in_simdgroup = static_cast<uint32_t>(i % 32);
    t.simdgroup_index_in_threadgroup = static_cast<uint32_t>(i / 32);
    t.simdgroups_per_threadgroup = static_cast<uint32_t>(simdgroups);
    f.state = kRunnable;
    f.wait_what = nullptr;
    fiber_init(w, &f);
    queue_push(w, i);
  }
  while (!w->failed) {
    int id = queue_pop(w);
    if (id < 0) {
      if (w->done != n) {
        describe_deadlock(w);
        w->failed = true;
      }
      break;
    }
    Fiber* f = &w->fibers[id];
    w->current = f;
    switch_to_fiber(w, f);
    w->current = nullptr;
  }
  if (!w->failed && !check_red_zones(w)) w->failed = true;
}

void release_all_blocked(Worker* w, int first, int count) {
  for (int i = first; i < first + count; ++i) {
    Fiber& f = w->fibers[i];
    if (f.state == kBlocked) {
      f.state = kRunnable;
      queue_push(w, i);
    }
  }
}

void worker_main(Launch* launch, int index) {
  const msl_rt_launch_desc* d = launch->desc;
  Worker w;
  w.launch = launch;
  w.rng.seed(d->seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index));
  tl_worker = &w;
  size_t tg_threads = size_t(d->threadgroup[0]) * d->threadgroup[1] * d->threadgroup[2];
  w.fibers.resize(tg_threads);
  w.simd.resize((tg_threads + 31) / 32);
  w.queue.resize(tg_threads);
  size_t stack_bytes = round_up(d->stack_bytes, page_size()) + page_size();
  bool ok = true;
  for (Fiber& f : w.fibers) {
    void* m = mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) {
      format(w.error, sizeof w.error, "cannot map thread stacks: %s", strerror(errno));
      ok = false;
      break;
    }
    mprotect(m, page_size(), PROT_NONE);  // overflow guard
    f.stack = static_cast<unsigned char*>(m);
    f.stack_bytes = stack_bytes;
  }
  size_t alt_bytes = 1 << 16;
  w.altstack = malloc(alt_bytes);
  stack_t ss;
  ss.ss_sp = w.altstack;
  ss.ss_size = alt_bytes;
  ss.ss_flags = 0;
  stack_t old_ss;
  sigaltstack(&ss, &old_ss);
  if (ok) {
    void* m = mmap(nullptr, kArenaBytes + page_size(), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      format(w.error, sizeof w.error, "cannot map threadgroup memory: %s", strerror(errno));
      ok = false;
    } else {
      w.arena = static_cast<unsigned char*>(m);
      mprotect(w.arena + kArenaBytes, page_size(), PROT_NONE);
    }
  }
  if (ok) {
    if (sigsetjmp(w.fault_jump, 1) == 0) {
      while (!launch->stop.load(std::memory_order_relaxed)) {
        uint64_t g = launch->next_group.fetch_add(1);
        if (g >= launch->groups) break;
        run_threadgroup(&w, g);
        if (w.failed) break;
      }
    } else {
      w.failed = true;  // fault: w.error holds the report
    }
    ok = !w.failed;
  }
  if (!ok) {
    launch->stop.store(true);
    std::lock_guard<std::mutex> lock(launch->error_mutex);
    if (!launch->error[0]) std::memcpy(launch->error, w.error, sizeof w.error);
  }
  if (!w.failed && w.tg_bytes > launch->tg_bytes) {
    std::lock_guard<std::mutex> lock(launch->error_mutex);
    launch->tg_bytes = w.tg_bytes;
  }
  sigaltstack(&old_ss, nullptr);
  free(w.altstack);
  if (w.arena) munmap(w.arena, kArenaBytes + page_size());
  for (Fiber& f : w.fibers) {
    if (f.stack) munmap(f.stack, f.stack_bytes);
  }
  tl_worker = nullptr;
}

}  // namespace

// ------------------------------------------------------------------------- C API

extern "C" {

msl_rt_thread* msl_rt_self(void) { return &tl_worker->current->info; }

void msl_rt_fail(const char* message) {
  Worker* w = tl_worker;
  const msl_rt_thread& t = w->current->info;
  format(w->error, sizeof w->error, "kernel %s, thread %u of threadgroup (%u,%u,%u): %s",
         w->launch->desc->kernel_name, t.thread_index_in_threadgroup,
         t.threadgroup_position_in_grid[0], t.threadgroup_position_in_grid[1],
         t.threadgroup_position_in_grid[2], message);
  fiber_fail(w);
}

void msl_rt_threadgroup_barrier(const char* file, int line) {
  Worker* w = tl_worker;
  if (w->barrier_arrived == 0) {
    w->barrier_file = file;
    w->barrier_line = line;
  } else if (w->barrier_line != line || w->barrier_file != file) {
    char msg[256];
    format(msg, sizeof msg,
           "divergent threadgroup_barrier: this thread is at line %d while others wait at "
           "line %d", line, w->barrier_line);
    msl_rt_fail(msg);
  }
  if (++w->barrier_arrived == w->threads) {
    w->barrier_arrived = 0;
    release_all_blocked(w, 0, w->threads);
    return;
  }
  block_current(w, "threadgroup_barrier", file, line);
}

const void* msl_rt_simd_exchange(const void* value, int nbytes, const char* what,
                                 const char* file, int line) {
  return msl_rt_simd_combine(value, nbytes, nullptr, what, file, line);
}

const void* msl_rt_simd_combine(const void* value, int nbytes,
                                void (*combine)(const unsigned char*, int, unsigned char*),
                                const char* what, const char* file, int line) {
  Worker* w = tl_worker;
  Fiber* f = w->current;
  int lane = static_cast<int>(f->info.thread_index_in_simdgroup);
  SimdGroup& sg = w->simd[f->info.simdgroup_index_in_threadgroup];
  if (nbytes > kSlotBytes) msl_rt_fail("SIMD-group exchange larger than the simulator slot");
  if (sg.arrived == 0) {
    sg.what = what;
    sg.file = file;
    sg.line = line;
  } else if (sg.what != what || sg.line != line || sg.file != file) {
    char msg[256];
    format(msg, sizeof msg,
           "divergent SIMD-group function: lane %d calls %s at line %d while other lanes wait "
           "in %s at line %d (the simulator needs every lane of the SIMD-group)", lane, what,
           line, sg.what, sg.line);
    msl_rt_fail(msg);
  }
  unsigned gen = sg.gen;
  std::memcpy(sg.slots[gen & 1][lane], value, static_cast<size_t>(nbytes));
  if (++sg.arrived == sg.lanes) {
    if (combine) combine(&sg.slots[gen & 1][0][0], sg.lanes, &sg.results[gen & 1][0][0]);
    sg.arrived = 0;
    ++sg.gen;
    int first = static_cast<int>(f->info.simdgroup_index_in_threadgroup) * 32;
    release_all_blocked(w, first, sg.lanes);
  } else {
    block_current(w, what, file, line);
  }
  return combine ? static_cast<const void*>(sg.results[gen & 1][lane]) : sg.slots[gen & 1];
}

void* msl_rt_threadgroup_var(size_t bytes, size_t align, int id, const char* name) {
  Worker* w = tl_worker;
  if (id < 0) msl_rt_fail("bad threadgroup variable id");
  if (static_cast<size_t>(id) >= w->vars.size()) w->vars.resize(static_cast<size_t>(id) + 1);
  TgVar& v = w->vars[static_cast<size_t>(id)];
  if (!v.name) {  // first use in this launch: place it after the previous red zone
    if (align < 16) align = 16;
    size_t offset = round_up(w->arena_used < kRedZone ? kRedZone : w->arena_used, align);
    if (offset + bytes + kRedZone > kArenaBytes) {
      msl_rt_fail("threadgroup variables exceed the simulator's 1 MiB arena");
    }
    v.offset = offset;
    v.bytes = bytes;
    v.name = name;
    w->tg_bytes += bytes;
    std::memset(w->arena + w->arena_used, 0xFF, offset + bytes + kRedZone - w->arena_used);
    w->arena_used = offset + bytes + kRedZone;
  } else if (v.bytes != bytes) {
    msl_rt_fail("a threadgroup variable changed size within a launch");
  }
  return w->arena + v.offset;
}

int msl_rt_simd_lanes(void) {
  Worker* w = tl_worker;
  return w->simd[w->current->info.simdgroup_index_in_threadgroup].lanes;
}

int msl_rt_buffer_alloc(size_t nbytes, const char* name, int readonly, void** data) {
  size_t page = kGuardBytes;  // guard zones: inaccessible, cost address space only
  size_t data_span = round_up(nbytes + 15, page_size());  // pages that hold the data (+ slack)
  size_t map_bytes = data_span + 2 * page;
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                 0);
  if (m == MAP_FAILED) return -1;
  auto* base = static_cast<unsigned char*>(m);
  Buffer b;
  b.base = base;
  b.map_bytes = map_bytes;
  b.data_pages = base + page;
  b.data_pages_bytes = data_span;
  b.back_guard = base + page + data_span;
  uintptr_t end = reinterpret_cast<uintptr_t>(b.back_guard);
  b.data = reinterpret_cast<unsigned char*>((end - nbytes) & ~uintptr_t(15));
  b.nbytes = nbytes;
  b.name = strdup(name ? name : "?");
  b.readonly = readonly != 0;
  b.live = true;
  std::memset(b.data_pages, 0xFF, data_span);
  mprotect(base, page, PROT_NONE);
  mprotect(b.back_guard, page, PROT_NONE);
  madvise(base, page, MADV_DONTNEED);
  *data = b.data;
  std::lock_guard<std::mutex> lock(g_buffers_mutex);
  for (size_t i = 0; i < g_buffers.size(); ++i) {
    if (!g_buffers[i].live) {
      g_buffers[i] = b;
      return static_cast<int>(i);
    }
  }
  g_buffers.push_back(b);
  return static_cast<int>(g_buffers.size() - 1);
}

void msl_rt_buffer_free(int handle) {
  std::lock_guard<std::mutex> lock(g_buffers_mutex);
  Buffer& b = g_buffers[static_cast<size_t>(handle)];
  if (!b.live) return;
  munmap(b.base, b.map_bytes);
  free(const_cast<char*>(b.name));
  b.live = false;
}

// Bytes in the slack around the data that are no longer 0xFF (written out of bounds).
long long msl_rt_buffer_slack_damage(int handle) {
  const Buffer& b = g_buffers[static_cast<size_t>(handle)];
  long long damaged = 0;
  for (unsigned char* p = b.data_pages; p < b.data; ++p) damaged += *p != 0xFF;
  for (unsigned char* p = b.data + b.nbytes; p < b.back_guard; ++p) damaged += *p != 0xFF;
  return damaged;
}

int msl_rt_launch(const msl_rt_launch_desc* desc, char* error, size_t error_len,
                  size_t* threadgroup_bytes) {
  std::lock_guard<std::mutex> serial(g_launch_mutex);
  Launch launch;
  launch.desc = desc;
  for (int a = 0; a < 3; ++a) {
    if (desc->grid[a] == 0 || desc->threadgroup[a] == 0) {
      format(error, error_len, "kernel %s: grid and threadgroup sizes must be positive",
             desc->kernel_name);
      return 1;
    }
    launch.groups_per[a] = (desc->grid[a] + desc->threadgroup[a] - 1) / desc->threadgroup[a];
  }
  launch.groups = uint64_t(launch.groups_per[0]) * launch.groups_per[1] * launch.groups_per[2];
  for (const Buffer& b : g_buffers) {
    if (b.live && b.readonly) mprotect(b.data_pages, b.data_pages_bytes, PROT_READ);
  }
  install_handler();
  int workers = desc->workers < 1 ? 1 : desc->workers;
  if (static_cast<uint64_t>(workers) > launch.groups) workers = static_cast<int>(launch.groups);
  std::vector<std::thread> threads;
  for (int i = 1; i < workers; ++i) threads.emplace_back(worker_main, &launch, i);
  worker_main(&launch, 0);
  for (auto& t : threads) t.join();
  restore_handler();
  for (const Buffer& b : g_buffers) {
    if (b.live && b.readonly) mprotect(b.data_pages, b.data_pages_bytes, PROT_READ | PROT_WRITE);
  }
  if (threadgroup_bytes) *threadgroup_bytes = launch.tg_bytes;
  if (!launch.error[0] && desc->threadgroup_memory_limit &&
      launch.tg_bytes > desc->threadgroup_memory_limit) {
    format(error, error_len, "kernel %s declares %zu bytes of threadgroup memory, over the "
           "%zu-byte limit", desc->kernel_name, launch.tg_bytes,
           static_cast<size_t>(desc->threadgroup_memory_limit));
    return 1;
  }
  if (launch.error[0]) {
    format(error, error_len, "%s", launch.error);
    return 1;
  }
  return 0;
}

}  // extern "C"
