// Tree attention, Metal body for mx.fast.metal_kernel (MLX writes the signature).
// Line-for-line twin of tree_attention.cu: only the thread indices, threadgroup memory,
// barriers, the simdgroup shuffle, exp, cos and sin differ.
// The verification pass of speculative decoding: each node of a candidate tree attends to the
// cached rows before the tree and to itself and its ancestors, and to nothing else. The kernel
// follows `parents` instead of reading a mask, so no (nodes x keys) mask is built, converted or
// read, and a layer's attention is one launch (a pass over a few dozen nodes is launch-bound).
// One threadgroup per (node t, KV head): its R query heads share every key and value it loads.
// A simdgroup's 32 lanes form 32/G groups of G lanes; a group takes B visible rows at a time,
// lane j of it elements [j*E, j*E + E) of each (D = G*E), and keeps its own online softmax per
// query head: a row's score is summed over the G lanes only, and nothing else crosses lanes
// until the end, when the groups' and then the NW simdgroups' partial results are merged.
// (One threadgroup per query head with the 32 lanes across a row summed every row: 48.6 us a
// layer on the H100 for 25 nodes of SmolLM2-135M over 256 cached rows.)
// RoPE is applied here to the queries and the tree's keys (a launch a layer fewer): element d
// turns with its pair d -+ D/2 by the angle position * inv_freq, in float32, and is rounded to T
// as mx.fast.rope rounds it. The node's own turned key is written to rk, which the cache
// receives for the accepted path.
// Inputs q (1, H, TN, D) queries before RoPE; k, v (1, KV, >= P, D) the cache, whose first P
// rows come before the tree; tk, tv (1, KV, TN, D) the tree's own keys (before RoPE) and
// values, which the cache receives only for the accepted path, after the pass; all any strides;
// parents (TN,) int32, -1 for a root; node_rows (TN,) int32, each node's row in the cache's buffer
// (P + its depth: the P rows before the root's are the cache's); positions (TN,) int32, each
// node's; freqs (D/2,) float32, mx.fast.rope's (inv_freq = 1 / freq). Outputs out (1, TN, H, D),
// rk (1, KV, TN, D). Template: T, H, R (query heads per KV head), TN, D, G, E, NW, B, and SCALE,
// the attention scale's float32 bits. P comes from `node_rows` and the scale from the template, never
// from an array of one element: MLX's CUDA allocator keeps arrays of 8 bytes or less in managed
// memory on the host, which every thread's read would cross the bus for.
const int group = threadgroup_position_in_grid.x;
const int tid = thread_position_in_threadgroup.x;
const int lane = tid % 32;
const int warp = tid / 32;
const int t = group / (H / R);
const int kvh = group - t * (H / R);
const int g = lane / G;  // the lane's row group in its simdgroup
const int j = lane % G;  // and its place in the group
const int half = D / 2;
threadgroup int par[TN];
threadgroup int chain[TN];
threadgroup int span[2];  // P, and the rows node t sees
threadgroup float qs[R * D];   // the queries, turned and scaled
threadgroup T ks[TN * D];      // the keys of node t and its ancestors, turned
threadgroup float m_part[NW * R];
threadgroup float l_part[NW * R];
threadgroup float o_part[NW * R * D];
for (int x = tid; x < TN; x += NW * 32) {
  par[x] = parents[x];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {  // the tree rows node t sees: itself, then its ancestors
  int n = t;
  int depth = 0;
  while (n >= 0 && depth < TN) {  // bounded: parents with a cycle (kernels.Kernel first launches on zeros) must not hang
    chain[depth] = n;
    depth += 1;
    n = par[n];
  }
  span[0] = node_rows[t] - depth + 1 > 0 ? node_rows[t] - depth + 1 : 0;
  span[1] = span[0] + depth;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const int P = span[0];
const int rows = span[1];
const float s0 = as_type<float>(SCALE);
for (int x = tid; x < (R + rows - P) * D; x += NW * 32) {  // R query rows, then the chain's keys
  const int c = x / D;
  const int d = x - c * D;
  const int pd = d < half ? d + half : d - half;
  const float sg = d < half ? -1.0f : 1.0f;
  const int node = c < R ? t : chain[c - R];
  const float a = static_cast<float>(positions[node]) * (1.0f / freqs[d % half]);
  const int64_t qb = (kvh * R + c) * q_strides[1] + t * q_strides[2];
  const int64_t kb = kvh * tk_strides[1] + node * tk_strides[2];
  const float x0 = c < R ? static_cast<float>(q[qb + d * q_strides[3]]) : static_cast<float>(tk[kb + d * tk_strides[3]]);
  const float x1 = c < R ? static_cast<float>(q[qb + pd * q_strides[3]]) : static_cast<float>(tk[kb + pd * tk_strides[3]]);
  const T turned = static_cast<T>(x0 * metal::cos(a) + sg * x1 * metal::sin(a));
  if (c < R) {
    qs[x] = static_cast<float>(turned) * s0;
  } else {
    ks[x - R * D] = turned;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int x = tid; x < D; x += NW * 32) {
  rk[(kvh * TN + t) * D + x] = ks[x];
}
float qv[R][E];
float ov[R][E];
float m[R];
float l[R];
for (int r = 0; r < R; ++r) {
  for (int e = 0; e < E; ++e) {
    qv[r][e] = qs[r * D + j * E + e];
    ov[r][e] = 0.0f;
  }
  m[r] = -1e30f;
  l[r] = 0.0f;
}
for (int base0 = warp * (32 / G) * B; base0 < rows; base0 += NW * (32 / G) * B) {  // uniform over the simdgroup
  const int base = base0 + g * B;
  float s[R][B];
  for (int b = 0; b < B; ++b) {
    const int i = base + b < rows ? base + b : rows - 1;  // past the last row: the last, weight 0
    const int64_t kb = kvh * k_strides[1] + (i < P ? i : 0) * k_strides[2];
    for (int r = 0; r < R; ++r) {
      s[r][b] = 0.0f;
    }
    for (int e = 0; e < E; ++e) {
      const int d = j * E + e;
      const float x = i < P ? static_cast<float>(k[kb + d * k_strides[3]]) : static_cast<float>(ks[(i - P) * D + d]);
      for (int r = 0; r < R; ++r) {
        s[r][b] += qv[r][e] * x;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float top = m[r];
    for (int b = 0; b < B; ++b) {
      for (int o = G / 2; o > 0; o /= 2) { s[r][b] += simd_shuffle_xor(s[r][b], static_cast<ushort>(o)); }
      top = base + b < rows && s[r][b] > top ? s[r][b] : top;
    }
    const float a = metal::exp(m[r] - top);
    l[r] *= a;
    for (int e = 0; e < E; ++e) {
      ov[r][e] *= a;
    }
    for (int b = 0; b < B; ++b) {
      s[r][b] = base + b < rows ? metal::exp(s[r][b] - top) : 0.0f;
      l[r] += s[r][b];
    }
    m[r] = top;
  }
  for (int b = 0; b < B; ++b) {
    const int i = base + b < rows ? base + b : rows - 1;
    const int64_t vb = i < P ? kvh * v_strides[1] + i * v_strides[2] : kvh * tv_strides[1] + chain[i - P] * tv_strides[2];
    const int64_t vs = i < P ? v_strides[3] : tv_strides[3];
    for (int e = 0; e < E; ++e) {
      const float x = i < P ? static_cast<float>(v[vb + (j * E + e) * vs]) : static_cast<float>(tv[vb + (j * E + e) * vs]);
      for (int r = 0; r < R; ++r) {
        ov[r][e] += s[r][b] * x;
      }
    }
  }
}
for (int o = G; o < 32; o *= 2) {  // merge the simdgroup's row groups
  for (int r = 0; r < R; ++r) {
    const float mo = simd_shuffle_xor(m[r], static_cast<ushort>(o));
    const float lo = simd_shuffle_xor(l[r], static_cast<ushort>(o));
    const float top = m[r] > mo ? m[r] : mo;
    const float ca = metal::exp(m[r] - top);
    const float cb = metal::exp(mo - top);
    l[r] = l[r] * ca + lo * cb;
    for (int e = 0; e < E; ++e) {
      ov[r][e] = ov[r][e] * ca + simd_shuffle_xor(ov[r][e], static_cast<ushort>(o)) * cb;
    }
    m[r] = top;
  }
}
if (g == 0) {
  for (int r = 0; r < R; ++r) {
    if (j == 0) {
      m_part[warp * R + r] = m[r];
      l_part[warp * R + r] = l[r];
    }
    for (int e = 0; e < E; ++e) {
      o_part[(warp * R + r) * D + j * E + e] = ov[r][e];
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int x = tid; x < R * D; x += NW * 32) {  // merge the simdgroups: query head kvh*R + x/D, element x%D
  const int r = x / D;
  float top = -1e30f;
  for (int w = 0; w < NW; ++w) {
    top = top > m_part[w * R + r] ? top : m_part[w * R + r];
  }
  float den = 0.0f;
  float acc = 0.0f;
  for (int w = 0; w < NW; ++w) {
    const float c = metal::exp(m_part[w * R + r] - top);
    den += c * l_part[w * R + r];
    acc += c * o_part[w * R * D + x];
  }
  out[(t * H + kvh * R) * D + x] = static_cast<T>(acc / den);
}
