// Tree attention, Metal body for mx.fast.metal_kernel (MLX writes the signature).
// Line-for-line twin of tree_attention.cu: only the thread indices, threadgroup memory,
// barriers, the simdgroup sum, exp, cos and sin differ.
// The verification pass of speculative decoding: each node of a candidate tree attends to the
// cached rows before the tree and to itself and its ancestors, and to nothing else. The kernel
// follows `parents` instead of reading a mask, so no (nodes x keys) mask is built, converted or
// read, and a layer's attention is one launch (a pass over a few dozen nodes is launch-bound).
// One threadgroup per (node t, query head h), NW simdgroups of 32 threads: lane l holds elements
// [l*E, l*E + E) of the head dimension D <= 32*E, so a row's loads are coalesced. Simdgroup w
// takes the visible rows B at a time (rows wB.., then NW*B further on, ...): their B dot
// products are loaded and summed across the lanes side by side, the online softmax moves once
// for the B, and their values are added in. Thread d < D merges the NW partial results for
// element d. (One row at a time, every row waited for its loads and its sum before the next
// began: 66 us a layer on the H100 for 25 nodes over 256 cached rows, against 24 us so.)
// RoPE is applied here to the queries and the tree's keys (a launch a layer fewer): element d
// turns with its pair d -+ D/2 by the angle position * inv_freq, in float32, and is rounded to T
// as mx.fast.rope rounds it. The threadgroups of a KV head's first query head also write the
// tree's turned keys (rk), which the cache receives for the accepted path.
// Inputs q (1, H, TN, D) queries before RoPE; k, v (1, KV, >= P, D) the cache, whose first P
// rows come before the tree; tk, tv (1, KV, TN, D) the tree's own keys (before RoPE) and
// values, which the cache receives only for the accepted path, after the pass; all any strides;
// parents (TN,) int32, -1 for a root; prefix (1,) int32, P; scale (1,) float32; positions (TN,)
// int32, each node's; freqs (D/2,) float32, mx.fast.rope's (inv_freq = 1 / freq). Outputs out
// (1, TN, H, D), rk (1, KV, TN, D). Template: T, H, R (query heads per KV head), TN, D, E, NW, B.
const int group = threadgroup_position_in_grid.x;
const int tid = thread_position_in_threadgroup.x;
const int lane = tid % 32;
const int warp = tid / 32;
const int t = group / H;
const int h = group - t * H;
const int kvh = h / R;
const int P = prefix[0];
threadgroup int chain[TN];
threadgroup int visible[1];
threadgroup float m_part[NW];
threadgroup float l_part[NW];
threadgroup float o_part[NW * D];
if (tid == 0) {  // the tree rows node t sees: itself, then its ancestors
  int n = t;
  int depth = 0;
  while (n >= 0) {
    chain[depth] = n;
    depth += 1;
    n = parents[n];
  }
  visible[0] = P + depth;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const int rows = visible[0];
const float s0 = scale[0];
const int half = D / 2;
float qv[E];
float ov[E];
float inv[E];  // this lane's elements: their pair's inverse frequency,
float sg[E];   // the sign their pair element enters with,
int pd[E];     // and that element
for (int e = 0; e < E; ++e) {
  const int d = lane * E + e;
  inv[e] = d < D ? 1.0f / freqs[d % half] : 0.0f;
  sg[e] = d < half ? -1.0f : 1.0f;
  pd[e] = d < half ? d + half : d - half;
  const int64_t qb = h * q_strides[1] + t * q_strides[2];
  const float a = static_cast<float>(positions[t]) * inv[e];
  const float x = d < D ? static_cast<float>(q[qb + d * q_strides[3]]) * metal::cos(a) + sg[e] * static_cast<float>(q[qb + pd[e] * q_strides[3]]) * metal::sin(a) : 0.0f;
  qv[e] = static_cast<float>(static_cast<T>(x)) * s0;
  ov[e] = 0.0f;
}
float m = -1e30f;
float l = 0.0f;
for (int base = warp * B; base < rows; base += NW * B) {
  float s[B];
  for (int r = 0; r < B; ++r) {
    const int i = base + r < rows ? base + r : base;  // past the last row: row base, weight 0
    const bool cached = i < P;
    const int row = cached ? i : chain[i - P];
    const int64_t kb = cached ? kvh * k_strides[1] + row * k_strides[2] : kvh * tk_strides[1] + row * tk_strides[2];
    const int64_t ks = cached ? k_strides[3] : tk_strides[3];
    const float a = cached ? 0.0f : static_cast<float>(positions[row]);
    s[r] = 0.0f;
    for (int e = 0; e < E && lane * E + e < D; ++e) {
      const int64_t at = kb + (lane * E + e) * ks;
      const float x = cached ? static_cast<float>(k[at]) : static_cast<float>(tk[at]) * metal::cos(a * inv[e]) + sg[e] * static_cast<float>(tk[kb + pd[e] * ks]) * metal::sin(a * inv[e]);
      s[r] += qv[e] * static_cast<float>(static_cast<T>(x));
    }
  }
  float top = m;
  for (int r = 0; r < B; ++r) {
    s[r] = simd_sum(s[r]);
    s[r] = base + r < rows ? s[r] : -1e30f;
    top = top > s[r] ? top : s[r];
  }
  const float a = metal::exp(m - top);
  l *= a;
  for (int e = 0; e < E; ++e) {
    ov[e] *= a;
  }
  for (int r = 0; r < B; ++r) {
    const int i = base + r < rows ? base + r : base;
    const bool cached = i < P;
    const int row = cached ? i : chain[i - P];
    const int64_t vb = cached ? kvh * v_strides[1] + row * v_strides[2] : kvh * tv_strides[1] + row * tv_strides[2];
    const int64_t vs = cached ? v_strides[3] : tv_strides[3];
    const float p = metal::exp(s[r] - top);
    l += p;
    for (int e = 0; e < E && lane * E + e < D; ++e) {
      const int64_t at = vb + (lane * E + e) * vs;
      ov[e] += p * static_cast<float>(cached ? v[at] : tv[at]);
    }
  }
  m = top;
}
if (lane == 0) {
  m_part[warp] = m;
  l_part[warp] = l;
}
for (int e = 0; e < E && lane * E + e < D; ++e) {
  o_part[warp * D + lane * E + e] = ov[e];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid < D) {
  float top = -1e30f;
  for (int w = 0; w < NW; ++w) {
    top = top > m_part[w] ? top : m_part[w];
  }
  float den = 0.0f;
  float acc = 0.0f;
  for (int w = 0; w < NW; ++w) {
    const float c = metal::exp(m_part[w] - top);
    den += c * l_part[w];
    acc += c * o_part[w * D + tid];
  }
  out[(t * H + h) * D + tid] = static_cast<T>(acc / den);
  if (h % R == 0) {  // the node's keys after RoPE, once per KV head
    const int64_t kb = kvh * tk_strides[1] + t * tk_strides[2];
    const float a = static_cast<float>(positions[t]) * (1.0f / freqs[tid % half]);
    const float sgn = tid < half ? -1.0f : 1.0f;
    const int pt = tid < half ? tid + half : tid - half;
    rk[(kvh * TN + t) * D + tid] = static_cast<T>(static_cast<float>(tk[kb + tid * tk_strides[3]]) * metal::cos(a) + sgn * static_cast<float>(tk[kb + pt * tk_strides[3]]) * metal::sin(a));
  }
}
