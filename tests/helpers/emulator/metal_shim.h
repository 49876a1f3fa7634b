// The part of the Metal Shading Language the kernels in metal_kernels/ may use, in C++20, so that
// the source MLX's mx.fast.metal_kernel assembles around a body (tests/metal_emulator.py writes
// it as MLX does) compiles with g++ and runs on the emulator's runtime (runtime.h).
//
// Address spaces: `device` and `constant` data are plain C++ objects; `threadgroup` arrays are
// static (shared by the threads of a threadgroup, which run one threadgroup at a time) and
// volatile, so threadgroup memory cannot be handed to anything that takes device, constant or
// thread memory: `const device float* p = shared_array;` does not compile, as in MSL. `thread`
// is the default. Every name a body may use is listed in tests/metal_emulator.py (MSL_NAMES);
// its strictness check rejects any other, so a name g++ knows and MSL does not cannot slip in.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "runtime.h"

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;

// bfloat: float32's upper 16 bits, converted from float by rounding to nearest even as Apple
// GPUs (and MLX's CPU bfloat16) do; arithmetic goes through float.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(const bfloat&) = default;
  bfloat(const volatile bfloat& o) : bits(o.bits) {}
  template <class U, class = std::enable_if_t<std::is_arithmetic_v<U>>>
  bfloat(U v) : bits(round(static_cast<float>(v))) {}
  bfloat& operator=(const bfloat&) = default;
  bfloat& operator=(const volatile bfloat& o) {
    bits = o.bits;
    return *this;
  }
  void operator=(const bfloat& o) volatile { bits = o.bits; }
  operator float() const { return widen(bits); }
  operator float() const volatile { return widen(bits); }
  static uint16_t round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN (quiet)
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
  }
  static float widen(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

// MLX's metal::utils() names its dtypes so: the signatures it writes use these.
typedef half float16_t;
typedef bfloat bfloat16_t;

// ------------------------------------------------------------------------------ vector types

template <class T, int N>
struct vec;
template <class T>
struct vec<T, 2> {
  T x, y;
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T>
struct vec<T, 3> {
  T x, y, z;
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T>
struct vec<T, 4> {
  T x, y, z, w;
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
#define EMU_VEC_OP(op)                                                                    \
  template <class T, int N>                                                               \
  vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                                       \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                                      \
    return a;                                                                             \
  }                                                                                       \
  template <class T, int N, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>   \
  vec<T, N> operator op(vec<T, N> a, S s) {                                               \
    for (int i = 0; i < N; ++i) a[i] = a[i] op s;                                         \
    return a;                                                                             \
  }
EMU_VEC_OP(+)
EMU_VEC_OP(-)
EMU_VEC_OP(*)
EMU_VEC_OP(/)
#undef EMU_VEC_OP
typedef vec<float, 2> float2; typedef vec<float, 3> float3; typedef vec<float, 4> float4;
typedef vec<half, 2> half2; typedef vec<half, 3> half3; typedef vec<half, 4> half4;
typedef vec<int, 2> int2; typedef vec<int, 3> int3; typedef vec<int, 4> int4;
typedef vec<uint, 2> uint2; typedef vec<uint, 3> uint3; typedef vec<uint, 4> uint4;
typedef vec<short, 2> short2; typedef vec<short, 3> short3; typedef vec<short, 4> short4;
typedef vec<ushort, 2> ushort2; typedef vec<ushort, 3> ushort3; typedef vec<ushort, 4> ushort4;

// ------------------------------------------------------------------------------ metal::

namespace metal {

// Half and bfloat arguments are computed in float and rounded back, as a GPU without native
// support would; the kernels convert to float themselves anyway.
template <class T>
using math_t = std::conditional_t<std::is_floating_point_v<T>, T, float>;

#define EMU_UNARY(name, expr)                    \
  template <class T>                             \
  T name(T v) {                                  \
    const math_t<T> x = static_cast<math_t<T>>(v); \
    return static_cast<T>(expr);                 \
  }
EMU_UNARY(exp, std::exp(x))
EMU_UNARY(exp2, std::exp2(x))
EMU_UNARY(log, std::log(x))
EMU_UNARY(log2, std::log2(x))
EMU_UNARY(log10, std::log10(x))
EMU_UNARY(sqrt, std::sqrt(x))
EMU_UNARY(rsqrt, 1 / std::sqrt(x))
EMU_UNARY(sin, std::sin(x))
EMU_UNARY(cos, std::cos(x))
EMU_UNARY(tan, std::tan(x))
EMU_UNARY(tanh, std::tanh(x))
EMU_UNARY(floor, std::floor(x))
EMU_UNARY(ceil, std::ceil(x))
EMU_UNARY(round, std::round(x))
EMU_UNARY(trunc, std::trunc(x))
EMU_UNARY(fabs, std::fabs(x))
#undef EMU_UNARY

template <class T>
T abs(T v) {
  return v < T(0) ? T(-v) : v;
}
template <class T>
T max(T a, T b) {
  return a < b ? b : a;
}
template <class T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
T fmax(T a, T b) {
  return static_cast<T>(std::fmax(static_cast<math_t<T>>(a), static_cast<math_t<T>>(b)));
}
template <class T>
T fmin(T a, T b) {
  return static_cast<T>(std::fmin(static_cast<math_t<T>>(a), static_cast<math_t<T>>(b)));
}
template <class T>
T clamp(T v, T lo, T hi) {
  return min(max(v, lo), hi);
}
template <class T>
T pow(T a, T b) {
  return static_cast<T>(std::pow(static_cast<math_t<T>>(a), static_cast<math_t<T>>(b)));
}
template <class T>
T fma(T a, T b, T c) {
  return static_cast<T>(std::fma(static_cast<math_t<T>>(a), static_cast<math_t<T>>(b), static_cast<math_t<T>>(c)));
}
template <class T>
bool isnan(T v) {
  return std::isnan(static_cast<math_t<T>>(v));
}
template <class T>
bool isinf(T v) {
  return std::isinf(static_cast<math_t<T>>(v));
}
template <class T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T>
struct numeric_limits {
  static constexpr T lowest() { return std::numeric_limits<T>::lowest(); }
  static constexpr T max() { return std::numeric_limits<T>::max(); }
  static constexpr T min() { return std::numeric_limits<T>::min(); }
  static constexpr T infinity() { return std::numeric_limits<T>::infinity(); }
};

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

}  // namespace metal

using namespace metal;

template <class T, class U>
T as_type(U v) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  T t;
  memcpy(&t, &v, sizeof t);
  return t;
}

// ------------------------------------------------------------------------------ synchronization

// Each call's place in the body identifies it (emu::barrier says why).
#define EMU_SITE int line = __builtin_LINE()
#define EMU_AT line

inline void threadgroup_barrier(mem_flags, EMU_SITE) { emu::barrier(EMU_AT); }

template <class T>
struct lanes {  // the lanes' values in one simdgroup operation, read on demand
  const unsigned char* slots;
  unsigned took_part;
  T v(int lane) const {
    T value;
    memcpy(&value, slots + 16 * lane, sizeof value);
    return value;
  }
};

template <class T>
lanes<T> simd_values(T value, int site) {
  static_assert(sizeof(T) <= 16, "simdgroup operations on types of 16 bytes at most");
  lanes<T> r;
  r.slots = emu::simd_exchange(&value, sizeof value, site, &r.took_part);
  return r;
}

inline int simd_lane() { return emu::team.current % emu::kLanes; }

inline void simdgroup_barrier(mem_flags, EMU_SITE) { simd_values(0, EMU_AT); }

#define EMU_SIMD_MOVE(name, source)                                   \
  template <class T>                                                  \
  T name(T value, ushort arg, EMU_SITE) {                             \
    const lanes<T> all = simd_values(value, EMU_AT);                  \
    const int l = simd_lane();                                        \
    return all.v((source) & (emu::kLanes - 1));                       \
  }
EMU_SIMD_MOVE(simd_shuffle, arg)
EMU_SIMD_MOVE(simd_broadcast, arg)
EMU_SIMD_MOVE(simd_shuffle_xor, l ^ arg)
EMU_SIMD_MOVE(simd_shuffle_up, l >= arg ? l - arg : l)
EMU_SIMD_MOVE(simd_shuffle_down, l + arg < emu::kLanes ? l + arg : l)
#undef EMU_SIMD_MOVE

// Reductions and scans over the lanes that take part, in lane order (Apple's hardware order is
// not documented: float sums may differ from a GPU's in the last bits).
#define EMU_SIMD_FOLD(name, op, scan, inclusive)                            \
  template <class T>                                                        \
  T name(T value, EMU_SITE) {                                               \
    const lanes<T> all = simd_values(value, EMU_AT);                        \
    const int upto = scan ? simd_lane() + (inclusive ? 1 : 0) : emu::kLanes; \
    bool any = false;                                                       \
    T acc{};                                                                \
    for (int l = 0; l < upto; ++l) {                                        \
      if (!(all.took_part >> l & 1)) continue;                              \
      acc = any ? static_cast<T>(op) : all.v(l);                            \
      any = true;                                                           \
    }                                                                       \
    return acc;                                                             \
  }
EMU_SIMD_FOLD(simd_sum, acc + all.v(l), false, false)
EMU_SIMD_FOLD(simd_product, acc * all.v(l), false, false)
EMU_SIMD_FOLD(simd_max, metal::max(acc, all.v(l)), false, false)
EMU_SIMD_FOLD(simd_min, metal::min(acc, all.v(l)), false, false)
EMU_SIMD_FOLD(simd_prefix_inclusive_sum, acc + all.v(l), true, true)
EMU_SIMD_FOLD(simd_prefix_exclusive_sum, acc + all.v(l), true, false)
EMU_SIMD_FOLD(simd_prefix_inclusive_product, acc * all.v(l), true, true)
EMU_SIMD_FOLD(simd_prefix_exclusive_product, acc * all.v(l), true, false)
#undef EMU_SIMD_FOLD

inline bool simd_all(bool value, EMU_SITE) {
  const lanes<bool> all = simd_values(value, EMU_AT);
  for (int l = 0; l < emu::kLanes; ++l) {
    if (all.took_part >> l & 1 && !all.v(l)) return false;
  }
  return true;
}
inline bool simd_any(bool value, EMU_SITE) {
  const lanes<bool> all = simd_values(value, EMU_AT);
  for (int l = 0; l < emu::kLanes; ++l) {
    if (all.took_part >> l & 1 && all.v(l)) return true;
  }
  return false;
}

#undef EMU_SITE
#undef EMU_AT

// ------------------------------------------------------------------------------ address spaces

#define device
#define constant
#define thread
#define threadgroup static volatile
