#pragma once
// The wide decode kernel `decode_wide_kernel`: layers that may hold a 16-bit page.
#include "attention/decode_mma.cuh"
#include "attention/element_read.cuh"
#include "attention/query.cuh"
#include "attention/softmax.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// ---- the wide decode kernel: layers that hold a 16-bit page -------------------------------------
// K codes of up to 16 bits are loaded from global memory into registers one slab ahead; V of up
// to 8 bits and the KIVI key scales go through two cp.async staging slots per warp (2 blocks/SM).
// `Replay`: the items from `attend_params::table` (a replayed step whose layer may hold a page of
// more than 8 bits; blocks past its items exit at once).
template <int D, bool Replay = false>
__global__ void __launch_bounds__(dec_warps * 32, 2) decode_wide_kernel(const __grid_constant__ attend_params p) {
  pdl_trigger();
  constexpr int Cap = 16;
  extern __shared__ __align__(16) uint8_t wide_smem[];  // a decode_smem<D> (dynamic: 55 KB at head_dim 256)
  decode_smem<D>& sm = *reinterpret_cast<decode_smem<D>*>(wide_smem);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  decode_item item;
  if (!load_item<Replay>(p, int(blockIdx.z), item)) return;
  const slab_range rg = block_slabs(p, item, warp);
  if (rg.c0 >= rg.c1) return;
  const int P = p.kv.page_tokens, page_slabs = rg.page_slabs, s0 = rg.s0, s1 = rg.s1;
  fill_page_table<D>(p, item, h, rg.c0, rg.c1, page_slabs, sm.pages);
  __syncthreads();

  uint32_t qb[D / 8];
  uint4(&qh)[D / 32][32] = sm.qh[warp];
  load_query<D>(p, item, h, g, t, qb);
  put_query<D>(qh, lane, qb);
  const uint8_t* q_scales_of = nullptr;  // the KIVI token group whose scales qb holds (nullptr: plain)
  column_state<D> cs(p, item, t);

  slab_ref cur{};
  k_raw<D, Cap> kc;
  const uint32_t slots = smem_addr(sm.vslot[warp][0]);
  // V of page slabs of up to 8 bits with a kind goes through the staging slots; 16-bit V is read
  // where it is used (staging it measured slower: 8 copies per lane and 4-way bank conflicts on the
  // reads), as are pages read by element
  auto staged = [&](const slab_ref& s) { return !s.ring && s.kv >= 0 && s.fv.bits <= 8; };
  if (s0 < s1) {
    cur = locate_slab<D>(p, item, h, s0, page_slabs, sm.pages);
    if (cur.ring || !by_element(cur.fk, cur.kk)) load_k<D, Cap>(cur, cur.fk, P, p.kv.window, g, t, kc);
    if (!cur.ring) stage_slab<D>(cur, P, lane, slots + (s0 & 1) * slot_bytes<D>);
  }
  cp_commit();
  for (int j = s0; j < s1; ++j) {
    const format_traits fk = cur.fk, fv = cur.fv;
    // this slab's V, then the next slab's K: in flight while this slab's scores are computed
    k_raw<D, Cap> kn = kc;
    if (j + 1 < s1) {
      const slab_ref nxt = locate_slab<D>(p, item, h, j + 1, page_slabs, sm.pages);
      if (nxt.ring || !by_element(nxt.fk, nxt.kk)) load_k<D, Cap>(nxt, nxt.fk, P, p.kv.window, g, t, kn);
      if (!nxt.ring) stage_slab<D>(nxt, P, lane, slots + ((j + 1) & 1) * slot_bytes<D>);
    }
    cp_commit();  // one group per slab (possibly empty): wait_group 1 leaves only the next in flight
    cp_wait<1>();
    __syncwarp();
    const uint8_t* slot = sm.vslot[warp][j & 1];

    const bool k_codes = !cur.ring && cur.kk >= 0 && fk.k_along_tokens();  // (by element: plain query)
    const int lgk = k_codes ? log2i(fk.group) : 0;
    const uint8_t* group_key =
        k_codes ? cur.k + uint32_t(P) * ((D * fk.bits) >> 3) + uint32_t(cur.row0 >> lgk) * D * 2 : nullptr;
    if (group_key != q_scales_of) {
      if (!k_codes) {
        get_query<D>(qh, lane, qb);
        cs.cz[0] = cs.cz[1] = 0.f;
      } else {
        fold_kivi<D>(slot + slot_kpar<D>, slot + slot_kpar<D> + D * 2, fk.bits, qh, lane, t, qb, cs.cz);  // staged with the slab
      }
      q_scales_of = group_key;
    }

    float sc[4] = {0.f, 0.f, 0.f, 0.f};
    if (!cur.ring && by_element(fk, cur.kk)) {
      scores_by_element<D>(cur, P, g, t, qh, lane, sc);
    } else {
      uint32_t kg[D / 8], kg8[D / 8];
      switch (fk.bits) {
        case 16: k_frags<D, 16, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
        case 8: k_frags<D, 8, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
        case 4: k_frags<D, 4, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
        default: k_frags<D, 2, Cap>(kc.w, fk.fam, kc.ps, kg, kg8); break;
      }
      scores_mma<D>(kg, kg8, qb, sc);
    }
    const bool v_elem = !cur.ring && by_element(fv, cur.kv);
    v_raw<D, Cap> vr;  // (unused for a page read by element)
    if (staged(cur)) {
      slab_ref sv = cur;
      sv.v = slot;
      sv.row0 = 0;
      load_v<D, Cap, false>(sv, fv, 16, p.kv.window, g, t, vr);
    } else if (!v_elem) {
      load_v<D, Cap, true>(cur, fv, P, p.kv.window, g, t, vr);  // 16-bit pages and the ring
    }
    float rs[2] = {1.f, 1.f};  // fp8 keys: per-token scales of rows g, g+8
    if (!cur.ring && fk.fam == family::fp8_e4m3) {
      const float2 r = fp8_scales(kc.ps[0], kc.ps[1], g, cur.valid);
      rs[0] = r.x, rs[1] = r.y;
    }
    float pv[4];
    softmax_tiles<D, 1>(sc, rs, p.scale_log2, cur.tok0, cur.valid, g, cs, pv);
    if (!cur.ring && fv.fam == family::fp8_e4m3) {  // per-token V scales fold into P
      const float2 v = fp8_scales(vr.s[0], vr.s[1], g, cur.valid);
      pv[0] *= v.x, pv[1] *= v.x, pv[2] *= v.y, pv[3] *= v.y;
    }
    uint32_t pb0, pb1;
    p_frags(pv, pb0, pb1);
    if (v_elem) values_by_element<D>(cur, P, g, t, pb0, pb1, cs.acc);
    else values_slab<D, Cap>(vr, fv, cur.valid, t, pb0, pb1, cs.acc);

    __syncwarp();  // every lane is done with this slab's staging slot
    // the next slab's description again (cheaper than keeping it live across the slab)
    if (j + 1 < s1) cur = locate_slab<D>(p, item, h, j + 1, page_slabs, sm.pages);
    kc = kn;
  }
  cp_wait<0>();
  __syncthreads();  // the merge area overlays the staging slots of every warp
  write_partial<D>(p, sm.m, cs, s0 < s1, warp, g, t);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
