// C ABI between gdngen.metal_sim's runtime (runtime.cpp), the MSL shim (metal_shim.h) and the
// Python launcher (gdngen/metal_sim/launch.py mirrors these structs with ctypes).
#pragma once

#include <stddef.h>
#include <stdint.h>

#define MSL_RT_SLOT_BYTES 64
#define MSL_RT_SCHEDULE_FORWARD 0
#define MSL_RT_SCHEDULE_REVERSE 1
#define MSL_RT_SCHEDULE_RANDOM 2
#define MSL_RT_SCHEDULE_LOW_FIRST 3   // lowest runnable thread: simdgroup 0 runs ahead
#define MSL_RT_SCHEDULE_HIGH_FIRST 4  // highest runnable thread: the last simdgroup runs ahead

#ifdef __cplusplus
extern "C" {
#endif

// Position attributes of one simulated Metal thread.
typedef struct msl_rt_thread {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
} msl_rt_thread;

typedef struct msl_rt_launch_desc {
  void (*thread_fn)(void* const* args);  // runs the kernel for msl_rt_self()
  void* const* args;                     // one pointer per kernel parameter buffer
  uint32_t grid[3];                      // threads, as mx.fast.metal_kernel's grid
  uint32_t threadgroup[3];
  int32_t workers;
  int32_t schedule;  // MSL_RT_SCHEDULE_*
  uint64_t seed;
  uint64_t stack_bytes;
  uint64_t threadgroup_memory_limit;  // 0: unlimited
  const char* kernel_name;
} msl_rt_launch_desc;

msl_rt_thread* msl_rt_self(void);
void msl_rt_fail(const char* message) __attribute__((noreturn));
void msl_rt_threadgroup_barrier(const char* file, int line);
const void* msl_rt_simd_exchange(const void* value, int nbytes, const char* what,
                                 const char* file, int line);
// As msl_rt_simd_exchange, but the last lane to arrive calls combine(slots, lanes, results)
// once for the whole SIMD-group (slots: MSL_RT_SLOT_BYTES per lane; results: as many per lane);
// returns this lane's result slot.
const void* msl_rt_simd_combine(const void* value, int nbytes,
                                void (*combine)(const unsigned char* slots, int lanes,
                                                unsigned char* results),
                                const char* what, const char* file, int line);
int msl_rt_simd_lanes(void);
// Storage of threadgroup variable `id` (the same address for every thread of the threadgroup).
void* msl_rt_threadgroup_var(size_t bytes, size_t align, int id, const char* name);

int msl_rt_buffer_alloc(size_t nbytes, const char* name, int readonly, void** data);
void msl_rt_buffer_free(int handle);
long long msl_rt_buffer_slack_damage(int handle);
int msl_rt_launch(const msl_rt_launch_desc* desc, char* error, size_t error_len,
                  size_t* threadgroup_bytes);

#ifdef __cplusplus
}
#endif
