// Just enough of Metal to run MLX-generated custom kernels on the CPU with g++.
// Threadgroups run one after another on a pool of std::threads (one per
// Metal thread); threadgroup memory becomes function-local statics shared by
// that pool, simd reductions go through per-simdgroup scratch and barriers.
#ifndef DSPARK_METAL_SHIM_H
#define DSPARK_METAL_SHIM_H

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

using uint = unsigned int;

struct uint3 {
  uint x, y, z;
};

using half = _Float16;
using float16_t = _Float16;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      bits = uint16_t(u >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace shim {

constexpr uint kSimdWidth = 32;

struct ThreadState {
  std::barrier<>* group_barrier;
  std::barrier<>* simd_barrier;
  unsigned char* simd_scratch;  // kSimdWidth slots of 16 bytes
  uint lane;
  uint simd_lanes;
};

inline thread_local ThreadState tls;

struct Ids {
  uint3 thread_position_in_grid, thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid, threads_per_threadgroup;
  uint3 threadgroups_per_grid, threads_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup, simdgroups_per_threadgroup;
  uint threads_per_simdgroup, quadgroup_index_in_threadgroup;
};

template <typename T, typename Op>
T simd_reduce(T x, Op op) {
  static_assert(sizeof(T) <= 16);
  auto* slots = tls.simd_scratch;
  std::memcpy(slots + 16 * tls.lane, &x, sizeof(T));
  tls.simd_barrier->arrive_and_wait();
  T r;
  std::memcpy(&r, slots, sizeof(T));
  for (uint i = 1; i < tls.simd_lanes; ++i) {
    T y;
    std::memcpy(&y, slots + 16 * i, sizeof(T));
    r = op(r, y);
  }
  tls.simd_barrier->arrive_and_wait();
  return r;
}

// Runs `kernel(ids)` for every thread of a uniform grid (Metal dispatchThreads
// with a grid that is a multiple of the threadgroup size).
inline void launch(uint3 grid, uint3 group, const std::function<void(const Ids&)>& kernel) {
  if (grid.x % group.x || grid.y % group.y || grid.z % group.z) {
    std::fprintf(stderr, "metal_shim: grid must be a multiple of the threadgroup\n");
    std::exit(3);
  }
  const uint3 groups{grid.x / group.x, grid.y / group.y, grid.z / group.z};
  const uint nthreads = group.x * group.y * group.z;
  const uint nsimd = (nthreads + kSimdWidth - 1) / kSimdWidth;
  std::barrier<> group_barrier(nthreads);
  std::vector<std::unique_ptr<std::barrier<>>> simd_barriers;
  for (uint s = 0; s < nsimd; ++s) {
    simd_barriers.push_back(std::make_unique<std::barrier<>>(
        std::min(kSimdWidth, nthreads - s * kSimdWidth)));
  }
  std::vector<unsigned char> scratch(nsimd * kSimdWidth * 16);
  std::vector<std::thread> pool;
  for (uint t = 0; t < nthreads; ++t) {
    pool.emplace_back([&, t] {
      const uint s = t / kSimdWidth;
      tls = {&group_barrier, simd_barriers[s].get(), scratch.data() + s * kSimdWidth * 16,
             t % kSimdWidth, std::min(kSimdWidth, nthreads - s * kSimdWidth)};
      Ids ids{};
      ids.thread_position_in_threadgroup = {t % group.x, (t / group.x) % group.y,
                                            t / (group.x * group.y)};
      ids.threads_per_threadgroup = group;
      ids.threadgroups_per_grid = groups;
      ids.threads_per_grid = grid;
      ids.thread_index_in_threadgroup = t;
      ids.thread_index_in_simdgroup = t % kSimdWidth;
      ids.simdgroup_index_in_threadgroup = s;
      ids.simdgroups_per_threadgroup = nsimd;
      ids.threads_per_simdgroup = kSimdWidth;
      ids.quadgroup_index_in_threadgroup = t / 4;
      for (uint gz = 0; gz < groups.z; ++gz)
        for (uint gy = 0; gy < groups.y; ++gy)
          for (uint gx = 0; gx < groups.x; ++gx) {
            const uint3 tp = ids.thread_position_in_threadgroup;
            ids.threadgroup_position_in_grid = {gx, gy, gz};
            ids.thread_position_in_grid = {gx * group.x + tp.x, gy * group.y + tp.y,
                                           gz * group.z + tp.z};
            kernel(ids);
            // Nobody may start the next group (and reuse its threadgroup
            // statics) before every thread has finished this one.
            group_barrier.arrive_and_wait();
          }
    });
  }
  for (auto& th : pool) th.join();
}

inline std::vector<unsigned char> read_file(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "metal_shim: cannot read %s\n", path);
    std::exit(2);
  }
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(f), {});
}

inline void write_file(const char* path, const std::vector<unsigned char>& data) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data.data()), data.size());
}

}  // namespace shim

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags) { shim::tls.group_barrier->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { shim::tls.simd_barrier->arrive_and_wait(); }

template <typename T>
T simd_sum(T x) {
  return shim::simd_reduce(x, [](T a, T b) { return T(a + b); });
}
template <typename T>
T simd_max(T x) {
  return shim::simd_reduce(x, [](T a, T b) { return a < b ? b : a; });
}
template <typename T>
T simd_min(T x) {
  return shim::simd_reduce(x, [](T a, T b) { return b < a ? b : a; });
}

inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a < b ? b : a; }
inline int min(int a, int b) { return b < a ? b : a; }
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }

namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace fast

namespace precise {
inline float exp(float x) { return std::exp(x); }
}  // namespace precise

}  // namespace metal

// Address spaces vanish, except that `constant` becomes `volatile` so that
// binding a constant buffer (MLX passes inputs of < 8 elements that way) to a
// plain pointer fails to compile, as it would in Metal. Threadgroup variables
// become statics shared by the thread pool of the current threadgroup (groups
// never run concurrently).
#define device
#define constant volatile
#define threadgroup static
#define thread

#endif  // DSPARK_METAL_SHIM_H
