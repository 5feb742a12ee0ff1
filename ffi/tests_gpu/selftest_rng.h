// Rng: the self-tests' generator -- splitmix64 with Box-Muller normals, fast enough for
// millions of cache entries a case and the same sequence on every platform for a seed.
#pragma once
#include <cmath>
#include <cstdint>

struct Rng {
  using result_type = uint64_t;
  uint64_t state;
  bool has_spare = false;
  float spare = 0.f;
  explicit Rng(uint64_t seed) : state(seed) {}
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t(0); }
  uint64_t operator()() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double((*this)() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  float normal() {
    if (has_spare) {
      has_spare = false;
      return spare;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform())), a = 6.283185307179586 * uniform();
    spare = float(r * std::sin(a));
    has_spare = true;
    return float(r * std::cos(a));
  }
};
