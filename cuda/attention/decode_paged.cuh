#pragma once
// The block-staged decode kernel `decode_paged_kernel`: layers of at most 8 bits, whole pages in
// stages shared by the block's warps.
#include "attention/decode_step.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// ---- the block-staged decode kernel: layers of at most 8 bits ---------------------------------
// The block's pages go whole through a ring of `p.stages` page stages shared by its warps: one
// bulk copy per page (a page-head's K and V blocks are contiguous), where the per-warp chunk
// stages took six per 32 tokens (K and V codes, scales, zeros), each a loop over lanes in the
// compiled code. Warp w takes the 32-token chunks w, w + 4, ... of the block's page slabs. Each
// stage has full barriers (the copy's bytes; one for its even and one for its odd fills) and an
// empty one (every lane of the page's warps arrives when done with it); the warp of a page's last
// chunk waits for the others (working on the same page at the same time) and refills the stage
// with the page `stages` further on. The
// FP16 ring's slabs follow, one per warp in turn. Pages wider than the stages are read from
// global memory.

// Issues the bulk copy of the block's page e (relative) into a page stage: the page-head's K and
// V blocks, or the one of them whose format the stages hold, or nothing (the barrier still
// completes its phase). What is copied starts at the stage's start: a staged V block whose K is
// wider than the stages goes there (its `page_table_cache::v_offset` is 0), not at its offset in
// the page-head, which would run past the stage (a stage holds the largest staged K and V blocks,
// not a wider K).
template <int D>
__device__ __forceinline__ void issue_page(const attend_params& p, const page_table_cache& pc, int e, uint32_t stage, uint32_t bar) {
  const uint32_t bytes = pc.copy_bytes[e];
  mbar_expect_tx(bar, bytes);
  if (bytes) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the warps' reads of the stage's last page
    bulk_copy(stage, p.pages + size_t(pc.page16[e]) * 16 + pc.copy_from[e], bytes, bar);
  }
}

// TwoFull: two full barriers per stage (rings whose warp pairs take a stage's pages in turn; below).
// Whole: the caller says each kv head's pages have one format pair (`attend_args::
// one_format_per_head`): blocks of 4/2-bit pages of one pair read whole 64-token units per step
// (`pages`, below). An instance of its own: compiled into one kernel with the per-page dispatch,
// it made that dispatch 2-5 % slower (register allocation), and a decode step over mixed layers
// (EchoKV's tiers over time) 6-7 % slower. Wide: the instance of a 16-bit stage plan
// (`decode_step`; not with Whole). Rules: the instance of a layer with a sliding window or
// soft-capping (`launch_plan::rules`; Whole: the window only, never soft-capped). Three: the
// instance of a layer whose 3-bit pages are among other formats (`launch_plan::three`; not with
// Whole or Wide): its per-page dispatch has the 3-bit kinds' cases (`kind::dispatch3`), and blocks
// of one 3-bit pair run their chunk loops. (In the other instances those cases made layers without
// 3-bit pages 5-14 % slower: register allocation, stack 168 -> 280 bytes.)
template <int D, bool TwoFull, bool Whole, bool Wide, bool Rules, bool Three = false>
__global__ void __launch_bounds__(dec_warps * 32, (decode_blocks<D, Wide>))
    decode_paged_kernel(const __grid_constant__ attend_params p) {
  static_assert(!(Three && (Whole || Wide)), "the Three instances: narrow stages, no whole units");
  pdl_trigger();
  constexpr int Cap = 8;
  extern __shared__ __align__(128) uint8_t dsm[];
  staged_head<D>& sm = *reinterpret_cast<staged_head<D>*>(dsm);
  uint8_t* stages = dsm + staged_head_bytes<D>;
  const int h = blockIdx.y, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);  // (known warp-uniform: uniform registers)
  decode_item item;
  if (!load_item(p, int(blockIdx.z), item)) return;  // (a replayed step: blocks past its items exit)
  const slab_range rg = block_slabs(p, item, 0);  // (the block's range; warps interleave below)
  if (rg.c0 >= rg.c1) return;
  const int P = p.kv.page_tokens, page_slabs = rg.page_slabs, c0 = rg.c0;  // c0: on a page boundary
  const int pc_end = max(c0, min(rg.c1, page_slabs));  // the block's page slabs: [c0, pc_end)
  const int n_chunks = (pc_end - c0 + 1) / 2, cpp = P / (2 * slab), n_pages = ceil_div(n_chunks, cpp);
  const int ns = p.stages;
  const uint32_t st_bytes = p.page_stage, stages_s = smem_addr(stages);
  // Per stage: a full barrier (TwoFull: one for its even and one for its odd fills) and an empty
  // barrier. Page e of the block goes to the warps of its chunks, e x cpp .. e x cpp + cpp - 1
  // (mod 4). With stages x cpp a multiple of 4, every page of a stage goes to the same warps;
  // otherwise (8-bit page-heads on 3 stages) two warp pairs take a stage's pages in turn. A parity
  // wait cannot tell a barrier's phase from the one two before it, so a pair that came to its next
  // page of a stage before the other pair's page there had landed would pass a single full
  // barrier's wait; with one barrier per fill parity, each barrier's phases belong to one pair,
  // which waits for them in order. (An empty barrier's waiter, the page's last warp, is one of its
  // arrivers, and the previous fill was released before this one was issued: it waits on the
  // current phase.) The single-barrier instance is kept for the other rings: the two-barrier code
  // measured 3-4 % slower on 4-bit layers (register allocation).
  const uint32_t bars = smem_addr(&sm.bar[0][0]), bars_empty = smem_addr(&sm.bar[1][0]), bars_odd = smem_addr(&sm.bar[2][0]);
  const auto full_bar = [&](int stage, int fill) {
    if constexpr (TwoFull) return (fill & 1 ? bars_odd : bars) + uint32_t(stage) * 8;
    else return bars + uint32_t(stage) * 8;
  };
  const auto full_parity = [](int fill) { return uint32_t(TwoFull ? fill >> 1 : fill) & 1u; };
  uint32_t qb[D / 8];
  staged_start<D>(p, item, h, rg, warp, g, t, lane, sm, qb);
  // Layers of one format (a static policy's) mostly: a block whose pages all have the same staged
  // K and V kinds runs code compiled for those kinds (the rings' common kinds: 8-bit (two full
  // barriers) kivi8, sym8, fp8; 4/2-bit kivi4, kivi2, sym4, sym2, cb4, cb2, fp4 and KIVI's K4V2): whole 64-token
  // units per step (`pages`, the Whole instance, page_tokens 64 and up), else 32-token chunks
  // (`chunks`). Blocks of one 3-bit pair (kivi3, sym3: `three_bit_pairs`) run chunk loops of their
  // own in the Whole instance and the Three instances, the only code that reads 3-bit pages staged
  // (the host plans them for such layers: `head_kernel_bits`, `attend_args::three_bit_pages`);
  // the Three instances of one full barrier also compile one for a 3-bit V beside a 4-bit K
  // (`three_bit_mixed_pairs`). Other blocks run 32-token chunks that dispatch on each page's kinds, with 3-bit cases in the
  // Three instances only.
  // (16-bit pages: `wide_pair` where every page of the block has 16-bit K and V)
  const auto uniform_kinds = [&]() {  // the (K kind, V kind) of every page of the block, both staged; else -1
    bool same = true;
    for (int i = threadIdx.x; i < n_pages; i += dec_warps * 32)
      same = same && sm.pages.kk[i] == sm.pages.kk[0] && sm.pages.kv[i] == sm.pages.kv[0] &&
             (!Wide || ((sm.pages.kk[i] >= 0 || sm.pages.fk[i].bits == 16) && (sm.pages.kv[i] >= 0 || sm.pages.fv[i].bits == 16)));
    if constexpr (!Wide) {  // (stages of at most 8 bits hold pages with a kind only)
      const bool uni = __syncthreads_and(same) && n_pages > 0 && sm.pages.fk[0].bits <= p.stage_cap &&
                       sm.pages.fv[0].bits <= p.stage_cap;
      return uni ? kind_pair(sm.pages.kk[0], sm.pages.kv[0]) : no_combo;
    }
    const bool uni = __syncthreads_and(same) && n_pages > 0 && stages_hold(sm.pages.fk[0], sm.pages.kk[0], p.stage_cap) &&
                     stages_hold(sm.pages.fv[0], sm.pages.kv[0], p.stage_cap);
    if (!uni) return no_combo;
    if (sm.pages.kk[0] < 0 || sm.pages.kv[0] < 0) return sm.pages.kk[0] < 0 && sm.pages.kv[0] < 0 ? wide_pair : no_combo;
    return kind_pair(sm.pages.kk[0], sm.pages.kv[0]);
  };
  int kinds = no_combo;
  bool whole = false;
  if constexpr (Whole) {
    __syncthreads();  // the page table
    kinds = uniform_kinds();
    // Whole units need a stage in flight beyond the pages the 4 warps hold (4/2-bit rings: 6-8
    // stages of one page each at page_tokens 64). 8-bit rings (3 stages, two full barriers)
    // measured 8-10 % slower with them: they run 32-token chunks compiled per kind (`chunks`).
    whole = P >= 4 * slab && ns * (P / (4 * slab)) > dec_warps &&
            has_whole_units(kinds);
  }
  // Units per page: 32-token chunks, or 64-token units for `pages`. With 64-token units, the pages
  // of a stage may go to up to four warps in turn: its fill f has full barrier row f mod 4, each
  // row's phases belong to one warp (or one pair at page_tokens 128), which waits for them in order.
  const int upp = whole ? P / (4 * slab) : cpp;
  const auto quad_bar = [&](int stage, int fill) {
    const int r = fill & 3;
    return bars + uint32_t((r == 0 ? 0 : r + 1) * max_stages + stage) * 8;
  };
  // Lane 0 of the warp of a page's last chunk issues the page's copy and arms its stage's full
  // barrier.
  const auto last_chunk = [&](int e) { return (e + 1) * upp - 1; };
  const auto issuer = [&](int e) { return last_chunk(e) % dec_warps; };
  if (warp == 0) {  // (a warp-uniform branch first: the init's loop over lanes must not run in other warps)
    if (lane < ns) {
      mbar_init(bars + lane * 8, 1);
      if (TwoFull || whole) mbar_init(bars_odd + lane * 8, 1);
      if (whole) {
        mbar_init(bars + (3 * max_stages + lane) * 8, 1);
        mbar_init(bars + (4 * max_stages + lane) * 8, 1);
      }
      mbar_init(bars_empty + lane * 8, uint32_t(32 * upp));
    }
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();
  if (lane == 0)
    for (int e = 0; e < min(ns, n_pages); ++e)
      if (issuer(e) == warp) issue_page<D>(p, sm.pages, e, stages_s + e * st_bytes, full_bar(e, 0));

  int q_key = -2;  // the KIVI token group (its first token) whose scales qb holds; -1: the plain query
  column_state<D> cs(p, item, t);
  bool worked = false;
  // The chunks of the block's pages, compiled for one (K kind, V kind) where KK, KV are kinds (every
  // page of the block of those kinds, both staged), else dispatching on each page's kinds.
  const auto chunks = [&]<int KK, int KV>() __attribute__((always_inline)) {
    // The warp's chunk u is in the block's page e = u / cpp, which is in stage st = e % ns, its fill
    // e / ns: kept as counters (pages advance by at most 4 / cpp <= 2 < ns per step), not divided
    // anew per chunk (a division by a runtime value is ~20 dependent instructions with a MUFU).
    const int lg_cpp = log2i(cpp);
    int e = warp >> lg_cpp, st = e % ns, fill = e / ns;
    for (int u = warp; u < n_chunks; u += dec_warps) {
      const int j = c0 + 2 * u;
      slab_ref cur;
      cur.tok0 = j * slab;
      cur.fk = sm.pages.fk[e], cur.fv = sm.pages.fv[e], cur.kk = sm.pages.kk[e], cur.kv = sm.pages.kv[e];
      cur.k = p.pages + size_t(sm.pages.page16[e]) * 16;  // (used by the unstaged paths only)
      cur.v = cur.k + sm.pages.v_offset[e];
      cur.ring = false;
      cur.row0 = cur.tok0 & (P - 1);
      mbar_wait(full_bar(st, fill), full_parity(fill));
      // (narrower instances: no page read by element, so the width alone says what the stages hold)
      const bool k_st = !per_page(KK) || (Wide ? stages_hold(cur.fk, cur.kk, p.stage_cap) : cur.fk.bits <= p.stage_cap),
                 v_st = !per_page(KV) || (Wide ? stages_hold(cur.fv, cur.kv, p.stage_cap) : cur.fv.bits <= p.stage_cap);
      slab_ref sk = cur;
      sk.k = stages + st * st_bytes, sk.v = sk.k + sm.pages.v_offset[e];
      if (j + 1 < pc_end && k_st && v_st) {  // the chunk's two slabs as one step
        cur.valid = sk.valid = min(2 * slab, item.from_pages - cur.tok0);
        decode_step<D, Cap, KK, KV, Wide, Rules, Rules && !Whole>(p, cur, sk, P, true, k_st, v_st, true, g, t, lane, sm.qh, qb, q_key, cs);
      } else {
        for (int i = 0; i < 2 && j + i < pc_end; ++i) {
          slab_ref c1 = cur, s1 = sk;
          c1.tok0 = cur.tok0 + slab * i, c1.row0 = s1.row0 = cur.row0 + slab * i;
          c1.valid = s1.valid = min(slab, item.from_pages - c1.tok0);
          decode_step<D, Cap, KK, KV, Wide, Rules, Rules && !Whole>(p, c1, s1, P, true, k_st, v_st, false, g, t, lane, sm.qh, qb, q_key, cs);
        }
      }
      worked = true;
      __syncwarp();  // every lane is done with this chunk's rows of the stage
      if (e + ns < n_pages) {  // the page's warps release its stage; the warp of its last chunk refills it
        mbar_arrive(bars_empty + st * 8);  // every lane: an arrive releases its own thread's reads only
        if ((u & (cpp - 1)) == cpp - 1) {  // u == last_chunk(e) (in warp issuer(e))
          mbar_wait(bars_empty + st * 8, uint32_t(fill) & 1u);
          if (lane == 0) issue_page<D>(p, sm.pages, e + ns, stages_s + st * st_bytes, full_bar(st, fill + 1));
        }
      }
      const int e_next = (u + dec_warps) >> lg_cpp;
      st += e_next - e, e = e_next;
      if (st >= ns) st -= ns, ++fill;
    }
  };
  // Whole 64-token units of a block whose pages all have one (K kind, V kind), both staged: one
  // online-softmax update per unit (four slabs), half the per-step work of 32-token chunks. Warp w
  // takes units w, w + 4, ...; at page_tokens 64 a unit is its page. HeadScale: codebook pages
  // whose K and V scales are whole-head (group 0): the scales multiply the scores and P, not
  // every level (`scores_kind`, `values_kind`).
  const auto pages = [&]<int KK, int KV, bool HeadScale = false>() __attribute__((always_inline)) {
    constexpr family FK = kind_family(KK), FV = kind_family(KV);
    constexpr int BK = kind_bits(KK), BV = kind_bits(KV);
    float fold = 0.f;  // (HeadScale: `head_fold`)
    constexpr bool Sub = FK == family::kivi && BK <= 4;  // keys as subnormal codes (`k_frags_sub`): scores x 2^-24
    const float scale_log2 = Sub ? p.scale_log2 * 0x1p24f : p.scale_log2;
    const int lg_upp = log2i(upp), n_units = ceil_div(pc_end - c0, 4), wnd = p.kv.window;
    int e = warp >> lg_upp, st = e % ns, fill = e / ns;
    // (KIVI: each half's zero-point offsets start its score accumulators; -0 adds as nothing)
    cs.cz[0] = cs.cz[1] = -0.f;
    for (int u = warp; u < n_units; u += dec_warps) {
      const int tok0 = (c0 + 4 * u) * slab, valid = min(4 * slab, item.from_pages - tok0);
      mbar_wait(quad_bar(st, fill), uint32_t(fill >> 2) & 1u);
      const format_traits fk = sm.pages.fk[e];
      slab_ref sk;
      sk.k = stages + st * st_bytes, sk.v = sk.k + sm.pages.v_offset[e];
      sk.tok0 = tok0, sk.row0 = tok0 & (P - 1), sk.valid = valid, sk.ring = false;
      float sc[16], rs[8], pv[16];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {  // two 32-token halves (KIVI g32: a token group each)
        slab_ref sh = sk;
        sh.row0 = sk.row0 + 2 * slab * hf;
        float part[8], prs[4] = {1.f, 1.f, 1.f, 1.f}, cz[2] = {0.f, 0.f};
        if constexpr (FK == family::kivi) {
          const int lgk = log2i(fk.group);
          const uint8_t* ks = sk.k + P * (uint32_t(D * BK) >> 3) + uint32_t(sh.row0 >> lgk) * D * 2;
          fold_kivi<D, Sub ? BK : 0>(ks, ks + uint32_t(P >> lgk) * D * 2, BK, sm.qh, lane, t, qb, cz);
        }
        const float czs = Sub ? 0x1p-24f : 1.f;
        scores_kind<D, Cap, FK, BK, 2, Sub, HeadScale>(sh, HeadScale ? uint16_t(0) : fk.group, P, wnd, g, t, qb, part, prs, valid - 2 * slab * hf,
                                                       make_float2(cz[0] * czs, cz[1] * czs));
#pragma unroll
        for (int i = 0; i < 8; ++i) sc[8 * hf + i] = part[i];
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[4 * hf + i] = prs[i];
      }
      softmax_tiles<D, 4, Rules, false>(p, sc, rs, scale_log2, tok0, valid, g, cs, pv);
      values_kind<D, Cap, FV, BV, 4, HeadScale>(sk, HeadScale ? uint16_t(0) : sm.pages.fv[e].group, P, wnd, g, t, pv, valid, cs.acc, &fold);
      worked = true;
      __syncwarp();  // every lane is done with this unit's rows of the stage
      if (e + ns < n_pages) {  // the page's warps release its stage; the warp of its last unit refills it
        mbar_arrive(bars_empty + st * 8);
        if ((u & (upp - 1)) == upp - 1) {
          mbar_wait(bars_empty + st * 8, uint32_t(fill) & 1u);
          if (lane == 0) issue_page<D>(p, sm.pages, e + ns, stages_s + st * st_bytes, quad_bar(st, fill + 1));
        }
      }
      const int e_next = (u + dec_warps) >> lg_upp;
      st += e_next - e, e = e_next;
      while (st >= ns) st -= ns, ++fill;
    }
    q_key = -2;  // qb holds a token group's fold
    if constexpr (HeadScale) head_unfold<D>(fold, cs.acc);
  };
  // Whether every page of the block has whole-head K and V scales (group 0; the HeadScale units).
  const auto head_scales = [&]() {
    bool ok = true;
    for (int i = threadIdx.x; i < n_pages; i += dec_warps * 32) ok = ok && sm.pages.fk[i].group == 0 && sm.pages.fv[i].group == 0;
    return __syncthreads_and(ok) != 0;
  };
  static_assert(!(Whole && Wide), "whole units: 4- and 2-bit pages");
  if constexpr (Wide) {
    // A 16-bit stage plan: blocks of 16-bit pages only run the chunk loop compiled for them.
    if (uniform_kinds() == wide_pair) chunks.template operator()<kind::staged16, kind::staged16>();
    else chunks.template operator()<kind::dispatch, kind::dispatch>();
  } else if constexpr (Whole) {
    // (every pair of `whole_unit_pairs` and `three_bit_pairs` has its case: `listed_pair`)
    static_assert(whole_unit_pairs::size == 8 && three_bit_pairs::size == 2, "a pair without its case here");
    switch (whole || in_kind_pairs(three_bit_pairs{}, kinds) ? kinds : no_combo) {
      case listed_pair<whole_unit_pairs, kind::kivi4, kind::kivi4>: pages.template operator()<kind::kivi4, kind::kivi4>(); break;
      case listed_pair<whole_unit_pairs, kind::kivi2, kind::kivi2>: pages.template operator()<kind::kivi2, kind::kivi2>(); break;
      case listed_pair<whole_unit_pairs, kind::kivi4, kind::kivi2>: pages.template operator()<kind::kivi4, kind::kivi2>(); break;
      case listed_pair<whole_unit_pairs, kind::sym4, kind::sym4>: pages.template operator()<kind::sym4, kind::sym4>(); break;
      case listed_pair<whole_unit_pairs, kind::sym2, kind::sym2>: pages.template operator()<kind::sym2, kind::sym2>(); break;
      case listed_pair<whole_unit_pairs, kind::cb4, kind::cb4>:
        if (head_scales()) pages.template operator()<kind::cb4, kind::cb4, true>();
        else pages.template operator()<kind::cb4, kind::cb4>();
        break;
      case listed_pair<whole_unit_pairs, kind::cb2, kind::cb2>:
        if (head_scales()) pages.template operator()<kind::cb2, kind::cb2, true>();
        else pages.template operator()<kind::cb2, kind::cb2>();
        break;
      case listed_pair<whole_unit_pairs, kind::fp4, kind::fp4>: pages.template operator()<kind::fp4, kind::fp4>(); break;
      // (3-bit pairs: no whole units, their chunk loops)
      case listed_pair<three_bit_pairs, kind::kivi3, kind::kivi3>: chunks.template operator()<kind::kivi3, kind::kivi3>(); break;
      case listed_pair<three_bit_pairs, kind::sym3, kind::sym3>: chunks.template operator()<kind::sym3, kind::sym3>(); break;
      default: chunks.template operator()<kind::dispatch, kind::dispatch>(); break;  // (a block of mixed pages: the hint was wrong)
    }
  } else {
    // A block whose pages all have the same staged K and V kinds runs the chunk loop compiled for
    // them (no dispatch per step): the pairs of `eight_bit_pairs` in the two-full-barrier ring,
    // those of `whole_unit_pairs` otherwise, and in the Three instances `three_bit_pairs` and
    // `three_bit_mixed_pairs`; other blocks dispatch per page (Three: `kind::dispatch3`).
    constexpr int Disp = Three ? kind::dispatch3 : kind::dispatch;
    kinds = uniform_kinds();
    bool done = false;
    if constexpr (Three) {
      static_assert(three_bit_pairs::size == 2 && three_bit_mixed_pairs::size == 1, "a pair without its case here");
      done = true;
      if (kinds == listed_pair<three_bit_pairs, kind::kivi3, kind::kivi3>) chunks.template operator()<kind::kivi3, kind::kivi3>();
      else if (kinds == listed_pair<three_bit_pairs, kind::sym3, kind::sym3>) chunks.template operator()<kind::sym3, kind::sym3>();
      // (kivi4 K + kivi3 V: 4-bit stages, which are never two_full at page_tokens 64 and up; in the
      // TwoFull instance, whose 3- and 8-bit stripes its code made slower, those blocks dispatch)
      else if constexpr (!TwoFull) {
        if (kinds == listed_pair<three_bit_mixed_pairs, kind::kivi4, kind::kivi3>) chunks.template operator()<kind::kivi4, kind::kivi3>();
        else done = false;
      } else {
        done = false;
      }
    }
    if (done) {
    } else if constexpr (TwoFull) {
      static_assert(eight_bit_pairs::size == 3, "a pair without its case here");
      switch (kinds) {
        case listed_pair<eight_bit_pairs, kind::kivi8, kind::kivi8>: chunks.template operator()<kind::kivi8, kind::kivi8>(); break;
        case listed_pair<eight_bit_pairs, kind::sym8, kind::sym8>: chunks.template operator()<kind::sym8, kind::sym8>(); break;
        case listed_pair<eight_bit_pairs, kind::fp8, kind::fp8>: chunks.template operator()<kind::fp8, kind::fp8>(); break;
        default: chunks.template operator()<Disp, Disp>(); break;
      }
    } else {
      static_assert(whole_unit_pairs::size == 8, "a pair without its case here");
      switch (kinds) {
        case listed_pair<whole_unit_pairs, kind::kivi4, kind::kivi4>: chunks.template operator()<kind::kivi4, kind::kivi4>(); break;
        case listed_pair<whole_unit_pairs, kind::kivi2, kind::kivi2>: chunks.template operator()<kind::kivi2, kind::kivi2>(); break;
        case listed_pair<whole_unit_pairs, kind::kivi4, kind::kivi2>: chunks.template operator()<kind::kivi4, kind::kivi2>(); break;
        case listed_pair<whole_unit_pairs, kind::sym4, kind::sym4>: chunks.template operator()<kind::sym4, kind::sym4>(); break;
        case listed_pair<whole_unit_pairs, kind::sym2, kind::sym2>: chunks.template operator()<kind::sym2, kind::sym2>(); break;
        case listed_pair<whole_unit_pairs, kind::cb4, kind::cb4>: chunks.template operator()<kind::cb4, kind::cb4>(); break;
        case listed_pair<whole_unit_pairs, kind::cb2, kind::cb2>: chunks.template operator()<kind::cb2, kind::cb2>(); break;
        case listed_pair<whole_unit_pairs, kind::fp4, kind::fp4>: chunks.template operator()<kind::fp4, kind::fp4>(); break;
        default: chunks.template operator()<Disp, Disp>(); break;
      }
    }
  }
  for (int j = max(c0, page_slabs) + warp; j < rg.c1; j += dec_warps) {  // the FP16 ring
    const slab_ref cur = locate_slab<D>(p, item, h, j, page_slabs, sm.pages);
    decode_step<D, Cap, kind::dispatch, kind::dispatch, false, Rules, Rules && !Whole>(p, cur, cur, P, true, false, false, false, g, t, lane, sm.qh, qb, q_key, cs);
    worked = true;
  }
  __syncthreads();  // the merge area overlays the stages (every page issued was waited for)
  write_partial<D>(p, *reinterpret_cast<merge_area<D>*>(stages), cs, worked, warp, g, t);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
