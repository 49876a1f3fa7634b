// One beam-search step's selection, Metal body for mx.fast.metal_kernel (MLX writes the
// signature). Line-for-line twin of beam_topk.cu: only the thread and block indices, the
// shared-memory, barrier and max spellings differ.
// Inputs logits (B, WC, V): the drafter's next-token logits after each of WC beams; scores
// (B, WC) float32: each beam's log-probability so far. A continuation (w, v) scores
// scores[w] + log_softmax(logits[w])[v]. Outputs origin, token (B, K) int32 and score (B, K)
// float32: the K best continuations over all beams, best first, ties to the lower w * V + v.
// Template T (logits' dtype), K (at most 16), TG (threads, a power of two). One threadgroup per
// sequence b: each beam's log-normalizer is a max and a sum of exponentials merged over the
// threads; each thread keeps its own sorted top K, and the lists are merged pairwise.
const int i = thread_position_in_threadgroup.x;
const int b = threadgroup_position_in_grid.x;
const int WC = logits_shape[1];
const int V = logits_shape[2];
const int base = b * WC * V;
const float lowest = -3.0e38f;  // below any logit; exp(lowest - x) is 0
threadgroup float red_m[TG];
threadgroup float red_s[TG];
threadgroup float lse[K];
threadgroup float top_v[TG * K];
threadgroup int top_i[TG * K];
for (int w = 0; w < WC; ++w) {
  float m = lowest;
  float s = 0.0f;
  for (int v = i; v < V; v += TG) {
    const float x = static_cast<float>(logits[base + w * V + v]);
    const float mx = metal::max(m, x);
    s = s * metal::exp(m - mx) + metal::exp(x - mx);
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
// This thread's best K, sorted; its candidates come in increasing w * V + v, so a strict
// comparison keeps the earlier of two equal scores.
float tv[K];
int ti[K];
for (int j = 0; j < K; ++j) {
  tv[j] = lowest;
  ti[j] = 2147483647;
}
for (int w = 0; w < WC; ++w) {
  for (int v = i; v < V; v += TG) {
    const float x = scores[b * WC + w] + (static_cast<float>(logits[base + w * V + v]) - lse[w]);
    if (x > tv[K - 1]) {
      int j = K - 1;
      while (j > 0 && x > tv[j - 1]) {
        tv[j] = tv[j - 1];
        ti[j] = ti[j - 1];
        --j;
      }
      tv[j] = x;
      ti[j] = w * V + v;
    }
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
