// Prefix de-duplication of equal-length beams into one candidate tree (ReDrafter appendix A.1),
// Metal body for mx.fast.metal_kernel (MLX writes the signature). Line-for-line twin of
// pack_beams.cu: only the thread index, shared-memory and barrier spellings differ.
// Input beams (BW, BL) int32. Two beam positions (b, l) and (c, l) are one node when the beams
// agree on tokens 0..l; nodes are numbered in beam-major order of their first position.
// Outputs tokens, parents, depths (TN): the nodes' last tokens, parents (-1 for the cache) and
// depths, then padding (token 0, parent -1, depth 0) up to TN = BW * (BL - 1) + 1; mask (TN, TN)
// bool: node s is node t or an ancestor of it; node_of (BW, BL): the node of each beam position;
// count (): the number of nodes before the padding. Template BW, BL, TN.
// One threadgroup of BW * BL threads, thread p owning position (b, l) = (p / BL, p % BL); every
// output element has one writer, and threads share only threadgroup memory.
const int p = thread_position_in_threadgroup.x;
const int b = p / BL;
const int l = p - b * BL;
threadgroup int isnew[BW * BL];
threadgroup int nodes[BW * BL];
threadgroup int tok[TN];
threadgroup int par[TN];
threadgroup int dep[TN];
// The first beam whose tokens 0..l are beam b's.
int f = b;
for (int c = 0; c < b && f == b; ++c) {
  bool same = true;
  for (int k = 0; k <= l && same; ++k) {
    same = beams[c * BL + k] == beams[b * BL + k];
  }
  if (same) {
    f = c;
  }
}
isnew[p] = f == b ? 1 : 0;
if (p < TN) {
  tok[p] = 0;
  par[p] = -1;
  dep[p] = 0;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
int number = 0;
for (int q = 0; q < p; ++q) {
  number += isnew[q];
}
if (f == b) {
  nodes[p] = number;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
// Position (f, l) opens its node: beam f is the first to share its own prefix.
const int node = nodes[f * BL + l];
threadgroup_barrier(mem_flags::mem_threadgroup);
nodes[p] = node;
node_of[p] = node;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (f == b) {
  tok[node] = beams[p];
  par[node] = l == 0 ? -1 : nodes[p - 1];
  dep[node] = l;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (p < TN) {
  tokens[p] = tok[p];
  parents[p] = par[p];
  depths[p] = dep[p];
  for (int s = 0; s < TN; ++s) {
    mask[p * TN + s] = false;
  }
  for (int a = p; a >= 0; a = par[a]) {
    mask[p * TN + a] = true;
  }
}
if (p == 0) {
  int n = 0;
  for (int q = 0; q < BW * BL; ++q) {
    n += isnew[q];
  }
  count[0] = n;
}
