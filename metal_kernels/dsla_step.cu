// Fused DSLA step, CUDA body for mx.fast.cuda_kernel (MLX writes the signature).
// Line-for-line twin of dsla_step.metal: only the thread indices, threadgroup memory, barriers,
// shuffles and exp/log/rsqrt lines differ.
// Both gates (logsigmoid / gate_norm, clamped), both gated linear-attention state updates, the
// queries' reads of both states, their mix and the per-head RMSNorm in one launch, for TN tokens
// that form a tree: TN = 1 is the decode step, more are the candidates of a verification pass
// (each node continues its parent's states; a launch-bound GPU pays per op, and the unfused
// path is ~46 ops a layer).
// Inputs qkv (batch, TN, (H + 2 KV) D): q, k, v rows; a1, a2 (batch, TN, H D): the gates'
// pre-activations; s1, s2 (batch, H, D, D): the states before the tree, key row i, value column
// j; mix: gamma (1) or alpha_list (2); norm_w (D): the RMSNorm weight (read only with NORM);
// consts: 1 / gate_norm, the log-gate clamp, the norm's eps; parents (>= TN, the first TN read): parents[t] < t, -1
// for the states before the tree. Outputs y (batch, TN, H D): the mixed (and normed) outputs;
// s1_out, s2_out (batch, TN, H, D, D): the states after each node. Template: T, Tg, Tn (the
// input dtypes), H, KV, D, S (threads a value column, a power of two <= 32), SOFTMAX, NORM.
// One threadgroup per (head, batch row). Its S threads of column j (neighbours in one SIMD
// group) split the D key rows: thread lane owns rows lane, lane + S, ... of column j of both
// states for every node, in node order, so the parent state it reads back is one it wrote
// itself; q S_i[:, j] is summed over the S threads by shuffles, the norm's sum of squares over
// the head's columns by shuffles and threadgroup memory.
const int h = blockIdx.x;
const int b = blockIdx.y;
const int tid = threadIdx.x;
// A thread past the last column (the group is rounded up to whole SIMD groups) computes column
// D - 1 without writing it: every thread of a SIMD group must take part in the shuffles.
const bool live = tid < D * S;
const int j = live ? tid / S : D - 1;
const int lane = tid % S;
const int TN = qkv_shape[1];
const int P = qkv_shape[2];
const int kvh = h / (H / KV);
const float inv_norm = consts[0];
const float lo = consts[1];
const float eps = consts[2];
const float w1 = SOFTMAX ? 1.0f / (1.0f + expf(mix[1] - mix[0])) : mix[0];
const float w2 = 1.0f - w1;
const float scale = rsqrtf(static_cast<float>(D));
__shared__ float part[32];
for (int t = 0; t < TN; ++t) {
  const int p = parents[t];
  const int row = (b * TN + t) * P;
  const int gate = ((b * TN + t) * H + h) * D;
  const float vj = static_cast<float>(qkv[row + (H + KV) * D + kvh * D + j]);
  float o1 = 0.0f;
  float o2 = 0.0f;
  for (int i = lane; i < D; i += S) {
    const float qi = static_cast<float>(qkv[row + h * D + i]) * scale;
    const float kv = static_cast<float>(qkv[row + H * D + kvh * D + i]) * vj;
    // logsigmoid(x) = min(x, 0) - log(1 + exp(-|x|)), never overflowing.
    const float x1 = static_cast<float>(a1[gate + i]);
    const float x2 = static_cast<float>(a2[gate + i]);
    float g1 = ((x1 < 0.0f ? x1 : 0.0f) - logf(1.0f + expf(x1 < 0.0f ? x1 : -x1))) * inv_norm;
    float g2 = ((x2 < 0.0f ? x2 : 0.0f) - logf(1.0f + expf(x2 < 0.0f ? x2 : -x2))) * inv_norm;
    g1 = g1 < lo ? lo : g1;
    g2 = g2 < lo ? lo : g2;
    const int at = ((b * H + h) * D + i) * D + j;
    const int up = (((b * TN + p) * H + h) * D + i) * D + j;
    const int here = (((b * TN + t) * H + h) * D + i) * D + j;
    const float h1 = expf(g1) * (p < 0 ? s1[at] : s1_out[up]) + kv;
    const float h2 = expf(g2) * (p < 0 ? s2[at] : s2_out[up]) + kv;
    if (live) {
      s1_out[here] = h1;
      s2_out[here] = h2;
    }
    o1 += qi * h1;
    o2 += qi * h2;
  }
  for (int m = S / 2; m > 0; m /= 2) {
    o1 += __shfl_xor_sync(0xffffffff, o1, m);
    o2 += __shfl_xor_sync(0xffffffff, o2, m);
  }
  float o = w1 * o1 + w2 * o2;
  if (NORM) {
    // One lane a column counts its square; the SIMD groups' sums meet in threadgroup memory.
    float ss = live && lane == 0 ? o * o : 0.0f;
    for (int m = 16; m > 0; m /= 2) {
      ss += __shfl_xor_sync(0xffffffff, ss, m);
    }
    if (tid % 32 == 0) {
      part[tid / 32] = ss;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < (D * S + 31) / 32; ++w) {
      total += part[w];
    }
    __syncthreads();
    o = o * rsqrtf(total / D + eps) * static_cast<float>(norm_w[j]);
  }
  if (live && lane == 0) {
    y[gate + j] = static_cast<T>(o);
  }
}
