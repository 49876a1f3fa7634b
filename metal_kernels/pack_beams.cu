// Prefix de-duplication of equal-length beams into one candidate tree (ReDrafter appendix A.1),
// CUDA body for mx.fast.cuda_kernel (MLX writes the signature). Line-for-line twin of
// pack_beams.metal: only the thread index, shared-memory and barrier spellings differ.
// Input beams (BW, BL) int32. Two beam positions (b, l) and (c, l) are one node when the beams
// agree on tokens 0..l; nodes are numbered in beam-major order of their first position.
// Outputs tokens, parents, depths (TN): the nodes' last tokens, parents (-1 for the cache) and
// depths, then padding (token 0, parent -1, depth 0) up to TN = BW * (BL - 1) + 1; mask (TN, TN)
// bool: node s is node t or an ancestor of it; node_of (BW, BL): the node of each beam position;
// count (): the number of nodes before the padding. Template BW, BL, TN.
// One threadgroup of BW * BL threads, thread p owning position (b, l) = (p / BL, p % BL); every
// output element has one writer, and threads share only threadgroup memory.
const int p = threadIdx.x;
const int b = p / BL;
const int l = p - b * BL;
__shared__ int isnew[BW * BL];
__shared__ int nodes[BW * BL];
__shared__ int tok[TN];
__shared__ int par[TN];
__shared__ int dep[TN];
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
__syncthreads();
int number = 0;
for (int q = 0; q < p; ++q) {
  number += isnew[q];
}
if (f == b) {
  nodes[p] = number;
}
__syncthreads();
// Position (f, l) opens its node: beam f is the first to share its own prefix.
const int node = nodes[f * BL + l];
__syncthreads();
nodes[p] = node;
node_of[p] = node;
__syncthreads();
if (f == b) {
  tok[node] = beams[p];
  par[node] = l == 0 ? -1 : nodes[p - 1];
  dep[node] = l;
}
__syncthreads();
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
