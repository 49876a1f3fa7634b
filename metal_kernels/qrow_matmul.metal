// Products of a few rows with an affine-quantized weight, Metal body for mx.fast.metal_kernel (MLX
// writes the signature). Line-for-line twin of qrow_matmul.cu: only the thread indices and the
// simdgroup shuffle differ.
// y = x dequantize(w)^T for the M rows of a verification pass, each packed word read once for all
// of them: MLX's quantized product over a few rows on CUDA is its matrix-vector kernel once a row
// (each row re-reads the weight) or a tiled kernel built for many rows
// (mlx_hybrid/models/qlinear.py).
// MLX's affine format: row n of w packs K elements of BITS bits (4 or 8), EPW = 32 / BITS a
// uint32 word, element e of a word in bits [e*BITS, (e+1)*BITS); each group of GS consecutive
// elements of a row has a scale s and a bias b (scales, biases: (N, K / GS)), and an element is
// s * q + b.
// Threadgroup g takes the C weight rows n = g*C.., which its NW simdgroups read from the cache
// after the first, and simdgroup s of it the MW input rows m = s*MW... Lane l reads the 4 words
// [4l + 128i, +4) of each weight row in turn (4 words hold 16 or 32 elements, within one group,
// so one scale and bias serve them), dequantizes them in float32 and adds their products with
// each of its rows in float32, element by element; the 32 lanes' sums are added pairwise across
// lane distances 16, 8, 4, 2, 1 and rounded once to T. A row's sums are formed in the same order
// whatever the other rows, and in float32 from the float32 dequantization of the weight, so they
// are qrow_matmul_ref's to float32 rounding; they are not MLX's decode step's bit for bit (the
// module says why).
// Inputs x (M, K), w (N, K / EPW) uint32, scales (N, K / GS), biases (N, K / GS), all row-major.
// Output y (M, N). Template: T (x's, scales' and biases' type), N, K, GS, BITS, C, NW, MW
// (= ceil(M / NW)); M comes from x's shape, so a build serves every row count of a warp share.
const int lane = thread_position_in_threadgroup.x % 32;
const int m0 = thread_position_in_threadgroup.x / 32 * MW;
const int n0 = threadgroup_position_in_grid.x * C;
const int M = x_shape[0];
constexpr int EPW = 32 / BITS;
constexpr int KW = K / EPW;
const uint32_t mask = (1u << BITS) - 1u;
float acc[MW][C];
for (int m = 0; m < MW; ++m) {
  for (int c = 0; c < C; ++c) {
    acc[m][c] = 0.0f;
  }
}
for (int word = 4 * lane; word < KW; word += 128) {
  float s[C];
  float b[C];
  for (int c = 0; c < C; ++c) {
    const int g = n0 + c < N ? (n0 + c) * (K / GS) + word * EPW / GS : 0;
    s[c] = n0 + c < N ? static_cast<float>(scales[g]) : 0.0f;
    b[c] = n0 + c < N ? static_cast<float>(biases[g]) : 0.0f;
  }
  for (int j = 0; j < 4; ++j) {
    float wv[C][EPW];
    for (int c = 0; c < C; ++c) {
      const uint32_t packed = n0 + c < N ? static_cast<uint32_t>(w[(n0 + c) * KW + word + j]) : 0u;
      for (int e = 0; e < EPW; ++e) {
        wv[c][e] = s[c] * static_cast<float>((packed >> (BITS * e)) & mask) + b[c];
      }
    }
    for (int m = 0; m < MW && m0 + m < M; ++m) {
      for (int e = 0; e < EPW; ++e) {
        const float xv = static_cast<float>(x[(m0 + m) * K + (word + j) * EPW + e]);
        for (int c = 0; c < C; ++c) {
          acc[m][c] += wv[c][e] * xv;
        }
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
      y[(m0 + m) * N + n0 + c] = static_cast<T>(acc[m][c]);
    }
  }
}
