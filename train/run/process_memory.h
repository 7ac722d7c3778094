// How a training process keeps the memory it frees. Every step allocates and frees the same
// activation and gradient buffers (megabytes to gigabytes each). With glibc's defaults, blocks
// above its mmap threshold are mapped and unmapped on each use and the heap's free top is
// returned to the system, so each step faults every such page in again and the kernel zeroes
// it: about a tenth of a small-moe step on this project's 2-core machine (docs/PERFORMANCE.md, "CPU speed").
#pragma once

namespace rs::train {

// From now on freed memory stays in the process for the next allocation: no block is served by
// its own mapping and the heap is never trimmed (glibc mallopt: M_MMAP_MAX 0, M_TRIM_THRESHOLD
// at its maximum). The resident size then stays at its peak instead of falling between steps;
// the peak itself does not grow. A no-op without glibc. For `reshard train` / `eval` and the
// training benchmarks, never for the converters, whose large buffers are one-off.
void KeepFreedMemory();

}  // namespace rs::train
