// A beam-search step's selection, part 2 of 2 (after beam_topk_chunks), Metal body for
// mx.fast.metal_kernel (MLX writes the signature). Line-for-line twin of beam_topk_merge.cu:
// only the thread and block indices, the shared-memory, barrier and max spellings differ.
// Inputs part_m, part_s (B, WC, CH), part_v, part_i (B, WC, CH, K): beam_topk_chunks' outputs;
// scores (B, WC) float32, each beam's log-probability so far. Beam w's log-normalizer merges its
// chunks' parts; a chunk candidate (w, v) with logit x scores scores[w] + (x - lse[w]), which
// grows with x, so the K best continuations over all beams are among the chunks' best K logits.
// Outputs origin, token (B, K) int32 and score (B, K) float32, best first, ties to the lower
// w * V + v. Template K (at most 16, and WC <= K), TG (threads, a power of two), V.
// One threadgroup per sequence b; each thread keeps its own sorted top K, merged pairwise.
const int i = thread_position_in_threadgroup.x;
const int b = threadgroup_position_in_grid.x;
const int WC = part_m_shape[1];
const int CH = part_m_shape[2];
const float lowest = -3.0e38f;
threadgroup float red_m[TG];
threadgroup float red_s[TG];
threadgroup float lse[K];
threadgroup float top_v[TG * K];
threadgroup int top_i[TG * K];
for (int w = 0; w < WC; ++w) {
  float m = lowest;
  float s = 0.0f;
  for (int c = i; c < CH; c += TG) {
    const float pm = part_m[(b * WC + w) * CH + c];
    const float mx = metal::max(m, pm);
    s = s * metal::exp(m - mx) + part_s[(b * WC + w) * CH + c] * metal::exp(pm - mx);
    m = mx;
  }
  red_m[i] = m;
  red_s[i] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int h = TG / 2; h > 0; h /= 2) {
    if (i < h) {
      const float mx = metal::max(red_m[i], red_m[i + h]);
      red_s[i] = red_s[i] * metal::exp(red_m[i] - mx) + red_s[i + h] * metal::exp(red_m[i + h] - mx);
      red_m[i] = mx;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (i == 0) {
    lse[w] = red_m[0] + metal::log(red_s[0]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
float tv[K];
int ti[K];
for (int j = 0; j < K; ++j) {
  tv[j] = lowest;
  ti[j] = 2147483647;
}
for (int n = i; n < WC * CH * K; n += TG) {
  const int w = n / (CH * K);
  const int v = part_i[b * WC * CH * K + n];
  const float x = scores[b * WC + w] + (part_v[b * WC * CH * K + n] - lse[w]);
  const int id = v < V ? w * V + v : 2147483647;
  if (v < V && (x > tv[K - 1] || (x == tv[K - 1] && id < ti[K - 1]))) {
    int j = K - 1;
    while (j > 0 && (x > tv[j - 1] || (x == tv[j - 1] && id < ti[j - 1]))) {
      tv[j] = tv[j - 1];
      ti[j] = ti[j - 1];
      --j;
    }
    tv[j] = x;
    ti[j] = id;
  }
}
for (int j = 0; j < K; ++j) {
  top_v[i * K + j] = tv[j];
  top_i[i * K + j] = ti[j];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int h = TG / 2; h > 0; h /= 2) {
  if (i < h) {
    int a = i * K;
    int c = (i + h) * K;
    for (int j = 0; j < K; ++j) {
      const bool left = top_v[a] > top_v[c] || (top_v[a] == top_v[c] && top_i[a] < top_i[c]);
      tv[j] = left ? top_v[a] : top_v[c];
      ti[j] = left ? top_i[a] : top_i[c];
      a += left ? 1 : 0;
      c += left ? 0 : 1;
    }
    for (int j = 0; j < K; ++j) {
      top_v[i * K + j] = tv[j];
      top_i[i * K + j] = ti[j];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (i < K) {
  const int id = top_i[i];
  origin[b * K + i] = id / V;
  token[b * K + i] = id - (id / V) * V;
  score[b * K + i] = top_v[i];
}
