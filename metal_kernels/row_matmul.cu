// Products of a few rows with a weight, CUDA body for mx.fast.cuda_kernel (MLX writes the
// signature). Line-for-line twin of row_matmul.metal: only the thread indices and the
// simdgroup shuffle differ.
// y = x w^T for the M rows of a verification pass, the weight read once: MLX's batched
// matrix-vector kernel re-reads it for every row, and its other path for more than one row,
// cuBLASLt, costs 11-19 us of host time a call (mlx_hybrid/models/linear.py).
// Threadgroup g takes the C weight rows n = g*C.., which its NW simdgroups read from the cache
// after the first, and simdgroup s of it the MW input rows m = s*MW... Each (row, weight row)
// sum is formed as MLX's matrix-vector kernel forms a decode step's: lane l adds the products
// of elements [l*NPT + i*32*NPT, +NPT) in order, in float32, and the 32 lanes' sums are added
// pairwise across lane distances 16, 8, 4, 2, 1, so a node's projection equals the decode
// step's bit for bit.
// Inputs x (M, K), w (N, K), both row-major. Output y (M, N). Template: T, M, N, K, NPT (MLX's
// elements a load: 4 where 128 divides K, 2 where 64 does, else 1), C, NW, MW (= ceil(M / NW)).
const int lane = threadIdx.x % 32;
const int m0 = threadIdx.x / 32 * MW;
const int n0 = blockIdx.x * C;
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
      const float xv = static_cast<float>(x[(m0 + m) * K + col + i]);
      for (int c = 0; c < C; ++c) {
        acc[m][c] += wv[c][i] * xv;
      }
    }
  }
}
for (int m = 0; m < MW; ++m) {
  for (int c = 0; c < C; ++c) {
    for (int o = 16; o > 0; o /= 2) {
      acc[m][c] += __shfl_xor_sync(0xffffffff, acc[m][c], o);
    }
    if ((m * C + c) % 32 == lane && m0 + m < M && n0 + c < N) {
      y[(m0 + m) * N + n0 + c] = static_cast<T>(acc[m][c]);
    }
  }
}
