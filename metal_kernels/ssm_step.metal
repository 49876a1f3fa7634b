// Fused Mamba/Mamba2 step, Metal body for mx.fast.metal_kernel (MLX writes the signature).
// Line-for-line twin of ssm_step.cu: only the thread index, shuffle and exp/log lines differ.
// Causal conv, silu, softplus(dt), the selective-scan update, D skip and the silu(z) gate in
// one launch, for TN tokens that form a tree: TN = 1 is the decode step, more are the
// candidates of a verification pass (each node continues its parent; a launch-bound GPU pays
// per op, and the unfused path is ~25 ops a layer).
// Inputs u (batch, TN, P): the layer's input projection rows; dt (batch, TN, DTW): dt before
// its bias; window (batch, K-1, WC): the conv inputs before the tree; conv_w (WC, K); conv_b
// (WC); dt_bias, A_log, D; state (batch, N, DI); parents (>= TN, the first TN read): parents[t] < t, -1 for the
// cached state. Outputs g (batch, TN, DI): the gated outputs; window_out (batch, TN, K-1, WC)
// and state_out (batch, TN, N, DI): the window and state after each node. Template: T, N, S
// (threads a channel, a power of two <= 32), R (KV-group repeats), K, MAMBA2, DI, DXB, and the
// offsets OX, OZ, OB, OC of x, z, B, C in u.
// The S threads of channel c (neighbours in one SIMD group) split its N state rows: thread lane
// owns rows lane, lane + S, ... for every node, in node order, so the parent state it reads back is
// one it wrote itself; y is summed over the S threads by shuffles. Nodes are serial, so a
// thread a state row (not a channel) keeps the chain short: a 21-node pass of one thread a
// channel walked 64 rows a node (43 us a node a layer on an H100, benchmarks/README.md).
// Mamba2 convolves [x, B, C] before the KV-group expansion (conv channel j reads u[OX + j]);
// Mamba convolves the expanded x only, and reads B and C as they are.
const int i = thread_position_in_grid.x;
const int b = thread_position_in_grid.y;
// A thread past the last channel (CUDA rounds the grid up to whole blocks) computes channel
// DI - 1 without writing it: every thread of a SIMD group must take part in the shuffles.
const bool live = i < DI * S;
const int c = live ? i / S : DI - 1;
const int lane = i % S;
const int TN = u_shape[1];
const int P = u_shape[2];
const int WC = window_shape[2];
const int DTW = dt_shape[2];
const int head = c / N;
const int kvh = head / R;
const int o = c - head * N;
const int wb = b * (K - 1) * WC;
// x: the conv channel of this thread's x and its input in u (x is stored before expansion).
const int xj = MAMBA2 ? kvh * N + o : c;
const int xu = OX + kvh * N + o;
const float Dc = D[MAMBA2 ? head : c];
for (int t = 0; t < TN; ++t) {
  // The conv inputs of node t, newest first: the node, its ancestors, then the cached window.
  // src >= 0 is a node (its row of u), src < 0 the window row K - 1 + src.
  int src[K];
  src[0] = t;
  for (int k = 1; k < K; ++k) {
    src[k] = src[k - 1] >= 0 ? parents[src[k - 1]] : src[k - 1] - 1;
  }
  const int ub = (b * TN + t) * P;
  float acc = static_cast<float>(conv_b[xj]);
  for (int k = 0; k < K; ++k) {
    const float v = src[k] >= 0 ? static_cast<float>(u[(b * TN + src[k]) * P + xu]) : static_cast<float>(window[wb + (K - 1 + src[k]) * WC + xj]);
    acc += v * static_cast<float>(conv_w[xj * K + K - 1 - k]);
  }
  const float xt = acc / (1.0f + metal::exp(-acc));
  const float dt_raw = static_cast<float>(dt[(b * TN + t) * DTW + (MAMBA2 ? head : c)]) + dt_bias[MAMBA2 ? head : c];
  const float dtt = dt_raw > 20.0f ? dt_raw : metal::log(1.0f + metal::exp(dt_raw));
  float dA = MAMBA2 ? metal::exp(-metal::exp(A_log[head]) * dtt) : 0.0f;  // Mamba2: one decay per head
  const int p = parents[t];
  float yt = 0.0f;
  for (int n = lane; n < N; n += S) {
    float Bn;
    float Cn;
    if (MAMBA2) {  // B and C go through the conv and silu too
      const int bj = DXB + kvh * N + n;
      const int cj = 2 * DXB + head * N + n;
      float ab = static_cast<float>(conv_b[bj]);
      float ac = static_cast<float>(conv_b[cj]);
      for (int k = 0; k < K; ++k) {
        const int row = (b * TN + src[k]) * P + OX;
        const int wrow = wb + (K - 1 + src[k]) * WC;
        ab += (src[k] >= 0 ? static_cast<float>(u[row + bj]) : static_cast<float>(window[wrow + bj])) * static_cast<float>(conv_w[bj * K + K - 1 - k]);
        ac += (src[k] >= 0 ? static_cast<float>(u[row + cj]) : static_cast<float>(window[wrow + cj])) * static_cast<float>(conv_w[cj * K + K - 1 - k]);
      }
      Bn = ab / (1.0f + metal::exp(-ab));
      Cn = ac / (1.0f + metal::exp(-ac));
    } else {  // Mamba: a decay per state row
      Bn = static_cast<float>(u[ub + OB + kvh * N + n]);
      Cn = static_cast<float>(u[ub + OC + head * N + n]);
      dA = metal::exp(-metal::exp(A_log[c * N + n]) * dtt);
    }
    const float before = p < 0 ? state[(b * N + n) * DI + c] : state_out[((b * TN + p) * N + n) * DI + c];
    const float h = dA * before + dtt * Bn * xt;
    if (live) {
      state_out[((b * TN + t) * N + n) * DI + c] = h;
    }
    yt += Cn * h;
  }
  for (int m = S / 2; m > 0; m /= 2) {
    yt += simd_shuffle_xor(yt, static_cast<ushort>(m));
  }
  const float z = static_cast<float>(u[ub + OZ + c]);
  if (live && lane == 0) {
    g[(b * TN + t) * DI + c] = static_cast<T>((yt + Dc * xt) * z / (1.0f + metal::exp(-z)));
  }
  // The window after node t: its K-1 newest conv inputs, oldest first. Each conv channel has one
  // writer: Mamba's x channel c; for Mamba2 the first head of a KV group writes its x and B
  // channels, every head its C. Thread lane of the channel writes the w-th of them, w = lane, lane + S, ...
  for (int w = lane; w < 3 && live; w += S) {
    const int j = w == 0 ? xj : (w == 1 ? DXB + kvh * N + o : 2 * DXB + head * N + o);
    if ((w == 0 && (!MAMBA2 || head % R == 0)) || (MAMBA2 && w == 1 && head % R == 0) || (MAMBA2 && w == 2)) {
      for (int k = 0; k < K - 1; ++k) {
        const int s = src[K - 2 - k];
        const float v = s >= 0 ? static_cast<float>(u[(b * TN + s) * P + (MAMBA2 ? OX + j : xu)]) : static_cast<float>(window[wb + (K - 1 + s) * WC + j]);
        window_out[((b * TN + t) * (K - 1) + k) * WC + j] = static_cast<T>(v);
      }
    }
  }
}
