// metal_shim.h: enough of the Metal Shading Language, as C++20, to compile the kernels that
// mx.fast.metal_kernel builds (MLX's generated signature + body) and run them on the CPU under
// gdngen.metal_sim's runtime (runtime.cpp).
//
// Covered: address-space qualifiers (device, constant, thread, threadgroup; threadgroup
// *variables* are rewritten by the simulator into references to the runtime's per-threadgroup
// arena, see gdngen/metal_sim/source.py); scalar types incl. half and bfloat with round-to-nearest-even conversions and
// per-operation rounding; vec<T,N> with the usual aliases, component access (.x .y .z .w,
// .r .g .b .a) and the swizzles .xy .xyz .zw .yz; metal math (plain, precise::, fast::);
// as_type; threadgroup_barrier / simdgroup_barrier; SIMD-group functions over 32 lanes;
// simdgroup_matrix 8x8 load / store / multiply(_accumulate) / thread_elements with Apple's lane
// layout; relaxed atomics on device memory; numeric_limits.
// Not covered (compile errors, not silent misbehaviour): textures, samplers, imageblocks,
// function constants, raytracing, indirect command buffers, matrices (float4x4 ...), packed_*
// vectors, other swizzles, quad-group functions, MLX's own kernel utilities (utils.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "runtime.h"

// ------------------------------------------------------------------ address spaces, keywords
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define METAL_FUNC inline __attribute__((always_inline))
#define METAL_CONST constexpr

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;

namespace metal {

// ------------------------------------------------------------------ half and bfloat

namespace detail {

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> IEEE binary16, round to nearest even (subnormals, overflow to inf, quiet NaN).
inline uint16_t float_to_half_bits(float f) {
  uint32_t x = f2u(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> inf
  if (ax < 0x38800000u) {  // |f| < 2^-14: subnormal half; v * 2^24 is exact
    float q = std::nearbyint(u2f(ax) * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(q));
  }
  uint32_t r = ax - 0x38000000u;  // rebias the exponent by 127 - 15
  r += 0xFFFu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24
    return sign ? -v : v;
  }
  if (e == 31) return u2f(sign | 0x7F800000u | (m << 13));
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

// float -> bfloat16, round to nearest even (NaN stays a quiet NaN).
inline uint16_t float_to_bfloat_bits(float f) {
  uint32_t x = f2u(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float bfloat_bits_to_float(uint16_t b) { return u2f(static_cast<uint32_t>(b) << 16); }

template <typename I>
inline constexpr bool is_int_v = std::is_integral_v<I> && !std::is_same_v<I, bool>;

}  // namespace detail

#define MSL_SHIM_LOWP(H, TO_BITS, FROM_BITS)                                                 \
  struct H {                                                                                 \
    uint16_t bits_;                                                                          \
    H() = default;                                                                           \
    H(float f) : bits_(detail::TO_BITS(f)) {}                                                \
    template <typename I, std::enable_if_t<std::is_arithmetic_v<I> &&                        \
                                               !std::is_same_v<I, float>, int> = 0>          \
    H(I i) : bits_(detail::TO_BITS(static_cast<float>(i))) {}                                \
    operator float() const { return detail::FROM_BITS(bits_); }                              \
    template <typename X>                                                                    \
    H& operator+=(X o) { return *this = H(static_cast<float>(*this) + static_cast<float>(o)); } \
    template <typename X>                                                                    \
    H& operator-=(X o) { return *this = H(static_cast<float>(*this) - static_cast<float>(o)); } \
    template <typename X>                                                                    \
    H& operator*=(X o) { return *this = H(static_cast<float>(*this) * static_cast<float>(o)); } \
    template <typename X>                                                                    \
    H& operator/=(X o) { return *this = H(static_cast<float>(*this) / static_cast<float>(o)); } \
  };                                                                                         \
  inline H operator-(H a) { H r; r.bits_ = a.bits_ ^ 0x8000u; return r; }                   \
  inline H operator+(H a) { return a; }

MSL_SHIM_LOWP(half, float_to_half_bits, half_bits_to_float)
MSL_SHIM_LOWP(bfloat, float_to_bfloat_bits, bfloat_bits_to_float)
#undef MSL_SHIM_LOWP

// Arithmetic: H op H -> H (rounded once), H op float -> float, H op integer -> H.
#define MSL_SHIM_LOWP_OPS(H, OP)                                                             \
  inline H operator OP(H a, H b) { return H(static_cast<float>(a) OP static_cast<float>(b)); } \
  inline float operator OP(H a, float b) { return static_cast<float>(a) OP b; }              \
  inline float operator OP(float a, H b) { return a OP static_cast<float>(b); }              \
  template <typename I, std::enable_if_t<detail::is_int_v<I>, int> = 0>                      \
  inline H operator OP(H a, I b) { return H(static_cast<float>(a) OP static_cast<float>(b)); } \
  template <typename I, std::enable_if_t<detail::is_int_v<I>, int> = 0>                      \
  inline H operator OP(I a, H b) { return H(static_cast<float>(a) OP static_cast<float>(b)); }
#define MSL_SHIM_LOWP_CMP(H, OP)                                                             \
  inline bool operator OP(H a, H b) { return static_cast<float>(a) OP static_cast<float>(b); } \
  inline bool operator OP(H a, float b) { return static_cast<float>(a) OP b; }               \
  inline bool operator OP(float a, H b) { return a OP static_cast<float>(b); }               \
  template <typename I, std::enable_if_t<detail::is_int_v<I>, int> = 0>                      \
  inline bool operator OP(H a, I b) { return static_cast<float>(a) OP static_cast<float>(b); } \
  template <typename I, std::enable_if_t<detail::is_int_v<I>, int> = 0>                      \
  inline bool operator OP(I a, H b) { return static_cast<float>(a) OP static_cast<float>(b); }
#define MSL_SHIM_LOWP_ALL(H)                                                                 \
  MSL_SHIM_LOWP_OPS(H, +) MSL_SHIM_LOWP_OPS(H, -) MSL_SHIM_LOWP_OPS(H, *)                    \
  MSL_SHIM_LOWP_OPS(H, /) MSL_SHIM_LOWP_CMP(H, <) MSL_SHIM_LOWP_CMP(H, >)                    \
  MSL_SHIM_LOWP_CMP(H, <=) MSL_SHIM_LOWP_CMP(H, >=) MSL_SHIM_LOWP_CMP(H, ==)                 \
  MSL_SHIM_LOWP_CMP(H, !=)
MSL_SHIM_LOWP_ALL(half)
MSL_SHIM_LOWP_ALL(bfloat)
#undef MSL_SHIM_LOWP_ALL
#undef MSL_SHIM_LOWP_CMP
#undef MSL_SHIM_LOWP_OPS

template <typename T>
inline constexpr bool is_lowp_v = std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <typename T>
inline constexpr bool is_scalar_v = std::is_arithmetic_v<T> || is_lowp_v<T>;

// ------------------------------------------------------------------ vectors

template <typename T, int N>
struct vec;

namespace detail {

// A swizzle view over a vector's storage; reads give a vec, writes set the named components.
template <typename T, int N, int... I>
struct swizzle {
  T s_[N];
  operator vec<T, sizeof...(I)>() const { return vec<T, sizeof...(I)>(s_[I]...); }
  swizzle& operator=(const vec<T, sizeof...(I)>& o) {
    int k = 0;
    ((s_[I] = o[k++]), ...);
    return *this;
  }
  swizzle& operator=(const swizzle&) = delete;  // a.xy = b.xy: convert explicitly instead
};

template <typename T, int N>
struct vec_storage;

template <typename T>
struct vec_storage<T, 2> {
  union {
    T v_[2];
    struct { T x, y; };
    struct { T r, g; };
    swizzle<T, 2, 0, 1> xy;
    swizzle<T, 2, 1, 0> yx;
  };
};

template <typename T>
struct vec_storage<T, 3> {
  union {
    T v_[3];
    struct { T x, y, z; };
    struct { T r, g, b; };
    swizzle<T, 3, 0, 1> xy;
    swizzle<T, 3, 1, 2> yz;
    swizzle<T, 3, 0, 1, 2> xyz;
  };
};

template <typename T>
struct vec_storage<T, 4> {
  union {
    T v_[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    swizzle<T, 4, 0, 1> xy;
    swizzle<T, 4, 1, 2> yz;
    swizzle<T, 4, 2, 3> zw;
    swizzle<T, 4, 0, 1, 2> xyz;
    swizzle<T, 4, 0, 1, 2, 3> xyzw;
  };
};

template <typename A>
struct components : std::integral_constant<int, 1> {};
template <typename T, int N>
struct components<vec<T, N>> : std::integral_constant<int, N> {};

}  // namespace detail

template <typename T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : detail::vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;

  vec() = default;
  vec(const vec& o) { std::memcpy(this->v_, o.v_, sizeof(T) * N); }
  vec& operator=(const vec& o) {
    std::memcpy(this->v_, o.v_, sizeof(T) * N);
    return *this;
  }
  // Broadcast a scalar: float4(0.0f).
  template <typename S, std::enable_if_t<is_scalar_v<S>, int> = 0>
  explicit vec(S s) {
    for (int i = 0; i < N; ++i) this->v_[i] = static_cast<T>(s);
  }
  // Conversion between element types: float4(half4).
  template <typename U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->v_[i] = static_cast<T>(o[i]);
  }
  // Concatenation of scalars and vectors: float4(a, b, c, d), float4(xy, zw), float3(v.xy, z).
  template <typename A0, typename A1, typename... As,
            std::enable_if_t<(detail::components<std::decay_t<A0>>::value +
                              detail::components<std::decay_t<A1>>::value +
                              (0 + ... + detail::components<std::decay_t<As>>::value)) == N,
                             int> = 0>
  vec(const A0& a0, const A1& a1, const As&... as) {
    int k = 0;
    put(k, a0);
    put(k, a1);
    (put(k, as), ...);
  }

  T& operator[](int i) { return this->v_[i]; }
  const T& operator[](int i) const { return this->v_[i]; }

#define MSL_SHIM_VEC_OP(OP)                                                                  \
  friend vec operator OP(const vec& a, const vec& b) {                                       \
    vec r;                                                                                   \
    for (int i = 0; i < N; ++i) r.v_[i] = a.v_[i] OP b.v_[i];                                \
    return r;                                                                                \
  }                                                                                          \
  friend vec operator OP(const vec& a, T s) {                                                \
    vec r;                                                                                   \
    for (int i = 0; i < N; ++i) r.v_[i] = a.v_[i] OP s;                                      \
    return r;                                                                                \
  }                                                                                          \
  friend vec operator OP(T s, const vec& a) {                                                \
    vec r;                                                                                   \
    for (int i = 0; i < N; ++i) r.v_[i] = s OP a.v_[i];                                      \
    return r;                                                                                \
  }                                                                                          \
  vec& operator OP##=(const vec& b) { return *this = *this OP b; }                           \
  vec& operator OP##=(T s) { return *this = *this OP s; }
  MSL_SHIM_VEC_OP(+)
  MSL_SHIM_VEC_OP(-)
  MSL_SHIM_VEC_OP(*)
  MSL_SHIM_VEC_OP(/)
#undef MSL_SHIM_VEC_OP

#define MSL_SHIM_VEC_CMP(OP)                                                                 \
  friend vec<bool, N> operator OP(const vec& a, const vec& b) {                              \
    vec<bool, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = a.v_[i] OP b.v_[i];                                   \
    return r;                                                                                \
  }                                                                                          \
  friend vec<bool, N> operator OP(const vec& a, T s) {                                       \
    vec<bool, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = a.v_[i] OP s;                                         \
    return r;                                                                                \
  }
  MSL_SHIM_VEC_CMP(<)
  MSL_SHIM_VEC_CMP(>)
  MSL_SHIM_VEC_CMP(<=)
  MSL_SHIM_VEC_CMP(>=)
  MSL_SHIM_VEC_CMP(==)
  MSL_SHIM_VEC_CMP(!=)
#undef MSL_SHIM_VEC_CMP

  friend vec operator-(const vec& a) {
    vec r;
    for (int i = 0; i < N; ++i) r.v_[i] = -a.v_[i];
    return r;
  }

 private:
  template <typename S>
  void put(int& k, const S& s) {
    if constexpr (detail::components<S>::value == 1 && !std::is_class_v<S>) {
      this->v_[k++] = static_cast<T>(s);
    } else if constexpr (is_lowp_v<S>) {
      this->v_[k++] = static_cast<T>(s);
    } else if constexpr (std::is_convertible_v<S, T> && detail::components<S>::value == 1) {
      this->v_[k++] = static_cast<T>(s);
    } else {
      for (int i = 0; i < detail::components<S>::value; ++i) this->v_[k++] = static_cast<T>(s[i]);
    }
  }
};

#define MSL_SHIM_VEC_ALIASES(T, NAME) \
  typedef vec<T, 2> NAME##2;          \
  typedef vec<T, 3> NAME##3;          \
  typedef vec<T, 4> NAME##4;
MSL_SHIM_VEC_ALIASES(float, float)
MSL_SHIM_VEC_ALIASES(half, half)
MSL_SHIM_VEC_ALIASES(bfloat, bfloat)
MSL_SHIM_VEC_ALIASES(int, int)
MSL_SHIM_VEC_ALIASES(uint, uint)
MSL_SHIM_VEC_ALIASES(short, short)
MSL_SHIM_VEC_ALIASES(ushort, ushort)
MSL_SHIM_VEC_ALIASES(char, char)
MSL_SHIM_VEC_ALIASES(uchar, uchar)
MSL_SHIM_VEC_ALIASES(int64_t, long)
MSL_SHIM_VEC_ALIASES(ulong, ulong)
MSL_SHIM_VEC_ALIASES(bool, bool)
#undef MSL_SHIM_VEC_ALIASES

template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

template <typename T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = s + a[i] * b[i];
  return s;
}

// ------------------------------------------------------------------ math

// Element type of a scalar or vector and the float type math is done in.
template <typename T>
struct elem { using type = T; };
template <typename T, int N>
struct elem<vec<T, N>> { using type = T; };

#define MSL_SHIM_UNARY(NAME, EXPR)                                                           \
  inline float NAME(float x) { return EXPR; }                                                \
  inline half NAME(half h) { float x = static_cast<float>(h); return half(EXPR); }           \
  inline bfloat NAME(bfloat h) { float x = static_cast<float>(h); return bfloat(EXPR); }     \
  template <typename T, int N>                                                               \
  inline vec<T, N> NAME(const vec<T, N>& v) {                                                \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                           \
    return r;                                                                                \
  }
#define MSL_SHIM_UNARY_SET                                                                   \
  MSL_SHIM_UNARY(exp, std::exp(x))                                                           \
  MSL_SHIM_UNARY(exp2, std::exp2(x))                                                         \
  MSL_SHIM_UNARY(exp10, std::pow(10.0f, x))                                                  \
  MSL_SHIM_UNARY(log, std::log(x))                                                           \
  MSL_SHIM_UNARY(log2, std::log2(x))                                                         \
  MSL_SHIM_UNARY(log10, std::log10(x))                                                       \
  MSL_SHIM_UNARY(sqrt, std::sqrt(x))                                                         \
  MSL_SHIM_UNARY(rsqrt, 1.0f / std::sqrt(x))                                                 \
  MSL_SHIM_UNARY(sin, std::sin(x))                                                           \
  MSL_SHIM_UNARY(cos, std::cos(x))                                                           \
  MSL_SHIM_UNARY(tan, std::tan(x))                                                           \
  MSL_SHIM_UNARY(asin, std::asin(x))                                                         \
  MSL_SHIM_UNARY(acos, std::acos(x))                                                         \
  MSL_SHIM_UNARY(atan, std::atan(x))                                                         \
  MSL_SHIM_UNARY(sinh, std::sinh(x))                                                         \
  MSL_SHIM_UNARY(cosh, std::cosh(x))                                                         \
  MSL_SHIM_UNARY(tanh, std::tanh(x))                                                         \
  MSL_SHIM_UNARY(floor, std::floor(x))                                                       \
  MSL_SHIM_UNARY(ceil, std::ceil(x))                                                         \
  MSL_SHIM_UNARY(trunc, std::trunc(x))                                                       \
  MSL_SHIM_UNARY(round, std::round(x))                                                       \
  MSL_SHIM_UNARY(rint, std::nearbyint(x))                                                    \
  MSL_SHIM_UNARY(fabs, std::fabs(x))                                                         \
  MSL_SHIM_UNARY(fract, x - std::floor(x))

MSL_SHIM_UNARY_SET
MSL_SHIM_UNARY(abs, std::fabs(x))
inline int abs(int x) { return x < 0 ? -x : x; }

namespace precise {
MSL_SHIM_UNARY_SET
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
namespace fast {
MSL_SHIM_UNARY_SET
inline float divide(float a, float b) { return a / b; }
}  // namespace fast
#undef MSL_SHIM_UNARY_SET
#undef MSL_SHIM_UNARY

inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline half fma(half a, half b, half c) {
  return half(std::fma(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c)));
}
inline float pow(float a, float b) { return std::pow(a, b); }
inline float powr(float a, float b) { return std::pow(a, b); }
inline float atan2(float a, float b) { return std::atan2(a, b); }
inline float fmod(float a, float b) { return std::fmod(a, b); }
inline float copysign(float a, float b) { return std::copysign(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline half min(half a, half b) { return a < b ? a : b; }
inline half max(half a, half b) { return a > b ? a : b; }
template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
inline I min(I a, I b) { return a < b ? a : b; }
template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
inline I max(I a, I b) { return a > b ? a : b; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
inline float saturate(float x) { return clamp(x, 0.0f, 1.0f); }
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool signbit(float x) { return std::signbit(x); }
inline bool isnan(half x) { return std::isnan(static_cast<float>(x)); }
inline bool isinf(half x) { return std::isinf(static_cast<float>(x)); }
inline bool isnan(bfloat x) { return std::isnan(static_cast<float>(x)); }
inline bool isinf(bfloat x) { return std::isinf(static_cast<float>(x)); }
template <typename T, int N>
inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <typename T, int N>
inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}

template <typename To, typename From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  To r;
  std::memcpy(static_cast<void*>(&r), static_cast<const void*>(&x), sizeof(To));
  return r;
}

template <typename T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static half make(uint16_t b) { half h; h.bits_ = b; return h; }
  static half max() { return make(0x7BFF); }
  static half min() { return make(0x0400); }
  static half lowest() { return make(0xFBFF); }
  static half epsilon() { return make(0x1400); }
  static half infinity() { return make(0x7C00); }
  static half quiet_NaN() { return make(0x7E00); }
  static half denorm_min() { return make(0x0001); }
};
template <>
struct numeric_limits<bfloat> {
  static bfloat make(uint16_t b) { bfloat h; h.bits_ = b; return h; }
  static bfloat max() { return make(0x7F7F); }
  static bfloat min() { return make(0x0080); }
  static bfloat lowest() { return make(0xFF7F); }
  static bfloat epsilon() { return make(0x3C00); }
  static bfloat infinity() { return make(0x7F80); }
  static bfloat quiet_NaN() { return make(0x7FC0); }
  static bfloat denorm_min() { return make(0x0001); }
};

#ifndef MAXFLOAT
#define MAXFLOAT 3.402823466e+38f
#endif

// ------------------------------------------------------------------ barriers

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}

// Every thread of the threadgroup must reach the same barrier; memory is coherent on the CPU,
// so the flags are accepted but not checked against the memory actually shared.
inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  msl_rt_threadgroup_barrier("", line);
}

inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  int none = 0;
  msl_rt_simd_exchange(&none, sizeof none, "simdgroup_barrier", "", line);
}

// ------------------------------------------------------------------ SIMD-group functions

namespace detail {

inline uint lane() { return msl_rt_self()->thread_index_in_simdgroup; }

// Deposit this lane's value and return all lanes' values (after every lane arrived).
template <typename T>
inline void gather(const T& x, T (&all)[32], int& lanes, const char* what, int line) {
  static_assert(sizeof(T) <= MSL_RT_SLOT_BYTES, "SIMD value too large for the simulator");
  const unsigned char* slots =
      static_cast<const unsigned char*>(msl_rt_simd_exchange(&x, sizeof(T), what, "", line));
  lanes = msl_rt_simd_lanes();
  for (int i = 0; i < lanes; ++i) {
    std::memcpy(static_cast<void*>(&all[i]), slots + i * MSL_RT_SLOT_BYTES, sizeof(T));
  }
}

template <typename T, typename Op>
inline T tree_reduce(T (&v)[32], int lanes, Op op) {
  // Butterfly order (xor 1, 2, 4, 8, 16), as simd_sum lowers to on Apple GPUs.
  for (int step = 1; step < 32; step <<= 1) {
    for (int i = 0; i + step < lanes; i += 2 * step) v[i] = op(v[i], v[i + step]);
  }
  return v[0];
}

}  // namespace detail

#define MSL_SHIM_REDUCE(NAME, EXPR)                                                          \
  template <typename T>                                                                      \
  inline T NAME(T x, int line = __builtin_LINE()) {                                          \
    T all[32];                                                                               \
    int lanes;                                                                               \
    detail::gather(x, all, lanes, #NAME, line);                                              \
    return detail::tree_reduce(all, lanes, [](T a, T b) -> T { return EXPR; });             \
  }
MSL_SHIM_REDUCE(simd_sum, a + b)
MSL_SHIM_REDUCE(simd_product, a * b)
MSL_SHIM_REDUCE(simd_max, max(a, b))
MSL_SHIM_REDUCE(simd_min, min(a, b))
MSL_SHIM_REDUCE(simd_and, a & b)
MSL_SHIM_REDUCE(simd_or, a | b)
MSL_SHIM_REDUCE(simd_xor, a ^ b)
#undef MSL_SHIM_REDUCE

template <typename T>
inline T simd_prefix_inclusive_sum(T x, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_prefix_inclusive_sum", line);
  uint me = detail::lane();
  T s = all[0];
  for (uint i = 1; i <= me; ++i) s = s + all[i];
  return s;
}

template <typename T>
inline T simd_prefix_exclusive_sum(T x, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_prefix_exclusive_sum", line);
  uint me = detail::lane();
  if (me == 0) return T(0);
  T s = all[0];
  for (uint i = 1; i < me; ++i) s = s + all[i];
  return s;
}

template <typename T>
inline T simd_prefix_inclusive_product(T x, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_prefix_inclusive_product", line);
  T s = all[0];
  for (uint i = 1; i <= detail::lane(); ++i) s = s * all[i];
  return s;
}

template <typename T>
inline T simd_shuffle(T x, ushort src, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_shuffle", line);
  if (src >= lanes) msl_rt_fail("simd_shuffle reads a lane outside the SIMD-group");
  return all[src];
}

template <typename T>
inline T simd_broadcast(T x, ushort src, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_broadcast", line);
  if (src >= lanes) msl_rt_fail("simd_broadcast reads a lane outside the SIMD-group");
  return all[src];
}

template <typename T>
inline T simd_broadcast_first(T x, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_broadcast_first", line);
  return all[0];
}

template <typename T>
inline T simd_shuffle_xor(T x, ushort mask, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_shuffle_xor", line);
  uint src = detail::lane() ^ mask;
  if (src >= static_cast<uint>(lanes)) msl_rt_fail("simd_shuffle_xor reads a missing lane");
  return all[src];
}

template <typename T>
inline T simd_shuffle_up(T x, ushort delta, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_shuffle_up", line);
  uint me = detail::lane();
  return me >= delta ? all[me - delta] : x;
}

template <typename T>
inline T simd_shuffle_down(T x, ushort delta, int line = __builtin_LINE()) {
  T all[32];
  int lanes;
  detail::gather(x, all, lanes, "simd_shuffle_down", line);
  uint me = detail::lane();
  return me + delta < static_cast<uint>(lanes) ? all[me + delta] : x;
}

inline bool simd_all(bool b, int line = __builtin_LINE()) {
  bool all[32];
  int lanes;
  detail::gather(b, all, lanes, "simd_all", line);
  for (int i = 0; i < lanes; ++i)
    if (!all[i]) return false;
  return true;
}

inline bool simd_any(bool b, int line = __builtin_LINE()) {
  bool all[32];
  int lanes;
  detail::gather(b, all, lanes, "simd_any", line);
  for (int i = 0; i < lanes; ++i)
    if (all[i]) return true;
  return false;
}

struct simd_vote {
  using vote_t = ulong;
  vote_t v;
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xFFFFFFFFull; }
  bool any() const { return v != 0; }
};

inline simd_vote simd_ballot(bool b, int line = __builtin_LINE()) {
  bool all[32];
  int lanes;
  detail::gather(b, all, lanes, "simd_ballot", line);
  simd_vote r{0};
  for (int i = 0; i < lanes; ++i)
    if (all[i]) r.v |= 1ull << i;
  return r;
}

inline bool simd_is_first() { return detail::lane() == 0; }

// ------------------------------------------------------------------ simdgroup matrices

namespace detail {

// Apple's 8x8 layout (as MLX's steel BaseMMAFrag): lane holds row fm, columns fn and fn + 1.
inline constexpr int frag_row(int lane) { return ((lane / 4) & 4) + ((lane / 2) % 4); }
inline constexpr int frag_col(int lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

}  // namespace detail

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the simulator implements 8x8 simdgroup matrices");
  vec<T, 2> e_;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T v) : e_(v) {}
  vec<T, 2>& thread_elements() { return e_; }
  const vec<T, 2>& thread_elements() const { return e_; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, Cols, Rows>(v);
}

// matrix_origin is (column, row) in the source; transposed loads read element (r, c) from
// source row c, column r.
template <typename T, typename P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, const P* src, size_t elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0, 0), bool transpose = false) {
  int lane = static_cast<int>(detail::lane());
  int r = detail::frag_row(lane), c0 = detail::frag_col(lane);
  for (int e = 0; e < 2; ++e) {
    int c = c0 + e;
    size_t row = transpose ? c : r, col = transpose ? r : c;
    m.e_[e] = static_cast<T>(src[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col]);
  }
}

template <typename T, typename P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P* dst, size_t elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0, 0), bool transpose = false) {
  int lane = static_cast<int>(detail::lane());
  int r = detail::frag_row(lane), c0 = detail::frag_col(lane);
  for (int e = 0; e < 2; ++e) {
    int c = c0 + e;
    size_t row = transpose ? c : r, col = transpose ? r : c;
    dst[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col] = static_cast<P>(m.e_[e]);
  }
}

namespace detail {

struct MmaPack {
  float a[2], b[2], c[2];
};

// Runs once per SIMD-group (in the last lane to arrive): every lane's d = a * b + c, each
// output a float FMA chain over k (products of half / bfloat operands are exact in float).
inline void mma_combine(const unsigned char* slots, int lanes, unsigned char* results) {
  float A[8][8], B[8][8];
  const MmaPack* in[32];
  for (int l = 0; l < lanes; ++l) {
    const auto* p = reinterpret_cast<const MmaPack*>(slots + l * MSL_RT_SLOT_BYTES);
    in[l] = p;
    int r = frag_row(l), c0 = frag_col(l);
    A[r][c0] = p->a[0];
    A[r][c0 + 1] = p->a[1];
    B[r][c0] = p->b[0];
    B[r][c0 + 1] = p->b[1];
  }
  for (int l = 0; l < lanes; ++l) {
    int r = frag_row(l), c0 = frag_col(l);
    float* out = reinterpret_cast<float*>(results + l * MSL_RT_SLOT_BYTES);
    for (int e = 0; e < 2; ++e) {
      float acc = in[l]->c[e];
      for (int k = 0; k < 8; ++k) acc = std::fma(A[r][k], B[k][c0 + e], acc);
      out[e] = acc;
    }
  }
}

}  // namespace detail

// d = a * b + c over the SIMD-group (every lane must take part).
template <typename TD, typename TA, typename TB, typename TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                          const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b,
                                          const simdgroup_matrix<TC, 8, 8>& c,
                                          int line = __builtin_LINE()) {
  if (msl_rt_simd_lanes() != 32) {
    msl_rt_fail("simdgroup matrix functions need a full SIMD-group of 32 lanes");
  }
  detail::MmaPack mine{{static_cast<float>(a.e_[0]), static_cast<float>(a.e_[1])},
                       {static_cast<float>(b.e_[0]), static_cast<float>(b.e_[1])},
                       {static_cast<float>(c.e_[0]), static_cast<float>(c.e_[1])}};
  const float* out = static_cast<const float*>(msl_rt_simd_combine(
      &mine, sizeof mine, detail::mma_combine, "simdgroup_multiply_accumulate", "", line));
  d.e_[0] = static_cast<TD>(out[0]);
  d.e_[1] = static_cast<TD>(out[1]);
}

template <typename TD, typename TA, typename TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, int line = __builtin_LINE()) {
  simdgroup_matrix<TD, 8, 8> zero(static_cast<TD>(0.0f));
  simdgroup_multiply_accumulate(d, a, b, zero, line);
}

// ------------------------------------------------------------------ atomics (device memory)

enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED };

template <typename T>
struct atomic {
  T value_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;

template <typename T>
inline T atomic_load_explicit(const atomic<T>* o, memory_order) {
  return __atomic_load_n(&o->value_, __ATOMIC_RELAXED);
}
template <typename T, typename U>
inline void atomic_store_explicit(atomic<T>* o, U v, memory_order) {
  __atomic_store_n(&o->value_, static_cast<T>(v), __ATOMIC_RELAXED);
}
template <typename T, typename U>
inline T atomic_exchange_explicit(atomic<T>* o, U v, memory_order) {
  return __atomic_exchange_n(&o->value_, static_cast<T>(v), __ATOMIC_RELAXED);
}
template <typename T, typename U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* o, T* expected, U desired,
                                                  memory_order, memory_order) {
  return __atomic_compare_exchange_n(&o->value_, expected, static_cast<T>(desired), true,
                                     __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

namespace detail {
template <typename T, typename F>
inline T atomic_rmw(atomic<T>* o, F f) {
  T old = __atomic_load_n(&o->value_, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(&o->value_, &old, f(old), true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}
}  // namespace detail

template <typename T, typename U>
inline T atomic_fetch_add_explicit(atomic<T>* o, U v, memory_order) {
  return detail::atomic_rmw(o, [&](T x) { return static_cast<T>(x + static_cast<T>(v)); });
}
template <typename T, typename U>
inline T atomic_fetch_sub_explicit(atomic<T>* o, U v, memory_order) {
  return detail::atomic_rmw(o, [&](T x) { return static_cast<T>(x - static_cast<T>(v)); });
}
template <typename T, typename U>
inline T atomic_fetch_max_explicit(atomic<T>* o, U v, memory_order) {
  return detail::atomic_rmw(o, [&](T x) { return x > static_cast<T>(v) ? x : static_cast<T>(v); });
}
template <typename T, typename U>
inline T atomic_fetch_min_explicit(atomic<T>* o, U v, memory_order) {
  return detail::atomic_rmw(o, [&](T x) { return x < static_cast<T>(v) ? x : static_cast<T>(v); });
}

}  // namespace metal

using namespace metal;

// MLX's utils.h names for the kernel dtypes (get_type_string: float16_t, bfloat16_t).
typedef half float16_t;
typedef bfloat bfloat16_t;

// Attribute values for the generated trampoline.
namespace msl_sim {
inline uint3 u3(const uint32_t* p) { return uint3(p[0], p[1], p[2]); }
}  // namespace msl_sim
