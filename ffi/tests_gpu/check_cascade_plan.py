"""CPU check of the cascade plans made on the host (jaxattn/cascade.h: cascade_plan_host, built
with -DJAXATTN_CASCADE_PLAN_INPUT=1) against the device's planning as emulate_cascade.py
transcribes it (plan_prefix_block): for random batches, every prefix block's record -- its
prefix or -1, its partition, the batch's partition count, its tile's request count and requests
-- must equal what the block would plan on the device.

    python3 check_cascade_plan.py [--batches N] [--cxx g++]

Batches of 1 to 600 requests over 1 to 2100 prefixes (several chunks of the device's bins),
query groups 1-8, tiles of 64 and 8 rows, prefix targets 1-528, split caps from 1 to the grid,
and prefix ids outside [-1, num_prefixes) among the requests.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import emulate_cascade as E  # noqa: E402

DRIVER = r"""
#include <cstdio>
#include <vector>
#include "jaxattn/cascade.h"
int main() {
  int n;
  if (std::scanf("%d", &n) != 1) return 1;
  for (int c = 0; c < n; ++c) {
    int B, G, per_tile, per_head, target, hkv, max_splits;
    if (std::scanf("%d %d %d %d %d %d %d", &B, &G, &per_tile, &per_head, &target, &hkv,
                   &max_splits) != 7)
      return 1;
    std::vector<int32_t> prefix_of(B);
    for (auto& x : prefix_of)
      if (std::scanf("%d", &x) != 1) return 1;
    const auto plan = jaxattn::cascade_plan_host(prefix_of.data(), B, G, per_tile, per_head,
                                                 target, hkv, max_splits);
    for (int k = 0; k < per_head; ++k) {
      const int32_t* r = &plan[size_t(k) * jaxattn::kCascadePlanStride];
      std::printf("%d %d %d %d", r[0], r[1], r[2], r[3]);
      for (int i = 0; i < (r[0] >= 0 ? r[3] : 0); ++i) std::printf(" %d", r[4 + i]);
      std::printf("\n");
    }
  }
  return 0;
}
"""


def cascade_tiles(batch, num_prefixes, per_tile):  # jaxattn/cascade.h
    if batch <= 0 or num_prefixes <= 0:
        return 0
    bound = (batch + per_tile - 1) // per_tile + min(num_prefixes, batch) - 1
    return min(bound, batch)


def cascade_blocks_per_head(tiles, target, kv_heads):  # jaxattn/cascade.h
    want = (target + kv_heads - 1) // kv_heads + (tiles + 1) // 2
    return 0 if tiles == 0 else max(tiles, want)


def random_batches(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        B = rng.choice([1, 2, 5, 9, 64, 100, 130, 257, 600])
        G = rng.choice([1, 2, 3, 7, 40, 1023, 1024, 1025, 2100])
        per_tile = max(1, rng.choice([64, 8]) // rng.choice([1, 2, 4, 8]))
        hkv = rng.choice([1, 2, 8])
        target = rng.choice([1, 16, 132, 264, 528])
        prefix_of = []
        for _ in range(B):
            r = rng.random()
            if r < 0.1:
                prefix_of.append(-1)
            elif r < 0.13:
                prefix_of.append(rng.choice([-2, G, G + 5, 2**31 - 1, -(2**31)]))
            elif r < 0.6:
                prefix_of.append(rng.randrange(min(G, 3)))
            else:
                prefix_of.append(rng.randrange(G))
        per_head = cascade_blocks_per_head(cascade_tiles(B, G, per_tile), target, hkv)
        max_splits = rng.choice([1, 2, 4, 16, max(per_head, 1)])
        yield B, G, per_tile, per_head, target, hkv, max_splits, prefix_of


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--cxx", default="g++")
    args = ap.parse_args()
    batches = list(random_batches(args.batches, args.seed))
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "plan_host.cc", Path(tmp) / "plan_host"
        src.write_text(DRIVER)
        include = HERE.parent / "include"
        subprocess.run(
            [
                args.cxx,
                "-std=c++17",
                "-O1",
                "-DJAXATTN_CASCADE_PLAN_INPUT=1",
                f"-I{include}",
                str(src),
                "-o",
                str(exe),
            ],
            check=True,
        )
        lines = [str(len(batches))]
        for b in batches:
            lines += [" ".join(map(str, b[:7])), " ".join(map(str, b[7]))]
        out = subprocess.run(
            [str(exe)], input="\n".join(lines), capture_output=True, text=True, check=True
        ).stdout.splitlines()
    at = checked = bad = 0
    for B, G, per_tile, per_head, target, hkv, max_splits, prefix_of in batches:
        P = {
            "num_prefixes": G,
            "prefix_of": prefix_of,
            "prefix_target": target,
            "hkv": hkv,
            "prefix_parts": max_splits,
        }
        for k in range(per_head):
            got = [int(x) for x in out[at].split()]
            at += 1
            plan, splits = E.plan_prefix_block(P, k, per_tile, per_head)
            if plan is None:
                want = [-1, 0, splits, 0]
            else:
                g, count, members, split = plan
                want = [g, split, splits, count, *members[:count]]
            checked += 1
            if got != want:
                bad += 1
                if bad <= 5:
                    print(
                        f"MISMATCH batch B={B} G={G} per_tile={per_tile} block {k}: "
                        f"host {got[:8]} device {want[:8]}"
                    )
    print(f"{checked} prefix blocks of {len(batches)} batches: {bad} records differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
