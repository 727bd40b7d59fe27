// CUDA twins of core/sampling_ops_cpu.cpp, bit for bit (integer sums, exact selects).
//
// sampling_threshold: one block of 1024 threads per row, or from V = 32,768 up a cluster of 8
// blocks per row, each a slice (one block alone streams a wide row slower than the sort it
// replaces: BENCHMARKS.md, "Sampling on the device"). Each select is a radix select over the 32-bit order keys in three passes (12, 10, 10
// bits, most significant first): a pass builds a histogram in shared memory (counts for top-k,
// fixed-point masses for top-p) of the keys that match the digits chosen so far, a cluster's
// blocks add theirs into rank 0's through distributed shared memory, and one warp picks the
// digit where the count or mass from the top reaches the target. A row is read three times per
// select (in L2 after the first); top-p alone reads z and probs three times, top-k and top-p seven.
//
// draw: one block per row, each of its 32 warps a contiguous segment of the row. The warps' sums,
// scanned, name the segment that holds the target; the block then splits that segment a few
// entries per thread, and the thread whose entries hold the target walks them to the first
// cumulative weight above it.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>

#include "core/sampling_ops.h"
#include "cuda/cuda_backend.h"
#include "cuda/kernel_errors.cuh"

namespace ortspec::cuda {
namespace {

using sampling::fixed_mass;
using sampling::order_key;
using sampling::scale_mass;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kFirstDigitBits = 12, kDigitBits = 10;  // 12 + 10 + 10 = 32
constexpr unsigned kAll = 0xFFFFFFFFu;
constexpr long long kClusterVocab = 32768;  // from this V up a row's threshold is split over a cluster
constexpr int kClusterBlocks = 8;           // blocks per row then (the portable cluster size)

// f(a[i], b[i]) for this thread's share of i < n (b may be null: then 0). Rows of a multiple of
// 4 floats at 16-byte addresses are read as float4, two per thread per iteration, both loads
// issued before f runs, so a thread keeps four to eight loads in flight instead of one.
template <typename F>
__device__ inline void visit_row(const float* a, const float* b, long long n, F&& f) {
  const bool vector = (n & 3) == 0 && ((reinterpret_cast<unsigned long long>(a) |
                                        reinterpret_cast<unsigned long long>(b)) & 15) == 0;
  if (vector) {
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    const long long n4 = n >> 2;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (long long j = threadIdx.x; j < n4; j += 2 * kThreads) {
      const long long j2 = j + kThreads;
      const float4 x0 = __ldg(a4 + j), y0 = b ? __ldg(b4 + j) : zero;
      const float4 x1 = j2 < n4 ? __ldg(a4 + j2) : zero, y1 = b && j2 < n4 ? __ldg(b4 + j2) : zero;
      f(x0.x, y0.x), f(x0.y, y0.y), f(x0.z, y0.z), f(x0.w, y0.w);
      if (j2 < n4) f(x1.x, y1.x), f(x1.y, y1.y), f(x1.z, y1.z), f(x1.w, y1.w);
    }
    return;
  }
  for (long long i = threadIdx.x; i < n; i += kThreads) f(a[i], b ? b[i] : 0.0f);
}

// A slice of a row as the selects read it: f(key, a, b) for each entry, the order key of its z
// and what mass(a, b) turns into its fixed-point mass, so a pass that does not need an entry's
// mass (its key outside the digits chosen so far) never computes it.
struct ProbsSlice {  // SamplingThreshold: z and Softmax(z) as given
  const float* z;
  const float* probs;
  long long n;
  int bits;
  template <bool kMass, typename F>
  __device__ void visit(F&& f) const {
    visit_row(z, kMass ? probs : nullptr, n, [&](float zi, float pi) { f(order_key(__float_as_uint(zi)), zi, pi); });
  }
  __device__ unsigned long long mass(float, float pi) const { return fixed_mass(pi, bits); }
};

struct LogitsSlice {  // SampleToken: z = logits x scale, mass exp(z - top) (core/sampling_ops.h)
  const float* logits;
  long long n;
  float scale, top;
  int bits;
  template <bool, typename F>
  __device__ void visit(F&& f) const {
    visit_row(logits, nullptr, n, [&](float li, float) {
      const float zi = sampling::mul_rn(li, scale);
      f(order_key(__float_as_uint(zi)), zi, 0.0f);
    });
  }
  __device__ unsigned long long mass(float zi, float) const {
    return fixed_mass(sampling::exp_rn(sampling::sub_rn(zi, top)), bits);
  }
};

__device__ inline unsigned long long warp_sum(unsigned long long v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kAll, v, offset);
  return v;
}

// The inclusive prefix sum over the warp's lanes: lane i gets v_0 + ... + v_i.
__device__ inline unsigned long long warp_scan(unsigned long long v) {
  const int lane = threadIdx.x & 31;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned long long lower = __shfl_up_sync(kAll, v, offset);
    if (lane >= offset) v += lower;
  }
  return v;
}

namespace cg = cooperative_groups;

struct SharedState {
  unsigned long long scratch[kWarps];
  unsigned long long partial;  // this block's share of a cluster-wide sum
  unsigned long long above;   // count or mass of the keys above the digits chosen so far
  unsigned long long target;
  unsigned long long tie;     // the mass of one of t_k's ties
  unsigned int digit;
};

// Sum over the block of every thread's v (all threads call it).
__device__ unsigned long long block_sum(unsigned long long v, SharedState& shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) shared.scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = lane < kWarps ? shared.scratch[lane] : 0;
    w = warp_sum(w);
    if (lane == 0) shared.scratch[0] = w;
  }
  __syncthreads();
  const unsigned long long total = shared.scratch[0];
  __syncthreads();
  return total;
}

// The largest over the block of every thread's v (all threads call it).
__device__ unsigned long long block_max(unsigned long long v, SharedState& shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other = __shfl_xor_sync(kAll, v, offset);
    v = other > v ? other : v;
  }
  if (lane == 0) shared.scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = shared.scratch[lane];
    for (int offset = 16; offset > 0; offset >>= 1) {
      const unsigned long long other = __shfl_xor_sync(kAll, w, offset);
      w = other > w ? other : w;
    }
    if (lane == 0) shared.scratch[0] = w;
  }
  __syncthreads();
  const unsigned long long largest = shared.scratch[0];
  __syncthreads();
  return largest;
}

// The blocks of one row (Blocks > 1: a thread block cluster, each block a slice of the row) add
// their histograms or sums through distributed shared memory; rank 0 decides and the others read
// its decision. Blocks == 1: one block holds the whole row and these are plain block operations.
template <int Blocks>
struct RowGroup {
  unsigned int rank;

  __device__ static RowGroup make() {
    if constexpr (Blocks > 1) return RowGroup{cg::this_cluster().block_rank()};
    return RowGroup{0};
  }
  __device__ void sync() const {
    if constexpr (Blocks > 1) cg::this_cluster().sync();
    else __syncthreads();
  }
  // Rank 0's histogram += every other rank's (the others' histograms are complete: call after sync()).
  __device__ void combine(unsigned long long* histogram, int bins) const {
    if constexpr (Blocks > 1) {
      if (rank == 0) {
        cg::cluster_group cluster = cg::this_cluster();
        for (int b = threadIdx.x; b < bins; b += kThreads) {
          unsigned long long sum = histogram[b];
          for (unsigned int r = 1; r < Blocks; ++r) sum += cluster.map_shared_rank(histogram, r)[b];
          histogram[b] = sum;
        }
      }
      __syncthreads();
    }
  }
  // Rank 0's shared state, seen from this block.
  __device__ SharedState& leader(SharedState& own) const {
    if constexpr (Blocks > 1) return *cg::this_cluster().map_shared_rank(&own, 0);
    return own;
  }
  // The sum over the row of every thread's v (all threads of every block call it).
  __device__ unsigned long long sum(unsigned long long v, SharedState& shared) const {
    v = block_sum(v, shared);
    if constexpr (Blocks == 1) return v;
    if (threadIdx.x == 0) shared.partial = v;
    sync();
    unsigned long long total = 0;
    cg::cluster_group cluster = cg::this_cluster();
    for (unsigned int r = 0; r < Blocks; ++r) total += cluster.map_shared_rank(&shared, r)->partial;
    sync();  // every block has read every partial before one is written again
    return total;
  }
  // The largest over the row of every thread's v (all threads of every block call it).
  __device__ unsigned long long max(unsigned long long v, SharedState& shared) const {
    v = block_max(v, shared);
    if constexpr (Blocks == 1) return v;
    if (threadIdx.x == 0) shared.partial = v;
    return max_of(&SharedState::partial, shared);
  }
  // The largest over the row of every block's shared value at `field` (after the blocks set it).
  __device__ unsigned long long max_of(unsigned long long SharedState::*field, SharedState& shared) const {
    if constexpr (Blocks == 1) return shared.*field;
    sync();
    unsigned long long best = 0;
    cg::cluster_group cluster = cg::this_cluster();
    for (unsigned int r = 0; r < Blocks; ++r) {
      const unsigned long long v = cluster.map_shared_rank(&shared, r)->*field;
      best = v > best ? v : best;
    }
    sync();
    return best;
  }
};

// The key whose count (kMass false) or mass (true) above it is < target and with its ties >=
// target, over this block's slice of a row shared by the group. target_fraction > 0:
// target = ceil(target_fraction x the row's whole mass), taken from the first pass's histogram
// (top-p without top-k). Returns the key; *above_out: the count or mass above it.
template <bool kMass, int Blocks, typename Slice>
__device__ unsigned int radix_select(const RowGroup<Blocks>& group, const Slice& slice, unsigned long long target,
                                     float target_fraction, unsigned long long* histogram, SharedState& shared,
                                     unsigned long long* above_out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned int prefix = 0, mask = 0;
  if (threadIdx.x == 0) shared.above = 0, shared.target = target;
  int shift = 32;
  for (int pass = 0; pass < 3; ++pass) {
    const int width = pass == 0 ? kFirstDigitBits : kDigitBits;
    const int bins = 1 << width;
    shift -= width;
    for (int b = threadIdx.x; b < bins; b += kThreads) histogram[b] = 0;
    __syncthreads();
    slice.template visit<kMass>([&](unsigned int key, float a, float b) {
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & (bins - 1)], kMass ? slice.mass(a, b) : 1ull);
    });
    group.sync();
    group.combine(histogram, bins);
    if (group.rank == 0 && warp == 0) {
      const int per_lane = bins / 32;
      unsigned long long sum = 0;
      for (int j = 0; j < per_lane; ++j) sum += histogram[lane * per_lane + j];
      unsigned long long from_top = sum;  // this lane's bins and every higher lane's
      for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long higher = __shfl_down_sync(kAll, from_top, offset);
        if (lane + offset < 32) from_top += higher;
      }
      if (pass == 0 && target_fraction > 0.0f) {
        const unsigned long long whole = __shfl_sync(kAll, from_top, 0);
        if (lane == 0) shared.target = scale_mass(whole, target_fraction, /*round_up=*/true);
        __syncwarp();
      }
      const unsigned long long above = shared.above, goal = shared.target;
      const unsigned long long start = above + from_top - sum;  // above this lane's bins
      const unsigned int found = __ballot_sync(kAll, start < goal && goal <= start + sum);
      if (found) {  // exact sums: one lane's bins hold the target; walk them from the top
        if (lane == __ffs(found) - 1) {
          unsigned long long at = start;
          int j = per_lane - 1;
          for (; j > 0 && at + histogram[lane * per_lane + j] < goal; --j) at += histogram[lane * per_lane + j];
          shared.digit = static_cast<unsigned int>(lane * per_lane + j);
          shared.above = at;
        }
      } else {  // not reached (the target exceeds the mass): the smallest key, the lowest nonempty bin
        const unsigned int nonempty = __ballot_sync(kAll, sum > 0);
        const int lowest = nonempty ? __ffs(nonempty) - 1 : 0;
        if (lane == lowest) {
          int j = 0;
          while (j < per_lane - 1 && histogram[lane * per_lane + j] == 0) ++j;
          shared.digit = static_cast<unsigned int>(lane * per_lane + j);
          shared.above = start + sum - histogram[lane * per_lane + j];
        }
      }
    }
    group.sync();
    const SharedState& decided = group.leader(shared);
    prefix |= decided.digit << shift;
    mask |= static_cast<unsigned int>(bins - 1) << shift;
    *above_out = decided.above;
    group.sync();  // every block has read the decision before rank 0 makes the next
  }
  return prefix;
}

// The smallest key top-k (k < V: on), then top-p (p < 1: on) keep, over this block's slice of
// a row shared by the group; at least one of them on.
template <int Blocks, typename Slice>
__device__ unsigned int row_threshold(const RowGroup<Blocks>& group, const Slice& slice, long long k, float p,
                                      long long vocab, unsigned long long* histogram, SharedState& shared) {
  if (threadIdx.x == 0) shared.tie = 0;
  unsigned int kept = 0;
  unsigned long long total = 0;
  if (k < vocab) {
    unsigned long long larger = 0;
    kept = radix_select<false>(group, slice, static_cast<unsigned long long>(k), 0.0f, histogram, shared, &larger);
    if (p < 1.0f) {  // the mass of the k largest: those above t_k and k - larger of its ties
      unsigned long long above = 0;
      slice.template visit<true>([&](unsigned int key, float a, float b) {
        if (key > kept) above += slice.mass(a, b);
        else if (key == kept) shared.tie = slice.mass(a, b);  // ties: one z, one mass
      });
      above = group.sum(above, shared);  // synchronizes: every block's shared.tie is set
      const unsigned long long tie = group.max_of(&SharedState::tie, shared);
      total = above + static_cast<unsigned long long>(k - static_cast<long long>(larger)) * tie;
    }
  }
  if (p < 1.0f) {
    unsigned long long mass_above = 0;
    const unsigned int by_mass =
        k < vocab ? radix_select<true>(group, slice, scale_mass(total, p, /*round_up=*/true), 0.0f, histogram, shared,
                                       &mass_above)
                  : radix_select<true>(group, slice, 0, p, histogram, shared, &mass_above);
    kept = kept > by_mass ? kept : by_mass;
  }
  return kept;
}

// This block's share of a row split over Blocks blocks: [begin, begin + n), begin a multiple of 4.
struct Share {
  long long begin, n;
  __device__ static Share of(unsigned int rank, long long per_block, long long vocab) {
    const long long begin = rank * per_block < vocab ? rank * per_block : vocab;
    return Share{begin, begin + per_block < vocab ? per_block : vocab - begin};
  }
};

__device__ inline long long clamp_top_k(long long top_k, long long vocab) {
  return top_k > 0 ? (top_k < vocab ? top_k : vocab) : vocab;
}

// One row per group of Blocks blocks (a cluster when Blocks > 1), each block a slice of the row.
template <int Blocks>
__global__ void __launch_bounds__(kThreads) sampling_threshold_kernel(const float* z, const float* probs, const long long* top_k,
                                          const float* top_p, float* threshold, long long rows_per_request,
                                          long long vocab) {
  __shared__ unsigned long long histogram[1 << kFirstDigitBits];
  __shared__ SharedState shared;
  const RowGroup<Blocks> group = RowGroup<Blocks>::make();
  const long long row = blockIdx.x / Blocks, request = row / rows_per_request;
  const Share share = Share::of(group.rank, ((vocab + Blocks - 1) / Blocks + 3) / 4 * 4, vocab);
  const ProbsSlice slice{z + row * vocab + share.begin, probs + row * vocab + share.begin, share.n,
                         sampling::fraction_bits(vocab)};
  const long long k = clamp_top_k(top_k[request], vocab);
  const float p = top_p[request];
  if (k == vocab && !(p < 1.0f)) {
    if (group.rank == 0 && threadIdx.x == 0) threshold[row] = -INFINITY;
    return;  // the whole group returns: one row, one decision
  }
  const unsigned int kept = row_threshold(group, slice, k, p, vocab, histogram, shared);
  if (group.rank == 0 && threadIdx.x == 0) threshold[row] = __uint_as_float(sampling::key_bits(kept));
}

// This thread's inclusive sum in a scan over the block of every thread's v (all threads call it).
__device__ unsigned long long block_scan(unsigned long long v, unsigned long long* warp_totals) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_scan(v);
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) warp_totals[lane] = warp_scan(warp_totals[lane]);
  __syncthreads();
  const unsigned long long inclusive = v + (warp > 0 ? warp_totals[warp - 1] : 0);
  __syncthreads();
  return inclusive;
}

__global__ void __launch_bounds__(kThreads) draw_kernel(const float* weights, const float* u, long long* index, long long vocab) {
  __shared__ unsigned long long segment_sums[kWarps];
  __shared__ SharedState shared;
  __shared__ int walker;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row = blockIdx.x;
  const float* w = weights + row * vocab;
  const int bits = sampling::fraction_bits(vocab);
  // Level 1: 32 segments, one per warp, each a multiple of 4 entries long (float4 reads where the
  // row allows), the warp's lanes reading consecutive entries.
  const long long segment = ((vocab + kWarps - 1) / kWarps + 3) / 4 * 4;
  const long long begin = warp * segment, end = begin + segment < vocab ? begin + segment : vocab;
  const bool vector = (vocab & 3) == 0 && (reinterpret_cast<unsigned long long>(w) & 15) == 0;
  unsigned long long sum = 0;
  if (vector) {
    const float4* w4 = reinterpret_cast<const float4*>(w);
    for (long long j = begin / 4 + lane; j < end / 4; j += 32) {
      const float4 x = __ldg(w4 + j);
      sum += fixed_mass(x.x, bits) + fixed_mass(x.y, bits) + fixed_mass(x.z, bits) + fixed_mass(x.w, bits);
    }
  } else {
    for (long long i = begin + lane; i < end; i += 32) sum += fixed_mass(w[i], bits);
  }
  sum = warp_sum(sum);
  if (lane == 0) segment_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    const unsigned long long own = segment_sums[lane];
    const unsigned long long through = warp_scan(own);  // segments 0..lane
    const unsigned long long total = __shfl_sync(kAll, through, 31);
    const unsigned long long target = scale_mass(total, u[row], /*round_up=*/false);
    const unsigned int holds = __ballot_sync(kAll, total > 0 && through - own <= target && target < through);
    if (lane == 0) walker = holds ? __ffs(holds) - 1 : -1, shared.target = target;
    if (holds && lane == __ffs(holds) - 1) shared.above = through - own;  // the mass before that segment
  }
  __syncthreads();
  if (walker < 0) {  // no weight reaches 2^-bits: the first largest, else V - 1 (core/sampling_ops_cpu.cpp)
    float best = -INFINITY;
    long long at = vocab;
    for (long long i = threadIdx.x; i < vocab; i += kThreads) {
      if (w[i] > best) best = w[i], at = i;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(kAll, best, offset);
      const long long other_at = __shfl_xor_sync(kAll, at, offset);
      if (other > best || (other == best && other_at < at)) best = other, at = other_at;
    }
    __shared__ float best_of[kWarps];
    __shared__ long long at_of[kWarps];
    if (lane == 0) best_of[warp] = best, at_of[warp] = at;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int other = 1; other < kWarps; ++other) {
        if (best_of[other] > best_of[0] || (best_of[other] == best_of[0] && at_of[other] < at_of[0])) {
          best_of[0] = best_of[other], at_of[0] = at_of[other];
        }
      }
      index[row] = best_of[0] > 0.0f ? at_of[0] : vocab - 1;
    }
    return;
  }
  // Level 2: the whole block over the segment that holds the target, a few entries per thread;
  // the thread whose entries hold it walks them.
  const long long seg_begin = walker * segment;
  const long long seg_end = seg_begin + segment < vocab ? seg_begin + segment : vocab;
  const long long chunk = (seg_end - seg_begin + kThreads - 1) / kThreads;
  const long long chunk_begin = seg_begin + threadIdx.x * chunk;
  const long long chunk_end = chunk_begin + chunk < seg_end ? chunk_begin + chunk : seg_end;
  unsigned long long local = 0;
  for (long long i = chunk_begin; i < chunk_end; ++i) local += fixed_mass(w[i], bits);
  const unsigned long long inclusive = block_scan(local, segment_sums);
  const unsigned long long target = shared.target;
  unsigned long long cumulative = shared.above + inclusive - local;
  if (local > 0 && cumulative <= target && target < cumulative + local) {
    for (long long i = chunk_begin; i < chunk_end; ++i) {
      cumulative += fixed_mass(w[i], bits);
      if (cumulative > target) {
        index[row] = i;
        return;
      }
    }
  }
}

// A row of logits under the sampling transform, as SampleToken, TransformRows and
// SpeculativeAccept read it: z = logits x scale, w = exp(z - top), kept where z's key >= kept
// and (floor <= 0 or w >= floor) (core/sampling_ops.h).
struct Transformed {
  float scale, top, floor;
  unsigned int kept;
  int bits;
  __device__ unsigned long long mass(float li) const {
    const float zi = sampling::mul_rn(li, scale);
    if (order_key(__float_as_uint(zi)) < kept) return 0;
    const float w = sampling::exp_rn(sampling::sub_rn(zi, top));
    return floor > 0.0f && !(w >= floor) ? 0 : fixed_mass(w, bits);
  }
};

// A row's slice for the group of Blocks blocks: Blocks x 32 segments of `segment` entries (a
// multiple of 4), block `rank` holding segments rank x 32 .. rank x 32 + 31, one per warp.
struct Segments {
  long long segment;
  Share share;
  __device__ static Segments of(unsigned int rank, int blocks, long long vocab) {
    const long long segment = ((vocab + blocks * kWarps - 1) / (blocks * kWarps) + 3) / 4 * 4;
    return Segments{segment, Share::of(rank, kWarps * segment, vocab)};
  }
};

// The transform of this block's slice l[0, n) of a row at temperature t > 0: the largest z
// (one pass), then the top-k / top-p threshold (3 passes per select; none when nothing truncates).
template <int Blocks>
__device__ Transformed transform_row(const RowGroup<Blocks>& group, const float* l, long long n, float t,
                                     long long top_k, float top_p, float min_p, long long vocab,
                                     unsigned long long* histogram, SharedState& shared) {
  const float scale = sampling::reciprocal_rn(t);
  unsigned long long largest = 0;  // order keys: their max is the largest z's
  visit_row(l, nullptr, n, [&](float li, float) {
    const unsigned long long key = order_key(__float_as_uint(sampling::mul_rn(li, scale)));
    largest = key > largest ? key : largest;
  });
  const float top = __uint_as_float(sampling::key_bits(static_cast<unsigned int>(group.max(largest, shared))));
  const int bits = sampling::fraction_bits(vocab);
  const long long k = clamp_top_k(top_k, vocab);
  const unsigned int kept = k == vocab && !(top_p < 1.0f)
                                ? order_key(__float_as_uint(-INFINITY))
                                : row_threshold(group, LogitsSlice{l, n, scale, top, bits}, k, top_p, vocab,
                                                histogram, shared);
  return Transformed{scale, top, min_p, kept, bits};
}

// The inverse-CDF draw over a row shared by the group: mass(i) the fixed-point weight of entry
// share.begin + i of this block's slice. Level 1: each warp sums its segment; rank 0's first warp
// scans all Blocks x 32 (lane j the segments j x Blocks .. j x Blocks + Blocks - 1) and names the
// one floor(u x total) falls in; level 2: the block holding it splits it a few entries per thread
// and the thread whose entries hold the target walks them. The holder writes *out; returns
// (in every block) whether the total was positive.
template <int Blocks, typename Mass>
__device__ bool group_draw(const RowGroup<Blocks>& group, const Segments& at, Mass&& mass, float u,
                           unsigned long long* segment_sums, SharedState& shared, long long* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long n = at.share.n, segment = at.segment;
  const long long seg_begin = warp * segment < n ? warp * segment : n;
  const long long seg_end = seg_begin + segment < n ? seg_begin + segment : n;
  unsigned long long sum = 0;
  for (long long i = seg_begin + lane; i < seg_end; i += 32) sum += mass(i);
  sum = warp_sum(sum);
  if (lane == 0) segment_sums[warp] = sum;
  group.sync();
  if (group.rank == 0 && warp == 0) {
    auto segment_sum = [&](int s) -> unsigned long long {
      if constexpr (Blocks > 1) return cg::this_cluster().map_shared_rank(segment_sums, s / kWarps)[s % kWarps];
      return segment_sums[s];
    };
    unsigned long long own = 0;
    for (int j = 0; j < Blocks; ++j) own += segment_sum(lane * Blocks + j);
    const unsigned long long through = warp_scan(own);
    const unsigned long long total = __shfl_sync(kAll, through, 31);
    const unsigned long long target = scale_mass(total, u, /*round_up=*/false);
    const unsigned int holds = __ballot_sync(kAll, total > 0 && through - own <= target && target < through);
    if (lane == 0) shared.digit = 0xFFFFFFFFu, shared.target = target;  // none: no mass
    __syncwarp();
    if (holds && lane == __ffs(holds) - 1) {
      unsigned long long before = through - own;
      int j = 0;
      for (; j < Blocks - 1 && before + segment_sum(lane * Blocks + j) <= target; ++j) {
        before += segment_sum(lane * Blocks + j);
      }
      shared.digit = static_cast<unsigned int>(lane * Blocks + j), shared.above = before;
    }
  }
  group.sync();
  const SharedState& decided = group.leader(shared);
  const unsigned int holder = decided.digit;
  const unsigned long long target = decided.target, before = decided.above;
  group.sync();  // every block has read the decision before any goes on
  if (holder == 0xFFFFFFFFu) return false;
  if (holder / kWarps != group.rank) return true;
  const long long begin = (holder % kWarps) * segment;
  const long long end = begin + segment < n ? begin + segment : n;
  const long long chunk = (end - begin + kThreads - 1) / kThreads;
  const long long chunk_begin = begin + threadIdx.x * chunk < end ? begin + threadIdx.x * chunk : end;
  const long long chunk_end = chunk_begin + chunk < end ? chunk_begin + chunk : end;
  unsigned long long local = 0;
  for (long long i = chunk_begin; i < chunk_end; ++i) local += mass(i);
  unsigned long long cumulative = before + block_scan(local, segment_sums) - local;
  if (local > 0 && cumulative <= target && target < cumulative + local) {
    for (long long i = chunk_begin; i < chunk_end; ++i) {
      cumulative += mass(i);
      if (cumulative > target) {
        *out = at.share.begin + i;
        break;
      }
    }
  }
  __syncthreads();  // segment_sums is free again
  return true;
}

// SampleToken: one row per group of Blocks blocks.
template <int Blocks>
__global__ void __launch_bounds__(kThreads) sample_token_kernel(const float* logits, const long long* greedy,
                                                                const float* temperature, const long long* top_k,
                                                                const float* top_p, const float* min_p,
                                                                const float* u, long long* token,
                                                                long long rows_per_request, long long vocab) {
  __shared__ unsigned long long histogram[1 << kFirstDigitBits];
  __shared__ unsigned long long segment_sums[kWarps];
  __shared__ SharedState shared;
  const RowGroup<Blocks> group = RowGroup<Blocks>::make();
  const long long row = blockIdx.x / Blocks, request = row / rows_per_request;
  const float t = temperature[request];
  if (!(t > 0.0f)) {  // a greedy row: the argmax the graph gives
    if (group.rank == 0 && threadIdx.x == 0) token[row] = greedy[row];
    return;
  }
  const Segments at = Segments::of(group.rank, Blocks, vocab);
  const float* l = logits + row * vocab + at.share.begin;
  const Transformed row_of = transform_row(group, l, at.share.n, t, top_k[request], top_p[request], min_p[request],
                                           vocab, histogram, shared);
  const bool drawn = group_draw(group, at, [&](long long i) { return row_of.mass(l[i]); }, u[row], segment_sums,
                                shared, token + row);
  if (!drawn && group.rank == 0 && threadIdx.x == 0) token[row] = greedy[row];  // nothing kept (min_p > 1)
}

// TransformRows: a row's transform as three int64s, (top's bits, the kept key, the kept mass),
// one row per group of Blocks blocks; zeros on greedy rows.
template <int Blocks>
__global__ void __launch_bounds__(kThreads) transform_rows_kernel(const float* logits, const float* temperature,
                                                                  const long long* top_k, const float* top_p,
                                                                  const float* min_p, long long* stats,
                                                                  long long rows_per_request, long long vocab) {
  __shared__ unsigned long long histogram[1 << kFirstDigitBits];
  __shared__ SharedState shared;
  const RowGroup<Blocks> group = RowGroup<Blocks>::make();
  const long long row = blockIdx.x / Blocks, request = row / rows_per_request;
  const float t = temperature[request];
  long long* out = stats + 3 * row;
  if (!(t > 0.0f)) {
    if (group.rank == 0 && threadIdx.x == 0) out[0] = out[1] = out[2] = 0;
    return;
  }
  const Share share = Share::of(group.rank, ((vocab + Blocks - 1) / Blocks + 3) / 4 * 4, vocab);
  const float* l = logits + row * vocab + share.begin;
  const Transformed row_of = transform_row(group, l, share.n, t, top_k[request], top_p[request], min_p[request],
                                           vocab, histogram, shared);
  unsigned long long kept = 0;
  visit_row(l, nullptr, share.n, [&](float li, float) { kept += row_of.mass(li); });
  kept = group.sum(kept, shared);
  if (group.rank == 0 && threadIdx.x == 0) {
    out[0] = __float_as_uint(row_of.top), out[1] = row_of.kept, out[2] = static_cast<long long>(kept);
  }
}

// SpeculativeAccept: one request per group of Blocks blocks. Each block decides the accept length
// itself (the same inputs, the same doubles), then the group draws the token after it.
template <int Blocks>
__global__ void __launch_bounds__(kThreads) speculative_accept_kernel(
    const float* logits, const long long* stats, const long long* drafts, const float* q, const float* temperature,
    const float* min_p, const float* u, const long long* greedy_accepted, const long long* greedy_token,
    long long* accepted_out, long long* emitted_out, long long k, long long vocab) {
  __shared__ unsigned long long segment_sums[kWarps];
  __shared__ SharedState shared;
  __shared__ long long accepted_shared;
  const RowGroup<Blocks> group = RowGroup<Blocks>::make();
  const long long request = blockIdx.x / Blocks;
  const float t = temperature[request];
  if (!(t > 0.0f)) {  // a greedy row: the greedy rule's
    if (group.rank == 0 && threadIdx.x == 0) {
      accepted_out[request] = greedy_accepted[request], emitted_out[request] = greedy_token[request];
    }
    return;
  }
  const int bits = sampling::fraction_bits(vocab);
  const float scale = sampling::reciprocal_rn(t);
  auto row = [&](long long i) {
    const long long* s = stats + 3 * (request * (k + 1) + i);
    return Transformed{scale, __uint_as_float(static_cast<unsigned int>(s[0])), min_p[request],
                       static_cast<unsigned int>(s[1]), bits};
  };
  auto total = [&](long long i) { return static_cast<unsigned long long>(stats[3 * (request * (k + 1) + i) + 2]); };
  const float* l = logits + request * (k + 1) * vocab;
  const float* qr = q + request * k * vocab;
  if (threadIdx.x == 0) {
    long long a = 0;
    for (; a < k; ++a) {
      const long long d = drafts[request * k + a];
      const double p = sampling::mass_probability(row(a).mass(l[a * vocab + d]), total(a));
      if (!(sampling::mul_rn_d(u[request * (k + 1) + a], qr[a * vocab + d]) < p)) break;
    }
    accepted_shared = a;
  }
  __syncthreads();
  const long long a = accepted_shared;
  const Segments at = Segments::of(group.rank, Blocks, vocab);
  const float* la = l + a * vocab + at.share.begin;
  const float* qa = qr + a * vocab + at.share.begin;
  const Transformed p_row = row(a);
  const float u_emit = u[request * (k + 1) + k];
  bool drawn = false;
  if (a < k) {  // the residual max(0, p_a - q_{a+1})
    const double inverse = sampling::inverse_mass(total(a));
    drawn = group_draw(group, at, [&](long long i) {
      return sampling::residual_mass(p_row.mass(la[i]), inverse, qa[i], bits);
    }, u_emit, segment_sums, shared, emitted_out + request);
  }
  if (!drawn) {  // after k accepts, or p_a == q_{a+1}: from p_a itself
    drawn = group_draw(group, at, [&](long long i) { return p_row.mass(la[i]); }, u_emit, segment_sums, shared,
                       emitted_out + request);
  }
  if (group.rank == 0 && threadIdx.x == 0) {
    accepted_out[request] = a;
    if (!drawn) emitted_out[request] = greedy_token[request];  // nothing kept (min_p > 1)
  }
}

// One row (or request) per block, or per cluster of kClusterBlocks from V = kClusterVocab up.
template <typename... Params, typename... Args>
void launch_per_row(void (*one)(Params...), void (*cluster)(Params...), std::int64_t rows, std::int64_t vocab,
                    std::uintptr_t stream, const char* name, Args... args) {
  if (rows == 0) return;
  if (vocab < kClusterVocab) {
    one<<<static_cast<unsigned int>(rows), kThreads, 0, as_stream(stream)>>>(args...);
  } else {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned int>(rows * kClusterBlocks));
    config.blockDim = dim3(kThreads);
    config.stream = as_stream(stream);
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = kClusterBlocks, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = 1;
    config.attrs = &attribute, config.numAttrs = 1;
    cudaLaunchKernelEx(&config, cluster, static_cast<Params>(args)...);
  }
  check_launch(name);
}

}  // namespace

void sampling_threshold(const float* z, const float* probs, const std::int64_t* top_k, const float* top_p,
                        float* threshold, std::int64_t rows, std::int64_t rows_per_request, std::int64_t vocab,
                        std::uintptr_t stream) {
  launch_per_row(sampling_threshold_kernel<1>, sampling_threshold_kernel<kClusterBlocks>, rows, vocab, stream,
                 "sampling_threshold", z, probs, reinterpret_cast<const long long*>(top_k), top_p, threshold,
                 static_cast<long long>(rows_per_request), static_cast<long long>(vocab));
}

void draw(const float* weights, const float* u, std::int64_t* index, std::int64_t rows, std::int64_t vocab,
          std::uintptr_t stream) {
  if (rows == 0) return;
  draw_kernel<<<static_cast<unsigned int>(rows), kThreads, 0, as_stream(stream)>>>(
      weights, u, reinterpret_cast<long long*>(index), vocab);
  check_launch("draw");
}

void sample_token(const float* logits, const std::int64_t* greedy, const float* temperature, const std::int64_t* top_k,
                  const float* top_p, const float* min_p, const float* u, std::int64_t* token, std::int64_t rows,
                  std::int64_t rows_per_request, std::int64_t vocab, std::uintptr_t stream) {
  launch_per_row(sample_token_kernel<1>, sample_token_kernel<kClusterBlocks>, rows, vocab, stream, "sample_token",
                 logits, reinterpret_cast<const long long*>(greedy), temperature,
                 reinterpret_cast<const long long*>(top_k), top_p, min_p, u, reinterpret_cast<long long*>(token),
                 static_cast<long long>(rows_per_request), static_cast<long long>(vocab));
}

void transform_rows(const float* logits, const float* temperature, const std::int64_t* top_k, const float* top_p,
                    const float* min_p, std::int64_t* stats, std::int64_t rows, std::int64_t rows_per_request,
                    std::int64_t vocab, std::uintptr_t stream) {
  launch_per_row(transform_rows_kernel<1>, transform_rows_kernel<kClusterBlocks>, rows, vocab, stream,
                 "transform_rows", logits, temperature, reinterpret_cast<const long long*>(top_k), top_p, min_p,
                 reinterpret_cast<long long*>(stats), static_cast<long long>(rows_per_request),
                 static_cast<long long>(vocab));
}

void speculative_accept(const float* logits, const std::int64_t* stats, const std::int64_t* drafts, const float* q,
                        const float* temperature, const float* min_p, const float* u,
                        const std::int64_t* greedy_accepted, const std::int64_t* greedy_token, std::int64_t* accepted,
                        std::int64_t* emitted, std::int64_t requests, std::int64_t k, std::int64_t vocab,
                        std::uintptr_t stream) {
  using I = const long long*;
  launch_per_row(speculative_accept_kernel<1>, speculative_accept_kernel<kClusterBlocks>, requests, vocab, stream,
                 "speculative_accept", logits, reinterpret_cast<I>(stats), reinterpret_cast<I>(drafts), q,
                 temperature, min_p, u, reinterpret_cast<I>(greedy_accepted), reinterpret_cast<I>(greedy_token),
                 reinterpret_cast<long long*>(accepted), reinterpret_cast<long long*>(emitted),
                 static_cast<long long>(k), static_cast<long long>(vocab));
}

}  // namespace ortspec::cuda
