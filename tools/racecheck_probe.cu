// A 60-line model of how Triton's `gl.warp_specialize` hands work to its worker warps, to see
// what compute-sanitizer's racecheck makes of it (scripts/sanitize.py builds and runs it).
//
// The compiled conv kernel does exactly this (see RESULTS.md, "Sanitizers"): the default
// warpgroup writes one byte per worker warp ("which partition do you run?") into shared memory,
// then every thread of the block meets at named barrier 1; each worker warp, past the same
// barrier, reads its byte and runs its partition; at the end, the default warpgroup writes
// "exit" and meets the workers at barrier 1 once more. The barrier orders each write before the
// reads (PTX ISA, barrier.sync: memory accesses requested by participating threads before the
// barrier are performed relative to all of them), so there is no race. The threads reach the
// barrier from different places in the code (different program counters), which is why Triton
// emits the non-aligned form `barrier.sync 1`.
//
// Variants (argv[1]):
//   aligned      every barrier is `bar.sync 1` (the aligned form)
//   nonaligned   `barrier.sync 1`, as Triton emits it
//   setmaxnreg   non-aligned, plus the register hand-over Triton adds on Hopper
//                (the worker warpgroup gives registers back with setmaxnreg.dec)
//   named0       non-aligned, and the default warpgroup also syncs among its own 128 threads
//                with `bar.sync 0, 128` inside its partition, as the conv's default partition does
#include <cstdio>
#include <cstring>

template <bool kAligned>
__device__ __forceinline__ void block_barrier_1() {
  if (kAligned) asm volatile("bar.sync 1;" ::: "memory");
  else asm volatile("barrier.sync 1;" ::: "memory");
}

template <bool kAligned, bool kSetMaxNReg, bool kNamed0>
__global__ void __launch_bounds__(256) dispatch_model(int* out) {
  __shared__ unsigned int partition_of_warp;   // byte w-4: what worker warp w runs (3 = exit)
  const int warp = threadIdx.x / 32;
  if (warp < 4) {                                              // the default warpgroup
    partition_of_warp = 0x02010100u;                           // warp 4: 0, warps 5-7: idle
    block_barrier_1<kAligned>();                               // release the workers
    out[threadIdx.x] = threadIdx.x;                            // "the default partition"
    if (kNamed0) asm volatile("bar.sync 0, 128;" ::: "memory");   // its warpgroup-local sync
    block_barrier_1<kAligned>();                               // join
    partition_of_warp = 0x03030303u;                           // everybody: exit
    block_barrier_1<kAligned>();
    return;
  }
#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (kSetMaxNReg) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
#endif
  for (;;) {
    block_barrier_1<kAligned>();
    const unsigned char mine = reinterpret_cast<volatile unsigned char*>(&partition_of_warp)[warp - 4];
    if (mine == 3) return;
    if (mine == 0) out[threadIdx.x] = -threadIdx.x;            // "the loader partition"
    block_barrier_1<kAligned>();                               // join
  }
}

int main(int argc, char** argv) {
  const char* variant = argc > 1 ? argv[1] : "nonaligned";
  int* out;
  cudaMalloc(&out, 256 * sizeof(int));
  if (!strcmp(variant, "aligned")) dispatch_model<true, false, false><<<2, 256>>>(out);
  else if (!strcmp(variant, "setmaxnreg")) dispatch_model<false, true, false><<<2, 256>>>(out);
  else if (!strcmp(variant, "named0")) dispatch_model<false, false, true><<<2, 256>>>(out);
  else dispatch_model<false, false, false><<<2, 256>>>(out);
  cudaError_t status = cudaDeviceSynchronize();
  printf("racecheck probe (%s): %s\n", variant, cudaGetErrorString(status));
  cudaFree(out);
  return status != cudaSuccess;
}
