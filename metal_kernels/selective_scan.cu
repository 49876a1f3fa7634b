// Selective scan, CUDA body for mx.fast.cuda_kernel (MLX writes the signature around it).
// Line-for-line twin of selective_scan.metal: only the thread index and exp lines differ.
// Inputs x, dt, A, B, C, D, state, save; outputs y, states; template T, Tdt, Tbc, N, NA.
// One thread per (batch b, channel c) keeps its state column h[0..N) in registers and walks
// the L tokens in order; neighbouring threads touch neighbouring channels, so every state
// read and write is coalesced. save holds S ascending positions whose states are written.
const int c = blockIdx.x * blockDim.x + threadIdx.x;
const int b = blockIdx.y * blockDim.y + threadIdx.y;
const int batch = x_shape[0];
const int L = x_shape[1];
const int channels = x_shape[2];
const int groups = B_shape[2];
const int S = save_shape[0];
if (c >= channels || b >= batch) {
  return;
}
const int g = c / (channels / groups);
float h[N];
#pragma unroll
for (int n = 0; n < N; ++n) {
  h[n] = state[(b * N + n) * channels + c];
}
const float Dc = D[c];
int s = 0;
for (int t = 0; t < L; ++t) {
  const int xi = (b * L + t) * channels + c;
  const int bi = ((b * L + t) * groups + g) * N;
  const float xt = static_cast<float>(x[xi]);
  const float dtt = static_cast<float>(dt[xi]);
  float dA = expf(dtt * A[c]);  // NA == 1: one decay for the whole column
  float yt = 0.0f;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    if (NA != 1) {  // a decay per state row; NA is a template constant
      dA = expf(dtt * A[n * channels + c]);
    }
    h[n] = dA * h[n] + dtt * static_cast<float>(B[bi + n]) * xt;
    yt += static_cast<float>(C[bi + n]) * h[n];
  }
  y[xi] = static_cast<T>(yt + Dc * xt);
  if (s < S && t == save[s]) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      states[((b * S + s) * N + n) * channels + c] = h[n];
    }
    ++s;
  }
}
