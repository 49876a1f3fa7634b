// A beam-search step's selection, part 1 of 2 (then beam_topk_merge), CUDA body for
// mx.fast.cuda_kernel (MLX writes the signature). Line-for-line twin of beam_topk_chunks.metal:
// only the thread and block indices, the shared-memory, barrier and max spellings differ.
// Inputs logits (B, WC, V): the drafter's next-token logits after each of WC beams. The logits of
// a beam are cut into chunks of TG * E; one threadgroup per (chunk, beam) returns the chunk's
// log-sum-exp parts (its max and its sum of exponentials below that max) and its K largest
// logits, largest first, ties to the lower v. Many threadgroups: one per sequence, as before,
// read 4 x 49152 logits a step with one SM and took about 1 ms; thread t reads elements
// t, t + TG, ... of its chunk (coalesced), all E before using any.
// Outputs part_m, part_s (B, WC, CH) float32; part_v (B, WC, CH, K) float32, part_i int32 (v,
// 2147483647 past the chunk's end). Template T (logits' dtype), K (at most 16), TG (threads, a
// power of two), E (logits per thread).
const int i = threadIdx.x;
const int c = blockIdx.x;
const int row = blockIdx.y;
const int V = logits_shape[2];
const int CH = (V + TG * E - 1) / (TG * E);
const int start = c * TG * E;
const float lowest = -3.0e38f;  // below any logit; exp(lowest - x) is 0
__shared__ float red_m[TG];
__shared__ float red_s[TG];
__shared__ float top_v[TG * K];
__shared__ int top_i[TG * K];
float xs[E];
for (int e = 0; e < E; ++e) {
  const int v = start + e * TG + i;
  xs[e] = v < V ? static_cast<float>(logits[(int64_t)row * V + v]) : lowest;
}
float m = lowest;
for (int e = 0; e < E; ++e) {
  m = fmaxf(m, xs[e]);
}
float s = 0.0f;
for (int e = 0; e < E; ++e) {
  s += start + e * TG + i < V ? expf(xs[e] - m) : 0.0f;
}
red_m[i] = m;
red_s[i] = s;
__syncthreads();
for (int h = TG / 2; h > 0; h /= 2) {
  if (i < h) {
    const float mx = fmaxf(red_m[i], red_m[i + h]);
    red_s[i] = red_s[i] * expf(red_m[i] - mx) + red_s[i + h] * expf(red_m[i + h] - mx);
    red_m[i] = mx;
  }
  __syncthreads();
}
// This thread's best K, sorted; its logits come in increasing v, so a strict comparison keeps
// the earlier of two equal ones.
float tv[K];
int ti[K];
for (int j = 0; j < K; ++j) {
  tv[j] = lowest;
  ti[j] = 2147483647;
}
for (int e = 0; e < E; ++e) {
  const int v = start + e * TG + i;
  if (v < V && xs[e] > tv[K - 1]) {
    int j = K - 1;
    while (j > 0 && xs[e] > tv[j - 1]) {
      tv[j] = tv[j - 1];
      ti[j] = ti[j - 1];
      --j;
    }
    tv[j] = xs[e];
    ti[j] = v;
  }
}
for (int j = 0; j < K; ++j) {
  top_v[i * K + j] = tv[j];
  top_i[i * K + j] = ti[j];
}
__syncthreads();
for (int h = TG / 2; h > 0; h /= 2) {
  if (i < h) {
    int a = i * K;
    int b = (i + h) * K;
    for (int j = 0; j < K; ++j) {
      const bool left = top_v[a] > top_v[b] || (top_v[a] == top_v[b] && top_i[a] < top_i[b]);
      tv[j] = left ? top_v[a] : top_v[b];
      ti[j] = left ? top_i[a] : top_i[b];
      a += left ? 1 : 0;
      b += left ? 0 : 1;
    }
    for (int j = 0; j < K; ++j) {
      top_v[i * K + j] = tv[j];
      top_i[i * K + j] = ti[j];
    }
  }
  __syncthreads();
}
if (i == 0) {
  part_m[row * CH + c] = red_m[0];
  part_s[row * CH + c] = red_s[0];
}
if (i < K) {
  part_v[(row * CH + c) * K + i] = top_v[i];
  part_i[(row * CH + c) * K + i] = top_i[i];
}
