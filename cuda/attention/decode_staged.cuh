#pragma once
// The per-warp staged decode kernel `decode_kernel`: layers whose page-heads leave room for fewer
// than 3 page stages.
#include "attention/decode_step.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// ---- the staged decode kernel ------------------------------------------------------------------
// Each warp streams its slabs through a ring of `stages` per-warp stages in shared memory, filled by
// the bulk-copy engine (cp.async.bulk, one instruction per section, completion counted in bytes
// by one mbarrier per stage): no addresses per lane and no register prefetch. A stage holds one
// page slab's K as a 16-row page (codes, then sym/fp8 parameter rows, or the KIVI token group's
// scales and zeros, D halves each) and, at `stage_k_bytes`, its V as a 16-row page (codes, scales
// rows, zeros rows). Slabs whose format is wider than the
// stages (a stray 16-bit page, an 8-bit page under a 4-bit stage plan) and the FP16 ring are read
// from global memory where they are used. Wide: the instance of a 16-bit stage plan (`decode_step`).

// One slab per stage (layers whose page-heads leave room for fewer than 3 page stages, e.g. 8 bits
// at page_tokens 128, 16 bits at head_dim 256 and page_tokens 128; the block-staged kernel takes the others). With the two-slab step compiled
// in, this path measured 3-10 % slower (one register allocation for both). `Rules`: the
// instance of a layer with a sliding window or soft-capping (`launch_plan::rules`). Three: the
// instance of a layer with 3-bit kind pages (`launch_plan::three`; narrow stages, never Wide):
// its stages hold them as 16-row 3-bit pages (both planes, `section_copy::bit_plane`), its
// per-page dispatch has their cases (`kind::dispatch3`).
template <int D, bool Wide, bool Rules, bool Three = false>
__global__ void __launch_bounds__(dec_warps * 32, (decode_blocks<D, Wide>))
    decode_kernel(const __grid_constant__ attend_params p) {
  static_assert(!(Three && Wide), "the Three instances: narrow stages");
  constexpr int Disp = Three ? kind::dispatch3 : kind::dispatch;
  pdl_trigger();
  constexpr int Cap = 8;
  extern __shared__ __align__(128) uint8_t dsm[];
  staged_head<D>& sm = *reinterpret_cast<staged_head<D>*>(dsm);
  uint8_t* stages = dsm + staged_head_bytes<D>;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  decode_item item;
  if (!load_item(p, int(blockIdx.z), item)) return;  // (a replayed step: blocks past its items exit)
  const slab_range rg = block_slabs(p, item, warp);
  if (rg.c0 >= rg.c1) return;
  const int P = p.kv.page_tokens, page_slabs = rg.page_slabs, s0 = rg.s0, s1 = rg.s1;
  const int ns = p.stages, rows = slab;
  const uint32_t st_bytes = stage_bytes(D, p.stage_cap), st_v = stage_k_bytes(D, p.stage_cap);
  uint8_t* my_stages = stages + uint32_t(warp * ns) * st_bytes;
  const uint32_t my_stages_s = smem_addr(my_stages), my_bars = smem_addr(&sm.bar[warp][0]);
  uint32_t qb[D / 8];
  staged_start<D>(p, item, h, rg, warp, g, t, lane, sm, qb);
  for (int i = threadIdx.x; i < int(format_count) * 6; i += dec_warps * 32)
    sm.sect[i / 6][i / 3 % 2][i % 3] = chunk_section(format_id(i / 6), i / 3 % 2, i % 3, D, P, p.stage_cap);
  if (lane < ns) mbar_init(my_bars + lane * 8, 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();

  // prologue: the first ns - 1 page slabs in flight
  const int issue_end = min(s1, page_slabs);
  int issue_j = s0, issue_st = 0;
  for (; issue_j < issue_end && issue_st < ns - 1; ++issue_j, ++issue_st)
    issue_chunk<D, Three>(p, sm.pages, sm.sect, issue_j, issue_j == s0, lane, my_stages_s + issue_st * st_bytes, my_bars + issue_st * 8);
  if (issue_st == ns) issue_st = 0;

  int q_key = -2;  // the KIVI token group (its first token) whose scales qb holds; -1: the plain query
  column_state<D> cs(p, item, t);
  int cur_st = 0, cur_e = -1;
  uint32_t phases = 0;  // bit s: parity of stage s's next phase
  format_traits pk{}, pv_fmt{};  // the current page's formats (kept across its slabs)
  int8_t pkk = kind::wide, pvk = kind::wide;     // and their kinds
  for (int j = s0; j < s1; ++j) {
    if (issue_j < issue_end) {  // refill the stage the previous slab freed
      issue_chunk<D, Three>(p, sm.pages, sm.sect, issue_j, false, lane, my_stages_s + issue_st * st_bytes, my_bars + issue_st * 8);
      ++issue_j;
      if (++issue_st == ns) issue_st = 0;
    }
    slab_ref cur;
    if (j < page_slabs) {  // the page's formats are read only when the page changes
      cur.tok0 = j * slab;
      const int e = (cur.tok0 >> log2i(P)) - sm.pages.first_page;
      if (e != cur_e) cur_e = e, pk = sm.pages.fk[e], pv_fmt = sm.pages.fv[e], pkk = sm.pages.kk[e], pvk = sm.pages.kv[e];
      cur.fk = pk, cur.fv = pv_fmt, cur.kk = pkk, cur.kv = pvk;
      cur.k = p.pages + size_t(sm.pages.page16[e]) * 16;  // (used by the unstaged paths only)
      cur.v = cur.k + sm.pages.v_offset[e];
      cur.ring = false;
      cur.row0 = cur.tok0 & (P - 1);
      mbar_wait(my_bars + cur_st * 8, (phases >> cur_st) & 1u);
      phases ^= 1u << cur_st;
    } else {
      cur = locate_slab<D>(p, item, h, j, page_slabs, sm.pages);
    }
    const format_traits fk = cur.fk, fv = cur.fv;
    const uint8_t* st = my_stages + cur_st * st_bytes;
    // (narrower instances: no page read by element, so the width alone says what the stages hold)
    const bool k_st = !cur.ring && (Wide ? stages_hold(fk, cur.kk, p.stage_cap) : fk.bits <= p.stage_cap),
               v_st = !cur.ring && (Wide ? stages_hold(fv, cur.kv, p.stage_cap) : fv.bits <= p.stage_cap);
    if (!cur.ring) cur.valid = min(slab, item.from_pages - cur.tok0);
    // the slab in its stage: a 16-row page
    slab_ref sk = cur;
    sk.k = st, sk.v = st + st_v, sk.row0 = 0;

    decode_step<D, Cap, Disp, Disp, Wide, Rules, Rules>(p, cur, sk, rows, false, k_st, v_st, false, g, t, lane, sm.qh, qb, q_key, cs);
    __syncwarp();  // every lane is done with this step's rows of the stage
    if (!cur.ring && ++cur_st == ns) cur_st = 0;
  }
  __syncthreads();  // the merge area overlays every warp's stages (all their copies were waited for)
  write_partial<D>(p, *reinterpret_cast<merge_area<D>*>(stages), cs, s0 < s1, warp, g, t);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
