// Fused Mamba/Mamba2 decode step, Metal body for mx.fast.metal_kernel (MLX writes the signature).
// Line-for-line twin of ssm_step.cu: only the thread index and exp/log lines differ.
// One token per sequence: causal conv step, silu, softplus(dt), one selective-scan update,
// D skip and the silu(z) gate in one launch (a decode step is launch-bound on a GPU).
// Inputs u (batch, 1, P): the layer's input projection row; dt (batch, 1, DTW): dt before
// its bias; window (batch, K-1, WC): the previous conv inputs; conv_w (WC, K); conv_b (WC);
// dt_bias, A_log, D; state (batch, N, DI). Outputs g (batch, 1, DI): the gated output;
// window_out; state_out. Template: T, N, R (KV-group repeats), K, MAMBA2, DI, DXB, and the
// offsets OX, OZ, OB, OC of x, z, B, C in u. Thread c of sequence b owns channel c of head c/N.
// Mamba2 convolves [x, B, C] before the KV-group expansion (conv channel j reads u[OX + j]);
// Mamba convolves the expanded x only, and reads B and C as they are.
const int c = thread_position_in_grid.x;
const int b = thread_position_in_grid.y;
const int batch = u_shape[0];
if (c >= DI || b >= batch) {
  return;
}
const int P = u_shape[2];
const int WC = window_shape[2];
const int head = c / N;
const int kvh = head / R;
const int o = c - head * N;
const int ub = b * P;
const int wb = b * (K - 1) * WC;
// x: the conv channel of this thread's x and its input in u (x is stored before expansion).
const int xj = MAMBA2 ? kvh * N + o : c;
const int xu = OX + kvh * N + o;
float acc = static_cast<float>(conv_b[xj]) + static_cast<float>(u[ub + xu]) * static_cast<float>(conv_w[xj * K + K - 1]);
for (int k = 0; k < K - 1; ++k) {
  acc += static_cast<float>(window[wb + k * WC + xj]) * static_cast<float>(conv_w[xj * K + k]);
}
const float xt = acc / (1.0f + metal::exp(-acc));
const float dt_raw = static_cast<float>(dt[b * dt_shape[2] + (MAMBA2 ? head : c)]) + dt_bias[MAMBA2 ? head : c];
const float dtt = dt_raw > 20.0f ? dt_raw : metal::log(1.0f + metal::exp(dt_raw));
const float Dc = D[MAMBA2 ? head : c];
float dA = MAMBA2 ? metal::exp(-metal::exp(A_log[head]) * dtt) : 0.0f;  // Mamba2: one decay per head
float yt = 0.0f;
for (int n = 0; n < N; ++n) {
  float Bn;
  float Cn;
  if (MAMBA2) {  // B and C go through the conv and silu too
    const int bj = DXB + kvh * N + n;
    const int cj = 2 * DXB + head * N + n;
    float ab = static_cast<float>(conv_b[bj]) + static_cast<float>(u[ub + OX + bj]) * static_cast<float>(conv_w[bj * K + K - 1]);
    float ac = static_cast<float>(conv_b[cj]) + static_cast<float>(u[ub + OX + cj]) * static_cast<float>(conv_w[cj * K + K - 1]);
    for (int k = 0; k < K - 1; ++k) {
      ab += static_cast<float>(window[wb + k * WC + bj]) * static_cast<float>(conv_w[bj * K + k]);
      ac += static_cast<float>(window[wb + k * WC + cj]) * static_cast<float>(conv_w[cj * K + k]);
    }
    Bn = ab / (1.0f + metal::exp(-ab));
    Cn = ac / (1.0f + metal::exp(-ac));
  } else {  // Mamba: a decay per state row
    Bn = static_cast<float>(u[ub + OB + kvh * N + n]);
    Cn = static_cast<float>(u[ub + OC + head * N + n]);
    dA = metal::exp(-metal::exp(A_log[c * N + n]) * dtt);
  }
  const int si = (b * N + n) * DI + c;
  const float h = dA * state[si] + dtt * Bn * xt;
  state_out[si] = h;
  yt += Cn * h;
}
const float z = static_cast<float>(u[ub + OZ + c]);
g[b * DI + c] = static_cast<T>((yt + Dc * xt) * z / (1.0f + metal::exp(-z)));
// Shift the conv window by one token. Each conv channel has one writer: Mamba's x channel c;
// for Mamba2 the first head of a KV group writes its x and B channels, every head its C.
for (int w = 0; w < 3; ++w) {
  const int j = w == 0 ? xj : (w == 1 ? DXB + kvh * N + o : 2 * DXB + head * N + o);
  if ((w == 0 && (!MAMBA2 || head % R == 0)) || (MAMBA2 && w == 1 && head % R == 0) || (MAMBA2 && w == 2)) {
    for (int k = 0; k < K - 2; ++k) {
      window_out[wb + k * WC + j] = window[wb + (k + 1) * WC + j];
    }
    window_out[wb + (K - 2) * WC + j] = u[ub + (MAMBA2 ? OX + j : xu)];
  }
}
