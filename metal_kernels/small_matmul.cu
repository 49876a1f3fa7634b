// Small matmul, CUDA body for mx.fast.cuda_kernel (MLX writes the signature).
// Line-for-line twin of small_matmul.metal: only the thread indices and the simdgroup sum differ.
// y = x @ w.T for a few rows (2 to 64: a verification pass's candidates, a drafter's beams). MLX
// runs such a product through a general matmul (cuBLAS on CUDA) whose launch costs two to three
// times a one-row product's, and a verification pass of a small model is launch-bound; this
// kernel is one plain launch, and its work is the one-row product's times the row count.
// Each simdgroup of 32 threads takes C consecutive output columns for all M rows: lane l reads
// elements [k, k+4) of those columns' weight rows and of every x row, for k = 4l, 4l + 128, ...,
// (coalesced), keeps M*C partial sums in registers, and sums each across the lanes at the end.
// Inputs x (..., K) with M rows in all, w (N, K), both row-major, K a multiple of 4; rows (1,)
// int32, M. Output y (..., N). Template: T, MT (M rounded up to a power of two, at least 4: a
// handful of compiled variants serve every row count), C (columns per simdgroup).
const int lane = threadIdx.x % 32;
const int col = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * C;
const int K = w_shape[1];
const int N = w_shape[0];
const int M = rows[0];
float acc[MT][C];
for (int m = 0; m < MT; ++m) {
  for (int c = 0; c < C; ++c) {
    acc[m][c] = 0.0f;
  }
}
for (int k = lane * 4; k < K; k += 128) {
  float wv[C][4];
  for (int c = 0; c < C; ++c) {
    const int64_t row = col + c < N ? (int64_t)(col + c) * K + k : -1;
    for (int e = 0; e < 4; ++e) {
      wv[c][e] = row >= 0 ? static_cast<float>(w[row + e]) : 0.0f;
    }
  }
  for (int m = 0; m < MT; ++m) {
    if (m >= M) {
      break;
    }
    float xv[4];
    for (int e = 0; e < 4; ++e) {
      xv[e] = static_cast<float>(x[(int64_t)m * K + k + e]);
    }
    for (int c = 0; c < C; ++c) {
      acc[m][c] += xv[0] * wv[c][0] + xv[1] * wv[c][1] + xv[2] * wv[c][2] + xv[3] * wv[c][3];
    }
  }
}
for (int m = 0; m < MT; ++m) {
  if (m >= M) {
    break;
  }
  for (int c = 0; c < C; ++c) {
    float s = acc[m][c];
    for (int o = 16; o > 0; o /= 2) { s += __shfl_xor_sync(0xffffffff, s, o); }
    if (lane == 0 && col + c < N) {
      y[(int64_t)m * N + col + c] = static_cast<T>(s);
    }
  }
}
