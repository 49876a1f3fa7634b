// Small quantized matmul, Metal body for mx.fast.metal_kernel (MLX writes the signature).
// Line-for-line twin of small_qmatmul.cu: only the thread indices and the simdgroup sum differ.
// small_matmul.cu for MLX's affine-quantized weights (`mx.quantize`): a weight is
// scale * q + bias, q the BITS-bit field at bit (k * BITS) of its row's packed words, scale and
// bias its group's (GS consecutive k). Lane l dequantizes elements [k, k+8) of its C columns, for
// k = 8l, 8l + 256, ... (8 | GS, so they share a group), and sums as small_matmul does.
// Inputs x (..., K) with M rows in all, w (N, K * BITS / 32) uint32, scales, biases (N, K / GS),
// all row-major, with BITS dividing 32 and K a multiple of GS; rows (1,) int32, M. Output y
// (..., N). Template: T, MT, C as small_matmul's, BITS, GS.
const int lane = thread_position_in_threadgroup.x % 32;
const int col = thread_position_in_grid.x / 32 * C;
const int K = scales_shape[1] * GS;
const int N = scales_shape[0];
const int words = K * BITS / 32;
const int groups = K / GS;
const int M = rows[0];
float acc[MT][C];
for (int m = 0; m < MT; ++m) {
  for (int c = 0; c < C; ++c) {
    acc[m][c] = 0.0f;
  }
}
for (int k = lane * 8; k < K; k += 256) {
  float wv[C][8];
  for (int c = 0; c < C; ++c) {
    const bool real = col + c < N;
    const int64_t n = real ? col + c : 0;
    const float s = real ? static_cast<float>(scales[n * groups + k / GS]) : 0.0f;
    const float b = real ? static_cast<float>(biases[n * groups + k / GS]) : 0.0f;
    for (int e = 0; e < 8; ++e) {
      const int bit = (k + e) * BITS;
      const uint32_t word = w[n * words + bit / 32];
      wv[c][e] = s * static_cast<float>((word >> (bit % 32)) & ((1u << BITS) - 1u)) + b;
    }
  }
  for (int m = 0; m < MT; ++m) {
    if (m >= M) {
      break;
    }
    float xv[8];
    for (int e = 0; e < 8; ++e) {
      xv[e] = static_cast<float>(x[(int64_t)m * K + k + e]);
    }
    for (int c = 0; c < C; ++c) {
      float d = 0.0f;
      for (int e = 0; e < 8; ++e) {
        d += xv[e] * wv[c][e];
      }
      acc[m][c] += d;
    }
  }
}
for (int m = 0; m < MT; ++m) {
  if (m >= M) {
    break;
  }
  for (int c = 0; c < C; ++c) {
    float s = acc[m][c];
    s = simd_sum(s);
    if (lane == 0 && col + c < N) {
      y[(int64_t)m * N + col + c] = static_cast<T>(s);
    }
  }
}
