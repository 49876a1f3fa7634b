// Products of a few rows with a weight, Metal body for mx.fast.metal_kernel (MLX writes the
// signature). Line-for-line twin of row_matmul.cu: only the thread indices, the simdgroup
// shuffle and the exp/rsqrt lines differ.
// y = x w^T for the M rows of a verification pass, the weight read once: MLX's batched
// matrix-vector kernel re-reads it for every row, and its other path for more than one row,
// cuBLASLt, costs 11-19 us of host time a call (mlx_hybrid/models/linear.py).
// Threadgroup g takes the C weight rows n = g*C.., which its NW simdgroups read from the cache
// after the first, and simdgroup s of it the MW input rows m = s*MW... Each (row, weight row)
// sum is formed as MLX's matrix-vector kernel forms a decode step's: lane l adds the products
// of elements [l*NPT + i*32*NPT, +NPT) in order, in float32, and the 32 lanes' sums are added
// pairwise across lane distances 16, 8, 4, 2, 1, so a node's projection equals the decode
// step's bit for bit.
// The ops around a projection in a decoder layer can come inside the same launch (a pass is
// bound by the host's time a launch): NORM, the RMSNorm before it (weight nw, eps EPS), each
// row's sum of squares formed by every simdgroup that takes the row; GATE, SwiGLU before it
// (x holds the gate's K columns, then the up's); RES, the residual r added after it. Each is
// rounded to T where MLX's own op rounds, but NORM's sum of squares is formed in another order
// than MLX's RMSNorm forms it, so a normalized row may differ from MLX's in the last bit.
// Inputs x (M, K or 2K with GATE), w (N, K), nw (K), r (M, N), all row-major (an input a flag
// leaves out is not read). Output y (M, N). Template: T, N, K, NPT (MLX's elements a load: 4
// where 128 divides K, 2 where 64 does, else 1), C, NW, MW (= ceil(M / NW)), NORM, GATE, RES (0
// or 1), EPS (the norm's eps as float32 bits: an array of one element would sit in host memory
// on MLX's CUDA backend, mlx_hybrid/kernels.py). M, the rows, comes from x's shape, not the template: MLX builds a kernel once a
// template (an NVRTC compile on CUDA), so a template by M was built again for each new count of
// rows (a chat turn's new tokens, the tokens a draft model re-reads); one by MW builds at most NW
// times a weight shape.
const int lane = thread_position_in_threadgroup.x % 32;
const int m0 = thread_position_in_threadgroup.x / 32 * MW;
const int n0 = threadgroup_position_in_grid.x * C;
const int M = x_shape[0];
const int XK = GATE ? 2 * K : K;
float inv[MW];
for (int m = 0; m < MW; ++m) {
  float ss = 0.0f;
  if (NORM && m0 + m < M) {
    for (int col = lane; col < K; col += 32) {
      const float v = static_cast<float>(x[(m0 + m) * XK + col]);
      ss += v * v;
    }
    for (int o = 16; o > 0; o /= 2) {
      ss += simd_shuffle_xor(ss, static_cast<ushort>(o));
    }
  }
  inv[m] = NORM ? metal::rsqrt(ss / K + as_type<float>(EPS)) : 1.0f;
}
float acc[MW][C];
for (int m = 0; m < MW; ++m) {
  for (int c = 0; c < C; ++c) {
    acc[m][c] = 0.0f;
  }
}
for (int col = NPT * lane; col < K; col += 32 * NPT) {
  float wv[C][NPT];
  for (int c = 0; c < C; ++c) {
    for (int i = 0; i < NPT; ++i) {
      wv[c][i] = n0 + c < N ? static_cast<float>(w[(n0 + c) * K + col + i]) : 0.0f;
    }
  }
  for (int m = 0; m < MW && m0 + m < M; ++m) {
    for (int i = 0; i < NPT; ++i) {
      float xv = static_cast<float>(x[(m0 + m) * XK + col + i]);
      if (GATE) {
        const float sg = static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-xv))));
        const float up = static_cast<float>(x[(m0 + m) * XK + K + col + i]);
        xv = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(xv * sg)) * up));
      }
      if (NORM) {
        xv = static_cast<float>(static_cast<T>(static_cast<float>(nw[col + i]) * static_cast<float>(static_cast<T>(xv * inv[m]))));
      }
      for (int c = 0; c < C; ++c) {
        acc[m][c] += wv[c][i] * xv;
      }
    }
  }
}
for (int m = 0; m < MW; ++m) {
  for (int c = 0; c < C; ++c) {
    for (int o = 16; o > 0; o /= 2) {
      acc[m][c] += simd_shuffle_xor(acc[m][c], static_cast<ushort>(o));
    }
    if ((m * C + c) % 32 == lane && m0 + m < M && n0 + c < N) {
      const int at = (m0 + m) * N + n0 + c;
      const float out = static_cast<float>(static_cast<T>(acc[m][c]));
      y[at] = static_cast<T>(RES ? static_cast<float>(r[at]) + out : out);
    }
  }
}
