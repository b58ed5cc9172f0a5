// The device canary (include/kvq/cuda/canary.hpp): echokv_policy::measure's KL on the GPU.
//
// Grid: (kv head, item), 512 threads. A block stages the item's window keys of its kv head in
// shared memory once (one global latency instead of one per encode step), then for each tier in
// turn: the error f(k) - k of every key element under the tier's codec, in pages of `align` tokens
// (every unit of a K page is one token group or one token, so the values equal those of the CPU's
// one page of all the keys; a group never wraps around the ring because align divides the window;
// KIVI keys a warp per (token group, 32 channels), a lane per channel, other formats through
// codec::encode_unit into shared-memory pages), decoded once per element, not once per row; then,
// for up to `rows_per_pass` query rows of the GQA group at a time, logits z = s·q·k and
// perturbations D = s·q·(f(k) - k) with four lanes per (key, 4 rows), and the KL of each row with
// a warp per row in fp64. Where the error table of the whole window does not fit in shared memory
// (head_dim 256 at a 128-token window), it is computed for `error_keys` keys at a time (a multiple
// of align) within each pass of rows, each block of keys then consumed by the z/D phase; the
// values are the same. The block's sum over rows goes to out[item][kv head][tier]. The work is
// tiny (the window is a few hundred keys): the launch is latency-bound, so the tiers share one
// block (the keys are staged once) and a whole decode step's canaries (every layer, every due
// sequence) are one launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/canary.hpp>

#include "dtype.cuh"
#include "launch.hpp"
#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

constexpr int threads = 512;  // 2 blocks per SM fit (shared memory); a 128-key window busies <= 16 warps
constexpr int warps = threads / 32;
constexpr int rows_per_pass = 16;  // query rows (row = query token x head of the group) per pass
constexpr int max_items = 64;
// Row padding of the staged keys (halves) and the error table (floats): in the z/D phase a warp
// reads 8 keys x 4 interleaved channel quarters; row strides of 4 words mod 32 put those 32 reads
// in 32 different banks (the keys' pairs of lanes share a word).
constexpr int key_pad = 8, err_pad = 4;  // items per launch (parameter space); more are launched in turn

using detail::cuda_status;
using detail::launch;
using detail::load_any;
using detail::msg;

size_t round16(size_t x) { return (x + 15) / 16 * 16; }

// Bytes of one align-token page of role K in format f, padded to 16.
size_t chunk_bytes(format_id f, int align, int head_dim) {
  return round16(layout_of(traits_of(f), role::k, align, head_dim).total());
}

struct canary_params {
  int q_heads, kv_heads, head_dim, window, align, tiers, n_items;
  int error_keys;  // keys of the error table (and of the pages behind it): a multiple of align
  int64_t ring_head_stride;
  float scale;
  const void* q;
  dtype q_type;
  int64_t q_stride;
  double* out;
  format_id tier_fmt[max_canary_tiers];
  uint32_t chunk_stride[max_canary_tiers];
  canary_item items[max_items];
};

// fp16 bits -> float with the hardware conversion (exact, like numeric.hpp's half_to_float)
__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

template <class T>
__device__ __forceinline__ T warp_sum(T x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__global__ void __launch_bounds__(threads) canary_kernel(const __grid_constant__ canary_params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const canary_item& it = p.items[blockIdx.y];
  const int d = p.head_dim, R = p.window, A = p.align, n = it.keys, group = p.q_heads / p.kv_heads;
  const uint16_t* ring = it.ring + size_t(h) * p.ring_head_stride;
  const int ek = min(n, p.error_keys), chunks = ek / A;  // keys (and pages) of one error block
  const int kstride = d + key_pad;  // halves per staged key row
  const int estride = d + err_pad;  // floats per error row
  uint32_t page_stride = 0;         // the pages of every tier fit (canary_smem_bytes)
  for (int t = 0; t < p.tiers; ++t) page_stride = max(page_stride, p.chunk_stride[t]);
  uint8_t* page = smem;
  uint16_t* keys = reinterpret_cast<uint16_t*>(smem + size_t(chunks) * page_stride);       // [n][d + 2]
  float* err = reinterpret_cast<float*>(keys + ((size_t(n) * kstride + 1) & ~size_t(1)));  // [ek][d + err_pad]
  float* qs = err + size_t(ek) * estride;                                                  // [rows_per_pass][d]
  float* z = qs + rows_per_pass * d;                                                       // [rows_per_pass][n]
  float* dd = z + rows_per_pass * n;                                                       // [rows_per_pass][n]
  double* kl = reinterpret_cast<double*>(dd + rows_per_pass * n);                          // [rows_per_pass]

  // K_ref: the window's keys into shared memory, 4 bytes per thread and step (one memory latency)
  for (int idx = threadIdx.x; idx < n * (d / 2); idx += threads) {
    const int j = idx / (d / 2), c2 = idx % (d / 2);
    const uint32_t w = reinterpret_cast<const uint32_t*>(ring + size_t((it.first + j) % R) * d)[c2];
    keys[j * kstride + 2 * c2] = uint16_t(w & 0xffffu);
    keys[j * kstride + 2 * c2 + 1] = uint16_t(w >> 16);
  }
  __syncthreads();

  // The tiers one after the other over the same staged keys (the shared-memory tables are reused).
  for (int t = 0; t < p.tiers; ++t) {
    const uint32_t cs = p.chunk_stride[t];
    const codec::page_geom g = codec::make_geom(p.tier_fmt[t], role::k, A, d);
    // f_t(K) - K of keys [kb, kb + kn) (whole token groups) into error rows 0 .. kn - 1.
    const auto errors = [&](int kb, int kn) {
      const uint16_t* kbase = keys + size_t(kb) * kstride;
      if (g.k_columns()) {
        // KIVI keys (the usual tiers): a warp per (token group, 32 channels), a lane per channel. The
        // range over the group's tokens, the fp16 scale and zero and the codes come from the codec's
        // own helpers (kivi_range, kivi_code), so they equal codec::encode_unit's; the error is then
        // x^ - x = (code s + z) - x with the codec's rounding, as the CPU canary computes it. No page
        // is written: the codes are only needed as values.
        const int G = g.fmt.group, bits = g.fmt.bits, blocks = d / 32;
        for (int task = warp; task < (kn / G) * blocks; task += warps) {
          const int tg = task / blocks, c = (task % blocks) * 32 + lane;
          const uint16_t* src = kbase + size_t(tg) * G * kstride + c;
          float lo = h2f(src[0]), hi = lo;
#pragma unroll 8
          for (int tt = 1; tt < G; ++tt) {
            const float x = h2f(src[tt * kstride]);
            lo = codec::fmin_(lo, x);
            hi = codec::fmax_(hi, x);
          }
          uint16_t s16, z16;
          codec::kivi_range(lo, hi, bits, s16, z16);  // (rolealign as kivi: the canary measures unclipped)
          const float sf = h2f(s16), zf = h2f(z16);
          float* er = err + size_t(tg) * G * estride + c;
#pragma unroll 8
          for (int tt = 0; tt < G; ++tt) {
            const float x = h2f(src[tt * kstride]);
            const uint32_t q = codec::kivi_code(x, sf, zf, bits);
            er[tt * estride] = codec::sub_rn(codec::add_rn(codec::mul_rn(float(q), sf), zf), x);
          }
        }
      } else {
        // other tiers: the codec's units into shared-memory pages of align tokens, then every element
        const int kc = kn / A;
        for (uint32_t i = threadIdx.x; i < kc * cs / 4; i += threads) reinterpret_cast<uint32_t*>(page)[i] = 0u;
        __syncthreads();
        const int units = g.unit_count();
        for (int ua = threadIdx.x; ua < kc * units; ua += threads) {
          const int ch = ua / units;
          codec::encode_unit(g, kbase + size_t(ch) * A * kstride, kstride, ua % units, page + size_t(ch) * cs,
                             codec::no_clip);
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < kn * d; idx += threads) {
          const int j = idx / d, c = idx % d;
          const float k = h2f(kbase[j * kstride + c]);
          err[j * estride + c] = codec::sub_rn(codec::decode_element(g, page + size_t(j / A) * cs, j % A, c), k);
        }
      }
    };
    if (ek >= n) errors(0, n);  // one block: once per tier, before the passes

    const int total_rows = it.q_len * group;
    const int64_t last_key = int64_t(it.first) + n;
    double acc = 0.0;
    for (int r0 = 0; r0 < total_rows; r0 += rows_per_pass) {
      const int rows = min(rows_per_pass, total_rows - r0);
      for (int idx = threadIdx.x; idx < rows_per_pass * d; idx += threads) {
        const int r = idx / d, c = idx % d, row = r0 + r;
        qs[idx] =
            r < rows ? load_any(p.q, p.q_type,
                                int64_t(it.q_row + row / group) * p.q_stride + int64_t(h * group + row % group) * d + c)
                     : 0.f;
      }
      __syncthreads();  // also orders the error table before the first pass's reads

      // z_j = s q.k_j and D_j = s q.(f(k_j) - k_j): four adjacent lanes per (key, block of 4 rows),
      // lane `quarter` over the channels 4i + quarter, summed by shuffles (the query reads are
      // broadcasts; key_pad / err_pad keep the key and error reads conflict-free). The trip count
      // is warp-uniform for the shuffles. Keys in blocks of ek (one block: the table of the tier).
      const int row_blocks = (rows + 3) / 4;
      for (int kb = 0; kb < n; kb += ek) {
        const int kn = min(ek, n - kb);
        if (ek < n) {
          errors(kb, kn);
          __syncthreads();
        }
        for (int base = 0; base < kn * row_blocks * 4; base += threads) {
          const int idx = base + int(threadIdx.x), quarter = idx % 4, pair = idx / 4;
          const int jb = pair % kn, j = kb + jb, rb = (pair / kn) * 4;
          const bool live = pair < kn * row_blocks;
          float az[4] = {0.f, 0.f, 0.f, 0.f}, ad[4] = {0.f, 0.f, 0.f, 0.f};
          if (live) {
            const uint16_t* kr = keys + j * kstride;
            const float* er = err + jb * estride;
#pragma unroll 8
            for (int i = 0; i < d / 4; ++i) {
              const int c = 4 * i + quarter;
              const float k = h2f(kr[c]), e = er[c];
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                az[r] += qs[(rb + r) * d + c] * k;
                ad[r] += qs[(rb + r) * d + c] * e;
              }
            }
          }
#pragma unroll
          for (int r = 0; r < 4; ++r)
            for (int o = 1; o < 4; o <<= 1) {
              az[r] += __shfl_xor_sync(0xffffffffu, az[r], o);
              ad[r] += __shfl_xor_sync(0xffffffffu, ad[r], o);
            }
          if (live && quarter == 0)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              if (rb + r < rows) {
                z[(rb + r) * n + j] = p.scale * az[r];
                dd[(rb + r) * n + j] = p.scale * ad[r];
              }
        }
        __syncthreads();  // (the next key block rewrites the error table)
      }

      // KL(p || softmax(z + D)) = log1p(Σ p expm1(D)) - Σ p D over the keys the row sees
      for (int r = warp; r < rows; r += warps) {
        const int64_t pos = int64_t(it.context) - it.q_len + (r0 + r) / group;  // the row's last visible key
        const int vis = int(min(last_key, pos + 1) - it.first);
        if (vis <= 0) {
          if (lane == 0) kl[r] = 0.0;
          continue;
        }
        float mx = -INFINITY;
        for (int j = lane; j < vis; j += 32) mx = fmaxf(mx, z[r * n + j]);
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        double sum = 0.0, e1 = 0.0, e2 = 0.0;
        for (int j = lane; j < vis; j += 32) {
          // exponentials in float (relative error ~1e-7, far inside the canary's use), sums in double
          const float dj = dd[r * n + j];
          const double w = double(expf(z[r * n + j] - mx));
          sum += w;
          e1 += w * double(expm1f(dj));
          e2 += w * double(dj);
        }
        sum = warp_sum(sum);
        e1 = warp_sum(e1);
        e2 = warp_sum(e2);
        if (lane == 0) kl[r] = fmax(log1p(e1 / sum) - e2 / sum, 0.0);  // rounding can give -1e-17
      }
      __syncthreads();
      if (threadIdx.x == 0)
        for (int r = 0; r < rows; ++r) acc += kl[r];  // in row order: deterministic
      __syncthreads();  // qs, z, dd (next pass) and the error table (next tier) are rewritten
    }
    if (threadIdx.x == 0) p.out[(size_t(blockIdx.y) * p.kv_heads + h) * p.tiers + t] = acc;
  }
}

}  // namespace

size_t canary_smem_bytes(std::span<const format_id> tiers, int align, int head_dim, int keys, int error_keys) {
  size_t page = 0;
  for (format_id f : tiers) page = std::max(page, chunk_bytes(f, align, head_dim));
  const int ek = error_keys > 0 ? std::min(error_keys, keys) : keys;
  const size_t chunks = size_t(ek / std::max(align, 1));
  const size_t staged = ((size_t(keys) * (head_dim + key_pad) + 1) & ~size_t(1)) * 2;  // fp16 keys, padded rows
  const size_t errors = size_t(ek) * (head_dim + err_pad) * 4;
  return chunks * page + staged + errors + size_t(rows_per_pass) * head_dim * 4 + 2 * size_t(rows_per_pass) * keys * 4 +
         rows_per_pass * sizeof(double);
}

namespace {

// The keys of the error table a launch holds: the whole window where it fits `optin` bytes of
// shared memory, else the largest multiple of align that does (0: not even one group fits).
int error_block_keys(const canary_args& a, int optin) {
  for (int ek = a.window; ek >= a.align; ek -= a.align)
    if (canary_smem_bytes(a.tiers, a.align, a.head_dim, a.window, ek) <= size_t(optin)) return ek;
  return 0;
}

result<int> device_optin() {
  int dev = 0, optin = 0;
  KVQ_TRY(cuda_status(cudaGetDevice(&dev), "cudaGetDevice"));
  KVQ_TRY(cuda_status(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                      "cudaDeviceGetAttribute"));
  return optin;
}

}  // namespace

status canary_can_implement(const canary_args& a) {
  const auto bad = [](std::string m) { return status{errc::unsupported, "canary: " + std::move(m)}; };
  if (a.kv_heads <= 0 || a.q_heads <= 0 || a.q_heads % a.kv_heads != 0)
    return bad(msg(a.q_heads, " query heads over ", a.kv_heads, " kv heads do not form whole GQA groups"));
  if (a.head_dim <= 0 || a.head_dim % 32 != 0 || a.head_dim > 256)
    return bad(msg("head_dim ", a.head_dim, " is not a multiple of 32 in [32, 256]"));
  if (a.tiers.empty() || a.tiers.size() > size_t(max_canary_tiers))
    return bad(msg(a.tiers.size(), " tiers; the kernel measures 1 to ", max_canary_tiers));
  if (a.align <= 0 || a.window <= 0 || a.window % a.align != 0)
    return bad(msg("token group ", a.align, " does not divide the window of ", a.window, " tokens"));
  for (format_id f : a.tiers)
    if (status s = check_shape(f, role::k, a.align, a.head_dim); !s.ok())
      return bad(msg("tier ", format_name(f), " cannot encode groups of ", a.align, " tokens: ", s.message()));
  const result<int> optin = device_optin();
  if (!optin) return optin.error();
  if (error_block_keys(a, *optin) == 0)
    return bad(msg("a window of ", a.window, " tokens at head_dim ", a.head_dim, " needs at least ",
                   canary_smem_bytes(a.tiers, a.align, a.head_dim, a.window, a.align),
                   " bytes of shared memory per block; the device offers ", *optin, " (use a smaller window)"));
  for (size_t i = 0; i < a.items.size(); ++i) {
    const canary_item& it = a.items[i];
    if (it.keys <= 0 || it.keys > a.window || it.keys % a.align != 0 || it.first < 0 || it.first % a.align != 0 ||
        it.q_len < 1 || it.context < it.first + it.keys)
      return bad(msg("item ", i, " measures keys [", it.first, ", ", int64_t(it.first) + it.keys, ") of a context of ",
                     it.context, " with q_len ", it.q_len, "; need whole aligned groups of ", a.align,
                     " tokens within the window of ", a.window));
  }
  return {};
}

status canary_run(const canary_args& a, void* stream) {
  KVQ_TRY(canary_can_implement(a));
  if (a.items.empty()) return {};
  const result<int> optin = device_optin();
  if (!optin) return optin.error();
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  canary_params p{};
  p.q_heads = a.q_heads;
  p.kv_heads = a.kv_heads;
  p.head_dim = a.head_dim;
  p.window = a.window;
  p.align = a.align;
  p.tiers = int(a.tiers.size());
  p.ring_head_stride = a.ring_head_stride;
  p.error_keys = error_block_keys(a, *optin);
  p.scale = a.scale;
  p.q = a.q;
  p.q_type = a.q_type;
  p.q_stride = a.q_stride > 0 ? a.q_stride : int64_t(a.q_heads) * a.head_dim;
  for (int t = 0; t < p.tiers; ++t) {
    p.tier_fmt[t] = a.tiers[size_t(t)];
    p.chunk_stride[t] = uint32_t(chunk_bytes(a.tiers[size_t(t)], a.align, a.head_dim));
  }
  for (size_t i0 = 0; i0 < a.items.size(); i0 += max_items) {
    const int count = int(std::min<size_t>(max_items, a.items.size() - i0));
    int keys = 0;
    for (int i = 0; i < count; ++i) {
      p.items[i] = a.items[i0 + size_t(i)];
      keys = std::max(keys, p.items[i].keys);
    }
    p.n_items = count;
    p.out = a.out + i0 * size_t(a.kv_heads) * a.tiers.size();
    const size_t smem = canary_smem_bytes(a.tiers, a.align, a.head_dim, keys, p.error_keys);
    // The opt-in belongs to the current device: set on every launch (a host call), as attend does.
    KVQ_TRY(detail::set_max_dynamic_smem(canary_kernel, int(smem)));
    KVQ_TRY(launch("canary launch", canary_kernel, dim3(unsigned(a.kv_heads), unsigned(count)), dim3(threads), smem, st, p));
  }
  return {};
}

}  // namespace cuda
KVQ_NAMESPACE_END
