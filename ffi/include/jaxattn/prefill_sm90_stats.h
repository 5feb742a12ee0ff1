// The Hopper prefill's wait counters (prefill_sm90.cuh), a diagnostics build switch: the
// categories and the host-side reader, apart from the kernels so that the prefill self-test
// can name them without instantiating the kernels in its own translation unit.
#pragma once

// JAXATTN_SM90_WAIT_STATS (diagnostics, off by default): the one-tile kernel counts, warp by
// warp (lane 0's clock64), the cycles its roles spend waiting, summed over the launch into
// sm90_wait_stats (indices Sm90WaitStat) and read back by sm90_read_wait_stats (prefill_sm90.cu):
// what the prefill self-test prints after each timed sm90 row of such a build.
#ifndef JAXATTN_SM90_WAIT_STATS
#define JAXATTN_SM90_WAIT_STATS 0
#endif

namespace jaxattn {
namespace gpu {

enum Sm90WaitStat {
  kWaitConsumerK,       // consumer warps: cycles in K full waits
  kWaitConsumerV,       // ... in V full waits
  kWaitConsumerTiles,   // ... key tiles (one per S)
  kWaitConsumerSpan,    // ... cycles from the q wait to the last P V's completion
  kWaitProducerK,       // producer warps: cycles in K empty waits
  kWaitProducerV,       // ... in V empty waits
  kWaitProducerCopies,  // ... issuing K's and V's copies
  kWaitProducerSync,    // ... in the producer barrier that publishes the next tile's offsets
  kWaitProducerTiles,   // ... key tiles
  kWaitStats
};

#if JAXATTN_SM90_WAIT_STATS
// prefill_sm90.cu's counters read into host[kWaitStats], then zeroed when `reset`.
void sm90_read_wait_stats(unsigned long long* host, bool reset);
#endif

}  // namespace gpu
}  // namespace jaxattn
